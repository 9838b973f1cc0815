"""The chat page at ``/`` in a real headless Chromium, against one real server of two tiny models behind an API key.

Through the page's own controls: an answer streams in (its text grows over several updates) and comes from the
model picked (each model's greedy text, asked of the API directly, differs from the other's); stop ends the
answer and the server counts the request aborted; regenerate replaces the last answer; the conversation survives
a reload; the page opens without the key, asks for it in words, and carries it to its calls and to the dashboard
link; refusals (400, 503, an error mid-stream) are shown in words. Chromium as for tests/observe/test_dashboard.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import write_tiny_llama
from tests.observe.test_dashboard import chromium_executable, wait_for
from tests.serving import Server, running_server

KEY = "chat-key"
NAMES = ("alpha", "beta")
PROMPT = "Paris is"
ANSWER_TOKENS = 200  # long enough to arrive over many reads of the stream, short enough to take about a second
# A MutationObserver on the newest answer's text: the lengths it had, one per update the page drew.
WATCH_UPDATES = """() => {
  window.lengthsSeen = [];
  new MutationObserver(() => {
    const answers = document.querySelectorAll('.message.assistant .content');
    if (answers.length) window.lengthsSeen.push(answers[answers.length - 1].textContent.length);
  }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
}"""


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=chromium_executable(),
                                              args=["--no-sandbox", "--disable-dev-shm-usage"])
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Server]:
    """Two tiny random Llamas (other weights, one tokenizer and chat template) served as alpha and beta."""
    second = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-beta"), 1, tiny_model_dir)
    with running_server(tiny_model_dir, "--model", str(second), "--served-model-name", *NAMES,
                        "--num-kv-blocks", "1024", "--kernels", "torch", api_key=KEY) as server:
        yield server


def ended(server: Server, outcome: str) -> float:
    """Requests ended with ``outcome`` (finished, aborted, errored), over both models."""
    text = httpx.get(f"{server.base}/metrics", headers=server.headers, timeout=10).text
    pattern = rf'^conveyor:requests_ended_total\{{[^}}]*outcome="{outcome}"[^}}]*\}} (\S+)$'
    return sum(float(value) for value in re.findall(pattern, text, re.MULTILINE))


def submitted(server: Server) -> float:
    text = httpx.get(f"{server.base}/metrics", headers=server.headers, timeout=10).text
    return sum(float(v) for v in re.findall(r"^conveyor:requests_submitted_total\{[^}]*\} (\S+)$", text, re.MULTILINE))


def greedy_answer(server: Server, model: str, messages: list[dict], max_tokens: int) -> str:
    """What ``model`` answers ``messages``, greedy, asked of the API directly."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{server.base}/v1/chat/completions", json=body, headers=server.headers, timeout=120)
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


def open_chat(browser, server: Server, key: str | None = KEY):
    """A fresh page (its own storage) on the chat page, once its model picker is filled (when it has the key).
    Its uncaught errors and what its Content-Security-Policy refused are kept in ``page.faults``."""
    page = browser.new_page()
    page.faults = []
    page.on("pageerror", lambda error: page.faults.append(str(error)))
    page.on("console", lambda message: page.faults.append(message.text) if "Content Security Policy" in message.text
            else None)
    page.goto(f"{server.base}/" + (f"?api_key={key}" if key else ""))
    if key == KEY:
        wait_for(lambda: page.locator("#model option").count() == len(NAMES), 30, "the model picker")
    return page


def close(page) -> None:
    """Close the page, which must have run without an uncaught error or a refusal of its own policy."""
    faults = page.faults
    page.close()
    assert faults == []


def messages_shown(page) -> list[list[str]]:
    """The turns on the page: (role label, text)."""
    return page.evaluate("""Array.from(document.querySelectorAll('.message'), m =>
        [m.querySelector('.role').textContent, m.querySelector('.content').textContent])""")


def last_note(page) -> str:
    notes = page.locator(".message.assistant .meta")
    return notes.last.inner_text() if notes.count() else ""


def ask(page, text: str, max_tokens: int | str, temperature: float | str = 0) -> None:
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#temperature", str(temperature))
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def wait_answered(page, timeout: float = 60) -> str:
    """Until the newest answer has ended (its note counts its tokens); its text."""
    wait_for(lambda: re.match(r"\d+ tokens", last_note(page)) and page.is_disabled("#stop"), timeout, "the answer")
    return messages_shown(page)[-1][1]


