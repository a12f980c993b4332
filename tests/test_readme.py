"""The README's quickstart runs as pasted (on the lane's device: the CPU lane's interpreter or
a GPU)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_quickstart_runs_as_pasted(tmp_path):
    text = README.read_text()
    section = text[text.index("## Quickstart") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    script = tmp_path / "quickstart.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300,
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    expected = "torch.Size([32, 16, 192]) torch.Size([32, 16, 192]) torch.Size([32, 16, 128])"
    assert result.stdout.strip() == expected
