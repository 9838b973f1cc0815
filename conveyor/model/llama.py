"""A Llama-family decoder over a flat batch of tokens and a paged KV cache.

RMSNorm, rotary embeddings, grouped-query attention and a SwiGLU MLP. Q, K and
V share one projection, as do gate and up, so that a layer runs two large
GEMMs instead of five small ones. The model only ever sees the flat token
batch the executor packed; which request a token belongs to is known only
to the attention metadata.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.core.model_config import ModelConfig
from conveyor.model.attention import AttentionMetadata, paged_attention

PROJECTIONS = ("qkv", "o", "gate_up", "down", "lm_head")  # the GEMM shapes of a step, by projection
# A layer's projections under our names and the HF ones each stands for (the fused ones join theirs in this
# order, weights and biases alike): what every loader maps a checkpoint's layer through.
LAYER_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")


@dataclass(slots=True)
class StepInputs:
    """One step's inputs as plain lists: row ``r`` holds token ``token_ids[r]`` at ``positions[r]``, writes
    its K/V to cache slot ``slots[r]`` and belongs to sequence ``row_seq[r]``, whose blocks are
    ``block_tables[row_seq[r]]``; the LM head runs on ``logit_rows``. The native stack takes them as they are
    (run_native); the PyTorch path makes tensors of them."""

    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    block_tables: list[list[int]]
    row_seq: list[int]
    logit_rows: list[int]


class Linear(nn.Linear):
    """``nn.Linear`` that can move its weight to the native kernel's packed layout.

    Packed, the weight is tiles of 16 output columns (32 for the 512-bit
    kernels), each contiguous, which a decode step streams at close to memory
    bandwidth (see csrc/gemm.h). Packed in bfloat16, the tiles hold pairs
    of consecutive inputs side by side, at half the bytes; inputs and outputs
    stay float32 either way. Row counts in ``torch_rows`` (inclusive ranges)
    run torch's own GEMM on the plain weight instead, which then stays.
    """

    kernels: ModuleType | None = None
    packed: torch.Tensor | None = None
    torch_rows: tuple[tuple[int, int], ...] = ()

    def pack(self, kernels: ModuleType, width: int = 256, keep_weight: bool = False, bfloat16: bool = False,
             out: torch.Tensor | None = None) -> None:
        """Pack for the kernels of ``width`` bits (the layout follows that path's tile), in bfloat16 if asked;
        into ``out`` if given (a view of the model's weight buffer, of ``kernels.packed_shape``)."""
        self.kernels = kernels
        self.packed = kernels.pack_linear_weight(self.weight.detach().contiguous(), width, bfloat16, out)
        if not keep_weight:  # the plain copy would double the model's memory
            self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        if any(lo <= x.shape[0] <= hi for lo, hi in self.torch_rows):
            return F.linear(x.to(self.weight.dtype), self.weight, self.bias).float()
        y = self.kernels.packed_linear(x.float(), self.packed, self.out_features)
        return y if self.bias is None else y + self.bias.float()


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the dtype, as the reference implementation does.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    # float32 throughout, as the reference implementation computes it, so angles agree bit for bit.
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    kind = scaling.get("rope_type", scaling.get("type")) if scaling else None
    if kind is None:
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent stretch: long wavelengths scaled, short kept."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > original / low, inv_freq / factor, blended)
    return torch.where(wavelen < original / high, inv_freq, out)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, looked up once per step."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq = _rope_inv_freq(config)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(n, self.num_heads, self.head_dim), *rope)
        k = apply_rope(k.view(n, self.num_kv_heads, self.head_dim), *rope)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(n, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """The decoder in PyTorch ops (any device and dtype, and the reference), or, once
    :meth:`use_native_kernels` has run, the same layers in one native call per step (on CPU: float32, or
    bfloat16 weights and KV cache with float32 activations)."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, max_positions)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.native = None  # the kernels' NativeLlama, holding the packed layers
        self.kernels: ModuleType | None = None  # the native kernels' module, once use_native_kernels has run

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states of every token; ``kv_cache`` is [layers, 2, blocks, block_size, kv_heads, head_dim]."""
        if self.native is not None:
            raise RuntimeError("this model runs as one native stack (use_native_kernels): step it with run_native")
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions, x.dtype)
        for layer, layer_cache in zip(self.layers, kv_cache):
            x = layer(x, rope, layer_cache, meta)
        return self.norm(x)

    def run_native(self, step: StepInputs, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """One step on the native stack: the final hidden states of every row and the logits of
        ``step.logit_rows``, both float32, and each logit row's argmax (its greedy token, found while the logits
        were in cache). Embedding, every layer and the LM head run in that one call, and its
        inputs go in as the lists the executor built: at batch 1 each tensor built, indexed or cast around the
        call cost a cold cache's worth of time after the weights streamed through."""
        return self.native.step(step.token_ids, step.positions, kv_cache, step.slots, step.block_tables,
                                step.row_seq, step.logit_rows)

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
        routes = {name: tuple(ranges) for name, ranges in (torch_rows or {}).items() if ranges}
        unknown = set(routes) - set(PROJECTIONS)
        if unknown:
            raise ValueError(f"torch_rows: no projection named {sorted(unknown)} (expected {PROJECTIONS})")
        self.kernels = kernels
        self._pack_projections(kernels, width, bfloat16, keep=set(routes))
        self.lm_head.torch_rows = routes.get("lm_head", ())
        if self.rotary.cos.dtype != torch.float32:  # a model cast to bfloat16 cast its tables: build them again
            self.rotary = RotaryEmbedding(self.config, self.rotary.cos.shape[0]).to(self.rotary.cos.device)
        c = self.config
        self.native = kernels.NativeLlama(
            c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size, c.intermediate_size, c.rms_norm_eps,
            _f32(self.norm.weight), width, bfloat16,
        )
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.native.add_layer(
                _f32(layer.input_layernorm.weight), _stack_weight(attn.qkv_proj), _bias(attn.qkv_proj),
                _stack_weight(attn.o_proj), _f32(layer.post_attention_layernorm.weight),
                _stack_weight(mlp.gate_up_proj), _bias(mlp.gate_up_proj), _stack_weight(mlp.down_proj),
                _bias(mlp.down_proj),
                *(_plain(module, bfloat16) for module in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                                          mlp.down_proj)),
            )
        # Only a routed LM head hands over its plain weight (a tied one keeps the embedding's, not needed else).
        head_plain = _plain(self.lm_head, bfloat16) if "lm_head" in routes else _no_weight(bfloat16)
        embedding = getattr(self.embed_tokens, "quantized", None) or self.embed_tokens.weight.detach()
        self.native.set_io(embedding, self.rotary.cos, self.rotary.sin, _stack_weight(self.lm_head), head_plain)
        for name, ranges in routes.items():
            for lo, hi in ranges:
                self.native.route_to_torch(name, lo, hi)
        if fused_swiglu_rows is not None:
            self.native.fuse_swiglu_at(list(fused_swiglu_rows))
        for projection, ranges in (quant_dots or {}).items():  # quantized projections: the kind per row class
            for dot, lo, hi in ranges:
                self.native.use_quant_dot(dot, projection, lo, hi)

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
        tied = self.lm_head.weight is self.embed_tokens.weight
        for (name, module), shape, part in zip(named, shapes, buffer.split(sizes), strict=True):
            keep_weight = name in keep or (module is self.lm_head and tied)
            module.pack(kernels, width, keep_weight=keep_weight, bfloat16=bfloat16, out=part.view(shape))

    @property
    def quantized(self) -> bool:
        """Whether some projection keeps its weight quantized (conveyor.model.quantized)."""
        return any(not isinstance(module, Linear) for _, module in self._projections())

    def _projections(self) -> list[tuple[str, nn.Module]]:
        """Every Linear, in the order a step runs them, with the name its shape class goes by (each layer's
        share one name per projection)."""
        named = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            named += [("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate_up", mlp.gate_up_proj),
                      ("down", mlp.down_proj)]
        return [*named, ("lm_head", self.lm_head)]

    def stored_weight_bits(self) -> tuple[float, float]:
        """Bits a weight takes as the model stores it, scales included: over the layers' projections, and over
        the LM head (what a decode step reads: the roofline's and the cost model's weight format)."""
        layers = [module for name, module in self._projections() if name != "lm_head"]
        return _bits_per_weight(layers), _bits_per_weight([self.lm_head])

    def quantized_weights(self) -> dict[str, object]:
        """One quantized weight of each projection shape (the first layer's, and the LM head's): what the choice
        of dot-product kinds times (:mod:`conveyor.model.quant_choice`)."""
        named = {}
        for name, module in self._projections():
            if getattr(module, "quantized", None) is not None:
                named.setdefault(name, module.quantized)
        return named

    def projection_weights(self) -> dict[str, torch.Tensor]:
        """One weight [N, K] of each projection shape (the first layer's, and the LM head's): what a kernel
        choice times (:mod:`conveyor.model.kernel_choice`)."""
        named = {}
        for name, module in self._projections():
            named.setdefault(name, module.weight.detach())
        return named

    def zeroed_kv_cache(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The KV cache, zeroed. For the native stack, on huge pages where Linux grants them: a step's attention
        reads blocks that lie anywhere in the cache, and on 4 KiB pages each block is a TLB miss or more
        (measured in a decode step at context 128 on Zen 4: attention 0.62 ms on 4 KiB pages, 0.54 on 2 MiB). Its
        pages are zero until written (kernels.cpp, huge_page_buffer): the pool is resident as far as requests fill
        it, not at its full size from the start."""
        if self.kernels is None or device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=device)
        buffer = self.kernels.huge_page_buffer(math.prod(shape), dtype == torch.bfloat16)
        return buffer.view(shape)

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
        if quantized is not None:
            stored += quantized.bytes
        else:
            tensor = module.packed if module.packed is not None else module.weight
            stored += tensor.numel() * tensor.element_size()
    return 8.0 * stored / weights


def _f32(t: torch.Tensor) -> torch.Tensor:
    """A norm weight or bias as the native stack takes it: float32 on every stack (a copy for other dtypes)."""
    return t.detach().float().contiguous()


def _stack_weight(layer: nn.Module) -> object:
    """A projection's weight as the native stack takes it: packed (Linear.pack), or quantized as it is."""
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


def _bias(layer: Linear) -> torch.Tensor:
    """The native stack takes an empty tensor for "no bias"."""
    return torch.empty(0) if layer.bias is None else _f32(layer.bias)
