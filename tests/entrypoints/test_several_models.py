"""Several models in one server: ``--model`` twice, a budget of one loaded model, and the official client sending
to both at once, so that each model is stopped and loaded again while the other's requests are in flight. None is
lost, each is answered by the model it named (its greedy text is that model's own, offline), ``/v1/models`` lists
both, ``/metrics`` labels both, and a name served by neither is a 404."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from conveyor.entrypoints.cli import main
from conveyor.entrypoints.serve import served_names_per_model
from tests.conftest import write_tiny_llama
from tests.serving import offline_text, openai_client, running_server

PROMPTS = ("The river", "Once upon a time", "1, 2, 3,", "Paris is")
MAX_TOKENS = 6
NAMES = ("alpha", "beta")


@pytest.fixture(scope="module")
def second_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """Another tiny random Llama (other weights, the same tokenizer): its greedy text differs from the first's."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-2"), 1, tiny_model_dir)


@pytest.fixture(scope="module")
def expected(offline, second_model_dir: Path) -> dict[str, dict[str, str]]:
    """Each model's greedy text for each prompt, offline: what the server must answer for that model."""
    from conveyor import LLM

    second = LLM(str(second_model_dir), num_kv_blocks=1024)
    texts = {model: {p: offline_text(llm, p, MAX_TOKENS, ignore_eos=True) for p in PROMPTS}
             for model, llm in zip(NAMES, (offline, second), strict=True)}
    assert texts["alpha"] != texts["beta"], "the two models must answer apart, or the test could not tell them"
    return texts


@pytest.fixture(scope="module")
def two_models(tiny_model_dir: Path, second_model_dir: Path):
    with running_server(tiny_model_dir, "--model", str(second_model_dir), "--served-model-name", *NAMES,
                        "--max-loaded-models", "1", "--num-kv-blocks", "1024") as running:
        yield running


def ask(client: openai.OpenAI, model: str, prompt: str, stream: bool) -> tuple[str, str]:
    """The answer's model field and text, greedy and of a fixed length."""
    options = dict(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    if not stream:
        answer = client.completions.create(**options)
        return answer.model, answer.choices[0].text
    chunks = list(client.completions.create(**options, stream=True))
    assert {chunk.model for chunk in chunks} == {model}
    return chunks[0].model, "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)


def loaded(server) -> dict[str, bool]:
    data = httpx.get(f"{server.base}/v1/models", timeout=10).json()["data"]
    return {card["id"]: card["loaded"] for card in data}


def labelled(server, family: str) -> dict[str, float]:
    """A figure of /metrics by its model_name label."""
    text = httpx.get(f"{server.base}/metrics", timeout=10).text
    pattern = re.compile(rf'^{re.escape(family)}\{{model_name="([^"]+)"\}} (\S+)$', re.MULTILINE)
    return {name: float(value) for name, value in pattern.findall(text)}


def test_requests_to_both_models_under_a_budget_of_one_are_each_answered_by_their_model(two_models, expected):
    assert loaded(two_models) == {"alpha": True, "beta": False}  # the first at start, the other on first use
    client = openai_client(two_models.base).with_options(timeout=120)  # a stuck pool fails, not waits 10 min
    jobs = [(NAMES[i % 2], PROMPTS[(i // 2) % len(PROMPTS)], i % 3 == 0) for i in range(24)]
    with ThreadPoolExecutor(8) as pool:  # both models asked at once: each stopped while the other's run
        answers = list(pool.map(lambda job: ask(client, *job), jobs))
    for (model, prompt, _), (reported, text) in zip(jobs, answers, strict=True):
        assert reported == model and text == expected[model][prompt], (model, prompt)
    assert sum(loaded(two_models).values()) == 1
    unloads = labelled(two_models, "conveyor:model_unloads_total")
    assert unloads["alpha"] >= 1, unloads  # beta could only load once alpha was stopped
    submitted = labelled(two_models, "conveyor:requests_submitted_total")
    assert submitted == {"alpha": 12, "beta": 12}  # counted across each model's engines, none lost or twice


def test_the_models_are_listed_and_a_name_of_neither_is_a_404(two_models) -> None:
    client = openai_client(two_models.base)
    assert [model.id for model in client.models.list().data] == list(NAMES)
    assert client.models.retrieve("beta").id == "beta"
    with pytest.raises(openai.NotFoundError, match="'alpha', 'beta'"):
        client.completions.create(model="gamma", prompt="hi", max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gamma")


def test_the_dashboard_feed_names_its_model(two_models) -> None:
    name = next(model for model, is_loaded in loaded(two_models).items() if is_loaded)
    other = next(model for model in NAMES if model != name)
    with httpx.stream("GET", f"{two_models.base}/debug/stream", params={"model": name}, timeout=10) as stream:
        assert stream.status_code == 200
        first = next(line for line in stream.iter_lines() if line.startswith("data:"))
    assert json.loads(first.removeprefix("data:"))["model"] == name
    assert httpx.get(f"{two_models.base}/debug/stream", params={"model": other}, timeout=10).status_code == 503
    assert httpx.get(f"{two_models.base}/debug/stream", params={"model": "gamma"}, timeout=10).status_code == 404


def test_served_names_name_each_model_in_order_or_are_refused() -> None:
    assert served_names_per_model(None, ["a/x.gguf", "b/y"]) == [("a/x.gguf",), ("b/y",)]
    assert served_names_per_model(["p", "q"], ["x", "y"]) == [("p",), ("q",)]
    assert served_names_per_model(["p", "q"], ["x"]) == [("p", "q")]  # one model: several names, as before
    with pytest.raises(ValueError, match="3 names for 2 --model"):
        served_names_per_model(["p", "q", "r"], ["x", "y"])
    with pytest.raises(ValueError, match="several models would be served as 'x'"):
        served_names_per_model(None, ["x", "x"])


def test_several_models_with_replicas_are_refused_before_anything_starts(capsys, tiny_model_dir: Path) -> None:
    model = str(tiny_model_dir)
    assert main(["serve", "--model", model, "--model", model, "--served-model-name", "a", "b",
                 "--data-parallel-size", "2"]) == 2
    assert "replicas (--data-parallel-size > 1, --ray-address) serve one model" in capsys.readouterr().err


def test_a_model_whose_weights_are_over_the_byte_budget_is_refused_at_start(capsys, tiny_model_dir: Path) -> None:
    assert main(["serve", "--model", str(tiny_model_dir), "--max-loaded-bytes", "1KiB"]) == 2
    err = capsys.readouterr().err
    assert "--max-loaded-bytes: the model" in err and "over the budget of 1,024" in err
