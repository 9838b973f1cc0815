"""A roofline cost model of one model step: FLOPs and bytes moved, on a hardware spec.

A step has two parts with different bounds. The dense part (projections,
MLP, LM head on the sampled rows) reads every weight once whatever the
batch, and does 2 FLOPs per weight per token. Attention reads each request's
cached K/V once and does 4 FLOPs per head dimension per query-key pair (QK^T
and PV); its K/V reads, gathered block by block, get a bandwidth efficiency
of their own. Each part takes the longer of its compute time and its memory time;
then come a fixed per-step overhead, a per-request overhead, the all-reduces
of tensor parallelism (two per layer) and any swap copies over the host link.
Activations and norms are left out: next to weights and K/V they are small.

Everything is per device: with tensor parallelism of degree ``tp`` each
device holds ``1/tp`` of the weights and of the KV heads.

Weights may be stored in another format than the activations and K/V are
computed in (``WeightFormat``: a GGUF file's Q4_1 layers are 5 bits a weight):
the bytes a step reads follow the weights' format, so the seed's roofline
stays true for quantized models.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from conveyor.core.formats import FLOAT_BYTES, WeightFormat
from conveyor.core.model_config import ModelConfig
from conveyor.core.scheduler.output import SchedulerOutput
from conveyor.sim.hardware import HardwareSpec


@dataclass(slots=True)
class StepWork:
    """What one model step computes, summed over its requests."""

    num_seqs: int = 0  # requests in the step
    num_tokens: int = 0  # tokens whose activations and K/V are computed
    num_sampled: int = 0  # rows that go through the LM head
    attention_pairs: int = 0  # query-key pairs, per layer and head
    kv_tokens_read: int = 0  # tokens of K/V that attention reads, per layer
    swap_blocks: int = 0  # KV blocks copied between device and host
    decode_context: int = 0  # keys the single-token rows attend to (their pairs; the rest are prompt rows')
    decode_rows: int = 0  # single-token rows
    # Of the decodes' KV blocks, those an earlier decode of the same step reads too (prefix caching shares them):
    # the later reads find the block in cache, and a measured profile prices their keys apart.
    shared_decode_blocks: int = 0

    @property
    def prompt_pairs(self) -> int:
        """Query-key pairs of the prompt chunks' rows: a measured profile prices them apart from decodes'."""
        return self.attention_pairs - self.decode_context


def step_work(output: SchedulerOutput) -> tuple[StepWork, list[str]]:
    """What the step computes, and the requests it samples a token for, in one pass over the scheduled ones
    (most of a simulated step's cost). The simulator prices this; calibration times it on the real engine."""
    sampled: list[str] = []
    num_tokens = attention_pairs = kv_tokens_read = decode_context = decode_rows = num_drafted_rows = 0
    # Blocks read by the step's decodes so far, kept only where some block is held by two requests at once.
    seen: set[int] | None = set() if output.memory is not None and output.memory.shared_slots else None
    shared_blocks = 0
    for item in output.scheduled:
        start, chunk = item.start_position, len(item.token_ids)
        context = start + chunk
        num_tokens += chunk
        kv_tokens_read += context
        if chunk == 1:  # a decode's one query sees its whole context (chunk_attention_pairs(start, 1))
            attention_pairs += context
            decode_context += context
            decode_rows += 1
        elif item.num_draft_tokens:  # a decode and its drafts: rows one at a time, each with its LM head row
            keys = chunk_attention_pairs(start, chunk)
            attention_pairs += keys
            decode_context += keys
            decode_rows += chunk
            num_drafted_rows += chunk - 1
        else:
            attention_pairs += chunk_attention_pairs(start, chunk)
        if seen is not None and (chunk == 1 or item.num_draft_tokens):
            shared_blocks += read_again(item.block_ids, seen)
        if item.draws_token:
            sampled.append(item.request_id)
    swap_blocks = len(output.blocks_to_swap_in) + len(output.blocks_to_swap_out)
    grouped, context = output.num_grouped_decodes, output.grouped_decode_context  # decodes counted, not listed
    work = StepWork(len(output.scheduled) + grouped, num_tokens + grouped, len(sampled) + grouped + num_drafted_rows,
                    attention_pairs + context, kv_tokens_read + context, swap_blocks, decode_context + context,
                    decode_rows + grouped, shared_blocks)
    return work, sampled


def read_again(block_ids: list[int], seen: set[int]) -> int:
    """How many of a decode's blocks an earlier decode of the step read; adds the others to ``seen``. (Only full
    blocks are shared; a step whose fast-forward group is only counted is listed first where blocks are shared:
    SimulatedExecutor.execute.)"""
    before = len(seen)
    seen.update(block_ids)
    return len(block_ids) - (len(seen) - before)


def chunk_attention_pairs(start: int, num_tokens: int) -> int:
    """Query-key pairs of ``num_tokens`` causal queries at positions ``start...`` (each sees itself and before)."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


def attention_params(model: ModelConfig) -> int:
    h, d = model.hidden_size, model.head_dim
    return h * model.num_heads * d * 2 + h * model.num_kv_heads * d * 2  # q and o; k and v


def expert_params(model: ModelConfig) -> int:
    """One expert's weights (its gate, up and down) in one layer; 0 for a dense model."""
    return 3 * model.hidden_size * model.moe_intermediate_size if model.num_experts else 0


def moe_layers(model: ModelConfig) -> int:
    return sum(1 for layer in range(model.num_layers) if model.layer_has_experts(layer))


def shared_layer_params(model: ModelConfig) -> int:
    """The layers' weights every step reads whatever its tokens: attention everywhere, the MLP of dense layers,
    and the routers of mixture-of-experts layers (their experts are read as tokens pick them)."""
    moe = moe_layers(model)
    dense = model.num_layers - moe
    return (model.num_layers * attention_params(model) + dense * 3 * model.hidden_size * model.intermediate_size
            + moe * model.num_experts * model.hidden_size)


def expected_experts(num_experts: int, top_k: int, num_tokens: int) -> float:
    """The distinct experts of one layer that ``num_tokens`` tokens pick, each ``top_k`` of ``num_experts``
    uniformly: E (1 - (1 - k/E)^B). At one token the k it picked; as the batch grows, every expert."""
    if not num_experts or not num_tokens:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def total_params(model: ModelConfig) -> int:
    """Parameters held in memory: layers (every expert), embedding, LM head unless tied, and the norms."""
    embeddings = model.vocab_size * model.hidden_size * (1 if model.tie_word_embeddings else 2)
    norms = (2 * model.num_layers + 1) * model.hidden_size
    experts = moe_layers(model) * model.num_experts * expert_params(model)
    return shared_layer_params(model) + experts + embeddings + norms


class CostModel:
    def __init__(self, model: ModelConfig, hardware: HardwareSpec, dtype: str, tensor_parallel_size: int = 1,
                 weights: WeightFormat | None = None, kv_element_bytes: int | None = None) -> None:
        if dtype not in FLOAT_BYTES:
            raise ValueError(f"dtype must be one of {', '.join(FLOAT_BYTES)}, got {dtype!r}")
        tp = tensor_parallel_size
        if tp < 1 or model.num_heads % tp:
            raise ValueError(f"tensor_parallel_size {tp} must be >= 1 and divide the {model.num_heads} attention heads")
        if tp > 1 and not hardware.interconnect_bandwidth:
            raise ValueError(f"hardware {hardware.name} has no interconnect_bandwidth: no tensor parallelism")
        self.model = model
        self.hardware = hardware
        self.dtype = dtype
        self.tensor_parallel_size = tp
        b = FLOAT_BYTES[dtype]
        h, layers = model.hidden_size, model.num_layers
        kv_heads = max(model.num_kv_heads // tp, 1)  # fewer KV heads than devices: each device keeps a copy
        shared, expert, moe = shared_layer_params(model), expert_params(model), moe_layers(model)
        # Per device.
        self.weights = weights or model.weight_format or WeightFormat(dtype, 8 * b, 8 * b)
        layer_b, head_b = self.weights.layer_bits / 8, self.weights.lm_head_bits / 8
        self.dense_weight_bytes = shared * layer_b / tp  # read by every step
        # One expert of every mixture-of-experts layer (0 for a dense model): a step reads as many as its
        # tokens pick (weights_read).
        self.expert_bytes = moe * expert * layer_b / tp
        self.lm_head_bytes = model.vocab_size * h * head_b / tp  # read by steps that sample
        layer_bytes = self.dense_weight_bytes + model.num_experts * self.expert_bytes
        layer_params = shared + moe * model.num_experts * expert
        self.weight_bytes = layer_bytes + (total_params(model) - layer_params) * head_b / tp
        self.dense_flops_per_token = 2 * (shared + moe * model.num_experts_per_tok * expert) / tp
        self.lm_head_flops_per_row = 2 * model.vocab_size * h / tp
        self.attention_flops_per_pair = 4 * layers * (model.num_heads // tp) * model.head_dim
        # K and V, all layers, in the cache's dtype (--kv-cache-dtype; None: the model's).
        self.kv_bytes_per_token = 2 * layers * kv_heads * model.head_dim * (kv_element_bytes or b)
        self.allreduce_bytes_per_token = h * b  # one hidden vector per token, twice per layer
        self.flops = hardware.flops(dtype) * hardware.flops_efficiency
        self.bandwidth = hardware.memory_bandwidth * hardware.bandwidth_efficiency
        self.kv_bandwidth = self.bandwidth * hardware.attention_efficiency
        # What serving adds to a step per token sampled in it, beyond the engine's step (the stream's events to
        # each client, and on a machine that also runs the clients, their work): 0 prices the offline engine.
        # The simulated executor adds it to every step; ``with_serving_overhead`` sets it.
        self.serving_s_per_token = 0.0
        # What serving adds to each request's time to first token and latency outside the steps: its way in (the
        # HTTP request, until the engine holds it) and its first token's way out to the client. The figures add
        # it to every finished request; 0 for the offline engine.
        self.serving_s_per_request = 0.0
        # How much longer than their prices the machine's steps take now: a validation measures it around each
        # real run (``with_pace``), since a shared machine's speed drifts by a fifth within minutes; 1 elsewhere.
        self.pace = 1.0

    def weights_read(self, num_tokens: int) -> float:
        """The layers' bytes a step of ``num_tokens`` tokens reads: every shared weight, and of a mixture of
        experts the experts its tokens pick (expected_experts), each once however many tokens picked it."""
        if not self.expert_bytes:
            return self.dense_weight_bytes
        model = self.model
        return self.dense_weight_bytes + self.expert_bytes * expected_experts(
            model.num_experts, model.num_experts_per_tok, num_tokens)

    def dense_time(self, num_tokens: int, num_sampled: int) -> float:
        flops = num_tokens * self.dense_flops_per_token + num_sampled * self.lm_head_flops_per_row
        weight_bytes = self.weights_read(num_tokens) + (self.lm_head_bytes if num_sampled else 0.0)
        return max(flops / self.flops, weight_bytes / self.bandwidth)

    def attention_time(self, attention_pairs: int, kv_tokens_read: int, num_tokens: int) -> float:
        flops = attention_pairs * self.attention_flops_per_pair
        moved = (kv_tokens_read + num_tokens) * self.kv_bytes_per_token  # cached K/V read, new K/V written
        return max(flops / self.flops, moved / self.kv_bandwidth)

    def allreduce_time(self, num_tokens: int) -> float:
        tp = self.tensor_parallel_size
        if tp == 1:
            return 0.0
        hw = self.hardware
        # Ring all-reduce: each device sends and receives 2 (tp - 1) / tp of the buffer.
        per_call = hw.allreduce_latency_s + 2 * (tp - 1) / tp * num_tokens * self.allreduce_bytes_per_token / (
            hw.interconnect_bandwidth
        )
        return 2 * self.model.num_layers * per_call

    def swap_time(self, num_blocks: int, block_size: int) -> float:
        return num_blocks * block_size * self.kv_bytes_per_token / self.hardware.host_link_bandwidth

    def overhead(self, num_seqs: int) -> float:
        return self.hardware.step_overhead_s + num_seqs * self.hardware.per_sequence_overhead_s

    def step_time(self, work: StepWork, block_size: int = 16) -> float:
        """Seconds one model step takes."""
        if not work.num_tokens:
            return self.swap_time(work.swap_blocks, block_size)
        return (
            self.overhead(work.num_seqs)
            + self.dense_time(work.num_tokens, work.num_sampled)
            + self.attention_time(work.attention_pairs, work.kv_tokens_read, work.num_tokens)
            + self.allreduce_time(work.num_tokens)
            + self.swap_time(work.swap_blocks, block_size)
        )

    def decode_time(self, num_seqs: int, context_tokens: int) -> float:
        """A step of ``num_seqs`` single-token decodes attending to ``context_tokens`` keys in all.

        The same sum as :meth:`step_time`, written out for the roofline's decode steps.
        """
        hw = self.hardware
        dense = max(
            num_seqs * (self.dense_flops_per_token + self.lm_head_flops_per_row) / self.flops,
            (self.weights_read(num_seqs) + self.lm_head_bytes) / self.bandwidth,
        )
        attention = max(
            context_tokens * self.attention_flops_per_pair / self.flops,
            (context_tokens + num_seqs) * self.kv_bytes_per_token / self.kv_bandwidth,
        )
        allreduce = self.allreduce_time(num_seqs) if self.tensor_parallel_size > 1 else 0.0
        return hw.step_overhead_s + num_seqs * hw.per_sequence_overhead_s + dense + attention + allreduce


def with_serving_overhead(cost: CostModel, seconds_per_token: float, seconds_per_request: float = 0.0) -> CostModel:
    """A copy of ``cost`` for a served engine priced from a profile of the offline one: its steps take
    ``seconds_per_token`` longer per token they sample, and each request's time to first token and latency
    ``seconds_per_request`` longer (both measured on the server: ``bench/tenant_fairness.py`` fits them from a
    run of its own)."""
    for name, value in (("a token", seconds_per_token), ("a request", seconds_per_request)):
        if value < 0:
            raise ValueError(f"the serving overhead must be >= 0 s {name}, got {value}")
    served = copy.copy(cost)
    served.serving_s_per_token = seconds_per_token
    served.serving_s_per_request = seconds_per_request
    return served


def with_pace(cost: CostModel, pace: float) -> CostModel:
    """A copy of ``cost`` whose steps take ``pace`` times their price: the machine as fast, or as slow, as it was
    measured to be when the run being predicted ran (``conveyor simulate validate`` holds each real run's own
    steps against the profile's prices: conveyor/benchmarks/sim_validation.py run_pace)."""
    if not pace > 0:
        raise ValueError(f"the pace must be > 0, got {pace}")
    paced = copy.copy(cost)
    paced.pace = pace
    return paced
