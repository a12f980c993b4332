"""Every ```python block of README.md and docs/*.md runs as pasted.

Each block runs alone, in a fresh Python process whose working directory is an empty folder,
with this checkout's ``src`` first on ``PYTHONPATH`` and the lane's environment (the CPU lane's
``TRITON_INTERPRET=1``, or the GPU lane's CUDA device): it must exit 0. A block that needs
something a plain CPU machine lacks says so in its first line, ``# requires: <what>``, and runs
only where that exists:

- ``cuda``: ``torch.cuda.is_available()`` (the GPU lane, ``--device cuda``, runs these);
- ``megatron``: ``import megatron.core`` works (the GPU lane's ``tests`` step, when
  ``scripts/gpu_lane.sh`` has installed a carried megatron-core wheel; no CPU lane);
- ``transformers``: ``import transformers`` works (the ``[dev]`` extra installs it, so every
  CPU lane runs these);
- ``a checkpoint``: never here (no test lane has a model checkpoint, and nothing is
  downloaded); such a block is a template.

Every block, run or not, must compile, and a requirement not in this list fails (a typo would
otherwise skip a block for ever). A ``print(...)  # <what it prints>`` line at the top level of a
block is checked too: the numbers of its comment must be the numbers of a line it printed.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<code>.*?)^(?P=indent)```[ \t]*$", re.M | re.S
)
REQUIRES = re.compile(r"#\s*requires:\s*(?P<what>.+?)\s*$")


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent package that is missing, or fails to import
        return False


REQUIREMENTS = {
    "cuda": torch.cuda.is_available,
    "megatron": lambda: _importable("megatron.core"),
    "transformers": lambda: _importable("transformers"),
    "a checkpoint": lambda: False,
}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence
    code: str
    requires: str | None

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks_of(path: Path, text: str | None = None) -> list[Block]:
    """The ```python blocks of a Markdown file, dedented to their fence."""
    text = path.read_text() if text is None else text
    found = []
    for m in FENCE.finditer(text):
        indent = m.group("indent")
        lines = m.group("code").splitlines()
        code = "\n".join(ln[len(indent) :] if ln.startswith(indent) else ln for ln in lines)
        first = next((ln.strip() for ln in code.splitlines() if ln.strip()), "")
        req = REQUIRES.fullmatch(first)
        found.append(
            Block(path, text.count("\n", 0, m.start()) + 1, code + "\n", req and req["what"])
        )
    return found


BLOCKS = [b for path in DOCS for b in blocks_of(path)]


def run_block(code: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """``code`` as a script in a fresh process in ``cwd``, with this checkout's src first."""
    script = cwd / "block.py"
    script.write_text(code)
    work = cwd / "work"
    work.mkdir()
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run(
        [sys.executable, str(script)], cwd=work, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def _numbers(text: str) -> list[str]:
    return re.findall(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", text)


def printed_claims(code: str) -> list[str]:
    """The comments of the top-level ``print(...)  # ...`` lines of ``code``, in order."""
    lines = code.splitlines()
    claims = []
    for node in ast.parse(code).body:
        call = getattr(node, "value", None)
        if (
            isinstance(node, ast.Expr)
            and isinstance(call, ast.Call)
            and isinstance(call.func, ast.Name)
            and call.func.id == "print"
        ):
            last = lines[node.end_lineno - 1]
            tail = last[node.end_col_offset :]
            if tail.strip().startswith("#"):
                claims.append(tail.strip()[1:])
    return claims


def check_claims(code: str, stdout: str) -> None:
    """Each claim's numbers are the numbers of a printed line, the claims in the lines' order."""
    out = [_numbers(line) for line in stdout.splitlines()]
    at = 0
    for claim in printed_claims(code):
        want = _numbers(claim)
        while at < len(out) and out[at] != want:
            at += 1
        assert at < len(out), f"no printed line shows {want} (the comment {claim!r}): {stdout!r}"
        at += 1


def test_the_docs_have_blocks():
    """The collector finds the blocks (a regex that matches nothing would pass every file)."""
    assert len(BLOCKS) >= 9
    assert {b.path.name for b in BLOCKS} >= {"README.md", "serving.md", "yarn.md"}


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.id)
def test_block_runs_as_pasted(block: Block, tmp_path):
    compile(block.code, block.id, "exec")  # every block, run here or not
    if block.requires is not None:
        assert block.requires in REQUIREMENTS, (
            f"{block.id}: unknown requirement {block.requires!r}; known: {sorted(REQUIREMENTS)}"
        )
        if not REQUIREMENTS[block.requires]():
            pytest.skip(f"{block.id} requires {block.requires}, which this machine lacks")
    result = run_block(block.code, tmp_path)
    assert result.returncode == 0, f"{block.id} failed:\n{result.stdout}\n{result.stderr}"
    check_claims(block.code, result.stdout)


# ------------------------------------------------------------------ the collector's own tests
def test_collector_reads_requirements_and_indented_blocks(tmp_path):
    text = (
        "intro\n\n```python\n# requires: cuda\nx = 1\n```\n\n- a list item:\n\n"
        "  ```python\n  import os\n  print(os.sep)\n  ```\n\n```bash\necho no\n```\n"
    )
    found = blocks_of(tmp_path / "x.md", text)
    assert [(b.line, b.requires) for b in found] == [(3, "cuda"), (10, None)]
    assert found[1].code == "import os\nprint(os.sep)\n"


def test_a_failing_block_fails(tmp_path):
    result = run_block("import mlarope\nundefined_name\n", tmp_path)
    assert result.returncode != 0 and "NameError" in result.stderr


def test_blocks_import_this_checkout(tmp_path):
    result = run_block("import mlarope\nprint(mlarope.__file__)\n", tmp_path)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).resolve() == ROOT / "src" / "mlarope" / "__init__.py"


def test_printed_claims_are_checked():
    code = "print(3, 4)  # 3, 4\nprint('x')\nprint([5])  # [5]\n"
    check_claims(code, "3 4\nx\n[5]\n")
    with pytest.raises(AssertionError, match="no printed line"):
        check_claims(code, "3 4\nx\n[6]\n")
