"""The serving benchmark's bytes model and its harness end to end on the CPU (``--cpu-smoke``:
tiny shapes, host timers; the numbers mean nothing, the code paths run)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

# Imported before a test sets TRITON_INTERPRET=0 for the PyTorch backend: Triton decides at a
# kernel's import whether it runs interpreted.
import mlarope.kernels.q
import mlarope.kernels.serving
from mlarope.tools.bench import serving as bench

# 16,384 positions drawn uniformly from 32,768 rows: 32768 * (1 - (1 - 1/32768) ** 16384)
# distinct rows expected, read once each: cos and sin, fp32, 32 entries (pair tables) or 64
PREFILL_ROWS = 12893
PAIR_ROW, FULL_ROW = 2 * 32 * 4, 2 * 64 * 4


def test_bytes_model_deepseek_v3():
    dims = bench.Dims()
    t = 16384
    op = bench.OPS_BY_KEY
    table = PREFILL_ROWS * PAIR_ROW
    # read kv_c and k_pe (576 bf16), write the entry (576 of the cache's dtype)
    assert bench.bytes_moved(op["append_concat_bf16"], t, dims) == t * 576 * (2 + 2) + table
    assert bench.bytes_moved(op["append_split_fp8"], t, dims) == t * 576 * (2 + 1) + table
    assert bench.bytes_moved(op["append_fp8_656"], t, dims) == t * (576 * 2 + 656) + table
    # read q_nope and q_pe, write [T, H, 576] per token and head
    assert bench.bytes_moved(op["query_bf16"], t, dims) == t * 128 * 576 * (2 + 2) + table
    assert bench.bytes_moved(op["query_fp8_out"], t, dims) == t * 128 * 576 * (2 + 1) + table
    # full tables: twice the table bytes
    full = dataclasses.replace(dims, pair_tables=False)
    assert bench.table_bytes(op["append_concat_bf16"], t, full) == PREFILL_ROWS * FULL_ROW
    # a decode token's row is almost surely its own: T rows (up to rounding)
    assert bench.table_bytes(op["query_fp8"], 1, dims) == PAIR_ROW


def test_bytes_model_deepseek_v4():
    dims = bench.Dims()
    t = 16384
    op = bench.OPS_BY_KEY
    # read kv_c (448) and k_pe (64) in bf16, write 584 bytes (a 576-byte data row, 8 of scales)
    assert bench.bytes_moved(op["append_fp8_584"], t, dims) == (
        t * (512 * 2 + 584) + PREFILL_ROWS * PAIR_ROW
    )
    # read o [T, 128, 512] bf16, write the codes and one fp32 scale per 128 channels; pair
    # tables too (--tables full: the full ones)
    full = dataclasses.replace(dims, pair_tables=False)
    for key in ("output_fp8", "output_fp8_vllm"):
        data = t * 128 * (512 * 2 + 512 + 4 * 4)
        assert bench.bytes_moved(op[key], t, dims) == data + PREFILL_ROWS * PAIR_ROW
        assert bench.bytes_moved(op[key], t, full) == data + PREFILL_ROWS * FULL_ROW
    assert dims.heads // dims.heads_per_group == 16  # V4-Pro's o_groups


def _run(tmp_path, *argv):
    parser = __import__("argparse").ArgumentParser()
    bench.add_arguments(parser)
    code = bench.run(parser.parse_args(["--cpu-smoke", "--cpu-reps", "1", "--host-calls", "2",
                                        "--out", str(tmp_path), *argv]))  # fmt: skip
    assert code == 0
    data = json.loads((tmp_path / "serving.json").read_text())
    assert (tmp_path / "serving.md").read_text().startswith("serving bench")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["serving.json", "serving.md"]
    return data


def test_cpu_smoke_reference_backend(tmp_path, monkeypatch):
    """Every op and case through the harness (the PyTorch backend: fast): timed, compared with
    the unfused sequence, host times for the decode rows."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    data = _run(tmp_path, "--cases", "prefill,decode1")
    rows = data["rows"]
    assert len(rows) == 2 * len(bench.OPS)
    for row in rows:
        assert not row["error"], row
        assert row["ours_ms"] and row["unfused_ms"] > 0
        if row["case"] == "prefill":
            assert row["check"]["ok"], row
            assert row["same_bytes_copy_ms"] > 0
        else:
            assert row["host_us"] > 0 and row["torch_op_us"] > 0 and row["unfused_host_us"] > 0


