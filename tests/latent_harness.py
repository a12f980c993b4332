"""The latent op's test harness: cases, inputs, launches into NaN-poisoned outputs, and the fp64
truth with per-element tolerances derived from the error model. ``tests/test_latent*.py`` build
on it.

Shapes (``tokens...`` is ``[S, B]`` for sbhd, ``[B, S]`` for bshd, ``[T]`` for thd):
``ckv: [tokens..., L + R]``, ``weight: [L]``, ``latent: [tokens..., L]``, ``k_pe: [tokens..., R]``.

The error model of the RMSNorm (docs/semantics.md). ``h = x * r`` with ``r = 1 / sqrt(var + eps)``
is computed in fp32 from an exact sum of squares (``_latent_sums``: within ``2**-40`` of the
exact value, relatively), divided by ``L`` in float64 and rounded to fp32 (one unit
``u = 2**-24``), then the addition of ``eps``, the square root (which halves a relative error),
the reciprocal and the product ``x * r``, one unit each: ``h`` is within ``E * |h|`` of the
exact value, ``E = 8u`` (generous by a few units). ``h`` rounded to the input dtype (one ulp),
times the weight in fp32 (one unit), rounded to the latent's dtype (one ulp). The backward
``dx = r * (dh - h_hat * m)``, ``m = sum(dh * h_hat) / L`` (the sum exact, then one unit): the
errors of ``r``, ``h_hat``, ``dh`` and ``m``, each a few ``E`` relative to the terms they
multiply, ``r * ((|dh| + |h_hat m|) * 3E + |h_hat| * mean(|dh h_hat|) * 2E)``, then one ulp.
The weight's gradient: the exact tile sums, their float64 sum and its rounding to an fp32
partial (one unit of the sum of ``|g h_r|``), the exact sum of the partials and its rounding to
fp32 (one more), plus ``h_r``'s own error per term (``E |h|`` in fp32; in 16 bits none unless
``h`` lies within ``E |h|`` of a rounding tie, then one ulp), then one ulp of the weight's
dtype. Another implementation of the same function (transformers' module) sums in an order of
its own: any order of ``n`` terms is within ``(n - 1) u`` relatively.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mlarope import reference
from mlarope.latent import check_latent_call
from tests.errmodel import U32, poisoned_like, rope_tolerance, ulp
from tests.harness import fused_multiply_add, random_tables


@dataclass
class Case:
    """One latent-op call: shapes, dtypes, pair layouts, position source, memory layout."""

    layout: str = "bshd"
    tokens: tuple = (2, 5)
    latent: int = 96
    rope: int = 64
    dtype: torch.dtype = torch.bfloat16
    weight_dtype: torch.dtype | None = None  # None: the input's dtype
    table_dtype: torch.dtype = torch.float32
    interleaved: bool = True
    interleaved_out: bool = False
    source: str = "seq"  # seq | cu | ids
    strided: bool = False
    table_rows: int = 64
    eps: float = 1e-6

    @property
    def w_dtype(self) -> torch.dtype:
        return self.weight_dtype or self.dtype


# thd: an empty sequence, a short one, and a padded tail (15 tokens, cu_seqlens[-1] = 13).
CU_SEQLENS = torch.tensor([0, 3, 3, 4, 13], dtype=torch.int32)


def make_inputs(case: Case, device):
    """-> ``(ckv, weight, cos, sin, kwargs)``: ``ckv`` rows of magnitudes from 1e-2 to 1e2 (maybe
    a strided, misaligned slice of a wider tensor), a weight of both signs, ``kwargs`` the
    layout, position source, ``kv_lora_rank`` and ``eps`` as the public call takes them
    (``position_ids`` with one out-of-range row: a NaN ``k_pe`` row)."""
    width = case.latent + case.rope
    scale = 10.0 ** (4 * torch.rand(*case.tokens, 1) - 2)
    if case.strided:
        if len(case.tokens) == 2:
            big = torch.randn(case.tokens[1], case.tokens[0], width + 7).transpose(0, 1)
        else:
            big = torch.randn(case.tokens[0], 2, width + 7)[:, 1]
        ckv = (big * scale).to(case.dtype).to(device)[..., 3 : 3 + width]
        assert ckv.stride(-1) == 1 and not ckv.is_contiguous()
    else:
        ckv = (torch.randn(*case.tokens, width) * scale).to(case.dtype).to(device)
    weight = (torch.randn(case.latent) * 0.5 + 1.0).to(case.w_dtype).to(device)
    cos, sin = random_tables(case.table_rows, case.rope, case.table_dtype, device)
    kwargs = dict(layout=case.layout, kv_lora_rank=case.latent, eps=case.eps)
    kwargs.update(interleaved=case.interleaved, interleaved_out=case.interleaved_out)
    if case.source == "cu":
        kwargs["cu_seqlens"] = CU_SEQLENS.to(device)
    elif case.source == "ids":
        n = math.prod(case.tokens)
        ids = torch.randint(0, case.table_rows, (n,))
        ids[1] = case.table_rows + 3  # out of range: NaN row
        kwargs["position_ids"] = ids.reshape(case.tokens).to(device)
    return ckv, weight, cos, sin, kwargs


def host_checked(ckv, weight, cos, sin, kwargs):
    """The public call's checks -> ``(ckv, weight, cos2d, sin2d, positions, eps)``."""
    return check_latent_call(
        ckv, weight, cos, sin, kwargs["kv_lora_rank"], kwargs["eps"], kwargs["layout"],
        kwargs.get("cu_seqlens"), kwargs.get("position_ids"), 0, 1, kwargs["interleaved"],
        kwargs["interleaved_out"],
    )  # fmt: skip


