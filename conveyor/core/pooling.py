"""How a prompt becomes one vector (an embedding): which of its final hidden states are pooled, and whether the
result is scaled to unit length.

A pooled request is a prompt-only request: the scheduler runs its prompt as it runs any other (chunked, batched
with decodes, under the same token budget and KV pool), and ends it once the prompt's last position is
computed, with no token drawn. The executor pools the hidden states it computed along the way.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class PoolingMethod(enum.StrEnum):
    """The names llama.cpp's ``--pooling`` uses for the two a decoder-only model supports."""

    LAST = "last"  # the last prompt position's hidden state: it has attended to the whole prompt
    MEAN = "mean"  # the mean over every prompt position


@dataclass(frozen=True, slots=True)
class PoolingParams:
    method: PoolingMethod = PoolingMethod.LAST
    normalize: bool = True  # scaled to unit Euclidean length, as OpenAI's and llama.cpp's embeddings are

    @property
    def reads_every_position(self) -> bool:
        """Mean pooling needs each prompt position's hidden state, so none may be skipped as a cached prefix."""
        return self.method is PoolingMethod.MEAN


DEFAULT_POOLING = PoolingParams()  # the last position, unit length: what the server does without --pooling
