# Shared by the peer set-up scripts (sourced, not run): where things live, and the model every peer loads.
# Everything a peer installs goes under .peers/ (git-ignored), never into the project's .venv.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEERS="$ROOT/.peers"
CONVEYOR="$ROOT/.venv/bin/conveyor"
PROJECT_PYTHON="$ROOT/.venv/bin/python"
# The peers' own virtual environments start from the interpreter that built the project's .venv.
BASE_PYTHON="${PYTHON:-$(readlink -f "$PROJECT_PYTHON")}"
mkdir -p "$PEERS"

# The default model as a Hugging Face folder (float32 safetensors + tokenizer): what OpenVINO and vLLM load.
hf_model() {
    if [ ! -f "$PEERS/model/config.json" ]; then
        test -x "$CONVEYOR" || { echo "run 'make install' first" >&2; exit 1; }
        "$CONVEYOR" export-hf "$PEERS/model" >&2
    fi
    echo "$PEERS/model"
}

# A fresh virtual environment for one peer: $PEERS/NAME.
new_venv() {
    rm -rf "$PEERS/$1"
    "$BASE_PYTHON" -m venv "$PEERS/$1"
    "$PEERS/$1/bin/pip" install --quiet --upgrade pip
}
