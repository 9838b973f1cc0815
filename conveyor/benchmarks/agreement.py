"""``conveyor bench agreement``: how near a quantized file's greedy answers and next-token distributions stay
to the float reference of the same weights, for Conveyor and, where it is set up, for llama.cpp.

The reference is Conveyor's float32 path over the file's weights dequantized (the path the tests hold token for
token to transformers). The prompts are windows of the text, spread evenly across it, each continued greedily
for a fixed number of tokens with end-of-sequence ignored. An engine's row says how many continuations equal
the reference's whole, and where the others first differ; then its perplexity over the text and the mean KL
divergence of its next-token distributions from its float32 run's, by ``llama-perplexity``'s protocol
(``divergence``: llama.cpp is held to its own F32 conversion of the file). Near-ties decide where quantized
continuations part from the float ones, so the first difference says more than the count alone; perplexity
moves by about 1% from one draw of the activations' rounding to the next, the KL divergence by a few percent.
Conveyor's continuations run as one batch: a request's answer is the same alone or batched
(``bench/batch_invariance.py``). llama.cpp's go one at a time, through its server, as ``bench compare`` runs it.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from conveyor.benchmarks.divergence import (
    LLAMA_BIN,
    Scored,
    divergence,
    float_reference,
    llama_cpp_divergence,
    scored_logprobs,
)
from conveyor.benchmarks.report import format_table
from conveyor.core.config import EngineConfig


@dataclass(frozen=True, slots=True)
class EngineAnswers:
    """One engine's greedy continuations of the prompts (in prompt order), its perplexity on the text and the
    mean KL divergence of its distributions from its float32 run's (0 for the reference itself)."""

    engine: str
    weights: str
    outputs: list[list[int]]
    perplexity: float
    mean_kld: float


def text_prompts(token_ids: list[int], count: int, length: int) -> list[list[int]]:
    """``count`` windows of ``length`` tokens, evenly spaced from the start of the text to its end."""
    if count < 1 or length < 1:
        raise ValueError(f"prompts and prompt length must be >= 1, got {count} and {length}")
    last = len(token_ids) - length
    if last < 0:
        raise ValueError(f"the text has {len(token_ids)} tokens, fewer than one prompt of {length}")
    starts = [round(i * last / max(count - 1, 1)) for i in range(count)]
    return [token_ids[start:start + length] for start in starts]


def first_difference(ours: list[int], reference: list[int]) -> int | None:
    """The position of the first token that differs (None: equal throughout)."""
    for position, (a, b) in enumerate(zip(ours, reference)):
        if a != b:
            return position
    return None if len(ours) == len(reference) else min(len(ours), len(reference))


def compared(answers: EngineAnswers, reference: EngineAnswers) -> tuple[int, list[int]]:
    """(continuations equal to the reference's, the first-difference positions of the others)."""
    positions = [first_difference(a, b) for a, b in zip(answers.outputs, reference.outputs, strict=True)]
    return positions.count(None), [p for p in positions if p is not None]


def agreement_table(reference: EngineAnswers, others: list[EngineAnswers], tokens: int) -> str:
    """One row an engine: cases equal to the reference, where the others part from it, perplexity against it,
    the KL divergence from its own float32 run."""
    rows = []
    for answers in (reference, *others):
        equal, parted = compared(answers, reference)
        where = (f"{min(parted)} / {statistics.median(parted):g}" if parted else "-")
        is_reference = answers is reference
        ratio = "-" if is_reference else f"{100 * (answers.perplexity / reference.perplexity - 1):+.2f}%"
        rows.append([answers.engine, answers.weights, "reference" if is_reference else
                     f"{equal}/{len(answers.outputs)}", where, f"{answers.perplexity:.4f}", ratio,
                     "-" if is_reference else f"{answers.mean_kld:.6f}"])
    headers = ["engine", "weights", f"all {tokens} tokens equal to float32", "first difference: min / median",
               "perplexity", "vs float32", "mean KLD from float32"]
    return format_table(headers, rows)


# ----- Conveyor ----------------------------------------------------------------------------------------------


