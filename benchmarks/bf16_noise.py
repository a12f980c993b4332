"""Where a family's bf16 test statistic comes from: per-tensor deviations from the fp64 run.

    python -m benchmarks.bf16_noise [DEVICE] [FAMILY] [--seeds N]

For a tiny model of ``FAMILY`` (default ``deepseek_v4``) in bf16 on ``DEVICE`` (default
``cuda``), built as the families' tests build it (``tests/families_harness.py``), prints per
seed:

- ``G`` (the test's aggregate: the root-sum-square of the relative deviations from the fp64 run,
  patched over unpatched) of the patched run, the fused reference's (the PyTorch backend
  computing the kernels' fused products) and the rounding emulation's;
- whether the kernels equal the fused reference bit for bit, and the worst per-tensor ratio;
- the six tensors the patched run deviates most on, with each run's relative deviation.

How the tenth session found that ``deepseek_v4``'s bf16 ``G`` on the H200 (3.95) was its router
gate's gradient alone, zero in exact arithmetic (docs/perf_log.md v15). Developer tooling: it
imports the tests' harness, so it runs from the repository root.
"""

from __future__ import annotations

import argparse
import copy

import pytest
import torch

from mlarope.integrations import transformers as mt
from tests import families_harness as families
from tests.harness import fused_reference, reference_backend


def relative(run: dict, truth: dict, key: str) -> float:
    norm = float(truth[key].double().norm())
    return float((run[key].double() - truth[key].double()).norm()) / norm


def diagnose(family: str, device: torch.device, seed: int, monkeypatch) -> None:
    model = families.tiny_model(families.REPORT[family], torch.bfloat16, device, seed=seed)
    model64 = copy.deepcopy(model).double()
    ids = families.token_ids(8, device)
    unpatched = families.run(model, ids)
    truth = families.run(model64, ids)
    nearest = families.run_emulated(monkeypatch, family, lambda: families.run(model, ids))
    with monkeypatch.context() as m:
        reference_backend(m, device)
        fused_reference(m)
        with mt.mlarope_patched(family, model=model):
            fused = families.run(model, ids)
    with mt.mlarope_patched(family, model=model):
        patched = families.run(model, ids)
    same = all(torch.equal(patched[k], fused[k]) for k in patched)
    ratios, g = families.bf16_ratios(patched, (unpatched, nearest), truth)
    _, g_fused = families.bf16_ratios(fused, (unpatched, nearest), truth)
    _, g_nearest = families.bf16_ratios(nearest, (unpatched,), truth)
    print(
        f"seed {seed}: G patched {g:.2f}, fused {g_fused:.2f}, nearest {g_nearest:.2f}; "
        f"patched == fused bit for bit: {same}; worst per-tensor ratio {max(ratios.values()):.2f}"
    )
    keys = [k for k in truth if float(truth[k].double().norm()) > 0]
    keys.sort(key=lambda k: -relative(patched, truth, k))
    for k in keys[:6]:
        print(
            f"   {k:60s} n={truth[k].numel():7d} relative deviation: patched "
            f"{relative(patched, truth, k):.3e}, unpatched {relative(unpatched, truth, k):.3e}, "
            f"nearest {relative(nearest, truth, k):.3e}, fused {relative(fused, truth, k):.3e}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("device", nargs="?", default="cuda")
    parser.add_argument("family", nargs="?", default="deepseek_v4")
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.family not in families.REPORT:
        parser.error(f"family {args.family!r} is not one of {sorted(families.REPORT)}")
    monkeypatch = pytest.MonkeyPatch()
    try:
        for seed in range(args.seeds):
            diagnose(args.family, torch.device(args.device), seed, monkeypatch)
    finally:
        monkeypatch.undo()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
