"""``--kernels auto``: which GEMM runs each projection at each batch size, chosen by timing on this machine.

The native kernels' packed GEMM is not the fastest at every shape on every
CPU: on an AVX2 or AVX-512 machine it streams a decode step's weights faster
than torch's ``F.linear`` (measured 1.2-5.0x on the default model), but where
torch's oneDNN has AMX tiles (Sapphire Rapids and later, in bfloat16) a
prompt's large GEMMs run faster there. So on a machine's first start, for
each projection shape of the model (``qkv``, ``o``, ``gate_up``, ``down``, the
LM head) and each class of row count a step brings (1, 2-8, 9-64, 65+), the
candidates are timed once, interleaved round by round so that a noisy
neighbour slows all of them alike: the packed kernels at each vector width
the CPU has, and torch's GEMM; the gate/up projection is timed with its
SwiGLU, and on the packed kernels also fused into the GEMM. One width is
packed for the whole model (two packings would double its memory); a
(projection, class) goes to torch's GEMM only where that is clearly faster
(:data:`TORCH_MARGIN`), since it keeps a second, plain copy of that weight.
The choice is cached per CPU model, ISA, kernel build, torch version, dtype,
thread count and model shape, so later starts read it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from conveyor.platform.cache_dir import cache_dir, write_cache_file
from conveyor.platform.cpu import this_cpu

logger = logging.getLogger("conveyor")


@dataclass(frozen=True, slots=True)
class RowClass:
    """Steps of ``lo``..``hi`` rows (inclusive), timed at ``timed_rows``."""

    name: str
    lo: int
    hi: int
    timed_rows: int


ROW_CLASSES = (
    RowClass("1", 1, 1, 1),
    RowClass("2-8", 2, 8, 8),
    RowClass("9-64", 9, 64, 64),
    RowClass("65+", 65, 2**62, 256),
)
TORCH = "torch"
TORCH_MARGIN = 0.9  # torch's GEMM must take under 90% of the packed kernels' time to be chosen
ROUNDS = 5  # timed rounds per (projection, row class); the minimum is kept
SHAPE_BUDGET_S = 2.0  # rounds at one (projection, row class) stop early past this (a large model's LM head)
CACHE_FILE = "kernel-choice.json"
CHOICE_VERSION = 2  # what a cached record holds; a record of another version is measured again
SWIGLU = "gate_up"  # the projection whose output goes through SwiGLU, fused into the packed GEMM or not

Seconds = dict[str, dict[str, dict[str, float]]]  # projection -> row class -> candidate -> seconds


def native(width: int) -> str:
    return f"native-{width}"


def fused(width: int) -> str:
    """The packed gate/up GEMM at ``width`` with SwiGLU fused in (its output never goes through memory)."""
    return f"native-{width}-fused"


def packed_seconds(s: Mapping[str, float], width: int) -> float:
    """The packed kernels' time at ``width`` at one point: fused or not, whichever is faster."""
    return min(s[native(width)], s.get(fused(width), float("inf")))


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """The packed width, the (projection, row class) pairs that run on torch's GEMM instead, and the row
    classes at which SwiGLU is fused into the packed gate/up GEMM."""

    width: int
    bfloat16: bool
    torch_classes: dict[str, list[str]]  # projection -> names of the row classes it runs on torch's GEMM
    fused_classes: list[str]  # names of the row classes that fuse SwiGLU
    seconds: Seconds  # what was measured
    measured_s: float  # how long measuring took
    cached: bool = False  # read from the cache rather than measured in this process

    def torch_rows(self) -> dict[str, list[tuple[int, int]]]:
        """The routes as Decoder.use_native_kernels takes them: projection -> inclusive row ranges."""
        return {projection: _ranges(names) for projection, names in self.torch_classes.items() if names}

    def fused_rows(self) -> list[tuple[int, int]]:
        return _ranges(self.fused_classes)

    def summary(self) -> str:
        """One line: where torch's GEMM runs (or that the packed kernels run everything), where SwiGLU is
        fused, and whence."""
        routed = [f"{projection} at {', '.join(names)} rows"
                  for projection, names in self.torch_classes.items() if names]
        where = "torch's GEMM for " + "; ".join(routed) if routed else "the packed kernels at every row count"
        fusion = f"SwiGLU fused at {', '.join(self.fused_classes)} rows" if self.fused_classes else "SwiGLU unfused"
        how = "from the cache" if self.cached else f"measured in {self.measured_s:.1f} s"
        return f"auto ({how}): {where}; {fusion}"

    def chosen(self, projection: str, row_class: str) -> str:
        """The candidate that runs ``projection`` at ``row_class``."""
        if row_class in self.torch_classes.get(projection, []):
            return TORCH
        return fused(self.width) if projection == SWIGLU and row_class in self.fused_classes else native(self.width)

    def table(self) -> list[dict[str, str]]:
        """The timings, one row per (projection, row class), in microseconds, with the choice."""
        return [
            {"projection": projection, "rows": name, "chosen": self.chosen(projection, name)}
            | {candidate: f"{s * 1e6:.0f}" for candidate, s in by_candidate.items()}
            for projection, by_class in self.seconds.items() for name, by_candidate in by_class.items()
        ]


