"""``--kernels auto``: the decision from timings, the cache and its key, and an engine on forced routes.

The timings themselves are whatever this machine measures; what is tested is
what follows from them: a width and routes that take torch's GEMM only where
it wins by the margin, a cache that a second start reads and a different CPU
does not, and greedy output equal to transformers' whichever GEMM runs.
"""

from __future__ import annotations

import json

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.model.quant import kernel_choice
from conveyor.model.quant.kernel_choice import ROW_CLASSES, TORCH, KernelChoice, choice_key, choose_kernels, decide
from conveyor.platform.cpu import Cpu
from tests.harness import hf_greedy


def _seconds(native_512: float, native_256: float, torch_s: float, **torch_at: float):
    """Every class of one projection at these times, torch's at some classes replaced."""
    return {"qkv": {c.name: {"native-512": native_512, "native-256": native_256, TORCH: torch_at.get(c.name, torch_s)}
                    for c in ROW_CLASSES}}


def test_torch_is_chosen_only_where_it_wins_by_the_margin():
    seconds = _seconds(1.0, 1.5, 2.0, **{"65+": 0.5, "9-64": 0.95})  # 9-64: faster, within the margin
    width, routes, fused_classes = decide(seconds, [256, 512])
    assert width == 512
    assert routes == {"qkv": ["65+"]}
    assert fused_classes == [], "no gate/up measured"


def test_swiglu_is_fused_where_that_measured_faster_and_gate_up_stays_packed():
    times = {"1": (1.0, 0.9, 5.0), "2-8": (1.0, 1.1, 5.0), "9-64": (1.0, 0.8, 5.0), "65+": (1.0, 0.8, 0.5)}
    seconds = {"gate_up": {name: {"native-512": unfused, "native-512-fused": fused_s, TORCH: torch_s}
                           for name, (unfused, fused_s, torch_s) in times.items()}}
    width, routes, fused_classes = decide(seconds, [512])
    assert routes == {"gate_up": ["65+"]}, "torch beats even the fused kernel there"
    assert fused_classes == ["1", "9-64"], "fused where faster, and never where gate/up runs on torch's GEMM"
    choice = KernelChoice(width, False, routes, fused_classes, seconds, 0.1)
    assert [choice.chosen("gate_up", name) for name in times] == ["native-512-fused", "native-512",
                                                                 "native-512-fused", TORCH]
    assert choice.fused_rows() == [(1, 1), (9, 64)]
    assert "SwiGLU fused at 1, 9-64 rows" in choice.summary()


def test_torch_must_beat_the_faster_of_fused_and_unfused():
    seconds = {"gate_up": {c.name: {"native-512": 1.0, "native-512-fused": 0.5, TORCH: 0.8} for c in ROW_CLASSES}}
    assert decide(seconds, [512])[1] == {"gate_up": []}


def test_the_width_is_the_one_that_costs_least_overall():
    assert decide(_seconds(1.2, 1.0, 9.0), [256, 512])[0] == 256
    assert decide(_seconds(1.0, 1.0, 9.0), [256, 512])[0] == 512, "a tie goes to the wider packing"
    assert decide(_seconds(1.2, 1.0, 9.0), [512])[0] == 512, "only the candidates given"


def test_routes_become_row_ranges():
    choice = KernelChoice(512, False, {"qkv": ["1", "65+"], "o": []}, [], {}, 0.0)
    assert choice.torch_rows() == {"qkv": [(1, 1), (65, 2**62)]}
    assert "qkv at 1, 65+ rows" in choice.summary() and "SwiGLU unfused" in choice.summary()
    assert "packed kernels at every row count" in KernelChoice(512, False, {"o": []}, [], {}, 1.0).summary()


def test_the_key_differs_by_cpu_isa_threads_dtype_and_shape(monkeypatch):
    shapes = {"qkv": [96, 64]}
    base = choice_key("build", [256, 512], False, 2, shapes)
    assert choice_key("build", [256, 512], True, 2, shapes) != base
    assert choice_key("build", [256, 512], False, 1, shapes) != base
    assert choice_key("build", [256, 512], False, 2, {"qkv": [96, 128]}) != base
    assert choice_key("other-build", [256, 512], False, 2, shapes) != base
    cpu = kernel_choice.this_cpu()
    other = Cpu(cpu.model, (*[f for f in cpu.isa if f != "avx512f"], "x"))
    monkeypatch.setattr(kernel_choice, "this_cpu", lambda: other)
    assert choice_key("build", [256, 512], False, 2, shapes) != base


