"""The latent op (``mlarope.rmsnorm_rope_latent``): forward and backward against the fp64
reference with tolerances from the error model (``tests/latent_harness.py``), ``k_pe`` as the
query op's rotation, the backends bit for bit and determinism. Against transformers:
``tests/test_latent_transformers.py``; the error contract: ``tests/test_latent_checks.py``;
autograd modes and ``torch.compile``: ``tests/test_latent_autograd.py``.

Runs on the ``device`` fixture: CPU tensors under Triton's interpreter in the CPU lane, CUDA in
the GPU lane.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import mlarope
from mlarope import _latent_sums, reference
from mlarope.kernels.latent import LatentLaunchConfig, choose_latent_config
from tests.errmodel import assert_close_elementwise
from tests.harness import (
    bitwise_equal,
    fused_reference,
    kernels_fuse,
    random_tables,
    reference_backend,
)
from tests.latent_harness import (
    Case,
    backward_truth,
    checked,
    exact_norm,
    forward_truth,
    fused_fma,
    launch_backward,
    launch_forward,
    make_grads,
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


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward_against_fp64(case, device):
    """Every element of both outputs within the error model of the fp64 truth, launched into
    NaN-poisoned outputs (an element left unwritten fails); the public call gives the same bits
    and leaves ``ckv`` untouched."""
    ckv, weight, cos, sin, kwargs, cos2d, sin2d, positions = checked(case, device)
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
    ckv, weight, cos, sin, kwargs, cos2d, sin2d, positions = checked(case, device)
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
    ckv, _, cos, sin, kwargs, *_ = checked(case, device)
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
    ckv, weight, _, _, _, cos2d, sin2d, positions = checked(case, device)
    g_latent, g_pe = make_grads(ckv, weight, case)
    d_ckv, d_weight = launch_backward(g_latent, g_pe, ckv, weight, cos2d, sin2d, positions, case)
    _, w_truth, _, w_tol = backward_truth(
        g_latent, g_pe, ckv, weight, cos2d, sin2d, positions, case
    )
    assert_close_elementwise(d_weight, w_truth, w_tol, "d_weight over 2,100 tokens")
    if kernels_fuse(device):  # the reference with the kernels' fused multiply-adds (Triton 3.7+)
        fused_reference(monkeypatch)
        monkeypatch.setattr(_latent_sums, "fma", fused_fma)
    ref_ckv, ref_weight = reference.rmsnorm_rope_latent_backward(
        g_latent, g_pe, ckv, weight, cos2d, sin2d, positions, eps=case.eps,
        interleaved_in=True, interleaved_out=False,
    )  # fmt: skip
    assert bitwise_equal(d_weight, ref_weight)
    assert bitwise_equal(d_ckv, ref_ckv)


def test_no_weight_gradient(device):
    """A frozen weight: the backward skips its sum (one launch), ``d_ckv`` has the same bits."""
    case = Case(dtype=torch.float32)
    ckv, weight, cos, sin, kwargs, cos2d, sin2d, positions = checked(case, device)
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
    ckv, weight, cos, sin, kwargs, *_ = checked(case, device)
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
    ckv, weight, cos, sin, kwargs, *_ = checked(case, device)
    _, k_pe = mlarope.rmsnorm_rope_latent(ckv, weight, cos, sin, **kwargs)
    tail = ckv[13:, case.latent :]
    assert torch.equal(k_pe[13:], torch.cat((tail[:, 0::2], tail[:, 1::2]), -1))


# --------------------------------------------------------------------------- determinism
def test_repeated_runs_bitwise(device):
    case = Case(layout="thd", tokens=(75,), source="cu", dtype=torch.float32)
    ckv, weight, cos, sin, kwargs, *_ = checked(case, device)
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
    ckv, weight, _, _, _, cos2d, sin2d, positions = checked(case, device)
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
    ckv, weight, cos, sin, kwargs, *_ = checked(case, device)
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
        monkeypatch.setattr(_latent_sums, "fma", fused_fma)
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
    ckv, weight, cos, sin, kwargs, *_ = checked(case, device)
    x = ckv.detach().requires_grad_(True)
    latent, k_pe = mlarope.rmsnorm_rope_latent(x, weight, cos, sin, **kwargs)
    (latent.float().sum() + k_pe.float().sum()).backward()


# ------------------------------------------------------------------------------- GPU lane
@pytest.mark.gpu
def test_deepseek_v3_shape_on_the_gpu(monkeypatch):
    """DeepSeek-V3's latent (L = 512, R = 64, bf16, 2 x 2,048 tokens): the fp64 error model,
    the fused reference's bits, and the same bits on a repeat and under another configuration."""
    device = torch.device("cuda")
    case = Case(layout="bshd", tokens=(2, 2048), latent=512, rope=64, table_rows=4096)
    ckv, weight, _, _, _, cos2d, sin2d, positions = checked(case, device)
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
    monkeypatch.setattr(_latent_sums, "fma", fused_fma)
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