def conveyor_answers(config: EngineConfig, name: str, prompts: list[list[int]], tokens: int, text: str,
                     context: int, base: Scored | None = None) -> tuple[EngineAnswers, Scored]:
    """Greedy continuations from Conveyor's engine on ``config``, all submitted at once, and its distributions
    over the text's chunks, against ``base``'s (None: this run is the reference)."""
    from conveyor.benchmarks.throughput import run_together
    from conveyor.core.sampling import SamplingParams
    from conveyor.engine import Engine

    engine = Engine(config)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    outputs, _ = run_together(engine, prompts, [params] * len(prompts))
    scored = scored_logprobs(engine, text, context)
    mean_kld = 0.0 if base is None else divergence(base, scored).mean_kld
    weights = engine.runner.kernel_dtype or engine.runner.dtype
    return EngineAnswers(name, weights, [list(o.token_ids) for o in outputs], scored.perplexity(), mean_kld), scored


# ----- llama.cpp ---------------------------------------------------------------------------------------------


def llama_cpp_answers(model: Path, prompts: list[list[int]], tokens: int, text_file: Path, context: int,
                      threads: int) -> EngineAnswers:
    """Greedy continuations from llama.cpp's server on the same file, one request after another (its runner in
    bench/peers), and its perplexity and KL divergence from its own F32 conversion (llama-perplexity)."""
    from conveyor.benchmarks.compare import PEERS, run_peer
    from conveyor.benchmarks.workload import ONE_AT_A_TIME, SyntheticRequest, Workload

    peer = next(p for p in PEERS if p.name == "llamacpp")
    peer = replace(peer, args=("--model", str(model)))
    workload = Workload("agreement", ONE_AT_A_TIME, [SyntheticRequest(p, tokens) for p in prompts])
    with tempfile.TemporaryDirectory(prefix="conveyor-agreement-") as tmp:
        workload_file = Path(tmp) / "workload.json"
        workload_file.write_text(json.dumps(workload.to_json()))
        result = run_peer(peer, [workload_file], Path(tmp) / "result.json", threads=threads)
    outputs = result.results["agreement"].output_token_ids
    found = llama_cpp_divergence(model, text_file, context, threads)
    return EngineAnswers(f"llama.cpp {result.version.split(',')[0]}", model.name, outputs, found.perplexity,
                         found.mean_kld)


# ----- the command -------------------------------------------------------------------------------------------


def bench_agreement(config: EngineConfig, text_file: Path, num_prompts: int, prompt_len: int, tokens: int,
                    context: int, llama_cpp: bool = True) -> tuple[str, list[EngineAnswers]]:
    """The table, and every engine's answers (the reference first): Conveyor on ``config`` and on its float32
    reference, and llama.cpp on the same GGUF file where it is set up (and ``llama_cpp``)."""
    from conveyor.core.config import usable_cores
    from conveyor.engine.tokenizer import Tokenizer
    from conveyor.model.weights.paths import gguf_source, resolve_model

    text = text_file.read_text(encoding="utf-8")
    folder = resolve_model(config.model)
    prompts = text_prompts(Tokenizer(folder).encode(text), num_prompts, prompt_len)
    config = replace(config, max_model_len=max(config.max_model_len or 0, context + 1, prompt_len + tokens))
    reference, base = conveyor_answers(float_reference(config), "Conveyor", prompts, tokens, text, context)
    answers = [reference, conveyor_answers(config, "Conveyor", prompts, tokens, text, context, base)[0]]
    gguf = gguf_source(folder)
    server = LLAMA_BIN / "llama-server"
    if llama_cpp and gguf is not None and server.is_file():
        threads = config.num_threads or usable_cores()
        answers.append(llama_cpp_answers(gguf, prompts, tokens, text_file, context, threads))
    elif llama_cpp:
        why = "the model is no GGUF file" if gguf is None else f"no {server} (bash bench/peers/setup_llamacpp.sh)"
        print(f"llama.cpp left out: {why}", file=sys.stderr)
    return agreement_table(reference, answers[1:], tokens), answers
