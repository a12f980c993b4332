"""The kernels and the PyTorch reference store the same bits (both CPU lanes and the GPU).

Where the result is defined to the bit (one rounding to nearest even of one fp32 value), every
backend must store it; NaN rows and NaN results are stored as the dtype's canonical quiet NaN
(``0x7FC0`` for bf16, ``0x7E00`` for fp16, ``0x7FC00000`` for fp32), whatever NaN arithmetic or
the hardware made. Triton's interpreter converts bf16 subnormals wrongly on loading and
truncates fp32 -> bf16 on storing; the kernels convert by bits there (``kernels/rotation.py``:
``to_f32``, ``from_f32``).

The inputs are every bf16 (fp16) bit pattern, rotated by a table whose sine is 0, so that the
fp32 result is one product, rounded once to fp32 on every backend (an fma with a zero addend
rounds once too): the 16-bit rounding of that value is then the only thing that can differ.
"""

from __future__ import annotations

import os
from fractions import Fraction

import numpy as np
import pytest
import torch

import mlarope
from mlarope import reference
from tests.harness import (
    fused_multiply_add,
    fused_reference,
    interpreter_fma_rounds_once,
    kernels_fuse,
)

R, H = 64, 16
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def every_pattern(dtype: torch.dtype, device) -> torch.Tensor:
    """All 65,536 16-bit patterns as ``[64, 16, 64]`` values of ``dtype``."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    return bits.view(dtype).reshape(2**16 // (H * R), H, R).to(device)


def tables(device, *, scale: float = 1.0 + 2.0**-9 + 2.0**-20):
    """One row: cos = ``scale`` (every product needs rounding), sin = 0."""
    cos = torch.full((1, R), scale, dtype=torch.float32, device=device)
    return cos, torch.zeros_like(cos)


@pytest.fixture
def reference_backend(monkeypatch):
    """``run(fn, *tensors)``: ``fn`` on CPU copies of ``tensors`` through mlarope's PyTorch
    backend (CPU tensors without ``TRITON_INTERPRET``: ``ops.use_triton`` reads it per call)."""

    def run(fn, *tensors):
        with monkeypatch.context() as m:
            m.setenv("TRITON_INTERPRET", "0")
            return fn(*(t.detach().cpu().requires_grad_(t.requires_grad) for t in tensors))

    return run


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    a, b = got.cpu().view(BITS[got.dtype]), want.cpu().view(BITS[want.dtype])
    differ = (a != b).sum().item()
    if differ:
        i = (a != b).nonzero()[0].tolist()
        raise AssertionError(
            f"{what}: {differ} of {a.numel()} stored values differ from the reference, first at "
            f"{i}: {int(a[tuple(i)]) & 0xFFFFFFFF:#x} against {int(b[tuple(i)]) & 0xFFFFFFFF:#x}"
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("interleaved_out", [False, True])
def test_query_op_rounds_as_the_reference(device, dtype, interleaved_out):
    q = every_pattern(dtype, device)
    cos, sin = tables(device)
    ids = torch.zeros(q.shape[0], dtype=torch.int64, device=device)
    kw = dict(layout="thd", position_ids=ids, interleaved=False, interleaved_out=interleaved_out)
    got = mlarope.apply_rope_q(q, cos, sin, **kw)
    ref_kw = {**kw, "position_ids": ids.cpu()}
    want = reference.apply_rope_q(q.cpu(), cos.cpu(), sin.cpu(), **ref_kw)
    assert_same_bits(got, want, f"{dtype} query op")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_nan_rows_and_nan_results_are_canonical(device, dtype, reference_backend):
    """A row outside the table (NaN by the contract), NaN inputs and ``inf * 0`` (NaN from the
    arithmetic, whose sign and payload vary by backend): the same canonical NaN everywhere, in
    the query op, the key/value op and its backward."""
    cos, sin = mlarope.YarnConfig(dim=R).cos_sin(8, device=device)
    q = torch.randn(4, 3, 16 + R, device=device).to(dtype)
    q[1, 0, 16] = float("nan")
    q[1, 1, 17] = -float("nan")
    q[1, 2, 16] = float("inf")  # its partner's sine term: inf * 0 at position 0
    ids = torch.tensor([0, 0, 100, 3], device=device)  # row 2: outside the table
    kw = dict(layout="thd", position_ids=ids)
    ref_kw = dict(layout="thd", position_ids=ids.cpu())
    got = mlarope.apply_rope_q(q, cos, sin, **kw)
    want = reference.apply_rope_q(q.cpu(), cos.cpu(), sin.cpu(), **ref_kw)
    assert got.isnan().any() and torch.equal(got.isnan().cpu(), want.isnan())
    assert_same_bits(got[got.isnan()], want[want.isnan()], f"{dtype} query op NaNs")

    kv = torch.randn(4, 3, 16 + 8, device=device).to(dtype)
    k_pe = q[:, 0, 16:].contiguous()
    k, _ = mlarope.apply_rope_kv(kv, k_pe, cos, sin, k_dim=16, **kw)
    k_ref, _ = reference.apply_rope_kv(kv.cpu(), k_pe.cpu(), cos.cpu(), sin.cpu(), k_dim=16,
                                       **ref_kw)  # fmt: skip
    # A finite rotated value is one fused multiply-add where the kernels' fma rounds once (the
    # GPU, Triton 3.7+'s interpreter) and a product and a sum where it rounds twice (Triton
    # 3.6's interpreter): the reference computes the same arithmetic, and then every bit agrees.
    with pytest.MonkeyPatch.context() as m:
        if kernels_fuse(device):
            fused_reference(m)
        k_ref, _ = reference.apply_rope_kv(kv.cpu(), k_pe.cpu(), cos.cpu(), sin.cpu(), k_dim=16,
                                           **ref_kw)  # fmt: skip
    assert_same_bits(k, k_ref, f"{dtype} key/value op")

    kv.requires_grad_(True)
    k_pe.requires_grad_(True)
    g = torch.randn(4, 3, 16 + R, device=device).to(dtype)
    g[0, :, 16] = float("nan")

    def k_pe_grad(kv, k_pe, g, cos, sin, ids):
        k, _ = mlarope.apply_rope_kv(kv, k_pe, cos, sin, k_dim=16, layout="thd", position_ids=ids)
        return torch.autograd.grad(k, k_pe, g)[0]

    # The head sum's order differs (kernels: pairwise; reference: in turn), so only the NaNs,
    # here a NaN head-sum entry and the row outside the table, are defined to the bit.
    dk_pe = k_pe_grad(kv, k_pe, g, cos, sin, ids)
    dk_pe_ref = reference_backend(k_pe_grad, kv, k_pe, g, cos, sin, ids)
    nan = dk_pe.isnan()
    assert nan.any() and torch.equal(nan.cpu(), dk_pe_ref.isnan())
    assert_same_bits(dk_pe[nan], dk_pe_ref[dk_pe_ref.isnan()], f"{dtype} k_pe gradient NaNs")


def test_bf16_subnormal_inputs_are_read_exactly(device):
    """``1e-40`` and ``1e-38`` (bf16 subnormals) rotated by the identity come back unchanged;
    Triton's own interpreter reads them as 0 and ``8.27e-39``."""
    cos, sin = torch.ones(1, R, device=device), torch.zeros(1, R, device=device)
    values = torch.tensor([1e-40, 1e-38, -3e-39, 2.0**-133], dtype=torch.bfloat16)
    q = values.repeat(R // 4 * 2).view(1, 2, R).to(device)
    got = mlarope.apply_rope_q(q, cos, sin, layout="thd", interleaved=False)
    assert_same_bits(got, q, "identity rotation of bf16 subnormals")


@pytest.mark.parametrize("cache_format", ["concat", "fp8_656", "fp8_584"])
def test_serving_nan_rope_values_are_canonical(device, cache_format, reference_backend):
    """A position outside the table writes NaN rope values into the cache: bf16's canonical
    ``0x7FC0`` on every backend (the reference stored ``0xFFFF``), the rest of the entry the
    same bytes too; the decode query likewise."""
    from mlarope import serving

    latent = {"concat": 512, "fp8_656": 512, "fp8_584": 448}[cache_format]
    cos, sin = mlarope.YarnConfig.deepseek_v3().cos_sin(8, device=device)
    kv_c = torch.randn(3, latent, device=device).to(torch.bfloat16)
    k_pe = torch.randn(3, R, device=device).to(torch.bfloat16)
    positions = torch.tensor([0, 100, 2], device=device)
    slots = torch.tensor([1, 5, 6], device=device)

    def cache_bytes(kv_c, k_pe, cos, sin, positions, slots):
        if cache_format == "concat":
            cache = torch.zeros(2, 4, latent + R, dtype=torch.bfloat16, device=kv_c.device)
        elif cache_format == "fp8_656":
            cache = torch.zeros(2, 4, 656, dtype=torch.uint8, device=kv_c.device)
        else:  # FlashMLA's allocation: blocks padded to a multiple of 576 bytes
            padded = -(-4 * 584 // 576) * 576
            cache = torch.zeros(2, padded, dtype=torch.uint8, device=kv_c.device)
            cache = cache[:, : 4 * 584].view(2, 4, 1, 584)
        serving.rope_append_kv_cache(kv_c, k_pe, cos, sin, positions, cache, slots,
                                     cache_format=cache_format)  # fmt: skip
        return cache.contiguous().view(torch.uint8).clone()

    got = cache_bytes(kv_c, k_pe, cos, sin, positions, slots)
    want = reference_backend(cache_bytes, kv_c, k_pe, cos, sin, positions, slots)
    assert torch.equal(got.cpu(), want), f"{cache_format}: the cache bytes differ"

    def query(q_nope, q_pe, cos, sin, positions):
        return serving.rope_decode_query(q_nope, q_pe, cos, sin, positions)

    q_nope = torch.randn(3, 2, 512, device=device).to(torch.bfloat16)
    q_pe = torch.randn(3, 2, R, device=device).to(torch.bfloat16)
    out = query(q_nope, q_pe, cos, sin, positions)
    assert_same_bits(out, reference_backend(query, q_nope, q_pe, cos, sin, positions), "query")


def correctly_rounded_fma(x: float, y: float, z: float) -> float:
    """``x * y + z`` in exact rational arithmetic, rounded to the nearest fp32 (ties to even)."""
    exact = Fraction(x) * Fraction(y) + Fraction(z)
    guess = np.float32(float(exact))
    candidates = [np.nextafter(guess, np.float32(-np.inf)), guess,
                  np.nextafter(guess, np.float32(np.inf))]  # fmt: skip
    return float(min(candidates, key=lambda c: (abs(Fraction(float(c)) - exact),
                                                int(np.array(c).view(np.int32)) & 1)))  # fmt: skip


def test_the_fused_emulation_rounds_once(device):
    """The tests' fp32 fused multiply-add (``tests.harness.fused_multiply_add``) is the correctly
    rounded ``x * y + z``: random operands, products cancelling their addend (the remainder
    decides), and near-ties, where a product rounded first (or a sum rounded to fp64 first)
    lands on the other side, and sums that need more than fp64's 53 bits."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3000, generator=g) * torch.exp2(torch.randint(-20, 20, (3000,), generator=g))
    y = torch.randn(3000, generator=g)
    z = torch.randn(3000, generator=g) * torch.exp2(torch.randint(-40, 20, (3000,), generator=g))
    z[1000:2000] = -(x[1000:2000] * y[1000:2000])  # cancellation: the product's rounding error
    ulp = torch.exp2(torch.randint(-30, -24, (1000,), generator=g).float())
    z[2000:] = -(x[2000:] * y[2000:]) + ulp  # the error plus a small offset: near-ties
    x[0], y[0], z[0] = 1.0 + 2.0**-12, 1.0 + 2.0**-12, -1.0  # x*x - 1 = 2^-11 + 2^-24
    # Exactly 2^40 + 2^-16 past an fp32 midpoint (2^30 + 2^6, scaled): the fp64 sum rounds to
    # the midpoint itself, and a second rounding then goes to even, the wrong way.
    scale = torch.exp2(torch.arange(-60, 40, dtype=torch.float32))
    sign = torch.where(torch.arange(100) % 2 == 0, 1.0, -1.0)
    x[1:101] = -8 * (1 + 2.0**-23) * scale * sign
    y[1:101] = 8 * (1 - 2.0**-23)
    z[1:101] = (2.0**30 + 2.0**7) * scale * sign
    got = fused_multiply_add(x, y, z)
    operands = zip(x.tolist(), y.tolist(), z.tolist(), strict=True)
    want = torch.tensor([correctly_rounded_fma(*t) for t in operands])
    assert float(got[0]) == 2.0**-11 + 2.0**-24
    unfused = x * y + z
    assert (unfused != want).sum() > 100, "the operands do not tell one rounding from two"
    assert_same_bits(got, want, "fused_multiply_add")
    # The premise: the GPU's tl.fma, and a newer interpreter's, rounds so too.
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if torch.device(device).type != "cpu" or (interpreted and interpreter_fma_rounds_once()):
        import triton
        import triton.language as tl

        @triton.jit
        def fma_kernel(x_ptr, y_ptr, z_ptr, out_ptr, n, BLOCK: tl.constexpr):
            i = tl.arange(0, BLOCK)
            m = i < n
            v = tl.fma(tl.load(x_ptr + i, m), tl.load(y_ptr + i, m), tl.load(z_ptr + i, m))
            tl.store(out_ptr + i, v, m)

        out = torch.empty_like(x, device=device)
        fma_kernel[(1,)](x.to(device), y.to(device), z.to(device), out, x.numel(), BLOCK=4096)
        assert_same_bits(out, want, f"tl.fma on {device}")


def signed_zero_case(device, dtype):
    """``q: [6, 1, 16 + 32]`` whose 16 rope pairs take every ``(a, b)`` of ``{+0, -0, 1, -1}``,
    at six table rows whose cos and sin are ``(1, +0)``, ``(1, -0)``, ``(-1, +0)``, ``(+0, 1)``,
    ``(-0, -1)``, ``(+0, -0)``: every product is exact, so each result's sign of zero is what
    IEEE arithmetic defines."""
    values = torch.tensor([0.0, -0.0, 1.0, -1.0])
    a, b = values.repeat_interleave(4), values.repeat(4)
    rope = torch.stack((a, b), -1).flatten()  # interleaved pairs
    q = torch.cat((torch.randn(6, 1, 16), rope.expand(6, 1, 32)), -1).to(dtype).to(device)
    cs = [(1.0, 0.0), (1.0, -0.0), (-1.0, 0.0), (0.0, 1.0), (-0.0, -1.0), (0.0, -0.0)]
    cos = torch.tensor([c for c, _ in cs]).repeat_interleave(32).view(6, 32).to(device)
    sin = torch.tensor([s for _, s in cs]).repeat_interleave(32).view(6, 32).to(device)
    return q, cos, sin, torch.arange(6, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("interleaved_out", [False, True])
def test_signed_zeros_are_the_references(device, dtype, inverse, interleaved_out, monkeypatch):
    """The sign of a zero result, forward and backward, in both ops: the kernels negated by
    ``0 - x`` (Triton's unary minus), which makes ``-(+0)`` ``+0``: ``-0 * 1 - 1 * (+0)`` came
    out ``+0`` where IEEE arithmetic, and the reference, give ``-0``."""
    q, cos, sin, ids = signed_zero_case(device, dtype)
    kw = dict(layout="thd", position_ids=ids, interleaved_out=interleaved_out)
    if kernels_fuse(device):
        fused_reference(monkeypatch)

    def run(q, k_pe, g):
        out = mlarope.apply_rope_q(q, cos, sin, inverse=inverse, **kw)
        k, _ = mlarope.apply_rope_kv(q[..., :16], k_pe, cos, sin, k_dim=8, **kw)
        dq, dk_pe = torch.autograd.grad((out, k[..., 8:]), (q, k_pe), (g, g[..., 16:]))
        return out, k, dq, dk_pe

    k_pe = q[:, 0, 16:]
    args = (q.detach().requires_grad_(), k_pe.detach().requires_grad_(), q.detach())
    got = run(*args)
    cos, sin, kw["position_ids"] = cos.cpu(), sin.cpu(), ids.cpu()  # the reference's, on the CPU
    with monkeypatch.context() as m:
        m.setenv("TRITON_INTERPRET", "0")
        want = run(*(t.cpu().detach().requires_grad_(t.requires_grad) for t in args))
    for name, x, y in zip(("q", "k", "dq", "dk_pe"), got, want, strict=True):
        assert_same_bits(x, y, f"{dtype} {name}")


@pytest.mark.parametrize("interleaved_out", [False, True])
def test_signed_zeros_in_the_fp8_attention_output(device, interleaved_out, monkeypatch):
    """``rope_inverse_quant_output`` (DeepSeek-V4's attention output, never fused): a zero's
    sign is its e4m3 code's (``0x80`` against ``0x00``); its kernel negated the sine by
    Triton's unary minus too."""
    from mlarope.serving import rope_inverse_quant_output

    q, cos, sin, ids = signed_zero_case(device, torch.bfloat16)
    o = torch.cat((torch.randn(6, 1, 96, device=device).to(q.dtype), q[..., 16:]), -1)
    kw = dict(interleaved_out=interleaved_out, scale_dtype=torch.float32)
    got = rope_inverse_quant_output(o, cos, sin, ids, **kw)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    want = rope_inverse_quant_output(o.cpu(), cos.cpu(), sin.cpu(), ids.cpu(), **kw)
    codes, want_codes = got[0].cpu().view(torch.uint8), want[0].view(torch.uint8)
    differ = codes != want_codes
    assert not differ.any(), (
        f"{int(differ.sum())} codes differ: {codes[differ][:8].tolist()} against "
        f"{want_codes[differ][:8].tolist()}"
    )
    assert_same_bits(got[1], want[1], "scales")
