"""The latent op (``mlarope.rmsnorm_rope_latent``): forward and backward against the fp64
reference with tolerances from the error model (``tests/latent_harness.py``), against
transformers' own ``DeepseekV3RMSNorm`` and rotary functions, the backends bit for bit,
determinism, the error contract, every autograd mode and ``torch.compile``.

Runs on the ``device`` fixture: CPU tensors under Triton's interpreter in the CPU lane, CUDA in
the GPU lane.
"""

from __future__ import annotations

import itertools
import math
import os
import re

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

import mlarope
from mlarope import _latent_sums, reference
from mlarope.kernels.latent import LatentLaunchConfig, choose_latent_config
from tests.errmodel import (
    U32,
    assert_close_elementwise,
    join_pairs,
    split_pairs,
    table_bound,
    ulp,
)
from tests.harness import (
    bitwise_equal,
    fused_multiply_add,
    fused_reference,
    kernels_fuse,
    random_tables,
    reference_backend,
)
from tests.latent_harness import (
    Case,
    backward_truth,
    dx_tolerance,
    exact_norm,
    forward_truth,
    host_checked,
    latent_tolerance,
    launch_backward,
    launch_forward,
    make_grads,
    make_inputs,
    norm_units,
    rope_truth,
    weight_truth,
)


def cases():
    yield Case()
    for latent, rope in itertools.product((512, 96, 32), (64, 32)):
        yield Case(latent=latent, rope=rope, tokens=(1, 9) if latent == 512 else (2, 5))
    for dtype, weight_dtype in itertools.product(
        (torch.bfloat16, torch.float16, torch.float32), (None, torch.float32)
    ):
        yield Case(dtype=dtype, weight_dtype=weight_dtype)
    yield Case(dtype=torch.bfloat16, weight_dtype=torch.float16)  # promoted to fp32
    yield Case(dtype=torch.float32, latent=512, tokens=(1, 9))
    yield Case(dtype=torch.float16, latent=512, tokens=(1, 9))
    for il, il_out in itertools.product((True, False), (True, False)):
        yield Case(interleaved=il, interleaved_out=il_out, dtype=torch.float32)
    yield Case(layout="sbhd", tokens=(5, 2))
    yield Case(layout="thd", tokens=(15,), source="cu")
    yield Case(layout="thd", tokens=(11,), source="seq")
    yield Case(layout="thd", tokens=(9,), source="ids", dtype=torch.float32)
    yield Case(layout="bshd", tokens=(2, 5), source="ids")
    yield Case(strided=True)
    yield Case(strided=True, layout="thd", tokens=(15,), source="cu", dtype=torch.float32)
    yield Case(table_dtype=torch.bfloat16)
    yield Case(latent=5, rope=32, dtype=torch.float32)  # odd width, padded to 8
    yield Case(latent=1, rope=32)
    yield Case(eps=0.5, dtype=torch.float32)


CASES = list(cases())
IDS = [f"case{i}" for i in range(len(CASES))]


