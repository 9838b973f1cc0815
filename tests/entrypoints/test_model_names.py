"""Models by name: ``ORG/NAME`` from a Hugging Face hub cache laid out as huggingface_hub writes it, ``NAME`` from
the models directory ($CONVEYOR_MODELS), the error that lists where it looked; and a server answering to several
served names."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
from pathlib import Path

import openai
import pytest

from conveyor.entrypoints.cli import main
from conveyor.entrypoints.serve import served_model_names
from conveyor.model.weights.names import MODELS_ENV, ModelNotFoundError, hf_hub_cache
from conveyor.model.weights.paths import default_model_path, gguf_source, model_source, resolve_model
from conveyor.platform.cache_dir import CACHE_ENV, cache_dir
from tests.serving import offline_text, openai_client, running_server

GGUF_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
TINY_REPO = "conveyor-tests/tiny-llama"
HUB_VARIABLES = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", MODELS_ENV)


def commit_hash(label: str) -> str:
    return hashlib.sha1(label.encode()).hexdigest()


def add_snapshot(cache: Path, repo: str, commit: str, files: dict[str, Path], refs: tuple[str, ...] = ()) -> Path:
    """A snapshot as huggingface_hub writes one: each file once in blobs/ (named by its SHA-256 if stored in LFS,
    its git blob hash if not), linked from snapshots/COMMIT/ by a relative symlink; refs/REF holds the commit."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (folder / "blobs").mkdir(exist_ok=True)
    for name, source in files.items():
        data = source.read_bytes()
        lfs = name.endswith((".gguf", ".safetensors"))
        blob = hashlib.sha256(data).hexdigest() if lfs else hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        target = folder / "blobs" / blob
        if not target.exists():
            try:
                os.link(source, target)  # a real file, as the hub's blobs are, without copying 100 MB
            except OSError:
                shutil.copyfile(source, target)
        (snapshot / name).symlink_to(Path("..", "..", "blobs", blob))
    for ref in refs:
        (folder / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (folder / "refs" / ref).write_text(commit)  # no newline, as the hub writes it
    return snapshot


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Path]:
    """A hub cache holding the default model's GGUF file (``GGUF_REPO``), and the tiny model as a HF folder
    (``TINY_REPO``) in two snapshots: refs/main at the newer one, the older one (a branch ``old``) without
    weights, so that a server started on the wrong one fails."""
    cache = tmp_path_factory.mktemp("hub")
    gguf = default_model_path()
    tiny = {p.name: p for p in sorted(tiny_model_dir.iterdir()) if p.is_file()}
    return {
        "cache": cache,
        "gguf": add_snapshot(cache, GGUF_REPO, commit_hash("gguf"), {gguf.name: gguf}, refs=("main",)),
        "old": add_snapshot(cache, TINY_REPO, commit_hash("old"), {"config.json": tiny["config.json"]},
                            refs=("old",)),
        "tiny": add_snapshot(cache, TINY_REPO, commit_hash("new"), tiny, refs=("main", "refs/pr/1")),
    }


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """No hub or models-directory setting from whoever runs the tests, and a HOME of the test's own (Conveyor's
    cache kept where it was: its conversions and kernels are not made again)."""
    monkeypatch.setenv(CACHE_ENV, str(cache_dir()))
    for variable in HUB_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return monkeypatch


def test_the_fake_cache_reads_as_huggingface_hubs_own(hub) -> None:
    from huggingface_hub import scan_cache_dir, snapshot_download

    scanned = scan_cache_dir(hub["cache"])
    assert scanned.warnings == []
    assert {repo.repo_id: sorted(r.commit_hash for r in repo.revisions) for repo in scanned.repos} == {
        GGUF_REPO: [commit_hash("gguf")], TINY_REPO: sorted([commit_hash("old"), commit_hash("new")])}
    found = snapshot_download(TINY_REPO, cache_dir=hub["cache"], local_files_only=True)
    assert Path(found) == hub["tiny"]


def test_a_gguf_repository_resolves_by_name_through_hf_hub_cache(hub, clean_env, tmp_path: Path) -> None:
    # The conversion is keyed by the file's contents: the shared cache's folder, copied into a cache of this
    # test's own, is the one found (converting again takes 16 s; pointing the shared one here would race others).
    converted = resolve_model(None)
    shutil.copytree(converted, tmp_path / "cache" / "models" / converted.name)
    clean_env.setenv(CACHE_ENV, str(tmp_path / "cache"))
    clean_env.setenv("HF_HUB_CACHE", str(hub["cache"]))
    file = model_source(GGUF_REPO)
    assert file == hub["gguf"] / default_model_path().name and file.is_symlink()
    folder = resolve_model(GGUF_REPO)
    assert folder == tmp_path / "cache" / "models" / converted.name
    assert gguf_source(folder) == file  # the snapshot's name, not the blob's hash


