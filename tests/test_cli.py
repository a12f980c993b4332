"""``python -m mlarope``: help, info, the demo on a small CPU batch, exit codes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlarope.tools import cli

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


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


def test_no_command_prints_the_help(capsys):
    """``python -m mlarope`` alone lists the commands and exits 0, as ``--help`` does (it exited
    2 with argparse's "the following arguments are required")."""
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert "usage:" in out
    for name in ("demo", "stress", "bench", "info"):
        assert name in out


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


def _run(
    code_or_args: list[str], env_extra: dict | None = None, drop: tuple = ()
) -> subprocess.CompletedProcess:
    """``python <args>`` in a subprocess with this package importable, stdout a pipe."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **(env_extra or {})}
    for name in drop:
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, *code_or_args], capture_output=True, text=True, env=env, timeout=300
    )


def test_demo_header_is_one_line_in_a_pipe():
    """Piped output is plain text: rich used to wrap the header at 80 columns
    (``thd batch [5,`` / ``16, 11]``)."""
    result = _run(["-m", "mlarope", "demo", "--device", "cpu"], drop=("TRITON_INTERPRET",))
    assert result.returncode == 0, result.stdout + result.stderr
    header = result.stdout.splitlines()[0]
    assert header.startswith("mlarope demo: ") and "thd batch [5, 16, 11] (32 tokens)" in header
    assert header.rstrip().endswith(tuple("0123456789")), header  # the softmax scale, unwrapped


@pytest.mark.parametrize("command", [["info"], ["demo", "--device", "cpu"]])
def test_commands_run_without_rich(command):
    """rich is an extra (``mlarope[bench]``): without it the commands print plain text."""
    code = (
        "import sys; sys.modules['rich'] = None\n"  # any import of rich now raises ImportError
        "from mlarope.tools.cli import main\n"
        f"sys.exit(main({command!r}))\n"
    )
    result = _run(["-c", code], drop=("TRITON_INTERPRET",))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr


def test_commands_say_why_without_triton():
    """Without Triton (no wheel for the platform, or one too old for the kernels) ``info``
    still runs and ``stress`` exits 2 with the reason instead of a traceback."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from mlarope.tools.cli import main\n"
        "print('info', main(['info']))\n"
        "print('stress', main(['stress', '--trials', '1']))\n"
    )
    result = _run(["-c", code], drop=("TRITON_INTERPRET",))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "info 0" in result.stdout and "stress 2" in result.stdout
    assert "triton" in result.stdout and "not installed" in result.stdout
    assert "mlarope stress: cannot run here" in result.stderr


def test_stress_without_gpu_or_interpreter_exits_2():
    """On a CPU-only machine without TRITON_INTERPRET=1 the stress run says what to set and
    exits 2, as ``bench`` does (it used to die in Triton's driver with a traceback)."""
    result = _run(
        ["-m", "mlarope", "stress", "--trials", "2"],
        env_extra={"CUDA_VISIBLE_DEVICES": ""}, drop=("TRITON_INTERPRET",),
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert "TRITON_INTERPRET=1" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.parametrize(
    "entry",
    [
        ["-m", "mlarope"],
        ["-m", "mlarope.tools.cli"],
        ["-m", "mlarope.tools.demo"],
        ["-m", "mlarope.tools.stress"],
        ["-m", "mlarope.tools.bench"],
        ["-m", "mlarope.tools.bench.serving"],
        [str(BENCHMARKS / "sweep.py")],
        [str(BENCHMARKS / "kernel_report.py")],
        [str(BENCHMARKS / "serving_kernel_report.py")],
        [str(BENCHMARKS / "host_path_cpu.py")],
    ],
    ids=lambda entry: entry[-1].replace(str(BENCHMARKS), "benchmarks"),
)
def test_every_module_entry_point_has_help(entry):
    """``python -m <module> --help`` and ``python benchmarks/<script> --help`` explain and exit
    0 without running anything (the kernel report's ``--help`` used to compile and print the
    report; the demo's and the stress run's module entry points printed nothing)."""
    result = _run([*entry, "--help"], drop=("TRITON_INTERPRET",))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("usage: ")
    assert "| kernel |" not in result.stdout


def test_library_does_not_import_the_tools():
    """The package's commands sit beside the library: no module outside ``mlarope.tools``
    (``python -m mlarope``'s ``__main__`` aside) imports them, at the top or in a function."""
    import ast

    import mlarope

    package = Path(mlarope.__file__).parent
    offenders = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package)
        if relative.parts[0] == "tools" or relative == Path("__main__.py"):
            continue
        # The package a relative import starts from (``a/b.py`` and ``a/__init__.py``: ``a``).
        package_parts = ["mlarope", *relative.with_suffix("").parts][:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package_parts[: len(package_parts) - node.level + 1] if node.level else []
                module = ".".join([*base, *([node.module] if node.module else [])])
                names = [f"{module}.{alias.name}" for alias in node.names]
            else:
                continue
            offenders += [f"{relative}: {n}" for n in names if n.startswith("mlarope.tools")]
    assert offenders == []


def test_unknown_option_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["info", "--no-such-option"])
    assert exit_info.value.code == 2
    assert "--no-such-option" in capsys.readouterr().err


def test_version_has_one_source():
    """pyproject takes the version from ``mlarope.__version__``, its one source; where the
    package is installed (the CPU lane's editable install), the metadata says the same. The GPU
    lane runs from ``src/`` without installing: no metadata there."""
    import re
    from importlib.metadata import PackageNotFoundError, version
    from pathlib import Path

    import mlarope

    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert re.search(r'^dynamic = \["version"\]$', pyproject, re.M)
    assert re.search(r'^version = \{ attr = "mlarope.__version__" \}$', pyproject, re.M)
    try:
        installed = version("mlarope")
    except PackageNotFoundError:
        return
    assert installed == mlarope.__version__


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--device", "gpu"], "--device must be cuda or cpu, got 'gpu'"),
        (["--heads", "0"], "--heads must be at least 1, got 0"),
        (["--heads", "-2"], "--heads must be at least 1, got -2"),
        (["--seq-lens", "5,abc"], "--seq-lens must be comma-separated integers, got '5,abc'"),
        (["--seq-lens", "0"], "--seq-lens must be lengths of at least 1, got '0'"),
        (["--steps", "3"], "--steps is the serving demo's option: add --serving"),
        (["--cache-format", "split"], "--cache-format is the serving demo's option"),
        (["--serving", "--seq-lens", "4,5"], "--seq-lens is the training demo's"),
        (["--serving", "--steps", "0"], "--steps must be at least 1, got 0"),
    ],
)
def test_demo_refuses_a_bad_command_line(argv, says, capsys):
    """Each demo option is checked before anything runs (exit 2, one line naming it), and an
    option of the other demo is refused: a traceback and exit 1, or a silently ignored option
    ("--heads 0" ran 4 heads and passed), before (found by review)."""
    assert cli.main(["demo", *argv]) == 2
    assert says in capsys.readouterr().out


def test_a_closed_pipe_ends_quietly(tmp_path):
    """``mlarope info | head -1``: no BrokenPipeError traceback when the reader leaves."""
    script = "import sys; from mlarope.tools import cli; sys.exit(cli.main(['info']))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        f"{sys.executable} -c \"{script}\" | head -c 1", shell=True, capture_output=True,
        text=True, env=env, timeout=300,
    )  # fmt: skip
    assert "BrokenPipeError" not in result.stderr and "Traceback" not in result.stderr, result
