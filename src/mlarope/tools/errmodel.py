"""The error model (docs/design.md, "How exact: the error model"), element by element: the
oracle of the tests and of the stress run.

A rotated element is ``y = a*c - b*s`` (or ``b*c + a*s``) computed in fp32 from exact inputs and
fp32 tables, then rounded once to the output dtype. Its error against the fp64 value is at most

    arith + ulp_out(|y| + arith),   arith = 3 * 2**-24 * (|a*c| + |b*s|)

(two products and a subtraction, each within half an fp32 ulp, bounded generously by 3 units of
2**-24; fused multiply-adds only tighten it), where ``ulp_out`` is one unit in the last place of
the output dtype at that magnitude: a correctly rounded result is within half of it, the
interpreter's truncation within one. ``|a*c| + |b*s|`` is bounded per pair by
``(|a| + |b|) * max(|c_a|, |c_b|, |s_a|, |s_b|)``. It matters only under cancellation.

A sum over ``H`` heads accumulated in fp32 adds at most ``(H - 1) * 2**-24 * sum_h |g_h|``
before the rotation.
"""

from __future__ import annotations

import torch

from mlarope.positions import token_positions
from mlarope.reference import gather_tables

U32 = 2.0**-24
_PRECISION = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24, torch.float64: 53}
_MIN_EXP = {torch.bfloat16: -126, torch.float16: -14, torch.float32: -126, torch.float64: -1022}


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of ``dtype`` at magnitude ``|x|`` (fp64 tensor in and out)."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(2.0 ** _MIN_EXP[dtype])))
    return torch.exp2(exponent - (_PRECISION[dtype] - 1))


def split_pairs(x: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    half = x.shape[-1] // 2
    return (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])


def join_pairs(a: torch.Tensor, b: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        return torch.stack((a, b), dim=-1).flatten(-2)
    return torch.cat((a, b), dim=-1)


def table_bound(cos: torch.Tensor, sin: torch.Tensor, positions, token_shape) -> torch.Tensor:
    """``max(|c_a|, |c_b|, |s_a|, |s_b|)`` per token and pair -> ``[tokens..., 1, half]`` fp64."""
    pos, _ = token_positions(positions, token_shape, cos.device)
    c, s, _ = gather_tables(cos.abs(), sin.abs(), pos, torch.float64)
    half = c.shape[-1] // 2
    parts = torch.stack((c[..., :half], c[..., half:], s[..., :half], s[..., half:]))
    return parts.amax(0).unsqueeze(-2)


def rope_tolerance(
    x_rope: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions,
    truth: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    interleaved_in: bool,
    interleaved_out: bool,
    summed_terms: int = 1,
) -> torch.Tensor:
    """Per-element tolerance for rotated channels.

    ``x_rope: [tokens..., H, R]`` fp64 input rope channels (for a head sum: the sum over heads
    of ``|g_h|``, with ``summed_terms = H``); ``truth: [tokens..., H, R]`` the fp64 result in
    the output layout.
    """
    a, b = split_pairs(x_rope.abs().double(), interleaved_in)
    bound = (a + b) * table_bound(cos, sin, positions, x_rope.shape[:-2])
    arith = (3 + (summed_terms - 1)) * U32 * bound
    arith = join_pairs(arith, arith, interleaved_out)
    return arith + ulp(truth.abs() + arith, out_dtype)


def wrong_elements(out: torch.Tensor, truth: torch.Tensor, tol: torch.Tensor) -> int:
    """How many elements break the error model (NaN where the truth is not, or vice versa,
    counts as wrong)."""
    out64 = out.double()
    nan_out, nan_truth = out64.isnan(), truth.isnan()
    err = (out64 - truth).abs().masked_fill(nan_truth | nan_out, 0.0)
    wrong = (err > tol.masked_fill(nan_truth, 0.0)) | (nan_out != nan_truth)
    return int(wrong.sum())


def assert_close_elementwise(
    out: torch.Tensor, truth: torch.Tensor, tol: torch.Tensor, what: str = "output"
) -> None:
    """Every element within its tolerance; NaN exactly where the truth is NaN."""
    out64 = out.double()
    nan_out, nan_truth = out64.isnan(), truth.isnan()
    if not torch.equal(nan_out, nan_truth):
        where = (nan_out != nan_truth).nonzero()[0].tolist()
        raise AssertionError(
            f"{what}: NaN mismatch at {where}: got {out64[tuple(where)].item()}, "
            f"expected {truth[tuple(where)].item()} ({int((nan_out != nan_truth).sum())} elements)"
        )
    err = (out64 - truth).abs().masked_fill(nan_truth, 0.0)
    excess = err - tol.masked_fill(nan_truth, 0.0)
    if bool((excess > 0).any()):
        flat = int(excess.flatten().argmax())
        where = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), excess.shape))
        raise AssertionError(
            f"{what}: {int((excess > 0).sum())} of {excess.numel()} elements outside the error "
            f"model; worst at {list(where)}: got {out64[where].item()!r}, fp64 reference "
            f"{truth[where].item()!r}, error {err[where].item():.3e} > tolerance "
            f"{tol[where].item():.3e}"
        )


def poisoned_like(t: torch.Tensor, shape=None) -> torch.Tensor:
    """A NaN-filled tensor, so an element the kernel never writes fails the comparison."""
    return torch.full(tuple(shape or t.shape), float("nan"), dtype=t.dtype, device=t.device)
