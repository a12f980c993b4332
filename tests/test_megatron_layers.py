"""The Megatron-Core layer benchmark (``benchmarks/megatron_layers.py``): its case parsing, and
its CPU smoke end to end (``--device cpu --tiny``: the patch and the unfused path on the PyTorch
backend; Megatron's autotuned kernels need a GPU). The smoke needs a Megatron-LM checkout named
by ``MEGATRON_LM``, as the layer tests in ``test_integration_megatron.py`` do; skipped without
one. The GPU figures come from the GPU lane's ``megatron_layers`` step (docs/megatron.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.megatron_layers import Case

REPO = Path(__file__).resolve().parents[1]


def test_cases_parse():
    assert Case.parse("sbhd:4096") == Case("sbhd", 4096, 1)
    thd = Case.parse("thd:16384/4096")
    assert (thd.layout, thd.tokens, thd.seqs, thd.label) == (
        "thd",
        16384,
        4096,
        "thd 16384 / 4096 seq",
    )
    assert Case.parse("thd:4096").seqs == 1
    assert Case.parse("sbhd:128").target == 1.00 and thd.target == 0.98
    for bad in ("bshd:64", "sbhd:64/2", "thd:10/4", "thd:0", "sbhd"):
        with pytest.raises(ValueError):
            Case.parse(bad)


def test_cpu_smoke(tmp_path):
    """The whole benchmark at the integration test's widths and short cases, one iteration each:
    every case's row is written, both rotations of the patched step reach mlarope, and the
    patched step is within the bound of the fp32 layer (exit status 0)."""
    megatron = os.environ.get("MEGATRON_LM")
    if not megatron:
        pytest.skip("needs a Megatron-LM checkout: MEGATRON_LM=path (gpu_lane.sh megatron_tests)")
    out = tmp_path / "megatron_layers.md"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # PyTorch backend
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO), *sys.path])
    cmd = [sys.executable, "-m", "benchmarks.megatron_layers", "--device", "cpu", "--tiny",
           "--iters", "1", "--rounds", "1", "--warmup", "1", "--out", str(out)]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "ms" in line]
    labels = ["sbhd 64 x 1", "thd 64 / 1 seq", "thd 64 / 16 seq", "sbhd 16 x 1"]
    assert [row.split(" | ")[0].lstrip("| ") for row in rows] == labels
    for row in rows:
        assert "ok: 2/2 rotations through mlarope" in row, row
        assert row.count("n/a") == 2, row  # Megatron's kernels: not on the CPU
    assert "Megatron's fused kernels not run" in out.read_text()
