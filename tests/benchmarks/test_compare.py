"""The peer comparison without any peer: fixed workloads, export-hf, the runner protocol, agreement and ratios.

Peers themselves (OpenVINO GenAI, vLLM, llama.cpp) are set up by hand under
.peers/ and never run here; a stand-in runner speaks their protocol instead.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys

import pytest
import torch
from safetensors import safe_open

from conveyor.benchmarks.compare import (
    ROOT,
    Comparison,
    EngineResult,
    Peer,
    Rounds,
    WorkloadResult,
    agreement,
    run_conveyor,
    run_peers,
    shrink,
)
from conveyor.benchmarks.workload import (
    AT_ONCE,
    ONE_AT_A_TIME,
    SyntheticRequest,
    Workload,
    comparison_workloads,
    long_tail_workload,
    w1_requests,
)
from conveyor.engine.tokenizer import Tokenizer
from conveyor.entrypoints.cli import main
from tests.harness import hf_greedy

PEERS_DIR = ROOT / "bench" / "peers"


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer(default_model_dir)


def _peer_module(name: str):
    """A runner script from bench/peers, imported the way it runs (its folder on sys.path)."""
    sys.path.insert(0, str(PEERS_DIR))
    try:
        spec = importlib.util.spec_from_file_location(name, PEERS_DIR / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(PEERS_DIR))


# ----- workloads ---------------------------------------------------------------------------------------


def test_w1_is_64_distinct_chat_prompts_of_41_tokens(tokenizer):
    requests = w1_requests(tokenizer)
    assert len(requests) == 64
    assert {len(r.prompt_token_ids) for r in requests} == {41}
    assert {r.output_len for r in requests} == {128}
    assert len({tuple(r.prompt_token_ids) for r in requests}) == 64
    text = tokenizer.decode(requests[0].prompt_token_ids, skip_special_tokens=False)
    # The question survives whole, inside the template, which still ends by opening the assistant's turn.
    assert "<|im_start|>user\nWhat is the capital of France?" in text
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert w1_requests(tokenizer) == requests


def test_w2_is_the_seeded_long_tail_workload(tokenizer):
    w1_single, w1, w2 = comparison_workloads(tokenizer, 49152, w1_single=5)
    assert (w1_single.name, w1_single.mode, w1.name, w1.mode, w2.name, w2.mode) == (
        "W1@1", ONE_AT_A_TIME, "W1@64", AT_ONCE, "W2", AT_ONCE)
    assert w1_single.requests == w1.requests[:5]
    assert len(w2.requests) == 256
    assert w2.requests == long_tail_workload(256, 0, 49152)
    assert all(16 <= len(r.prompt_token_ids) <= 512 and 8 <= r.output_len <= 512 for r in w2.requests)
    assert comparison_workloads(tokenizer, 49152, names=("W2",))[0] == w2
    with pytest.raises(ValueError, match="W3"):
        comparison_workloads(tokenizer, 49152, names=("W3",))


def test_shrink_cuts_requests_and_outputs():
    requests = [SyntheticRequest([1, 2], 100), SyntheticRequest([3], 5), SyntheticRequest([4], 9)]
    workload = Workload("W", AT_ONCE, requests)
    (small,) = shrink([workload], limit=2, max_output_len=8)
    assert small.requests == [SyntheticRequest([1, 2], 8), SyntheticRequest([3], 5)]
    assert shrink([workload], None, None) == [workload]


# ----- export-hf ---------------------------------------------------------------------------------------


def test_export_hf_folder_loads_in_transformers_and_agrees(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from conveyor import LLM, SamplingParams

    out = tmp_path / "exported"
    assert main(["export-hf", str(out), "--model", str(tiny_model_dir)]) == 0
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    prompts = [[1, 504, 3458, 282], list(range(2000, 2030))]
    llm = LLM(str(out), num_kv_blocks=64, kernels="torch")
    ours = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(prompts, ours):
        assert output.token_ids == hf_greedy(hf, prompt, 12)
    assert main(["export-hf", str(out), "--model", str(tiny_model_dir)]) == 2  # never over an existing model


def test_export_hf_writes_float32_from_half_precision(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    half = tmp_path / "half"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).save_pretrained(half)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, half / name)
    out = tmp_path / "f32"
    assert main(["export-hf", str(out), "--model", str(half)]) == 0
    with safe_open(next(out.glob("*.safetensors")), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}  # noqa: SIM118
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"


# ----- running: Conveyor in process, peers through their runner protocol ---------------------------------


def test_conveyor_runs_both_modes_to_exact_lengths(tiny_model_dir, tokenizer):
    from conveyor.core.config import EngineConfig
    from conveyor.engine import Engine

    engine = Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=128, kernels="torch"))
    workloads = shrink(comparison_workloads(tokenizer, 49152, w1_single=2, names=("W1@1", "W1@64")), 3, 6)
    result = run_conveyor({False: engine}, workloads)
    one, together = result.results["W1@1"], result.results["W1@64"]
    assert [len(ids) for ids in one.output_token_ids] == [6, 6]
    assert [len(ids) for ids in together.output_token_ids] == [6, 6, 6]
    assert together.output_token_ids[:2] == one.output_token_ids  # batching does not change greedy output
    assert all(0 < t <= lat for t, lat in zip(together.ttft_s, together.latency_s))
    assert together.output_tokens_per_s == pytest.approx(18 / together.wall_s)


def test_peer_io_routes_prefix_caching_workloads_and_skips_them_without_a_cached_mode(tmp_path, capsys):
    peer_io = _peer_module("peer_io")
    request = {"prompt_token_ids": [7, 8], "output_len": 2}
    files = []
    for name, caching in (("plain", False), ("shared", True)):
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps({"name": name, "mode": "at-once", "prefix_caching": caching,
                                         "requests": [request]}))
    used = []

    def runner(tag):
        def run(requests):
            used.append(tag)
            return [peer_io.record([1] * r["output_len"], 0.1, 0.2) for r in requests]
        return run

    args = peer_io.argument_parser("test", tmp_path).parse_args([*map(str, files), "--result", str(tmp_path / "r")])
    peer_io.main("E", "1", args, runner("plain"))
    assert [r["workload"] for r in json.loads((tmp_path / "r").read_text())["results"]] == ["plain"]
    assert "shared skipped: this runner has no prefix-caching mode" in capsys.readouterr().out
    used.clear()
    peer_io.main("E", "1", args, runner("plain"), runner("cached"))
    assert [r["workload"] for r in json.loads((tmp_path / "r").read_text())["results"]] == ["plain", "shared"]
    assert used == ["plain", "cached", "plain", "cached"] or used == ["cached", "plain", "plain", "cached"]


def test_peer_io_runs_modes_as_named():
    peer_io = _peer_module("peer_io")
    calls = []

    def run_together(requests):
        calls.append(len(requests))
        return [peer_io.record(r["prompt_token_ids"][:1] * r["output_len"], None, 0.1) for r in requests]

    requests = [{"prompt_token_ids": [7], "output_len": 2}, {"prompt_token_ids": [8], "output_len": 3}]
    at_once = peer_io.run_workload({"name": "A", "mode": "at-once", "requests": requests}, run_together)
    single = peer_io.run_workload({"name": "B", "mode": "one-at-a-time", "requests": requests}, run_together)
    assert calls == [2, 1, 1]
    assert [r["output_token_ids"] for r in at_once["requests"]] == [[7, 7], [8, 8, 8]]
    assert single["requests"] == at_once["requests"] and single["mode"] == "one-at-a-time"
    with pytest.raises(ValueError, match="mode"):
        peer_io.run_workload({"name": "C", "mode": "sometimes", "requests": requests}, run_together)


STAND_IN_RUNNER = '''
"""A peer that answers each prompt with its own tokens repeated."""
import peer_io

def run_together(requests):
    return [peer_io.record((r["prompt_token_ids"] * 600)[: r["output_len"]], 0.01, 0.02) for r in requests]

if __name__ == "__main__":
    parser = peer_io.argument_parser("stand-in", peer_io.PEERS / "none")
    parser.add_argument("--name", default="stand-in")
    args = parser.parse_args()
    peer_io.main(args.name, f"1.0 on {args.threads} threads", args, run_together)
'''


def test_run_peers_speaks_the_runner_protocol_and_skips_missing_peers(tmp_path, capsys):
    peers = tmp_path / "bench" / "peers"
    peers.mkdir(parents=True)
    shutil.copy(PEERS_DIR / "peer_io.py", peers / "peer_io.py")
    (peers / "run_stand_in.py").write_text(STAND_IN_RUNNER)
    workloads = [Workload("W1@1", ONE_AT_A_TIME, [SyntheticRequest([5, 6], 3)]),
                 Workload("W2", AT_ONCE, [SyntheticRequest([9], 2), SyntheticRequest([4, 3, 2], 4)])]
    stand_in = Peer("stand-in", "run_stand_in.py", None, (), "setup_stand_in.sh")
    absent = Peer("absent", "run_absent.py", ".peers/absent/bin/python", (), "setup_absent.sh")
    renamed = Peer("renamed", "run_stand_in.py", None, (), "setup_stand_in.sh", ("--name", "renamed"))
    result, other = run_peers([absent, stand_in, renamed], workloads, root=tmp_path, threads=3)
    assert "skipping absent" in capsys.readouterr().err
    assert result.version == "1.0 on 3 threads"  # Conveyor's thread count reaches every runner
    assert other.engine == "renamed"  # the peer's own options reach its runner
    assert result.engine == "stand-in"
    assert result.results["W1@1"].output_token_ids == [[5, 6, 5]]
    assert result.results["W2"].output_token_ids == [[9, 9], [4, 3, 2, 4]]
    assert result.results["W2"].ttft_s == [0.01, 0.01]


def test_llamacpp_request_is_greedy_exact_and_uncached():
    runner = _peer_module("run_llamacpp")
    body = runner.completion_body({"prompt_token_ids": [1, 2, 3], "output_len": 7})
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 7
    assert body["ignore_eos"] is True and body["temperature"] == 0 and body["cache_prompt"] is False
    assert body["return_tokens"] is True and body["stream"] is False
    response = {"tokens": [4, 5], "content": "ab", "timings": {"predicted_ms": 1500.0, "prompt_ms": 20.0}}
    assert runner.endpoint(8080).record(response, 2.0) == {"output_token_ids": [4, 5], "ttft_s": 0.5,
                                                            "latency_s": 2.0}
    assert "--no-ui" in runner.SERVER_ARGS and runner.SERVER_ARGS[:2] == ("-np", "64")
    # A fork whose answers hold no ids (ik_llama.cpp): its tokens are counted, not compared.
    fork = {"content": "ab", "tokens_predicted": 3, "timings": {"predicted_ms": 100.0}}
    assert runner.endpoint(8080).record(fork, 0.5)["output_token_ids"] == [runner.UNKNOWN_TOKEN] * 3


def test_conveyor_is_timed_through_its_own_server_as_the_peers_are():
    runner = _peer_module("run_conveyor")
    body = runner.completion_body({"prompt_token_ids": [1, 2, 3], "output_len": 7})
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 7 and body["ignore_eos"] is True
    assert body["temperature"] == 0 and body["return_token_ids"] is True and body["stream"] is False
    answer = {"choices": [{"token_ids": [4, 5]}], "timings": {"predicted_ms": 500.0}}
    assert runner.endpoint(1).record(answer, 2.0) == {"output_token_ids": [4, 5], "ttft_s": 1.5, "latency_s": 2.0}
    command = runner.serve_command("m.gguf", 9, 2, False, ["--max-num-seqs", "64"])
    assert command[command.index("--num-threads") + 1] == "2" and "--no-enable-prefix-caching" in command
    assert command[-2:] == ["--model", "m.gguf"] and "--max-num-seqs" in command


def test_on_a_gguf_file_the_llamacpp_peers_run_that_file():
    from conveyor.benchmarks.compare import on_the_file, select_peers

    peers = select_peers(["llamacpp-q4_1", "ik-llamacpp", "openvino"])
    followed = on_the_file(peers, "/models/x.gguf")
    assert followed[0].args == ("--model", "/models/x.gguf")
    assert followed[1].args == ("--fork", "ik_llama.cpp", "--model", "/models/x.gguf")
    assert followed[2] == peers[2] and on_the_file(peers, None) == peers


# ----- agreement, table and ratios ---------------------------------------------------------------------


def _result(engine: str, tokens_per_s: dict[str, float], outputs: list[list[int]], p50: float = 10.0) -> EngineResult:
    """Each workload with ``outputs`` as its requests' tokens, timed to the given tokens/s."""
    total = sum(len(o) for o in outputs)
    runs = {name: WorkloadResult(name, total / tps, outputs, [None] * len(outputs), [p50] * len(outputs))
            for name, tps in tokens_per_s.items()}
    return EngineResult(engine, "v", runs)


