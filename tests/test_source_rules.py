"""Rules of the source tree that no other test sees: no source file over 700 lines, and no run
IDs (the GPU lane's and the perf log's names for one measurement: ``run`` or ``runs`` and one or
two capitals with up to two digits, as the cases of ``test_what_a_run_id_is`` show) in the
comments and docstrings of the code. A comment gives the reason; the run that measured it
belongs in docs/perf_log.md (``perf_log v16`` points there where a comment needs its evidence).

Both read every Python file of ``src/``, ``benchmarks/``, ``tests/`` and ``scripts/``: a longer
test module is split by concern, its shared helpers in a harness module (``tests/*harness.py``).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("src", "benchmarks", "tests", "scripts")
MAX_LINES = 700
# "run" or "runs", then a run's name: one or two capitals and at most two digits (A, AC, H3, Z6,
# CP2), not followed by a word character or "(" (the run "O(1)" away is big-O).
RUN_ID = re.compile(r"\bruns?\s+\(?[A-Z]{1,2}[0-9]{0,2}(?![\w(])")


def source_files() -> list[Path]:
    return sorted(p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py"))


def comments(text: str) -> list[tuple[int, str]]:
    """``(line, text)`` of every comment and docstring (module, class, function) of the code."""
    found = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(text).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                found.append((node.body[0].lineno, doc))
    return found


def run_ids(text: str) -> list[str]:
    return [
        f"line {line}: {m.group(0)!r}" for line, c in comments(text) for m in RUN_ID.finditer(c)
    ]


def test_no_source_file_over_700_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in source_files()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines (split by concept): {long}"


def test_no_run_ids_in_comments():
    found = {
        str(p.relative_to(ROOT)): ids for p in source_files() if (ids := run_ids(p.read_text()))
    }
    assert not found, f"run IDs in comments (the reason stays, the run goes to perf_log): {found}"


@pytest.mark.parametrize(
    "text,flagged",
    [
        ("# measured in run H3 (24 us)\n", True),
        ("# runs H2-I3 agree\n", True),
        ("x = 1  # (run AC): the old kernel\n", True),
        ('def f():\n    """Slower in run G5\'s table."""\n', True),
        ("# run Z, then run Z6\n", True),
        ('"""Module doc: see runs A and B."""\n', True),
        ("# a wrong rotation puts the run O(1) away\n", False),
        ("# the run-to-run spread; runs in fp32; run it again\n", False),
        ("# perf_log v16: the table rows\n", False),
        ('message = "the first full run (G2) measured"\n', False),  # a string, not a comment
        ("# DeepSeek-V3 on an H200, at L2 size\n", False),
    ],
)
def test_what_a_run_id_is(text, flagged):
    assert bool(run_ids(text)) is flagged, run_ids(text)
