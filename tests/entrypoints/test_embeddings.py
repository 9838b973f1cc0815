"""Embeddings: a prompt's final hidden states pooled (the last position or the mean) and scaled to unit length.

On the float path they equal transformers' last hidden state of the same weights pooled the same way; they
run through the scheduler as prompt-only requests (chunked, batched with decodes, preempted, beside the prefix
cache) with the same vector as alone; and the server answers /v1/embeddings through the openai client.
"""

from __future__ import annotations

import base64
import random
import struct

import httpx
import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.core.pooling import PoolingMethod, PoolingParams
from conveyor.core.request import Request

LAST, MEAN = PoolingParams(PoolingMethod.LAST), PoolingParams(PoolingMethod.MEAN)
LENGTHS = [1, 2, 15, 16, 17, 64, 129, 300]


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(n)] for n in lengths]


def _cosine(a: list[float], b: list[float]) -> float:
    return torch.nn.functional.cosine_similarity(torch.tensor(a, dtype=torch.float64),
                                                 torch.tensor(b, dtype=torch.float64), dim=0).item()


@pytest.fixture(scope="module")
def hf_pooled(tiny_hf_model):
    """transformers' final (normed) hidden states of a prompt, pooled and scaled to unit length."""

    def pooled(prompt: list[int], method: PoolingMethod) -> list[float]:
        with torch.no_grad():
            hidden = tiny_hf_model.model(torch.tensor([prompt])).last_hidden_state[0].to(torch.float64)
        vector = hidden[-1] if method is PoolingMethod.LAST else hidden.mean(dim=0)
        return torch.nn.functional.normalize(vector, dim=0).tolist()

    return pooled


