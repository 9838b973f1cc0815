"""The whole native stack (NativeDecoder, Decoder.run_native) against the model's PyTorch layers.

Mixed batches of prompt chunks (with and without a cached prefix) and decode
rows; GEMMs routed to torch's at some row counts; SwiGLU fused or not; the LM
head on chosen rows; inputs out of range refused; the weights packed in step
order. On every vector width the CPU can run.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F


def _stack_model(intermediate_size: int):
    """A random two-layer model with biases on every projection that may carry one."""
    from conveyor.core.model_config import ModelConfig
    from conveyor.model.decoder import Decoder

    config = ModelConfig(
        vocab_size=300, hidden_size=48, intermediate_size=intermediate_size, num_layers=2, num_heads=6,
        num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=128,
        tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
    )
    model = Decoder(config, max_positions=128)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model


def _assert_native_stack_matches(kernels, width, model, positions, row_seq, tables, decodes, prefills, block_size=4,
                                 torch_rows=None, fused_swiglu_rows=None, kv_cache_dtype="auto"):
    """The same step through the PyTorch layers and through NativeDecoder (with some GEMMs routed to torch's,
    and SwiGLU fused at given row counts, if asked): equal hidden states, caches, and logits of the rows the
    LM head is asked for (some, out of order).

    Over a cache narrower than the model (``kv_cache_dtype``), both write the step's K and V rounded alike and
    attend to what the cache holds; a K or V within float32 noise of a rounding boundary may round to the
    neighbouring value on one side only, so the caches are held to agree but for a few elements, each within
    one step of the format, and the outputs to a tolerance that allows for those."""
    from conveyor.model.attention import AttentionMetadata, from_cache, to_cache
    from conveyor.model.decoder import StepInputs
    from conveyor.model.dtypes import kv_cache_dtype as storage_dtype

    config = model.config
    slots = torch.stack([tables[s, p // block_size] * block_size + p % block_size for s, p in zip(row_seq, positions)])
    cache = to_cache(torch.randn(config.num_layers, 2, 32, block_size, config.num_kv_heads, config.head_dim),
                     storage_dtype(kv_cache_dtype, torch.float32))
    ids = torch.randint(0, config.vocab_size, (len(positions),))
    logit_rows = [len(positions) - 1, 0, len(positions) // 2]
    torch_cache = cache.clone()
    with torch.inference_mode():
        want = model(ids, positions, torch_cache, AttentionMetadata(slots, decodes, prefills))
        want_logits = model.compute_logits(want[logit_rows])
        model.use_native_kernels(kernels, width, torch_rows=torch_rows, fused_swiglu_rows=fused_swiglu_rows)
        inputs = StepInputs(ids.tolist(), positions.tolist(), slots.tolist(), tables.tolist(), row_seq.tolist(),
                            logit_rows)
        got, got_logits, greedy = model.run_native(inputs, cache)
    assert greedy == got_logits.argmax(dim=-1).tolist()
    atol = 1e-4
    if cache.dtype == torch.float32:
        torch.testing.assert_close(cache, torch_cache, rtol=1e-5, atol=1e-5)
    else:
        apart = (cache != torch_cache).sum().item()
        assert apart <= cache.numel() // 500, f"{apart} of {cache.numel()} cache elements differ"
        torch.testing.assert_close(from_cache(cache, torch.float32), from_cache(torch_cache, torch.float32),
                                   rtol=0.25, atol=2.0**-14)
        atol = 1e-4 if apart == 0 else 5e-2
    torch.testing.assert_close(got, want, rtol=1e-4, atol=atol)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=atol)


def mixed_batch():
    """One step of a prompt chunk after a cached prefix (sequence 0: positions 5..9 after 5 cached), a fresh
    prompt (sequence 1: 0..5) and a decode row (sequence 2, at position 10): (positions, row_seq, tables,
    decodes, prefills), block size 4."""
    from conveyor.model.attention import DecodeGroup, PrefillChunk

    tables = torch.tensor([[3, 9, 4, 0], [7, 1, 0, 0], [12, 15, 2, 0]])
    positions = torch.cat([torch.arange(5, 10), torch.arange(0, 6), torch.tensor([10])])
    row_seq = torch.tensor([0] * 5 + [1] * 6 + [2])
    decodes = [DecodeGroup(11, 12, tables[2:3], (torch.arange(16) < 11).view(1, 1, 1, 16))]
    prefix_mask = torch.arange(10)[None, :] <= torch.arange(5, 10)[:, None]
    prefills = [PrefillChunk(0, 5, 5, tables[0], prefix_mask), PrefillChunk(5, 11, 0, tables[1], None)]
    return positions, row_seq, tables, decodes, prefills


def test_native_stack_matches_the_torch_layers_on_a_mixed_batch(kernels, width):
    """A prompt with a cached prefix, a fresh prompt and a decode row in one step."""
    torch.manual_seed(5)
    positions, row_seq, tables, decodes, prefills = mixed_batch()
    _assert_native_stack_matches(kernels, width, _stack_model(80), positions, row_seq, tables, decodes, prefills)


@pytest.mark.parametrize("intermediate_size", [96, 80, 72])
def test_native_stack_matches_the_torch_layers_on_a_long_prompt(kernels, width, intermediate_size):
    """70 rows: enough for SwiGLU to be fused into the gate/up projection where the intermediate size is a
    whole number of tiles (96 on both paths, 80 on the 16-column one), and the unfused path where it is not."""
    from conveyor.model.attention import PrefillChunk

    torch.manual_seed(6)
    tables = torch.randperm(32)[:18].view(1, 18)
    positions, row_seq = torch.arange(70), torch.zeros(70, dtype=torch.long)
    prefills = [PrefillChunk(0, 70, 0, tables[0], None)]
    _assert_native_stack_matches(
        kernels, width, _stack_model(intermediate_size), positions, row_seq, tables, [], prefills
    )


EVERY_ROW = [(1, 2**62)]


@pytest.mark.parametrize(
    "routes",
    [
        {name: EVERY_ROW for name in ("qkv", "o", "gate_up", "down")},
        {"qkv": [(1, 11)], "down": [(12, 12)]},  # this 12-row step: qkv and down on torch's GEMM, o and gate_up not
    ],
    ids=["all-on-torch", "some-on-torch"],
)
def test_native_stack_with_gemms_routed_to_torch_matches_the_torch_layers(kernels, width, routes):
    """--kernels auto may hand some projections at some row counts to torch's GEMM inside the stack."""
    torch.manual_seed(5)
    positions, row_seq, tables, decodes, prefills = mixed_batch()
    _assert_native_stack_matches(
        kernels, width, _stack_model(80), positions, row_seq, tables, decodes, prefills, torch_rows=routes
    )