def test_agreement_counts_first_tokens_and_stops_at_eos():
    ours = _result("Conveyor", {"W2": 1.0}, [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 0, 9, 9, 9, 9, 9], [5, 5]])
    theirs = _result("peer", {"W2": 1.0}, [[1, 2, 3, 4, 5, 6, 7, 8, 0], [1, 2, 3, 3, 3, 3, 3, 3], [5, 6]])
    # Request 1 differs only past 8 tokens; request 2 only after our EOS (0); request 3 really differs.
    assert agreement(ours, theirs, eos_token_id=0) == (2, 3)
    assert agreement(ours, theirs, eos_token_id=None) == (1, 3)
    assert agreement(ours, _result("other", {"W1@64": 1.0}, [[1]]), eos_token_id=0) == (0, 0)
    unknown = _result("no ids", {"W2": 1.0}, [[-1] * 9, [1, 2, 3, 3, 3, 3, 3, 3], [-1, -1]])
    assert agreement(ours, unknown, eos_token_id=0) == (1, 1)  # only the request whose ids came back counts


def test_table_ratios_read_above_one_where_conveyor_is_ahead():
    outputs = [[1, 2, 3, 4]]
    conveyor = _result("Conveyor", {"W1@1": 50.0, "W1@64": 400.0, "W2": 150.0}, outputs, p50=20.0)
    slower = _result("slower", {"W1@1": 25.0, "W1@64": 500.0, "W2": 100.0}, outputs, p50=40.0)
    partial = _result("partial", {"W1@64": 200.0}, [[1, 2, 9, 9]])
    comparison = Comparison({"cpu": "test"}, [], 0, conveyor, [slower, partial])
    rows = {row[0]: row for row in comparison.rows()}
    assert rows["Conveyor"][6:] == ["1.00x", "1.00x", "1.00x", "1.00x", "reference"]
    assert rows["slower"][2:6] == pytest.approx([25.0, 500.0, 100.0, 40.0])
    assert rows["slower"][6:] == ["2.00x", "0.80x", "1.50x", "2.00x", "3/3"]
    assert rows["partial"][2:] == ["-", 200.0, "-", "-", "-", "2.00x", "-", "-", "0/1"]
    table = comparison.table()
    assert "W1@64 Conveyor/peer" in table and "W2 p50 peer/Conveyor" in table
    saved = comparison.to_json()
    assert [e["engine"] for e in saved["engines"]] == ["Conveyor", "slower", "partial"]
    assert saved["engines"][1]["results"]["W2"]["output_tokens_per_s"] == pytest.approx(100.0)
    assert saved["engines"][2]["first_tokens_agree"] == {"matched": 0, "compared": 1}
    assert saved["engines"][0]["first_tokens_agree"] is None


