"""``conveyor export-hf``: the model Conveyor serves, as a Hugging Face folder that other engines load.

Peers are compared on the very weights Conveyor runs: a GGUF file is
dequantized once into a cached float32 HF folder, so exporting is copying
that folder. Weights are written in float32 whatever the source held, so that
every engine starts from the same numbers.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from conveyor.model.weights.loader import float32_folder


def export_hf(model: str | os.PathLike | None, out_dir: str | os.PathLike) -> Path:
    """Copy ``model`` (None = the default) as a float32 HF folder into ``out_dir``, which must be new or empty."""
    source = float32_folder(model)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"export-hf: {out} exists and is not an empty folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed, so an interrupted export never leaves a half folder.
    staging = out.parent / f".{out.name}.partial-{uuid.uuid4().hex}"
    staging.mkdir()
    try:
        for file in sorted(source.iterdir()):
            if file.is_file():
                shutil.copyfile(file, staging / file.name)  # copyfile: the umask's permissions, not the cache's
        _make_float32(staging)
        if out.exists():
            out.rmdir()
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _make_float32(folder: Path) -> None:
    """Rewrite any half-precision weights as float32 and say so in config.json."""
    for file in sorted(folder.glob("*.safetensors")):
        tensors = load_file(file)
        if all(t.dtype == torch.float32 or not t.is_floating_point() for t in tensors.values()):
            continue
        save_file({name: t.float() if t.is_floating_point() else t for name, t in tensors.items()}, str(file),
                  metadata={"format": "pt"})
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    for key in ("torch_dtype", "dtype"):
        if key in config:
            config[key] = "float32"
    config_path.write_text(json.dumps(config, indent=2) + "\n")
