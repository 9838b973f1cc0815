#!/usr/bin/env bash
# OpenVINO GenAI in its own virtual environment (.peers/openvino), and the default model exported to
# OpenVINO IR with float32 weights (.peers/openvino/model), and with int8 and int4 weights (model-int8,
# model-int4: OpenVINO's own weight compression, what its users run on a CPU).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
MODEL="$(hf_model)"
VENV="$PEERS/openvino"

new_venv openvino
"$VENV/bin/pip" install --quiet torch==2.13.0 "optimum-intel[openvino]" openvino-genai openvino-tokenizers
# The torchvision wheel from PyPI is built for another torch and breaks imports beside the local CPU torch.
"$VENV/bin/pip" uninstall --quiet -y torchvision || true

"$VENV/bin/optimum-cli" export openvino --model "$MODEL" --weight-format fp32 --task text-generation-with-past \
    "$VENV/model.tmp"
rm -rf "$VENV/model" && mv "$VENV/model.tmp" "$VENV/model"
# int4 in groups of 64 inputs: OpenVINO's default of 128 does not divide this model's 576.
for bits in int8 int4; do
    "$VENV/bin/optimum-cli" export openvino --model "$MODEL" --weight-format "$bits" \
        $([ "$bits" = int4 ] && echo --group-size 64) --task text-generation-with-past "$VENV/model-$bits.tmp"
    rm -rf "$VENV/model-$bits" && mv "$VENV/model-$bits.tmp" "$VENV/model-$bits"
done
echo "OpenVINO GenAI ready: $VENV"
