"""``benchmarks/transformers_layers.py``'s CPU smoke: every patched family of the installed
transformers builds its layer from its model's arguments, runs unpatched and patched, and
passes the check (small widths, the PyTorch reference backend: the kernels under Triton's
interpreter would take minutes a family). The timings mean nothing here."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from benchmarks import transformers_layers


@pytest.mark.cpu
def test_every_family_runs_on_the_cpu(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # read per call: the reference backend
    argv = ["--device", "cpu", "--tiny", "--seq", "16", "--iters", "1", "--rounds", "1",
            "--warmup", "0"]  # fmt: skip
    status = transformers_layers.main(argv)
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith("| ") and " ms " in line]
    families = transformers_layers.families("all")
    assert len(rows) >= 2 * len(families), table
    assert status == 0, table
    assert "FAILED" not in table
