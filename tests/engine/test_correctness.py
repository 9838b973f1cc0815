"""Greedy output equals transformers' ``generate`` token for token, on the same weights.

The tiny random Llama covers the shapes that break paged attention: prompts
of 1 to 300 tokens, block sizes 1 and 16, prompts chunked by a small token
budget, batches of mixed lengths, and preemption forced by a tiny pool, with
the native kernels (the default) and with plain PyTorch ops. The
real default model covers real weights and the GGUF conversion.
"""

from __future__ import annotations

import random

import pytest

from conveyor import LLM, SamplingParams
from tests.harness import hf_greedy

GREEDY_16 = SamplingParams(temperature=0.0, max_tokens=16)


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def references(tiny_hf_model):
    """transformers' greedy tokens, computed once per prompt."""
    cache: dict[tuple[int, ...], list[int]] = {}

    def reference(prompt: list[int], max_tokens: int = 16) -> list[int]:
        key = (*prompt, -max_tokens)
        if key not in cache:
            cache[key] = hf_greedy(tiny_hf_model, prompt, max_tokens)
        return cache[key]

    return reference


LENGTHS = [1, 2, 7, 15, 16, 17, 33, 64, 100, 129, 250, 300]


@pytest.mark.parametrize(
    "options",
    [
        dict(block_size=16),
        dict(block_size=1),
        dict(block_size=16, max_num_batched_tokens=37),  # prompts chunked across steps
        dict(block_size=1, max_num_batched_tokens=5),
        dict(block_size=4, num_kv_blocks=96, max_num_batched_tokens=64),  # preemption by a tiny pool
        dict(block_size=16, kernels="torch"),  # the plain PyTorch path (the default is the native kernels)
        dict(block_size=4, num_kv_blocks=96, max_num_batched_tokens=64, kernels="torch"),
    ],
    ids=["bs16", "bs1", "chunked", "bs1-chunked", "tiny-pool", "torch-bs16", "torch-tiny-pool"],
)
def test_tiny_model_batch_matches_transformers(tiny_model_dir, references, options):
    options.setdefault("num_kv_blocks", 2048)
    llm = LLM(str(tiny_model_dir), **options)
    prompts = _prompts(LENGTHS, seed=1)
    outputs = llm.generate(prompts, GREEDY_16, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.token_ids == references(prompt), f"prompt of {len(prompt)} tokens"
    if options["num_kv_blocks"] == 96:
        assert sum(o.metrics.num_preemptions for o in outputs) > 0, "the tiny pool should force preemption"


@pytest.mark.parametrize("width", [256, 512])
def test_tiny_model_matches_transformers_on_each_kernel_width(tiny_model_dir, references, monkeypatch, width):
    """Each vector width the CPU can run, forced: the greedy tokens match, prompts long enough for the fused
    SwiGLU and decode batches of one to twelve rows; a width the CPU lacks is skipped, naming the feature."""
    from conveyor.model.native.kernels import WIDTH_ENV, WIDTH_FEATURES, native_kernels

    kernels = native_kernels()
    assert kernels is not None, "the native kernels should build on the test machine"
    if width not in kernels.kernel_widths():
        pytest.skip(f"CPU lacks {WIDTH_FEATURES[width]}: no {width}-bit kernels to check")
    monkeypatch.setenv(WIDTH_ENV, str(width))
    llm = LLM(str(tiny_model_dir), num_kv_blocks=2048, max_num_batched_tokens=128)
    assert llm.engine.runner.kernel_width == width
    assert llm.engine.executor.model.lm_head.packed.shape[2] == width // 16, "the forced width's packing"
    prompts = _prompts(LENGTHS, seed=8)
    for prompt, output in zip(prompts, llm.generate(prompts, GREEDY_16, use_tqdm=False)):
        assert output.token_ids == references(prompt), f"prompt of {len(prompt)} tokens"


def test_tiny_model_each_length_alone(tiny_model_dir, references):
    llm = LLM(str(tiny_model_dir), num_kv_blocks=512, max_num_batched_tokens=128)
    for prompt in _prompts([1, 3, 31, 32, 200], seed=2):
        [output] = llm.generate([prompt], GREEDY_16, use_tqdm=False)
        assert output.token_ids == references(prompt)


def test_requests_join_while_others_decode(tiny_model_dir, references):
    """Requests added mid-run (continuous batching) still match the reference."""
    llm = LLM(str(tiny_model_dir), num_kv_blocks=512)
    engine = llm.engine
    prompts = _prompts([5, 40, 90, 12], seed=3)
    done = {}
    engine.add_request(prompts[0], GREEDY_16, request_id="0")
    for step in range(200):
        if step in (3, 6, 9):
            engine.add_request(prompts[step // 3], GREEDY_16, request_id=str(step // 3))
        done.update({o.request_id: o for o in engine.step() if o.finished})
        if len(done) == len(prompts):
            break
    for i, prompt in enumerate(prompts):
        assert done[str(i)].token_ids == references(prompt)


def test_batch_invariance(tiny_model_dir):
    """A request's greedy tokens are the same alone, in a batch of 32, and when preempted."""
    probe = _prompts([45], seed=4)[0]
    others = _prompts([random.Random(5).randrange(1, 200) for _ in range(31)], seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = LLM(str(tiny_model_dir), num_kv_blocks=512).generate([probe], params, use_tqdm=False)[0]
    batch = LLM(str(tiny_model_dir), num_kv_blocks=2048).generate([*others[:15], probe, *others[15:]], params,
                                                                  use_tqdm=False)
    assert batch[15].token_ids == alone.token_ids
    # 64 blocks of 4 hold a 200-token prompt and the probe, but not their growth: the probe,
    # the later arrival, is preempted and recomputed on the way.
    squeezed = LLM(str(tiny_model_dir), num_kv_blocks=64, block_size=4, max_model_len=256)
    outputs = squeezed.generate([_prompts([200], seed=7)[0], probe], params, use_tqdm=False)
    assert outputs[1].metrics.num_preemptions > 0
    assert outputs[1].token_ids == alone.token_ids


CHATS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain what a CPU does in one sentence.",
    "List three colours of the rainbow.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Give one tip for sleeping well.",
]


@pytest.fixture(scope="module")
def default_llm(default_model_dir):
    """The default model, every option its default but the pool: 256 blocks hold the batch of eight, where the
    default pool (1.5 GB, written through at start) would hold 128 requests."""
    return LLM(str(default_model_dir), num_kv_blocks=256)


@pytest.fixture(scope="module")
def default_references(default_model_dir, default_llm):
    import torch
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    prompts = [default_llm.tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    return prompts, [hf_greedy(hf, p, 32) for p in prompts]


def test_default_model_alone_and_batched(default_llm, default_references):
    prompts, references = default_references
    params = SamplingParams(temperature=0.0, max_tokens=32)
    for prompt, reference in zip(prompts, references):
        assert default_llm.generate([prompt], params, use_tqdm=False)[0].token_ids == reference
    batched = default_llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in batched] == references
    assert "Paris" in batched[0].text


def test_the_lm_head_runs_on_the_sampled_rows_only(tiny_model_dir):
    """A step of decodes and a prompt chunk that does not reach its prompt's end: one row samples per decode,
    none of the chunk's rows does, and only the sampled rows go through the LM head."""
    from conveyor.core.config import EngineConfig
    from conveyor.engine import Engine

    engine = Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256, max_num_batched_tokens=37))
    sampler = engine.executor.sampler
    rows_seen = []
    sample_batch = sampler.sample_batch

    def recording(logits, *args):  # the LM head's output, native stack or PyTorch ops alike
        rows_seen.append(logits.shape[0])
        return sample_batch(logits, *args)

    sampler.sample_batch = recording
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request(list(range(5, 15)), params, "short")
    engine.step()  # the short prompt whole: one row samples
    engine.add_request(list(range(20, 120)), params, "long")
    engine.step()  # the short one decodes; 36 of the long prompt's 100 tokens: not its last
    assert rows_seen == [1, 1]