def test_a_long_prompt_with_gate_up_on_torch_skips_the_fused_swiglu(kernels, width):
    """70 rows would fuse SwiGLU into the packed gate/up GEMM; routed to torch's GEMM, the gate/up projection
    goes through memory and the separate SwiGLU instead, with the same result."""
    from conveyor.model.attention import PrefillChunk

    torch.manual_seed(6)
    tables = torch.randperm(32)[:18].view(1, 18)
    positions, row_seq = torch.arange(70), torch.zeros(70, dtype=torch.long)
    _assert_native_stack_matches(
        kernels, width, _stack_model(96), positions, row_seq, tables, [], [PrefillChunk(0, 70, 0, tables[0], None)],
        torch_rows={"gate_up": [(65, 2**62)]},
    )


@pytest.mark.parametrize(("rows", "fused_at"), [(3, [(1, 8)]), (70, [])], ids=["fused-at-3-rows", "unfused-at-70"])
def test_the_stack_fuses_swiglu_at_the_row_counts_it_is_given(kernels, width, rows, fused_at):
    """--kernels auto replaces the stack's own rule (fused from 64 rows) with the row counts it measured."""
    from conveyor.model.attention import PrefillChunk

    torch.manual_seed(rows)
    tables = torch.randperm(32)[:18].view(1, 18)
    positions, row_seq = torch.arange(rows), torch.zeros(rows, dtype=torch.long)
    _assert_native_stack_matches(
        kernels, width, _stack_model(96), positions, row_seq, tables, [], [PrefillChunk(0, rows, 0, tables[0], None)],
        fused_swiglu_rows=fused_at,
    )


def test_the_lm_head_routed_to_torch_at_some_row_counts(kernels):
    """From Python (compute_logits: prompt logprobs), rows in the LM head's torch_rows take F.linear on the
    kept weight, others the packed kernels; both give the plain layer's result."""
    from conveyor.model.decoder import Linear

    torch.manual_seed(7)
    layer = Linear(48, 300, bias=False)
    inputs = [torch.randn(rows, 48) for rows in (1, 9, 70)]
    want = [F.linear(x, layer.weight) for x in inputs]
    layer.pack(kernels, keep_weight=True)
    layer.torch_rows = ((9, 64),)
    for x, expected in zip(inputs, want):
        torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-4)


