"""``scripts/_env.sh``: what it may delete (found by review: it removed any directory named by
``MLAROPE_VENV`` that it could not use)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_directory_it_did_not_make_is_never_deleted(tmp_path):
    mine = tmp_path / "somebody's environment"
    mine.mkdir()
    (mine / "keep.txt").write_text("not mlarope's")
    result = subprocess.run(
        ["bash", "-c", f'source "{ROOT}/scripts/_env.sh"'],
        env={"PATH": "/usr/bin:/bin", "MLAROPE_VENV": str(mine), "HOME": str(tmp_path)},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "was not made by this script" in result.stderr
    assert (mine / "keep.txt").read_text() == "not mlarope's"
