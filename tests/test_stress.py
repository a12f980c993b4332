"""The stress harness runs, and it sees wrong elements when a kernel produces them."""

from __future__ import annotations

import argparse
import json

import pytest

from mlarope.tools import stress


def _args(tmp_path, device, trials=3, control=1) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    stress.add_arguments(parser)
    return parser.parse_args(
        ["--trials", str(trials), "--control-trials", str(control), "--small",
         "--device", device.type, "--json", str(tmp_path / "stress.json")]
    )  # fmt: skip


def test_stress_runs_clean(tmp_path, device, capsys):
    assert stress.run(_args(tmp_path, device)) == 0
    summary = json.loads((tmp_path / "stress.json").read_text())
    assert summary["trials"] == 3 and summary["failed_trials"] == 0
    # Off the GPU the output says why the racy control cannot fail (it printed "0" unexplained)
    said = "the racy control cannot fail here" in capsys.readouterr().out
    assert said == (device.type != "cuda")


def test_stress_draws_and_checks_kv_without_copy_v(device):
    """Key/value trials also run without ``copy_v`` (the forward's other code path), clean."""
    import random

    import torch

    trials = [stress.draw_trial(random.Random(seed), small=True) for seed in range(200)]
    kv_trials = [t for t in trials if t.op == "kv"]
    assert {t.copy_v for t in kv_trials} == {True, False}
    trial = next(t for t in kv_trials if not t.copy_v)
    assert "copy_v=False" in stress.coverage_keys(trial)
    gen = torch.Generator(device=device).manual_seed(0)
    assert stress.run_kv_trial(trial, device, gen) == 0


def test_stress_catches_a_wrong_kernel(tmp_path, device, monkeypatch):
    """A launcher that leaves one rope element unrotated must be counted as failing."""
    real_q, real_kv = stress.rope_q_launch, stress.rope_kv_launch

    def broken_q(x, out, *args, **kwargs):
        real_q(x, out, *args, **kwargs)
        out[..., -1] = x[..., -1] * 1.5

    def broken_kv(kv, k_pe, k, v, *args, **kwargs):
        real_kv(kv, k_pe, k, v, *args, **kwargs)
        k[..., -1] = 7.0

    monkeypatch.setattr(stress, "rope_q_launch", broken_q)
    monkeypatch.setattr(stress, "rope_kv_launch", broken_kv)
    assert stress.run(_args(tmp_path, device, trials=4, control=0)) == 1
    summary = json.loads((tmp_path / "stress.json").read_text())
    assert summary["failed_trials"] == 4


@pytest.mark.gpu
def test_racy_control_is_caught_on_gpu(tmp_path, device):
    """The deliberately racy in-place kernel fails somewhere in the harness on the GPU; this is
    what shows that the harness can see races (ours never fails in the same harness)."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    failed = sum(
        stress.run_control_trial("cuda", gen, 1, 4, skew_steps=256, rope=128) > 0 for _ in range(50)
    )
    assert failed > 0, "the racy control never failed: the harness would not see a race"


def test_stress_stopped_early_exits_1(tmp_path, device):
    """A run cut short by ``--max-seconds`` did not do what was asked: exit code 1, and the
    summary counts only the trials that ran."""
    parser = argparse.ArgumentParser()
    stress.add_arguments(parser)
    args = parser.parse_args(
        ["--trials", "6", "--control-trials", "0", "--small", "--device", device.type,
         "--max-seconds", "1e-9", "--json", str(tmp_path / "stress.json")]
    )  # fmt: skip
    assert stress.run(args) == 1
    summary = json.loads((tmp_path / "stress.json").read_text())
    assert 0 < summary["trials"] < 6 and summary["failed_trials"] == 0
