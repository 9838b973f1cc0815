"""A model named rather than pointed at: ``NAME`` in the models directory (``$CONVEYOR_MODELS``), ``ORG/NAME`` in
the local Hugging Face hub cache, as huggingface_hub lays it out. Nothing is downloaded: a name found nowhere is
an error that lists every place looked, in order.

A name is ``NAME`` or ``ORG/NAME``, then ``@REVISION`` (a branch or tag under the repository's ``refs/``, or a
commit hash; the Hugging Face cache only) and ``:QUANT`` (which of a folder's GGUF files: the one whose file name
holds ``QUANT`` as a word, ``Q4_K_M`` say), each optional. Torch-free, as :mod:`.paths` that asks it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

MODELS_ENV = "CONVEYOR_MODELS"
# A repository id as the Hub allows them (ASCII word characters, '.', '-'; one '/' at most), then the extras.
NAME = re.compile(r"(?P<repo>[\w.-]+(?:/[\w.-]+)?)(?:@(?P<revision>[\w./-]+))?(?::(?P<quant>[\w-]+))?", re.ASCII)
COMMIT = re.compile(r"[0-9a-f]{40}")


class ModelNotFoundError(FileNotFoundError, ValueError):
    """No model under the name given, or not one that can be chosen; the message says where it looked."""


@dataclass(frozen=True, slots=True)
class ModelName:
    repo: str  # NAME or ORG/NAME
    revision: str | None = None  # a ref of the Hugging Face cache, or a commit hash; None: main
    quant: str | None = None  # which GGUF file of several

    @classmethod
    def parse(cls, text: str) -> ModelName | None:
        """The name ``text`` spells, or None when it is no name (an absolute path, ``..``, a space)."""
        match = NAME.fullmatch(text)
        if match is None or any(part in ("", ".", "..") for part in re.split(r"[/@]", text.split(":")[0])):
            return None
        return cls(match["repo"], match["revision"], match["quant"])


def hf_hub_cache() -> tuple[Path, str]:
    """The Hugging Face hub cache, chosen as huggingface_hub chooses it, and what chose it: ``$HF_HUB_CACHE``
    (or its older name ``$HUGGINGFACE_HUB_CACHE``), else ``$HF_HOME/hub``, else
    ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return _expand(os.environ[variable]), f"${variable}"
    if os.environ.get("HF_HOME"):
        return _expand(os.environ["HF_HOME"]) / "hub", "$HF_HOME/hub"
    if os.environ.get("XDG_CACHE_HOME"):
        return _expand(os.environ["XDG_CACHE_HOME"]) / "huggingface" / "hub", "$XDG_CACHE_HOME/huggingface/hub"
    return Path.home() / ".cache" / "huggingface" / "hub", "the default"


def models_dirs() -> list[Path]:
    """The folders of ``$CONVEYOR_MODELS``, in order (several are joined as in ``$PATH``)."""
    return [_expand(part) for part in os.environ.get(MODELS_ENV, "").split(os.pathsep) if part]


def find_named(text: str, looked: list[str]) -> Path:
    """The GGUF file or HF folder the name ``text`` names, from the models directory, then the Hugging Face
    cache. ``looked`` holds the places already looked (the path, the packaged names); the error lists them
    and these."""
    name = ModelName.parse(text)
    if name is None:
        looked.append("not a name (NAME or ORG/NAME, then @REVISION and :QUANT if need be), so neither the models "
                      "directory nor the Hugging Face cache")
        raise ModelNotFoundError(_not_found(text, looked))
    for find in (_in_models_dirs, _in_hf_cache):
        found = find(name, looked)
        if found is not None:
            return found
    raise ModelNotFoundError(_not_found(text, looked))