def checked(case, device):
    """``case``'s inputs, with the tables and positions its host checks give the kernels."""
    ckv, weight, cos, sin, kwargs = make_inputs(case, device)
    _, _, cos2d, sin2d, positions, _ = host_checked(ckv, weight, cos, sin, kwargs)
    return ckv, weight, cos, sin, kwargs, cos2d, sin2d, positions


def make_grads(ckv, weight, case: Case):
    """Upstream gradients ``g_latent: [tokens..., L]`` (the latent's dtype) and
    ``g_pe: [tokens..., R]``."""
    tokens = ckv.shape[:-1]
    out_dtype = reference.latent_dtype(ckv.dtype, weight.dtype)
    g_latent = torch.randn(*tokens, case.latent).to(out_dtype).to(ckv.device)
    g_pe = torch.randn(*tokens, case.rope).to(ckv.dtype).to(ckv.device)
    return g_latent, g_pe


def launch_forward(ckv, weight, cos2d, sin2d, positions, case: Case, config=None):
    """The forward launcher into NaN-poisoned outputs."""
    from mlarope.kernels.latent import latent_launch

    tokens = ckv.shape[:-1]
    out_dtype = reference.latent_dtype(ckv.dtype, weight.dtype)
    latent = torch.full((*tokens, case.latent), float("nan"), dtype=out_dtype, device=ckv.device)
    k_pe = torch.full((*tokens, case.rope), float("nan"), dtype=ckv.dtype, device=ckv.device)
    latent_launch(
        ckv, weight, latent, k_pe, cos2d, sin2d, positions, eps=case.eps,
        interleaved_in=case.interleaved, interleaved_out=case.interleaved_out, config=config,
    )  # fmt: skip
    return latent, k_pe


def launch_backward(g_latent, g_pe, ckv, weight, cos2d, sin2d, positions, case: Case, config=None,
                    weight_grad=True):  # fmt: skip
    """The backward launchers into NaN-poisoned outputs -> ``(d_ckv, d_weight)``."""
    from mlarope.kernels.latent import latent_backward_launch

    d_ckv = poisoned_like(ckv, ckv.shape).contiguous()
    d_weight = poisoned_like(weight) if weight_grad else None
    latent_backward_launch(
        g_latent, g_pe, ckv, weight, d_ckv, d_weight, cos2d, sin2d, positions, eps=case.eps,
        interleaved_in=case.interleaved, interleaved_out=case.interleaved_out, config=config,
    )  # fmt: skip
    return d_ckv, d_weight


# ------------------------------------------------------------------------------- the truth
def norm_units(n_latent: int, extra_order: int = 0) -> float:
    """``E``: the relative error of fp32 ``h`` and ``r`` (module docstring); ``extra_order``:
    an implementation whose sum is in an unknown order (``L - 1`` units for any order)."""
    return (8 + extra_order) * U32


def exact_norm(ckv: torch.Tensor, n_latent: int, eps: float):
    """fp64 ``(r, h_hat)`` of ``ckv[..., :L]``."""
    x = ckv[..., :n_latent].double()
    r = 1.0 / torch.sqrt((x * x).mean(-1) + eps)
    return r, x * r[..., None]


def latent_tolerance(h, weight, truth, in_dtype, out_dtype, units: float) -> torch.Tensor:
    """Per element: ``|w| (E |h| + ulp_in(h))`` (``h``'s error and its rounding to the input
    dtype), one unit of the fp32 product, one ulp of the latent's dtype."""
    w = weight.double().abs()
    arith = w * (units * h.abs() + ulp(h.abs() * (1 + units), in_dtype))
    arith = arith + U32 * (truth.abs() + arith)
    return arith + ulp(truth.abs() + arith, out_dtype)