def _checked(case, device):
    ckv, weight, cos, sin, kwargs = make_inputs(case, device)
    _, _, cos2d, sin2d, positions, _ = host_checked(ckv, weight, cos, sin, kwargs)
    return ckv, weight, cos, sin, kwargs, cos2d, sin2d, positions


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward_against_fp64(case, device):
    """Every element of both outputs within the error model of the fp64 truth, launched into
    NaN-poisoned outputs (an element left unwritten fails); the public call gives the same bits
    and leaves ``ckv`` untouched."""
    ckv, weight, cos, sin, kwargs, cos2d, sin2d, positions = _checked(case, device)
    before = ckv.clone()
    latent, k_pe = launch_forward(ckv, weight, cos2d, sin2d, positions, case)
    truth, pe_truth, tol, pe_tol = forward_truth(ckv, weight, cos2d, sin2d, positions, case)
    assert latent.dtype == reference.latent_dtype(case.dtype, case.w_dtype)
    assert_close_elementwise(latent, truth, tol, f"latent {case}")
    assert_close_elementwise(k_pe, pe_truth, pe_tol, f"k_pe {case}")
    got_latent, got_pe = mlarope.rmsnorm_rope_latent(ckv, weight, cos, sin, **kwargs)
    assert bitwise_equal(got_latent, latent) and got_latent.is_contiguous()
    assert bitwise_equal(got_pe, k_pe) and got_pe.is_contiguous()
    assert got_latent.shape == (*ckv.shape[:-1], case.latent)
    assert bitwise_equal(ckv, before), "the input is untouched"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_backward_against_fp64(case, device):
    """``d_ckv`` (latent and rope parts, one buffer) and ``d_weight`` within the error model,
    launched into NaN-poisoned outputs; autograd through the public call gives the same bits."""
    ckv, weight, cos, sin, kwargs, cos2d, sin2d, positions = _checked(case, device)
    g_latent, g_pe = make_grads(ckv, weight, case)
    d_ckv, d_weight = launch_backward(g_latent, g_pe, ckv, weight, cos2d, sin2d, positions, case)
    truth, w_truth, tol, w_tol = backward_truth(
        g_latent, g_pe, ckv, weight, cos2d, sin2d, positions, case
    )
    assert_close_elementwise(d_ckv, truth, tol, f"d_ckv {case}")
    assert_close_elementwise(d_weight, w_truth, w_tol, f"d_weight {case}")

    x = ckv.detach().requires_grad_(True)
    w = weight.detach().requires_grad_(True)
    latent, k_pe = mlarope.rmsnorm_rope_latent(x, w, cos, sin, **kwargs)
    torch.autograd.backward((latent, k_pe), (g_latent, g_pe))
    assert bitwise_equal(x.grad, d_ckv.view(ckv.shape))
    assert bitwise_equal(w.grad, d_weight)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_normalized_value_rounded_to_the_input_dtype(dtype, device):
    """transformers' module rounds ``h`` to the input dtype before the weight multiplies it: with
    an fp32 weight of powers of two the fp32 latent is exactly ``w * h_r``, so ``latent / w`` is
    a value of the input dtype (an unrounded ``h`` is not: the error model's ulp would hide it)."""
    case = Case(dtype=dtype, weight_dtype=torch.float32)
    ckv, _, cos, sin, kwargs, *_ = _checked(case, device)
    weight = 2.0 ** torch.randint(-3, 4, (case.latent,), device=device).float()
    latent, _ = mlarope.rmsnorm_rope_latent(ckv, weight, cos, sin, **kwargs)
    h = latent / weight
    assert latent.dtype == torch.float32 and torch.equal(h.to(dtype).float(), h)
    _, exact = exact_norm(ckv, case.latent, case.eps)
    assert (exact.to(dtype).double() != exact).all(), "the exact values need the rounding"


def test_weight_gradient_over_many_tokens(device, monkeypatch):
    """1,100 tokens: the exact sum of 35 program partials (two steps of the sum's loop), the last
    one partly padding; the fp64 truth, and the reference's bits (no fused multiply-add: bf16
    products are exact)."""
    case = Case(layout="thd", tokens=(1100,), latent=32, rope=32, table_rows=1100)
    ckv, weight, _, _, _, cos2d, sin2d, positions = _checked(case, device)
    g_latent, g_pe = make_grads(ckv, weight, case)
    d_ckv, d_weight = launch_backward(g_latent, g_pe, ckv, weight, cos2d, sin2d, positions, case)
    _, w_truth, _, w_tol = backward_truth(
        g_latent, g_pe, ckv, weight, cos2d, sin2d, positions, case
    )
    assert_close_elementwise(d_weight, w_truth, w_tol, "d_weight over 2,100 tokens")
    if kernels_fuse(device):  # the reference with the kernels' fused multiply-adds (Triton 3.7+)
        fused_reference(monkeypatch)
        monkeypatch.setattr(_latent_sums, "fma", _fused_fma)
    ref_ckv, ref_weight = reference.rmsnorm_rope_latent_backward(
        g_latent, g_pe, ckv, weight, cos2d, sin2d, positions, eps=case.eps,
        interleaved_in=True, interleaved_out=False,
    )  # fmt: skip
    assert bitwise_equal(d_weight, ref_weight)
    assert bitwise_equal(d_ckv, ref_ckv)


