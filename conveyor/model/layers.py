"""The layers every family is built of, each reading its family's description (conveyor.model.families).

RMSNorm (w or 1 + w), rotary embeddings (one table per layer kind where local and global layers differ),
grouped-query attention with an optional QK-norm and window, and a gated MLP (SwiGLU or GeGLU). Q, K and V
share one projection, as do gate and up, so that a layer runs two large GEMMs instead of five small ones.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.core.model_config import ModelConfig
from conveyor.model.attention import AttentionMetadata, paged_attention
from conveyor.model.families import Family, rope_kind

# A layer's projections under our names and the HF ones each stands for (the fused ones join theirs in this
# order, weights and biases alike): what every loader maps a checkpoint's layer through.
LAYER_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
Rope = tuple[torch.Tensor, torch.Tensor]


def checkpoint_projections(family: Family) -> dict[str, tuple[str, ...]]:
    """Our projections and the checkpoint tensors each is read from: LAYER_PROJECTIONS, or for a family whose
    checkpoints store them fused already (Phi-3), each from its own name."""
    if family.fused_projections:
        return {ours: (ours,) for ours in LAYER_PROJECTIONS}
    return LAYER_PROJECTIONS


class Linear(nn.Linear):
    """``nn.Linear`` that can move its weight to the native kernel's packed layout.

    Packed, the weight is tiles of 16 output columns (32 for the 512-bit
    kernels), each contiguous, which a decode step streams at close to memory
    bandwidth (see model/native/csrc/gemm.h). Packed in bfloat16, the tiles hold pairs
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
    """RMSNorm, normalised in float32 whatever the dtype, as the reference implementations do. ``one_plus``:
    scaled by 1 + w (Gemma, whose stored weights sit around 0), in float32 before the cast back, as Gemma's
    reference does; else by w after the cast, as Llama's does."""

    def __init__(self, size: int, eps: float, one_plus: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if one_plus else torch.ones(size))
        self.eps = eps
        self.one_plus = one_plus

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.one_plus:
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)


def make_norm(family: Family, size: int, eps: float) -> RMSNorm:
    return RMSNorm(size, eps, one_plus=family.norm == "rms_one_plus")


def _rope_inv_freq(dim: int, theta: float, scaling: dict[str, Any], trained_positions: int,
                   max_model_len: int) -> tuple[torch.Tensor, float]:
    """The inverse frequencies and the factor cos and sin are scaled by (YaRN's and longrope's attention factor;
    1 for the others), as transformers' modeling_rope_utils computes them; longrope's by the set of factors
    ``max_model_len`` picks (_longrope_factors). ``trained_positions``: the config's max_position_embeddings."""
    # float32 throughout, as the reference implementation computes it, so angles agree bit for bit.
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = rope_kind(scaling)
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(dim, theta, scaling, trained_positions)
    if kind == "longrope":
        factors = _longrope_factors(scaling, max_model_len)
        return _longrope_inv_freq(dim, theta, factors), _longrope_attention_factor(scaling, trained_positions)
    raise ValueError(f"model: rope_scaling type {kind!r} is not supported (supported: default, linear, llama3, "
                     "yarn, longrope)")


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


def _yarn_inv_freq(dim: int, theta: float, scaling: dict, trained_positions: int) -> tuple[torch.Tensor, float]:
    """YaRN (Qwen2.5, Qwen3): frequencies interpolated by ``factor`` below the band the original context turns
    fewer than ``beta_slow`` times, kept above the one it turns more than ``beta_fast`` times, blended linearly
    between; cos and sin scaled by 0.1 ln(factor) + 1 (or the ratio of two such with ``mscale`` and
    ``mscale_all_dim``, or ``attention_factor`` as given)."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or trained_positions / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def band_edge(rotations: float) -> float:  # the dimension whose wavelength fits ``rotations`` in the context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = band_edge(beta_fast), band_edge(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as the reference: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    kept = 1 - ramp  # the share of each frequency extrapolated (kept as it was trained)
    return (1.0 / (factor * pos_freqs)) * (1 - kept) + (1.0 / pos_freqs) * kept, float(attention_factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _longrope_factors(scaling: dict, max_model_len: int) -> list[float]:
    """longrope's one set of factors for an engine, by vLLM's rule (Phi3LongRoPEScaledRotaryEmbedding): the long
    ones where the engine's max_model_len exceeds the original context, else the short ones, at every position
    of every sequence. transformers picks per forward pass instead, by the sequence's length, and Phi-3's
    generation computes its cache again when a sequence grows past the original context; one table keeps what
    a cached key means fixed, so steps stay the scheduler's and blocks stay shareable (docs/models.md)."""
    long = max_model_len > scaling["original_max_position_embeddings"]
    return scaling["long_factor"] if long else scaling["short_factor"]


