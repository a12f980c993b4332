"""Install like a user: build the wheel, install it into a fresh virtual environment next to
this lane's torch, and run the ``mlarope`` command there under Triton's interpreter.

The fresh environment gets this lane's torch first (its CPU build: a looser requirement would
pull a multi-GB CUDA build), then the wheel with this lane's triton and numpy as constraints,
so the pinned lane checks the wheel with triton 3.6 and the newest lane with the newest
releases, which is what ``pip install mlarope`` next to torch 2.13 resolves. Nothing else:
no rich, so the commands print their plain-text output. About two minutes (the environment,
then the demo and 20 stress trials on the interpreter).
"""

from __future__ import annotations

import email.parser
import os
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import numpy
import pytest
import torch
import triton

import mlarope

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.cpu, pytest.mark.slow]


def _run(args: list[str], cwd: Path, env: dict | None = None, timeout: int = 600) -> str:
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{' '.join(args)} exited {result.returncode}:\n{output[-4000:]}"
    return output


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[Path, str]:
    """``(wheel path, build output)``, built by pip from a copy of the sources pip would pack,
    with ``benchmarks/`` beside them as in a checkout (the wheel must leave it out)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    for folder in ("src", "benchmarks"):
        shutil.copytree(
            ROOT / folder,
            source / folder,
            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"),
        )
    out = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp / "dist"), str(source)],
        cwd=tmp,
    )
    (built,) = (tmp / "dist").glob("mlarope-*.whl")
    return built, out


def test_wheel_metadata(wheel):
    path, build_output = wheel
    assert "deprecated" not in build_output.lower(), build_output[-3000:]
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        info = f"mlarope-{mlarope.__version__}.dist-info"
        metadata = email.parser.Parser().parsestr(archive.read(f"{info}/METADATA").decode())
        license_text = archive.read(f"{info}/licenses/LICENSE").decode()
    assert metadata["Version"] == mlarope.__version__
    assert metadata["License-Expression"] == "Apache-2.0"
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    requires = metadata.get_all("Requires-Dist")
    core = sorted(r for r in requires if "extra ==" not in r)
    assert core == ["numpy", "torch>=2.6", "triton>=3.6"]
    assert "mlarope/py.typed" in names and "mlarope/kernels/_triton_compat.py" in names
    # The commands a user runs are in the package; the GPU lane's tooling is not.
    assert "mlarope/tools/cli.py" in names and "mlarope/tools/bench/__main__.py" in names
    assert not [n for n in names if n.startswith("benchmarks/") or "sweep" in n], names


def test_wheel_in_a_fresh_environment(wheel, tmp_path):
    path, _ = wheel
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = str(env_dir / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q"]
    _run([*pip, f"torch=={torch.__version__}"], cwd=tmp_path)
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(f"triton=={triton.__version__}\nnumpy=={numpy.__version__}\n")
    _run([*pip, "-c", str(constraints), str(path)], cwd=tmp_path)

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["TRITON_INTERPRET"] = "1"
    mlarope_cmd = str(env_dir / "bin" / "mlarope")
    location = _run(
        [python, "-c", "import mlarope; print(mlarope.__file__)"], cwd=tmp_path, env=env
    )
    assert location.strip().startswith(str(env_dir)), location  # the wheel, not the checkout
    no_rich = subprocess.run([python, "-c", "import rich"], env=env, capture_output=True)
    assert no_rich.returncode != 0, "rich is not a dependency: the plain output is under test"

    info = _run([mlarope_cmd, "info"], cwd=tmp_path, env=env)
    assert f"mlarope           {mlarope.__version__}" in info, info
    assert f"triton            {triton.__version__}" in info, info
    assert "Triton kernels (interpreter)" in info, info

    demo = _run([mlarope_cmd, "demo", "--device", "cpu"], cwd=tmp_path, env=env)
    assert "under Triton's interpreter" in demo and "demo passed" in demo, demo

    stress = _run(
        [mlarope_cmd, "stress", "--trials", "20", "--control-trials", "2"], cwd=tmp_path, env=env
    )
    assert re.search(r"mlarope \(ours\) +20 of 20 +0 +0\n", stress), stress