def test_compare_refuses_unknown_peers_and_bad_sizes_before_running_anything():
    assert main(["bench", "compare", "--peers", "openvino,elsewhere"]) == 2
    assert main(["bench", "compare", "--w1-single", "65"]) == 2
    assert main(["bench", "compare", "--limit", "0"]) == 2
    assert main(["bench", "compare", "--rounds", "0"]) == 2


def test_rounds_report_the_median_of_each_rounds_ratio_and_its_spread():
    outputs = [[1, 2, 3, 4]]

    def round_of(ours: float, theirs: float, ours_at_once: float) -> Comparison:
        conveyor = _result("Conveyor", {"W1@1": ours, "W1@64": ours_at_once}, outputs)
        return Comparison({"cpu": "test"}, [], 0, conveyor, [_result("peer", {"W1@1": theirs}, outputs)])

    # The machine slows down in round 2 under both engines; the ratios are 1.5, 1.5 and 1.2.
    rounds = Rounds([round_of(30.0, 20.0, 90.0), round_of(15.0, 10.0, 80.0), round_of(36.0, 30.0, 70.0)])
    medians = rounds.median_ratios()
    assert medians == {"peer": {"W1@1 Conveyor/peer": pytest.approx((1.5, 1.2, 1.5))}}  # no W1@64 of the peer
    assert "1.50x (1.20-1.50)" in rounds.table() and "median of 3 rounds" in rounds.table()
    saved = rounds.to_json()
    assert len(saved["rounds"]) == 3 and saved["rounds"][1][1]["results"]["W1@1"]["output_tokens_per_s"] == 10.0
    assert saved["median_ratios"]["peer"]["W1@1 Conveyor/peer"]["median"] == pytest.approx(1.5)


