"""The latent op against transformers' own ``DeepseekV3RMSNorm`` and rotary functions: forward
and backward within our error model plus transformers' own, and special values (zeros,
infinities, NaN) as transformers' module computes them.
"""

from __future__ import annotations

import pytest
import torch

import mlarope
from tests.errmodel import U32, assert_close_elementwise, join_pairs, split_pairs, table_bound, ulp
from tests.harness import random_tables
from tests.latent_harness import (
    Case,
    dx_tolerance,
    exact_norm,
    forward_truth,
    host_checked,
    latent_tolerance,
    make_grads,
    make_inputs,
    norm_units,
    rope_truth,
    weight_truth,
)

hf = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")


def _hf_tables(batch, seq, rope, dtype, device):
    """transformers' per-token tables ``[B, S, R]`` (YaRN, DeepSeek-V3's), for per-row
    positions with offsets, from its own rotary embedding."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        hidden_size=64, num_attention_heads=2, qk_rope_head_dim=rope, kv_lora_rank=32,
        q_lora_rank=None, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=8192,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    )  # fmt: skip
    rotary = hf.DeepseekV3RotaryEmbedding(config).to(device)
    ids = torch.arange(seq, device=device)[None, :] + torch.tensor([[0], [1000]], device=device)
    x = torch.zeros(batch, seq, 8, dtype=dtype, device=device)
    return rotary(x, ids[:batch])


def _hf_latent(ckv, weight, cos, sin, n_latent, eps, interleave):
    """transformers' DeepSeek-V3 attention from ``compressed_kv`` to ``(kv_nope, k_rot)``."""
    batch, seq = ckv.shape[:2]
    kv_nope, k_rot = torch.split(ckv, [n_latent, ckv.shape[-1] - n_latent], dim=-1)
    norm = hf.DeepseekV3RMSNorm(n_latent, eps=eps).to(device=ckv.device, dtype=weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    norm.weight.requires_grad_(weight.requires_grad)
    kv_nope = norm(kv_nope)
    k_rot = k_rot.view(batch, 1, seq, -1)
    rotate = hf.apply_rotary_pos_emb_interleave if interleave else hf.apply_rotary_pos_emb
    _, k_rot = rotate(k_rot, k_rot, cos, sin)
    return kv_nope, k_rot.view(batch, seq, -1), norm.weight


def _product_rounding(x, cos2d, sin2d, positions, interleaved_in, interleaved_out, dtype):
    """transformers' rotation computed in a 16-bit ``dtype`` (its tables' and input's): each
    product and the sum rounded, ``1.5 ulp(|a c| + |b s|)`` per element (``x: [tokens..., R]``)."""
    if dtype == torch.float32:
        return torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    a, b = split_pairs(x.abs().double(), interleaved_in)
    bound = (a + b) * table_bound(cos2d, sin2d, positions, x.shape[:-1]).squeeze(-2)
    return join_pairs(*(1.5 * ulp(bound, dtype),) * 2, interleaved_out)


HF_CASES = [
    (torch.float32, None, True),
    (torch.float32, None, False),
    (torch.bfloat16, None, True),
    (torch.bfloat16, None, False),
    (torch.bfloat16, torch.float32, True),  # fp32 weight, bf16 input: an fp32 latent
]


@pytest.mark.parametrize("dtype, weight_dtype, interleave", HF_CASES)
def test_matches_transformers(dtype, weight_dtype, interleave, device):
    """Forward and backward against transformers' ``DeepseekV3RMSNorm`` and rotary function, on
    the tables its rotary embedding gathers (``[B, S, R]`` as a ``[B * S, R]`` table and
    ``position_ids = b * S + s``, as the integration passes them): each difference within our
    error model plus transformers' own (its sums in an order of their own; in bf16 its
    rotation's products, the norm's ``g * w`` and the weight gradient's products rounded)."""
    batch, seq, n_latent, rope, eps = 2, 7, 96, 64, 1e-6
    case = Case(tokens=(batch, seq), latent=n_latent, rope=rope, dtype=dtype,
                weight_dtype=weight_dtype, interleaved=interleave, eps=eps)  # fmt: skip
    ckv, weight, *_ = make_inputs(case, device)
    cos, sin = _hf_tables(batch, seq, rope, dtype, device)
    cos2d, sin2d = cos.reshape(batch * seq, rope), sin.reshape(batch * seq, rope)
    ids = torch.arange(batch * seq, device=device).view(batch, seq)
    kw = dict(kv_lora_rank=n_latent, eps=eps, layout="bshd", position_ids=ids,
              interleaved=interleave)  # fmt: skip
    _, _, _, _, positions, _ = host_checked(
        ckv, weight, cos2d, sin2d, {**kw, "interleaved_out": False}
    )

    x = ckv.detach().requires_grad_(True)
    w = weight.detach().requires_grad_(True)
    latent, k_pe = mlarope.rmsnorm_rope_latent(x, w, cos2d, sin2d, **kw)
    x_hf = ckv.detach().requires_grad_(True)
    latent_hf, k_pe_hf, w_hf = _hf_latent(x_hf, w.detach().requires_grad_(True), cos, sin,
                                          n_latent, eps, interleave)  # fmt: skip
    assert latent.dtype == latent_hf.dtype and k_pe.dtype == k_pe_hf.dtype

    units = norm_units(n_latent)
    units_hf = norm_units(n_latent, extra_order=n_latent)
    truth, _, _, pe_tol = forward_truth(ckv, weight, cos2d, sin2d, positions, case)
    r, h = exact_norm(ckv, n_latent, eps)
    out_dtype = latent.dtype
    tol = latent_tolerance(h, weight, truth, dtype, out_dtype, units)
    tol = tol + latent_tolerance(h, weight, truth, dtype, out_dtype, units_hf)
    assert_close_elementwise(latent, latent_hf.double(), tol, "latent vs transformers")
    rope_in = ckv[..., n_latent:]
    pe_tol_hf = pe_tol + _product_rounding(rope_in, cos2d, sin2d, positions, interleave, False,
                                           dtype)  # fmt: skip
    assert_close_elementwise(k_pe, k_pe_hf.double(), pe_tol + pe_tol_hf, "k_pe vs transformers")

    g_latent, g_pe = make_grads(ckv, weight, case)
    torch.autograd.backward((latent, k_pe), (g_latent, g_pe))
    torch.autograd.backward((latent_hf, k_pe_hf), (g_latent, g_pe))
    dh = g_latent.double() * weight.double()
    dx = x_hf.grad[..., :n_latent].double()
    # autograd hands h.to(bf16) a bf16 gradient g * w (rounded), whatever the weight's dtype
    dh_rel_hf = 2.0**-8 if dtype == torch.bfloat16 else U32
    tol_dx = dx_tolerance(r, h, dh, dx, dtype, units, U32)
    tol_dx = tol_dx + dx_tolerance(r, h, dh, dx, dtype, units_hf, dh_rel_hf)
    assert_close_elementwise(x.grad[..., :n_latent], dx, tol_dx, "d_ckv latent vs transformers")
    _, d_pe_tol = rope_truth(g_pe, cos2d, sin2d, positions, case, True)
    d_pe_tol_hf = d_pe_tol + _product_rounding(g_pe, cos2d, sin2d, positions, False, interleave,
                                               dtype)  # fmt: skip
    assert_close_elementwise(x.grad[..., n_latent:], x_hf.grad[..., n_latent:].double(),
                             d_pe_tol + d_pe_tol_hf, "d_ckv rope vs transformers")  # fmt: skip
    _, tol_w = weight_truth(g_latent, h, weight, dtype, units)
    term_rel_hf = 2.0**-8 if out_dtype == torch.bfloat16 else U32
    _, tol_w_hf = weight_truth(g_latent, h, weight, dtype, units, term_rel=term_rel_hf,
                               levels=batch * seq + 1)  # fmt: skip
    assert_close_elementwise(w.grad, w_hf.grad.double(), tol_w + tol_w_hf, "d_weight vs hf")


# Triton's interpreter (numpy) warns on inf - inf, which the exact sum's finiteness test computes.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_special_values_as_transformers(device):
    """Rows of zeros (``var = 0``: ``h = 0``), with an infinity (``var = inf``: ``r = 0``, so the
    infinity's own ``h`` is NaN and the others 0) and with a NaN (all NaN), as transformers'
    module computes them."""
    n_latent, eps = 32, 1e-6
    ckv = torch.randn(1, 4, n_latent + 32, device=device)
    ckv[0, 0, :n_latent] = 0.0
    ckv[0, 1, 3] = float("inf")
    ckv[0, 2, 5] = float("-inf")
    ckv[0, 3, 7] = float("nan")
    weight = torch.randn(n_latent, device=device)
    cos, sin = random_tables(8, 32, torch.float32, device)
    latent, _ = mlarope.rmsnorm_rope_latent(
        ckv, weight, cos, sin, kv_lora_rank=n_latent, eps=eps, layout="bshd"
    )
    want, _, _ = _hf_latent(ckv, weight, cos[None, :4], sin[None, :4], n_latent, eps, True)
    assert torch.equal(latent.isnan(), want.isnan()) and latent[0, 3].isnan().all()
    assert torch.equal(latent.nan_to_num(7.0), want.nan_to_num(7.0))
    assert latent[0, 1].isnan().sum() == 1 and latent[0, 0].eq(0).all()
