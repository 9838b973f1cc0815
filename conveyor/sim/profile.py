"""A measured step-time model: what one step of the real engine costs on hardware someone has, as a table.

The roofline (:mod:`conveyor.sim.cost`) prices a step from first principles, the longer of its FLOPs and
its bytes moved. On a CPU most batches sit near the ridge point, where neither bound holds and a constant
overhead cannot make up the difference. A profile instead learns from steps timed on the real engine
(``conveyor simulate calibrate``), in the shape Vidur gives GPU operators: each part of a step priced by
what it grows with, the parameters fitted by non-negative least squares on relative error::

    step = dense(T) + per_sequence * N + per_sampled_row * S
           + per_decode_key[rows bucket] * (Kd - Ks) + per_shared_decode_key * Ks
           + per_prompt_pair * Pp + per_swapped_token * W

``dense(T)`` is a table of seconds by the step's token count ``T``, interpolated linearly between its
entries (and along its last segment beyond them): the projections and MLP, which read every weight
whatever the batch and then grow with the rows, the KV writes, and the fixed cost of a step. ``N`` is the
requests in the step (input preparation, bookkeeping), ``S`` the rows that sample (LM head, sampler,
detokenizer), ``Kd`` the keys the decode rows attend to, ``Pp`` the query-key pairs of prompt rows, ``W``
the tokens of KV swapped. Every parameter is a time, none negative. A key costs a lone decode row more
than one of many (two to three times, measured on 2 cores), as a few rows' heads cannot keep every thread
busy, so its price is kept per bucket of decode rows in the step (1, 2-3, 4-7, 8-15, 16 and more). ``Ks``
are the decode keys in blocks that an earlier decode of the same step read too (requests sharing a cached
prefix): read again from cache, not memory, they cost less (measured on 2 cores: decode steps over shared
prefixes took 0.60 of the unshared price where steps without took 0.68-0.73), so they have a price of their
own, measured by decode probes over shared prefixes (without such probes, the unshared price).

A profile says what it was measured on: the CPU and its vector ISA, the threads, the model's shape, the
dtype, and a fingerprint of the engine's own code. Used with another model or dtype it is refused; with
another engine version it is stale, and refused too: a changed kernel changes every step.
Pure Python, like the rest of the simulator.
"""

from __future__ import annotations

import calendar
import dataclasses
import hashlib
import importlib.metadata
import json
import platform
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conveyor.core.config import usable_cores
from conveyor.core.formats import FLOAT_BYTES
from conveyor.core.model_config import ModelConfig
from conveyor.platform.cache_dir import cache_dir, write_cache_file
from conveyor.platform.cpu import this_cpu
from conveyor.sim.cost import CostModel, StepWork, expected_experts
from conveyor.sim.hardware import HardwareSpec

ENGINE_PACKAGES = ("core", "engine", "executor", "model", "csrc")  # the code a real step runs
PACKAGE_ROOT = Path(__file__).resolve().parent.parent
MODEL_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "tie_word_embeddings", "stored_as", "num_experts", "num_experts_per_tok",
                "moe_intermediate_size")
MEASURED_AT_FORMAT = "%Y-%m-%dT%H:%M:%SZ"  # a profile's measured_at: UTC, to the second
LINEAR_PARTS = ("per_sequence_s", "per_sampled_row_s", "per_prompt_pair_s")
DECODE_ROW_BUCKETS = (1, 2, 4, 8, 16)  # lower bounds: a key's price by how many decode rows share the step


class ProfileError(ValueError):
    """A profile that cannot price this simulation: another model or dtype, or a stale engine version."""