def test_hf_home_and_the_home_folder_are_the_fallbacks(hub, clean_env, tmp_path: Path) -> None:
    repo = f"models--{GGUF_REPO.replace('/', '--')}"
    file = Path(repo, "snapshots", commit_hash("gguf"), default_model_path().name)
    hf_home, home = tmp_path / "hf-home", tmp_path / "home"
    for hub_folder in (hf_home / "hub", home / ".cache" / "huggingface" / "hub"):
        hub_folder.mkdir(parents=True)
        (hub_folder / repo).symlink_to(hub["cache"] / repo)
    clean_env.setenv("HF_HOME", str(hf_home))
    assert hf_hub_cache() == (hf_home / "hub", "$HF_HOME/hub")
    assert model_source(GGUF_REPO) == hf_home / "hub" / file
    clean_env.delenv("HF_HOME")
    assert hf_hub_cache() == (home / ".cache" / "huggingface" / "hub", "the default")
    assert model_source(GGUF_REPO) == home / ".cache" / "huggingface" / "hub" / file
    clean_env.setenv("HF_HUB_CACHE", str(hub["cache"]))
    clean_env.setenv("HF_HOME", str(hf_home))  # HF_HUB_CACHE wins, as with huggingface_hub
    assert hf_hub_cache() == (hub["cache"], "$HF_HUB_CACHE")


def test_refs_main_is_honoured_and_a_revision_can_be_named(hub, clean_env) -> None:
    clean_env.setenv("HF_HUB_CACHE", str(hub["cache"]))
    assert model_source(TINY_REPO) == hub["tiny"]
    assert model_source(f"{TINY_REPO}@old") == hub["old"]
    assert model_source(f"{TINY_REPO}@refs/pr/1") == hub["tiny"]
    assert model_source(f"{TINY_REPO}@{commit_hash('old')}") == hub["old"]
    with pytest.raises(ModelNotFoundError, match=r"has no refs/v9 \(its refs: main, old, refs/pr/1; its snapshots"):
        model_source(f"{TINY_REPO}@v9")


def test_several_gguf_files_are_chosen_between_by_quant(hub, clean_env, tmp_path: Path) -> None:
    gguf = default_model_path()
    cache = tmp_path / "hub"
    snapshot = add_snapshot(cache, "org/multi", commit_hash("multi"), {"m-Q4_K_M.gguf": gguf, "m-Q4_K_S.gguf": gguf,
                                                                        "m-F16.gguf": gguf}, refs=("main",))
    clean_env.setenv("HF_HUB_CACHE", str(cache))
    assert model_source("org/multi:Q4_K_M") == snapshot / "m-Q4_K_M.gguf"
    assert model_source("org/multi:f16") == snapshot / "m-F16.gguf"
    with pytest.raises(ModelNotFoundError, match=r"holds 3 GGUF files \(m-F16.gguf, m-Q4_K_M.gguf, m-Q4_K_S.gguf\); "
                                                 "name one as NAME:QUANT"):
        model_source("org/multi")
    with pytest.raises(ModelNotFoundError, match="none or several of them match :Q4_K"):
        model_source("org/multi:Q4_K")


def test_the_models_directory_finds_name_gguf_and_name_folders(hub, clean_env, tmp_path: Path, tiny_model_dir) -> None:
    models = tmp_path / "models"
    (models / "multi").mkdir(parents=True)
    (models / "smollm2.gguf").symlink_to(default_model_path())
    shutil.copytree(tiny_model_dir, models / "tiny")
    for quant in ("Q4_1", "Q8_0"):
        (models / "multi" / f"smol.{quant}.gguf").symlink_to(default_model_path())
    clean_env.setenv(MODELS_ENV, f"{tmp_path / 'empty'}{os.pathsep}{models}")
    clean_env.setenv("HF_HUB_CACHE", str(hub["cache"]))
    assert model_source("smollm2") == models / "smollm2.gguf"
    assert model_source("smollm2.gguf") == models / "smollm2.gguf"
    assert model_source("tiny") == models / "tiny"
    assert model_source("multi:Q4_1") == models / "multi" / "smol.Q4_1.gguf"
    with pytest.raises(ModelNotFoundError):
        model_source("SmolLM2")  # case-sensitive: a name is a file's name
    assert model_source(GGUF_REPO).parent == hub["gguf"]  # not in the models directory: the hub cache next


