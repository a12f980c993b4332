"""mlarope.compat.megatron's key/value functions against the independent fp64 reference
(``tests/compat_megatron_harness.py``): values and gradients, and the ``k_pos_emb`` gradient
rounded where Megatron-Core rounds (``rounding="megatron"``, the default) bit for bit on both
backends, or once (``rounding="exact"``); ``kernels.kv.round_to_16bit`` against PyTorch's
conversion.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from mlarope import reference
from mlarope.compat import megatron as mm
from mlarope.kernels.kv import round_to_16bit
from mlarope.ops import KVCall, rope_kv_backward
from mlarope.positions import Positions
from tests.compat_megatron_harness import (
    CASES,
    CU,
    DTYPES,
    H,
    K,
    P,
    R,
    V,
    assert_within,
    case_id,
    cu_arg,
    f64,
    make_tables,
    megatron_kpe_grad,
    megatron_positions,
    quantized,
    randn,
    ref_kv,
    rounder,
    tables64,
    tokens_shape,
)

KV_VARIANTS = [
    ("fused_apply_mla_rope_for_kv", False),
    ("fused_mla_rope_kv_split", False),
    ("fused_mla_rope_kv_split", True),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("variant", KV_VARIANTS, ids=lambda v: f"{v[0]}-ril{v[1]:d}")
def test_kv_matches_megatron(variant, case, dtype, device):
    name, ril = variant
    layout, cp_size, cp_rank = case
    cos, sin = make_tables(dtype, device, seed=8)
    tokens = tokens_shape(layout, cp_size)
    kv = randn(*tokens, H, K + V, dtype=dtype, seed=9, device=device).requires_grad_()
    kpe = randn(*tokens, 1, R, dtype=dtype, seed=10, device=device).requires_grad_()
    gk = quantized(*tokens, H, K + R, dtype=dtype, seed=11, device=device)
    gv = randn(*tokens, H, V, dtype=dtype, seed=12, device=device)
    pos = megatron_positions(layout, cp_size, cp_rank)
    c64, s64 = tables64(cos, sin)

    kv64, kpe64 = f64(kv).requires_grad_(), f64(kpe).requires_grad_()
    key64, val64 = ref_kv(kv64, kpe64, pos, c64, s64, ril)
    dkv64, dkpe64 = torch.autograd.grad((key64, val64), (kv64, kpe64), (f64(gk), f64(gv)))
    mag_key, _ = ref_kv(kv64.detach().abs(), kpe64.detach().abs(), pos, c64, s64, ril, True)
    akey, _ = ref_kv(kv64, kpe64, pos, c64, s64, ril, True)
    (mag_dkpe,) = torch.autograd.grad(akey, kpe64, f64(gk).abs())

    fn = getattr(mm, name)
    cu = cu_arg(layout, device)
    if name == "fused_apply_mla_rope_for_kv":  # positional, as multi_latent_attention.py does
        key, value = fn(kv, kpe, cos, sin, R, K, V, cu, cp_rank, cp_size)
    else:
        key, value = fn(
            kv, kpe, cos, sin, R, K, V, cu_seqlens_kv=cu, cp_rank=cp_rank, cp_size=cp_size,
            remove_interleaving=ril,
        )  # fmt: skip

    assert value.untyped_storage().data_ptr() != kv.untyped_storage().data_ptr()  # a new tensor
    assert torch.equal(key.detach()[..., :K], kv.detach()[..., :K])
    assert torch.equal(value.detach(), kv.detach()[..., K:])
    assert_within(key, key64.detach(), mag_key, dtype, 4, "key")
    rope = key.detach()[..., K:]
    assert torch.equal(rope, rope[..., :1, :].expand_as(rope))  # the same for every head

    torch.autograd.backward((key, value), (gk, gv))
    assert torch.equal(f64(kv.grad), dkv64)  # dkv: plain copies of dk's nope part and dv
    if dtype == torch.float32:  # fp32 tables and activations: Megatron's rounding is fp32's
        assert_within(kpe.grad, dkpe64, mag_dkpe, dtype, H + 4, "grad k_pos_emb")
    else:  # the default rounding="megatron": bit for bit as Megatron's unfused path
        rope_grad = gk.detach().float().cpu().reshape(-1, H, K + R)[..., K:]
        want = megatron_kpe_grad(rope_grad, pos, *tables64(cos, sin), ril, rounder(dtype, device),
                                 True)  # fmt: skip
        assert torch.equal(kpe.grad.float().cpu().reshape(-1, R), want)


def _kv_grads(name, dtype, table_dtype, layout, rounding, device):
    """k_pos_emb's gradient through ``name`` (thd: cp 2, rank 1) and what it needs to check it."""
    cos, sin = make_tables(table_dtype, device, seed=33)
    tokens = tokens_shape(layout, 2)
    kv = randn(*tokens, H, K + V, dtype=dtype, seed=34, device=device).requires_grad_()
    kpe = randn(*tokens, 1, R, dtype=dtype, seed=35, device=device).requires_grad_()
    gk = quantized(*tokens, H, K + R, dtype=dtype, seed=36, device=device)
    gv = randn(*tokens, H, V, dtype=dtype, seed=37, device=device)
    kwargs = {} if rounding is None else {"rounding": rounding}
    key, value = getattr(mm, name)(
        kv, kpe, cos, sin, R, K, V, cu_arg(layout, device), 1, 2, **kwargs
    )
    torch.autograd.backward((key, value), (gk, gv))
    pos = megatron_positions(layout, 2, 1)
    return kpe.grad, gk.detach().float().cpu().reshape(-1, H, K + R)[..., K:], pos, cos, sin


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["sbhd", "thd"])
@pytest.mark.parametrize("ril", [False, True])
def test_reference_backend_rounds_as_megatron(ril, layout, dtype):
    """The PyTorch backend (CPU tensors without Triton's interpreter) rounds the k_pos_emb
    gradient to nearest even at Megatron's rounding points, bit for bit; without the flag it
    is the exact result."""
    cos, sin = make_tables(dtype, seed=38)
    tokens = tokens_shape(layout, 2)
    dk = quantized(*tokens, H, K + R, dtype=dtype, seed=39)
    dv = randn(*tokens, H, V, dtype=dtype, seed=40)
    cu = None if layout == "sbhd" else torch.tensor(CU, dtype=torch.int32)
    cp_rank, cp_size = (0, 1) if layout == "sbhd" else (1, 2)
    positions = Positions(layout, cu, None, cp_rank, cp_size)
    tables = (cos.view(P, R), sin.view(P, R))
    kw = dict(k_dim=K, interleaved_in=True, interleaved_out=ril)
    grads = [
        reference.rope_kv_backward(dk, dv, *tables, positions, **kw, megatron_rounding=rounded)
        for rounded in (True, False)
    ]
    pos = megatron_positions(layout, cp_size, cp_rank)
    rope_grad = dk.float().reshape(-1, H, K + R)[..., K:]
    rne = rounder(dtype, "cuda")  # to nearest even, as PyTorch rounds on any device
    want = megatron_kpe_grad(rope_grad, pos, *tables64(cos, sin), ril, rne, True)
    assert torch.equal(grads[0][1].float().reshape(-1, R), want)
    assert torch.equal(grads[0][0], grads[1][0])  # dkv untouched by the flag
    assert not torch.equal(grads[0][1], grads[1][1])
    assert reference.megatron_product_dtype(dtype, dtype) == dtype
    assert reference.megatron_product_dtype(dtype, torch.float32) is None
    assert reference.megatron_product_dtype(torch.bfloat16, torch.float16) is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["sbhd", "thd"])