def test_no_weight_gradient(device):
    """A frozen weight: the backward skips its sum (one launch), ``d_ckv`` has the same bits."""
    case = Case(dtype=torch.float32)
    ckv, weight, cos, sin, kwargs, cos2d, sin2d, positions = _checked(case, device)
    g_latent, g_pe = make_grads(ckv, weight, case)
    full, _ = launch_backward(g_latent, g_pe, ckv, weight, cos2d, sin2d, positions, case)
    alone, none = launch_backward(
        g_latent, g_pe, ckv, weight, cos2d, sin2d, positions, case, weight_grad=False
    )
    assert none is None and bitwise_equal(alone, full)
    x = ckv.detach().requires_grad_(True)
    latent, k_pe = mlarope.rmsnorm_rope_latent(x, weight, cos, sin, **kwargs)
    torch.autograd.backward((latent, k_pe), (g_latent, g_pe))
    assert bitwise_equal(x.grad, full.view(ckv.shape)) and weight.grad is None


def test_no_tokens(device):
    case = Case(layout="thd", tokens=(0,))
    ckv, weight, cos, sin, kwargs, *_ = _checked(case, device)
    x = ckv.detach().requires_grad_(True)
    w = weight.detach().requires_grad_(True)
    latent, k_pe = mlarope.rmsnorm_rope_latent(x, w, cos, sin, **kwargs)
    assert latent.shape == (0, case.latent) and k_pe.shape == (0, case.rope)
    (latent.sum() + k_pe.sum()).backward()
    assert x.grad.shape == x.shape and torch.equal(w.grad, torch.zeros_like(w))


ROTATION_CASES = [
    dict(layout="sbhd", tokens=(5, 2)),
    dict(layout="bshd", tokens=(2, 5), interleaved=False, interleaved_out=True),
    dict(layout="thd", tokens=(15,), cu_seqlens=[0, 3, 3, 4, 13]),
    dict(layout="thd", tokens=(9,), cu_seqlens=[0, 4, 4, 16], cp_size=2, cp_rank=1),
    dict(layout="sbhd", tokens=(4, 2), cp_size=2, cp_rank=0, interleaved_out=True),
    dict(layout="bshd", tokens=(2, 4), position_ids=[[0, 9, 3, 70], [1, 1, 2, 63]]),
]


@pytest.mark.parametrize("spec", ROTATION_CASES, ids=[str(i) for i in range(len(ROTATION_CASES))])
def test_k_pe_is_the_query_ops_rotation(spec, device):
    """Every position source (context parallel included): ``k_pe`` and its gradient are
    :func:`mlarope.apply_rope_q`'s rotation of ``ckv[..., L:]`` as a one-head query, bit for
    bit, and the latent does not depend on the positions."""
    spec = dict(spec)
    tokens = spec.pop("tokens")
    for name in ("cu_seqlens", "position_ids"):
        if name in spec:
            spec[name] = torch.tensor(spec[name], device=device)
    n_latent, rope = 32, 64
    ckv = torch.randn(*tokens, n_latent + rope, device=device).to(torch.bfloat16)
    weight = torch.randn(n_latent, device=device).to(torch.bfloat16)
    cos, sin = random_tables(64, rope, torch.float32, device)
    g_pe = torch.randn(*tokens, rope, device=device).to(torch.bfloat16)
    x = ckv.detach().requires_grad_(True)
    latent, k_pe = mlarope.rmsnorm_rope_latent(
        x, weight, cos, sin, kv_lora_rank=n_latent, eps=1e-6, **spec
    )
    torch.autograd.backward((latent, k_pe), (torch.zeros_like(latent), g_pe))
    q = ckv[..., n_latent:].detach().unsqueeze(-2).requires_grad_(True)
    want = mlarope.apply_rope_q(q, cos, sin, **spec)
    want.backward(g_pe.unsqueeze(-2))
    assert bitwise_equal(k_pe, want.squeeze(-2))
    assert bitwise_equal(x.grad[..., n_latent:], q.grad.squeeze(-2))
    plain, _ = mlarope.rmsnorm_rope_latent(
        ckv, weight, cos, sin, kv_lora_rank=n_latent, eps=1e-6, layout=spec["layout"]
    )
    assert bitwise_equal(latent, plain)


def test_padding_tokens_pass_through(device):
    """thd tokens past ``cu_seqlens[-1]``: ``k_pe`` re-laid out, not rotated; the latent is
    normalized as any other row."""
    case = Case(layout="thd", tokens=(15,), source="cu", interleaved=True, interleaved_out=False)
    ckv, weight, cos, sin, kwargs, *_ = _checked(case, device)
    _, k_pe = mlarope.rmsnorm_rope_latent(ckv, weight, cos, sin, **kwargs)
    tail = ckv[13:, case.latent :]
    assert torch.equal(k_pe[13:], torch.cat((tail[:, 0::2], tail[:, 1::2]), -1))


