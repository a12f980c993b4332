# ruff: noqa: B023, F821  (closures are called within the loop iteration that made them)
"""Exploration of the key/value kernels' variants on the GPU (not part of the package).

Times, in one process at DeepSeek-V3 shapes (16,384 tokens, H = 128, K = V = 128, R = 64,
bf16), the kernels on main against variants, after checking that every variant's outputs are
bitwise equal to main's:

- fwd ``loads_first``: the tile's ``kv`` loads issued before the position / table / rotation
  chain (main issues them after the rope stores);
- bwd ``head_major``: main's backward with a 1-D grid whose head blocks of one token are
  adjacent in launch order (main: token blocks fastest, so the first head block's long
  programs, which read every head's rope slice, all run first);
- bwd ``token``: one program per token block, looping over 16-head chunks: it copies the
  chunk and adds its rope slice to the head sum in the same iteration (no imbalance, every
  row read in one pass).

Also the access-pattern ceilings (contiguous copy; the forward's bytes without copy_v; the
backward's row copies). ``--ncu`` runs each kernel once, for Nsight Compute.

    PYTHONPATH=src python3 scripts/kv_explore.py [--ncu] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

from mlarope._checks import Positions
from mlarope.kernels._lookup import (
    VARYING_INTS,
    load_table_halves,
    position_args,
    rotate,
    token_positions,
)
from mlarope.kernels.kv import (
    _halve_heads,
    _sum_heads,
    rope_kv_backward_launch,
    rope_kv_launch,
)
from mlarope.kernels.q import cdiv, geometry
from mlarope.sweep import kv_pattern_copy
from mlarope.yarn import YarnConfig

T = int(os.environ.get("KV_EXPLORE_TOKENS", 16384))
H, K, V, R = 128, 128, 128, 64


@triton.jit(do_not_specialize=VARYING_INTS)
def _fwd_loads_first(
    kv_ptr, kpe_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr,
    n_tokens, D1, n_heads, k_dim, v_dim, n_rows,
    stride_kv0, stride_kv1, stride_kvh, stride_pe0, stride_pe1,
    stride_k0, stride_k1, stride_kh, stride_v0, stride_v1, stride_vh, stride_table,
    ids_ptr, stride_id0, stride_id1, n_seqs, cp_rank, cp_size,
    POS_MODE: tl.constexpr, HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_C: tl.constexpr, COPY_V: tl.constexpr,
):  # fmt: skip
    """Half-split layouts, K and V <= BLOCK_C."""
    i_t = tl.program_id(0)
    i_h = tl.program_id(1)
    o_t = i_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    o_h = (i_h * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    m_t = o_t < n_tokens
    m_h = o_h < n_heads
    i0 = o_t // D1
    i1 = o_t % D1
    kv_row = (i0 * stride_kv0 + i1 * stride_kv1)[:, None, None] + (o_h * stride_kvh)[None, :, None]
    k_row = (i0 * stride_k0 + i1 * stride_k1)[:, None, None] + (o_h * stride_kh)[None, :, None]
    m_row = m_t[:, None, None] & m_h[None, :, None]
    c = tl.arange(0, BLOCK_C)[None, None, :]
    m_k = m_row & (c < k_dim)
    k_blk = tl.load(kv_ptr + kv_row + c, mask=m_k)
    if COPY_V:
        m_v = m_row & (c < v_dim)
        v_blk = tl.load(kv_ptr + kv_row + k_dim + c, mask=m_v)
    pos, is_padding = token_positions(
        o_t, i0, i1, m_t, ids_ptr, stride_id0, stride_id1, n_seqs, cp_rank, cp_size, POS_MODE,
    )  # fmt: skip
    in_range = (pos >= 0) & (pos < n_rows)
    j = tl.arange(0, HALF)
    c_a, c_b, s_a, s_b = load_table_halves(
        cos_ptr, sin_ptr, pos, m_t & in_range & ~is_padding, stride_table, j, HALF
    )
    pe_row = (i0 * stride_pe0 + i1 * stride_pe1)[:, None]
    k2 = tl.arange(0, 2 * HALF)[None, :]
    x = tl.load(kpe_ptr + pe_row + k2, mask=m_t[:, None] & (k2 < 2 * HALF), other=0.0)
    a, b = tl.split(tl.reshape(x.to(tl.float32), (BLOCK_T, HALF, 2)))
    out_a, out_b = rotate(
        a, b, c_a, c_b, s_a, s_b, is_padding[:, None], (~in_range & ~is_padding)[:, None],
        False, False,
    )  # fmt: skip
    out_a = out_a.to(k_ptr.dtype.element_ty)
    out_b = out_b.to(k_ptr.dtype.element_ty)
    jj = j[None, None, :]
    m_pair = m_row & (jj < HALF)
    k_a = tl.broadcast_to(out_a[:, None, :], (BLOCK_T, BLOCK_H, HALF))
    tl.store(k_ptr + k_row + k_dim + jj, k_a, mask=m_pair)
    tl.store(k_ptr + k_row + k_dim + HALF + jj,
             tl.broadcast_to(out_b[:, None, :], (BLOCK_T, BLOCK_H, HALF)), mask=m_pair)  # fmt: skip
    tl.store(k_ptr + k_row + c, k_blk, mask=m_k)
    if COPY_V:
        v_row = (i0 * stride_v0 + i1 * stride_v1)[:, None, None] + (o_h * stride_vh)[None, :, None]
        tl.store(v_ptr + v_row + c, v_blk, mask=m_v)


@triton.jit
def _bwd_tail(dk_ptr, dpe_ptr, cos_ptr, sin_ptr, total, o_t, i0, i1, m_t, n_rows, stride_table,
              ids_ptr, stride_id0, stride_id1, n_seqs, cp_rank, cp_size, POS_MODE: tl.constexpr,
              HALF: tl.constexpr, BLOCK_T: tl.constexpr):  # fmt: skip
    """Rotate the head sum and store dk_pe (interleaved in, half-split out)."""
    pos, is_padding = token_positions(
        o_t, i0, i1, m_t, ids_ptr, stride_id0, stride_id1, n_seqs, cp_rank, cp_size, POS_MODE,
    )  # fmt: skip
    in_range = (pos >= 0) & (pos < n_rows)
    j = tl.arange(0, HALF)
    c_a, c_b, s_a, s_b = load_table_halves(
        cos_ptr, sin_ptr, pos, m_t & in_range & ~is_padding, stride_table, j, HALF
    )
    g_a, g_b = tl.split(tl.permute(tl.reshape(total, (BLOCK_T, 2, HALF)), (0, 2, 1)))
    d_a, d_b = rotate(
        g_a, g_b, c_a, c_b, s_a, s_b, is_padding[:, None], (~in_range & ~is_padding)[:, None],
        False, True,
    )  # fmt: skip
    r = tl.arange(0, 2 * HALF)[None, :]
    pairs = tl.reshape(tl.join(d_a.to(dpe_ptr.dtype.element_ty), d_b.to(dpe_ptr.dtype.element_ty)),
                       (BLOCK_T, 2 * HALF))  # fmt: skip
    tl.store(dpe_ptr + o_t[:, None] * (2 * HALF) + r, pairs, mask=m_t[:, None] & (r < 2 * HALF))


@triton.jit(do_not_specialize=VARYING_INTS)
def _bwd_head_major(
    dk_ptr, dv_ptr, dkv_ptr, dpe_ptr, cos_ptr, sin_ptr,
    n_tokens, D1, n_heads, k_dim, v_dim, n_rows, n_head_blocks,
    stride_dk0, stride_dk1, stride_dkh, stride_dv0, stride_dv1, stride_dvh,
    stride_dkv0, stride_dkv1, stride_dkvh, stride_table,
    ids_ptr, stride_id0, stride_id1, n_seqs, cp_rank, cp_size,
    POS_MODE: tl.constexpr, HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_C: tl.constexpr, HEADS_PADDED: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    i_h = pid % n_head_blocks
    i_t = pid // n_head_blocks
    o_t = i_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    o_h = (i_h * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    m_t = o_t < n_tokens
    m_h = o_h < n_heads
    i0 = o_t // D1
    i1 = o_t % D1
    dk_tok = i0 * stride_dk0 + i1 * stride_dk1
    dk_row = dk_tok[:, None, None] + (o_h * stride_dkh)[None, :, None]
    dv_row = (i0 * stride_dv0 + i1 * stride_dv1)[:, None, None] + (o_h * stride_dvh)[None, :, None]
    dkv_row = (i0 * stride_dkv0 + i1 * stride_dkv1)[:, None, None] + (o_h * stride_dkvh)[
        None, :, None
    ]
    m_row = m_t[:, None, None] & m_h[None, :, None]
    n_copy = tl.maximum(k_dim, v_dim)
    for c0 in range(0, n_copy, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)[None, None, :]
        m_k = m_row & (c < k_dim)
        m_v = m_row & (c < v_dim)
        k_blk = tl.load(dk_ptr + dk_row + c, mask=m_k)
        v_blk = tl.load(dv_ptr + dv_row + c, mask=m_v)
        tl.store(dkv_ptr + dkv_row + c, k_blk, mask=m_k)
        tl.store(dkv_ptr + dkv_row + k_dim + c, v_blk, mask=m_v)
    if i_h == 0:
        total = _sum_heads(
            dk_ptr, dk_tok, m_t, stride_dkh, n_heads, k_dim, BLOCK_T, HEADS_PADDED, 2 * HALF
        )
        _bwd_tail(dk_ptr, dpe_ptr, cos_ptr, sin_ptr, total, o_t, i0, i1, m_t, n_rows,
                  stride_table, ids_ptr, stride_id0, stride_id1, n_seqs, cp_rank, cp_size,
                  POS_MODE, HALF, BLOCK_T)  # fmt: skip


@triton.jit(do_not_specialize=VARYING_INTS)
def _bwd_token(
    dk_ptr, dv_ptr, dkv_ptr, dpe_ptr, cos_ptr, sin_ptr,
    n_tokens, D1, n_heads, k_dim, v_dim, n_rows,
    stride_dk0, stride_dk1, stride_dkh, stride_dv0, stride_dv1, stride_dvh,
    stride_dkv0, stride_dkv1, stride_dkvh, stride_table,
    ids_ptr, stride_id0, stride_id1, n_seqs, cp_rank, cp_size,
    POS_MODE: tl.constexpr, HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    i_t = tl.program_id(0)
    o_t = i_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    m_t = o_t < n_tokens
    i0 = o_t // D1
    i1 = o_t % D1
    dk_tok = i0 * stride_dk0 + i1 * stride_dk1
    dv_tok = i0 * stride_dv0 + i1 * stride_dv1
    dkv_tok = i0 * stride_dkv0 + i1 * stride_dkv1
    RR: tl.constexpr = 2 * HALF
    r = tl.arange(0, RR)[None, None, :]
    negative_zero = tl.full((BLOCK_T, RR), -(2**31), tl.int32).to(tl.float32, bitcast=True)
    total = negative_zero
    neg16 = tl.full((BLOCK_T, 16, RR), -(2**31), tl.int32).to(tl.float32, bitcast=True)
    n_copy = tl.maximum(k_dim, v_dim)
    for h0 in range(0, n_heads, 16):
        h = (h0 + tl.arange(0, 16)).to(tl.int64)
        m_row = m_t[:, None, None] & (h < n_heads)[None, :, None]
        dk_row = dk_tok[:, None, None] + (h * stride_dkh)[None, :, None]
        dv_row = dv_tok[:, None, None] + (h * stride_dvh)[None, :, None]
        dkv_row = dkv_tok[:, None, None] + (h * stride_dkvh)[None, :, None]
        m_r = m_row & (r < RR)
        g = tl.load(dk_ptr + dk_row + k_dim + r, mask=m_r, other=0.0).to(tl.float32)
        for c0 in range(0, n_copy, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)[None, None, :]
            m_k = m_row & (c < k_dim)
            m_v = m_row & (c < v_dim)
            k_blk = tl.load(dk_ptr + dk_row + c, mask=m_k)
            v_blk = tl.load(dv_ptr + dv_row + c, mask=m_v)
            tl.store(dkv_ptr + dkv_row + c, k_blk, mask=m_k)
            tl.store(dkv_ptr + dkv_row + k_dim + c, v_blk, mask=m_v)
        g = tl.where(m_r, g, neg16)
        g = _halve_heads(g, BLOCK_T, 16, RR)
        g = _halve_heads(g, BLOCK_T, 8, RR)
        g = _halve_heads(g, BLOCK_T, 4, RR)
        g = tl.reshape(_halve_heads(g, BLOCK_T, 2, RR), (BLOCK_T, RR))
        total = total + g
    _bwd_tail(dk_ptr, dpe_ptr, cos_ptr, sin_ptr, total, o_t, i0, i1, m_t, n_rows, stride_table,
              ids_ptr, stride_id0, stride_id1, n_seqs, cp_rank, cp_size, POS_MODE, HALF,
              BLOCK_T)  # fmt: skip


@triton.jit
def _copy_bwd_pattern(dk_ptr, dv_ptr, dkv_ptr, n_rows, K: tl.constexpr, V: tl.constexpr,
                      R: tl.constexpr, BLOCK_R: tl.constexpr):  # fmt: skip
    """The backward's row bytes, copies only: dk rows read whole, dv rows, dkv rows written."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    m = (rows < n_rows)[:, None]
    c = tl.arange(0, K)[None, :]
    j = tl.arange(0, R)[None, :]
    k_blk = tl.load(dk_ptr + rows[:, None] * (K + R) + c, mask=m)
    pe = tl.load(dk_ptr + rows[:, None] * (K + R) + K + j, mask=m)
    v_blk = tl.load(dv_ptr + rows[:, None] * V + c, mask=m)
    tl.store(dkv_ptr + rows[:, None] * (K + V) + c, k_blk, mask=m)
    tl.store(dkv_ptr + rows[:, None] * (K + V) + K + c, v_blk, mask=m)
    tl.store(dk_ptr + rows[:, None] * 0 + j, pe, mask=m & (rows[:, None] < 0))  # keep pe live


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100) * 1e3