def model_in_folder(folder: Path, quant: str | None = None) -> Path:
    """The model a folder holds: itself, a HF folder (``config.json`` and weights), or its one GGUF file (the
    one ``quant`` picks, of several)."""
    ggufs = sorted(p for p in folder.glob("*.gguf") if p.is_file())
    hf_folder = (folder / "config.json").is_file()
    if quant is None and hf_folder and (not ggufs or any(folder.glob("*.safetensors"))):
        return folder
    if not ggufs:
        what = f"no GGUF file whose name holds {quant!r}" if quant else "neither config.json nor a .gguf file"
        raise ModelNotFoundError(f"model: {folder} holds {what}")
    if quant is not None:
        word = re.compile(rf"(?<![a-z0-9]){re.escape(quant)}(?![a-z0-9_])", re.IGNORECASE)
        chosen = [p for p in ggufs if word.search(p.stem)]
    else:
        chosen = ggufs
    if len(chosen) == 1:
        return chosen[0]
    listed = ", ".join(p.name for p in ggufs)
    which = f"none or several of them match :{quant}" if quant else "name one as NAME:QUANT (Q4_K_M, say)"
    raise ModelNotFoundError(f"model: {folder} holds {len(ggufs)} GGUF files ({listed}); {which}, or pass "
                             "the file's path")


def _in_models_dirs(name: ModelName, looked: list[str]) -> Path | None:
    """``NAME.gguf``, else ``NAME/`` (a HF folder, or a folder of GGUF files), in each models directory."""
    folders = models_dirs()
    if not folders:
        looked.append(f"the models directory: ${MODELS_ENV} is not set")
        return None
    if name.revision is not None:
        looked.append(f"the models directory (${MODELS_ENV}): not asked, @{name.revision} is a Hugging Face "
                      "revision")
        return None
    for folder in folders:
        file, subfolder = folder / f"{name.repo}.gguf", folder / name.repo
        if file.is_file() and name.quant is None:  # :QUANT picks among a folder's files
            return file
        if subfolder.is_dir():
            return model_in_folder(subfolder, name.quant)
        if subfolder.is_file() and subfolder.suffix == ".gguf" and name.quant is None:  # NAME.gguf given whole
            return subfolder
        where = ("it does not exist" if not folder.is_dir() else f"no {name.repo}/ folder" if name.quant else
                 f"no {file.relative_to(folder)} and no {name.repo}/ folder")
        looked.append(f"the models directory {folder} (${MODELS_ENV}): {where}")
    return None


def _in_hf_cache(name: ModelName, looked: list[str]) -> Path | None:
    """The snapshot ``refs/main`` (or the revision named) points at, in the Hugging Face cache: its HF folder,
    or its GGUF file."""
    cache, chosen_by = hf_hub_cache()
    repo = cache / f"models--{name.repo.replace('/', '--')}"
    where = f"the Hugging Face cache {cache} ({chosen_by})"
    if not repo.is_dir():
        looked.append(f"{where}: no {repo.name}")
        return None
    revision = name.revision or "main"
    ref = repo / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision if COMMIT.fullmatch(revision) else None
    snapshot = repo / "snapshots" / commit if commit else None
    if snapshot is None or not snapshot.is_dir():
        refs = sorted(str(p.relative_to(repo / "refs")) for p in (repo / "refs").rglob("*") if p.is_file())
        snapshots = sorted(p.name for p in (repo / "snapshots").glob("*") if p.is_dir())
        missing = f"no refs/{revision}" if commit is None else f"no snapshot {commit}"
        looked.append(f"{where}: {repo.name} has {missing} (its refs: {', '.join(refs) or 'none'}; its "
                      f"snapshots: {', '.join(snapshots) or 'none'})")
        return None
    return model_in_folder(snapshot, name.quant)


def _not_found(text: str, looked: list[str]) -> str:
    places = "\n".join(f"  {i}. {place}" for i, place in enumerate(looked, 1))
    return (f"model: found no model {text!r}; looked, in order:\n{places}\nPass a HF folder or a .gguf "
            f"file, put NAME.gguf in a folder named by ${MODELS_ENV}, or download the model into the Hugging Face "
            "cache first (`hf download ORG/NAME`): Conveyor downloads nothing.")


def _expand(path: str) -> Path:
    return Path(os.path.expandvars(os.path.expanduser(path)))
