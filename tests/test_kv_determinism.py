"""The key/value op is deterministic: every launch configuration gives the same bits, and so do
repeated runs (``tests/kv_harness.py``).

Under the interpreter the cases are small and the configurations a pairwise-covering subset;
the GPU lane scales the cases to DeepSeek-V3 widths and many heads (:func:`scaled_for`) and
tries every tiling, where a configuration-dependent race or reduction order would show.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from mlarope.kernels.kv import KVLaunchConfig, choose_kv_backward_config, choose_kv_config
from tests.harness import bitwise_equal
from tests.kv_harness import (
    Case,
    case_id,
    check_backward,
    check_forward,
    host_checked,
    launch_backward,
    launch_forward,
    make_inputs,
    make_upstream_grads,
)


def launch_configs(device, n_tokens: int, heads: int, widths: tuple[int, int, int]):
    """The heuristics' picks for this shape and for other shapes, and a covering set of tilings.

    On the GPU every combination of ``block_t`` x ``block_h`` x ``block_c`` x ``num_warps``;
    under the interpreter (which ignores ``num_warps``) a pairwise-covering subset.
    """
    k_dim, v_dim, rope = widths
    picks = {
        choose_kv_config(n_tokens, heads, max(k_dim, v_dim, rope)),
        choose_kv_backward_config(n_tokens, heads, max(k_dim, v_dim), rope),
        choose_kv_config(1, 1, 16),
        choose_kv_backward_config(4096, 128, 512, 64),
        choose_kv_config(4096, 128, 512),
    }
    grid = itertools.product((1, 2, 4), (1, 2, 4, 16), (16, 32, 128), (1, 4))
    if device.type != "cuda":
        # Every (block_t, block_h), (block_h, block_c) and (block_t, block_c) pair at least once.
        grid = [
            (1, 1, 16, 1),
            (1, 2, 32, 4),
            (1, 4, 128, 1),
            (1, 16, 16, 4),
            (2, 1, 32, 4),
            (2, 2, 128, 1),
            (2, 4, 16, 4),
            (2, 16, 128, 1),
            (4, 1, 128, 4),
            (4, 2, 16, 1),
            (4, 4, 32, 4),
            (4, 16, 32, 1),
        ]
    return sorted(picks, key=repr) + [KVLaunchConfig(*c) for c in grid]


# Small enough for the interpreter (every config re-launches both kernels, down to one token
# and one head per program); the GPU lane scales them up (see ``scaled_for``).
CU_SMALL = (0, 0, 3, 4, 4, 6)  # empty, 3 tokens, 1 token, empty, 2 tokens; then 2 padding tokens
CU_BIG = (0, 0, 1, 38, 38, 538, 539, 1537, 2000)  # GPU lane: 8 sequences, 10 padding tokens
CONFIG_CASES = [
    Case(layout="thd", tokens=(8,), source="cu", cu=CU_SMALL, heads=3, k_dim=40, v_dim=24),
    # Two head-sum chunks, the second mostly missing heads; head blocks that divide 20 and
    # that leave a partial block; an odd token count.
    Case(layout="thd", tokens=(9,), source="cu", cu=CU_SMALL, heads=20, k_dim=40, v_dim=24),
    # Without copy_v the forward loads its first channel block early and copies the rest
    # (k_dim 40 > block_c 16 or 32) after the rotation.
    Case(
        layout="thd",
        tokens=(8,),
        source="cu",
        cu=CU_SMALL,
        heads=3,
        k_dim=40,
        v_dim=24,
        copy_v=False,
    ),
    Case(
        layout="sbhd",
        tokens=(4, 2),
        heads=3,
        k_dim=16,
        v_dim=40,
        dtype=torch.float16,
        interleaved=False,
        interleaved_out=True,
        cp_size=2,
        cp_rank=1,
        table_rows=16,
    ),
]


def scaled_for(case: Case, device) -> Case:
    """On the GPU, the same case at a realistic size (DeepSeek-V3 widths, many heads), where a
    config-dependent race or reduction order would show; unchanged under the interpreter. thd
    cases keep their head count modulo 16, so a partial head-sum chunk stays partial."""
    if device.type != "cuda":
        return case
    if case.layout == "thd":
        return replace(
            case,
            tokens=(CU_BIG[-1] + 10,),
            cu=CU_BIG,
            heads=128 + case.heads % 16,
            k_dim=128,
            v_dim=128,
            table_rows=2048,
        )
    return replace(case, tokens=(256, 4), heads=16, k_dim=128, v_dim=128, table_rows=512)


@pytest.mark.parametrize("case", CONFIG_CASES, ids=case_id)
def test_identical_for_every_launch_config(case, device):
    case = scaled_for(case, device)
    inp = make_inputs(case, device)
    kv, k_pe, cos2d, sin2d, positions = host_checked(inp, case)
    dk, dv, _ = make_upstream_grads(kv, case)
    n_tokens = kv.shape[0] * (kv.shape[1] if kv.dim() == 4 else 1)
    configs = launch_configs(device, n_tokens, case.heads, (case.k_dim, case.v_dim, case.rope))
    first = None
    for config in configs:
        k, v = launch_forward(kv, k_pe, cos2d, sin2d, positions, case, config=config)
        dkv, dk_pe = launch_backward(dk, dv, cos2d, sin2d, positions, case, config=config)
        if first is None:
            first = (k, v, dkv, dk_pe)
            check_forward(kv, k_pe, k, v, cos2d, sin2d, positions, case)
            check_backward(dk, dv, dkv, dk_pe, cos2d, sin2d, positions, case)
            continue
        for name, got, want in zip(
            ("k", "v", "dkv", "dk_pe"), (k, v, dkv, dk_pe), first, strict=True
        ):
            if want is None:  # v without copy_v
                assert got is None
                continue
            assert bitwise_equal(got, want), f"{name} differs with {config} vs {configs[0]}"


def test_dk_pe_bitwise_repeatable(device):
    """20 backward runs give the same bits (no atomics: the head sum has a fixed order)."""
    case = Case(layout="thd", tokens=(8,), source="cu", cu=CU_SMALL, heads=16, k_dim=16, v_dim=16)
    case = scaled_for(case, device)
    inp = make_inputs(case, device)
    kv, _, cos2d, sin2d, positions = host_checked(inp, case)
    dk, dv, _ = make_upstream_grads(kv, case)
    dkv0, dk_pe0 = launch_backward(dk, dv, cos2d, sin2d, positions, case)
    check_backward(dk, dv, dkv0, dk_pe0, cos2d, sin2d, positions, case)
    for run in range(19):
        dkv, dk_pe = launch_backward(dk, dv, cos2d, sin2d, positions, case)
        assert bitwise_equal(dk_pe, dk_pe0), f"dk_pe differs on run {run + 1}"
        assert bitwise_equal(dkv, dkv0), f"dkv differs on run {run + 1}"