def positions(case: str, device) -> tuple[Positions, tuple[int, ...]]:
    if case == "sbhd":
        return Positions("sbhd", None, None, 0, 1), (T // 4, 4)
    n = int(case[3:])
    cu = torch.arange(0, T + 1, T // n, dtype=torch.int32, device=device)
    return Positions("thd", cu, None, 0, 1), (T,)


FWD_BYTES = {True: T * (H * ((K + V) * 2 + (K + R + V) * 2) + R * 2),
             False: T * (H * (K * 2 + (K + R) * 2) + R * 2)}  # fmt: skip
BWD_BYTES = T * (H * ((K + R + V) * 2 + (K + V) * 2) + R * 2)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ncu", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--cases", default="sbhd,thd4096")
    parser.add_argument("--check-only", action="store_true", help="CPU interpreter: no timing")
    args = parser.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cos, sin = YarnConfig.deepseek_v3().cos_sin(32768, device=dev)
    bf16 = dict(dtype=torch.bfloat16, device=dev)
    out: dict = {"rows": []}

    def timed(name, case, fn, nbytes, ref_ms=None):
        if args.ncu or args.check_only:
            fn()
            sync()
            print(f"ran {name} {case}", flush=True)
            return
        us = bench(fn)
        copy = out["copy_tbps"]
        tbps = nbytes / (us * 1e-6) / 1e12
        row = dict(name=name, case=case, us=round(us, 1), pct=round(100 * tbps / copy, 1))
        out["rows"].append(row)
        print(f"{name:40s} {case:8s} {us:8.1f} us {100 * tbps / copy:5.1f} %", flush=True)

    if not (args.ncu or args.check_only):
        src = torch.empty(1 << 29, **bf16).normal_()
        dst = torch.empty_like(src)
        out["copy_tbps"] = 2 * src.numel() * 2 / (bench(lambda: dst.copy_(src)) * 1e-6) / 1e12
        print(f"copy {out['copy_tbps']:.3f} TB/s")
        del src, dst
    # Ceilings.
    kv = torch.randn(T, H, K + V, **bf16)
    k_pe = torch.randn(T, R, **bf16)
    k = torch.empty(T, H, K + R, **bf16)
    for block_r, warps in ((128, 8), (64, 4)):
        fn = lambda b=block_r, w=warps: kv_pattern_copy(kv, k_pe, k, b, w)
        timed(f"pattern kv_no_v [{block_r}x{warps}w]", "-", fn, FWD_BYTES[False])
    dk = torch.randn(T, H, K + R, **bf16)
    dv = torch.randn(T, H, V, **bf16)
    dkv = torch.empty(T, H, K + V, **bf16)
    for block_r, warps in ((64, 8), (32, 4), (16, 2)):
        timed(f"pattern kv_bwd [{block_r}x{warps}w]", "-",
              lambda b=block_r, w=warps: _copy_bwd_pattern[(cdiv(T * H, b),)](
                  dk, dv, dkv, T * H, K=K, V=V, R=R, BLOCK_R=b, num_warps=w),
              BWD_BYTES)  # fmt: skip
    del kv, k_pe, k, dk, dv, dkv

    for case in args.cases.split(","):
        pos, tokens = positions(case, dev)
        kv = torch.randn(*tokens, H, K + V, **bf16)
        k_pe = torch.randn(*tokens, R, **bf16)
        for copy_v in (False, True):
            k_main = torch.empty(*tokens, H, K + R, **bf16)
            v_main = torch.empty(*tokens, H, V, **bf16) if copy_v else None

            def main_fwd(k_main=k_main, v_main=v_main):
                rope_kv_launch(kv, k_pe, k_main, v_main, cos, sin, pos, k_dim=K,
                               interleaved_in=True, interleaved_out=False)  # fmt: skip

            main_fwd()
            timed(f"fwd main copy_v={copy_v}", case, main_fwd, FWD_BYTES[copy_v])
            d0, d1, n_heads, _, skv0, skv1, skvh = geometry(kv)
            _, _, _, _, sk0, sk1, skh = geometry(k_main)
            pe_s = k_pe.stride()
            spe0, spe1 = (pe_s[0], 0) if k_pe.dim() == 2 else pe_s[:2]
            pos_mode, pos_args = position_args(pos, kv, (d0, d1))
            for bt, bh, warps in ((1, 128, 8), (1, 128, 16), (2, 64, 8), (1, 64, 4), (1, 32, 2)):
                k_new = torch.empty_like(k_main)
                v_new = torch.empty_like(v_main) if copy_v else k_new
                sv = geometry(v_new)[4:] if copy_v else (0, 0, 0)

                def var_fwd(k_new=k_new, v_new=v_new, sv=sv, bt=bt, bh=bh, warps=warps):
                    _fwd_loads_first[(cdiv(d0 * d1, bt), cdiv(n_heads, bh))](
                        kv, k_pe, k_new, v_new, cos, sin, d0 * d1, d1, n_heads, K, V,
                        cos.shape[0], skv0, skv1, skvh, spe0, spe1, sk0, sk1, skh, *sv,
                        cos.stride(0), *pos_args, POS_MODE=pos_mode, HALF=R // 2, BLOCK_T=bt,
                        BLOCK_H=bh, BLOCK_C=128, COPY_V=copy_v, num_warps=warps,
                    )  # fmt: skip

                var_fwd()
                sync()
                ok = torch.equal(k_new, k_main) and (not copy_v or torch.equal(v_new, v_main))
                if not ok:
                    print(f"fwd loads_first {bt, bh, warps} copy_v={copy_v}: WRONG")
                    continue
                timed(f"fwd loads_first ({bt},{bh},{warps}) copy_v={copy_v}", case, var_fwd,
                      FWD_BYTES[copy_v])  # fmt: skip
            del k_main, v_main
        del kv, k_pe

        dk = torch.randn(*tokens, H, K + R, **bf16)
        dv = torch.randn(*tokens, H, V, **bf16)
        dkv_main = torch.empty(*tokens, H, K + V, **bf16)
        dpe_main = torch.empty(*tokens, R, **bf16)

        def main_bwd():
            rope_kv_backward_launch(dk, dv, dkv_main, dpe_main, cos, sin, pos, k_dim=K,
                                    interleaved_in=True, interleaved_out=False)  # fmt: skip

        main_bwd()
        timed("bwd main", case, main_bwd, BWD_BYTES)
        d0, d1, n_heads, _, sdk0, sdk1, sdkh = geometry(dk)
        sdv = geometry(dv)[4:]
        sdkv = geometry(dkv_main)[4:]
        pos_mode, pos_args = position_args(pos, dk, (d0, d1))
        n_tok = d0 * d1
        common = (n_tok, d1, n_heads, K, V, cos.shape[0])
        strides = (sdk0, sdk1, sdkh, *sdv, *sdkv, cos.stride(0), *pos_args)
        variants = []
        for bt, bh, warps in ((1, 8, 1), (1, 16, 2), (1, 32, 4), (1, 16, 1)):
            nhb = cdiv(n_heads, bh)

            def hm(dkv_new, dpe_new, bt=bt, bh=bh, warps=warps, nhb=nhb):
                _bwd_head_major[(cdiv(n_tok, bt) * nhb,)](
                    dk, dv, dkv_new, dpe_new, cos, sin, *common[:6], nhb, *strides,
                    POS_MODE=pos_mode, HALF=R // 2, BLOCK_T=bt, BLOCK_H=bh, BLOCK_C=128,
                    HEADS_PADDED=128, num_warps=warps,
                )  # fmt: skip

            variants.append((f"bwd head_major ({bt},{bh},{warps})", hm))
        for bt, warps in ((1, 2), (1, 4), (1, 8), (2, 4), (2, 8)):

            def tok(dkv_new, dpe_new, bt=bt, warps=warps):
                _bwd_token[(cdiv(n_tok, bt),)](
                    dk, dv, dkv_new, dpe_new, cos, sin, *common, *strides,
                    POS_MODE=pos_mode, HALF=R // 2, BLOCK_T=bt, BLOCK_C=128, num_warps=warps,
                )  # fmt: skip

            variants.append((f"bwd token ({bt},{warps})", tok))
        for name, fn in variants:
            dkv_new = torch.empty_like(dkv_main)
            dpe_new = torch.empty_like(dpe_main)
            fn(dkv_new, dpe_new)
            sync()
            if not (torch.equal(dkv_new, dkv_main) and torch.equal(dpe_new, dpe_main)):
                print(f"{name}: WRONG")
                continue
            timed(name, case, lambda fn=fn, a=dkv_new, b=dpe_new: fn(a, b), BWD_BYTES)
        del dk, dv, dkv_main, dpe_main
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
