"""The README stays a front page, its links lead somewhere, and the docs' tables follow the code and carry their
provenance: the request-parameter table names every field the server takes, and every figure table (the
benchmark pages, quantized weights, reliability, the KV cache) is stamped with its machine, date, commit and
command. (The flag tables: tests/entrypoints/test_flags.py.)"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from conveyor.core.sampling import SamplingParams
from conveyor.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
FIGURE_PAGES = [*sorted(p for p in (DOCS / "benchmarks").glob("*.md") if p.name != "index.md"),
                DOCS / "quantized-weights.md", DOCS / "reliability.md", DOCS / "kv-cache.md", DOCS / "embeddings.md"]
REFERENCE_TABLES = {  # tables of those pages that hold no figures
    "| peer | set-up | what it runs |", "| GGUF type | kept as | bits a weight: file, stored | exact? |",
    "| kind | needs | used by default |",
    "| `--kv-layout` | |", "| field | what it takes |"}
STAMP = re.compile(r"^Machine: .+\. Recorded: \d{4}-\d{2}-\d{2}, commit [0-9a-f]{7}\b.*\. Command: .+\.$")


def tables(text: str) -> list[tuple[int, list[str]]]:
    """Every Markdown table: (index of the line after it, its lines)."""
    lines, found, i = text.splitlines(), [], 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            found.append((j, lines[i:j]))
            i = j
        i += 1
    return found


def test_readme_is_a_front_page() -> None:
    assert len((ROOT / "README.md").read_bytes()) <= 10 * 1024


def test_readme_links_lead_to_files() -> None:
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    local = [link for link in links if "://" not in link]
    assert local, "the README links into the docs"
    assert [link for link in local if not (ROOT / link).exists()] == []


def test_request_parameter_table_names_every_field() -> None:
    text = (DOCS / "serving.md").read_text().split("\n## Request parameters\n", 1)[1].split("\n## ", 1)[0]
    (_, rows), = [table for table in tables(text) if table[1][0].startswith("| parameter |")]
    named = {name for row in rows[2:] for name in re.findall(r"`([a-z_]+)`", row.split("|")[1])}
    fields = {name for model in (ChatCompletionRequest, CompletionRequest) for name in model.model_fields}
    assert sorted(fields - named) == [], "request fields missing from docs/serving.md's table"
    assert sorted(named - fields) == [], "docs/serving.md's table names fields the server does not take"


def test_sampling_params_table_matches_the_dataclass() -> None:
    text = (DOCS / "offline.md").read_text()
    (_, rows), = [table for table in tables(text) if table[1][0].startswith("| field |")]
    shown = {cells[1].strip("` "): cells[4].strip() for cells in (row.split("|") for row in rows[2:])}
    fields = {field.name: field.default for field in dataclasses.fields(SamplingParams)}
    assert list(shown) == list(fields), "docs/offline.md's SamplingParams table differs from the dataclass's fields"
    assert {name: repr(default) for name, default in fields.items()} == shown


@pytest.mark.parametrize("page", FIGURE_PAGES, ids=[p.name for p in FIGURE_PAGES])
def test_every_figure_table_is_stamped(page: Path) -> None:
    lines = page.read_text().splitlines()
    for end, table in tables(page.read_text()):
        if table[0] in REFERENCE_TABLES:
            continue
        after = next((line for line in lines[end:] if line.strip()), "")
        assert STAMP.match(after), f"{page.name}: the table {table[0][:60]!r} is not followed by its stamp"
