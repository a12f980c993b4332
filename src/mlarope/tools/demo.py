"""``python -m mlarope demo``: a DeepSeek-V3-shaped MLA attention step through mlarope.

Builds YaRN tables for DeepSeek-V3, a packed thd batch of several sequences, rotates the
queries (in place, as a training framework does) and the keys through mlarope, runs causal
attention per sequence and the backward, and checks outputs and gradients against the same
step through :mod:`mlarope.reference` in float64. On a GPU it also times the two ops against the
reference. On the CPU the shapes are small and the backend is the PyTorch reference (or the
Triton kernels under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import torch
import torch.nn.functional as F

import mlarope
from mlarope.ops import use_triton

from ._console import Console, Table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    parser.add_argument(
        "--heads", type=int, default=None, help="heads (default 128 on GPU, 4 on CPU)"
    )
    parser.add_argument(
        "--seq-lens", default=None,
        help="comma-separated sequence lengths of the packed batch "
        "(default 1024,3072,2048,2048 on GPU, 5,16,11 on CPU)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="random inputs' seed (default 0)")
    parser.add_argument(
        "--serving", action="store_true",
        help="decode steps through a paged FP8 MLA cache (mlarope.serving) instead",
    )  # fmt: skip
    from .serving_demo import add_arguments as serving_arguments

    serving_arguments(parser)


def _mla_step(api, q0, kv0, k_pe0, cos, sin, cu, k_dim, scale, inplace):
    """Rotate, attend per sequence (causal), return output and gradients."""
    q_leaf = q0.clone().requires_grad_(True)
    kv = kv0.clone().requires_grad_(True)
    k_pe = k_pe0.clone().requires_grad_(True)
    q_in = q_leaf * 1.0 if inplace else q_leaf
    kwargs = dict(layout="thd", cu_seqlens=cu)
    if api is mlarope:
        q = api.apply_rope_q(q_in, cos, sin, inplace=inplace, **kwargs)
    else:
        q = api.apply_rope_q(q_in, cos, sin, **kwargs)
    k, v = api.apply_rope_kv(kv, k_pe, cos, sin, k_dim=k_dim, **kwargs)
    outs = []
    bounds = cu.tolist()
    for start, end in itertools.pairwise(bounds):
        qs, ks, vs = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale))
    out = torch.cat([o.squeeze(0).transpose(0, 1) for o in outs])
    gen = torch.Generator().manual_seed(1)
    grad = torch.randn(out.shape, generator=gen).to(out.dtype).to(out.device)
    out.backward(grad)
    return out.detach(), q_leaf.grad, kv.grad, k_pe.grad


def _time(fn, device, repeats=20) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def _argument_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the command line, or None: each option is checked before anything
    runs, and an option of the other demo is refused rather than ignored."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        kind = torch.device(device).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):
        return f"--device must be cuda or cpu, got {device!r}"
    if kind == "cuda" and not torch.cuda.is_available():
        return "--device cuda, but no CUDA device is available"
    if args.heads is not None and args.heads < 1:
        return f"--heads must be at least 1, got {args.heads}"
    if args.seq_lens is not None:
        if args.serving:
            return "--seq-lens is the training demo's; the serving demo decodes its own prompts"
        try:
            lengths = [int(s) for s in args.seq_lens.split(",")]
        except ValueError:
            return f"--seq-lens must be comma-separated integers, got {args.seq_lens!r}"
        if min(lengths) < 1:
            return f"--seq-lens must be lengths of at least 1, got {args.seq_lens!r}"
    if not args.serving:
        for flag, value in (("--cache-format", args.cache_format), ("--steps", args.steps)):
            if value is not None:
                return f"{flag} is the serving demo's option: add --serving"
    elif args.steps is not None and args.steps < 1:
        return f"--steps must be at least 1, got {args.steps}"
    return None


def run(args: argparse.Namespace) -> int:
    """Exit code 0 when every check passed, 1 when one failed, 2 for a bad command line."""
    problem = _argument_problem(args)
    if problem:
        Console().print(f"mlarope demo: {problem}", style="red")
        return 2
    if args.serving:
        from .serving_demo import run as run_serving

        return run_serving(args)
    console = Console()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    heads = args.heads or (128 if on_gpu else 4)
    seq_lens = [
        int(s)
        for s in (args.seq_lens or ("1024,3072,2048,2048" if on_gpu else "5,16,11")).split(",")
    ]
    nope, rope, k_dim, v_dim = 128, 64, 128, 128
    dtype = torch.bfloat16 if on_gpu else torch.float32
    cfg = mlarope.YarnConfig.deepseek_v3()
    cos, sin = cfg.cos_sin(max(seq_lens), device=device)
    scale = cfg.softmax_scale(nope + rope)
    cu = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu = cu.to(device)
    n_tokens = sum(seq_lens)
    gen = torch.Generator().manual_seed(args.seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    q = rand(n_tokens, heads, nope + rope)
    kv = rand(n_tokens, heads, k_dim + v_dim)
    k_pe = rand(n_tokens, 1, rope)
    backend = "Triton kernels" if use_triton(q) else "PyTorch reference"
    if backend == "Triton kernels" and not on_gpu:
        backend += " under Triton's interpreter"
    console.print(
        f"mlarope demo: DeepSeek-V3 MLA, {heads} heads, N={nope} R={rope} K={k_dim} V={v_dim}, "
        f"thd batch {seq_lens} ({n_tokens} tokens), {dtype}, {device} ({backend}), "
        f"YaRN factor {cfg.factor}, softmax scale {scale:.6f}",
        style="bold",
    )
    ours = _mla_step(mlarope, q, kv, k_pe, cos, sin, cu, k_dim, scale, inplace=True)
    # The reference in float64: the rope inputs are exact in float64, so the comparison measures
    # our rounding (one per element) plus the attention's own low-precision arithmetic.
    truth = _mla_step(
        mlarope.reference, q.double(), kv.double(), k_pe.double(), cos.double(), sin.double(),
        cu, k_dim, scale, inplace=False,
    )  # fmt: skip
    table = Table(title="mlarope vs float64 reference")
    table.add_column("tensor")
    table.add_column("max |err| / max |ref|", justify="right")
    table.add_column("limit", justify="right")
    table.add_column("ok")
    limit = 2e-2 if dtype == torch.bfloat16 else 1e-5
    ok = True
    for name, got, ref in zip(("attention out", "dq", "dkv", "dk_pe"), ours, truth, strict=True):
        rel = ((got.double() - ref).abs().max() / ref.abs().max()).item()
        passed = rel <= limit
        ok &= passed
        table.add_row(
            name, f"{rel:.2e}", f"{limit:.0e}", "yes" if passed else "NO",
            styles=(None, None, None, None if passed else "red"),
        )  # fmt: skip
    console.print(table)

    if on_gpu:
        timing = Table(title="rope ops, forward (ms per call)")
        timing.add_column("op")
        timing.add_column("mlarope", justify="right")
        timing.add_column("reference (eager)", justify="right")
        qw = q.clone()
        rows = [
            ("q in place", lambda: mlarope.apply_rope_q(qw, cos, sin, layout="thd", cu_seqlens=cu,
             inplace=True), lambda: mlarope.reference.apply_rope_q(qw, cos, sin, layout="thd",
             cu_seqlens=cu)),
            ("kv", lambda: mlarope.apply_rope_kv(kv, k_pe, cos, sin, k_dim=k_dim, layout="thd",
             cu_seqlens=cu), lambda: mlarope.reference.apply_rope_kv(kv, k_pe, cos, sin,
             k_dim=k_dim, layout="thd", cu_seqlens=cu)),
        ]  # fmt: skip
        for name, fast, slow in rows:
            timing.add_row(name, f"{_time(fast, device):.3f}", f"{_time(slow, device):.3f}")
        console.print(timing)
    console.print("demo passed" if ok else "demo FAILED", style="green" if ok else "red")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m mlarope.tools.demo`` (the same as ``python -m mlarope demo``)."""
    parser = argparse.ArgumentParser(prog="python -m mlarope demo", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
