"""Sliding-window attention over KV groups on the real engine: tokens equal to transformers past the window.

The tiny random-weight Gemma 3 (windowed, full, windowed: three KV groups of one layer) and Mistral (every
layer windowed: one group) of test_families run with prefix caching off, so their windowed layers give back
the blocks behind the window (conveyor/core/kv/grouped.py). Prompts run past the windows (16 and 24
positions) and decoding goes on far past them, alone, batched, in small chunks, and preempted by recompute
and by swap from a small pool (Gemma's full group fills it), on the native stack and once on the PyTorch ops;
every step, a spy on the manager checks that blocks were given back and that no windowed group holds more than
its bound.
"""

from __future__ import annotations

import pytest

from conveyor import LLM, SamplingParams
from conveyor.core.kv import NULL_BLOCK, blocks_for_tokens
from tests.harness import hf_greedy
from tests.model.test_families import _build

LONG = SamplingParams(temperature=0.0, max_tokens=48)
LENGTHS = [3, 17, 40, 70, 100]
GROUPS = {"gemma3": 3, "mistral": 1}  # KV groups: Gemma's layers are windowed, full, windowed
OPTIONS = {
    "batched": dict(),
    "chunked": dict(max_num_batched_tokens=19),
    "recompute": dict(num_kv_blocks=40, max_num_batched_tokens=64),
    "swap": dict(num_kv_blocks=40, max_num_batched_tokens=64, preemption_mode="swap", swap_space="1MiB"),
    "torch-ops": dict(kernels="torch"),
}


def _prompts() -> list[list[int]]:
    import random

    rng = random.Random(7)
    return [[rng.randrange(1000, 40000) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module", params=sorted(GROUPS))
def family(request, tmp_path_factory, default_model_dir):
    """(family name, its folder, transformers' greedy tokens of each prompt)."""
    folder = tmp_path_factory.mktemp(f"window-{request.param}")
    reference_model = _build(request.param, folder, default_model_dir)
    expected = [hf_greedy(reference_model, prompt, LONG.max_tokens) for prompt in _prompts()]
    return request.param, folder, expected


def _spy_on_releases(llm: LLM, window_of: dict[int, int]) -> list[int]:
    """Wrap the manager's release so that, after each, every windowed group is checked against its bound;
    returns the list of blocks behind windows seen after each release (to show some were given back)."""
    kv = llm.engine.core.scheduler.kv_manager
    bs, seen = kv.block_size, []
    release = kv.release_behind_window

    def checked(request) -> None:
        release(request)
        tables = kv.group_block_ids(request.request_id)
        for group, window in window_of.items():
            live = sum(block != NULL_BLOCK for block in tables[group])
            assert live <= blocks_for_tokens(window - 1, bs) + 1, f"group {group} holds {live} blocks"
        seen.append(kv._num_behind)

    kv.release_behind_window = checked
    return seen


@pytest.mark.parametrize("options", sorted(OPTIONS))
def test_windowed_groups_match_transformers_far_past_the_window(family, options):
    name, folder, expected = family
    llm = LLM(str(folder), enable_prefix_caching=False, block_size=4, **{"num_kv_blocks": 1024, **OPTIONS[options]})
    layout = llm.engine.kv_layout
    assert layout is not None and layout.num_groups == GROUPS[name]
    assert (llm.engine.runner.kernel_width is None) == (options == "torch-ops"), "the native stack runs KV groups"
    seen = _spy_on_releases(llm, {g: w for g, w in enumerate(layout.windows) if w is not None})
    outputs = llm.generate(_prompts(), LONG, use_tqdm=False)
    for prompt, output, want in zip(_prompts(), outputs, expected):
        assert output.token_ids == want, f"{name}: prompt of {len(prompt)} tokens"
    assert max(seen) > 0, "no block was given back behind a window"
    if options in ("recompute", "swap") and name == "gemma3":  # Mistral's one windowed group needs little
        assert sum(o.metrics.num_preemptions for o in outputs) > 0, "the small pool should force preemption"


def test_each_prompt_alone_matches_transformers(family):
    name, folder, expected = family
    llm = LLM(str(folder), enable_prefix_caching=False, block_size=4, num_kv_blocks=256)
    for prompt, want in zip(_prompts(), expected):
        [output] = llm.generate([prompt], LONG, use_tqdm=False)
        assert output.token_ids == want, f"{name}: prompt of {len(prompt)} tokens"


def test_prefix_caching_keeps_one_group(family):
    """With prefix caching on (the default) the windowed layers keep their blocks and attend through a mask:
    the layout is one group and a repeated prompt is found in the cache (test_families checks the tokens)."""
    _, folder, _ = family
    llm = LLM(str(folder), num_kv_blocks=256)
    assert llm.engine.kv_layout is None
