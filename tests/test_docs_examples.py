"""Every Python example in the README and the docs that shows its output (``print(...)  # what it prints``) runs
against a real ``conveyor serve`` of the default model, and each such print prints what its comment says.

A block that uses ``client`` without making one gets the README's client first. Finding fewer blocks than the
pages hold today fails too, so that none is skipped silently.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests.serving import running_server

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHOWN = re.compile(r"^\s*print\(.*\)\s+#\s+(?P<shown>.+)$")
CLIENT = 'from openai import OpenAI\nclient = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")\n'


def examples() -> list[tuple[str, str]]:
    """(page:line, code) of every python block with a print whose comment shows what it prints."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in re.finditer(r"```python\n(.*?)```", text, re.S):
            code = match.group(1)
            if any(SHOWN.match(line) for line in code.splitlines()) and "client." in code:
                line = text.count("\n", 0, match.start()) + 2
                found.append((f"{page.relative_to(ROOT)}:{line}", code))
    return found


EXAMPLES = examples()


def test_the_pages_examples_are_all_found() -> None:
    names = {name.split(":")[0] for name, _ in EXAMPLES}
    assert {"README.md", "docs/index.md", "docs/serving.md", "docs/responses-api.md",
            "docs/structured-output.md"} <= names
    assert len(EXAMPLES) >= 6


@pytest.fixture(scope="module")
def default_server():
    """The default model under the name `conveyor serve` gives it when no --model is named (as `make run`)."""
    from conveyor.entrypoints.serve import DEFAULT_MODEL_NAME
    from conveyor.model.weights.paths import default_model_path

    with running_server(default_model_path(), "--num-kv-blocks", "512", "--served-model-name",
                        DEFAULT_MODEL_NAME) as server:
        yield server


@pytest.mark.parametrize(("where", "code"), EXAMPLES, ids=[name for name, _ in EXAMPLES])
def test_an_example_prints_what_it_shows(default_server, where, code) -> None:
    if "OpenAI(" not in code:
        code = CLIENT + code
    code = code.replace("http://127.0.0.1:8000/v1", f"{default_server.base}/v1")
    printed: dict[int, str] = defaultdict(str)

    def shown_print(*values, sep=" ", end="\n", **_) -> None:
        printed[sys._getframe(1).f_lineno] += sep.join(map(str, values)) + end

    exec(compile(code, where, "exec"), {"print": shown_print, "__name__": "example"})
    for number, line in enumerate(code.splitlines(), start=1):
        if (match := SHOWN.match(line)) is not None:
            assert printed[number].strip() == match["shown"].strip(), f"{where}, line {number}"