def test_the_stacks_lm_head_routed_to_torch(kernels, width):
    """Inside the stack, an LM head over 3 rows routed to torch's GEMM gives the torch layers' logits."""
    torch.manual_seed(8)
    tables = torch.tensor([[3, 9, 4]])
    positions, row_seq = torch.arange(9), torch.zeros(9, dtype=torch.long)
    from conveyor.model.attention import PrefillChunk

    _assert_native_stack_matches(kernels, width, _stack_model(80), positions, row_seq, tables, [],
                                 [PrefillChunk(0, 9, 0, tables[0], None)], torch_rows={"lm_head": [(3, 3)]})


def test_a_native_step_refuses_inputs_outside_its_tables(kernels):
    """Whatever reaches the native step out of range is an error naming it, not a read past a buffer."""
    from conveyor.model.decoder import StepInputs

    model = _stack_model(80)
    model.use_native_kernels(kernels)
    cache = model.zeroed_kv_cache((2, 2, 8, 4, 2, 8), torch.float32, torch.device("cpu"))
    good = dict(token_ids=[5, 6], positions=[0, 1], slots=[12, 13], block_tables=[[3]], row_seq=[0, 0],
                logit_rows=[1])
    hidden, logits, greedy = model.run_native(StepInputs(**good), cache)
    assert hidden.shape == (2, 48) and logits.shape == (1, model.config.vocab_size) and len(greedy) == 1
    cases = {
        "token id 9999 outside the vocabulary": dict(token_ids=[5, 9999]),
        "block 8 outside the cache": dict(block_tables=[[8]]),
        "slot 32 outside the cache": dict(slots=[12, 32]),
        "position 4 is past its sequence's blocks": dict(positions=[0, 4]),
        "position 500 outside the 128": dict(positions=[0, 500]),
        "names block table 1 of 1": dict(row_seq=[0, 1]),
        "logit row 2 of 2": dict(logit_rows=[2]),
        "one entry per row": dict(positions=[0]),
    }
    for message, change in cases.items():
        with pytest.raises(RuntimeError, match=message):
            model.run_native(StepInputs(**{**good, **change}), cache)


def test_a_native_model_packs_its_weights_in_step_order_into_one_buffer(kernels, width):
    """Every projection back to back in the order a step reads them (layer by layer: qkv, o, gate/up, down;
    the LM head last), from a 2 MiB boundary; the KV cache the model hands out is zeroed, also on huge pages."""
    model = _stack_model(80)
    model.use_native_kernels(kernels, width)
    packed = [module.packed for _, module in model._projections()]
    assert packed[0].data_ptr() % (2 << 20) == 0
    for before, after in itertools.pairwise(packed):
        assert after.data_ptr() == before.data_ptr() + before.numel() * before.element_size()
    assert packed[-1] is model.lm_head.packed
    cache = model.zeroed_kv_cache((2, 2, 8, 4, 2, 8), torch.float32, torch.device("cpu"))
    assert cache.data_ptr() % (2 << 20) == 0 and not cache.any()


def test_routing_a_projection_needs_its_plain_weight_and_a_known_name(kernels):
    model = _stack_model(80)
    model.use_native_kernels(kernels)  # no routes: the plain weights are freed
    with pytest.raises(RuntimeError, match="gate_up has no plain weight"):
        model.native.route_to_torch("gate_up", 1, 8)
    with pytest.raises(RuntimeError, match="no projection named mlp"):
        model.native.route_to_torch("mlp", 1, 8)
    with pytest.raises(RuntimeError, match="no range of row counts"):
        model.native.route_to_torch("qkv", 9, 8)
    with pytest.raises(RuntimeError, match="lm_head has no plain weight"):
        model.native.route_to_torch("lm_head", 1, 8)
    routed = kernels.NativeDecoder(6, 2, 8, 48, 80, 1e-5, torch.ones(48), 256, False)
    layer = model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    args = [torch.ones(48), attn.qkv_proj.packed, torch.empty(0), attn.o_proj.packed, torch.ones(48),
            mlp.gate_up_proj.packed, torch.empty(0), mlp.down_proj.packed, torch.empty(0)]
    routed.add_layer(*args, torch.empty(0), torch.empty(0), torch.randn(160, 48), torch.empty(0))
    routed.route_to_torch("gate_up", 1, 8)
    with pytest.raises(RuntimeError, match="gate_up is routed to torch's GEMM: every layer needs its plain weight"):
        routed.add_layer(*args, *[torch.empty(0)] * 4)
    with pytest.raises(ValueError, match="no projection named"):
        _stack_model(80).use_native_kernels(kernels, torch_rows={"attention": [(1, 1)]})
