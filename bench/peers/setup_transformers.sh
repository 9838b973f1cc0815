#!/usr/bin/env bash
# transformers runs in the project's own .venv; it needs only the model as a HF folder (.peers/model).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
echo "transformers ready: $(hf_model)"