@pytest.mark.parametrize("ril", [False, True])
def test_kernel_rounds_as_the_reference(ril, layout, dtype, device):
    """The key/value backward kernel with Megatron's rounding equals the PyTorch reference's
    bit for bit (``ops.rope_kv_backward``, the flag both backends share), on every lane.
    (On the H200 this failed in up to 24 ulps while the kernel rounded with
    ``x.to(fp16).to(fp32)``, which the compiler folded away; ``round_to_16bit`` rounds with
    integer arithmetic.)"""
    cos, sin = make_tables(dtype, device, seed=41)
    tokens = tokens_shape(layout, 2)
    dk = quantized(*tokens, H, K + R, dtype=dtype, seed=42, device=device)
    dv = randn(*tokens, H, V, dtype=dtype, seed=43, device=device)
    cu = cu_arg(layout, device)
    cp_rank, cp_size = (0, 1) if layout == "sbhd" else (1, 2)
    call = KVCall(cos.view(P, R), sin.view(P, R), cu, None, None, layout, cp_rank, cp_size, K,
                  True, ril, True, True)  # fmt: skip
    dkv, dkpe = rope_kv_backward(dk, dv, call)
    tables = (cos.view(P, R).cpu(), sin.view(P, R).cpu())
    kw = dict(k_dim=K, interleaved_in=True, interleaved_out=ril, megatron_rounding=True)
    positions = Positions(layout, None if cu is None else cu.cpu(), None, cp_rank, cp_size)
    want_dkv, want = reference.rope_kv_backward(dk.cpu(), dv.cpu(), *tables, positions, **kw)
    assert torch.equal(dkv.cpu(), want_dkv)
    assert torch.equal(dkpe.cpu().view(torch.int16), want.view(torch.int16))


