"""A model's tokenizer is loaded once per process while its files stay as they were, and again when they change."""

from __future__ import annotations

import json
import shutil

from conveyor.engine.tokenizer import Tokenizer


def test_an_engine_built_again_finds_its_tokenizer_loaded_and_a_changed_one_is_read_again(tiny_model_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    first, again = Tokenizer(folder), Tokenizer(str(folder) + "/")
    assert again.hf_tokenizer is first.hf_tokenizer, "the same files: loaded once"
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    config_path.write_text(json.dumps(config))
    changed = Tokenizer(folder)
    assert changed.hf_tokenizer is not first.hf_tokenizer
    assert changed.chat_template == config["chat_template"] != first.chat_template
    assert changed.apply_chat_template([{"role": "user", "content": "hi"}]) == changed.encode("[hi]")
