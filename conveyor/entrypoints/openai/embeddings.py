"""``/v1/embeddings`` as OpenAI and vLLM serve it: the body, and the answer's shape.

Each input becomes a pooled request (conveyor.core.pooling) that the engine schedules like any other: its
prompt in chunks beside the decodes of running requests, under the same token budget and KV pool. The vector
is the model's final hidden states pooled as the server's ``--pooling`` says (the last position, or the mean)
and scaled to unit length. A model of fixed width cannot shorten its vectors without losing what they mean
(only models trained for it can), so ``dimensions`` is refused, as vLLM refuses it for such models.
"""

from __future__ import annotations

import base64
import struct
import time
from typing import Any, Literal

from pydantic import Field

from conveyor.core.errors import FieldError
from conveyor.engine.output import RequestOutput
from conveyor.entrypoints.openai.protocol import Body, one_or_several

MAX_INPUTS = 2048  # inputs in one request, OpenAI's limit: each becomes a request, short-lived (its prompt only)


class EmbeddingRequest(Body):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        """The inputs, each a string or a list of token ids; FieldError naming the field that is wrong."""
        if self.dimensions is not None:
            raise FieldError("dimensions", "dimensions: this model's embeddings have one fixed size (it was not "
                                           "trained to be shortened); leave dimensions out")
        return one_or_several(self.input, "input", MAX_INPUTS, "inputs")


def embedding_response(outputs: list[RequestOutput], model: str, encoding_format: str) -> dict[str, Any]:
    """OpenAI's answer: one ``embedding`` object per input, in the inputs' order, and the prompt tokens read."""
    num_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": index, "embedding": encoded(output.embedding, encoding_format)}
                 for index, output in enumerate(outputs)],
        "model": model,
        "created": int(time.time()),
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }


def encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """The vector as floats, or as base64 of its little-endian float32 bytes (what OpenAI's clients decode)."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