def test_the_page_is_open_and_holds_only_itself(chat_server) -> None:
    page = httpx.get(f"{chat_server.base}/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "connect-src 'self'" in policy and "default-src 'none'" in policy and "unsafe-inline" not in policy
    assert "chat-key" not in page.text and "alpha" not in page.text  # no key, no model: those come from the API
    assert httpx.get(f"{chat_server.base}/v1/models", timeout=10).status_code == 401  # its calls need the key


def slow_download(page) -> None:
    """The page's downloads at 64 KB/s: the answer's events arrive over many reads of the stream even on a loaded
    machine, where a browser slowed by the load could otherwise read a whole short answer at once."""
    session = page.context.new_cdp_session(page)
    session.send("Network.enable")
    session.send("Network.emulateNetworkConditions",
                 {"offline": False, "latency": 0, "downloadThroughput": 64_000, "uploadThroughput": -1})


def test_an_answer_streams_in_from_the_model_picked(browser, chat_server) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    expected = {name: greedy_answer(chat_server, name, messages, ANSWER_TOKENS) for name in NAMES}
    assert expected["alpha"] != expected["beta"], "the two models must answer apart, or the test could not tell them"
    page = open_chat(browser, chat_server)
    for name in ("beta", "alpha"):
        page.click("#new-chat")
        page.select_option("#model", name)
        assert page.get_attribute("#dashboard-link", "href") == f"/dashboard?model={name}&api_key={KEY}"
        page.evaluate(WATCH_UPDATES)
        slow_download(page)
        ask(page, PROMPT, ANSWER_TOKENS)
        assert wait_answered(page) == expected[name]
        assert messages_shown(page) == [["you", PROMPT], [name, expected[name]]]
        lengths = page.evaluate("window.lengthsSeen")
        assert any(0 < n < len(expected[name]) for n in lengths), lengths  # shown in part before the whole
    close(page)


def test_stop_ends_the_answer_and_the_server_aborts_it(browser, chat_server) -> None:
    page = open_chat(browser, chat_server)
    aborted, finished = ended(chat_server, "aborted"), ended(chat_server, "finished")
    ask(page, "Tell me a long story.", 900, 1)
    wait_for(lambda: len(messages_shown(page)) == 2 and len(messages_shown(page)[1][1]) > 0, 60, "the first text")
    page.click("#stop")
    wait_for(lambda: last_note(page) == "stopped", 10, "the answer marked stopped")
    wait_for(lambda: ended(chat_server, "aborted") == aborted + 1, 30, "the server to abort the request")
    assert ended(chat_server, "finished") == finished  # it was stopped, not let run to its 900 tokens
    assert page.is_enabled("#send") and page.is_disabled("#stop")
    stopped = messages_shown(page)[1][1]
    # Regenerate replaces the stopped answer with a new one.
    page.fill("#max-tokens", "8")
    page.click("#regenerate")
    answered = wait_answered(page)
    assert len(messages_shown(page)) == 2 and answered != stopped
    close(page)


def test_regenerate_replaces_the_last_answer(browser, chat_server) -> None:
    page = open_chat(browser, chat_server)
    ask(page, PROMPT, 12, 1.5)
    first = wait_answered(page)
    before = submitted(chat_server)
    page.click("#regenerate")  # the old answer goes at once: the note waited for is the new one's
    second = wait_answered(page)
    assert submitted(chat_server) == before + 1
    shown = messages_shown(page)
    assert [role for role, _ in shown] == ["you", "alpha"] and shown[0][1] == PROMPT
    assert second != first  # sampled anew (12 tokens at temperature 1.5 from a random model: never twice the same)
    close(page)


def test_the_conversation_survives_a_reload(browser, chat_server) -> None:
    page = open_chat(browser, chat_server)
    page.select_option("#model", "beta")
    ask(page, PROMPT, 6)
    wait_answered(page)
    ask(page, "And then?", 6)
    wait_answered(page)
    shown = messages_shown(page)
    assert [role for role, _ in shown] == ["you", "beta", "you", "beta"]
    page.reload()
    wait_for(lambda: page.locator("#model option").count() == len(NAMES), 30, "the model picker")
    assert messages_shown(page) == shown
    assert page.input_value("#model") == "beta" and page.input_value("#max-tokens") == "6"
    page.click("#new-chat")
    assert messages_shown(page) == []
    page.reload()
    wait_for(lambda: page.locator("#model option").count() == len(NAMES), 30, "the model picker")
    assert messages_shown(page) == [] and page.is_disabled("#regenerate")
    close(page)


def test_the_page_asks_for_the_key_and_carries_it(browser, chat_server) -> None:
    page = open_chat(browser, chat_server, key=None)
    wait_for(lambda: page.is_visible("#key-form"), 30, "the key form")
    assert "API key" in page.inner_text("#notice") and "401" in page.inner_text("#notice")
    page.fill("#api-key", "wrong")
    page.click("#key-form button")
    wait_for(lambda: "401" in page.inner_text("#notice"), 10, "the wrong key refused")
    page.fill("#api-key", KEY)
    page.click("#key-form button")
    wait_for(lambda: page.locator("#model option").count() == len(NAMES), 30, "the model picker")
    assert page.is_hidden("#notice") and page.is_hidden("#key-form")
    assert f"api_key={KEY}" in page.url  # a reload keeps it
    dashboard = page.get_attribute("#dashboard-link", "href")
    assert dashboard == f"/dashboard?model=alpha&api_key={KEY}"
    assert httpx.get(f"{chat_server.base}{dashboard}", timeout=10).status_code == 200
    ask(page, PROMPT, 4)
    wait_answered(page)
    close(page)


def test_refusals_are_shown_in_words(browser, chat_server) -> None:
    page = open_chat(browser, chat_server)
    ask(page, PROMPT, 100000)  # past the context: the server's 400
    wait_for(lambda: page.is_visible("#notice"), 30, "the refusal")
    notice = page.inner_text("#notice")
    assert "refused" in notice and "400" in notice and "max_tokens" in notice, notice
    assert messages_shown(page) == [["you", PROMPT]] and page.is_enabled("#regenerate")  # no empty answer left

    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=503, content_type="application/json", headers={"Retry-After": "1"},
        body=json.dumps({"error": {"message": "engine stopped", "type": "internal_server_error"}})))
    page.fill("#max-tokens", "4")
    page.click("#regenerate")
    wait_for(lambda: "503" in page.inner_text("#notice"), 30, "the 503 in words")
    assert "cannot answer now" in page.inner_text("#notice") and "engine stopped" in page.inner_text("#notice")

    page.unroute("**/v1/chat/completions")
    events = [{"choices": [{"index": 0, "delta": {"content": "Half an"}}]},
              {"error": {"message": "the step failed", "type": "internal_server_error"}}]
    sse(page, events)
    page.click("#regenerate")
    wait_for(lambda: "the step failed" in page.inner_text("#notice"), 30, "the error mid-stream in words")
    assert messages_shown(page)[-1][1] == "Half an" and "failed" in last_note(page)  # what came is kept, marked
    close(page)


