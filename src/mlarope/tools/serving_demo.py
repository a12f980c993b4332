"""``python -m mlarope demo --serving``: decode steps of a tiny DeepSeek-V3-shaped MLA layer
through a paged FP8 cache, checked against the reference.

A batch of sequences is prefilled into the cache (``rope_append_kv_cache``, FlashMLA's
656-byte FP8 record by default), then each decode step appends every sequence's new token
and builds the absorbed query (``rope_decode_query``); attention runs in float64 on the cache
read back by slot (absorbed MLA: MQA over ``[c | k_rope]``, ``o = W_UV (p @ c)``). The same
steps run through :mod:`mlarope.serving.reference` into a second cache. Checked: the two
caches hold the same latent bytes and scales, and rope values within one rounding of each
other; the outputs agree; and the absorbed output through the FP8 cache is close to
attention in float64 on the unquantized values (the FP8 error, for scale).
"""

from __future__ import annotations

import argparse

import torch

import mlarope
from mlarope.ops import use_triton
from mlarope.serving import reference as ref
from mlarope.serving import rope_append_kv_cache, rope_decode_query

from ._console import Console, Table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cache-format", default=None, choices=("fp8_656", "concat", "split"),
        help="serving demo: the cache format (default fp8_656; concat and split are FP8 with a "
        "per-tensor scale)",
    )  # fmt: skip
    parser.add_argument(
        "--steps", type=int, default=None, help="serving demo: decode steps (default 4)"
    )