@pytest.mark.parametrize("options", [
    dict(),
    dict(max_num_batched_tokens=37),  # prompts chunked across steps: the mean sums chunk by chunk
    dict(kernels="torch"),
    dict(num_kv_blocks=80, block_size=4, max_num_batched_tokens=64),  # a pool short of the prompts: they queue
], ids=["native", "chunked", "torch", "small-pool"])
@pytest.mark.parametrize("method", list(PoolingMethod))
def test_embeddings_equal_transformers_pooled_the_same_way(tiny_model_dir, hf_pooled, options, method):
    options.setdefault("num_kv_blocks", 1024)
    llm = LLM(str(tiny_model_dir), **options)
    prompts = _prompts(LENGTHS, seed=3)
    outputs = llm.embed(prompts, PoolingParams(method), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.finished and output.finish_reason == "stop" and output.token_ids == []
        assert len(output.embedding) == 64
        assert abs(sum(v * v for v in output.embedding) - 1.0) < 1e-5, "scaled to unit length"
        assert _cosine(output.embedding, hf_pooled(prompt, method)) >= 0.9999, f"prompt of {len(prompt)} tokens"


def test_embeddings_run_in_the_same_steps_as_decodes_and_equal_their_vectors_alone(tiny_model_dir):
    """Prompt-only requests join running decodes in one step, under one token budget; each vector equals the one
    computed alone, and the generated tokens equal those generated without the embeddings beside them."""
    llm = LLM(str(tiny_model_dir), num_kv_blocks=1024, max_num_batched_tokens=48)
    texts, inputs = _prompts([20, 30], seed=4), _prompts([40, 90, 7], seed=5)
    alone = [o.embedding for o in llm.embed(inputs, MEAN, use_tqdm=False)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(texts, greedy, use_tqdm=False)]

    engine = llm.engine
    generating = [engine.add_request(text, greedy) for text in texts]
    for _ in range(4):
        engine.step()
    pooled = [engine.requests.build_pooled(given, MEAN) for given in inputs]
    for request in pooled:
        engine.add_request(request)
    outputs, mixed_steps = {}, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output
        scheduled = engine.core.last_output.scheduled
        mixed_steps += any(s.pooling for s in scheduled) and any(s.pooling is None for s in scheduled)
        assert sum(s.num_scheduled_tokens for s in scheduled) <= 48
    assert mixed_steps >= 2, "the embeddings' prompts should share steps with the decodes"
    for request, vector in zip(pooled, alone):
        assert _cosine(outputs[request.request_id].embedding, vector) >= 0.99999
    assert [outputs[request_id].token_ids for request_id in generating] == expected


def test_a_mean_pooled_prompt_preempted_mid_prompt_is_computed_again_whole(tiny_model_dir):
    """Decodes that grow take the blocks of a prompt being pooled in chunks: it is preempted (its KV dropped),
    computed again from its first position, and its vector equals the one computed alone."""
    llm = LLM(str(tiny_model_dir), num_kv_blocks=48, block_size=4, max_num_batched_tokens=8)
    (given,) = _prompts([120], seed=8)
    (alone,) = llm.embed([given], MEAN, use_tqdm=False)
    engine = llm.engine
    greedy = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    for text in _prompts([36, 36], seed=9):
        engine.add_request(text, greedy)
    engine.step()
    pooled = engine.requests.build_pooled(given, MEAN)
    engine.add_request(pooled)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((output.request_id, output) for output in engine.step())
    output = outputs[pooled.request_id]
    assert output.metrics.num_preemptions > 0, "the growing decodes should preempt the pooled prompt"
    assert _cosine(output.embedding, alone.embedding) >= 0.99999


def test_a_mean_pooled_prompt_finds_no_cached_prefix_and_a_last_pooled_one_may(tiny_model_dir, hf_pooled):
    """Mean pooling needs every position's hidden state, so it never starts from the prefix cache; the last
    position is always computed, so last pooling may start there and still equal the reference."""
    llm = LLM(str(tiny_model_dir), num_kv_blocks=1024, enable_prefix_caching=True)
    (prompt,) = _prompts([100], seed=6)
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    (mean,) = llm.embed([prompt], MEAN, use_tqdm=False)
    (last,) = llm.embed([prompt], LAST, use_tqdm=False)
    assert mean.num_cached_tokens == 0 and last.num_cached_tokens > 0
    assert _cosine(mean.embedding, hf_pooled(prompt, PoolingMethod.MEAN)) >= 0.9999
    assert _cosine(last.embedding, hf_pooled(prompt, PoolingMethod.LAST)) >= 0.9999


def test_a_pooled_prompt_may_fill_the_context_but_not_pass_it(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_kv_blocks=1024, max_model_len=64)
    (full,) = llm.embed(_prompts([64], seed=7), use_tqdm=False)
    assert len(full.embedding) == 64
    with pytest.raises(ValueError, match="input: 65 tokens, but max_model_len is 64") as refused:
        llm.embed(_prompts([65], seed=7), use_tqdm=False)
    assert refused.value.field == "input"
    assert isinstance(llm.engine.requests.build_pooled("a", LAST), Request)


# ----- the server, through the openai client -----

def test_the_openai_client_gets_the_offline_vectors(client, offline):
    texts = ["The capital of France is Paris.", "Rivers flow to the sea.", "x"]
    expected = [o.embedding for o in offline.embed(texts, use_tqdm=False)]
    response = client.embeddings.create(model="tiny", input=texts)  # the client asks for base64 and decodes it
    assert [item.index for item in response.data] == [0, 1, 2]
    for item, vector in zip(response.data, expected):
        assert _cosine(item.embedding, vector) >= 0.99999
    num_tokens = sum(len(offline.get_tokenizer().encode(text)) for text in texts)
    assert response.usage.prompt_tokens == response.usage.total_tokens == num_tokens
    assert response.model == "tiny"

    ids = offline.get_tokenizer().encode(texts[0])
    by_ids = client.embeddings.create(model="tiny", input=ids, encoding_format="float")
    assert _cosine(by_ids.data[0].embedding, expected[0]) >= 0.99999


def test_base64_is_the_little_endian_float32_bytes_of_the_float_answer(server):
    body = {"model": "tiny", "input": ["Rivers flow to the sea."]}
    floats = httpx.post(f"{server}/v1/embeddings", json=body, timeout=60).json()["data"][0]["embedding"]
    raw = httpx.post(f"{server}/v1/embeddings", json=body | {"encoding_format": "base64"}, timeout=60).json()
    decoded = struct.unpack(f"<{len(floats)}f", base64.b64decode(raw["data"][0]["embedding"]))
    assert list(decoded) == pytest.approx(floats, abs=1e-7)


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"input": "a", "dimensions": 32}, 400, "dimensions"),
    ({"input": []}, 400, "input"),
    ({"input": ""}, 400, "input"),
    ({"input": [[]]}, 400, "input"),
    ({"input": [10**9]}, 400, "input"),
    ({"input": "a", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": ["a"] * 2049}, 400, "input"),
    ({"input": "a", "model": "no-such-model"}, 404, "model"),
    ({"input": "a", "temperature": 0.5}, 400, "temperature"),
])
def test_bad_embedding_requests_are_refused_naming_the_field(server, body, status, param):
    response = httpx.post(f"{server}/v1/embeddings", json={"model": "tiny"} | body, timeout=60)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


def test_an_input_longer_than_the_context_is_refused(server):
    response = httpx.post(f"{server}/v1/embeddings", json={"model": "tiny", "input": [5] * 100_000}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "input"
    assert "max_model_len" in response.json()["error"]["message"]
