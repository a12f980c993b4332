"""``python benchmarks/sweep.py``: launch-configuration sweep of the kernels on the GPU.

The benchmark (``python -m mlarope bench``) times what users get: the public API with the
heuristic launch configurations. This times the launchers directly, at DeepSeek-V3 shapes
(H = 128, N = K = V = 128, R = 64, bf16, fp32 tables), for the heuristic's configuration and a
list of alternatives, beside ceilings measured in the same process: a contiguous
device-to-device copy; a strided copy of exactly the elements the in-place query op moves
(``q[..., N:]``: 128 of every 384 bytes), which is the best any kernel with that access
pattern can do; and the key/value forward's bytes without ``copy_v`` moved by plain loads and
stores (half of every ``kv`` row read, ``k`` written whole), that op's own ceiling; and the
backward's row copies (``dk`` and ``dv`` rows read whole, ``dkv`` rows written). It is how
the heuristics in ``kernels/q.py`` and ``kernels/kv.py`` were chosen
(docs/perf_log.md).

Timing: ``triton.testing.do_bench`` (L2 flushed before each call; its default return, the mean
of the repetitions).
Output: a table on stdout and ``--json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch
import triton
import triton.language as tl

from mlarope import YarnConfig
from mlarope.kernels.kv import KVLaunchConfig, rope_kv_backward_launch, rope_kv_launch
from mlarope.kernels.lookup import launch_cu_seqlens_search, position_args, search_cu_seqlens
from mlarope.kernels.q import QLaunchConfig, rope_q_launch
from mlarope.positions import Positions

HEADS, NOPE, ROPE, K_DIM, V_DIM, TOKENS = 128, 128, 64, 128, 128, 16384

# (block_t, block_h, block_n or block_c, num_warps); None is the heuristic's choice.
Q_INPLACE_CONFIGS = [
    None, (1, 128, 64, 4), (1, 128, 64, 8), (1, 64, 64, 4), (1, 64, 64, 2), (1, 32, 64, 2),
    (1, 32, 64, 1), (2, 64, 64, 4), (1, 16, 64, 1), (1, 8, 64, 1), (2, 16, 64, 1),
    (2, 32, 64, 2),
]  # fmt: skip
Q_CONFIGS = [None, (1, 128, 128, 8), (1, 64, 128, 4), (1, 32, 128, 2)]
KV_CONFIGS = [
    None, (1, 128, 128, 8), (1, 64, 128, 8), (1, 64, 128, 4), (1, 32, 128, 4), (1, 32, 128, 2),
    (1, 16, 128, 2), (1, 16, 128, 1), (1, 16, 128, 4), (1, 8, 128, 1), (1, 8, 128, 2),
    (2, 16, 128, 4), (2, 8, 128, 2),
]  # fmt: skip
KV_BWD_CONFIGS = [
    None, (1, 16, 128, 2), (1, 8, 128, 1), (1, 16, 128, 4), (1, 32, 128, 2), (1, 32, 128, 4),
    (2, 16, 128, 4), (1, 64, 128, 8),
]  # fmt: skip
# (tokens per program, num_warps) of the cu_seqlens search kernel: from 256-token 4-warp programs
# down to 16-token one-warp ones; the heuristic's is (32, 1).
SEARCH_CONFIGS = [(256, 4), (128, 4), (128, 2), (64, 2), (64, 1), (32, 1), (16, 1)]
OPS = {
    "q_inplace": Q_INPLACE_CONFIGS,
    "q": Q_CONFIGS,
    "kv": KV_CONFIGS,
    "kv_no_v": KV_CONFIGS,
    "kv_bwd": KV_BWD_CONFIGS,
}
CASES = {"sbhd": 0, "thd4": 4, "thd4096": 4096}


def _bytes(op: str) -> int:
    per_head = {
        "q_inplace": 2 * ROPE * 2,
        "q": 2 * (NOPE + ROPE) * 2,
        "kv": (K_DIM + V_DIM) * 2 + (K_DIM + ROPE + V_DIM) * 2,
        "kv_no_v": K_DIM * 2 + (K_DIM + ROPE) * 2,
        "kv_bwd": (K_DIM + ROPE + V_DIM) * 2 + (K_DIM + V_DIM) * 2,
    }[op]
    per_token = 0 if op.startswith("q") else ROPE * 2  # the k_pe / dk_pe row
    return TOKENS * (HEADS * per_head + per_token)


def _positions(case: str, device) -> tuple[Positions, tuple[int, ...]]:
    n_seqs = CASES[case]
    if n_seqs == 0:
        return Positions("sbhd", None, None, 0, 1), (4096, 4)
    cu = torch.arange(0, TOKENS + 1, TOKENS // n_seqs, dtype=torch.int32, device=device)
    return Positions("thd", cu, None, 0, 1), (TOKENS,)


def _bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100) * 1e3  # us


def _call(op: str, case: str, config, device):
    positions, tokens = _positions(case, device)
    cos, sin = YarnConfig.deepseek_v3().cos_sin(32768, device=device)
    bf16 = dict(dtype=torch.bfloat16, device=device)
    if op in ("q_inplace", "q"):
        q = torch.randn(*tokens, HEADS, NOPE + ROPE, **bf16)
        out = q if op == "q_inplace" else torch.empty_like(q)
        cfg = QLaunchConfig(*config) if config else None
        return lambda: rope_q_launch(
            q, out, cos, sin, positions, interleaved_in=True, interleaved_out=False,
            inverse=False, transpose=False, config=cfg,
        )  # fmt: skip
    cfg = KVLaunchConfig(*config) if config else None
    if op == "kv_bwd":
        if positions.cu_seqlens is not None:  # the forward's search, as a backward reads it
            found = search_cu_seqlens(positions.cu_seqlens, TOKENS, 0, 1)
            positions = dataclasses.replace(positions, searched=found)
        dk = torch.randn(*tokens, HEADS, K_DIM + ROPE, **bf16)
        dv = torch.randn(*tokens, HEADS, V_DIM, **bf16)
        dkv = torch.empty(*tokens, HEADS, K_DIM + V_DIM, **bf16)
        dk_pe = torch.empty(*tokens, ROPE, **bf16)
        return lambda: rope_kv_backward_launch(
            dk, dv, dkv, dk_pe, cos, sin, positions, k_dim=K_DIM, interleaved_in=True,
            interleaved_out=False, config=cfg,
        )  # fmt: skip
    kv = torch.randn(*tokens, HEADS, K_DIM + V_DIM, **bf16)
    k_pe = torch.randn(*tokens, ROPE, **bf16)
    k = torch.empty(*tokens, HEADS, K_DIM + ROPE, **bf16)
    v = torch.empty(*tokens, HEADS, V_DIM, **bf16) if op == "kv" else None
    return lambda: rope_kv_launch(
        kv, k_pe, k, v, cos, sin, positions, k_dim=K_DIM, interleaved_in=True,
        interleaved_out=False, config=cfg,
    )  # fmt: skip


def search_call(cu: torch.Tensor, n_tokens: int, block: int, warps: int):
    """The cu_seqlens search kernel alone (``cu: [n + 1]`` int32 -> ``[n_tokens]`` int64
    positions) with the given tile; checked against the launch path's output before it is
    timed."""
    found = torch.empty(n_tokens, dtype=torch.int64, device=cu.device)
    run = lambda: launch_cu_seqlens_search(cu, found, 0, 1, block, warps)
    run()
    expected = position_args(Positions("thd", cu, None, 0, 1), found, (n_tokens, 1))[1][0]
    if not torch.equal(found, expected):
        raise AssertionError(f"search with ({block}, {warps}) differs from the launch path")
    return run


def copy_tbps(numel: int, device) -> float:
    """TB/s (read + write) of a device-to-device copy of ``numel`` bf16 elements."""
    src = torch.empty(numel, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    return 2 * numel * 2 / (_bench(lambda: dst.copy_(src)) * 1e-6) / 1e12


@triton.jit
def _copy_row_slices(src_ptr, dst_ptr, n_rows, row_stride, offset, BLOCK_R: tl.constexpr,
                     WIDTH: tl.constexpr, LOAD_CACHE: tl.constexpr = "",
                     LOAD_EVICT: tl.constexpr = "", STORE_CACHE: tl.constexpr = "",
                     STORE_EVICT: tl.constexpr = ""):  # fmt: skip
    """``dst[r, offset : offset + WIDTH] = src[r, offset : offset + WIDTH]`` for a row block,
    with the given cache modifiers and eviction policies ("" is the default)."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    at = r[:, None] * row_stride + offset + tl.arange(0, WIDTH)[None, :]
    m = (r < n_rows)[:, None]
    x = tl.load(src_ptr + at, mask=m, cache_modifier=LOAD_CACHE, eviction_policy=LOAD_EVICT)
    tl.store(dst_ptr + at, x, mask=m, cache_modifier=STORE_CACHE, eviction_policy=STORE_EVICT)


