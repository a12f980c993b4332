"""Shared pieces of the serving tests: tables, the fp64 truth of the rotation and the error
model of each stored element (docs/design.md's, ``mlarope.tools.errmodel``'s, extended to FP8)."""

from __future__ import annotations

import torch

import mlarope
from mlarope.reference import rotate_pairs
from mlarope.serving import reference as ref
from mlarope.tools.errmodel import U32, ulp


def tables(rope_dim: int, rows: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 YaRN tables ``[rows, rope_dim]`` (DeepSeek-V3's for R = 64)."""
    if rope_dim == 64:
        cfg = mlarope.YarnConfig.deepseek_v3()
    else:
        cfg = mlarope.YarnConfig(
            dim=rope_dim, base=10000.0, factor=40.0, original_max_position_embeddings=4096,
            beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
        )  # fmt: skip
    return cfg.cos_sin(rows, device=device)


def rope_truth(x, cos, sin, positions, *, interleaved_in, interleaved_out) -> torch.Tensor:
    """The rotation in float64 (NaN outside the table): ``x: [T, (H,) R]`` -> the same shape."""
    pos = positions.to(torch.int64).cpu()
    rows = cos.shape[0]
    in_range = (pos >= 0) & (pos < rows)
    index = pos.clamp(0, rows - 1)
    c, s = cos.cpu().double()[index], sin.cpu().double()[index]
    heads = x.dim() == 3
    out = rotate_pairs(
        (x if heads else x.unsqueeze(1)).cpu().double(), c, s, torch.zeros_like(in_range),
        in_range, interleaved_in=interleaved_in, interleaved_out=interleaved_out, inverse=False,
        transpose=False,
    )  # fmt: skip
    return out if heads else out.squeeze(1)


def rope_arith(x, cos, sin, positions, *, interleaved_in, interleaved_out) -> torch.Tensor:
    """The fp32 arithmetic bound of each rotated element, ``3 * 2**-24 * (|a| + |b|) * max|table
    entry|``, in the output layout."""
    pos = positions.to(torch.int64).cpu().clamp(0, cos.shape[0] - 1)
    table = torch.maximum(cos.cpu().abs(), sin.cpu().abs()).double()[pos].amax(-1)
    heads = x.dim() == 3
    x = (x if heads else x.unsqueeze(1)).cpu().double().abs()
    half = x.shape[-1] // 2
    a, b = (x[..., 0::2], x[..., 1::2]) if interleaved_in else (x[..., :half], x[..., half:])
    bound = 3 * U32 * (a + b) * table[:, None, None]
    out = (
        torch.stack((bound, bound), -1).flatten(-2)
        if interleaved_out
        else torch.cat((bound, bound), -1)
    )
    return out if heads else out.squeeze(1)


def stored_tolerance(truth, arith, dtype, scale=None) -> torch.Tensor:
    """What a stored element may be off by, against the float64 truth: for a float dtype the
    arithmetic bound plus one unit in the last place (one rounding); for FP8 e4m3 (``dtype``
    ``torch.float8_e4m3fn``) with dequant ``scale`` one quantization step at the value, plus the
    arithmetic bound."""
    if dtype in (torch.float8_e4m3fn, torch.uint8):
        scale = float(scale)
        return arith + scale * ref.e4m3_step((truth.abs() + arith) / scale)
    return arith + ulp(truth.abs() + arith, dtype)


def assert_within(got, truth, tol, what: str) -> None:
    """Element by element within ``tol``; NaN exactly where the truth is NaN."""
    from mlarope.tools.errmodel import assert_close_elementwise

    assert_close_elementwise(got.cpu().double(), truth, tol, what)


def exact_tile_scales(x: torch.Tensor) -> torch.Tensor:
    """FlashMLA's power-of-two tile scales from float64 arithmetic: ``x: [n, 512]`` -> ``[n, 4]``
    fp32 (the smallest power of two >= max(fl32(amax / 448), fl32(1e-4)))."""
    amax = x.cpu().float().reshape(x.shape[0], -1, 128).abs().amax(-1)
    quotient = (amax / 448.0).double().clamp(min=float(torch.tensor(1e-4)))
    return torch.exp2(torch.ceil(torch.log2(quotient))).float()


def stored_model(truth, arith, dtype, scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(model, bound)``: the value a stored element holds, from the float64 truth, and how far
    the stored value may be from it. Rounding (or e4m3 quantization of ``x / scale``) is
    monotone, so every fp32 result within ``arith`` of the truth stores the model's value
    unless a rounding boundary lies within reach; there the bound is the distance between the
    two neighbours, elsewhere 0."""
    truth = truth.double()
    slack = arith.double() + truth.abs() * 2.0**-22  # and one fp32 rounding of x / scale

    def stored(v: torch.Tensor) -> torch.Tensor:
        if dtype in (torch.float8_e4m3fn, torch.uint8):  # dequantized as the reader does
            s = torch.tensor(scale, dtype=torch.float32)
            return (ref.e4m3_decode(ref.e4m3_encode((v / float(s)).float())) * s).double()
        return v.to(dtype).double()

    model, low, high = stored(truth), stored(truth - slack), stored(truth + slack)
    return model, (high - low).abs()


def model1_cache(n_blocks: int, block_size: int, device, *, dtype=torch.uint8, four_d=True,
                 gen=None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(raw, cache)``: a DeepSeek-V4 FP8 cache as FlashMLA's ``quantize_k_cache`` allocates it
    for ``MODEL1_FP8Sparse``: ``raw [num_blocks, ceil(block_size * 584 / 576) * 576]`` bytes
    (random where ``gen`` is given, else zero) and ``cache``, its view ``[:, :block_size * 584]``
    as ``[num_blocks, block_size, 1, 584]`` (or 3-D) of ``dtype``."""
    padded = -(-block_size * 584 // 576) * 576
    if gen is None:
        raw = torch.zeros(n_blocks, padded, dtype=torch.uint8)
    else:
        raw = torch.randint(0, 256, (n_blocks, padded), generator=gen, dtype=torch.uint8)
    raw = raw.to(device)
    cache = raw.view(dtype)[:, : block_size * 584]
    shape = (n_blocks, block_size, 1, 584) if four_d else (n_blocks, block_size, 584)
    return raw, cache.view(shape)


def flashmla_model1_scales(x: torch.Tensor) -> torch.Tensor:
    """FlashMLA's MODEL1 tile scales as its reference quantizer computes them (tests/quant.py):
    per 64-channel tile ``amax / 448`` in fp32, floored at ``1e-4``, ``2 ** ceil(log2(.))`` with
    torch's fp32 ``log2`` and ``pow``: ``x: [n, 448]`` -> ``[n, 7]`` fp32."""
    amax = x.float().reshape(x.shape[0], 7, 64).abs().amax(-1)
    return torch.pow(2, (amax / 448.0).clamp_min(1e-4).log2().ceil()).to(torch.float32)