@dataclass(frozen=True, slots=True)
class StepProfile:
    dense_tokens: tuple[int, ...]  # token counts of the dense table, ascending
    dense_s: tuple[float, ...]  # seconds of the dense part (and the step's fixed cost) at each
    per_sequence_s: float
    per_sampled_row_s: float
    per_decode_key_s: tuple[float, ...]  # by DECODE_ROW_BUCKETS
    per_prompt_pair_s: float
    per_swapped_token_s: float
    machine: dict[str, Any]  # cpu, isa, threads, device
    model: dict[str, Any]  # MODEL_FIELDS of the model measured
    dtype: str
    block_size: int
    engine: str  # engine_fingerprint() when measured
    measured_at: str = ""
    fit: dict[str, Any] = field(default_factory=dict)  # samples, errors, shapes: how well it describes them
    per_shared_decode_key_s: float | None = None  # None: no probe shared blocks; such keys cost as the others
    experts: tuple[int, int] | None = None  # a mixture of experts' (experts, top-k): the table's axis (dense_weights)
    kv_element_bytes: int | None = None  # bytes of a K or V element in the cache it timed (None: the dtype's)

    def dense_time(self, num_tokens: int) -> float:
        weights = dense_weights(self.dense_tokens, num_tokens, self.experts)
        return sum(w * self.dense_s[i] for i, w in weights)

    def step_time(self, work: StepWork, block_size: int = 16) -> float:
        swap = work.swap_blocks * block_size * self.per_swapped_token_s
        if not work.num_tokens:
            return swap
        return (
            self.dense_time(work.num_tokens)
            + work.num_seqs * self.per_sequence_s
            + work.num_sampled * self.per_sampled_row_s
            + self.decode_keys_time(work, block_size)
            + work.prompt_pairs * self.per_prompt_pair_s
            + swap
        )

    def decode_keys_time(self, work: StepWork, block_size: int) -> float:
        """The decodes' keys: those in blocks an earlier decode of the step read at their own price, if measured."""
        price = self.per_decode_key_s[decode_bucket(work.decode_rows)]
        shared = work.shared_decode_blocks * block_size
        if not shared or self.per_shared_decode_key_s is None:
            return work.decode_context * price
        return (work.decode_context - shared) * price + shared * self.per_shared_decode_key_s

    def age_s(self, now: float | None = None) -> float | None:
        """Seconds since the profile was measured; None where its stamp is missing or not one ``new_profile``
        writes (a profile edited by hand prices steps as well as any)."""
        try:
            return (time.time() if now is None else now) - calendar.timegm(time.strptime(self.measured_at,
                                                                                         MEASURED_AT_FORMAT))
        except (TypeError, ValueError):
            return None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> StepProfile:
        optional = ("measured_at", "fit", "per_shared_decode_key_s", "experts", "kv_element_bytes")
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in raw and f.name not in optional]
        if missing:
            raise ProfileError(f"not a step profile: missing {', '.join(missing)}")
        known = {f.name for f in dataclasses.fields(cls)}
        values = {key: value for key, value in raw.items() if key in known}
        values["dense_tokens"] = tuple(int(t) for t in values["dense_tokens"])
        values["dense_s"] = tuple(float(s) for s in values["dense_s"])
        keys = values["per_decode_key_s"]
        if not isinstance(keys, list | tuple) or len(keys) != len(DECODE_ROW_BUCKETS):
            raise ProfileError(f"step profile: per_decode_key_s needs one price per bucket of decode rows "
                               f"{DECODE_ROW_BUCKETS}; measure it again with `conveyor simulate calibrate`")
        values["per_decode_key_s"] = tuple(float(k) for k in keys)
        if values.get("experts") is not None:
            values["experts"] = tuple(int(n) for n in values["experts"])
        return cls(**values)


def decode_bucket(decode_rows: int) -> int:
    """Which of DECODE_ROW_BUCKETS a step with ``decode_rows`` single-token rows falls in."""
    return max(i for i, low in enumerate(DECODE_ROW_BUCKETS) if decode_rows >= low) if decode_rows else 0


def dense_weights(knots: Sequence[int], num_tokens: int,
                  experts: tuple[int, int] | None = None) -> list[tuple[int, float]]:
    """Linear interpolation weights of ``num_tokens`` over the table's entries: (index, weight) pairs.

    Outside the table the nearest segment is extended, so a step larger than any measured grows at the
    last measured rate instead of stopping at the last entry. For a mixture of experts (``experts``: how many,
    and the top-k each token takes), a step between two entries is placed by the distinct experts its tokens
    are expected to pick (sim.cost.expected_experts), not by its tokens: a few-row step reads the weights of
    each expert it touches, and the 12th token of a batch adds fewer new experts than the 2nd did. Where the
    entries' experts hardly differ (every expert touched), by tokens.
    """
    if len(knots) == 1:
        return [(0, 1.0)]
    i = 0
    while i < len(knots) - 2 and num_tokens > knots[i + 1]:
        i += 1
    lo, hi = knots[i], knots[i + 1]
    u = (num_tokens - lo) / (hi - lo)
    if experts is not None and lo <= num_tokens <= hi:
        picked = [expected_experts(experts[0], experts[1], t) for t in (lo, num_tokens, hi)]
        if picked[2] - picked[0] > 0.01 * experts[0]:
            u = (picked[1] - picked[0]) / (picked[2] - picked[0])
    return [(i, 1.0 - u), (i + 1, u)]


# -- fitting -------------------------------------------------------------------------------------------------

