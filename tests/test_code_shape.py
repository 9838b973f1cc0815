"""The size rules the codebase keeps: no Python module over 500 lines of code, no function over 60.

Long files and long functions are where a reader gets lost; this keeps the
rule from eroding one commit at a time. Only code counts: docstrings, comments
and blank lines do not, so explaining is never what gets cut to fit (a file
past the rule is split by concept). The C++ kernels are exempt.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
SOURCES = sorted(p for folder in ("conveyor", "tests", "bench") for p in (ROOT / folder).rglob("*.py"))
NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING,
            tokenize.ENDMARKER}


def docstring_lines(tree: ast.Module) -> set[int]:
    """The lines of every module, class and function docstring."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def code_lines(text: str, tree: ast.Module) -> set[int]:
    """The lines that hold code: a token other than a comment, less the docstrings."""
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type not in NOT_CODE:
            lines.update(range(token.start[0], token.end[0] + 1))
    return lines - docstring_lines(tree)


def test_code_lines_leave_out_docstrings_comments_and_blank_lines() -> None:
    text = ('"""A module.\n\nIts role."""\n\n# why\nx = (1,\n     2)  # two\n\n\n'
            'def f():\n    """Doc."""\n    return x\n')
    assert sorted(code_lines(text, ast.parse(text))) == [6, 7, 10, 12]


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(ROOT)) for p in SOURCES])
def test_modules_and_functions_stay_short(path: Path) -> None:
    text = path.read_text()
    tree = ast.parse(text)
    code = code_lines(text, tree)
    assert len(code) <= MAX_MODULE_LINES, f"{path.name}: {len(code)} lines of code, over {MAX_MODULE_LINES}"
    long = [
        f"{node.name} ({size} lines of code, line {node.lineno})"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and (size := len(code & set(range(node.lineno, node.end_lineno + 1)))) > MAX_FUNCTION_LINES
    ]
    assert not long, f"{path.name}: functions over {MAX_FUNCTION_LINES} lines of code: {', '.join(long)}"
