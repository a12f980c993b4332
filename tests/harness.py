"""What the query and key/value harnesses share (``tests/q_harness.py``, ``tests/kv_harness.py``):
general random tables and a bit-for-bit comparison."""

from __future__ import annotations

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
