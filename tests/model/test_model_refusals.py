"""A model Conveyor cannot run is refused at start in one line naming the field and what is supported.

Each case is a folder of a config.json and the default model's tokenizer, no weights: the refusal comes
before any weight is read. ``conveyor generate`` must exit with status 2, one ``conveyor: error:`` line, and
no traceback; one case runs ``conveyor serve`` too, which refuses the same way.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conveyor.entrypoints import cli
from tests.entrypoints.test_hostile_input import refusal_at_start

LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=49152, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)


def _folder(tmp_path: Path, tokenizer_dir: Path, **changes) -> Path:
    """A model folder whose config.json is LLAMA with ``changes`` (a value None: the key left out)."""
    config = {key: value for key, value in {**LLAMA, **changes}.items() if value is not None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, tmp_path / name)
    return tmp_path


CASES = {
    "architecture": (dict(model_type="gpt2"), ["model_type 'gpt2' is not supported", "gemma3", "qwen3", "llama"]),
    "missing-key": (dict(num_attention_heads=None), ["lacks 'num_attention_heads'", "num_hidden_layers"]),
    "rope-scaling": (dict(rope_scaling={"rope_type": "dynamic", "factor": 4.0}),
                     ["rope_scaling type 'dynamic' is not supported", "linear", "llama3", "yarn", "longrope"]),
    "activation": (dict(hidden_act="gelu"), ["hidden_act 'gelu' is not supported for llama", "silu"]),
    "gemma-activation": (dict(model_type="gemma3_text", hidden_activation="silu", head_dim=16),
                         ["hidden_act 'silu' is not supported for gemma3", "gelu_pytorch_tanh"]),
    "partial-rotary": (dict(model_type="phi3", partial_rotary_factor=0.75),
                       ["partial_rotary_factor 0.75 is not supported", "1.0"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_generate_refuses_in_one_line(case, tmp_path, default_model_dir, capsys):
    changes, words = CASES[case]
    folder = _folder(tmp_path, default_model_dir, **changes)
    assert cli.main(["generate", "--model", str(folder), "--prompt", "hi", "--num-kv-blocks", "16"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("conveyor: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in lines[0], lines[0]


def test_serve_refuses_an_unknown_architecture(tmp_path, default_model_dir):
    folder = _folder(tmp_path, default_model_dir, model_type="phi_unknown")
    assert "model_type 'phi_unknown' is not supported" in refusal_at_start(folder)