def run(args: argparse.Namespace) -> int:
    console = Console()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    fmt = args.cache_format or "fp8_656"
    steps = args.steps or 4
    heads = args.heads or (16 if on_gpu else 2)
    nope, v_dim, latent, rope = (128, 128, 512, 64) if on_gpu else (32, 32, 512, 64)
    prompts = [37, 64, 5] if on_gpu else [6, 3]
    block_size, kv_scale = 16, 0.05
    cfg = mlarope.YarnConfig.deepseek_v3()
    max_len = max(prompts) + steps
    cos, sin = cfg.cos_sin(max_len, device=device)
    sigma = cfg.softmax_scale(nope + rope)
    gen = torch.Generator().manual_seed(args.seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16).to(device)

    w_uv = torch.randn(heads, v_dim, latent, generator=gen, dtype=torch.float64) / latent**0.5
    n_blocks = sum(-(-(p + steps) // block_size) for p in prompts) + 2
    block_ids = torch.randperm(n_blocks, generator=gen).tolist()
    tables, cursor = [], 0  # each sequence's pages
    for p in prompts:
        need = -(-(p + steps) // block_size)
        tables.append(block_ids[cursor : cursor + need])
        cursor += need

    def slot(seq: int, pos: int) -> int:
        return tables[seq][pos // block_size] * block_size + pos % block_size

    def new_cache():
        if fmt == "fp8_656":
            return torch.zeros(n_blocks, block_size, 656, dtype=torch.uint8, device=device)
        if fmt == "concat":
            shape = (n_blocks, block_size, latent + rope)
            return torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device)
        return (
            torch.zeros(n_blocks, block_size, latent, dtype=torch.float8_e4m3fn, device=device),
            torch.zeros(n_blocks, block_size, rope, dtype=torch.float8_e4m3fn, device=device),
        )

    scale = None if fmt == "fp8_656" else kv_scale
    cache, ref_cache = new_cache(), new_cache()
    history = [[] for _ in prompts]  # exact (c, k_pe, position) per sequence, for float64

    def append(kv_c, k_pe, positions, slots):
        rope_append_kv_cache(
            kv_c, k_pe, cos, sin, positions, cache, slots, cache_format=fmt, kv_scale=scale
        )
        ref.append_kv_cache(
            kv_c, k_pe, cos, sin, positions, ref_cache if fmt != "split" else ref_cache[0],
            None if fmt != "split" else ref_cache[1], slots, cache_format=fmt,
            kv_scale=scale, interleaved_in=True, interleaved_out=True,
        )  # fmt: skip

    # prefill: every sequence's prompt in one batch, with two padding tokens (slot -1)
    tokens = []
    for seq, p in enumerate(prompts):
        tokens += [(seq, pos) for pos in range(p)]
    tokens.insert(1, None)
    tokens.append(None)
    kv_c, k_pe = rand(len(tokens), latent), rand(len(tokens), rope)
    positions = torch.tensor([0 if t is None else t[1] for t in tokens], device=device)
    slots = torch.tensor([-1 if t is None else slot(*t) for t in tokens], device=device)
    append(kv_c, k_pe, positions, slots)
    for i, t in enumerate(tokens):
        if t is not None:
            history[t[0]].append((kv_c[i], k_pe[i], t[1]))

    backend = "Triton kernels" if use_triton(kv_c) else "PyTorch reference"
    if backend == "Triton kernels" and not on_gpu:
        backend += " under Triton's interpreter"
    console.print(
        f"mlarope serving demo: DeepSeek-V3-shaped MLA, {heads} heads, L={latent} R={rope}, "
        f"{len(prompts)} sequences (prompts {prompts}), {steps} decode steps, "
        f"{fmt} cache ({n_blocks} pages of {block_size}), {device} ({backend})",
        style="bold",
    )
    table = Table(title="decode steps: ours vs the reference (and vs float64, unquantized)")
    for name in ("step", "cache bytes", "max |o - o_ref|", "max |o - o_fp64| / max |o|", "ok"):
        table.add_column(name, justify="left" if name == "ok" else "right")
    ok_all = True
    for step in range(steps):
        n = len(prompts)
        kv_c, k_pe = rand(n, latent), rand(n, rope)
        q_lat, q_pe = rand(n, heads, latent, scale=0.2), rand(n, heads, rope)
        positions = torch.tensor([prompts[s] + step for s in range(n)], device=device)
        slots = torch.tensor([slot(s, prompts[s] + step) for s in range(n)], device=device)
        append(kv_c, k_pe, positions, slots)
        for s in range(n):
            history[s].append((kv_c[s], k_pe[s], prompts[s] + step))
        q = rope_decode_query(q_lat, q_pe, cos, sin, positions)
        q_ref = ref.decode_query(
            q_lat, q_pe, cos, sin, positions, out_dtype=q_lat.dtype, q_scale=None,
            interleaved_in=True, interleaved_out=True,
        )  # fmt: skip
        same_bytes = _cache_agrees(cache, ref_cache, fmt, latent)
        err_ref = err_exact = scale_o = 0.0
        for s in range(n):
            seq_slots = torch.tensor([slot(s, pos) for *_, pos in history[s]], device=device)
            o = _absorbed(q[s], cache, seq_slots, fmt, rope, scale, w_uv, sigma)
            o_ref = _absorbed(q_ref[s], ref_cache, seq_slots, fmt, rope, scale, w_uv, sigma)
            o_exact = _exact(q_lat[s], q_pe[s], positions[s], history[s], w_uv, cos, sin, sigma)
            err_ref = max(err_ref, float((o - o_ref).abs().max()))
            err_exact = max(err_exact, float((o - o_exact).abs().max()))
            scale_o = max(scale_o, float(o_exact.abs().max()))
        rel = err_exact / scale_o
        # ours vs the reference: one bf16 rounding of the rope values at most; vs float64
        # unquantized: the FP8 latent's error (e4m3: 2**-4 relative per element at most)
        ok = same_bytes and err_ref <= 2e-2 * scale_o and rel <= 0.1
        ok_all &= ok
        table.add_row(
            str(step), "same" if same_bytes else "DIFFER", f"{err_ref:.2e}", f"{rel:.2e}",
            "yes" if ok else "NO", styles=(None, None, None, None, None if ok else "red"),
        )  # fmt: skip
    console.print(table)
    console.print("demo passed" if ok_all else "demo FAILED", style="green" if ok_all else "red")
    return 0 if ok_all else 1


def _cache_agrees(cache, ref_cache, fmt: str, latent: int) -> bool:
    """Latent codes and tile scales bitwise equal; rope values within one step (the kernels'
    fused multiply-adds may round differently in the last bit)."""
    if fmt == "split":
        pairs = [(cache[0], ref_cache[0], None), (cache[1], ref_cache[1], 0)]
    else:
        pairs = [(cache, ref_cache, 528 if fmt == "fp8_656" else latent)]
    for ours, theirs, rope_at in pairs:
        a, b = ours.view(torch.uint8), theirs.view(torch.uint8)
        if rope_at is None:
            if not torch.equal(a, b):
                return False
            continue
        if not torch.equal(a[..., :rope_at], b[..., :rope_at]):
            return False
        if fmt == "fp8_656":
            ra = a[..., rope_at:].contiguous().view(torch.bfloat16).float()
            rb = b[..., rope_at:].contiguous().view(torch.bfloat16).float()
            if not torch.allclose(ra, rb, rtol=2**-7, atol=0):
                return False
        elif (a[..., rope_at:].int() - b[..., rope_at:].int()).abs().max() > 1:
            return False
    return True


def _absorbed(q, cache, slots, fmt, rope, scale, w_uv, sigma) -> torch.Tensor:
    """float64 absorbed MLA for one token's query ``q: [H, L + R]`` over the cache at
    ``slots``."""
    c, kr = ref.read_kv_cache(cache, slots, cache_format=fmt, rope_dim=rope, kv_scale=scale)
    c, kr = c.cpu().double(), kr.cpu().double()
    p = torch.softmax(sigma * q.cpu().double() @ torch.cat((c, kr), 1).T, dim=-1)  # [H, T]
    return torch.einsum("hvl,hl->hv", w_uv, p @ c)


def _exact(q_lat, q_pe, position, history, w_uv, cos, sin, sigma):
    """float64 attention on the unquantized inputs and exact rotations (absorbed; equal to the
    non-absorbed form, ``q_lat . c = q_nope . (W_UK c)``, which the round-trip test checks)."""
    c = torch.stack([h[0] for h in history]).cpu().double()
    kpe = torch.stack([h[1] for h in history]).cpu().double()
    pos = torch.tensor([h[2] for h in history])
    c64, s64 = cos.cpu().double(), sin.cpu().double()
    kr = ref.rotate_pairs(
        kpe.unsqueeze(1), c64[pos], s64[pos], torch.zeros(len(history), dtype=torch.bool),
        torch.ones(len(history), dtype=torch.bool), interleaved_in=True, interleaved_out=True,
        inverse=False, transpose=False,
    ).squeeze(1)  # fmt: skip
    p_ = int(position)
    qr = ref.rotate_pairs(
        q_pe.cpu().double().unsqueeze(0), c64[p_ : p_ + 1], s64[p_ : p_ + 1],
        torch.zeros(1, dtype=torch.bool), torch.ones(1, dtype=torch.bool), interleaved_in=True,
        interleaved_out=True, inverse=False, transpose=False,
    ).squeeze(0)  # fmt: skip
    scores = sigma * (q_lat.cpu().double() @ c.T + qr @ kr.T)
    p = torch.softmax(scores, dim=-1)
    return torch.einsum("hvl,hl->hv", w_uv, p @ c)
