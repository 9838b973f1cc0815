"""A decoder of any family over a flat batch of tokens and a paged KV cache.

The layers are the shared ones (:mod:`conveyor.model.layers`), built as the config's family describes
(:mod:`conveyor.model.families`). The model only ever sees the flat token batch the executor packed; which
request a token belongs to is known only to the attention metadata. Families the native stack runs (Llama's
layers) can move into it whole (:meth:`Decoder.use_native_kernels`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType

import torch
from torch import nn

from conveyor.core.model_config import ModelConfig
from conveyor.model.attention import AttentionMetadata
from conveyor.model.families import family_for
from conveyor.model.layers import (
    LAYER_PROJECTIONS,
    DecoderLayer,
    ExpertLinears,
    Linear,
    RotaryEmbedding,
    SparseMoE,
    make_norm,
)
from conveyor.model.native.kernels import native_gaps

__all__ = ["LAYER_PROJECTIONS", "PROJECTIONS", "Decoder", "Linear", "StepInputs"]

PROJECTIONS = ("qkv", "o", "gate_up", "down", "lm_head")  # the GEMM shapes of a step, by projection


@dataclass(slots=True)
class StepInputs:
    """One step's inputs as plain lists: row ``r`` holds token ``token_ids[r]`` at ``positions[r]``, writes
    its K/V to cache slot ``slots[r]`` and belongs to sequence ``row_seq[r]``, whose blocks are
    ``block_tables[row_seq[r]]``; the LM head runs on ``logit_rows``. With KV groups (conveyor.core.kv.groups),
    ``slots`` and ``block_tables`` are group 0's and ``group_slots`` / ``group_tables`` those of groups 1, 2, ...
    The native stack takes them as they are (run_native); the PyTorch path makes tensors of them."""

    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    block_tables: list[list[int]]
    row_seq: list[int]
    logit_rows: list[int]
    group_slots: list[list[int]] = field(default_factory=list)
    group_tables: list[list[list[int]]] = field(default_factory=list)


class Decoder(nn.Module):
    """The decoder in PyTorch ops (any device and dtype, and the reference), or, once
    :meth:`use_native_kernels` has run, the same layers in one native call per step (on CPU: float32, or
    bfloat16 weights and KV cache with float32 activations)."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.family = family = family_for(config)
        # Its weight given, not drawn: nn.Embedding's own random init, even on the meta device the loaders build
        # on, goes through torch's reference ops and imports torch._dynamo, 1.3-2.4 s of every start.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, family, i) for i in range(config.num_layers))
        self.norm = make_norm(family, config.hidden_size, config.rms_norm_eps)
        self.build_rotary(max_positions)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        # Per layer: (its KV group, its index in the cache tensor), set by the executor for a grouped layout
        # (conveyor.core.kv.groups); one group of every layer by default.
        self.kv_slots: list[tuple[int, int]] = [(0, layer) for layer in range(config.num_layers)]
        self.native = None  # the kernels' NativeDecoder, holding the packed layers
        self.kernels: ModuleType | None = None  # the native kernels' module, once use_native_kernels has run

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata | Sequence[AttentionMetadata],
    ) -> torch.Tensor:
        """Hidden states of every token; ``kv_cache`` is [layers, 2, blocks, block_size, kv_heads, head_dim]
        (with KV groups, [layers per group, ...], and ``meta`` one metadata per group: see ``kv_slots``)."""
        if self.native is not None:
            raise RuntimeError("this model runs as one native stack (use_native_kernels): step it with run_native")
        x = self.embed_tokens(input_ids)
        if self.family.embedding_scale:  # in the activations' dtype, as the reference scales
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        ropes = (self.rotary(positions, x.dtype), None if self.rotary_local is None else
                 self.rotary_local(positions, x.dtype))
        metas = (meta,) if isinstance(meta, AttentionMetadata) else meta
        for layer, (group, slot) in zip(self.layers, self.kv_slots):
            x = layer(x, ropes, kv_cache[slot], metas[group])
        return self.norm(x)

    def build_rotary(self, max_positions: int, device: torch.device | str | None = None) -> None:
        """The rope tables, in float32 on ``device`` (None: the current default): the global layers', and the
        windowed layers' own where the family gives them another base (what a model built on the meta device
        builds again once it has a device). Tables for the meta device are computed on CPU and moved there:
        computed on meta, their arithmetic goes through torch's reference ops, which import torch._dynamo
        (about a second of every start, for tables the loader builds again on the real device)."""
        local = self.config.local_rope_theta is not None
        target = torch.get_default_device() if device is None else torch.device(device)
        with torch.device("cpu") if target.type == "meta" else target:
            rotary = RotaryEmbedding(self.config, max_positions)
            rotary_local = RotaryEmbedding(self.config, max_positions, local=True) if local else None
        if target.type == "meta":
            rotary.to(target)
            if rotary_local is not None:
                rotary_local.to(target)
        self.rotary, self.rotary_local = rotary, rotary_local

    def run_native(self, step: StepInputs, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """One step on the native stack: the final hidden states of every row and the logits of
        ``step.logit_rows``, both float32, and each logit row's argmax (its greedy token, found while the logits
        were in cache). Embedding, every layer and the LM head run in that one call, and its
        inputs go in as the lists the executor built: at batch 1 each tensor built, indexed or cast around the
        call cost a cold cache's worth of time after the weights streamed through."""
        return self.native.step(step.token_ids, step.positions, kv_cache, step.slots, step.block_tables,
                                step.row_seq, step.logit_rows, step.group_slots, step.group_tables)

    def use_native_kernels(
        self, kernels: ModuleType, width: int = 256, bfloat16: bool = False,
        torch_rows: Mapping[str, Sequence[tuple[int, int]]] | None = None,
        fused_swiglu_rows: Sequence[tuple[int, int]] | None = None,
        quant_dots: Mapping[str, Sequence[tuple[str, int, int]]] | None = None,
    ) -> None:
        """Pack every projection for the native kernels of ``width`` bits (in bfloat16 if asked: then the KV
        cache the stack is handed must be bfloat16 too) and hand the layers to one native stack, on CPU. The
        layers' plain weights are freed, except where ``torch_rows`` routes a projection (``qkv``, ``o``,
        ``gate_up``, ``down``, ``lm_head``) at some row counts (inclusive ranges) to torch's own GEMM. The stack
        runs the LM head on a step's sampled rows (run_native); its packed Linear still serves compute_logits
        (prompt logprobs). ``fused_swiglu_rows`` replaces
        the stack's own rule for when SwiGLU is fused into the packed gate/up GEMM. Norm weights, biases and
        the rotary tables go to the stack in float32."""
        gaps = native_gaps(self.config)
        if gaps:
            raise ValueError(f"native kernels: the native stack lacks {', '.join(gaps)} ({self.family.name})")
        routes = {name: tuple(ranges) for name, ranges in (torch_rows or {}).items() if ranges}
        unknown = set(routes) - set(PROJECTIONS)
        if unknown:
            raise ValueError(f"torch_rows: no projection named {sorted(unknown)} (expected {PROJECTIONS})")
        self.kernels = kernels
        self._pack_projections(kernels, width, bfloat16, keep=set(routes))
        self.lm_head.torch_rows = routes.get("lm_head", ())
        if self.rotary.cos.dtype != torch.float32:  # a model cast to bfloat16 cast its tables: build them again
            self.build_rotary(self.rotary.cos.shape[0], self.rotary.cos.device)
        self._pack_experts(kernels, width, bfloat16)
        c = self.config
        self.native = kernels.NativeDecoder(
            c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size, c.intermediate_size, c.rms_norm_eps,
            _norm_weight(self.norm), width, bfloat16,
        )
        self._hand_layers_to_native(bfloat16)
        # Only a routed LM head hands over its plain weight (a tied one keeps the embedding's, not needed else).
        head_plain = _plain(self.lm_head, bfloat16) if "lm_head" in routes else _no_weight(bfloat16)
        embedding = getattr(self.embed_tokens, "quantized", None) or self.embed_tokens.weight.detach()
        self.native.set_io(embedding, self.rotary.cos, self.rotary.sin, _stack_weight(self.lm_head), head_plain)
        self._hand_family_to_native()  # after set_io: the windowed layers' rope is checked against its tables
        for name, ranges in routes.items():
            for lo, hi in ranges:
                self.native.route_to_torch(name, lo, hi)
        if fused_swiglu_rows is not None:
            self.native.fuse_swiglu_at(list(fused_swiglu_rows))
        for projection, ranges in (quant_dots or {}).items():  # quantized projections: the kind per row class
            for dot, lo, hi in ranges:
                self.native.use_quant_dot(dot, projection, lo, hi)

    def _hand_layers_to_native(self, bfloat16: bool) -> None:
        """Every layer's weights to the native stack; a mixture of experts' layer with no MLP weights of its own
        and its router and experts after (set_layer_experts: the expert-grouped step, native/csrc/experts.h)."""
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            mlp_norm = layer.pre_feedforward_layernorm if layer.sandwich else layer.post_attention_layernorm
            moe = isinstance(mlp, SparseMoE)
            gate_up, down = (None, None) if moe else (mlp.gate_up_proj, mlp.down_proj)
            self.native.add_layer(
                _norm_weight(layer.input_layernorm), _stack_weight(attn.qkv_proj), _bias(attn.qkv_proj),
                _stack_weight(attn.o_proj), _norm_weight(mlp_norm), _stack_weight(gate_up), _bias(gate_up),
                _stack_weight(down), _bias(down),
                *(_plain(module, bfloat16) for module in (attn.qkv_proj, attn.o_proj, gate_up, down)),
            )
            if moe:
                self.native.set_layer_experts(i, _stack_weight(mlp.router), mlp.gate_up_proj.expert_weights(),
                                              mlp.down_proj.expert_weights(), mlp.top_k, mlp.normalize, mlp.width)

    def _pack_experts(self, kernels: ModuleType, width: int, bfloat16: bool) -> None:
        """Pack each mixture of experts' router and float experts (quantized ones are taken as they are)."""
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoE):
                for module in (layer.mlp.router, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                    if isinstance(module, (Linear, ExpertLinears)):
                        module.pack(kernels, width, bfloat16=bfloat16)

    def step_experts(self) -> list[int]:
        """The distinct experts each mixture-of-experts layer's rows chose in the last step, in layer order (empty
        for a dense model): what the step profile sets beside the cost model's expectation."""
        if self.native is not None:
            return list(self.native.step_experts())
        return [layer.mlp.step_experts for layer in self.layers if isinstance(layer.mlp, SparseMoE)]

    def use_kv_layout(self, kv_slots: list[tuple[int, int]]) -> None:
        """Keep each layer's K/V where a grouped layout puts it: (its KV group, its index in the cache tensor)
        per layer (conveyor.core.kv.groups, KVLayout.layer_slots); the native stack is told too."""
        self.kv_slots = list(kv_slots)
        if self.native is not None:
            self._hand_family_to_native()

    def _hand_family_to_native(self) -> None:
        """What the family changes in Llama's layers, told to the native stack: the embedding and attention
        scales, the activation and the windowed layers' rope model-wide; per layer its QK-norm, the norms after
        attention and the MLP, its window and where its K/V lives."""
        c, none = self.config, torch.empty(0)
        local = self.rotary_local
        self.native.set_family(c.hidden_size**0.5 if self.family.embedding_scale else 1.0,
                               self.layers[0].self_attn.scale if self.layers else 1.0, c.hidden_act,
                               none if local is None else local.cos, none if local is None else local.sin,
                               c.clip_qkv or 0.0)
        for i, (layer, (group, slot)) in enumerate(zip(self.layers, self.kv_slots, strict=True)):
            attn = layer.self_attn
            q_norm, k_norm = ((_norm_weight(attn.q_norm), _norm_weight(attn.k_norm)) if hasattr(attn, "q_norm")
                              else (none, none))
            outputs = ((_norm_weight(layer.post_attention_layernorm), _norm_weight(layer.post_feedforward_layernorm))
                       if layer.sandwich else (none, none))
            self.native.set_layer_traits(i, q_norm, k_norm, *outputs, attn.window or 0, layer.local, group, slot)

    def _pack_projections(self, kernels: ModuleType, width: int, bfloat16: bool, keep: set[str]) -> None:
        """Pack every projection into one buffer on huge pages, in the order a step reads them: a decode step
        is then nearly one stream (kernels.cpp, huge_page_buffer). Each plain weight is freed as soon as it is
        packed, except the projections in ``keep`` and a LM head tied to the embedding."""
        named = [(name, module) for name, module in self._projections() if isinstance(module, Linear)]
        if not named:  # every projection is quantized: nothing to pack
            return
        shapes = [kernels.packed_shape(m.out_features, m.in_features, width, bfloat16) for _, m in named]
        sizes = [math.prod(shape) for shape in shapes]
        buffer = kernels.huge_page_buffer(sum(sizes), bfloat16)
        tied = getattr(self.lm_head, "weight", None) is self.embed_tokens.weight  # a quantized head has no weight
        for (name, module), shape, part in zip(named, shapes, buffer.split(sizes), strict=True):
            keep_weight = name in keep or (module is self.lm_head and tied)
            module.pack(kernels, width, keep_weight=keep_weight, bfloat16=bfloat16, out=part.view(shape))

    @property
    def quantized(self) -> bool:
        """Whether some projection keeps its weight quantized (conveyor.model.quant.linear)."""
        return any(not isinstance(module, (Linear, ExpertLinears))
                   for module in [*(m for _, m in self._projections()), *self._expert_modules()])

    def _projections(self) -> list[tuple[str, nn.Module]]:
        """Every Linear a step runs on all its rows, in the order a step runs them, with the name its shape class
        goes by (each layer's share one name per projection); a mixture of experts' are _expert_modules."""
        named = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            named += [("qkv", attn.qkv_proj), ("o", attn.o_proj)]
            if not isinstance(mlp, SparseMoE):
                named += [("gate_up", mlp.gate_up_proj), ("down", mlp.down_proj)]
        return [*named, ("lm_head", self.lm_head)]

    def _expert_modules(self) -> list[nn.Module]:
        """Each mixture of experts' router and stacked projections, in layer order."""
        return [module for layer in self.layers if isinstance(layer.mlp, SparseMoE)
                for module in (layer.mlp.router, layer.mlp.gate_up_proj, layer.mlp.down_proj)]

    def stored_weight_bits(self) -> tuple[float, float]:
        """Bits a weight takes as the model stores it, scales included: over the layers' projections (every
        expert's included), and over the LM head (what a decode step reads: the roofline's and the cost model's
        weight format)."""
        layers = [module for name, module in self._projections() if name != "lm_head"] + self._expert_modules()
        return _bits_per_weight(layers), _bits_per_weight([self.lm_head])

    def quantized_weights(self) -> dict[str, object]:
        """One quantized weight of each projection shape (the first layer's, and the LM head's): what the choice
        of dot-product kinds times (:mod:`conveyor.model.quant.dot_choice`)."""
        named = {}
        for name, module in self._projections():
            if getattr(module, "quantized", None) is not None:
                named.setdefault(name, module.quantized)
        return named

    def projection_weights(self) -> dict[str, torch.Tensor]:
        """One weight [N, K] of each projection shape (the first layer's, and the LM head's): what a kernel
        choice times (:mod:`conveyor.model.quant.kernel_choice`)."""
        named = {}
        for name, module in self._projections():
            named.setdefault(name, module.weight.detach())
        return named

    def zeroed_kv_cache(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The KV cache, zeroed and resident. For the native stack, on huge pages where Linux grants them: a step's
        attention reads blocks that lie anywhere in the cache, and on 4 KiB pages each block is a TLB miss or more
        (measured in a decode step at context 128 on Zen 4: attention 0.62 ms on 4 KiB pages, 0.54 on 2 MiB).

        Written through once here, as llama.cpp clears its KV buffer, so that no step pays for the pool's pages.
        Fresh pages become resident when first written, and the block allocator hands out every free block
        before it reuses one (prefix caching keeps what freed blocks hold for as long as it can), so requests
        walk through the whole pool; a block's K and V lie in one page per layer, and the first block written in
        each run of about 170 faulted in 60 huge pages inside one step. Measured on a 2-core Zen 5 VM, 320
        prompts of 128 tokens one after another on a fresh engine (the default 2 GiB pool): 60 ms a prompt step
        on average and stalls of up to 400 ms, against 47-50 ms and none with the pool written here; the write
        itself took 2.2 s for 2 GiB in a fresh process (most of it the VM's host backing the memory), 0.1 s
        where the memory had been used before."""
        if self.kernels is None or device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=device)
        if dtype == torch.uint8:  # fp8 bits: a float32 buffer of a quarter the elements, seen as bytes
            numel = math.prod(shape)
            buffer = self.kernels.huge_page_buffer(-(-numel // 4), False)
            cache = buffer.view(torch.uint8)[:numel].view(shape)
        else:  # float32, or a bfloat16 buffer's 2-byte elements seen as the cache's (bfloat16, float16)
            buffer = self.kernels.huge_page_buffer(math.prod(shape), dtype.itemsize == 2)
            cache = buffer.view(dtype).view(shape)
        buffer.zero_()
        return cache

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in float32 for the rows that are sampled, and only those."""
        return self.lm_head(hidden).float()


def _bits_per_weight(modules: list[nn.Module]) -> float:
    """Stored bits over weights of some projections: quantized codes and scales, a packed copy, or the plain
    weight (whichever a step reads)."""
    weights = stored = 0
    for module in modules:
        weights += module.in_features * module.out_features
        quantized = getattr(module, "quantized", None)
        if hasattr(module, "stored_bytes"):  # a mixture's experts, each its own weight
            stored += module.stored_bytes()
        elif quantized is not None:
            stored += quantized.bytes
        else:
            tensor = module.packed if module.packed is not None else module.weight
            stored += tensor.numel() * tensor.element_size()
    return 8.0 * stored / weights


def _norm_weight(norm: nn.Module) -> torch.Tensor:
    """A norm's weight as the native stack scales by it, in float32: w, or 1 + w for a (1 + w) norm (Gemma's:
    added in float32, as its reference computes it)."""
    weight = _f32(norm.weight)
    return (1.0 + weight).contiguous() if norm.one_plus else weight


def _f32(t: torch.Tensor) -> torch.Tensor:
    """A norm weight or bias as the native stack takes it: float32 on every stack (a copy for other dtypes)."""
    return t.detach().float().contiguous()


def _stack_weight(layer: nn.Module | None) -> object:
    """A projection's weight as the native stack takes it: packed (Linear.pack), or quantized as it is; None (a
    mixture of experts' layer has no MLP weights of its own): empty."""
    if layer is None:
        return torch.empty(0)
    quantized = getattr(layer, "quantized", None)
    return quantized if quantized is not None else layer.packed


def _plain(layer: nn.Module, bfloat16: bool) -> torch.Tensor:
    """A projection's plain weight as the native stack takes it, in the stack's dtype: kept for torch's GEMM,
    else empty (always for a quantized projection)."""
    if not isinstance(layer, Linear):
        return _no_weight(bfloat16)
    weight = layer.weight.detach()
    return weight.to(torch.bfloat16 if bfloat16 else torch.float32) if weight.numel() else _no_weight(bfloat16)


def _no_weight(bfloat16: bool) -> torch.Tensor:
    """The empty tensor the native stack takes for "no plain weight", in its dtype."""
    return torch.empty(0, dtype=torch.bfloat16 if bfloat16 else torch.float32)


def _bias(layer: Linear | None) -> torch.Tensor:
    """The native stack takes an empty tensor for "no bias"."""
    return torch.empty(0) if layer is None or layer.bias is None else _f32(layer.bias)
