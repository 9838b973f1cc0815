"""The native expert-grouped step (model/native/csrc/experts.h) against the plain reference, a loop over experts.

Routing: the router's softmax top-k, scaled or not, equals torch's. The grouped MLP, on given routings
(random ones, experts with no rows, every row on one expert, one row): with float experts packed for each
vector width, equal to PyTorch's loop over the experts within float rounding; with quantized experts (a K-quant
and a uniform format, run in one pass over every expert's tiles, and the two mixed, run expert by expert),
equal to the same loop run through the quantized kernels expert by expert, on every dot-product kind, so the
grouping, the split of the work, the gathering and the weighted sum are exact. The ``kernels`` and ``width``
fixtures are conftest's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conveyor.model.quant.formats import quantize_matrix
from conveyor.model.quant.linear import native_weight
from tests.model.test_k_quants import random_blocks

HIDDEN, WIDTH, EXPERTS, TOP_K = 256, 256, 8, 2  # K-quants take rows of whole 256-weight blocks


def _routings(rows: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Routings [rows, TOP_K] of experts and weights: random (some experts left without rows), all rows on
    experts 3 and 5, and expert 0 alone for every row's first pick."""
    gen = torch.Generator().manual_seed(rows)
    weights = torch.rand(rows, TOP_K, generator=gen)
    random = torch.stack([torch.randperm(EXPERTS - 3, generator=gen)[:TOP_K] for _ in range(rows)])
    crowded = torch.tensor([[3, 5]] * rows)
    first = torch.stack([torch.tensor([0, 1 + r % (EXPERTS - 1)]) for r in range(rows)])
    return {"random": (random, weights), "crowded": (crowded, weights), "first": (first, weights)}


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _reference(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up, down,
               act=_swiglu) -> torch.Tensor:
    """The loop over experts: each expert on the rows that chose it, weighted, added in expert order."""
    out = torch.zeros_like(x)
    for expert in chosen.unique().tolist():
        rows, slot = torch.where(chosen == expert)
        out.index_add_(0, rows, down(expert, act(gate_up(expert, x[rows]))) * weights[rows, slot, None])
    return out


def test_routing_is_torchs_softmax_top_k(kernels) -> None:
    logits = torch.randn(300, EXPERTS, generator=torch.Generator().manual_seed(0)) * 3
    probs = torch.softmax(logits, dim=-1)
    for normalize in (False, True):
        chosen, weights = kernels.route_experts(logits, TOP_K, normalize)
        want_weights, want = torch.topk(probs, TOP_K, dim=-1)
        if normalize:
            want_weights = want_weights / want_weights.sum(dim=-1, keepdim=True)
        assert torch.equal(chosen, want)
        assert torch.allclose(weights, want_weights, rtol=1e-6, atol=1e-7)


def test_routing_refuses_more_picks_than_experts(kernels) -> None:
    with pytest.raises(Exception, match="top-9 of 8 experts"):
        kernels.route_experts(torch.zeros(2, EXPERTS), 9, True)


@pytest.mark.parametrize("rows", [1, 7, 40])
def test_float_experts_equal_the_loop_over_experts(kernels, width, rows) -> None:
    gen = torch.Generator().manual_seed(width + rows)
    gate_up = torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, generator=gen) * 0.1
    down = torch.randn(EXPERTS, HIDDEN, WIDTH, generator=gen) * 0.1
    packed_gate_up = [kernels.pack_linear_weight(w.contiguous(), width, False, None) for w in gate_up]
    packed_down = [kernels.pack_linear_weight(w.contiguous(), width, False, None) for w in down]
    x = torch.randn(rows, HIDDEN, generator=gen)
    for name, (chosen, weights) in _routings(rows).items():
        ours = kernels.expert_mlp(x, chosen, weights, packed_gate_up, packed_down, WIDTH, width)
        want = _reference(x, chosen, weights, lambda e, v: v @ gate_up[e].T, lambda e, v: v @ down[e].T)
        assert torch.allclose(ours, want, rtol=1e-4, atol=1e-5), (name, (ours - want).abs().max())


def _quantized_experts(kernels, kind: str, n: int, k: int) -> list:
    """Every expert in format ``kind`` (one pass runs them all), or with "mixed" Q4_K and int8 in turn (expert
    by expert)."""
    if kind == "mixed":
        q4k, int8 = _quantized_experts(kernels, "Q4_K", n, k), _quantized_experts(kernels, "int8", n, k)
        return [q4k[e] if e % 2 else int8[e] for e in range(EXPERTS)]
    if kind == "Q4_K":
        return [native_weight(kernels, random_blocks(kind, n, k, seed)) for seed in range(EXPERTS)]
    rng = np.random.default_rng(n)
    return [native_weight(kernels, quantize_matrix(rng.standard_normal((n, k), dtype=np.float32) * 0.1, kind))
            for _ in range(EXPERTS)]


@pytest.mark.parametrize("kind", ["Q4_K", "int8", "mixed"])
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_quantized_experts_equal_the_loop_over_their_kernels(kernels, kind: str, rows: int) -> None:
    gate_up = _quantized_experts(kernels, kind, 2 * WIDTH, HIDDEN)
    down = _quantized_experts(kernels, kind, HIDDEN, WIDTH)
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows))
    for dot in kernels.quant_dots():
        def linear(weights: list, dot: str = dot):
            return lambda e, v: kernels.quantized_linear(v.contiguous(), weights[e], dot)

        for name, (chosen, weights) in _routings(rows).items():
            ours = kernels.expert_mlp(x, chosen, weights, gate_up, down, WIDTH, dot=dot)
            # The stack's own activation: torch's silu rounds differently, and the int8 codes of what goes into
            # down would part where a value sits on a rounding edge.
            want = _reference(x, chosen, weights, linear(gate_up), linear(down), kernels.silu_and_mul)
            # Equal but for the rounding of the weighted sum (a fused multiply-add or not): 1e-6 of the largest.
            assert (ours - want).abs().max() <= 1e-6 * want.abs().max(), (dot, name, (ours - want).abs().max())


def test_a_routing_outside_the_experts_is_refused(kernels) -> None:
    packed = [kernels.pack_linear_weight(torch.zeros(2 * WIDTH, HIDDEN), 256, False, None)] * 2
    down = [kernels.pack_linear_weight(torch.zeros(HIDDEN, WIDTH), 256, False, None)] * 2
    with pytest.raises(Exception, match="expert 2 of 2"):
        kernels.expert_mlp(torch.zeros(1, HIDDEN), torch.tensor([[0, 2]]), torch.ones(1, 2), packed, down, WIDTH)
