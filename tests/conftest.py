"""Shared fixtures: the default model's folder, a tiny random Llama that shares its tokenizer, a server of it
with the official client (``server``, ``client``: test_server and test_replicas define their own), and the
offline engine a server's answers are compared with (``offline``).

The tiny model is what most engine tests run on: it exercises every code path
of the real one (GQA, RoPE, paged attention, chunked prefill, preemption) in
milliseconds per step, and transformers builds the same network from the
same weights as the reference.
"""

from __future__ import annotations

import gc
import os
import shutil
from pathlib import Path

import pytest

from conveyor.model.native.kernels import WIDTH_FEATURES, native_kernels


def _one_ssl_context_for_every_client() -> None:
    """httpx builds a new SSL context for every client (certifi's bundle read: 36 ms of CPU), and the tests make
    thousands on loopback: each httpx.get, each official client, each /health poll while a server starts. One
    context, built once, serves them all (a context may be shared; none of these speaks TLS)."""
    import functools

    import httpx._transports.default as transports

    build = transports.create_ssl_context

    @functools.lru_cache(maxsize=1)
    def default_context():
        return build()

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if verify is True and cert is None and trust_env:
            return default_context()
        return build(verify=verify, cert=cert, trust_env=trust_env)

    transports.create_ssl_context = create_ssl_context


_one_ssl_context_for_every_client()

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

TINY_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=49152,
    max_position_embeddings=1024,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    eos_token_id=2,
    bos_token_id=1,
)

# The files that take longest (seconds to tens of seconds each on 2 cores: real weights against transformers,
# servers started and stopped, fuzzing, the short soak, Ray), longest first, as measured (2-core Zen 4, 2026-12-05):
# `make test` hands whole files to two workers in this order (--no-loadscope-reorder: pytest-xdist would otherwise
# order files by how many tests they hold), and the rest, each a few seconds at most, come after them, so that no
# long file is left to one worker at the end while the other waits.
LONGEST_FIRST = (
    "test_gemma3.py", "test_speculative.py", "test_quantized.py", "test_correctness.py", "test_hostile_input.py",
    "test_replicas.py", "test_soak.py", "test_server.py", "test_structured_output.py", "test_grammar_bombs.py",
    "test_auto_tool_choice.py", "test_reasoning.py", "test_replica_exposure.py", "test_chat_page.py",
    "test_low_bit_formats.py", "test_dashboard.py", "test_policy_properties.py", "test_batch_invariance_property.py",
    "test_families.py", "test_docs_examples.py", "test_kernel_library.py", "test_compare.py", "test_rope_scaling.py",
    "test_ollama_api.py", "test_gguf.py", "test_sim_calibrate.py", "test_responsiveness.py", "test_roofline.py",
    "test_faults.py", "test_moe.py", "test_load_shedding_server.py", "test_api_fuzz.py", "test_fuzz_bodies.py",
    "test_sampling.py", "test_sim_fast_forward.py", "test_sim_goodput.py", "test_several_models.py",
    "test_server_sampling.py", "test_kernels.py", "test_server_limits.py",
)


# The garbage collector, tuned for a run that builds engines, tokenizers and GGUF readers by the hundred: a young
# collection every 10,000 allocations rather than 700, so that full collections (each walking every tracked object,
# 0.1-0.4 s) come about a tenth as often: 49 of them, 7.0 s, in test_gemma3 and test_low_bit_formats, against 6 and
# 2.6 s (2-core Zen 4). Garbage in cycles lives a little longer; nothing else changes.
gc.set_threshold(10_000, 10, 10)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """At the end of each file, once its fixtures are torn down: its garbage collected, then what outlives it
    (imported modules, caches, the session's fixtures) frozen out of the collector's way. Python's full
    collection walks every tracked object; a worker holds 1.2-1.7 million of them by its last files (torch,
    transformers, tokenizers, hypothesis), and its 50-60 full collections took 16-26 s of each worker's run, 6-15
    s with this. A collection here walks only what the file left."""
    yield
    if nextitem is None or nextitem.path != item.path:
        gc.collect()
        gc.freeze()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model as a HF folder of float32 weights (dequantized from its GGUF file once, then cached):
    what transformers loads as the reference."""
    from conveyor.model.weights.loader import float32_folder

    return float32_folder(None)


def write_tiny_llama(folder: Path, seed: int, tokenizer_from: Path) -> Path:
    """A tiny random Llama (TINY_CONFIG, weights from ``seed``) with the tokenizer of ``tokenizer_from``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**TINY_CONFIG)).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), 0, default_model_dir)


@pytest.fixture(scope="session")
def server(tiny_model_dir: Path):
    """A real ``conveyor serve`` of the tiny model, served as "tiny", no API key: its base URL. One for the whole
    run (each start costs seconds of loading): the modules that share it only send requests, and assert
    nothing of the server's counters."""
    from tests.serving import running_server

    with running_server(tiny_model_dir, "--num-kv-blocks", "1024", "--served-model-name", "tiny") as running:
        yield running.base


@pytest.fixture(scope="session")
def client(server: str):
    from tests.serving import openai_client

    return openai_client(server)


@pytest.fixture(scope="session")
def offline(tiny_model_dir: Path):
    """The tiny model offline, with the servers' pool size: what a server's greedy answers must equal."""
    from conveyor import LLM

    return LLM(str(tiny_model_dir), num_kv_blocks=1024)


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_model_dir: Path):
    """transformers' own LlamaForCausalLM on the tiny weights: the reference."""
    import torch
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


# The native kernels, and each vector width the CPU can run (test_kernels, test_native_stack, test_bf16).
@pytest.fixture(scope="module")
def kernels():
    module = native_kernels()
    assert module is not None, "the native kernels should build on the test machine (needs a C++ compiler)"
    return module


@pytest.fixture(params=sorted(WIDTH_FEATURES), ids=lambda width: f"{width}bit")
def width(request, kernels) -> int:
    """Each vector width in turn; one this CPU cannot run is skipped, naming the feature it lacks."""
    if request.param not in kernels.kernel_widths():
        pytest.skip(f"CPU lacks {WIDTH_FEATURES[request.param]}: no {request.param}-bit kernels to check")
    return request.param


@pytest.fixture
def machine_cache(tmp_path, monkeypatch):
    """The simulator's files (machine figures, profiles) in tmp_path; cpu-local measured as 2e10 B/s, 1e11 FLOP/s,
    whether or not this machine was ever measured."""
    import json

    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path))
    (tmp_path / "machine.json").write_text(json.dumps({
        "memory_bandwidth": 2e10, "gemm_flops": 1e11, "dtype": "float32", "threads": 2, "cpu": "test",
        "measured_at": "now"}))
    return tmp_path
