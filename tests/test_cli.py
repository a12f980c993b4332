"""``python -m mlarope``: help, info, the demo on a small CPU batch, exit codes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mlarope import cli


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for name in ("demo", "stress", "bench", "info"):
        assert name in out


@pytest.mark.parametrize("command", ["demo", "stress", "bench"])
def test_each_command_explains_its_options(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    assert "--" in capsys.readouterr().out


def test_bad_usage_exits_2():
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["no-such-command"])
    assert exit_info.value.code == 2


def test_info_runs():
    assert cli.main(["info"]) == 0


def test_demo_on_cpu_passes():
    """The README's main job, as a subprocess (as a user runs it), on the CPU backend."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run(
        [sys.executable, "-m", "mlarope", "demo", "--device", "cpu"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "demo passed" in result.stdout
