"""``mlarope.serving.rope_inverse_quant_output``: DeepSeek-V4's attention output, its rope slice
inverse-rotated and every head quantized to FP8 e4m3 with one UE8M0 scale per 128 channels.

Byte for byte against the rule, written out here with torch's own operations (on both CPU
backends, the kernels under the interpreter and the PyTorch backend, and on CUDA): the inverse
rotation ``(a c_a + b s_a, b c_b - a s_b)`` in fp32, each product and sum rounded; the block
scale ``2 ** ceil(log2(fl32(max(amax, 1e-4) * fl32(1 / 448))))`` as DeepSeek's ``act_quant``
(``scale_fmt="ue8m0"``) computes it, taken exactly from ``frexp`` here; the codes torch's
e4m3 conversion of ``x / s`` saturated; the scales as fp32, UE8M0 bytes or four to an int32.
Plus the float64 error model of what the codes dequantize to, the layouts a caller may pass
(vLLM's group-major codes and padded MN-major scales), untouched bytes around them, the checks,
plans, one launch, ``torch.compile`` and CUDA graphs.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import pytest
import torch

# Imported before a test sets TRITON_INTERPRET=0 for the PyTorch backend: Triton decides at a
# kernel's import whether it runs interpreted.
import mlarope.kernels.output_quant  # noqa: F401
from mlarope import serving
from mlarope._launch_cache import LAUNCH_CACHE, clear_launch_cache
from mlarope.kernels._launch import recording
from mlarope.serving import _plans, checks
from mlarope.serving import reference as ref
from mlarope.tools.errmodel import U32
from tests.harness import random_tables

ROWS = 40
E8M0 = getattr(torch, "float8_e8m0fnu", torch.uint8)
R_1_448 = torch.tensor(1.0 / 448.0, dtype=torch.float32)  # fl32(1 / 448), DeepSeek's fp8_max_inv


# ------------------------------------------------------------------------------------ the rule
def rule_rotation(x_rope: torch.Tensor, cos, sin, positions, interleaved_in, interleaved_out):
    """The inverse rotation in fp32 with torch's operations: ``x_rope [T, H, R]`` -> fp32."""
    x = x_rope.cpu().float()
    half = x.shape[-1] // 2
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved_in else (x[..., :half], x[..., half:])
    pos = positions.cpu().long()
    inside = (pos >= 0) & (pos < cos.shape[0])
    row = pos.clamp(0, cos.shape[0] - 1)
    c, s = cos.cpu().float()[row][:, None, :], sin.cpu().float()[row][:, None, :]
    out_a = a * c[..., :half] + b * s[..., :half]
    out_b = b * c[..., half:] - a * s[..., half:]
    nan = torch.tensor(float("nan"))
    out_a = torch.where(inside[:, None, None], out_a, nan)
    out_b = torch.where(inside[:, None, None], out_b, nan)
    if interleaved_out:
        return torch.stack((out_a, out_b), -1).flatten(-2)
    return torch.cat((out_a, out_b), -1)


def rule_scale(amax: torch.Tensor) -> torch.Tensor:
    """``2 ** ceil(log2(fl32(max(amax, 1e-4) * fl32(1/448))))``, exactly (frexp in float64)."""
    q = (amax.float().clamp_min(1e-4) * R_1_448).double()
    mantissa, exponent = torch.frexp(q)  # q = mantissa * 2**exponent, 0.5 <= mantissa < 1
    return torch.where(mantissa == 0.5, torch.exp2(exponent - 1.0), torch.exp2(exponent.double()))


