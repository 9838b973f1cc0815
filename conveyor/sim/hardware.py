"""Hardware and model specs for the simulator, read from data files users can extend.

The packaged catalog (``catalog/hardware.json``, ``catalog/models.json``) is
merged with the user's own files of the same names under
``$CONVEYOR_CACHE_DIR/sim/`` (user entries win), and a path to a JSON file
works wherever a name does. Models are HF ``config.json`` dicts, so any HF
model folder or config file can be simulated as it is.

``cpu-local`` is this machine: its peak figures come from the file that
``conveyor roofline`` writes. Its steps are priced by the step profile
that ``conveyor simulate calibrate`` measures (:mod:`conveyor.sim.profile`)
when there is one; the roofline's efficiencies here are first guesses.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from conveyor.core.model_config import ModelConfig
from conveyor.platform.cache_dir import cache_dir

CATALOG_DIR = Path(__file__).parent / "catalog"


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    """One device; a tensor-parallel group is several of them joined by ``interconnect_bandwidth``."""

    name: str
    peak_flops: dict[str, float]  # dense FLOP/s per dtype
    memory_bandwidth: float  # bytes/s
    memory_capacity: int  # bytes
    host_link_bandwidth: float  # bytes/s each way between device and host memory: swap copies cross it
    interconnect_bandwidth: float | None = None  # bytes/s each way between devices, for all-reduce
    default_dtype: str = "float16"
    flops_efficiency: float = 0.6  # share of peak FLOP/s a step's matrix products reach
    bandwidth_efficiency: float = 0.8  # share of peak bandwidth its reads reach
    # Share of that usable bandwidth attention's K/V reads reach: about 1 for fused GPU kernels, far
    # less where K/V blocks are gathered and multiplied in small pieces (an eager CPU engine).
    attention_efficiency: float = 1.0
    step_overhead_s: float = 0.002  # fixed cost of a step: scheduling, launches, sampling
    per_sequence_overhead_s: float = 0.0  # cost per request in the step: input preparation, bookkeeping
    allreduce_latency_s: float = 1e-5  # fixed cost of one all-reduce
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def flops(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            known = ", ".join(self.peak_flops)
            raise ValueError(f"hardware {self.name} has no peak FLOP/s for {dtype} (it has {known})")
        return self.peak_flops[dtype]


def machine_file() -> Path:
    """Where ``conveyor roofline`` saves this machine's figures, and ``cpu-local`` reads them."""
    return cache_dir() / "machine.json"


def _catalog(kind: str) -> dict[str, dict[str, Any]]:
    entries = json.loads((CATALOG_DIR / f"{kind}.json").read_text())
    user_file = cache_dir() / "sim" / f"{kind}.json"
    if user_file.is_file():
        entries.update(json.loads(user_file.read_text()))
    return entries


def _catalog_name(catalog: dict[str, Any], name: str) -> str | None:
    """The catalog's own spelling of ``name``, matched without regard to case (``llama-2-13b``)."""
    if name in catalog:
        return name
    return next((known for known in catalog if known.lower() == name.lower()), None)


def hardware_names() -> list[str]:
    return list(_catalog("hardware"))


def model_names() -> list[str]:
    return list(_catalog("models"))


def load_hardware(name_or_path: str) -> HardwareSpec:
    """A catalog name (``A100-80GB``, ``cpu-local``, ...) or a JSON file holding one spec."""
    catalog = _catalog("hardware")
    if (known := _catalog_name(catalog, name_or_path)) is not None:
        name, raw = known, catalog[known]
    elif Path(name_or_path).is_file():
        name, raw = Path(name_or_path).stem, json.loads(Path(name_or_path).read_text())
    else:
        raise ValueError(f"hardware: {name_or_path!r} is neither a JSON file nor one of {', '.join(catalog)}")
    if raw.get("from_machine_file"):
        raw = {**raw, **_machine_figures()}
    return _hardware_from_dict(name, raw)


def _hardware_from_dict(name: str, raw: dict[str, Any]) -> HardwareSpec:
    known = {f.name for f in fields(HardwareSpec)} - {"name", "extra"}
    missing = [key for key in ("peak_flops", "memory_bandwidth", "memory_capacity", "host_link_bandwidth")
               if key not in raw]
    if missing:
        raise ValueError(f"hardware {name}: missing {', '.join(missing)}")
    values = {key: value for key, value in raw.items() if key in known}
    extra = {key: value for key, value in raw.items() if key not in known}
    return HardwareSpec(name=name, extra=extra, **values)


def _machine_figures() -> dict[str, Any]:
    """cpu-local's peak figures from the roofline measurement of this machine."""
    path = machine_file()
    if not path.is_file():
        raise ValueError(
            f"hardware cpu-local: no measurement of this machine at {path}; create it with `conveyor roofline`, "
            'or: python -c "from conveyor.benchmarks.machine import measure_machine; measure_machine().save()"'
        )
    machine = json.loads(path.read_text())
    bandwidth = float(machine["memory_bandwidth"])
    return {
        "peak_flops": {machine["dtype"]: float(machine["gemm_flops"])},
        "memory_bandwidth": bandwidth,
        "memory_capacity": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "host_link_bandwidth": bandwidth / 2,  # a swap is a copy within the same memory: read plus write
        "default_dtype": machine["dtype"],
        "description": f"{machine.get('cpu', 'this CPU')}, {machine.get('threads', '?')} threads, "
        f"measured {machine.get('measured_at', '?')}",
    }


def load_model_config(name_or_path: str) -> ModelConfig:
    """A catalog name (``Llama-2-13B``, ...), a HF ``config.json``, or a folder holding one."""
    catalog = _catalog("models")
    if (known := _catalog_name(catalog, name_or_path)) is not None:
        return ModelConfig.from_hf_dict(catalog[known])
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return ModelConfig.from_hf_dict(json.loads(path.read_text()))
    raise ValueError(f"model config: {name_or_path!r} is neither a config.json (or its folder) "
                     f"nor one of {', '.join(catalog)}")
