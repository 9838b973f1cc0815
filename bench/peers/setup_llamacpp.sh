#!/usr/bin/env bash
# llama.cpp's llama-server, built from the llama.cpp source that the llama-cpp-python sdist vendors
# (PyPI is the one source reachable here), and an F32 GGUF of the default model's weights.
# Takes 10-20 minutes on a 2-core machine. Result: .peers/llama.cpp/{build/bin/llama-server, model-f32.gguf,
# model-q8_0.gguf}; the default model's own Q4_1 file is run where it lies (run_llamacpp.py --gguf q4_1).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
VERSION=0.3.36
DIR="$PEERS/llama.cpp"
mkdir -p "$DIR"

if [ ! -d "$DIR/src" ]; then
    "$BASE_PYTHON" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DIR/sdist"
    mkdir -p "$DIR/src.tmp"
    tar -xzf "$DIR/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$DIR/src.tmp" --strip-components=1
    mv "$DIR/src.tmp" "$DIR/src"
fi

cmake -S "$DIR/src/vendor/llama.cpp" -B "$DIR/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TESTS=OFF
cmake --build "$DIR/build" --target llama-server llama-quantize llama-batched-bench llama-perplexity -j "$(nproc)"

# The same weights every other engine gets: the shipped Q4_1 file dequantized to float32.
Q4_1="$("$PROJECT_PYTHON" -c 'from conveyor.model.weights.paths import default_model_path; print(default_model_path())')"
if [ ! -f "$DIR/model-f32.gguf" ]; then
    "$DIR/build/bin/llama-quantize" --allow-requantize "$Q4_1" "$DIR/model-f32.gguf.tmp" F32
    mv "$DIR/model-f32.gguf.tmp" "$DIR/model-f32.gguf"
fi
# The same weights requantized by llama.cpp itself to Q8_0 (from the Q4_1 file, as a user would): the 8-bit case.
if [ ! -f "$DIR/model-q8_0.gguf" ]; then
    "$DIR/build/bin/llama-quantize" --allow-requantize "$Q4_1" "$DIR/model-q8_0.gguf.tmp" Q8_0
    mv "$DIR/model-q8_0.gguf.tmp" "$DIR/model-q8_0.gguf"
fi
echo "llama.cpp ready: $DIR/build/bin/llama-server, $DIR/model-f32.gguf, $DIR/model-q8_0.gguf"