def forward_truth(ckv, weight, cos2d, sin2d, positions, case: Case):
    """-> ``(latent*, k_pe*, tol_latent, tol_pe)``: fp64 truth and tolerances."""
    _, h = exact_norm(ckv, case.latent, case.eps)
    latent = weight.double() * h
    out_dtype = reference.latent_dtype(ckv.dtype, weight.dtype)
    tol_latent = latent_tolerance(h, weight, latent, ckv.dtype, out_dtype, norm_units(case.latent))
    k_pe, tol_pe = rope_truth(ckv[..., case.latent :], cos2d, sin2d, positions, case, False)
    return latent, k_pe, tol_latent, tol_pe


def rope_truth(x, cos2d, sin2d, positions, case: Case, transpose: bool):
    """fp64 rotation (``transpose``: the backward's, layouts swapped) of ``x: [tokens..., R]``
    and its tolerance (``errmodel.rope_tolerance``)."""
    il_in, il_out = case.interleaved, case.interleaved_out
    if transpose:
        il_in, il_out = il_out, il_in
    truth = reference._rotate_k_pe(
        x.double(), cos2d.double(), sin2d.double(), positions, il_in, il_out, transpose
    )
    tol = rope_tolerance(
        x.double().unsqueeze(-2), cos2d, sin2d, positions, truth.unsqueeze(-2), x.dtype,
        interleaved_in=il_in, interleaved_out=il_out,
    ).squeeze(-2)  # fmt: skip
    return truth, tol


def dx_tolerance(r, h, dh, truth, in_dtype, units: float, dh_rel: float) -> torch.Tensor:
    """The latent part of ``d_ckv``: ``r ((|dh| + |h m|) 3E + |h| mean|dh h| 2E)`` with ``dh``
    itself within ``dh_rel`` (relative), then one ulp of the input dtype."""
    m = (dh * h).mean(-1, keepdim=True)
    a = (dh * h).abs().mean(-1, keepdim=True)
    r = r[..., None]
    arith = r * (
        dh.abs() * (3 * units + dh_rel)
        + (h * m).abs() * 3 * units
        + h.abs() * a * (2 * units + dh_rel)
    )
    return arith + ulp(truth.abs() + arith, in_dtype)


def _tie_flips(h: torch.Tensor, dtype: torch.dtype, units: float) -> torch.Tensor:
    """Per element, the rounding of ``h`` to ``dtype`` that an error of ``units * |h|`` can move
    across a tie: 0 or one ulp."""
    if dtype in (torch.float32, torch.float64):
        return torch.zeros_like(h)
    up = (h * (1 + units)).to(dtype).double()
    down = (h * (1 - units)).to(dtype).double()
    return (up - down).abs()


# The weight gradient's roundings relative to the sum of |g h_r| (module docstring), generously.
WEIGHT_SUM_UNITS = 3


def backward_truth(g_latent, g_pe, ckv, weight, cos2d, sin2d, positions, case: Case):
    """-> ``(d_ckv*, d_weight*, tol_d_ckv, tol_d_weight)``: fp64 truth and tolerances."""
    n_latent = case.latent
    units = norm_units(n_latent)
    r, h = exact_norm(ckv, n_latent, case.eps)
    dh = g_latent.double() * weight.double()
    m = (dh * h).mean(-1, keepdim=True)
    dx = r[..., None] * (dh - h * m)
    tol_dx = dx_tolerance(r, h, dh, dx, ckv.dtype, units, U32)
    d_pe, tol_pe = rope_truth(g_pe, cos2d, sin2d, positions, case, True)
    d_weight, tol_dw = weight_truth(g_latent, h, weight, ckv.dtype, units)
    return torch.cat((dx, d_pe), -1), d_weight, torch.cat((tol_dx, tol_pe), -1), tol_dw


def weight_truth(g_latent, h, weight, in_dtype, units, term_rel=0.0, levels=None):
    """``sum_t g * h_r`` in fp64 with ``h_r = round(h*, in_dtype)`` and its tolerance;
    ``term_rel``: another implementation's relative error per product (transformers' rounded
    product), ``levels``: its summation's units (default ours)."""
    L = h.shape[-1]
    g = g_latent.double().reshape(-1, L)
    h = h.reshape(-1, L)
    unrounded = in_dtype in (torch.float32, torch.float64)  # h_r is the fp32 h itself
    h_r = h if unrounded else h.to(in_dtype).double()
    truth = (g * h_r).sum(0)
    h_error = h.abs() * units if unrounded else _tie_flips(h, in_dtype, units)
    per_term = g.abs() * h_error
    levels = WEIGHT_SUM_UNITS if levels is None else levels
    arith = per_term.sum(0) + (levels * U32 + term_rel) * (g * h_r).abs().sum(0)
    return truth, arith + ulp(truth.abs() + arith, weight.dtype)


def fused_fma(x, y, z):
    """``_latent_sums.fma`` as the kernels compute it where they fuse: one rounding in fp32."""
    if x.dtype != torch.float32:
        return x * y + z
    x, y, z = torch.broadcast_tensors(x, y, z)
    return fused_multiply_add(x, y, z)
