"""``conveyor bench compare``: Conveyor and the engines a user would pick instead, on the same workloads.

Every engine is timed the way a user meets it. Conveyor runs as its own ``conveyor serve``
(``bench/peers/run_conveyor.py``), and every served peer (llama.cpp) as its own server, all
asked by one HTTP client (``bench/peers/http_client.py``) on the same token ids and the same
threads; engines that have no server of their own (OpenVINO GenAI, vLLM's offline LLM,
transformers) run through their runner scripts in their own virtual environments, set up
under ``.peers/`` by ``bench/peers/setup_*.sh``. One engine after another, so every ratio
comes from one sitting on one machine (machines of this kind differ by up to 2x from day to
day). ``--in-process`` adds Conveyor's engine called in this process, a row named for what it
is (no HTTP, no server threads). Greedy engines on the same weights should agree token for
token, so the first tokens of every request are checked against Conveyor's server's as well.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from importlib.metadata import version
from pathlib import Path
from typing import Any

from conveyor.benchmarks.report import format_table
from conveyor.benchmarks.throughput import run_all_at_once
from conveyor.benchmarks.workload import AT_ONCE, ONE_AT_A_TIME, SyntheticRequest, Workload
from conveyor.engine import Engine
from conveyor.observe.figures import percentile

ROOT = Path(__file__).resolve().parents[2]
PEERS_DIR = ROOT / "bench" / "peers"
AGREEMENT_TOKENS = 8  # greedy outputs are compared on this many first tokens
WARMUP_TOKENS = 4


@dataclass(frozen=True, slots=True)
class Peer:
    name: str  # what --peers takes
    runner: str  # the script in bench/peers
    python: str | None  # its interpreter, relative to the root; None: this one (the project's .venv)
    needs: tuple[str, ...]  # what its set-up script leaves, relative to the root
    setup: str
    args: tuple[str, ...] = ()  # its runner's own options

    def missing(self, root: Path = ROOT) -> list[str]:
        paths = [self.python] if self.python else []
        return [p for p in (*paths, *self.needs) if not (root / p).exists()]


PEERS = (
    Peer("openvino", "run_openvino.py", ".peers/openvino/bin/python", (".peers/openvino/model/openvino_model.xml",),
         "setup_openvino.sh"),
    # OpenVINO's own default: an 8-bit KV cache (lossy; every other engine here keeps float32).
    Peer("openvino-u8kv", "run_openvino.py", ".peers/openvino/bin/python",
         (".peers/openvino/model/openvino_model.xml",), "setup_openvino.sh", ("--kv-cache-precision", "u8")),
    # OpenVINO's defaults throughout: its inference precision (bf16 on CPUs with AVX512-BF16 or AMX) and KV cache
    # (u8): the peer for `--dtype bfloat16`.
    Peer("openvino-default", "run_openvino.py", ".peers/openvino/bin/python",
         (".peers/openvino/model/openvino_model.xml",), "setup_openvino.sh",
         ("--inference-precision", "default", "--kv-cache-precision", "default")),
    Peer("llamacpp", "run_llamacpp.py", None,
         (".peers/llama.cpp/build/bin/llama-server", ".peers/llama.cpp/model-f32.gguf"), "setup_llamacpp.sh"),
    # llama.cpp on the file the default model ships as (Q4_1), and on that file requantized to Q8_0.
    Peer("llamacpp-q4_1", "run_llamacpp.py", None, (".peers/llama.cpp/build/bin/llama-server",),
         "setup_llamacpp.sh", ("--gguf", "q4_1")),
    Peer("llamacpp-q8_0", "run_llamacpp.py", None,
         (".peers/llama.cpp/build/bin/llama-server", ".peers/llama.cpp/model-q8_0.gguf"), "setup_llamacpp.sh",
         ("--gguf", "q8_0")),
    # ik_llama.cpp (a llama.cpp fork with row-interleaved layouts, repacked at load by -rtr), built by hand from
    # its public source into .peers/ik_llama.cpp (not by `make`): on the default model's Q4_1 file.
    Peer("ik-llamacpp", "run_llamacpp.py", None, (".peers/ik_llama.cpp/build/bin/llama-server",),
         "by hand (docs/benchmarks/peers.md#ik_llamacpp)", ("--gguf", "q4_1", "--fork", "ik_llama.cpp")),
    # llama.cpp on Gemma 3 270M's Q4_K_M file (with `conveyor bench compare --model gemma3-270m`).
    Peer("llamacpp-gemma3-270m", "run_llamacpp.py", None, (".peers/llama.cpp/build/bin/llama-server",),
         "setup_llamacpp.sh", ("--gguf", "gemma3-270m")),
    # OpenVINO's own weight compression of the same weights (int8; int4 with some layers kept int8).
    Peer("openvino-int8", "run_openvino.py", ".peers/openvino/bin/python",
         (".peers/openvino/model-int8/openvino_model.xml",), "setup_openvino.sh",
         ("--model", ".peers/openvino/model-int8")),
    Peer("openvino-int4", "run_openvino.py", ".peers/openvino/bin/python",
         (".peers/openvino/model-int4/openvino_model.xml",), "setup_openvino.sh",
         ("--model", ".peers/openvino/model-int4")),
    Peer("vllm", "run_vllm.py", ".peers/vllm/bin/python", (".peers/vllm/.ready", ".peers/model/config.json"),
         "setup_vllm.sh"),
    Peer("transformers", "run_transformers.py", None, (".peers/model/config.json",), "setup_transformers.sh"),
)


@dataclass(slots=True)
class WorkloadResult:
    """One engine on one workload: per request (in workload order) the output ids, TTFT and latency."""

    workload: str
    wall_s: float  # first submit to last finish
    output_token_ids: list[list[int]]
    ttft_s: list[float | None]
    latency_s: list[float]

    @property
    def output_tokens_per_s(self) -> float:
        return sum(len(ids) for ids in self.output_token_ids) / self.wall_s

    @property
    def latency_p50_s(self) -> float:
        return percentile(self.latency_s, 50)

    @property
    def ttft_mean_s(self) -> float | None:
        ttft = [t for t in self.ttft_s if t is not None]
        return sum(ttft) / len(ttft) if ttft else None

    def figures(self) -> dict[str, Any]:
        ttft = [t for t in self.ttft_s if t is not None]
        return {"num_requests": len(self.latency_s), "output_tokens": sum(len(i) for i in self.output_token_ids),
                "wall_s": self.wall_s, "output_tokens_per_s": self.output_tokens_per_s,
                "latency_p50_s": self.latency_p50_s, "latency_p99_s": percentile(self.latency_s, 99),
                "ttft_p50_s": percentile(ttft, 50) if ttft else None, "ttft_mean_s": self.ttft_mean_s}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WorkloadResult:
        requests = data["requests"]
        return cls(data["workload"], data["wall_s"], [r["output_token_ids"] for r in requests],
                   [r["ttft_s"] for r in requests], [r["latency_s"] for r in requests])


@dataclass(slots=True)
class EngineResult:
    engine: str
    version: str
    results: dict[str, WorkloadResult] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EngineResult:
        results = [WorkloadResult.from_json(r) for r in data["results"]]
        return cls(data["engine"], data["version"], {r.workload: r for r in results})


# ----- running -----------------------------------------------------------------------------------------


def shrink(workloads: list[Workload], limit: int | None, max_output_len: int | None) -> list[Workload]:
    """The first ``limit`` requests of each workload, outputs capped: a quick check, not a benchmark."""
    def cut(r: SyntheticRequest) -> SyntheticRequest:
        return SyntheticRequest(r.prompt_token_ids, min(r.output_len, max_output_len or r.output_len))

    return [replace(w, requests=[cut(r) for r in w.requests[:limit]]) for w in workloads]


def _conveyor_together(engine: Engine, requests: list[SyntheticRequest]) -> list[dict[str, Any]]:
    """All requests submitted at once, stepped to the end; times counted from the submit."""
    outputs, _ = run_all_at_once(engine, requests)
    return [{"output_token_ids": o.token_ids, "ttft_s": o.metrics.time_to_first_token, "latency_s": o.metrics.latency}
            for o in outputs]


def run_conveyor(engines: dict[bool, Engine], workloads: list[Workload], name: str = "Conveyor") -> EngineResult:
    """The same protocol as the peer runners (bench/peers/peer_io.py): one warm-up, then each workload, on the
    engine with prefix caching on or off as the workload says (``engines[workload.prefix_caching]``)."""
    first = workloads[0].requests[0]
    for engine in engines.values():
        _conveyor_together(engine, [SyntheticRequest(first.prompt_token_ids, WARMUP_TOKENS)])
    result = EngineResult(name, version("conveyor"))
    for workload in workloads:
        engine = engines[workload.prefix_caching]
        start = time.perf_counter()
        if workload.mode == AT_ONCE:
            records = _conveyor_together(engine, workload.requests)
        elif workload.mode == ONE_AT_A_TIME:
            records = [_conveyor_together(engine, [r])[0] for r in workload.requests]
        else:
            raise ValueError(f"workload {workload.name}: unknown mode {workload.mode!r}")
        wall = time.perf_counter() - start
        result.results[workload.name] = WorkloadResult.from_json(
            {"workload": workload.name, "wall_s": wall, "requests": records})
        print(f"Conveyor: {workload.name} done in {wall:.1f} s", file=sys.stderr, flush=True)
    return result


def run_peer(peer: Peer, workload_files: list[Path], result_file: Path, root: Path = ROOT,
             threads: int | None = None) -> EngineResult:
    """The peer's runner in its own interpreter, on ``threads`` CPU threads (Conveyor's); its output goes
    straight to the terminal."""
    python = str(root / peer.python) if peer.python else sys.executable
    command = [python, str(root / "bench" / "peers" / peer.runner), *map(str, workload_files),
               "--result", str(result_file), *peer.args]
    if threads is not None:
        command += ["--threads", str(threads)]
    subprocess.run(command, cwd=root, check=True)
    return EngineResult.from_json(json.loads(result_file.read_text()))


def run_peers(peers: list[Peer], workloads: list[Workload], root: Path = ROOT,
              threads: int | None = None) -> list[EngineResult]:
    """Every installed peer on the workloads, one after another; missing or failing ones are reported."""
    results = []
    with tempfile.TemporaryDirectory(prefix="conveyor-compare-") as tmp:
        files = [Path(tmp) / f"workload-{i}.json" for i in range(len(workloads))]
        for path, workload in zip(files, workloads):
            path.write_text(json.dumps(workload.to_json()))
        for peer in peers:
            missing = peer.missing(root)
            if missing:
                how = (f"run `bash bench/peers/{peer.setup}` or `make bench-peers`" if peer.setup.endswith(".sh")
                       else f"it is set up {peer.setup}")
                print(f"skipping {peer.name}: not set up (no {missing[0]}); {how}", file=sys.stderr)
                continue
            print(f"running {peer.name} ...", file=sys.stderr, flush=True)
            try:
                results.append(run_peer(peer, files, Path(tmp) / f"result-{peer.name}.json", root, threads))
            except (subprocess.CalledProcessError, OSError, KeyError, ValueError) as error:
                print(f"{peer.name} failed: {error}", file=sys.stderr)
    return results


# ----- reporting ---------------------------------------------------------------------------------------


def agreement(reference: EngineResult, other: EngineResult, eos_token_id: int | None,
              num_tokens: int = AGREEMENT_TOKENS) -> tuple[int, int]:
    """(requests whose first ``num_tokens`` output ids equal the reference's, requests compared).

    Engines read ``ignore_eos`` two ways: some may still produce the end-of-sequence token and go on
    (Conveyor, transformers), others never produce it (min_tokens, an EOS logit bias). Where either
    output holds one, the outputs are compared only up to it. Outputs whose ids the engine did not return
    (negative ids) are not compared."""
    matched = total = 0
    for name, ours in reference.results.items():
        theirs = other.results.get(name)
        if theirs is None:
            continue
        for a, b in zip(ours.output_token_ids, theirs.output_token_ids):
            if any(token < 0 for token in b):  # a server that returned no ids (run_llamacpp.UNKNOWN_TOKEN)
                continue
            n = min(num_tokens, _index(a, eos_token_id), _index(b, eos_token_id))
            total += 1
            matched += a[:n] == b[:n]
    return matched, total


def _index(token_ids: list[int], token_id: int | None) -> int:
    return token_ids.index(token_id) if token_id in token_ids else len(token_ids)


# (workload, figure, its column, its ratio's column); ratios read > 1 where Conveyor is ahead.
COLUMNS = (
    ("W1@1", "output_tokens_per_s", "W1@1 tok/s", "W1@1 Conveyor/peer"),
    ("W1@64", "output_tokens_per_s", "W1@64 tok/s", "W1@64 Conveyor/peer"),
    ("W2", "output_tokens_per_s", "W2 output tok/s", "W2 Conveyor/peer"),
    ("W2", "latency_p50_s", "W2 p50 latency s", "W2 p50 peer/Conveyor"),
    ("SP", "output_tokens_per_s", "SP output tok/s", "SP Conveyor/peer"),
    ("SP", "ttft_mean_s", "SP mean TTFT s", "SP mean TTFT peer/Conveyor"),
)


def _figure(result: EngineResult, workload: str, attribute: str) -> float | None:
    run = result.results.get(workload)
    return getattr(run, attribute) if run is not None else None


def _ratio(ours: float | None, theirs: float | None, higher_is_better: bool) -> float | None:
    """How far Conveyor is ahead: > 1 means Conveyor is faster, whichever way the figure runs."""
    if ours is None or theirs is None or not ours or not theirs:
        return None
    return ours / theirs if higher_is_better else theirs / ours


@dataclass(slots=True)
class Comparison:
    """Everything one run measured: what the table, the agreement check and the JSON are made of."""

    machine: dict[str, Any]
    workloads: list[Workload]
    eos_token_id: int | None  # the model's; where outputs hold it, agreement stops there
    conveyor: EngineResult
    peers: list[EngineResult]

    def agreement(self, result: EngineResult) -> tuple[int, int]:
        return agreement(self.conveyor, result, self.eos_token_id)

    def columns(self) -> list[tuple[str, str, str, str]]:
        """The table's columns: those of the workloads some engine ran."""
        ran = {name for result in (self.conveyor, *self.peers) for name in result.results}
        return [column for column in COLUMNS if column[0] in ran]

    def ratios(self, result: EngineResult) -> dict[str, float | None]:
        """Conveyor's ratio to ``result`` under each ratio column's header."""
        return {header: _ratio(_figure(self.conveyor, w, a), _figure(result, w, a), a == "output_tokens_per_s")
                for w, a, _, header in self.columns()}

    def rows(self) -> list[list[object]]:
        columns, rows = self.columns(), []
        for result in (self.conveyor, *self.peers):
            figures = [_figure(result, w, a) for w, a, _, _ in columns]
            ratios = ["-" if r is None else f"{r:.2f}x" for r in self.ratios(result).values()]
            agree = "reference" if result is self.conveyor else "{}/{}".format(*self.agreement(result))
            rows.append([result.engine, result.version, *("-" if f is None else f for f in figures), *ratios, agree])
        return rows

    def table(self) -> str:
        columns = self.columns()
        headers = ["engine", "version", *(c[2] for c in columns), *(c[3] for c in columns),
                   f"first {AGREEMENT_TOKENS} tokens agree"]
        return format_table(headers, self.rows())

    def to_json(self) -> dict[str, Any]:
        return {
            "machine": self.machine,
            "workloads": {w.name: {"mode": w.mode, "num_requests": len(w.requests),
                                   "output_tokens": sum(r.output_len for r in w.requests)} for w in self.workloads},
            "engines": [{"engine": r.engine, "version": r.version,
                         "first_tokens_agree": None if r is self.conveyor else dict(
                             zip(("matched", "compared"), self.agreement(r))),
                         "results": {name: run.figures() for name, run in r.results.items()}}
                        for r in (self.conveyor, *self.peers)],
        }


@dataclass(slots=True)
class Rounds:
    """Several comparisons of the same engines run in turn (Conveyor, the peers, Conveyor again, ...). These
    machines change speed by a third within minutes, under every engine alike, so a ratio means most between
    neighbours: each round's ratio is taken, and their median is the figure (the spread beside it)."""

    comparisons: list[Comparison]

    def median_ratios(self) -> dict[str, dict[str, tuple[float, float, float]]]:
        """By peer, by ratio column: (median, lowest, highest) of the rounds' ratios that exist."""
        found: dict[str, dict[str, list[float]]] = {}
        for comparison in self.comparisons:
            for peer in comparison.peers:
                for header, value in comparison.ratios(peer).items():
                    if value is not None:
                        found.setdefault(peer.engine, {}).setdefault(header, []).append(value)
        return {engine: {header: (statistics.median(values), min(values), max(values))
                         for header, values in by_header.items()} for engine, by_header in found.items()}

    def table(self) -> str:
        medians = self.median_ratios()
        headers = sorted({h for by_header in medians.values() for h in by_header},
                         key=[c[3] for c in COLUMNS].index)
        rows = [[engine, *(f"{by[h][0]:.2f}x ({by[h][1]:.2f}-{by[h][2]:.2f})" if h in by else "-" for h in headers)]
                for engine, by in medians.items()]
        return format_table(["engine", *(f"{h}, median of {len(self.comparisons)} rounds" for h in headers)], rows)

    def to_json(self) -> dict[str, Any]:
        first = self.comparisons[0].to_json()
        return {"machine": first["machine"], "workloads": first["workloads"],
                "rounds": [c.to_json()["engines"] for c in self.comparisons],
                "median_ratios": {engine: {h: dict(zip(("median", "lowest", "highest"), v)) for h, v in by.items()}
                                  for engine, by in self.median_ratios().items()}}


def machine_info(threads: int) -> dict[str, Any]:
    import torch

    from conveyor.benchmarks.machine import _cpu_name

    return {"cpu": _cpu_name(), "cores": os.cpu_count(), "threads (every engine)": threads, "torch": torch.__version__,
            "python": platform.python_version()}


# ----- the command -------------------------------------------------------------------------------------


def conveyor_on_workloads(names: tuple[str, ...], w1_single: int, limit: int | None, max_output_len: int | None,
                          threads: int | None = None, dtype: str = "float32", model: str | None = None,
                          workloads: list[Workload] | None = None,
                          ) -> tuple[list[Workload], EngineResult, int | None]:
    """Conveyor with its default configuration (in ``dtype``) on ``model`` (None: the default model, as its
    GGUF file: weights kept quantized); the workloads come from its tokenizer unless given. Returns them, its
    result and the model's EOS id. The engine is dropped on return: its memory is free before the peers start."""
    from conveyor.benchmarks.workload import comparison_workloads
    from conveyor.core.config import EngineConfig

    def engine_with(caching: bool) -> Engine:  # prefix caching off as every peer runs W1 and W2; on for SP
        return Engine(EngineConfig(model=model, enable_prefix_caching=caching, num_threads=threads, dtype=dtype))

    engine = engine_with(False)
    if workloads is None:
        workloads = comparison_workloads(engine.tokenizer, engine.model_config.vocab_size, w1_single, names)
        workloads = shrink(workloads, limit, max_output_len)
    engines = {caching: engine if not caching else engine_with(True) for caching in {w.prefix_caching
                                                                                   for w in workloads}}
    stored = engine.runner.kernel_dtype or dtype  # the weights' format on the native stack ("Q4_1+Q8_0", "float32")
    return workloads, run_conveyor(engines, workloads, f"Conveyor in-process ({stored})"), engine.tokenizer.eos_token_id


def select_peers(names: list[str]) -> list[Peer]:
    known = {p.name: p for p in PEERS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"--peers: unknown {unknown}; choose from {', '.join(known)}")
    return [known[n] for n in names]


CONVEYOR_SERVER = Peer("conveyor", "run_conveyor.py", None, (), "")
CONVEYOR_SERVER_NAME = "Conveyor server"  # the reference row every ratio is taken against


def conveyor_server(model: str | None, dtype: str, serve_args: str, name: str = CONVEYOR_SERVER_NAME) -> Peer:
    """Conveyor's own server as a runner, on ``model`` in ``dtype``, with ``serve_args`` for ``conveyor serve``."""
    flags = f"--dtype {dtype} {serve_args}".strip()
    return replace(CONVEYOR_SERVER, args=(*(("--model", model) if model else ()), "--serve-args", flags,
                                          "--name", name))


def on_the_file(peers: list[Peer], model: str | None) -> list[Peer]:
    """Where Conveyor's model is a GGUF file of the user's, the llama.cpp peers run that very file."""
    if not model or not str(model).endswith(".gguf"):
        return peers
    def follow(peer: Peer) -> Peer:
        if peer.runner != "run_llamacpp.py":
            return peer
        kept = [a for i, a in enumerate(peer.args) if a != "--gguf" and (i == 0 or peer.args[i - 1] != "--gguf")]
        return replace(peer, args=(*kept, "--model", str(Path(model).resolve())))
    return [follow(p) for p in peers]


def model_workloads(model: str | None, names: tuple[str, ...], w1_single: int, limit: int | None,
                    max_output_len: int | None) -> tuple[list[Workload], int | None]:
    """The workloads in ``model``'s token ids (its tokenizer alone: no weights are loaded) and its EOS id."""
    from conveyor.benchmarks.workload import comparison_workloads
    from conveyor.core.model_config import ModelConfig
    from conveyor.engine.tokenizer import Tokenizer
    from conveyor.model.weights.paths import resolve_model

    folder = resolve_model(model)
    tokenizer = Tokenizer(folder)
    workloads = comparison_workloads(tokenizer, ModelConfig.from_folder(folder).vocab_size, w1_single, names)
    return shrink(workloads, limit, max_output_len), tokenizer.eos_token_id


def compare(workload_names: list[str], peer_names: list[str], w1_single: int, limit: int | None = None,
            max_output_len: int | None = None, output: str | None = None, num_threads: int | None = None,
            dtype: str = "float32", model: str | None = None, float32: bool = False, in_process: bool = False,
            serve_args: str = "", rounds: int = 1) -> int:
    """Run everything on ``num_threads`` threads each (default: the usable cores): Conveyor's server in
    ``dtype`` on ``model`` (with ``float32``, on its float32 weights too; with ``in_process``, its engine called
    in this process as well), then each peer, ``rounds`` times in turn; print machine info and each round's
    table (and with more than one, the median of the rounds' ratios), write JSON to ``output``."""
    if not 1 <= w1_single <= 64:
        raise ValueError(f"--w1-single must be in [1, 64], got {w1_single}")
    if rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {rounds}")
    if (limit is not None and limit < 1) or (max_output_len is not None and max_output_len < 1):
        raise ValueError("--limit and --max-output-len must be >= 1")
    peers = on_the_file(select_peers(peer_names), model)
    if not PEERS_DIR.is_dir():
        raise FileNotFoundError(f"bench compare: no {PEERS_DIR}; it runs from a source checkout of Conveyor")
    from conveyor.core.config import usable_cores

    threads = num_threads or usable_cores()
    machine = machine_info(threads)
    print("machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()), flush=True)
    workloads, eos_token_id = model_workloads(model, tuple(workload_names), w1_single, limit, max_output_len)
    ours = [conveyor_server(model, dtype, serve_args)]
    if float32:
        from conveyor.model.weights.loader import float32_folder

        ours.append(conveyor_server(str(float32_folder(model)), "float32", serve_args, "Conveyor server (float32)"))
    comparisons = []
    for round_number in range(1, rounds + 1):
        results = run_peers(ours + peers, workloads, threads=threads)
        if not results or results[0].engine != CONVEYOR_SERVER_NAME:
            raise RuntimeError("bench compare: Conveyor's own server did not run; see the messages above")
        if in_process:
            results.insert(1, conveyor_on_workloads((), w1_single, None, None, threads, dtype, model, workloads)[1])
        comparisons.append(Comparison(machine, workloads, eos_token_id, results[0], results[1:]))
        print((f"round {round_number} of {rounds}\n" if rounds > 1 else "") + comparisons[-1].table(), flush=True)
    summary = Rounds(comparisons) if rounds > 1 else None
    if summary is not None:
        print(summary.table())
    if output:
        saved = comparisons[0].to_json() if summary is None else summary.to_json()
        Path(output).write_text(json.dumps(saved, indent=2) + "\n")
        print(f"wrote {output}")
    return 0
