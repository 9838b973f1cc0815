"""``--chat-template`` / ``LLM(chat_template=...)``: the chat template read from a file or taken as given (vLLM's
rule), refused at start where it does not compile or names no file; offline, the prompt a chat makes is that
template's rendering (per engine, or per call). A model without a template says so at start; its chat requests
are a 400 that names the flag, and /v1/completions goes on. (The servers that read a template from a file and
from a string, and a template failing on some requests, are in test_reasoning.py.)"""

from __future__ import annotations

import httpx
import pytest

from conveyor import LLM
from conveyor.core.config import EngineConfig, read_chat_template
from conveyor.core.errors import FieldError
from conveyor.core.sampling import SamplingParams
from conveyor.engine.tokenizer import Tokenizer
from tests.serving import openai_client, running_server, with_chat_template

TEMPLATE = "{% for message in messages %}[{{ message.role }}] {{ message.content }}\n{% endfor %}[assistant]"
MESSAGES = [{"role": "user", "content": "Hello there"}]


def test_a_file_is_read_and_a_template_taken_as_given(tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert read_chat_template(str(path)) == TEMPLATE
    assert read_chat_template(TEMPLATE) == TEMPLATE  # a line break in it: the template itself, untouched
    assert read_chat_template("{{ 'a' }}\\n{{ 'é' }}\\t") == "{{ 'a' }}\n{{ 'é' }}\t"  # one line: escapes read
    assert read_chat_template(None) is None
    with pytest.raises(ValueError, match=r"chat_template: '.*missing\.jinja' looks like a file's path"):
        EngineConfig(chat_template=str(tmp_path / "missing.jinja"))
    assert EngineConfig(chat_template=str(path)).chat_template_text() == TEMPLATE


def test_a_template_that_does_not_compile_is_refused_at_start_naming_its_line(tiny_model_dir, capsys):
    with pytest.raises(ValueError, match=r"chat_template: the template does not compile at line 2 of the template"):
        Tokenizer(tiny_model_dir, "{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    from conveyor.entrypoints import cli

    assert cli.main(["serve", "--model", str(tiny_model_dir), "--num-kv-blocks", "16", "--port", "0",
                     "--chat-template", "{% for m in messages %}{{ m.content }}"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("conveyor: error:")]
    assert len(lines) == 1 and "does not compile at line 1" in lines[0] and "Traceback" not in err, err


def test_offline_chat_renders_the_template_given(tiny_model_dir):
    tokenizer = Tokenizer(tiny_model_dir)
    expected = tokenizer.hf_tokenizer.encode("[user] Hello there\n[assistant]", add_special_tokens=False)
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64, chat_template=TEMPLATE)
    params = SamplingParams(max_tokens=2, temperature=0)
    [output] = llm.chat(MESSAGES, params, use_tqdm=False)
    assert output.prompt_token_ids == expected
    other = "{% for message in messages %}<<{{ message.content }}>>{% endfor %}"
    [output] = llm.chat(MESSAGES, params, use_tqdm=False, chat_template=other)  # for this call only
    assert output.prompt_token_ids == tokenizer.hf_tokenizer.encode("<<Hello there>>", add_special_tokens=False)
    own = LLM(str(tiny_model_dir), num_kv_blocks=64).chat(MESSAGES, params, use_tqdm=False)[0]
    assert own.prompt_token_ids != expected  # the model's own template shows its system prompt


@pytest.fixture(scope="module")
def untemplated_model(tiny_model_dir, tmp_path_factory):
    """The tiny model with no chat template."""
    return with_chat_template(tiny_model_dir, tmp_path_factory.mktemp("tiny-untemplated"), None)


def test_offline_chat_without_a_template_says_how_to_give_one(untemplated_model):
    tokenizer = Tokenizer(untemplated_model)
    assert tokenizer.chat_template is None
    with pytest.raises(FieldError, match=r"no chat template: give one .*LLM\(chat_template=\.\.\.\)"):
        tokenizer.apply_chat_template(MESSAGES)
    assert Tokenizer(untemplated_model, TEMPLATE).apply_chat_template(MESSAGES)


def test_a_server_without_a_template_says_so_and_serves_completions(untemplated_model):
    with running_server(untemplated_model, "--num-kv-blocks", "64", "--served-model-name", "tiny") as server:
        chat = httpx.post(f"{server.base}/v1/chat/completions", timeout=60,
                          json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2})
        assert chat.status_code == 400
        error = chat.json()["error"]
        assert error["param"] == "messages" and "no chat template" in error["message"]
        assert "--chat-template" in error["message"]
        responses = httpx.post(f"{server.base}/v1/responses", json={"model": "tiny", "input": "Hi"}, timeout=60)
        assert responses.status_code == 400 and "--chat-template" in responses.json()["error"]["message"]
        completion = openai_client(server.base).completions.create(model="tiny", prompt="Hello", max_tokens=3,
                                                                    temperature=0)
        assert completion.usage.completion_tokens == 3
    printed = server.output()
    assert "no chat template" in printed and "--chat-template" in printed