def rule(o, cos, sin, positions, groups, interleaved_in=True, interleaved_out=True):
    """``(codes uint8 [T, G, W], scales fp32 [T, G, W / 128], the fp32 values x)``."""
    t, h, d = o.shape
    r = cos.shape[1]
    rope = rule_rotation(o[..., d - r :], cos, sin, positions, interleaved_in, interleaved_out)
    x = torch.cat((o[..., : d - r].cpu().float(), rope), -1).reshape(t, h, d // 128, 128)
    amax = torch.where(x.isnan(), 0.0, x.abs()).amax(-1)
    s = rule_scale(amax).float()
    codes = (x / s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes.reshape(t, groups, -1), s.reshape(t, groups, -1), x


def scale_bytes(s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rule's scales as ``dtype`` stores them, as bytes ``[T, G, blocks, size]``."""
    if dtype == torch.float32:
        return s.contiguous().view(torch.uint8).reshape(*s.shape, 4)
    e8m0 = s.to(E8M0).view(torch.uint8) if torch.uint8 != E8M0 else ref.e8m0_encode(s)
    return e8m0.reshape(*s.shape, 1)


def stored_scale_bytes(scale_out: torch.Tensor) -> torch.Tensor:
    """What ``scale_out`` holds, as bytes ``[T, G, blocks, size]`` (int32: its four bytes)."""
    t = scale_out.cpu()
    if t.dtype == torch.int32:
        return t.contiguous().view(torch.uint8).reshape(*t.shape[:2], -1, 1)
    if t.dtype == torch.float32:
        return t.contiguous().view(torch.uint8).reshape(*t.shape, 4)
    return t.contiguous().view(torch.uint8).reshape(*t.shape, 1)


# -------------------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    dtype: torch.dtype = torch.bfloat16
    tokens: int = 5
    heads: int = 4
    head_dim: int = 512
    rope: int = 64
    groups: int = 2
    scale_dtype: torch.dtype = torch.float32
    layout: str = "default"  # default (allocated) | token (given, token-major) | vllm
    interleaved: bool = True
    interleaved_out: bool = True
    strided: bool = False  # o a slice of a wider buffer, heads strided
    index_dtype: torch.dtype = torch.int64


CASES = [
    Case(),
    Case(dtype=torch.float16, scale_dtype=E8M0, layout="token"),
    Case(dtype=torch.float32, scale_dtype=torch.int32, layout="vllm"),
    Case(layout="vllm", tokens=6, index_dtype=torch.int32),  # fp32 MN-major scales, padded T
    Case(heads=6, groups=3, scale_dtype=torch.uint8, strided=True),
    Case(heads=3, groups=1, head_dim=256, rope=128, interleaved=False),
    Case(rope=32, interleaved_out=False, layout="token", scale_dtype=torch.int32),
    Case(heads=8, groups=8, tokens=2),  # one head a group
]


def _case_id(case: Case) -> str:
    default = Case()
    parts = []
    for name in Case.__dataclass_fields__:
        value = getattr(case, name)
        if value != getattr(default, name):
            value = str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value
            parts.append(f"{name}={value}")
    return ",".join(parts) or "default"


def _inputs(case: Case, device, gen):
    t, h, d = case.tokens, case.heads, case.head_dim
    if case.strided:
        o = torch.randn(t, h + 1, d + 16, generator=gen)[:, 1:, 8 : 8 + d]
    else:
        o = torch.randn(t, h, d, generator=gen)
    # blocks of very different magnitudes: a zero block, a tiny one (under the 1e-4 floor), a
    # large one, and a block whose maximum is exactly 1.75 * 2**k (a power-of-two quotient)
    o[0, 0, :128] = 0.0
    o[1 % t, 0, :128] *= 1e-6
    o[:, -1, 128:256] *= 300.0
    o[0, -1, 130] = 448.0 * 2.0**-3
    o = o.to(case.dtype).to(device)
    cos, sin = random_tables(ROWS, case.rope, torch.float32, device)
    positions = torch.randint(0, ROWS, (t,), generator=gen)
    positions[-1] = ROWS + 3  # outside the table: NaN rope values
    return o, cos, sin, positions.to(case.index_dtype).to(device)


def _outputs(case: Case, device):
    """``(out, scale_out, keep)``: the caller's buffers for the layout (None: allocated), and
    the raw buffers behind them (random bytes, to check nothing outside the views is touched)."""
    t, g = case.tokens, case.groups
    width = case.heads // g * case.head_dim
    blocks = width // 128
    gen = torch.Generator().manual_seed(9)

    def raw(n, dtype):
        size = torch.empty((), dtype=dtype).element_size()
        b = torch.randint(0, 256, (n * size,), generator=gen, dtype=torch.uint8)
        return b.view(dtype).to(device)

    if case.layout == "default":
        return None, None, ()
    if case.layout == "token":
        k = blocks // 4 if case.scale_dtype == torch.int32 else blocks
        out_raw, s_raw = raw(t * g * width, torch.uint8), raw(t * g * k + 8, case.scale_dtype)
        out = out_raw.view(torch.float8_e4m3fn).view(t, g, width)
        scale = s_raw[8:].view(t, g, k)  # an offset view
        return out, scale, (out_raw, s_raw)
    # vLLM: codes [G, T, W] transposed; scales [G, K, T padded to 4] transposed (MN-major)
    padded_t = -(-t // 4) * 4
    k = blocks // 4 if case.scale_dtype == torch.int32 else blocks
    out_raw = raw(g * t * width, torch.uint8)
    out = out_raw.view(torch.float8_e4m3fn).view(g, t, width).transpose(0, 1)
    s_raw = raw(g * k * padded_t, case.scale_dtype)
    scale = s_raw.as_strided((g, t, k), (k * padded_t, 1, padded_t)).transpose(0, 1)
    return out, scale, (out_raw, s_raw)


def _run(case, device, backend, o, cos, sin, positions):
    out, scale_out, keep = _outputs(case, device)
    before = [k.cpu().clone() for k in keep]
    previous = os.environ.get("TRITON_INTERPRET")
    if backend == "reference":
        os.environ["TRITON_INTERPRET"] = "0"
    try:
        result = serving.rope_inverse_quant_output(
            o, cos, sin, positions, groups=case.groups, out=out, scale_out=scale_out,
            scale_dtype=None if scale_out is not None else case.scale_dtype,
            interleaved=case.interleaved, interleaved_out=case.interleaved_out,
        )  # fmt: skip
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous
    if out is not None:
        assert result[0] is out and result[1] is scale_out
    return result, keep, before


def _footprint(t: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """Which bytes of ``raw`` the view ``t`` covers (both on their own device: only their
    addresses are read; a ``.cpu()`` copy of each would have its own storage)."""
    mask = torch.zeros(raw.numel() * raw.element_size(), dtype=torch.bool)
    size = t.element_size()
    offsets = torch.zeros((), dtype=torch.int64)
    for n, stride in zip(t.shape, t.stride(), strict=True):
        offsets = offsets[..., None] + torch.arange(n) * stride
    start = (t.data_ptr() - raw.data_ptr()) // size
    for b in range(size):
        mask[(start + offsets.flatten()) * size + b] = True
    return mask


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_bytes_are_the_rule(device, case):
    gen = torch.Generator().manual_seed(1)
    o, cos, sin, positions = _inputs(case, device, gen)
    codes, scales, _ = rule(o, cos, sin, positions, case.groups, case.interleaved,
                            case.interleaved_out)  # fmt: skip
    backends = ["kernel"] if device.type == "cuda" else ["kernel", "reference"]
    for backend in backends:
        (out, scale_out), keep, before = _run(case, device, backend, o, cos, sin, positions)
        what = f"{backend} {_case_id(case)}"
        assert out.dtype in (torch.float8_e4m3fn, torch.uint8)
        assert out.shape == (case.tokens, case.groups, case.heads // case.groups * case.head_dim)
        got = out.cpu().view(torch.uint8)
        differ = (got != codes).nonzero()
        assert differ.numel() == 0, f"{what}: {differ.shape[0]} codes differ, first {differ[:3]}"
        assert torch.equal(stored_scale_bytes(scale_out),
                           scale_bytes(scales, scale_out.dtype).reshape(
                               stored_scale_bytes(scale_out).shape)), f"{what}: scales"  # fmt: skip
        for t, raw, raw0 in zip((out, scale_out), keep, before, strict=False):
            outside = ~_footprint(t, raw)
            now, then = raw.cpu().view(torch.uint8)[outside], raw0.view(torch.uint8)[outside]
            assert torch.equal(now, then), f"{what}: bytes outside"


@pytest.mark.parametrize("case", CASES[:3], ids=_case_id)
def test_dequantized_against_fp64(device, case):
    """``code * s`` against the float64 inverse rotation (nope: the input): within one e4m3
    step at the value (of the block's scale) plus the fp32 arithmetic bound."""
    gen = torch.Generator().manual_seed(2)
    o, cos, sin, positions = _inputs(case, device, gen)
    out, scale = serving.rope_inverse_quant_output(
        o, cos, sin, positions, groups=case.groups, scale_dtype=torch.float32,
        interleaved=case.interleaved, interleaved_out=case.interleaved_out,
    )  # fmt: skip
    t, h, d, r = case.tokens, case.heads, case.head_dim, case.rope
    values = ref.e4m3_decode(out.cpu()).reshape(t, h, d // 128, 128) * scale.cpu().reshape(
        t, h, d // 128, 1
    )  # fmt: skip
    values = values.reshape(t, h, d).double()
    x = o.cpu().double()
    from tests.serving_support import rope_arith, rope_truth

    flags = dict(interleaved_in=case.interleaved, interleaved_out=case.interleaved_out)
    inverse_sin = -sin  # the inverse rotation is the rotation by the negated angle
    truth = torch.cat((x[..., : d - r], rope_truth(x[..., d - r :], cos, inverse_sin, positions,
                                                   **flags)), -1)  # fmt: skip
    arith = torch.cat((torch.zeros_like(x[..., : d - r]),
                       rope_arith(x[..., d - r :], cos, sin, positions, **flags)), -1)  # fmt: skip
    s = scale.cpu().double().reshape(t, h, d // 128, 1).expand(t, h, d // 128, 128)
    s = s.reshape(t, h, d)
    tol = arith + s * ref.e4m3_step((truth.abs() + arith) / s)
    from tests.serving_support import assert_within

    assert_within(values, truth, tol, f"{_case_id(case)} dequantized")
    assert U32 > 0


def test_scale_rule_from_the_bits_is_deepseeks_for_every_fp32():
    """For every fp32 ``amax`` of three binades (all 2**23 mantissas each: around the floor,
    1.0, and a large one) and the edges of every binade, the exponent from the bits
    (``ue8m0_block_exponents``) is DeepSeek's ``2 ** ceil(log2(fl32(max(amax, 1e-4) *
    fl32(1/448))))``: multiplying by the rounded reciprocal crosses no power of two that the
    exact quotient does not."""
    mantissas = torch.arange(2**23, dtype=torch.int32)
    parts = [((e << 23) | mantissas).view(torch.float32) for e in (113, 127, 200)]
    edges = torch.exp2(torch.arange(-149, 128, dtype=torch.float64)).float()
    edges = torch.cat([edges * m for m in (1.0, 1.75)])
    for bump in (float("inf"), float("-inf")):
        edges = torch.cat((edges, edges.nextafter(torch.tensor(bump))))
    parts.append(edges[edges.isfinite() & (edges > 0)])
    for amax in parts:
        blocks = torch.zeros(amax.shape[0], 1, 1)
        blocks[:, 0, 0] = amax
        ours = ref.ue8m0_block_exponents(blocks.expand(-1, 1, 1))[:, 0]
        want = rule_scale(amax)
        assert torch.equal(torch.exp2(ours.double() - 127), want)


def test_no_fused_multiply_add_in_the_rotation(device):
    """Tables whose products cancel exactly in two roundings (``c_a = s_a = c_b = -s_b``, pairs
    ``b = -a``): PyTorch's fp32 ``a c + b s`` is 0, a fused multiply-add keeps the product's
    rounding error (up to ``2**-24 |a c|``, which the floor scale 2**-22 turns into codes of
    about 0.25). The op's codes are zero, as the reference's: every backend computes what
    PyTorch computes (Triton 3.6's interpreter rounds its fma twice, so only compiled code and
    later interpreters could differ here)."""
    t, h, d = 2, 2, 512
    gen = torch.Generator().manual_seed(3)
    a = torch.rand(t, h, 32, generator=gen) + 0.5  # the rope block's only values
    o = torch.zeros(t, h, d)
    o[..., 448::2] = a
    o[..., 449::2] = -a
    value = torch.tensor(0.7071067690849304)  # fp32; every product needs rounding
    cos = torch.full((4, 64), float(value))
    sin = torch.cat((torch.full((4, 32), float(value)), torch.full((4, 32), -float(value))), 1)
    o, cos, sin = o.to(device), cos.to(device), sin.to(device)
    positions = torch.tensor([1, 2], device=device)
    out, scale = serving.rope_inverse_quant_output(o, cos, sin, positions)
    rope_codes = out.cpu().view(torch.uint8).reshape(t, h, d)[..., 448:]
    assert not rope_codes.any(), rope_codes
    assert torch.equal(scale.cpu().reshape(t, h, 4)[..., 3], torch.full((t, h), 2.0**-22))


def test_infinite_and_nan_inputs(device):
    """A block with an infinite value gets the scale ``2 ** 120`` (the bits rule; the infinite
    value's code saturates at 448, the others round to zero); NaN does not count towards a
    block's scale and is stored as a NaN code."""
    o = torch.randn(1, 1, 512)
    o[0, 0, 5] = float("inf")
    o[0, 0, 200] = float("nan")
    o = o.to(device)
    cos, sin = random_tables(4, 64, torch.float32, device)
    out, scale = serving.rope_inverse_quant_output(o, cos, sin, torch.tensor([0], device=device))
    codes = out.cpu().view(torch.uint8)[0, 0]
    assert float(scale.cpu()[0, 0, 0]) == 2.0**120 and codes[5] == 0x7E
    assert (codes[:128][torch.arange(128) != 5] & 0x7F == 0).all()
    assert codes[200] & 0x7F == 0x7F
    x = o.cpu()[0, 0, 128:256]
    want = rule_scale(torch.where(x.isnan(), 0.0, x.abs()).amax()[None])
    assert float(scale.cpu()[0, 0, 1]) == float(want)


# ------------------------------------------------------------------------------------- checks
T, H, D = 4, 4, 512


def _args(**changes):
    cos, sin = random_tables(ROWS, 64, torch.float32, "cpu")
    args = dict(o=torch.randn(T, H, D).to(torch.bfloat16), cos=cos, sin=sin,
                positions=torch.tensor([0, 5, 7, 39]))  # fmt: skip
    args.update(changes)
    return args


def _call(args, fn=serving.rope_inverse_quant_output):
    a = dict(args)
    return fn(a.pop("o"), a.pop("cos"), a.pop("sin"), a.pop("positions"), **a)


_BUF = torch.zeros(T, H, D, dtype=torch.bfloat16)
_OUT_AND_SCALE = torch.zeros(T, 1, H * D + 64, dtype=torch.uint8)
ERRORS = [
    (dict(o=torch.zeros(T, D, dtype=torch.bfloat16)), ValueError, "o must be 3-D [T, H, D]"),
    (dict(o=torch.zeros(T, H, D, dtype=torch.float64)), TypeError, "o must be bfloat16"),
    (dict(o=torch.zeros(T, H, 448, dtype=torch.bfloat16)), ValueError,
     "o's head dim D = o.shape[-1] must be a positive multiple of 128 (one scale per 128 "
     "channels), got shape (4, 4, 448)"),
    (dict(o=torch.zeros(T, D, H, dtype=torch.bfloat16).transpose(1, 2)), ValueError,
     "o must have a contiguous last dim"),
    (dict(positions=torch.zeros(T)), TypeError, "positions must be int32 or int64"),
    (dict(positions=torch.zeros(T + 1, dtype=torch.int64)), ValueError,
     "positions must be 1-D [T] with T = 4"),
    (dict(cos=torch.zeros(ROWS, 48)), ValueError, "cos and sin must have the same shape"),
    (dict(groups=3), ValueError,
     "groups must be a positive divisor of the head count H = o.shape[1] = 4"),
    (dict(groups=0), ValueError, "got 0"),
    (dict(groups=2.0), TypeError, "groups must be an int, got 2.0 (float)"),
    (dict(groups=True), TypeError, "groups must be an int, got True"),
    (dict(interleaved=1), TypeError, "interleaved must be a bool"),
    (dict(interleaved_out=None), TypeError, "interleaved_out must be a bool"),
    (dict(scale_dtype="fp32"), TypeError, "scale_dtype must be a torch.dtype or None"),
    (dict(scale_dtype=torch.float16), TypeError,
     "the scale dtype must be one of torch.float32"),
    (dict(groups=4, o=torch.zeros(T, H, 256, dtype=torch.bfloat16), scale_dtype=torch.int32),
     ValueError, "int32 scales pack four UE8M0 bytes each: a group's 2 blocks"),
    (dict(out=torch.zeros(T, H, D, dtype=torch.uint8)), ValueError,
     "out must be [T, G, (H / G) * D] = [4, 1, 2048] (G = groups = 1), got shape (4, 4, 512)"),
    (dict(out=torch.zeros(T, 1, H * D, dtype=torch.bfloat16)), TypeError,
     "out holds e4m3 codes: torch.float8_e4m3fn or torch.uint8, got dtype torch.bfloat16"),
    (dict(out=torch.zeros(1, H * D, T, dtype=torch.uint8).permute(2, 0, 1)), ValueError,
     "out must have a contiguous last dim"),
    (dict(out=torch.zeros(1, 1, H * D, dtype=torch.uint8).expand(T, 1, H * D)), ValueError,
     "out"),
    (dict(scale_out=torch.zeros(T, 1, 15)), ValueError,
     "scale_out must be [T, G, (H / G) * D / 128] = [4, 1, 16] for torch.float32 scales, got "
     "shape (4, 1, 15)"),
    (dict(scale_out=torch.zeros(T, 1, 16, dtype=torch.int32)), ValueError,
     "scale_out must be [T, G, (H / G) * D / 512] = [4, 1, 4] for torch.int32 scales"),
    (dict(scale_out=torch.zeros(T, 1, 16), scale_dtype=torch.uint8), TypeError,
     "scale_out has dtype torch.float32 but scale_dtype is torch.uint8"),
    (dict(scale_out=torch.zeros(T, 1, 16, dtype=torch.float16)), TypeError,
     "the scale dtype must be one of"),
    (dict(o=_BUF, out=_BUF.view(torch.uint8).view(T, 1, 2 * H * D)[..., : H * D]), ValueError,
     "out and o share memory"),
    (dict(out=_OUT_AND_SCALE[..., : H * D], scale_out=_OUT_AND_SCALE[..., H * D - 8 : H * D + 8]),
     ValueError, "out and scale_out share memory"),
    (dict(o=torch.zeros(T, H, D, dtype=torch.bfloat16, requires_grad=True)), ValueError,
     "o requires grad; the serving ops are not differentiable"),
]  # fmt: skip


@pytest.mark.parametrize("index", range(len(ERRORS)))
def test_checks_name_the_value(index):
    change, error, message = ERRORS[index]
    with pytest.raises(error, match=re.escape(message)):
        _call(_args(**change))


def test_validation_names_the_position(device, monkeypatch):
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in _args().items()}
    args["positions"] = torch.tensor([0, 5, 40, 1], device=device)
    with pytest.raises(
        ValueError, match=re.escape("positions[2] = 40 is outside the table [0, 40)")
    ):
        _call(args, lambda *a, **k: serving.rope_inverse_quant_output(*a, validate=True, **k))
    monkeypatch.setenv("MLAROPE_VALIDATE", "1")
    with pytest.raises(ValueError, match="positions\\[2\\] = 40"):
        _call(args)
    monkeypatch.delenv("MLAROPE_VALIDATE")
    out, _ = _call(args)  # without validation: NaN rope values (codes 0x7F) for that token
    codes = out.cpu().view(torch.uint8).reshape(T, H, D)
    assert (codes[2, :, 448:] == 0x7F).all() and not (codes[[0, 1, 3], :, 448:] == 0x7F).all()


def test_reference_has_the_same_parameters_and_errors():
    import inspect

    def params(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert params(ref.rope_inverse_quant_output) == params(serving.rope_inverse_quant_output)
    for change, error, message in ERRORS[:6]:
        with pytest.raises(error, match=re.escape(message)):
            _call(_args(**change), ref.rope_inverse_quant_output)


def test_reference_form_writes_what_the_public_call_writes(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    args = _args(groups=2, scale_dtype=torch.int32, interleaved_out=False)
    a = _call(args)
    b = _call(args, ref.rope_inverse_quant_output)
    assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8))
    assert torch.equal(a[1], b[1])


# ------------------------------------------------------------------- plans, launches, compile
@pytest.mark.parametrize("given", [False, True])
def test_plan_replays_the_pipeline(device, monkeypatch, given):
    """A repeated call takes its plan (no checks run) and writes what the pipeline writes, on
    new inputs of the same metadata; allocated outputs are new tensors each call."""
    clear_launch_cache()
    base = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in _args().items()}
    base.update(groups=2, scale_dtype=E8M0)
    if given:
        out = torch.empty(T, 2, 2 * D, dtype=torch.float8_e4m3fn, device=device)
        scale_out = torch.empty(T, 2, 8, dtype=E8M0, device=device)
        base.update(out=out, scale_out=scale_out, scale_dtype=None)
    first = _call(base)
    _call(base)
    (entries,) = LAUNCH_CACHE.plans.values()
    assert entries[0][1].__class__ is _plans.Plan
    fresh = dict(base, o=torch.randn(T, H, D).to(torch.bfloat16).to(device),
                 positions=torch.tensor([3, 1, 2, 0], device=device))  # fmt: skip
    monkeypatch.setattr(checks, "check_output_call", lambda *a: 1 / 0)
    got = _call(fresh)
    monkeypatch.undo()
    got = tuple(t.clone() for t in got)
    want = _call(dict(fresh, validate=True))  # the pipeline
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
    if not given:
        assert got[0].data_ptr() != first[0].data_ptr()


def test_one_launch_per_call(device):
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in _args().items()}
    with recording() as launches:
        _call(dict(args, validate=True))
    assert len(launches) == (1 if device.type == "cuda" or _interpreted() else 0)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in _args().items()}

    def step(o, positions, out, scale_out):
        serving.rope_inverse_quant_output(o, args["cos"], args["sin"], positions, groups=2,
                                          out=out, scale_out=scale_out)  # fmt: skip
        return serving.rope_inverse_quant_output(o, args["cos"], args["sin"], positions,
                                                 scale_dtype=torch.int32)  # fmt: skip

    def run(fn):
        out = torch.empty(T, 2, 2 * D, dtype=torch.uint8, device=device)
        scale = torch.empty(T, 2, 8, device=device)
        a, b = fn(args["o"], args["positions"], out, scale)
        return out, scale, a.view(torch.uint8), b

    for e, c in zip(run(step), run(torch.compile(step, fullgraph=True)), strict=True):
        assert torch.equal(e, c)


@pytest.mark.gpu
def test_cuda_graph_replays_with_new_inputs():
    device = torch.device("cuda")
    cos, sin = random_tables(64, 64, torch.float32, device)
    t, h = 8, 16
    o = torch.zeros(t, h, D, dtype=torch.bfloat16, device=device)
    positions = torch.zeros(t, dtype=torch.int64, device=device)
    out = torch.empty(t, 2, h // 2 * D, dtype=torch.float8_e4m3fn, device=device)
    scale = torch.empty(2, h // 2 * 4, t, device=device).permute(2, 0, 1)  # MN-major

    def step():
        serving.rope_inverse_quant_output(o, cos, sin, positions, groups=2, out=out,
                                          scale_out=scale)  # fmt: skip

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        o.copy_(torch.randn(t, h, D, generator=gen))
        positions.copy_(torch.randint(0, 64, (t,), generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        codes, scales, _ = rule(o, cos, sin, positions, 2)
        assert torch.equal(out.cpu().view(torch.uint8), codes)
        assert torch.equal(scale.cpu(), scales)


def test_every_launch_configuration_writes_the_same_bytes(device):
    """The heuristic's tile and others (one head a program up to several tokens and heads), and
    the whole-row variant (every load before the first store)."""
    if device.type != "cuda" and not _interpreted():
        pytest.skip("the kernels run on CUDA or under the interpreter")
    from mlarope.kernels.output_quant import OutputConfig, choose_output_config
    from mlarope.serving import ops

    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in _args().items()}
    results = []
    for config in (choose_output_config(T, H), OutputConfig(1, 1, 1), OutputConfig(2, 4, 2),
                   OutputConfig(4, 2, 4), OutputConfig(1, 1, 1, whole_row=True),
                   OutputConfig(2, 2, 4, whole_row=True)):  # fmt: skip
        out = torch.empty(T, 2, 2 * D, dtype=torch.uint8, device=device)
        scale = torch.empty(T, 2, 2, dtype=torch.int32, device=device)
        ops.output_with_kernel(args["o"], args["cos"], args["sin"], args["positions"], out, scale,
                               2, True, True, config=config)  # fmt: skip
        results.append((out.cpu(), scale.cpu()))
    for out, scale in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(scale, results[0][1])


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.uint8, torch.int32])
@pytest.mark.parametrize("backend", ["kernels", "reference"])
def test_no_tokens(device, backend, scale_dtype, monkeypatch):
    """An empty batch gives empty codes and scales of the grouped shape on both backends (the
    reference's reshape could not infer a width from zero elements)."""
    if backend == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    cos, sin = random_tables(8, 64, torch.float32, device)
    o = torch.empty(0, 4, 512, dtype=torch.bfloat16, device=device)
    positions = torch.empty(0, dtype=torch.int64, device=device)
    for call in (serving.rope_inverse_quant_output, ref.rope_inverse_quant_output):
        out, scale = call(o, cos, sin, positions, groups=2, scale_dtype=scale_dtype)
        blocks = 2 if scale_dtype == torch.int32 else 8  # four UE8M0 bytes an int32
        assert out.shape == (0, 2, 1024) and scale.shape == (0, 2, blocks), call


@pytest.mark.parametrize("backend", ["kernels", "reference"])
def test_zero_width_head_is_refused(backend, monkeypatch):
    """``D = 0`` passed ``D % 128 == 0``: the PyTorch backend raised torch's own RuntimeError, the
    kernels returned empty tensors (issue 36). A head holds the rope slice, so ``D`` is at least
    128: a ValueError naming ``D`` from the public call and the PyTorch form."""
    if backend == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    cos, sin = random_tables(8, 64, torch.float32, "cpu")
    message = re.escape(
        "o's head dim D = o.shape[-1] must be a positive multiple of 128 (one scale per 128 "
        "channels), got shape (2, 2, 0)"
    )
    for call in (serving.rope_inverse_quant_output, ref.rope_inverse_quant_output):
        with pytest.raises(ValueError, match=message):
            call(torch.randn(2, 2, 0), cos, sin, torch.tensor([0, 1]))