# Cache hints tried on the copy onto itself (the in-place op's pattern), at the in-place
# kernel's tile (16 rows of 64 channels, one warp): (name, load cache modifier, load eviction
# policy, store cache modifier, store eviction policy).
ONTO_ITSELF_HINTS = [
    ("plain", "", "", "", ""),
    ("ld evict_first", "", "evict_first", "", ""),
    ("st evict_first", "", "", "", "evict_first"),
    ("ld+st evict_first", "", "evict_first", "", "evict_first"),
    ("ld .cg", ".cg", "", "", ""),
    ("st .cs", "", "", ".cs", ""),
    ("st .wt", "", "", ".wt", ""),
    ("ld .cg st .cs", ".cg", "", ".cs", ""),
]


@triton.jit
def _copy_kv_pattern(kv_ptr, kpe_ptr, k_ptr, n_rows, n_heads, K: tl.constexpr,
                     V: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr):  # fmt: skip
    """The key/value forward's bytes without ``copy_v`` and without arithmetic: for a block of
    (token, head) rows, ``k[r, :K] = kv[r, :K]`` and ``k[r, K:] = k_pe[r // n_heads]``."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    m = (r < n_rows)[:, None]
    c = tl.arange(0, K)[None, :]
    tl.store(k_ptr + r[:, None] * (K + R) + c, tl.load(kv_ptr + r[:, None] * (K + V) + c, mask=m),
             mask=m)  # fmt: skip
    j = tl.arange(0, R)[None, :]
    pe = tl.load(kpe_ptr + (r // n_heads)[:, None] * R + j, mask=m)
    tl.store(k_ptr + r[:, None] * (K + R) + K + j, pe, mask=m)


@triton.jit
def _copy_kv_bwd_pattern(dk_ptr, dv_ptr, dkv_ptr, sums_ptr, n_rows, K: tl.constexpr,
                         V: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr):  # fmt: skip
    """The key/value backward's row bytes with the least arithmetic: for a block of (token,
    head) rows, ``dkv[r] = [dk[r, :K], dv[r]]``, and ``dk[r, K:]`` summed over the block into
    one fp32 row of ``sums`` (the head sum's input must be read: the compiler drops a load whose
    value is unused, and the pattern would then move fewer bytes than the op and read above
    the op's ceiling). K, V and R are powers of two (``tl.arange``)."""
    pid = tl.program_id(0)
    r = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    m = (r < n_rows)[:, None]
    c = tl.arange(0, K)[None, :]
    j = tl.arange(0, R)[None, :]
    k_blk = tl.load(dk_ptr + r[:, None] * (K + R) + c, mask=m)
    pe = tl.load(dk_ptr + r[:, None] * (K + R) + K + j, mask=m, other=0.0)
    cv = tl.arange(0, V)[None, :]
    v_blk = tl.load(dv_ptr + r[:, None] * V + cv, mask=m)
    tl.store(dkv_ptr + r[:, None] * (K + V) + c, k_blk, mask=m)
    tl.store(dkv_ptr + r[:, None] * (K + V) + K + cv, v_blk, mask=m)
    tl.store(sums_ptr + pid.to(tl.int64) * R + tl.arange(0, R), tl.sum(pe.to(tl.float32), axis=0))


def kv_pattern_copy(kv: torch.Tensor, k_pe: torch.Tensor, k: torch.Tensor, block_r: int,
                    num_warps: int) -> None:  # fmt: skip
    """``kv: [T, H, K + V]``, ``k_pe: [T, R]`` -> ``k: [T, H, K + R]`` (contiguous), copies only."""
    n_tokens, n_heads, _ = kv.shape
    rope = k_pe.shape[-1]
    k_dim = k.shape[-1] - rope
    _copy_kv_pattern[(triton.cdiv(n_tokens * n_heads, block_r),)](
        kv, k_pe, k, n_tokens * n_heads, n_heads, K=k_dim, V=kv.shape[-1] - k_dim, R=rope,
        BLOCK_R=block_r, num_warps=num_warps,
    )  # fmt: skip


def kv_bwd_pattern_copy(dk: torch.Tensor, dv: torch.Tensor, dkv: torch.Tensor, rope: int,
                        block_r: int, num_warps: int) -> torch.Tensor:  # fmt: skip
    """``dk: [rows, K + R]``, ``dv: [rows, V]`` -> ``dkv: [rows, K + V]`` (contiguous), and the
    returned fp32 ``[ceil(rows / block_r), R]`` sums of ``dk[:, K:]`` over each row block (4 MB
    written at DeepSeek-V3 shapes and 64-row blocks, 0.2 % of the op's bytes)."""
    k_dim = dk.shape[-1] - rope
    n_blocks = triton.cdiv(dk.shape[0], block_r)
    sums = torch.empty(n_blocks, rope, dtype=torch.float32, device=dk.device)
    _copy_kv_bwd_pattern[(n_blocks,)](
        dk, dv, dkv, sums, dk.shape[0], K=k_dim, V=dv.shape[-1], R=rope, BLOCK_R=block_r,
        num_warps=num_warps,
    )  # fmt: skip
    return sums


def ceilings(device) -> dict[str, float]:
    """TB/s of a contiguous 1 GiB copy, and of a plain copy of exactly the elements the
    in-place query op reads and writes (``q[..., N:]`` of every row: 128 of every 384 bytes),
    out of place and onto itself: the pattern's own ceiling, whatever the arithmetic."""
    contiguous = copy_tbps(1 << 29, device)
    q = torch.randn(TOKENS * HEADS, NOPE + ROPE, dtype=torch.bfloat16, device=device)
    q2 = torch.empty_like(q)
    moved = TOKENS * HEADS * ROPE * 2 * 2
    out = {"copy_tbps": contiguous}
    for name, dst in (("rope_slice_copy_tbps", q2), ("rope_slice_onto_itself_tbps", q)):
        for block_r, warps in ((128, 8), (64, 4), (32, 2)):
            us = _bench(
                lambda dst=dst, block_r=block_r, warps=warps: _copy_row_slices[
                    (triton.cdiv(q.shape[0], block_r),)
                ](
                    q,
                    dst,
                    q.shape[0],
                    q.stride(0),
                    NOPE,
                    BLOCK_R=block_r,
                    WIDTH=ROPE,
                    num_warps=warps,
                )
            )
            out[f"{name}[{block_r}x{warps}w]"] = moved / (us * 1e-6) / 1e12
    for name, ld_cache, ld_evict, st_cache, st_evict in ONTO_ITSELF_HINTS:
        us = _bench(
            lambda hints=(ld_cache, ld_evict, st_cache, st_evict): _copy_row_slices[
                (triton.cdiv(q.shape[0], 16),)
            ](q, q, q.shape[0], q.stride(0), NOPE, 16, ROPE, *hints, num_warps=1)
        )
        out[f"rope_slice_onto_itself_tbps[16x1w {name}]"] = moved / (us * 1e-6) / 1e12
    torch_us = _bench(lambda: q2[..., NOPE:].copy_(q[..., NOPE:]))
    out["rope_slice_torch_copy_tbps"] = moved / (torch_us * 1e-6) / 1e12
    # The key/value forward without copy_v reads half of every kv row (K of K + V channels).
    kv = torch.randn(TOKENS, HEADS, K_DIM + V_DIM, dtype=torch.bfloat16, device=device)
    k_pe = torch.randn(TOKENS, ROPE, dtype=torch.bfloat16, device=device)
    k = torch.empty(TOKENS, HEADS, K_DIM + ROPE, dtype=torch.bfloat16, device=device)
    for block_r, warps in ((128, 8), (64, 4), (32, 4)):
        us = _bench(lambda b=block_r, w=warps: kv_pattern_copy(kv, k_pe, k, b, w))
        out[f"kv_no_v_pattern_tbps[{block_r}x{warps}w]"] = _bytes("kv_no_v") / (us * 1e-6) / 1e12
    # The key/value backward reads dk and dv rows whole and writes dkv rows whole.
    dk = torch.randn(TOKENS * HEADS, K_DIM + ROPE, dtype=torch.bfloat16, device=device)
    dv = torch.randn(TOKENS * HEADS, V_DIM, dtype=torch.bfloat16, device=device)
    dkv = torch.empty(TOKENS * HEADS, K_DIM + V_DIM, dtype=torch.bfloat16, device=device)
    for block_r, warps in ((64, 8), (64, 4)):
        us = _bench(lambda b=block_r, w=warps: kv_bwd_pattern_copy(dk, dv, dkv, ROPE, b, w))
        out[f"kv_bwd_pattern_tbps[{block_r}x{warps}w]"] = _bytes("kv_bwd") / (us * 1e-6) / 1e12
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/sweep.py", description=__doc__)
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma list of {list(OPS)}")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma list of {list(CASES)}")
    parser.add_argument(
        "--heuristic-only", action="store_true", help="time the heuristic's configuration only"
    )
    parser.add_argument("--label", default="", help="a name for this run in the JSON")
    parser.add_argument("--json", default=None, help="write the rows as JSON to this path")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/sweep.py needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    ceiling = ceilings(device)
    print(f"{args.label} ceilings: " + ", ".join(f"{k} {v:.3f}" for k, v in ceiling.items()))
    rows = []
    for case in args.cases.split(","):
        # The thd cases' cu_seqlens search (its own kernel, launched by every thd call above).
        positions, tokens = _positions(case, device)
        if positions.cu_seqlens is not None:
            x = torch.empty(*tokens, 1, 1, device=device)
            us = _bench(lambda p=positions, x=x, t=tokens: position_args(p, x, (t[0], 1)))
            row = dict(op="cu_seqlens search", case=case, config="heuristic", us=round(us, 1))
            rows.append(row)
            print(f"{args.label} cu_seqlens search {case:8s} heuristic {us:8.1f} us", flush=True)
            for block, warps in SEARCH_CONFIGS:
                us = _bench(search_call(positions.cu_seqlens, tokens[0], block, warps))
                label = f"({block}, {warps})"
                rows.append(dict(op="cu_seqlens search", case=case, config=label, us=round(us, 1)))
                print(f"{args.label} cu_seqlens search {case:8s} {label} {us:8.1f} us", flush=True)
    for op in args.ops.split(","):
        for case in args.cases.split(","):
            for config in OPS[op][:1] if args.heuristic_only else OPS[op]:
                try:
                    us = _bench(_call(op, case, config, device))
                except Exception as error:  # a config the kernel cannot compile: say so
                    print(f"{op} {case} {config}: {type(error).__name__}: {error}"[:300])
                    continue
                tbps = _bytes(op) / (us * 1e-6) / 1e12
                pct = round(100 * tbps / ceiling["copy_tbps"], 1)
                label = str(config or "heuristic")
                rows.append(dict(op=op, case=case, config=label, us=round(us, 1),
                                 tbps=round(tbps, 3), pct_copy=pct))  # fmt: skip
                print(f"{args.label} {op:9s} {case:8s} {label:22s} {us:8.1f} us "
                      f"{tbps:6.3f} TB/s {pct:5.1f} %", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"label": args.label, "ceilings": ceiling, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