def test_conveyor_runs_the_comparison_in_the_dtype_asked_and_says_so():
    from conveyor.benchmarks.compare import conveyor_on_workloads

    workloads, result, _ = conveyor_on_workloads(("W1@1",), w1_single=1, limit=1, max_output_len=4, threads=1,
                                                 dtype="bfloat16")
    assert result.engine == "Conveyor in-process (bfloat16)"
    assert [len(ids) for ids in result.results["W1@1"].output_token_ids] == [4]
    assert len(workloads) == 1 and workloads[0].name == "W1@1"


def test_compare_times_conveyor_through_its_own_server(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "compare.json"
    assert main(["bench", "compare", "--peers", "", "--workloads", "W1@1,W1@64", "--limit", "2",
                 "--max-output-len", "5", "--model", str(tiny_model_dir), "--num-threads", "1",
                 "--serve-args", "--num-kv-blocks 256 --kernels torch", "-o", str(out)]) == 0
    saved = json.loads(out.read_text())
    (engine,) = saved["engines"]
    assert engine["engine"] == "Conveyor server"
    assert engine["results"]["W1@64"]["output_tokens"] == 10 and engine["results"]["W1@1"]["num_requests"] == 2
    assert engine["results"]["W1@64"]["ttft_mean_s"] > 0


def test_a_streamed_answer_is_read_from_its_last_event():
    import asyncio

    import httpx

    runner = _peer_module("run_llamacpp")
    client_module = sys.modules["http_client"]  # the runner's own client, imported with it
    events = ['data: {"content": "a", "stop": false}', "",
              'data: {"content": "", "stop": true, "tokens_predicted": 5, "timings": {"predicted_ms": 250.0}}', ""]

    def answer(request: httpx.Request) -> httpx.Response:
        assert json.loads(request.content)["stream"] is True  # the body asks for the stream
        return httpx.Response(200, text="\n".join(events), headers={"content-type": "text/event-stream"})

    async def one():
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            return await client_module._one(client, runner.endpoint(1, streamed=True), {"prompt_token_ids": [1],
                                                                                       "output_len": 5})

    record = asyncio.run(one())
    assert record["output_token_ids"] == [runner.UNKNOWN_TOKEN] * 5 and record["latency_s"] >= record["ttft_s"]
