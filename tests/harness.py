"""What the query and key/value harnesses share (``tests/q_harness.py``, ``tests/kv_harness.py``):
general random tables and a bit-for-bit comparison."""

from __future__ import annotations

import os

import torch


def random_tables(
    rows: int, rope: int, dtype: torch.dtype, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """General tables ``cos, sin: [rows, rope]`` in ``dtype``: random angles, and the two halves
    of a row differ (the formulas use both, so a kernel that mixes them up fails); ``|c|, |s|``
    up to 1.5, like a YaRN attention factor."""
    theta = torch.rand(rows, rope, dtype=torch.float64) * 6.3
    scale = 1.0 + 0.5 * torch.rand(rows, 1, dtype=torch.float64)
    cos = (theta.cos() * scale).to(dtype).to(device)
    sin = (theta.sin() * scale).to(dtype).to(device)
    return cos, sin


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (NaN == NaN with the same payload, -0.0 != 0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))


_FMA_ROUNDS_ONCE: list[bool] = []


def interpreter_fma_rounds_once() -> bool:
    """Whether Triton's interpreter computes ``tl.fma`` as a fused multiply-add (one rounding,
    as the GPU does: Triton 3.7 and later) or as a product and a sum (two roundings: 3.6). The
    kernels' rotation is ``fma(a, c, -(b * s))``, so only the older interpreter reproduces a
    PyTorch ``a * c - b * s`` bit for bit. Measured once, on inputs whose fused and unfused
    results differ."""
    if not _FMA_ROUNDS_ONCE:
        import triton
        import triton.language as tl

        @triton.jit
        def fma_kernel(x_ptr, out_ptr):
            x = tl.load(x_ptr)
            tl.store(out_ptr, tl.fma(x, x, -1.0))

        # x = 1 + 2^-12: x*x = 1 + 2^-11 + 2^-24 exactly; fused, x*x - 1 keeps the 2^-24 term;
        # unfused, x*x rounds to 1 + 2^-11 (ties to even) first and the term is lost.
        x = torch.tensor([1.0 + 2.0**-12], dtype=torch.float32)
        out = torch.empty_like(x)
        fma_kernel[(1,)](x, out)
        _FMA_ROUNDS_ONCE.append(float(out) != 2.0**-11)
    return _FMA_ROUNDS_ONCE[0]


def kernels_fuse(device) -> bool:
    """Whether the kernels' ``tl.fma`` rounds once on ``device``: always on a GPU, under Triton's
    interpreter from 3.7 on (``interpreter_fma_rounds_once``; CPU tensors without the
    interpreter run the reference, whose products are not fused)."""
    if torch.device(device).type != "cpu":
        return True
    return os.environ.get("TRITON_INTERPRET") == "1" and interpreter_fma_rounds_once()


def fused_multiply_add(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """fp32 ``x * y + z`` rounded once to nearest even, as a fused multiply-add: the product is
    exact in fp64 (24 + 24 bits), the sum exact as two fp64 values (Knuth's two-sum), and the
    sum is rounded to odd at 53 bits before the rounding to fp32's 24 (a nonzero remainder sets
    the last bit), which makes the two roundings one (Boldo and Melquiond's rounding to odd)."""
    p = x.double() * y.double()
    w = z.double()
    hi = p + w
    back = hi - p
    lo = (p - (hi - back)) + (w - back)
    even = (hi.view(torch.int64) & 1) == 0
    toward_lo = torch.nextafter(hi, torch.where(lo > 0, torch.inf, -torch.inf).to(hi))
    hi = torch.where((lo != 0) & even & hi.isfinite(), toward_lo, hi)
    return hi.float()


def fused_products(a, b, c_a, c_b, s_a, s_b):
    """The kernels' rotation, ``fma(a, c_a, -(b*s_a))`` and ``fma(b, c_b, a*s_b)``, for
    ``mlarope.reference.rotate_products`` (fp32 compute; fp64 inputs keep PyTorch's order)."""
    if a.dtype != torch.float32:
        return a * c_a - b * s_a, b * c_b + a * s_b
    a, b, c_a, c_b, s_a, s_b = torch.broadcast_tensors(a, b, c_a, c_b, s_a, s_b)
    return fused_multiply_add(a, c_a, -(b * s_a)), fused_multiply_add(b, c_b, a * s_b)


def fused_reference(monkeypatch) -> None:
    """Give mlarope's PyTorch reference the kernels' fused arithmetic for the rest of the test
    (on the GPU and under a fused-fma interpreter the kernels then store its bits)."""
    from mlarope import reference

    monkeypatch.setattr(reference, "rotate_products", fused_products)


def reference_backend(monkeypatch, device) -> None:
    """Run mlarope's PyTorch reference for the rest of the test, on ``device``: CPU tensors with
    ``TRITON_INTERPRET`` off (``ops.use_triton`` reads it on every call); CUDA tensors with the
    backend choice patched, and the recorded launch plans forgotten (a plan replays kernels)."""
    from mlarope import _plans, ops
    from mlarope._launch_cache import clear_launch_cache

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if torch.device(device).type != "cpu":
        monkeypatch.setattr(ops, "use_triton", lambda t: False)
        monkeypatch.setattr(_plans, "use_triton", lambda t: False)
        clear_launch_cache()
