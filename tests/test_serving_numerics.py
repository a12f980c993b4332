"""The serving ops' number formats, bit for bit: the e4m3 encoder, the bf16 rounding and
FlashMLA's power-of-two tile scales, in the PyTorch reference and inside a Triton kernel (the
interpreter in the CPU lane, compiled code in the GPU lane), against torch's own conversions
and an exact float64 rule."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from mlarope.kernels.serving import bf16_bits, e4m3_codes, pow2_tile_scales, quotient
from mlarope.serving import reference as ref
from tests.harness import interpreter_fma_rounds_once


def _torch_e4m3(x: torch.Tensor) -> torch.Tensor:
    """torch's conversion of the saturated value (older torch maps |x| >= 480 to NaN)."""
    return x.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)


def _hard_values() -> torch.Tensor:
    """Every e4m3 value, every midpoint between neighbours and the floats on either side of it,
    the extremes, signed zeros, infinities, and random floats of every magnitude."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = ref.e4m3_decode(codes)
    values = values[~values.isnan()].sort().values
    mids = (values[1:].double() + values[:-1].double()) / 2
    mid32 = mids.float()
    up = torch.nextafter(mid32, torch.tensor(float("inf")))
    down = torch.nextafter(mid32, torch.tensor(float("-inf")))
    special = torch.tensor(
        [0.0, -0.0, 448.0, -448.0, 464.0, 464.0001, 479.9, 480.0, 1e4, -1e30, 2.0**-6, 2.0**-9,
         2.0**-10, 2.0**-10 * 1.0000001, 3 * 2.0**-11, 1e-30, -1e-40, float("inf"),
         float("-inf"), 31.6, 1.0625, 1.1875],
    )  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    mags = torch.exp2(torch.empty(20000).uniform_(-20, 12, generator=gen))
    signs = torch.where(torch.rand(20000, generator=gen) < 0.5, -1.0, 1.0)
    return torch.cat((values, mids.float(), up, down, -up, -down, special, mags * signs))


def test_e4m3_encoder_matches_torch_bitwise():
    x = _hard_values()
    assert torch.equal(ref.e4m3_encode(x), _torch_e4m3(x))
    # every bf16 and fp16 input, as the ops get them
    every16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    for dtype in (torch.bfloat16, torch.float16):
        v = every16.view(dtype).float()
        v = v[~v.isnan()]
        assert torch.equal(ref.e4m3_encode(v), _torch_e4m3(v)), dtype


def test_e4m3_encoder_nan_and_saturation():
    codes = ref.e4m3_encode(torch.tensor([float("nan"), -float("nan"), 1e9, -1e9, float("inf")]))
    assert codes.tolist() == [0x7F, 0xFF, 0x7E, 0xFE, 0x7E]
    assert ref.e4m3_decode(codes[:2]).isnan().all()


def _exact_tile_scale(amax: float) -> float:
    """2**ceil(log2(max(fl32(amax / 448), 1e-4 as fp32))) from frexp, in float64."""
    quotient = float(torch.tensor(amax, dtype=torch.float32) / 448.0)
    s = max(quotient, float(torch.tensor(1e-4, dtype=torch.float32)))
    mantissa, exponent = math.frexp(s)  # s = mantissa * 2**exponent, 0.5 <= mantissa < 1
    return 2.0 ** (exponent - 1) if mantissa == 0.5 else 2.0**exponent


def _amax_values() -> torch.Tensor:
    """Tile maxima around every power-of-two boundary of amax / 448, and random ones."""
    pow2 = torch.exp2(torch.arange(-30, 40, dtype=torch.float64))
    edges = (448.0 * pow2).float()
    gen = torch.Generator().manual_seed(2)
    near = [edges]
    for direction in (float("inf"), float("-inf")):
        step = edges
        for _ in range(3):
            step = torch.nextafter(step, torch.tensor(direction))
            near.append(step)
    rand = torch.exp2(torch.empty(4000).uniform_(-40, 40, generator=gen))
    return torch.cat((*near, rand, torch.tensor([0.0, 1e-30, 0.0448, 0.04480001, 448.0])))


def test_pow2_tile_scales_exact():
    amax = _amax_values()
    tiles = torch.zeros(amax.shape[0], 1, 128)
    tiles[:, 0, 5] = amax
    tiles[:, 0, 9] = -amax / 3  # smaller values do not change the maximum
    got = ref.pow2_tile_scales(tiles)[:, 0]
    want = torch.tensor([_exact_tile_scale(a) for a in amax.tolist()], dtype=torch.float32)
    assert torch.equal(got, want)
    # the largest quotient is at most 448: nothing saturates
    assert float((amax.double() / got.double()).max()) <= 448.0


# ----------------------------------------------------------------------------- inside a kernel
@triton.jit
def _encode_kernel(x_ptr, e4m3_ptr, bf16_ptr, scale_ptr, n, BLOCK: tl.constexpr,
                   NATIVE: tl.constexpr):  # fmt: skip
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    x = tl.load(x_ptr + o, mask=m, other=0.0)
    tl.store(e4m3_ptr + o, e4m3_codes(x, NATIVE), mask=m)
    tl.store(bf16_ptr + o, bf16_bits(x, NATIVE), mask=m)
    bits, inverse = pow2_tile_scales(tl.where(x == x, tl.abs(x), 0.0))
    tl.store(scale_ptr + o, bits, mask=m)
    tl.device_assert((inverse * bits.to(tl.float32, bitcast=True) == 1.0) | ~m)


def _kernel_encoders(device, native: bool):
    def run(x: torch.Tensor):
        x = x.to(device)
        n = x.numel()
        e4m3 = torch.empty(n, dtype=torch.uint8, device=device)
        bf16 = torch.empty(n, dtype=torch.int16, device=device)
        scales = torch.empty(n, dtype=torch.int32, device=device)
        block = 4096
        grid = (triton.cdiv(n, block),)
        _encode_kernel[grid](x, e4m3, bf16, scales, n, BLOCK=block, NATIVE=native)
        return e4m3.cpu(), bf16.cpu(), scales.cpu().view(torch.float32)

    return run


# The encoder paths: integer operations (the interpreter's, and the GPU's when asked), and the
# hardware conversions that compiled kernels use (``native_casts``), GPU lane only.
PATHS = [
    pytest.param(False, id="integer"),
    pytest.param(True, id="native", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("native", PATHS)
def test_kernel_encoders_bitwise(device, native):
    """The kernels' encoders give torch's bits on this lane's backend (interpreter or GPU)."""
    run = _kernel_encoders(device, native)
    x = torch.cat((_hard_values(), _amax_values()))
    x = x[~x.isnan()]
    e4m3, bf16, scales = run(x)
    assert torch.equal(e4m3, _torch_e4m3(x))
    assert torch.equal(bf16, x.to(torch.bfloat16).view(torch.int16))
    want = ref.pow2_tile_scales(x.abs().reshape(-1, 1, 1).expand(-1, 1, 128))[:, 0]
    assert torch.equal(scales, want)
    # NaNs whose payload is in the low 16 bits alone (their top 16 bits are an infinity's)
    nans = torch.tensor([0x7FC00000, 0x7F800001, -0x7FFFFF, 0x7F808000], dtype=torch.int32)
    nan_codes, nan_bf16, _ = run(nans.view(torch.float32))
    assert (nan_codes & 0x7F == 0x7F).all()
    assert torch.isnan(nan_bf16.view(torch.bfloat16)).all(), nan_bf16


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_bf16_rounding_every_input(device, dtype, native):
    """fp32 values that are not bf16: every 16-bit pattern with random low bits."""
    run = _kernel_encoders(device, native)
    base = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype).float()
    gen = torch.Generator().manual_seed(3)
    low = torch.randint(0, 2**16, base.shape, generator=gen, dtype=torch.int32)
    x = (base.view(torch.int32) | low).view(torch.float32)
    x = torch.cat((x, base, (base.view(torch.int32) | 0x8000).view(torch.float32)))  # ties
    x = x[~x.isnan()]
    _, bf16, _ = run(x)
    assert torch.equal(bf16, x.to(torch.bfloat16).view(torch.int16))


