"""``--kernels auto`` on quantized weights: which dot-product kind runs each projection at each batch size.

A CPU may have several kinds of the quantized kernels (native/csrc/quant_gemm.h): vnni512 and vnni256 where
it has AVX512-VNNI, avx2 everywhere AVX2 is, and the portable one. Which is fastest depends on the shape and
the rows: at one row a step streams the weights and the wider registers cost more per byte in some layouts; at
a batch the 512-bit one does twice the multiply-adds per instruction. So, as for the float GEMMs
(:mod:`conveyor.model.quant.kernel_choice`), each projection shape of the model (``qkv``, ``o``, ``gate_up``,
``down``, the LM head) is timed at each row class a step brings (1, 2-8, 9-64, 65+) on every kind but the
portable one (the reference, never faster where another is built), interleaved round by round. One kind then
runs a projection at every row count: kinds round differently (they quantize activations and add partial sums
their own way), so a kind per row class would give a request other bits alone than in a batch. The kind is the
one least slower than the fastest, summed over the row classes; the summary says what that costs where
another kind would be faster. The choice is cached under the same kind of key (CPU, ISA, build, torch,
threads, shapes).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

import torch

from conveyor.model.quant.kernel_choice import ROW_CLASSES, choice_key, read_choices, store_choice, time_candidates
from conveyor.platform.cache_dir import cache_dir

logger = logging.getLogger("conveyor")
CACHE_FILE = "quantized-kernel-choice.json"
PORTABLE = "portable"

Seconds = dict[str, dict[str, dict[str, float]]]  # projection -> row class -> dot kind -> seconds


@dataclass(frozen=True, slots=True)
class QuantDotChoice:
    """This machine's dot-product kind per projection and row class, and the timings it came from."""

    dots: dict[str, dict[str, str]]  # projection -> row class name -> dot kind
    seconds: Seconds
    measure_s: float
    cached: bool = False

    def ranges(self) -> dict[str, list[tuple[str, int, int]]]:
        """Per projection, (dot kind, lo, hi) for each row class: what NativeDecoder.use_quant_dot takes."""
        classes = {row_class.name: row_class for row_class in ROW_CLASSES}
        return {projection: [(dot, classes[name].lo, classes[name].hi) for name, dot in by_class.items()]
                for projection, by_class in self.dots.items()}

    def summary(self) -> str:
        """``qkv 1: vnni512, 2-8: vnni256, ...`` collapsed to the kinds chosen and where."""
        chosen: dict[str, list[str]] = {}
        for projection, by_class in self.dots.items():
            for name, dot in by_class.items():
                chosen.setdefault(dot, []).append(f"{projection} {name}")
        source = "from the cache" if self.cached else f"measured in {self.measure_s:.1f} s"
        if len(chosen) == 1:
            text = f"quantized dot products ({source}): {next(iter(chosen))} everywhere"
        else:
            text = f"quantized dot products ({source}): " + "; ".join(
                f"{dot} at {', '.join(places)}" for dot, places in chosen.items())
        slowest = self.cost()
        return text if slowest is None else text + f" (one kind per projection: {slowest})"

    def cost(self) -> str | None:
        """Where one kind per projection is furthest behind the fastest kind at a row class, or None where it
        never is."""
        worst = None
        for projection, by_class in self.seconds.items():
            for name, timed in by_class.items():
                ratio = timed[self.dots[projection][name]] / min(timed.values())
                if ratio > 1.0 and (worst is None or ratio > worst[0]):
                    worst = (ratio, projection, name)
        if worst is None:
            return None
        return f"at most {100 * (worst[0] - 1):.0f}% slower than the fastest kind, {worst[1]} at {worst[2]} rows"


def candidates(kernels: ModuleType) -> list[str]:
    """The kinds worth timing: every one built but the portable reference (alone where it is all there is)."""
    built = list(kernels.quant_dots())
    return [dot for dot in built if dot != PORTABLE] or [PORTABLE]


def one_kind(by_class: Mapping[str, Mapping[str, float]]) -> str:
    """The kind whose time relative to the fastest at each row class, summed over the classes, is least."""
    kinds = list(next(iter(by_class.values())))
    fastest = {name: min(timed.values()) for name, timed in by_class.items()}
    return min(kinds, key=lambda dot: sum(timed[dot] / fastest[name] for name, timed in by_class.items()))


def measure(kernels: ModuleType, weights: Mapping[str, object], dots: list[str]) -> Seconds:
    seconds: Seconds = {}
    for projection, weight in weights.items():
        seconds[projection] = {}
        for row_class in ROW_CLASSES:
            x = torch.randn(row_class.timed_rows, weight.k)
            calls = {dot: (lambda dot=dot, x=x, weight=weight: kernels.quantized_linear(x, weight, dot))
                     for dot in dots}
            seconds[projection][row_class.name] = time_candidates(calls)
    return seconds


def choose_quant_dots(kernels: ModuleType, weights: Mapping[str, object], cache: Path | None = None) -> QuantDotChoice:
    """The choice for a model with these quantized projection ``weights`` (one per projection name): from the
    cache, else measured (a few seconds) and stored."""
    cache = cache or cache_dir() / CACHE_FILE
    dots = candidates(kernels)
    shapes = {name: [weight.n, weight.k, weight.bytes] for name, weight in weights.items()}
    key = choice_key(f"{kernels.__name__}:quantized-one-kind:{','.join(dots)}", [], False, torch.get_num_threads(),
                     shapes)
    stored = read_choices(cache).get(key)
    if stored is not None:
        return QuantDotChoice(**stored | {"cached": True})
    start = time.perf_counter()
    if len(dots) > 1:
        logger.warning("timing the quantized kernels' dot products on this machine (first start here: a few "
                       "seconds, then cached in %s)", cache)
        seconds = measure(kernels, weights, dots)
        chosen = {projection: dict.fromkeys(by_class, one_kind(by_class)) for projection, by_class in seconds.items()}
    else:  # one kind built: nothing to time
        seconds = {}
        chosen = {projection: {row_class.name: dots[0] for row_class in ROW_CLASSES} for projection in weights}
    choice = QuantDotChoice(chosen, seconds, time.perf_counter() - start)
    store_choice(cache, key, asdict(choice) | {"cached": False})
    return choice