def _ranges(names: list[str]) -> list[tuple[int, int]]:
    by_name = {row_class.name: row_class for row_class in ROW_CLASSES}
    return [(by_name[name].lo, by_name[name].hi) for name in names]


def decide(seconds: Seconds, widths: list[int]) -> tuple[int, dict[str, list[str]], list[str]]:
    """The packed width, the torch routes and the fused SwiGLU classes for measured ``seconds``: the width
    whose packed kernels (fused or not), each (projection, class) taking torch's GEMM where that wins by the
    margin, sum to the least time relative to the best at each point (so the LM head's milliseconds do not
    outvote the rest)."""
    def routes(width: int) -> dict[str, list[str]]:
        return {
            projection: [name for name, s in by_class.items() if s[TORCH] < TORCH_MARGIN * packed_seconds(s, width)]
            for projection, by_class in seconds.items()
        }

    def cost(width: int) -> float:
        chosen = routes(width)
        total = 0.0
        for projection, by_class in seconds.items():
            for name, s in by_class.items():
                taken = s[TORCH] if name in chosen[projection] else packed_seconds(s, width)
                total += taken / min(s.values())
        return total

    width = min(widths, key=lambda w: (cost(w), -w))
    torch_classes = routes(width)
    fused_classes = [
        name for name, s in seconds.get(SWIGLU, {}).items()
        if name not in torch_classes[SWIGLU] and s.get(fused(width), float("inf")) < s[native(width)]
    ]
    return width, torch_classes, fused_classes


def time_candidates(candidates: Mapping[str, Callable[[], object]], rounds: int = ROUNDS,
                    budget_s: float = SHAPE_BUDGET_S) -> dict[str, float]:
    """The fastest of ``rounds`` calls of each candidate, the candidates taking turns each round (one
    untimed call each first: packing's fresh pages and the allocator's first use are not the kernel)."""
    for call in candidates.values():
        call()
    best = dict.fromkeys(candidates, float("inf"))
    start = time.perf_counter()
    for _ in range(rounds):
        for name, call in candidates.items():
            began = time.perf_counter()
            call()
            best[name] = min(best[name], time.perf_counter() - began)
        if time.perf_counter() - start > budget_s:
            break
    return best


def measure(kernels: ModuleType, weights: Mapping[str, torch.Tensor], widths: list[int], bfloat16: bool) -> Seconds:
    """Time each projection's weight at each row class: the packed kernels at each width, and torch's GEMM
    (in bfloat16 on a bf16 model, as the stack would call it); gate/up with its SwiGLU after it, and fused
    into the packed GEMM where its halves are whole tiles. One projection's packings at a time."""
    seconds: Seconds = {}
    for projection, weight in weights.items():
        k = weight.shape[1]
        plain = weight.to(torch.bfloat16 if bfloat16 else torch.float32).contiguous()
        packed = {width: kernels.pack_linear_weight(weight.float(), width, bfloat16) for width in widths}
        seconds[projection] = {}
        for row_class in ROW_CLASSES:
            x = torch.randn(row_class.timed_rows, k)
            calls = _swiglu_calls(kernels, x, packed, plain) if projection == SWIGLU else _calls(kernels, x, packed,
                                                                                                  plain)
            seconds[projection][row_class.name] = time_candidates(calls)
    return seconds