# ------------------------------------------------------------------------- x / scale, rounded
@triton.jit
def _quotient_kernel(x_ptr, out_ptr, scale, n, BLOCK: tl.constexpr, FAST: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    x = tl.load(x_ptr + o, mask=m, other=0.0)
    q = quotient(x, scale, FAST)
    tl.store(out_ptr + o, e4m3_codes(q, False), mask=m)
    tl.store(out_ptr + n + o, q.to(tl.int32, bitcast=True).to(tl.uint8), mask=m)  # low bits


def _quotient_inputs(scale: float) -> torch.Tensor:
    """For one scale: every e4m3 value, midpoint and the floats either side of a midpoint, times
    the scale and moved by up to 3 ulps (the quotients near a rounding boundary of the code),
    random magnitudes, and the special values."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = ref.e4m3_decode(codes)
    values = values[~values.isnan()].sort().values.double()
    mids = (values[1:] + values[:-1]) / 2
    near = (torch.cat((values, mids)) * scale).float()
    bits = near.view(torch.int32)
    moved = torch.cat([(bits + d).view(torch.float32) for d in range(-3, 4)])
    gen = torch.Generator().manual_seed(5)
    mags = torch.exp2(torch.empty(20000).uniform_(-40, 40, generator=gen)) * scale
    signs = torch.where(torch.rand(20000, generator=gen) < 0.5, -1.0, 1.0)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 3e38, -3e38, 1e-45, 1e-38])
    x = torch.cat((moved, (mags * signs).float(), special))
    return x[x.isfinite() | x.isinf()]


# Markstein's correction runs where the fma rounds once: compiled code, and Triton's interpreter
# from 3.7 on (3.6's rounds twice: the division there).
FAST_PATHS = [
    pytest.param(False, id="division"),
    pytest.param(True, id="markstein"),
]


@pytest.mark.parametrize("fast", FAST_PATHS)
@pytest.mark.parametrize(
    "scale",
    [1.0, 0.0123, 3.7e-3, 1 / 448, 17.3, 2.0**-20 * 1.37, 2.0**-90, 2.0**90, 6e-30, 5e28],
    ids=lambda s: f"{s:.3g}",
)
def test_quotient_is_torchs_division(device, fast, scale):
    """``quotient`` gives the bits of torch's fp32 ``x / scale`` wherever they reach the e4m3
    code, on the path compiled kernels take (Markstein's correction; scales outside
    [2**-90, 2**90] divide) and on the interpreter's (the division)."""
    if fast and torch.device(device).type == "cpu" and not interpreter_fma_rounds_once():
        pytest.skip("Triton 3.6's interpreter rounds tl.fma twice: the correction needs one")
    x = _quotient_inputs(scale)
    n = x.numel()
    out = torch.empty(2 * n, dtype=torch.uint8, device=device)
    scale32 = float(torch.tensor(scale, dtype=torch.float32))
    _quotient_kernel[(triton.cdiv(n, 4096),)](x.to(device), out, scale32, n, BLOCK=4096, FAST=fast)
    out = out.cpu()
    want = x / torch.tensor(scale32, dtype=torch.float32)
    assert torch.equal(out[:n], _torch_e4m3(want))
    # the quotient itself, bit for bit where it is finite (its low 8 bits; the code above checks
    # the rest), except below 2**-120, where a Markstein remainder may underflow (codes: 0)
    exact = want.isfinite() & (want.abs() >= 2.0**-120)
    low = want.view(torch.int32).to(torch.uint8)
    assert torch.equal(out[n:][exact], low[exact])