# --------------------------------------------------------------------------- determinism
def test_repeated_runs_bitwise(device):
    case = Case(layout="thd", tokens=(75,), source="cu", dtype=torch.float32)
    ckv, weight, cos, sin, kwargs, *_ = _checked(case, device)
    g_latent, g_pe = make_grads(ckv, weight, case)

    def run():
        x = ckv.detach().requires_grad_(True)
        w = weight.detach().requires_grad_(True)
        outs = mlarope.rmsnorm_rope_latent(x, w, cos, sin, **kwargs)
        torch.autograd.backward(outs, (g_latent, g_pe))
        return (*outs, x.grad, w.grad)

    first = run()
    for _ in range(3):
        assert all(bitwise_equal(a, b) for a, b in zip(run(), first, strict=True))


CONFIGS = [
    LatentLaunchConfig(block_t=1, num_warps=1, backward_warps=1, block_c=4, block_p=1, sum_warps=1),
    LatentLaunchConfig(block_t=2, num_warps=2, backward_warps=2, block_c=4, block_p=2, sum_warps=2),
    LatentLaunchConfig(block_t=16, num_warps=8, backward_warps=8, block_c=128, block_p=64,
                       sum_warps=4),
    LatentLaunchConfig(block_t=64, num_warps=4, backward_warps=4, block_c=16, block_p=8,
                       sum_warps=8),
]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_identical_for_every_launch_config(dtype, device):
    """The sums are exact, whatever order the threads add in: every tile size, warp count and
    partial-sum step, the same bits."""
    case = Case(layout="bshd", tokens=(3, 11), latent=96, dtype=dtype, source="ids")
    ckv, weight, _, _, _, cos2d, sin2d, positions = _checked(case, device)
    g_latent, g_pe = make_grads(ckv, weight, case)
    picked = choose_latent_config(33, case.latent)
    results = [
        (
            *launch_forward(ckv, weight, cos2d, sin2d, positions, case, config),
            *launch_backward(g_latent, g_pe, ckv, weight, cos2d, sin2d, positions, case, config),
        )
        for config in [picked, *CONFIGS]
    ]
    for other in results[1:]:
        assert all(bitwise_equal(a, b) for a, b in zip(other, results[0], strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_backends_agree_bitwise(dtype, device, monkeypatch):
    """The PyTorch reference computes the kernels' arithmetic in the kernels' order: the same
    bits (with the kernels' fused multiply-adds where they fuse)."""
    case = Case(layout="thd", tokens=(40,), source="ids", dtype=dtype, latent=96)
    ckv, weight, cos, sin, kwargs, *_ = _checked(case, device)
    g_latent, g_pe = make_grads(ckv, weight, case)

    def run():
        x = ckv.detach().requires_grad_(True)
        w = weight.detach().requires_grad_(True)
        outs = mlarope.rmsnorm_rope_latent(x, w, cos, sin, **kwargs)
        torch.autograd.backward(outs, (g_latent, g_pe))
        return (*outs, x.grad, w.grad)

    kernels = run()
    if kernels_fuse(device):
        fused_reference(monkeypatch)
        monkeypatch.setattr(_latent_sums, "fma", _fused_fma)
    reference_backend(monkeypatch, device)
    for got, want in zip(kernels, run(), strict=True):
        assert bitwise_equal(got, want)


def test_backend_choice_is_the_other_ops(monkeypatch, device):
    """The op takes its backend from ``ops.use_triton``, as the other ops do, so that choosing
    the reference (``tests.harness.reference_backend``, on the GPU lane too) chooses it here."""
    from mlarope import ops
    from mlarope.kernels import latent as kernels

    def refuse(*args, **kwargs):
        raise AssertionError("the kernels ran")

    monkeypatch.setattr(ops, "use_triton", lambda t: False)
    monkeypatch.setattr(kernels, "latent_launch", refuse)
    monkeypatch.setattr(kernels, "latent_backward_launch", refuse)
    case = Case(layout="thd", tokens=(4,))
    ckv, weight, cos, sin, kwargs, *_ = _checked(case, device)
    x = ckv.detach().requires_grad_(True)
    latent, k_pe = mlarope.rmsnorm_rope_latent(x, weight, cos, sin, **kwargs)
    (latent.float().sum() + k_pe.float().sum()).backward()


def _fused_fma(x, y, z):
    if x.dtype != torch.float32:
        return x * y + z
    x, y, z = torch.broadcast_tensors(x, y, z)
    return fused_multiply_add(x, y, z)


# ------------------------------------------------------------------ against transformers
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


# ---------------------------------------------------------------------------- the checks
def _good(device):
    ckv = torch.randn(2, 3, 32 + 64, device=device)
    weight = torch.ones(32, device=device)
    cos, sin = random_tables(8, 64, torch.float32, device)
    return ckv, weight, cos, sin, dict(kv_lora_rank=32, eps=1e-6, layout="bshd")


BAD = [
    ("ckv", lambda c, w: ([1.0], w), {}, TypeError, "ckv must be a torch.Tensor"),
    ("ckv int", lambda c, w: (c.long(), w), {}, TypeError, "ckv must be float32"),
    ("ckv dims", lambda c, w: (c[0], w), {}, ValueError, "ckv must be 3-D [B, S, L + R]"),
    ("ckv stride", lambda c, w: (c.transpose(1, 2).contiguous().transpose(1, 2)[:, :, :],
                                 w), {}, ValueError, "ckv must have a contiguous last dim"),
    ("width", lambda c, w: (c[..., 1:], w), {}, ValueError,
     "ckv.shape[-1] must be kv_lora_rank + R = 32 + 64 = 96"),
    ("weight shape", lambda c, w: (c, w[1:]), {}, ValueError,
     "weight must be [kv_lora_rank] = [32]"),
    ("weight 2-D", lambda c, w: (c, w[None]), {}, ValueError, "weight must be [kv_lora_rank]"),
    ("weight dtype", lambda c, w: (c.bfloat16(), w.double()), {}, TypeError,
     "weight must be float32, float16 or bfloat16 for a torch.bfloat16 ckv"),
    ("weight int", lambda c, w: (c, w.int()), {}, TypeError, "weight must be float32"),
    ("weight stride", lambda c, w: (c, torch.ones(64, device=c.device)[::2]), {}, ValueError,
     "weight must have a contiguous last dim"),
    ("weight device", lambda c, w: (c, w.to("meta")), {}, ValueError,
     "weight must be on ckv's device"),
    ("rank bool", lambda c, w: (c, w), {"kv_lora_rank": True}, TypeError,
     "kv_lora_rank must be an int"),
    ("rank 0", lambda c, w: (c, w), {"kv_lora_rank": 0}, ValueError, "kv_lora_rank must be >= 1"),
    ("rank", lambda c, w: (c, w), {"kv_lora_rank": 31}, ValueError,
     "weight must be [kv_lora_rank] = [31]"),
    ("eps 0", lambda c, w: (c, w), {"eps": 0.0}, ValueError, "eps must be a finite number > 0"),
    ("eps < 0", lambda c, w: (c, w), {"eps": -1e-6}, ValueError, "got -1e-06"),
    ("eps nan", lambda c, w: (c, w), {"eps": math.nan}, ValueError, "got nan"),
    ("eps inf", lambda c, w: (c, w), {"eps": math.inf}, ValueError, "got inf"),
    ("eps str", lambda c, w: (c, w), {"eps": "1e-6"}, TypeError, "eps must be a float"),
    ("eps bool", lambda c, w: (c, w), {"eps": True}, TypeError, "eps must be a float"),
    ("eps tensor", lambda c, w: (c, w), {"eps": torch.tensor(1e-6)}, TypeError,
     "eps must be a float"),
    ("layout", lambda c, w: (c, w), {"layout": "bhsd"}, ValueError, "layout must be one of"),
    ("interleaved", lambda c, w: (c, w), {"interleaved": 1}, TypeError,
     "interleaved must be a bool"),
    ("interleaved_out", lambda c, w: (c, w), {"interleaved_out": None}, TypeError,
     "interleaved_out must be a bool"),
    ("cu_seqlens", lambda c, w: (c, w), {"cu_seqlens": torch.tensor([0, 3])}, ValueError,
     "cu_seqlens is only valid with layout='thd'"),
    ("position_ids", lambda c, w: (c, w), {"position_ids": torch.zeros(3, 2, dtype=torch.long)},
     ValueError, "position_ids must match the token dims (2, 3)"),
    ("validate", lambda c, w: (c, w), {"validate": "yes"}, TypeError, "validate must be a bool"),
]  # fmt: skip


@pytest.mark.parametrize("what, inputs, kwargs, error, message", BAD, ids=[b[0] for b in BAD])
def test_bad_arguments_are_named(what, inputs, kwargs, error, message, device):
    ckv, weight, cos, sin, good = _good(device)
    ckv, weight = inputs(ckv, weight)
    for name in ("cu_seqlens", "position_ids"):
        if name in kwargs:
            kwargs = {**kwargs, name: kwargs[name].to(device)}
    with pytest.raises(error, match=re.escape(message)):
        mlarope.rmsnorm_rope_latent(ckv, weight, cos, sin, **{**good, **kwargs})


def test_bad_tables_are_named(device):
    ckv, weight, cos, sin, good = _good(device)
    odd = random_tables(8, 48, torch.float32, device)
    with pytest.raises(ValueError, match=re.escape("rope dim R = cos.shape[-1] must be one of")):
        mlarope.rmsnorm_rope_latent(ckv[..., :80], weight, *odd, **good)
    with pytest.raises(ValueError, match="cos requires grad"):
        mlarope.rmsnorm_rope_latent(ckv, weight, cos.requires_grad_(True), sin, **good)
    with pytest.raises(ValueError, match="the table has 8 positions"):
        mlarope.rmsnorm_rope_latent(
            torch.randn(1, 9, 96, device=device), weight, cos.detach(), sin, **good
        )


def test_validate_finds_positions_outside_the_table(device):
    ckv, weight, cos, sin, good = _good(device)
    ids = torch.tensor([[0, 1, 8], [0, 1, 2]], device=device)
    with pytest.raises(ValueError, match=re.escape("position_ids[0, 2] = 8 is outside the table")):
        mlarope.rmsnorm_rope_latent(ckv, weight, cos, sin, position_ids=ids, validate=True,
                                    **good)  # fmt: skip
    latent, k_pe = mlarope.rmsnorm_rope_latent(ckv, weight, cos, sin, position_ids=ids, **good)
    assert k_pe[0, 2].isnan().all() and not k_pe[0, :2].isnan().any()
    assert not latent.isnan().any()


# ------------------------------------------------------------------------------ autograd
FP64_CASES = [
    dict(layout="bshd", tokens=(2, 3)),
    dict(layout="thd", tokens=(7,), cu_seqlens=torch.tensor([0, 2, 6])),
    dict(layout="sbhd", tokens=(3, 2), interleaved=False, interleaved_out=True),
]
CHECK = dict(eps=1e-6, atol=1e-9, rtol=1e-7, fast_mode=True)


def _fp64_fn(spec, weight_dtype=torch.float64):
    spec = dict(spec)
    tokens = spec.pop("tokens")
    cos, sin = random_tables(8, 32, torch.float64, "cpu")
    kw = dict(kv_lora_rank=6, eps=1e-3, **spec)

    def fn(ckv, weight):
        return mlarope.rmsnorm_rope_latent(ckv, weight, cos, sin, **kw)

    ckv = torch.randn(*tokens, 6 + 32, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, dtype=weight_dtype, requires_grad=True)
    return fn, ckv, weight


@pytest.mark.parametrize("spec", FP64_CASES, ids=["bshd", "thd-cu", "sbhd-layouts"])
def test_every_derivative_fp64(spec):
    """float64 (the reference backend): backward, forward-mode AD, double backward and forward
    over reverse, checked numerically."""
    fn, ckv, weight = _fp64_fn(spec)
    assert gradcheck(fn, (ckv, weight), check_forward_ad=True, **CHECK)
    assert gradgradcheck(fn, (ckv, weight), check_fwd_over_rev=True, check_rev_over_rev=True,
                         **CHECK)  # fmt: skip


def _loss(fn):
    def loss(ckv, weight):
        latent, k_pe = fn(ckv, weight)
        return (latent.sin() * latent).sum() + (k_pe.cos() * k_pe).sum()

    return loss


def test_torch_func_fp64():
    """``torch.func``: grad, vjp, jvp and a Hessian-vector product against autograd's own."""
    fn, ckv, weight = _fp64_fn(FP64_CASES[0])
    ckv, weight = ckv.detach(), weight.detach()
    close = dict(rtol=1e-12, atol=1e-12)
    grads = torch.func.grad(_loss(fn), argnums=(0, 1))(ckv, weight)
    x, w = ckv.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    want = torch.autograd.grad(_loss(fn)(x, w), (x, w))
    torch.testing.assert_close(grads, want, **close)
    t = (torch.randn_like(ckv), torch.randn_like(weight))
    _, tangents = torch.func.jvp(fn, (ckv, weight), t)
    with torch.autograd.forward_ad.dual_level():
        duals = [
            torch.autograd.forward_ad.make_dual(p, d) for p, d in zip((ckv, weight), t, strict=True)
        ]
        want = [torch.autograd.forward_ad.unpack_dual(o).tangent for o in fn(*duals)]
    torch.testing.assert_close(tangents, tuple(want), **close)
    out, vjp = torch.func.vjp(fn, ckv, weight)
    cot = (torch.randn_like(out[0]), torch.randn_like(out[1]))
    x, w = ckv.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    want = torch.autograd.grad(fn(x, w), (x, w), cot)
    torch.testing.assert_close(vjp(cot), want, **close)
    _, hvp = torch.func.jvp(torch.func.grad(_loss(fn), argnums=(0, 1)), (ckv, weight), t)
    x, w = ckv.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    g = torch.autograd.grad(_loss(fn)(x, w), (x, w), create_graph=True)
    want = torch.autograd.grad(g, (x, w), t)
    torch.testing.assert_close(hvp, want, **close)


def test_double_backward_and_forward_ad_on_the_kernels(device, monkeypatch):
    """fp32 on the kernels: the gradient with ``create_graph=True`` (it has a graph) and its
    derivative, and the forward-mode tangents, are the reference backend's bits (plain PyTorch
    formulas on both, differentiable to any order; float64 checks them numerically)."""
    case = Case(layout="thd", tokens=(9,), source="ids", dtype=torch.float32, latent=32)
    ckv, weight, cos, sin, kwargs, *_ = _checked(case, device)
    g_latent, g_pe = make_grads(ckv, weight, case)
    v = torch.randn_like(ckv)
    t = (torch.randn_like(ckv), torch.randn_like(weight))

    def derivatives():
        x = ckv.detach().requires_grad_(True)
        w = weight.detach().requires_grad_(True)
        outs = mlarope.rmsnorm_rope_latent(x, w, cos, sin, **kwargs)
        dx, dw = torch.autograd.grad(outs, (x, w), (g_latent, g_pe), create_graph=True)
        assert dx.requires_grad and dw.requires_grad
        second = torch.autograd.grad((dx * v).sum() + dw.sum(), (x, w))
        with torch.autograd.forward_ad.dual_level():
            duals = [
                torch.autograd.forward_ad.make_dual(p, d)
                for p, d in zip((ckv, weight), t, strict=True)
            ]
            tangents = [
                torch.autograd.forward_ad.unpack_dual(o).tangent
                for o in mlarope.rmsnorm_rope_latent(*duals, cos, sin, **kwargs)
            ]
        return (dx, dw, *second, *tangents)

    kernels = derivatives()
    reference_backend(monkeypatch, device)
    for got, want in zip(kernels, derivatives(), strict=True):
        assert bitwise_equal(got.detach(), want.detach())


def test_vmap_on_the_kernels_is_a_clear_error(device):
    case = Case(layout="thd", tokens=(4,))
    ckv, weight, cos, sin, kwargs, *_ = _checked(case, device)
    fn = lambda c: mlarope.rmsnorm_rope_latent(c, weight, cos, sin, **kwargs)
    stacked = torch.stack((ckv, ckv))
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the reference backend runs vmap")
    with pytest.raises(NotImplementedError, match="cannot run on batched tensors"):
        torch.func.vmap(fn)(stacked)


def test_vmap_on_the_reference(monkeypatch):
    """``torch.func.vmap`` without autograd runs the PyTorch reference on the batched tensors:
    the same bits as one call per sample."""
    reference_backend(monkeypatch, "cpu")
    case = Case(layout="thd", tokens=(4,), dtype=torch.float32)
    ckv, weight, cos, sin, kwargs, *_ = _checked(case, torch.device("cpu"))
    fn = lambda c: mlarope.rmsnorm_rope_latent(c, weight, cos, sin, **kwargs)
    stacked = torch.stack((ckv, 2 * ckv, -ckv))
    latent, k_pe = torch.func.vmap(fn)(stacked)
    for i, sample in enumerate(stacked):
        want_latent, want_pe = fn(sample)
        assert bitwise_equal(latent[i], want_latent) and bitwise_equal(k_pe[i], want_pe)


# ------------------------------------------------------------------------------ compile
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_compile_fullgraph(grad, device):
    """``torch.compile(fullgraph=True)`` (``aot_eager`` in the CPU lane, Inductor on the GPU):
    the custom ops, the same bits as eager, forward and backward."""
    case = Case(layout="bshd", tokens=(2, 5), source="ids", dtype=torch.float32)
    ckv, weight, cos, sin, kwargs, *_ = _checked(case, device)
    g_latent, g_pe = make_grads(ckv, weight, case)
    backend = "inductor" if device.type == "cuda" else "aot_eager"

    def f(x, w, cos, sin, ids):
        return mlarope.rmsnorm_rope_latent(x, w, cos, sin, **{**kwargs, "position_ids": ids})

    compiled = torch.compile(f, fullgraph=True, backend=backend)
    results = []
    for fn in (f, compiled):
        x = ckv.detach().requires_grad_(grad)
        w = weight.detach().requires_grad_(grad)
        outs = fn(x, w, cos, sin, kwargs["position_ids"])
        if grad:
            torch.autograd.backward(outs, (g_latent, g_pe))
            outs = (*outs, x.grad, w.grad)
        results.append(outs)
    for got, want in zip(results[1], results[0], strict=True):
        assert bitwise_equal(got.detach(), want.detach())


# ------------------------------------------------------------------------------- GPU lane
@pytest.mark.gpu
def test_deepseek_v3_shape_on_the_gpu(monkeypatch):
    """DeepSeek-V3's latent (L = 512, R = 64, bf16, 2 x 2,048 tokens): the fp64 error model,
    the fused reference's bits, and the same bits on a repeat and under another configuration."""
    device = torch.device("cuda")
    case = Case(layout="bshd", tokens=(2, 2048), latent=512, rope=64, table_rows=4096)
    ckv, weight, _, _, _, cos2d, sin2d, positions = _checked(case, device)
    g_latent, g_pe = make_grads(ckv, weight, case)
    latent, k_pe = launch_forward(ckv, weight, cos2d, sin2d, positions, case)
    truth, pe_truth, tol, pe_tol = forward_truth(ckv, weight, cos2d, sin2d, positions, case)
    assert_close_elementwise(latent, truth, tol, "latent")
    assert_close_elementwise(k_pe, pe_truth, pe_tol, "k_pe")
    d_ckv, d_weight = launch_backward(g_latent, g_pe, ckv, weight, cos2d, sin2d, positions, case)
    truth, w_truth, tol, w_tol = backward_truth(
        g_latent, g_pe, ckv, weight, cos2d, sin2d, positions, case
    )
    assert_close_elementwise(d_ckv, truth, tol, "d_ckv")
    assert_close_elementwise(d_weight, w_truth, w_tol, "d_weight")
    config = LatentLaunchConfig(
        block_t=2, num_warps=2, backward_warps=4, block_c=64, block_p=128, sum_warps=4
    )
    again = (
        *launch_forward(ckv, weight, cos2d, sin2d, positions, case, config),
        *launch_backward(g_latent, g_pe, ckv, weight, cos2d, sin2d, positions, case, config),
    )
    for got, want in zip(again, (latent, k_pe, d_ckv, d_weight), strict=True):
        assert bitwise_equal(got, want)
    fused_reference(monkeypatch)
    monkeypatch.setattr(_latent_sums, "fma", _fused_fma)
    ref_latent, ref_pe = reference.rmsnorm_rope_latent(
        ckv, weight, cos2d, sin2d, positions, eps=case.eps, interleaved_in=True,
        interleaved_out=False,
    )  # fmt: skip
    ref_d_ckv, ref_d_weight = reference.rmsnorm_rope_latent_backward(
        g_latent, g_pe, ckv, weight, cos2d, sin2d, positions, eps=case.eps, interleaved_in=True,
        interleaved_out=False,
    )  # fmt: skip
    for got, want in zip(
        (latent, k_pe, d_ckv, d_weight), (ref_latent, ref_pe, ref_d_ckv, ref_d_weight), strict=True
    ):
        assert bitwise_equal(got, want)