def sse(page, events: list[dict]) -> None:
    """Answer the page's next chat calls with these server-sent events (the whole stream at once)."""
    body = "".join(f"data: {json.dumps(event)}\n\n" for event in events) + "data: [DONE]\n\n"
    page.route("**/v1/chat/completions", lambda route: route.fulfill(status=200, content_type="text/event-stream",
                                                                     body=body))


def test_reasoning_is_shown_apart_from_the_answer(browser, chat_server) -> None:
    """A reasoning model's stream (--reasoning-parser) as the server sends it: reasoning_content, then content."""
    page = open_chat(browser, chat_server)
    sse(page, [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
               {"choices": [{"index": 0, "delta": {"reasoning_content": "The user asks about "}}]},
               {"choices": [{"index": 0, "delta": {"reasoning_content": "Paris."}}]},
               {"choices": [{"index": 0, "delta": {"content": "A city"}, "finish_reason": "stop"}]},
               {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}}])
    ask(page, PROMPT, 16)
    wait_answered(page)
    answer = page.locator(".message.assistant")
    assert answer.locator(".reasoning .text").inner_text() == "The user asks about Paris."
    assert answer.locator(".content").inner_text() == "A city"
    assert last_note(page) == "9 tokens"
    assert page.locator(".message.user .reasoning").is_hidden()
    close(page)
