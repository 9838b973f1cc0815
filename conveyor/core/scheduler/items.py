"""A request's share of one step as the scheduler hands it on (``ScheduledRequest``), built here: how many
tokens it takes, the record of a chunk or a decode, a decode that carries drafts, and taking a share back
from a step when its request is preempted."""

from __future__ import annotations

from collections.abc import Callable

from conveyor.core.request import Request
from conveyor.core.scheduler.output import ScheduledRequest


def num_new_tokens(request: Request, budget: int) -> int:
    """The tokens the request lacks (prompt, chunk, recompute or one decode), within ``budget``."""
    lacking = len(request.prompt_token_ids) + len(request.output_token_ids) - request.num_computed_tokens
    return lacking if lacking < budget else budget


def scheduled_request(request: Request, num_new: int, block_ids: list[int]) -> ScheduledRequest:
    """The plain-data record of the request's share of this step.

    Built for every running request in every step, so it reads each list length once and gives a
    decode its one token without slicing through prompt + output. ``block_ids`` is the request's
    block table itself, not a copy: tables are replaced, never changed in place.
    """
    start = request.num_computed_tokens
    output_ids = request.output_token_ids
    num_output = len(output_ids)
    in_output = start - len(request.prompt_token_ids)  # where the chunk starts in the output; < 0: in the prompt
    if num_new == 1 and in_output >= 0:
        token_ids = [output_ids[in_output]]
    else:
        token_ids = request.token_ids(start, start + num_new)
    samples_token = in_output + num_new == num_output  # the chunk reaches the last known token
    # Positional arguments, in field order.
    return ScheduledRequest(
        request.request_id, start, token_ids, block_ids, request.sampling_params, samples_token, num_output,
        request.prompt_token_ids, output_ids, request.eos_token_id, pooling=request.pooling,
    )


def drafted_request(request: Request, draft: list[int], block_ids: list[int]) -> ScheduledRequest:
    """The record of a decode that carries drafts: its last token (the decode's own record, which samples), then
    the drafts, all verified this step."""
    item = scheduled_request(request, 1, block_ids)
    item.token_ids = item.token_ids + draft
    item.num_draft_tokens = len(draft)
    return item


def with_drafts(request: Request, drafts: dict[str, list[int]], allowed: int,
                grow_table: Callable[[str, int], list[int] | None]) -> ScheduledRequest | None:
    """The record of a decode with its drafts, as many as ``allowed`` tokens leave room for (its last token takes
    one), if the pool gives their blocks (``grow_table``); None when it has none, or no room for them: it then
    decodes without, and never preempts anyone for a draft."""
    draft = drafts.get(request.request_id)
    if not draft or allowed < 2:
        return None
    draft = draft[:allowed - 1]
    block_ids = grow_table(request.request_id, request.num_computed_tokens + 1 + len(draft))
    return None if block_ids is None else drafted_request(request, draft, block_ids)


def unschedule(request: Request, scheduled: list[ScheduledRequest]) -> int:
    """Take the request's share of this step out of ``scheduled`` (it is being preempted); its tokens, or 0."""
    for i, item in enumerate(scheduled):
        if item.request_id == request.request_id:
            return scheduled.pop(i).num_scheduled_tokens
    return 0


