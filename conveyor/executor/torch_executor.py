"""The one part that runs the model: carries out a SchedulerOutput on real tensors.

It owns the KV tensor ([layers, 2, blocks, block_size, kv_heads, head_dim]),
packs the step's tokens into one flat batch (decode rows first, then prompt
chunks), runs the model (on the native stack, one call on plain lists; on
PyTorch ops, with attention metadata built once for all layers), computes
logits only for rows that sample, and samples.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from conveyor.core.kv import KVLayout
from conveyor.core.logprobs import TokenLogprob
from conveyor.core.scheduler.output import ScheduledRequest, SchedulerOutput
from conveyor.executor.logprobs import token_logprobs
from conveyor.executor.sampler import Constrain, Sampler
from conveyor.model.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from conveyor.model.decoder import Decoder, StepInputs


class TorchExecutor:
    def __init__(
        self,
        model: Decoder,
        num_blocks: int,
        block_size: int,
        seed: int = 0,
        num_cpu_blocks: int = 0,
        constrain: Constrain | None = None,
        forget: Callable[[list[str]], None] | None = None,
        kv_layout: KVLayout | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """``constrain`` masks constrained rows to what their grammars allow; ``forget`` is told which requests
        ended, so whatever keeps per-request state (the grammar matchers) can drop it. ``kv_layout``: the KV
        groups (conveyor.core.kv.groups), each block then holding one group's layers; None: one group.
        ``kv_dtype``: what the cache stores (conveyor.model.dtypes.kv_cache_dtype); None: the model's dtype."""
        config = model.config
        param = model.embed_tokens.weight
        self.model = model
        self.device = param.device
        self.block_size = block_size
        self.num_groups = 1 if kv_layout is None else kv_layout.num_groups
        self._has_null_blocks = kv_layout is not None and kv_layout.windowed  # NULL_BLOCK entries in tables
        cache_layers = config.num_layers
        if kv_layout is not None:
            model.use_kv_layout(kv_layout.layer_slots())
            cache_layers = kv_layout.layers_per_group
        # Zeroed, not empty: padded decode rows (and entries behind a window) read unused slots, which must
        # hold finite numbers.
        self.kv_cache = model.zeroed_kv_cache(
            (cache_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim), kv_dtype or param.dtype,
            self.device,
        )
        # The swap space: same layout, in host memory (pinned when the device is a GPU, for fast copies). Empty,
        # not zeroed: a swap-in reads only blocks a swap-out wrote, so its pages become resident as swapping
        # first reaches them; zeroing the default 4 GiB took seconds at every start of an engine that swaps.
        self.cpu_kv_cache = torch.empty(
            (*self.kv_cache.shape[:2], num_cpu_blocks, *self.kv_cache.shape[3:]),
            dtype=self.kv_cache.dtype,
            pin_memory=self.device.type == "cuda" and num_cpu_blocks > 0,
        )
        self.sampler = Sampler(seed)
        self._constrain, self._forget = constrain, forget
        # The latest step's logprobs, for the engine to read after execute(): request id -> the sampled
        # token's, and request id -> (position of the first, prompt tokens' logprobs) for prompt_logprobs.
        self.last_logprobs: dict[str, TokenLogprob] = {}
        self.last_prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = {}
        self.accepted_drafts: dict[str, int] = {}  # the latest step's: drafts accepted, by request (see Executor)
        # Pooled requests (embeddings): the latest step's vectors, by request, for the engine to read; and each
        # unfinished mean-pooled request's running sum of the hidden states its chunks so far computed.
        self.last_embeddings: dict[str, list[float]] = {}
        self._pool_sums: dict[str, torch.Tensor] = {}

    def execute(self, output: SchedulerOutput) -> dict[str, int]:
        """Run one step; return the token sampled for each request whose chunk ended at its last token. (No
        grad mode set around it all: the loaded model's weights need no gradient, and entering and leaving
        inference_mode took 40 us of a batch-1 step, its code cold after the weights streamed through.)"""
        self._swap(output)
        self.last_logprobs, self.last_prompt_logprobs, self.accepted_drafts = {}, {}, {}
        self.last_embeddings = {}
        for request_id in output.finished_request_ids:  # aborted while pooling
            self._pool_sums.pop(request_id, None)
        if self._forget is not None and output.finished_request_ids:
            self._forget(output.finished_request_ids)
        if output.is_empty:
            return {}
        batch = sorted(output.scheduled, key=_row_order)
        inputs = self._inputs(batch)
        argmax = None
        if self.model.native is not None:  # the whole model in one native call (Decoder.use_native_kernels)
            hidden, logits, argmax = self.model.run_native(inputs, self.kv_cache)
        else:
            hidden, logits = self._run_torch(batch, inputs)
        self._prompt_logprobs(batch, hidden)
        self._pool(batch, hidden)
        sampled = [item for item in batch if item.draws_token]
        if not sampled:
            return {}
        if output.num_draft_tokens:
            return self._sample_and_verify(logits, argmax, sampled)
        tokens, logprobs = self.sampler.sample_batch(logits, sampled, self._constrain, argmax)
        self.last_logprobs = {sampled[row].request_id: found for row, found in logprobs.items()}
        return {s.request_id: t for s, t in zip(sampled, tokens)}

    def _sample_and_verify(self, logits: torch.Tensor, argmax: list[int] | None,
                           sampled: list[ScheduledRequest]) -> dict[str, int]:
        """A step with drafts: requests without any sample their one row as usual; each that carried drafts
        has a row per draft and one before them, verified (Sampler.verify), its accepted count kept in
        ``accepted_drafts``."""
        plain, plain_rows, drafted = [], [], []
        row = 0
        for item in sampled:
            if item.num_draft_tokens:
                drafted.append((item, row))
                row += 1 + item.num_draft_tokens
            else:
                plain.append(item)
                plain_rows.append(row)
                row += 1
        tokens: dict[str, int] = {}
        if plain:
            rows = logits[torch.tensor(plain_rows, dtype=torch.long, device=logits.device)]
            found, logprobs = self.sampler.sample_batch(rows, plain, self._constrain,
                                                        None if argmax is None else [argmax[r] for r in plain_rows])
            self.last_logprobs = {plain[r].request_id: lp for r, lp in logprobs.items()}
            tokens = {item.request_id: token for item, token in zip(plain, found)}
        for item, first in drafted:
            last = first + 1 + item.num_draft_tokens
            accepted, tokens[item.request_id] = self.sampler.verify(
                logits[first:last], item, None if argmax is None else argmax[first:last])
            self.accepted_drafts[item.request_id] = accepted
        return tokens

    def _prompt_logprobs(self, batch: list[ScheduledRequest], hidden: torch.Tensor) -> None:
        """For chunks of requests with prompt_logprobs: row j of a chunk at ``start`` predicts the prompt token
        at ``start + j + 1``; the LM head runs on those rows only."""
        first_row = 0
        for item in batch:
            num_prompt, start = len(item.prompt_token_ids), item.start_position
            wanted = item.sampling_params.prompt_logprobs
            targets = item.prompt_token_ids[start + 1 : min(item.context_len + 1, num_prompt)]
            if wanted is not None and targets:
                rows = torch.arange(first_row, first_row + len(targets), device=self.device)
                found = token_logprobs(self.model.compute_logits(hidden[rows]), targets, [wanted] * len(targets))
                self.last_prompt_logprobs[item.request_id] = (start + 1, found)
            first_row += item.num_scheduled_tokens

    def _pool(self, batch: list[ScheduledRequest], hidden: torch.Tensor) -> None:
        """Pooled requests (embeddings): the mean's running sum grows by each chunk's rows, in float64 so a long
        prompt's sum loses nothing; at the prompt's last position the vector is made (mean or last row), scaled
        to unit length if asked. A chunk from position 0 starts the sum again: a request preempted and
        recomputed (mean-pooled ones never start from a cached prefix) computes every position again."""
        first_row = 0
        for item in batch:
            pooling, rows = item.pooling, item.num_scheduled_tokens
            if pooling is not None:
                chunk = hidden[first_row:first_row + rows]
                if pooling.reads_every_position:
                    chunk_sum = chunk.sum(dim=0, dtype=torch.float64)
                    so_far = None if item.start_position == 0 else self._pool_sums.get(item.request_id)
                    self._pool_sums[item.request_id] = chunk_sum if so_far is None else so_far + chunk_sum
                if item.samples_token:
                    self.last_embeddings[item.request_id] = self._pooled(item, chunk)
            first_row += rows

    def _pooled(self, item: ScheduledRequest, chunk: torch.Tensor) -> list[float]:
        if item.pooling.reads_every_position:
            vector = self._pool_sums.pop(item.request_id) / item.context_len
        else:
            vector = chunk[-1].to(torch.float64)
        if item.pooling.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector.to(torch.float32).tolist()

    def _swap(self, output: SchedulerOutput) -> None:
        """Copy swapped blocks, all layers at once; swap-ins first (see SchedulerOutput)."""
        if output.blocks_to_swap_in:
            cpu, device = zip(*output.blocks_to_swap_in)
            self.kv_cache[:, :, list(device)] = self.cpu_kv_cache[:, :, list(cpu)].to(self.device)
        if output.blocks_to_swap_out:
            device, cpu = zip(*output.blocks_to_swap_out)
            self.cpu_kv_cache[:, :, list(cpu)] = self.kv_cache[:, :, list(device)].cpu()

    def _inputs(self, batch: list[ScheduledRequest]) -> StepInputs:
        """The step's rows in batch order: each request's scheduled tokens, their positions and KV slots; the
        LM head's rows are the last of each chunk that samples."""
        bs = self.block_size
        inputs = StepInputs([], [], [], [item.block_ids for item in batch], [], [])
        for seq, item in enumerate(batch):
            start, end = item.start_position, item.context_len
            inputs.token_ids.extend(item.token_ids)
            inputs.positions.extend(range(start, end))
            table = item.block_ids
            inputs.slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            inputs.row_seq.extend([seq] * (end - start))
            if item.draws_token:  # its last row; with drafts, also the row before each draft
                num_rows = len(inputs.token_ids)
                inputs.logit_rows.extend(range(num_rows - 1 - item.num_draft_tokens, num_rows))
        for group in range(1, self.num_groups):  # with KV groups, each later group's own tables and slots
            tables = [item.group_block_ids[group] for item in batch]
            inputs.group_tables.append(tables)
            inputs.group_slots.append([table[p // bs] * bs + p % bs for item, table in zip(batch, tables)
                                       for p in range(item.start_position, item.context_len)])
        return inputs

    @torch.no_grad()  # not inference_mode: the sampler changes these logits in place after it has ended
    def _run_torch(self, batch: list[ScheduledRequest], inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The model in PyTorch ops: the final hidden states, and the logits of the rows that sample."""
        tables, slots = [inputs.block_tables, *inputs.group_tables], [inputs.slots, *inputs.group_slots]
        metas = [self._torch_metadata(batch, table, self._tensor(slot)) for table, slot in zip(tables, slots)]
        hidden = self.model(self._tensor(inputs.token_ids), self._tensor(inputs.positions), self.kv_cache, metas)
        rows = inputs.logit_rows
        if not rows:
            return hidden, hidden[:0]
        sampled = hidden if len(rows) == hidden.shape[0] else hidden[self._tensor(rows)]  # all rows: no gather
        return hidden, self.model.compute_logits(sampled)

    def _torch_metadata(self, batch: list[ScheduledRequest], tables: list[list[int]],
                        slots: torch.Tensor) -> AttentionMetadata:
        """Decode rows in groups of similar context, and one causal chunk per prompt (see model/attention.py);
        ``tables``: each request's block table in the KV group this is for."""
        num_decodes = sum(1 for s in batch if s.num_scheduled_tokens == 1)
        first_rows = itertools.accumulate((item.num_scheduled_tokens for item in batch), initial=0)
        prefills = [self._prefill_chunk(item, table, row)
                    for item, table, row in zip(batch, tables, first_rows) if item.num_scheduled_tokens > 1]
        decodes = self._decode_groups(batch[:num_decodes], tables[:num_decodes])
        return AttentionMetadata(slot_mapping=slots, decodes=decodes, prefills=prefills, block_size=self.block_size)

    def _decode_groups(self, decodes: list[ScheduledRequest], tables: list[list[int]]) -> list[DecodeGroup]:
        """One group per power-of-two bucket of block count: padding stays under 2x per row."""
        groups = []
        row_start = 0
        for _, members in itertools.groupby(zip(decodes, tables), key=lambda pair: _bucket(pair[0])):
            rows, row_tables = zip(*members)
            groups.append(self._decode_group(list(rows), list(row_tables), row_start))
            row_start += len(rows)
        return groups

    def _padded_tables(self, tables: list[list[int]]) -> torch.Tensor:
        """Block tables padded with block 0 to the longest (entries behind a window read block 0 too)."""
        width = max(len(table) for table in tables)
        padded = self._tensor([table + [0] * (width - len(table)) for table in tables])
        return padded.clamp_(min=0) if self._has_null_blocks else padded

    def _decode_group(self, rows: list[ScheduledRequest], tables: list[list[int]], row_start: int) -> DecodeGroup:
        padded, context_lens = self._padded_tables(tables), self._tensor([s.context_len for s in rows])
        slots = torch.arange(padded.shape[1] * self.block_size, device=self.device)
        mask = (slots[None, :] < context_lens[:, None]).view(len(rows), 1, 1, -1)
        return DecodeGroup(row_start, row_start + len(rows), padded, mask, context_lens)

    def _prefill_chunk(self, item: ScheduledRequest, table: list[int], row: int) -> PrefillChunk:
        start, n = item.start_position, item.num_scheduled_tokens
        mask = None
        if start > 0:
            query_pos = torch.arange(start, start + n, device=self.device)
            mask = torch.arange(start + n, device=self.device)[None, :] <= query_pos[:, None]
        return PrefillChunk(
            query_start=row,
            query_end=row + n,
            start_position=start,
            block_ids=self._padded_tables([table])[0],
            causal_mask=mask,
        )

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)


def _bucket(item: ScheduledRequest) -> int:
    return len(item.block_ids).bit_length()


def _row_order(item: ScheduledRequest) -> tuple[int, int]:
    """Decode rows first, grouped by context-length bucket; prompt chunks after."""
    return (0, _bucket(item)) if item.num_scheduled_tokens == 1 else (1, 0)