@pytest.mark.cpu
def test_cpu_smoke_kernels_and_sweep(tmp_path):
    """The kernels (interpreter) through the harness, and the launch-configuration sweep."""
    ops = "append_fp8_656,query_fp8,append_fp8_584,output_fp8_vllm"
    data = _run(tmp_path, "--cases", "prefill", "--ops", ops, "--sweep")
    assert len(data["rows"]) == 4
    assert all(not r["error"] and r["check"]["ok"] for r in data["rows"]), data["rows"]
    variants = {(s["op"], s["variant"]) for s in data["sweep"]}
    assert ("append_fp8_656", "heuristic") in variants
    assert ("query_fp8", "heuristic, integer e4m3 encoder") in variants
    assert ("append_fp8_584", "heuristic, integer e4m3 encoder") in variants
    assert ("append_fp8_584", "heuristic, every position 0") in variants
    assert ("append_fp8_584", "heuristic, full tables") in variants
    assert ("output_fp8_vllm", "heuristic, integer e4m3 encoder") in variants
    assert any(op == "output_fp8_vllm" and "whole_row=True" in v for op, v in variants)
    assert not [s for s in data["sweep"] if "error" in s]


@pytest.mark.cpu
def test_cpu_smoke_decode_sweep(tmp_path):
    """``--sweep`` at a decode batch times the decode query's launch configurations."""
    data = _run(tmp_path, "--cases", "decode1", "--ops", "query_fp8", "--sweep", "--tables", "full")
    assert data["meta"]["dims"]["pair_tables"] == "False"
    variants = [s["variant"] for s in data["sweep"] if s["op"] == "query_fp8"]
    assert variants[:3] == [
        "decode1: heuristic", "decode1: heuristic, float scale",
        "decode1: heuristic, float scale, x * (1 / s)",
    ], variants  # fmt: skip
    assert len(variants) == 5, variants
    assert all(v.startswith("decode1: QueryConfig(") for v in variants[3:]), variants
    assert mlarope.kernels.serving.RECIPROCAL_QUOTIENT is False  # measurement only: reset
    assert not [s for s in data["sweep"] if "error" in s]


def test_dry_run_and_bad_options(capsys):
    parser = __import__("argparse").ArgumentParser()
    bench.add_arguments(parser)
    assert bench.run(parser.parse_args(["--dry-run", "--cases", "prefill"])) == 0
    assert "append_fp8_656" in capsys.readouterr().out
    assert bench.run(parser.parse_args(["--dry-run", "--cases", "prefil"])) == 2
    assert "unknown cases" in capsys.readouterr().out


@pytest.mark.gpu
def test_gpu_decode_host_path_is_the_plan():
    """On the GPU a repeated decode call takes its plan: the launch goes straight to the
    compiled kernel (no Triton binder), which is what the host-time target needs."""
    from mlarope._launch_cache import LAUNCH_CACHE, clear_launch_cache
    from mlarope.serving import _plans

    clear_launch_cache()
    dims = bench.Dims()
    gen = torch.Generator().manual_seed(0)
    cos, sin = __import__("mlarope").YarnConfig.deepseek_v3().cos_sin(dims.positions, device="cuda")
    op = bench.OPS_BY_KEY["append_fp8_656"]
    inp = bench.make_inputs(op, 1, dims, torch.device("cuda"), gen, prefill=False)
    call = bench.ours(op, inp, cos, sin, dims)
    call()
    call()
    (entries,) = LAUNCH_CACHE.plans.values()
    plan = entries[0][1]
    assert plan.__class__ is _plans.Plan and plan.launch.kernel is not None