def test_a_choice_is_measured_once_then_read_from_the_cache(kernels, tmp_path):
    cache = tmp_path / "choice.json"
    weights = {"qkv": torch.randn(96, 64), "lm_head": torch.randn(300, 64), "gate_up": torch.randn(128, 64)}
    widths = list(kernels.kernel_widths())
    first = choose_kernels(kernels, weights, widths, False, cache)
    assert not first.cached and first.width in widths
    assert set(first.seconds) == {"qkv", "lm_head", "gate_up"}
    assert {f"native-{w}-fused" for w in widths} <= set(first.seconds["gate_up"]["1"]), "64 = whole tiles"
    assert "native-256-fused" not in first.seconds["qkv"]["1"]
    assert set(first.seconds["qkv"]) == {c.name for c in ROW_CLASSES}
    assert all(s > 0 for by_class in first.seconds.values() for t in by_class.values() for s in t.values())
    again = choose_kernels(kernels, weights, widths, False, cache)
    assert again.cached and (again.width, again.torch_classes) == (first.width, first.torch_classes)
    assert len(json.loads(cache.read_text())) == 1
    choose_kernels(kernels, {"qkv": torch.randn(96, 32)}, widths, False, cache)
    assert len(json.loads(cache.read_text())) == 2, "another shape is another record"


def test_an_unreadable_cache_is_measured_again(kernels, tmp_path):
    cache = tmp_path / "choice.json"
    cache.write_text("{not json")
    choice = choose_kernels(kernels, {"o": torch.randn(64, 64)}, [256], False, cache)
    assert not choice.cached and choice.width == 256


def test_the_engine_on_every_gemm_routed_to_torch_matches_transformers(
    tiny_model_dir, tiny_hf_model, kernels, monkeypatch, tmp_path
):
    """Whatever the timings say, both GEMMs give transformers' greedy tokens: here the decision is forced to
    torch's GEMM everywhere (the timing and the stack around it are the real ones)."""
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(
        kernel_choice, "decide",
        lambda seconds, widths: (max(widths), {p: [c.name for c in ROW_CLASSES] for p in seconds}, []),
    )
    llm = LLM(str(tiny_model_dir), num_kv_blocks=1024, max_num_batched_tokens=128)
    assert "torch's GEMM for" in llm.engine.runner.native_kernels_summary
    assert llm.engine.executor.model.layers[0].mlp.down_proj.weight.numel() > 0, "kept for torch's GEMM"
    prompts = [[1000 + 37 * i % 30000 for i in range(n)] for n in (3, 40, 100)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    for prompt, output in zip(prompts, llm.generate(prompts, greedy, use_tqdm=False)):
        assert output.token_ids == hf_greedy(tiny_hf_model, prompt, 12), f"prompt of {len(prompt)} tokens"


def test_auto_is_the_default_and_says_what_it_chose(tiny_model_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path))
    runner = LLM(str(tiny_model_dir), num_kv_blocks=64).engine.runner
    assert runner.kernel_choice is not None and not runner.kernel_choice.cached
    assert runner.native_kernels_summary.startswith(f"{runner.kernel_width}-bit vectors; auto (measured in")
    assert LLM(str(tiny_model_dir), num_kv_blocks=64).engine.runner.kernel_choice.cached
    native = LLM(str(tiny_model_dir), num_kv_blocks=64, kernels="native").engine
    assert native.runner.kernel_choice is None, "--kernels native: the packed kernels everywhere, nothing timed"


@pytest.mark.parametrize("bad", ["fast", ""])
def test_an_unknown_kernels_option_is_refused(tiny_model_dir, bad):
    with pytest.raises(ValueError, match="kernels"):
        LLM(str(tiny_model_dir), num_kv_blocks=64, kernels=bad)
