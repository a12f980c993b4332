"""The GPU lane's launch-configuration sweep (``benchmarks/sweep.py``): its bytes model against
the benchmark's, its exit without CUDA, and its ceiling kernels and search tilings on the lane's
device (the timings themselves come from the GPU lane)."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks import sweep
from mlarope.tools.bench.model import MlaDims, bytes_moved

# The sweep's ops as the benchmark's bytes_moved arguments: (op, direction, inplace, copy_v).
SWEEP_OPS = {
    "q_inplace": ("q", "fwd", True, True),
    "q": ("q", "fwd", False, True),
    "kv": ("kv", "fwd", False, True),
    "kv_no_v": ("kv", "fwd", False, False),
    "kv_bwd": ("kv", "bwd", False, True),
}


@pytest.mark.parametrize("op", list(SWEEP_OPS))
def test_sweep_bytes_match_bench_model(op):
    """The sweep reports TB/s from its own bytes model (``_bytes``); it must be the benchmark's
    ``bytes_moved`` at the sweep's shapes (DeepSeek-V3 widths, ``TOKENS`` tokens in
    every case), or the sweep's and the benchmark's percentages of copy disagree."""
    assert set(sweep.OPS) == set(SWEEP_OPS)
    dims = MlaDims(sweep.HEADS, sweep.NOPE, sweep.ROPE, sweep.K_DIM, sweep.V_DIM, elem_bytes=2)
    assert dims == MlaDims.deepseek_v3()
    for case in sweep.CASES:
        _, tokens = sweep._positions(case, "cpu")
        assert math.prod(tokens) == sweep.TOKENS, f"case {case} is not TOKENS tokens"
    kind, direction, inplace, copy_v = SWEEP_OPS[op]
    want = bytes_moved(
        kind, direction, tokens=sweep.TOKENS, dims=dims, inplace=inplace, copy_v=copy_v
    )
    assert sweep._bytes(op) == want


def test_sweep_without_cuda_exits_2(monkeypatch, capsys):
    """``python benchmarks/sweep.py`` on a machine without CUDA exits 2 with a message saying so
    (after parsing its arguments, before touching a device). CUDA is hidden with monkeypatch,
    so this runs in both lanes."""
    monkeypatch.setattr(sweep.torch.cuda, "is_available", lambda: False)
    assert sweep.main(["--ops", "kv", "--cases", "sbhd", "--heuristic-only"]) == 2
    captured = capsys.readouterr()
    assert "needs a CUDA device" in captured.err and captured.out == ""
    with pytest.raises(SystemExit) as exit_info:  # bad usage is argparse's exit 2, as usual
        sweep.main(["--no-such-option"])
    assert exit_info.value.code == 2


def test_sweep_kv_pattern_copy_moves_the_kv_ops_elements(device):
    """The sweep's key/value ceiling kernel copies exactly what the key/value forward without
    copy_v writes, minus the rotation: ``k[..., :K] = kv[..., :K]``, ``k[..., K:] = k_pe``."""
    kv = torch.randn(5, 3, 16 + 8, device=device)
    k_pe = torch.randn(5, 32, device=device)
    k = torch.full((5, 3, 16 + 32), float("nan"), device=device)
    sweep.kv_pattern_copy(kv, k_pe, k, block_r=4, num_warps=1)
    assert torch.equal(k[..., :16], kv[..., :16])
    assert torch.equal(k[..., 16:], k_pe[:, None, :].expand(5, 3, 32))


def test_sweep_kv_bwd_pattern_copy_moves_the_kv_backwards_rows(device):
    """The sweep's key/value backward ceiling kernel writes ``dkv = [dk[:, :K], dv]``, leaves
    ``dk`` unchanged and uses its rope channels (their sum per row block), so the compiler
    cannot drop their loads."""
    dk = torch.randn(7, 16 + 32, device=device)
    dv = torch.randn(7, 8, device=device)
    dk_before = dk.clone()
    dkv = torch.full((7, 16 + 8), float("nan"), device=device)
    sums = sweep.kv_bwd_pattern_copy(dk, dv, dkv, rope=32, block_r=4, num_warps=1)
    assert torch.equal(dkv, torch.cat([dk[:, :16], dv], dim=-1))
    assert torch.equal(dk, dk_before)
    want = torch.stack([dk[:4, 16:].sum(0), dk[4:, 16:].sum(0)])
    torch.testing.assert_close(sums, want, rtol=1e-6, atol=1e-6)


def test_sweep_search_configs_find_the_launch_paths_positions(device):
    """Every search tiling the sweep times gives the launch path's positions (``search_call``
    raises otherwise), padding and empty sequences included."""
    cu = torch.tensor([0, 3, 3, 10, 40, 41], dtype=torch.int32, device=device)
    for block, warps in sweep.SEARCH_CONFIGS:
        sweep.search_call(cu, 45, block, warps)()


def test_sweep_hinted_slice_copy_moves_exactly_the_slice(device):
    """Each cache-hint variant the sweep times copies ``x[:, N:]`` and nothing else."""
    import triton

    assert len(sweep.ONTO_ITSELF_HINTS) == 8
    src = torch.randn(40, 48, device=device).to(torch.bfloat16)
    for _name, *hints in sweep.ONTO_ITSELF_HINTS:
        dst = torch.zeros_like(src)
        sweep._copy_row_slices[(triton.cdiv(40, 16),)](
            src, dst, 40, src.stride(0), 16, 16, 32, *hints, num_warps=1
        )
        assert torch.equal(dst[:, 16:], src[:, 16:]) and not dst[:, :16].any()