def test_a_name_found_nowhere_lists_every_place_it_looked_in_order(clean_env, tmp_path: Path) -> None:
    clean_env.setenv(MODELS_ENV, str(tmp_path / "models"))
    clean_env.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "models").mkdir()
    with pytest.raises(ModelNotFoundError) as error:
        model_source("nobody/nothing")
    message = str(error.value)
    places = [str(Path("nobody/nothing").absolute()), "gemma3-270m", str(tmp_path / "models"),
              "nothing.gguf", str(tmp_path / "hub"), "models--nobody--nothing"]
    assert all(place in message for place in places), message
    assert [message.index(place) for place in places] == sorted(message.index(place) for place in places)
    assert isinstance(error.value, ValueError) and isinstance(error.value, FileNotFoundError)
    assert "downloads nothing" in message


def test_the_command_prints_where_it_looked_not_a_traceback(clean_env, tmp_path: Path, capsys) -> None:
    clean_env.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert main(["generate", "--model", "nobody/nothing", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("conveyor: error: model: found no model 'nobody/nothing'")
    assert f"Hugging Face cache {tmp_path / 'hub'} ($HF_HUB_CACHE): no models--nobody--nothing" in err
    assert "Traceback" not in err


def test_the_simulator_takes_the_model_by_its_name_or_file(hub, clean_env, tiny_model_dir: Path) -> None:
    """``conveyor simulate --model`` prices the model it names as the engine finds it (a name in the hub cache,
    a GGUF file by its description's config), a catalog name as before, and --model-config first of all."""
    from conveyor.entrypoints.simulate import _model_config

    clean_env.setenv("HF_HUB_CACHE", str(hub["cache"]))
    tiny = json.loads((tiny_model_dir / "config.json").read_text())
    for model, model_config, layers in [(TINY_REPO, None, tiny["num_hidden_layers"]),
                                        (str(default_model_path()), None, 30), ("llama-2-13b", None, 40),
                                        (TINY_REPO, "Llama-2-7B", 32)]:
        args = argparse.Namespace(model=model, model_config=model_config)
        assert _model_config(args).num_layers == layers, (model, model_config)
    with pytest.raises(ModelNotFoundError, match="nobody/nothing"):
        _model_config(argparse.Namespace(model="nobody/nothing", model_config=None))


def test_paths_and_packaged_names_keep_working(tiny_model_dir: Path, clean_env) -> None:
    assert model_source(None) == default_model_path()
    assert model_source("SmolLM2-135M-Instruct") == default_model_path()
    assert model_source(str(default_model_path())) == default_model_path()
    assert model_source(tiny_model_dir) == tiny_model_dir


def test_the_default_served_name() -> None:
    assert served_model_names(None, None) == ["SmolLM2-135M-Instruct"]
    assert served_model_names(None, str(default_model_path())) == ["SmolLM2-135M-Instruct.Q4_1"]
    assert served_model_names(None, TINY_REPO) == [TINY_REPO]  # a name is served as given, as vLLM does
    assert served_model_names(["a", "b", "a"], TINY_REPO) == ["a", "b"]


def test_the_offline_llm_takes_a_name(hub, clean_env, offline) -> None:
    from conveyor import LLM

    clean_env.setenv("HF_HUB_CACHE", str(hub["cache"]))
    by_name = LLM(TINY_REPO, num_kv_blocks=64)
    assert offline_text(by_name, "The river", 8) == offline_text(offline, "The river", 8)


@pytest.fixture(scope="module")
def named_server(hub):
    """The tiny model served by its hub name, answering to two names."""
    with running_server(TINY_REPO, "--num-kv-blocks", "256", "--served-model-name", "tiny", "team/alias",
                        env={"HF_HUB_CACHE": str(hub["cache"])}) as running:
        yield running


def test_each_served_name_answers_and_the_first_is_reported(named_server, offline) -> None:
    client = openai_client(named_server.base)
    expected = offline_text(offline, "Once upon", 6)
    for name in ("tiny", "team/alias"):
        completion = client.completions.create(model=name, prompt="Once upon", max_tokens=6, temperature=0)
        assert completion.choices[0].text == expected and completion.model == "tiny"
        chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=4, temperature=0)
        assert chat.model == "tiny" and chat.usage.completion_tokens == 4
        assert client.models.retrieve(name).id == name
    assert [m.id for m in client.models.list().data] == ["tiny", "team/alias"]


def test_an_unknown_name_is_a_404_naming_the_served_ones(named_server) -> None:
    client = openai_client(named_server.base)
    for unknown in (TINY_REPO, "other"):  # the model's own name too, once others are given (as vLLM)
        with pytest.raises(openai.NotFoundError) as error:
            client.chat.completions.create(model=unknown, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert error.value.body["code"] == "model_not_found"
        served = "this server serves 'tiny', 'team/alias'"
        assert error.value.body["message"] == f"model {unknown!r} does not exist; {served}"
