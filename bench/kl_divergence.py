"""How far a quantized file's next-token distributions lie from its float32 reference's: KL divergence, as
``llama-perplexity --kl-divergence`` reports it, for Conveyor and, where it is set up, llama.cpp.

Greedy continuations and perplexity (``conveyor bench agreement``) hide much: a token agrees until a near-tie
flips, and perplexity's errors cancel. The KL divergence of every scored token's whole distribution does not:
a kernel that loses precision shows in it even where the greedy tokens agree. The protocol is
``llama-perplexity``'s (chunks of ``--context`` tokens, the second half of each scored); the reference is the
same weights dequantized, on the float32 path (Conveyor: ``bench agreement``'s reference; llama.cpp: the file
converted to F32 by ``llama-quantize``). Each engine is held to its own float run, so that the two columns
say how much each engine's quantized arithmetic (the activations' int8 steps, its sums) moves the answers.

    python bench/kl_divergence.py [--model M] [--context 256] [--text tests/data/declaration-of-independence.txt]
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from conveyor.benchmarks.agreement import LLAMA_BIN, float_reference
from conveyor.benchmarks.perplexity import text_chunks
from conveyor.benchmarks.report import format_table
from conveyor.core.config import EngineConfig, usable_cores
from conveyor.core.sampling import SamplingParams
from conveyor.engine import Engine
from conveyor.model.weights.paths import gguf_source, resolve_model

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class Divergence:
    """The figures llama-perplexity prints for a quantized run against its base."""

    mean_kld: float
    median_kld: float
    rms_dp: float  # percent: the root mean square change of the scored token's probability
    same_top: float  # percent of scored tokens whose most likely next token is the reference's


def scored_logprobs(config: EngineConfig, text: str, context: int) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Each chunk's scored positions' log-probabilities over the whole vocabulary, and the tokens they score.

    A chunk runs as one request (prompt logprobs on), alone; the engine's LM head over its prompt rows is read as
    it computes them (Decoder.compute_logits), so the distributions are the engine's own, not recomputed."""
    engine = Engine(config)
    chunks, _ = text_chunks(engine, text, context)
    model = engine.executor.model
    rows: list[torch.Tensor] = []
    head = model.compute_logits

    def reading_head(hidden: torch.Tensor) -> torch.Tensor:
        logits = head(hidden)
        if hidden.shape[0] > 1:  # prompt rows (a sampled row alone is the step's one new token)
            rows.append(torch.log_softmax(logits.float(), dim=-1))
        return logits

    model.compute_logits = reading_head
    first = context // 2
    distributions, targets = [], []
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    for chunk in chunks:
        rows.clear()
        engine.add_request(chunk, params)
        while engine.has_unfinished_requests():
            engine.step()
        every = torch.cat(rows)  # row j predicts chunk[j + 1]
        if every.shape[0] != len(chunk) - 1:
            raise RuntimeError(f"read {every.shape[0]} prompt rows of a {len(chunk)}-token chunk")
        distributions.append(every[first:])
        targets.append(chunk[first + 1:])
    return distributions, targets


def divergence(base: list[torch.Tensor], quantized: list[torch.Tensor], targets: list[list[int]]) -> Divergence:
    kld, dp, same = [], [], 0
    for b, q, t in zip(base, quantized, targets, strict=True):
        kld.extend((b.exp() * (b - q)).sum(-1).tolist())
        index, rows = torch.tensor(t), torch.arange(len(t))
        dp.extend((q[rows, index].exp() - b[rows, index].exp()).tolist())
        same += int((b.argmax(-1) == q.argmax(-1)).sum())
    return Divergence(statistics.mean(kld), statistics.median(kld),
                      100 * math.sqrt(statistics.mean(d * d for d in dp)), 100 * same / len(dp))


def llama_cpp_divergence(gguf: Path, text_file: Path, context: int, threads: int) -> Divergence:
    """llama-perplexity's KL divergence of the file against its own F32 conversion (llama-quantize)."""
    with tempfile.TemporaryDirectory(prefix="conveyor-kld-") as tmp:
        f32, base = Path(tmp) / "f32.gguf", Path(tmp) / "base.kld"
        run([LLAMA_BIN / "llama-quantize", "--allow-requantize", gguf, f32, "F32", str(threads)])
        common = ["-f", text_file, "-c", str(context), "-b", str(context), "-t", str(threads),
                  "--kl-divergence-base", base]
        run([LLAMA_BIN / "llama-perplexity", "-m", f32, *common])
        out = run([LLAMA_BIN / "llama-perplexity", "-m", gguf, *common, "--kl-divergence"])

    def figure(label: str) -> float:
        match = re.search(rf"{label}\s*:\s*(-?[0-9.]+)", out)
        if match is None:
            raise RuntimeError(f"llama-perplexity printed no '{label}': {out[-2000:]}")
        return float(match.group(1))

    return Divergence(figure("Mean    KLD"), figure("Median  KLD"), figure("RMS Δp"), figure("Same top p"))


def run(command: list) -> str:
    done = subprocess.run([str(part) for part in command], capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{Path(str(command[0])).name} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout + done.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF file or packaged name (default: the default model)")
    parser.add_argument("--text", type=Path, default=ROOT / "tests" / "data" / "declaration-of-independence.txt")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--no-llamacpp", action="store_true", help="Conveyor only")
    args = parser.parse_args()
    text = args.text.read_text(encoding="utf-8")
    config = EngineConfig(model=args.model, max_model_len=args.context + 1, enable_prefix_caching=False)
    base, targets = scored_logprobs(float_reference(config), text, args.context)
    quantized, same_targets = scored_logprobs(config, text, args.context)
    if same_targets != targets:
        raise RuntimeError("the float and quantized runs scored different tokens")
    rows = [["Conveyor", divergence(base, quantized, targets)]]
    gguf = gguf_source(resolve_model(config.model))
    if not args.no_llamacpp and gguf is not None and (LLAMA_BIN / "llama-perplexity").is_file():
        rows.append(["llama.cpp", llama_cpp_divergence(gguf, args.text, args.context, usable_cores())])
    print(f"model {gguf or config.model}; {sum(len(t) for t in targets)} tokens scored, chunks of {args.context}")
    print(format_table(["engine", "mean KLD", "median KLD", "RMS Δp", "same top token"],
                       [[name, f"{d.mean_kld:.6f}", f"{d.median_kld:.6f}", f"{d.rms_dp:.3f}%", f"{d.same_top:.2f}%"]
                        for name, d in rows]))


if __name__ == "__main__":
    main()