def _calls(kernels: ModuleType, x: torch.Tensor, packed: Mapping[int, torch.Tensor],
           plain: torch.Tensor) -> dict[str, Callable[[], object]]:
    """Each candidate's GEMM of ``x`` as a call: the packed kernels at each width, and torch's."""
    n = plain.shape[0]
    calls: dict[str, Callable[[], object]] = {
        native(width): (lambda p=p: kernels.packed_linear(x, p, n)) for width, p in packed.items()
    }
    calls[TORCH] = lambda: F.linear(x.to(plain.dtype), plain).float()
    return calls


def _swiglu_calls(kernels: ModuleType, x: torch.Tensor, packed: Mapping[int, torch.Tensor],
                  plain: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The gate/up candidates, each followed by SwiGLU as the stack runs it; the fused ones where the halves
    are whole tiles of the packing (a tile must not straddle gate and up)."""
    intermediate, width = plain.shape[0] // 2, max(packed)
    calls = {name: (lambda gemm=gemm: kernels.silu_and_mul(gemm(), width))
             for name, gemm in _calls(kernels, x, packed, plain).items()}
    for w, p in packed.items():
        if intermediate % p.shape[2] == 0:
            calls[fused(w)] = lambda p=p: kernels.packed_swiglu(x, p, intermediate)
    return calls


def choose_kernels(kernels: ModuleType, weights: Mapping[str, torch.Tensor], widths: list[int],
                   bfloat16: bool, cache: Path | None = None) -> KernelChoice:
    """This machine's choice for a model with these projection ``weights``: from the cache when it has one for
    the same CPU, build, torch, dtype, threads and shapes; else measured (a few seconds, said at warning
    level since the default log shows it) and stored."""
    cache = cache or cache_dir() / CACHE_FILE
    key = choice_key(kernels.__name__, widths, bfloat16, torch.get_num_threads(),
                     {name: list(weight.shape) for name, weight in weights.items()})
    stored = read_choices(cache).get(key)
    if stored is not None:
        return KernelChoice(**stored | {"cached": True})  # the key's version matches the record's fields
    logger.warning("timing the native kernels against torch's GEMM on this machine (first start here: a few "
                   "seconds, then cached in %s)", cache)
    start = time.perf_counter()
    seconds = measure(kernels, weights, widths, bfloat16)
    width, torch_classes, fused_classes = decide(seconds, widths)
    choice = KernelChoice(width, bfloat16, torch_classes, fused_classes, seconds, time.perf_counter() - start)
    store_choice(cache, key, asdict(choice) | {"cached": False})
    return choice


def choice_key(build: str, widths: list[int], bfloat16: bool, threads: int, shapes: Mapping[str, list[int]]) -> str:
    """Everything a choice depends on, as one string: the CPU's model name and vector ISA, the kernels' build
    (its name carries the source, compiler target and torch), torch, the candidates, dtype, threads, shapes."""
    cpu = this_cpu()
    return json.dumps([CHOICE_VERSION, cpu.model, list(cpu.isa), build, torch.__version__, widths, bfloat16, threads,
                       sorted(shapes.items())])


def read_choices(cache: Path) -> dict:
    try:
        return json.loads(cache.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: measure again
        return {}


def store_choice(cache: Path, key: str, record: dict) -> None:
    """Add a record, replacing the file in one rename so that a concurrent reader never sees half of it. A
    cache that cannot be written costs the next start the measurement again, not this one its engine."""
    try:
        write_cache_file(cache, json.dumps(read_choices(cache) | {key: record}, indent=1))
    except OSError as error:
        logger.warning("the kernel choice could not be stored in %s (%s); the next start measures it again",
                       cache, error)
