"""How far a quantized file's next-token distributions lie from its float32 reference's: KL divergence, as
``llama-perplexity --kl-divergence`` reports it, for Conveyor and for llama.cpp.

Greedy continuations and perplexity hide much: a token agrees until a near-tie flips, and perplexity's errors
cancel. Perplexity over a page of text also moves by itself: the activations' int8 rounding turns any change
of the last bit (a cache's float16 rounding, an attention scale moved by one part in a million) into another
draw of the same rounding noise, and the default file's perplexity over 762 scored tokens moves by +-0.6% from
draw to draw (llama.cpp's too, with its cache type); its mean KL divergence by +-5%
(docs/quantized-weights.md, "One draw of the rounding"). The KL divergence of every scored token's whole
distribution is the steadier measure, and a kernel that loses precision shows in it even where the greedy
tokens agree.

The protocol is ``llama-perplexity``'s (chunks of ``context`` tokens, the second half of each scored); the
reference is the same weights dequantized, on the float32 path (Conveyor: ``float_reference``, which
``bench agreement`` holds its answers to as well; llama.cpp: the file converted to F32 by ``llama-quantize``).
Each engine is held to its own float run, so that the two figures say how much each engine's quantized
arithmetic (the activations' int8 steps, its sums) moves the answers.
"""

from __future__ import annotations

import math
import re
import statistics
import subprocess
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from conveyor.benchmarks.perplexity import text_chunks
from conveyor.core.config import EngineConfig
from conveyor.core.sampling import SamplingParams
from conveyor.engine import Engine

LLAMA_BIN = Path(__file__).resolve().parents[2] / ".peers" / "llama.cpp" / "build" / "bin"
# llama-perplexity's cache types for Conveyor's --kv-cache-dtype (-ctk and -ctv)
LLAMA_CACHE_TYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def float_reference(config: EngineConfig) -> EngineConfig:
    """The same weights, dequantized to float32, on the float32 path with a float32 KV cache."""
    from conveyor.model.weights.loader import float32_folder

    return replace(config, model=str(float32_folder(config.model)), dtype="float32", quantization="none",
                   kv_cache_dtype="float32")


@dataclass(frozen=True, slots=True)
class Scored:
    """A run's distributions over a text's chunks: each chunk's scored positions' log-probabilities over the
    whole vocabulary, and the tokens they score."""

    distributions: list[torch.Tensor]
    targets: list[list[int]]

    def perplexity(self) -> float:
        """exp of the mean negative log-likelihood of the scored tokens."""
        nll = sum(-float(d[torch.arange(len(t)), torch.tensor(t)].sum())
                  for d, t in zip(self.distributions, self.targets, strict=True))
        return math.exp(nll / sum(len(t) for t in self.targets))


@dataclass(frozen=True, slots=True)
class Divergence:
    """The figures llama-perplexity prints for a quantized run against its base, and the quantized run's
    perplexity over the scored tokens."""

    mean_kld: float
    median_kld: float
    rms_dp: float  # percent: the root mean square change of the scored token's probability
    same_top: float  # percent of scored tokens whose most likely next token is the reference's
    perplexity: float


def scored_logprobs(engine: Engine, text: str, context: int) -> Scored:
    """The engine's distributions over the text cut as llama-perplexity cuts it.

    A chunk runs as one request (prompt logprobs on), alone; the engine's LM head over its prompt rows is read as
    it computes them (Decoder.compute_logits), so the distributions are the engine's own, not recomputed. Every
    prompt row is computed: a request that asks for prompt logprobs never reads the prefix cache."""
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
    try:
        return _read_chunks(engine, chunks, context // 2, rows)
    finally:
        del model.compute_logits  # the class's own again


def _read_chunks(engine: Engine, chunks: list[list[int]], first: int, rows: list[torch.Tensor]) -> Scored:
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
    return Scored(distributions, targets)


def divergence(base: Scored, quantized: Scored) -> Divergence:
    """llama-perplexity's figures for ``quantized`` against ``base``, chunk by chunk over the same targets."""
    if quantized.targets != base.targets:
        raise RuntimeError("the reference and quantized runs scored different tokens")
    kld, dp, same = [], [], 0
    for b, q, t in zip(base.distributions, quantized.distributions, base.targets, strict=True):
        kld.extend((b.exp() * (b - q)).sum(-1).tolist())
        index, rows = torch.tensor(t), torch.arange(len(t))
        dp.extend((q[rows, index].exp() - b[rows, index].exp()).tolist())
        same += int((b.argmax(-1) == q.argmax(-1)).sum())
    return Divergence(statistics.mean(kld), statistics.median(kld),
                      100 * math.sqrt(statistics.mean(d * d for d in dp)), 100 * same / len(dp),
                      quantized.perplexity())


def conveyor_divergence(config: EngineConfig, text: str, context: int) -> Divergence:
    """Conveyor's run of ``config`` against its float32 reference (the same weights dequantized)."""
    return engines_divergence(Engine(float_reference(config)), Engine(config), text, context)


def engines_divergence(reference: Engine, quantized: Engine, text: str, context: int) -> Divergence:
    """``quantized``'s distributions against ``reference``'s over the same chunks of the text."""
    return divergence(scored_logprobs(reference, text, context), scored_logprobs(quantized, text, context))


def llama_cpp_divergence(gguf: Path, text_file: Path, context: int, threads: int,
                         kv_cache_dtype: str = "float16") -> Divergence:
    """llama-perplexity's KL divergence of the file against its own F32 conversion (llama-quantize), the
    quantized run's cache of ``kv_cache_dtype`` (llama.cpp's default: float16)."""
    if kv_cache_dtype not in LLAMA_CACHE_TYPES:
        raise ValueError(f"llama-perplexity has no cache type for {kv_cache_dtype!r}; "
                         f"one of {', '.join(LLAMA_CACHE_TYPES)}")
    cache = LLAMA_CACHE_TYPES[kv_cache_dtype]
    with tempfile.TemporaryDirectory(prefix="conveyor-kld-") as tmp:
        f32, base = Path(tmp) / "f32.gguf", Path(tmp) / "base.kld"
        run([LLAMA_BIN / "llama-quantize", "--allow-requantize", gguf, f32, "F32", str(threads)])
        common = ["-f", text_file, "-c", str(context), "-b", str(context), "-t", str(threads),
                  "--kl-divergence-base", base]
        run([LLAMA_BIN / "llama-perplexity", "-m", f32, *common])
        out = run([LLAMA_BIN / "llama-perplexity", "-m", gguf, *common, "--kl-divergence",
                   "-ctk", cache, "-ctv", cache])

    def figure(label: str) -> float:
        match = re.search(rf"{re.escape(label)}\s*:\s*(-?[0-9.]+)", out)
        if match is None:
            raise RuntimeError(f"llama-perplexity printed no '{label}': {out[-2000:]}")
        return float(match.group(1))

    return Divergence(figure("Mean    KLD"), figure("Median  KLD"), figure("RMS Δp"), figure("Same top p"),
                      figure("Mean PPL(Q)"))


def run(command: list) -> str:
    done = subprocess.run([str(part) for part in command], capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{Path(str(command[0])).name} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout + done.stderr