def dense_knots(token_counts: Sequence[int]) -> tuple[int, ...]:
    """Table entries: powers of two from 1 up to the largest step, each with a measured step within a factor of
    two on either side (beyond the last entry the table extends its last segment)."""
    knots, k, largest = [], 1, max(token_counts)
    while k <= largest:
        if any(k / 2 < t < 2 * k for t in token_counts):
            knots.append(k)
        k *= 2
    return tuple(knots)


def features(work: StepWork, knots: Sequence[int], block_size: int = 16,
             experts: tuple[int, int] | None = None) -> list[float]:
    """The row of the least-squares problem: dense-table weights, the linear parts' quantities, the decode
    keys in their bucket's column (less those in blocks read again), then the keys read again."""
    linear = len(knots) + len(LINEAR_PARTS)
    row = [0.0] * (linear + len(DECODE_ROW_BUCKETS) + 1)
    for index, weight in dense_weights(knots, work.num_tokens, experts):
        row[index] = weight
    row[len(knots):linear] = [work.num_seqs, work.num_sampled, work.prompt_pairs]
    shared = work.shared_decode_blocks * block_size
    row[linear + decode_bucket(work.decode_rows)] = work.decode_context - shared
    row[-1] = shared
    return row


def fit_step_times(samples: Sequence[tuple[StepWork, float]], outlier_factor: float = 4.0,
                   rounds: int = 3, block_size: int = 16, experts: tuple[int, int] | None = None) -> dict[str, Any]:
    """The dense table and linear parts that best predict ``samples`` (work, seconds), by relative error.

    Swap-free steps with tokens only (the swap price is not fitted: see ``calibrate``). Each further
    round refits without the steps more than ``outlier_factor`` times the median error away (never
    closer than 10%), judged against the previous round's fit: a step that a stray process or a
    collection interrupted would otherwise pull the whole table.
    """
    usable = [(w, t) for w, t in samples if w.num_tokens and not w.swap_blocks and t > 0]
    if not usable:
        raise ValueError("no timed steps with tokens to fit")
    knots = dense_knots([w.num_tokens for w, _ in usable])
    kept = usable
    params = _fit(kept, knots, block_size, experts)
    for _ in range(rounds - 1):
        errors = [abs(_predict(params, knots, w, block_size, experts) / t - 1) for w, t in usable]
        limit = max(outlier_factor * sorted(errors)[len(errors) // 2], 0.10)
        kept = [sample for sample, error in zip(usable, errors) if error <= limit]
        params = _fit(kept, knots, block_size, experts)
    dense = _fill_unmeasured(params[: len(knots)], knots)
    linear = len(knots) + len(LINEAR_PARTS)
    fitted = dict(zip(LINEAR_PARTS, params[len(knots):linear]))
    keys = _fill_unmeasured_buckets(params[linear:-1], [w.decode_rows for w, _ in kept])
    shared = params[-1] if any(w.shared_decode_blocks for w, _ in kept) else None
    return {"dense_tokens": knots, "dense_s": tuple(dense), **fitted, "per_decode_key_s": keys,
            "per_shared_decode_key_s": shared, "experts": experts,
            "fit": {"samples": len(usable), "outliers_dropped": len(usable) - len(kept)}}


def _fit(samples: Sequence[tuple[StepWork, float]], knots: Sequence[int], block_size: int,
         experts: tuple[int, int] | None) -> list[float]:
    # Relative error: each row over its time.
    rows = [[x / t for x in features(w, knots, block_size, experts)] for w, t in samples]
    return nonnegative_least_squares(rows, [1.0] * len(rows))


def _predict(params: Sequence[float], knots: Sequence[int], work: StepWork, block_size: int,
             experts: tuple[int, int] | None) -> float:
    return sum(p * x for p, x in zip(params, features(work, knots, block_size, experts)))


def _fill_unmeasured(dense: Sequence[float], knots: Sequence[int]) -> list[float]:
    """An entry the fit left at zero with no step beside it to set it takes its neighbours' line."""
    filled = list(dense)
    for i, value in enumerate(filled):
        if value == 0 and 0 < i < len(filled) - 1:
            filled[i] = filled[i - 1] + (filled[i + 1] - filled[i - 1]) * (knots[i] - knots[i - 1]) / (
                knots[i + 1] - knots[i - 1])
    return filled


def _fill_unmeasured_buckets(prices: Sequence[float], decode_rows: Sequence[int]) -> tuple[float, ...]:
    """A bucket of decode rows that no timed step fell in takes the price of the nearest smaller one that did."""
    measured = {decode_bucket(rows) for rows in decode_rows if rows}
    filled = list(prices)
    for i in range(len(filled)):
        if i not in measured:
            filled[i] = next((filled[j] for j in range(i - 1, -1, -1) if j in measured), filled[i])
    return tuple(filled)


def nonnegative_least_squares(rows: Sequence[Sequence[float]], targets: Sequence[float]) -> list[float]:
    """argmin ||A x - b|| with x >= 0 (Lawson and Hanson's active set), on columns scaled to unit length.

    A few dozen unknowns and a few thousand rows: plain Python is quick enough, and the simulator stays
    free of numerical libraries.
    """
    p = len(rows[0])
    scale = [sum(r[j] * r[j] for r in rows) ** 0.5 or 1.0 for j in range(p)]
    gram = [[sum(r[i] * r[j] for r in rows) / (scale[i] * scale[j]) for j in range(p)] for i in range(p)]
    rhs = [sum(r[j] * b for r, b in zip(rows, targets)) / scale[j] for j in range(p)]
    x = [0.0] * p
    passive: list[int] = []
    for _ in range(3 * p):
        gradient = [rhs[j] - sum(gram[j][k] * x[k] for k in range(p)) for j in range(p)]
        free = [j for j in range(p) if j not in passive and gradient[j] > 1e-12]
        if not free:
            break
        passive.append(max(free, key=gradient.__getitem__))
        x, passive = _inner_loop(gram, rhs, x, passive)
    return [x[j] / scale[j] for j in range(p)]


def _inner_loop(gram: list[list[float]], rhs: list[float], x: list[float],
                passive: list[int]) -> tuple[list[float], list[int]]:
    """Solve on the passive set; step back along the way while a passive unknown would turn negative."""
    while True:
        solved = _solve([[gram[i][j] for j in passive] for i in passive], [rhs[i] for i in passive])
        z = [0.0] * len(x)
        for index, value in zip(passive, solved):
            z[index] = value
        if all(z[j] > 0 for j in passive):
            return z, passive
        alpha = min(x[j] / (x[j] - z[j]) for j in passive if z[j] <= 0)
        x = [xi + alpha * (zi - xi) for xi, zi in zip(x, z)]
        passive = [j for j in passive if x[j] > 1e-15]
        if not passive:
            return [0.0] * len(x), passive


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting; a tiny ridge keeps nearly collinear columns solvable."""
    n = len(vector)
    a = [[*row, vector[i]] for i, row in enumerate(matrix)]
    for i in range(n):
        a[i][i] += 1e-10
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            factor = a[r][col] / a[col][col]
            for c in range(col, n + 1):
                a[r][c] -= factor * a[col][c]
    solution = [0.0] * n
    for r in range(n - 1, -1, -1):
        solution[r] = (a[r][n] - sum(a[r][c] * solution[c] for c in range(r + 1, n))) / a[r][r]
    return solution


# -- identity: what a profile was measured on ----------------------------------------------------------------

def this_machine(threads: int, device: str = "cpu") -> dict[str, Any]:
    """The CPU model, its vector ISA, the threads the engine uses, and the device (a GPU's name, or cpu)."""
    cpu = this_cpu()
    model = cpu.model or platform.processor() or platform.machine()
    return {"cpu": model, "isa": list(cpu.isa), "threads": threads, "device": device}


def model_signature(model: ModelConfig) -> dict[str, Any]:
    return {name: getattr(model, name) for name in MODEL_FIELDS}


def model_experts(model: ModelConfig) -> tuple[int, int] | None:
    """A mixture of experts' (experts, top-k), the step profile's axis between its entries; None for a dense model."""
    return (model.num_experts, model.num_experts_per_tok) if model.num_experts else None


def engine_version() -> str:
    try:
        return importlib.metadata.version("conveyor")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "source"


def engine_fingerprint(root: Path = PACKAGE_ROOT) -> str:
    """A hash of the engine's version and of the code every real step runs (kernels, model, executor, core)."""
    version = engine_version()
    digest = hashlib.sha256(version.encode())
    for package in ENGINE_PACKAGES:
        for path in sorted((root / package).rglob("*")):
            if path.suffix in (".py", ".cpp", ".h") and path.is_file():
                digest.update(str(path.relative_to(root)).encode())
                digest.update(path.read_bytes())
    return f"{version}+{digest.hexdigest()[:16]}"


def profile_path(machine: dict[str, Any], model: ModelConfig, dtype: str) -> Path:
    """Where this machine's profile of this model and dtype lives: one file per CPU, ISA, threads, model, dtype."""
    tag = json.dumps([machine, model_signature(model), dtype], sort_keys=True)
    cpu = re.sub(r"[^a-z0-9]+", "-", machine["cpu"].lower()).strip("-")[:40] or "cpu"
    return cache_dir() / "sim" / "profiles" / f"{cpu}-{hashlib.sha256(tag.encode()).hexdigest()[:12]}.json"


def save_profile(profile: StepProfile, model: ModelConfig) -> Path:
    path = profile_path(profile.machine, model, profile.dtype)
    write_cache_file(path, json.dumps(profile.to_json(), indent=2) + "\n")
    return path


def load_profile(path: str | Path) -> StepProfile:
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ProfileError(f"step profile {path}: {error}") from error
    return StepProfile.from_json(raw)


def check_profile(profile: StepProfile, model: ModelConfig, dtype: str, tensor_parallel_size: int = 1,
                  kv_element_bytes: int | None = None) -> None:
    """Refuse a profile measured on something else than what is simulated (a model, dtype, or KV cache element
    of ``kv_element_bytes``, None: the dtype's), or with another engine version."""
    if profile.model != model_signature(model):
        raise ProfileError(f"the step profile was measured on another model ({profile.model}), not this one")
    if profile.dtype != dtype:
        raise ProfileError(f"the step profile was measured in {profile.dtype}, not {dtype}")
    measured = profile.kv_element_bytes or FLOAT_BYTES[profile.dtype]
    if measured != (kv_element_bytes or FLOAT_BYTES[dtype]):
        raise ProfileError(f"the step profile timed a KV cache of {measured}-byte elements, not "
                           f"{kv_element_bytes or FLOAT_BYTES[dtype]} (calibrate with the same --kv-cache-dtype)")
    if tensor_parallel_size != 1:
        raise ProfileError("a step profile prices one device: no tensor parallelism")
    current = engine_fingerprint()
    if profile.engine != current:
        raise ProfileError(
            f"the step profile is stale: measured with engine {profile.engine}, this is {current}; "
            "measure again with `conveyor simulate calibrate`")


class ProfiledCostModel(CostModel):
    """The roofline's sizes (weights, KV bytes per token) with the profile's step times."""

    def __init__(self, model: ModelConfig, hardware: HardwareSpec, dtype: str, profile: StepProfile) -> None:
        super().__init__(model, hardware, dtype, kv_element_bytes=profile.kv_element_bytes)
        self.profile = profile

    def step_time(self, work: StepWork, block_size: int = 16) -> float:
        return self.profile.step_time(work, block_size)


def new_profile(fitted: dict[str, Any], per_swapped_token_s: float, machine: dict[str, Any], model: ModelConfig,
                dtype: str, block_size: int, kv_element_bytes: int | None = None) -> StepProfile:
    """A profile from a fit (``fit_step_times``), stamped with what it was measured on and when."""
    return StepProfile(**fitted, per_swapped_token_s=per_swapped_token_s, machine=machine,
                       model=model_signature(model), dtype=dtype, block_size=block_size,
                       kv_element_bytes=kv_element_bytes,
                       engine=engine_fingerprint(), measured_at=time.strftime(MEASURED_AT_FORMAT, time.gmtime()))


def step_cost_model(model: ModelConfig, hardware: HardwareSpec, dtype: str, tensor_parallel_size: int = 1,
                    step_profile: str = "auto", threads: int | None = None,
                    kv_element_bytes: int | None = None) -> tuple[CostModel, str]:
    """The cost model a simulation prices its steps with, and a line saying which.

    ``step_profile``: ``none``, the roofline; a file, that profile (refused if it was measured on another
    model, dtype or engine version); ``auto``, this machine's own profile of the model for ``cpu-local``
    when ``conveyor simulate calibrate`` has measured one and it is still current, else the roofline. A
    stale profile is never used: ``auto`` says so and falls back to the roofline.
    """
    roofline = CostModel(model, hardware, dtype, tensor_parallel_size, kv_element_bytes=kv_element_bytes)
    if step_profile == "none":
        return roofline, "roofline"
    if step_profile != "auto":
        profile = load_profile(step_profile)
        check_profile(profile, model, dtype, tensor_parallel_size, kv_element_bytes)
        return ProfiledCostModel(model, hardware, dtype, profile), f"step profile {step_profile}"
    if not hardware.extra.get("from_machine_file"):
        return roofline, "roofline"
    path = profile_path(this_machine(threads or usable_cores()), model, dtype)
    if not path.is_file():
        return roofline, "roofline (no step profile of this model on this machine: `conveyor simulate calibrate`)"
    profile = load_profile(path)
    try:
        check_profile(profile, model, dtype, tensor_parallel_size, kv_element_bytes)
    except ProfileError as error:
        return roofline, f"roofline: {error}"
    return ProfiledCostModel(model, hardware, dtype, profile), f"step profile {path}"