def transpose_rows(total, pos, cos, sin):
    """The exact transpose rotation of ``total: [M, R]`` fp64 (halves, the key's layout) ->
    ``k_pos_emb``'s gradient ``[M, R]`` (pairs) and its error-model magnitudes ``[M, R]``
    (``(|g_a| + |g_b|) * max|table|`` per pair); padding rows (``pos`` None) pass through."""
    half = total.shape[-1] // 2
    want, mag = [], []
    for m, p in enumerate(pos):
        ga, gb = total[m, :half], total[m, half:]
        if p is None:
            da, db, bound = ga, gb, torch.zeros_like(ga)
        else:
            da = ga * cos[p, :half] + gb * sin[p, half:]
            db = gb * cos[p, half:] - ga * sin[p, :half]
            bound = (ga.abs() + gb.abs()) * torch.cat((cos[p], sin[p])).abs().max()
        want.append(torch.stack((da, db), -1).flatten())
        mag.append(torch.stack((bound, bound), -1).flatten())
    return torch.stack(want), torch.stack(mag)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["sbhd", "thd"])
def test_kv_exact_rounding_switch(layout, dtype, device):
    """``rounding="exact"``: the k_pos_emb gradient of the fp64 reference, rounded once (as
    mlarope.apply_rope_kv); the default (Megatron's roundings) differs from it here."""
    name = "fused_apply_mla_rope_for_kv"
    exact, gk_rope, pos, cos, sin = _kv_grads(name, dtype, dtype, layout, "exact", device)
    default = _kv_grads(name, dtype, dtype, layout, None, device)[0]
    want, mag = transpose_rows(gk_rope.double().sum(1), pos, *tables64(cos, sin))
    assert_within(exact.reshape(-1, R), want, mag, dtype, H + 4, "exact grad k_pos_emb")
    assert not torch.equal(exact, default)


@pytest.mark.parametrize("table_dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["fused_mla_rope_kv_split", "fused_apply_mla_rope_for_kv"])
def test_kv_megatron_rounding_with_other_tables(name, table_dtype, device):
    """bf16 activations with tables of another dtype: Megatron's kernel promotes the products
    to fp32 (bf16 x fp32, and bf16 x fp16 alike), so only the head sum is rounded to bf16;
    the rotation is then exact within fp32 arithmetic."""
    dtype = torch.bfloat16
    got, gk_rope, pos, cos, sin = _kv_grads(name, dtype, table_dtype, "thd", None, device)
    total = rounder(dtype, device)(gk_rope.sum(1)).double()
    want, mag = transpose_rows(total, pos, *tables64(cos, sin))
    assert_within(got.reshape(-1, R), want, mag, dtype, 4, "grad k_pos_emb")


@triton.jit
def _round_kernel(x_ptr, y_ptr, n, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    tl.store(y_ptr + o, round_to_16bit(tl.load(x_ptr + o, mask=m), DTYPE), mask=m)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_round_to_16bit_is_torchs_rounding(dtype, device):
    """``kernels.kv.round_to_16bit`` (Megatron's rounding points in the kernel) rounds fp32 to
    ``dtype`` exactly as PyTorch's conversion does: ties, subnormals of both formats, the
    largest finite values and overflow, infinities and NaN, on both lanes. A kernel that rounds
    through ``x.to(dtype).to(fp32)`` fails this on the GPU (the compiler folds the pair)."""
    g = torch.Generator().manual_seed(5)
    finfo = torch.finfo(dtype)
    lowp = torch.randn(4096, generator=g).to(dtype).float()
    mantissa_bits = 7 if dtype == torch.bfloat16 else 10
    step = lowp.abs() * 2.0 ** -(mantissa_bits + 1)  # about half a spacing: ties, and near them
    specials = torch.tensor(
        [0.0, -0.0, finfo.max, -finfo.max, finfo.tiny, finfo.tiny / 2, finfo.tiny / 3,
         2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -25, 2.0 ** -26, 65504.0, 65519.0, 65520.0, 65536.0,
         1e30, -1e30, 3.4e38, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-45],
    )  # fmt: skip
    x = torch.cat((
        lowp + step, lowp - step, lowp + step / 3, torch.randn(4096, generator=g) * 1e-5,
        torch.randn(2048, generator=g) * 1e4, torch.randn(2048, generator=g), specials,
    ))  # fmt: skip
    x = x.to(device)
    y = torch.empty_like(x)
    n = x.numel()
    tl_dtype = tl.bfloat16 if dtype == torch.bfloat16 else tl.float16
    _round_kernel[(triton.cdiv(n, 1024),)](x, y, n, tl_dtype, 1024)
    want = x.cpu().to(dtype).float()
    got = y.cpu()
    same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
    assert bool(same.all()), (
        f"{int((~same).sum())} of {n} differ; first x = {x.cpu()[~same][:4].tolist()}: "
        f"got {got[~same][:4].tolist()}, want {want[~same][:4].tolist()}"
    )