def _longrope_inv_freq(dim: int, theta: float, factors: list[float]) -> torch.Tensor:
    """LongRoPE (Phi-3 128k, Phi-3.5): each frequency divided by its own factor."""
    ext = torch.tensor(factors, dtype=torch.float32)
    return 1.0 / (ext * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _longrope_attention_factor(scaling: dict, trained_positions: int) -> float:
    """sqrt(1 + ln(scale) / ln(original)), scale being max_position_embeddings / original (or ``factor``),
    unless the config gives ``attention_factor``."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    scale = scaling.get("factor") or trained_positions / original
    return 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(original))


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, looked up once per step: the global layers' rope, or with
    ``local`` the windowed layers' own (Gemma 3's base 10000 beside the global 1e6). ``max_positions`` is the
    engine's max_model_len (runner.load hands it down): the positions the tables hold, and for longrope which
    of its two sets of factors they are made of (_longrope_factors)."""

    def __init__(self, config: ModelConfig, max_positions: int, local: bool = False) -> None:
        super().__init__()
        theta, scaling = config.rope_theta, config.rope_scaling
        if local:
            theta, scaling = config.local_rope_theta, config.local_rope_scaling
        inv_freq, attention_factor = _rope_inv_freq(config.head_dim, theta, scaling, config.max_position_embeddings,
                                                    max_positions)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        # Times the attention factor as the reference scales them (times 1.0: unchanged, bit for bit).
        self.register_buffer("cos", angles.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", angles.sin() * attention_factor, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Grouped-query attention over the paged cache; with the family's QK-norm before rope (over each head, or
    over the whole query and key projections before they are split into heads), Q, K and V clamped where the
    config clips them, and over the last ``window`` positions only where the layer has one."""

    def __init__(self, config: ModelConfig, family: Family, window: int | None) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.window = window
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.qk_norm, self.clip = family.qk_norm, config.clip_qkv
        if family.qk_norm:
            per_head = family.qk_norm == "head"
            self.q_norm = make_norm(family, config.head_dim if per_head else self.q_size, config.rms_norm_eps)
            self.k_norm = make_norm(family, config.head_dim if per_head else self.kv_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(n, self.num_heads, self.head_dim), k.view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, self.window)
        return self.o_proj(out.reshape(n, self.q_size))


ACTIVATION_FNS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with silu, GeGLU with tanh GELU."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.act = ACTIVATION_FNS[config.hidden_act]
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


class ExpertLinears(nn.Module):
    """One projection of every expert, stacked: weight [experts, out, in]. ``in_features`` and ``out_features``
    count all experts' outputs, so the weight counts of a model's projections (stored bits, the roofline) hold.
    Packed (:meth:`pack`), each expert's weight becomes a packed tile layout of its own, as a Linear's does,
    for the native stack's expert-grouped step."""

    def __init__(self, num_experts: int, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, num_experts * out_features
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))
        self.packed: list[torch.Tensor] | None = None

    def pack(self, kernels: ModuleType, width: int = 256, bfloat16: bool = False) -> None:
        """Pack each expert for the kernels of ``width`` bits (bfloat16 if asked); the stacked weight is freed."""
        self.packed = [kernels.pack_linear_weight(matrix.detach().contiguous(), width, bfloat16, None)
                       for matrix in self.weight]
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def expert_weights(self) -> list[object]:
        """Each expert's weight as the native stack takes it (packed)."""
        if self.packed is None:
            raise RuntimeError("the experts are not packed for the native kernels (pack)")
        return list(self.packed)

    def stored_bytes(self) -> int:
        """What a step that touches every expert reads of this projection."""
        tensors = self.packed if self.packed is not None else [self.weight]
        return sum(t.numel() * t.element_size() for t in tensors)


class SparseMoE(nn.Module):
    """A mixture of experts in place of the MLP: the router's softmax picks each token's top-k experts (their
    probabilities scaled to sum to 1 where the config says), each expert is a gated MLP, and a token's output is
    its experts' outputs weighted by those probabilities. The plain reference: a loop over the experts some
    token picked, each run on the rows that picked it, in the order and dtypes transformers runs them."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        experts, hidden, width = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.top_k, self.normalize, self.width = config.num_experts_per_tok, config.norm_topk_prob, width
        self.step_experts = 0  # the distinct experts the last step's rows chose (on PyTorch ops)
        self.act = ACTIVATION_FNS[config.hidden_act]
        self.router = Linear(hidden, experts, bias=False)
        self.gate_up_proj = ExpertLinears(experts, hidden, 2 * width)
        self.down_proj = ExpertLinears(experts, width, hidden)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's experts [rows, k] and their weights [rows, k] (in x's dtype)."""
        logits = F.linear(x, self.router.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(logits.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        out = torch.zeros_like(x)
        chosen = experts.unique().tolist()
        self.step_experts = len(chosen)  # the distinct experts this step's rows chose (Decoder.step_experts)
        for expert in chosen:
            rows, slot = torch.where(experts == expert)
            gate, up = F.linear(x[rows], self.gate_up_proj.weight[expert]).chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, self.down_proj.weight[expert])
            out.index_add_(0, rows, (y * weights[rows, slot, None]).to(out.dtype))
        return out


class DecoderLayer(nn.Module):
    """Attention and MLP, each in a residual branch with a norm before it (and, for sandwich-norm families,
    one after it too). The norms keep their HF names: in Llama ``post_attention_layernorm`` is the MLP's
    input norm, in Gemma the norm of attention's output."""

    def __init__(self, config: ModelConfig, family: Family, layer: int) -> None:
        super().__init__()
        self.local = config.layer_window(layer) is not None and config.local_rope_theta is not None
        self.sandwich = family.sandwich_norms
        for name in family.layer_norms:
            if "." not in name:
                setattr(self, name, make_norm(family, config.hidden_size, config.rms_norm_eps))
        self.self_attn = Attention(config, family, config.layer_window(layer))
        self.mlp = SparseMoE(config) if config.layer_has_experts(layer) else MLP(config)

    def forward(self, x: torch.Tensor, ropes: tuple[Rope, Rope | None], kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        rope = ropes[1] if self.local else ropes[0]
        if not self.sandwich:
            x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
