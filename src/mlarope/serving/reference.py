"""The serving ops in plain PyTorch: the spec the kernels match, the CPU backend, and the readers
that dequantize a cache back (docs/serving.md). :func:`rope_append_kv_cache` and
:func:`rope_decode_query` take the public calls' arguments and check them as those do;
:func:`append_kv_cache` and :func:`decode_query` are the backend's forms (checked inputs).

Every cache format is written by slot: slot ``s`` is entry ``s % block_size`` of block
``s // block_size``; a slot outside ``[0, num_blocks * block_size)`` (``-1``: padding) is not
written. Math runs in fp32 and each stored element is rounded (or quantized) once:

- bf16 / fp16 / fp32: round to nearest even (the latent part is a copy);
- FP8 e4m3 with a per-tensor dequant scale: ``code = e4m3(x / scale)`` (fp32 division);
- ``fp8_656``: the latent in four 128-channel tiles, each with FlashMLA's power-of-two scale
  ``s_j = 2 ** ceil(log2(max(amax_j / 448, 1e-4)))`` and ``code = e4m3(x / s_j)``; the rotated
  rope values in bf16.
- ``fp8_584`` (DeepSeek-V4): the 448-channel latent in seven 64-channel tiles with the same rule,
  the scales stored as UE8M0 exponent bytes in a block's scale rows; the rope values in bf16.

``e4m3`` rounds to nearest even and saturates to +-448 (infinities too); NaN gives a NaN code.
The encoder below does it with integer operations, the same as the kernels, and equals
``torch``'s ``x.clamp(-448, 448).to(torch.float8_e4m3fn)`` on every non-NaN value.

:func:`inverse_quant_output` (and :func:`rope_inverse_quant_output`, the public call's form) is
DeepSeek-V4's attention output for its FP8 grouped output projection: the trailing rope slice
of ``o: [T, H, D]`` rotated by the inverse angle in fp32, then the whole head quantized to e4m3
with one UE8M0 scale per 128 channels, ``s = 2 ** ceil(log2(max(amax, 1e-4) / 448))``.
"""

from __future__ import annotations

import torch

# Core import point (the rotation's spec, the validation switch).
from .._checks import validation_requested
from ..reference import canonical_nan, rotate_pairs
from . import checks
from .formats import (
    E4M3_MAX,
    FP8_584_LATENT,
    FP8_584_ROPE_AT,
    FP8_584_TILE,
    FP8_584_TILES,
    FP8_656_LATENT,
    FP8_656_ROPE_AT,
    FP8_656_SCALES_AT,
    FP8_656_TILE,
    OUTPUT_BLOCK,
    as_codes,
    fp8_584_rows,
    fp8_656_records,
)


# ------------------------------------------------------------------------------ number formats
def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> ``uint8`` FP8 e4m3fn codes: round to nearest even, saturating to +-448 (infinities
    too); NaN -> ``0x7F`` with the sign of ``x``."""
    bits = x.to(torch.float32).contiguous().view(torch.int32)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    is_nan = mag > 0x7F800000
    mag = mag.clamp(max=0x43E00000)
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    significand = (mag & 0x7FFFFF) | 0x800000
    shift = (141 - (mag >> 23)).clamp(max=25)
    one = torch.ones_like(shift)
    q = significand >> shift
    rest = significand & ((one << shift) - 1)
    half = one << (shift - 1)
    q = q + ((rest > half) | ((rest == half) & ((q & 1) == 1))).to(torch.int32)
    code = torch.where(mag < 0x3C800000, q, normal)
    code = torch.where(is_nan, 0x7F, code) | sign
    return code.to(torch.uint8)


def e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    """FP8 e4m3fn codes (``uint8``, ``int8`` or ``float8_e4m3fn``) -> fp32 values."""
    if codes.dtype != torch.float8_e4m3fn:
        codes = codes.view(torch.float8_e4m3fn)
    return codes.to(torch.float32)


def pow2_tile_scales(x: torch.Tensor) -> torch.Tensor:
    """FlashMLA's dequant scale per tile, exactly: ``x: [..., tiles, width]`` (``fp8_656``: 128,
    ``fp8_584``: 64) -> ``[..., tiles]`` fp32 powers of two ``2 ** ceil(log2(max(amax / 448,
    1e-4)))``. NaN does not count towards ``amax``. Computed from the bits of ``amax``: for
    ``amax = m * 2**e`` (``1 <= m < 2``) the scale is ``2**(e - 8)`` if ``m <= 1.75``, else
    ``2**(e - 7)``, at least ``2**-13`` (the fp32 quotient ``amax / 448`` rounds across no
    power of two, so this is the ceiling of the rounded quotient; FlashMLA's ``log2`` in fp32
    misses by a factor of two a few ulp above a power of two)."""
    x = x.to(torch.float32)
    amax = torch.where(x.isnan(), 0.0, x.abs()).amax(-1)
    bits = amax.contiguous().view(torch.int32)
    exponent = (bits >> 23) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    exponent = exponent.clamp(min=114)
    return (exponent << 23).view(torch.float32)


def e8m0_encode(scales: torch.Tensor) -> torch.Tensor:
    """fp32 powers of two (normal numbers) -> their UE8M0 bytes (``uint8``): the biased exponent,
    ``2 ** (byte - 127)``, what ``.to(torch.float8_e8m0fnu)`` stores for them."""
    return ((scales.to(torch.float32).contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def e8m0_decode(codes: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes (``uint8`` or ``float8_e8m0fnu``) -> fp32 ``2 ** (byte - 127)``; 0xFF is NaN."""
    b = codes.view(torch.uint8).to(torch.int32)
    value = torch.ldexp(torch.ones_like(b, dtype=torch.float32), b - 127)
    return torch.where(b == 255, float("nan"), value)


def ue8m0_block_exponents(x: torch.Tensor) -> torch.Tensor:
    """The biased exponents (int32 ``[..., blocks]``) of DeepSeek's UE8M0 activation scales of
    ``x: [..., blocks, 128]``, exactly: ``s = 2 ** ceil(log2(max(amax, 1e-4) / 448))``
    (``act_quant`` with ``scale_fmt="ue8m0"`` in DeepSeek-V4's inference kernels: ``amax``
    floored at ``1e-4``, times the fp32 ``1 / 448``, rounded up to a power of two by its bits),
    ``amax`` the largest magnitude of the block, NaN not counted. From the bits of ``amax`` as
    :func:`pow2_tile_scales` (``m <= 1.75``: ``2**(e - 8)``, else ``2**(e - 7)``), at least
    ``2**-22`` (105), the scale of ``amax = 1e-4``; an infinite ``amax`` gives ``2**120``."""
    x = x.to(torch.float32)
    amax = torch.where(x.isnan(), 0.0, x.abs()).amax(-1)
    bits = amax.contiguous().view(torch.int32)
    exponent = (bits >> 23) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    return exponent.clamp(min=105)


def e4m3_step(value: torch.Tensor) -> torch.Tensor:
    """The spacing of e4m3 values at magnitude ``|value|`` (fp64): ``2**(floor(log2|v|) - 3)``
    for normal magnitudes, ``2**-9`` below ``2**-6``."""
    v = value.abs().to(torch.float64).clamp(min=2.0**-6, max=E4M3_MAX)
    return torch.exp2(torch.floor(torch.log2(v)) - 3)


def as_scale(scale: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A per-tensor dequant scale as a 0-d fp32 tensor on ``device``."""
    if isinstance(scale, torch.Tensor):
        return scale.detach().reshape(()).to(device=device, dtype=torch.float32)
    return torch.tensor(float(scale), dtype=torch.float32, device=device)


def quantize(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """``e4m3(x / scale)`` in fp32 -> ``uint8`` codes."""
    return e4m3_encode(x.to(torch.float32) / as_scale(scale, x.device))


# ------------------------------------------------------------------------------------- rotation
def rotate_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    *,
    interleaved_in: bool,
    interleaved_out: bool,
    inverse: bool = False,
) -> torch.Tensor:
    """``x: [T, R]`` or ``[T, H, R]`` rotated at ``positions: [T]`` in fp32 -> fp32, same shape
    (``inverse``: by the negated angle); a position outside ``[0, P)`` gives NaN (``cos, sin:
    [P, R]``, or pair tables ``[P, R / 2]``: each entry serves both halves). Each product and
    sum is rounded to fp32 (PyTorch's own arithmetic)."""
    pos = positions.to(torch.int64)
    rows = cos.shape[0]
    in_range = (pos >= 0) & (pos < rows)
    index = pos.clamp(0, rows - 1)
    c = cos.to(torch.float32)[index]
    s = sin.to(torch.float32)[index]
    if 2 * c.shape[-1] == x.shape[-1]:
        c, s = torch.cat((c, c), -1), torch.cat((s, s), -1)
    heads = x.dim() == 3
    rotated = rotate_pairs(
        (x if heads else x.unsqueeze(1)).to(torch.float32), c, s,
        torch.zeros_like(in_range), in_range,
        interleaved_in=interleaved_in, interleaved_out=interleaved_out, inverse=inverse,
        transpose=False,
    )  # fmt: skip
    return rotated if heads else rotated.squeeze(1)


def _round(x: torch.Tensor, dtype: torch.dtype, scale) -> torch.Tensor:
    """fp32 values stored as ``dtype`` (FP8: ``uint8`` codes of ``x / scale``)."""
    if dtype in (torch.float8_e4m3fn, torch.uint8):
        return quantize(x, scale)
    return canonical_nan(x.to(dtype))


# ------------------------------------------------------------------------------------ the cache
def _slots(slot_mapping: torch.Tensor, block_size: int, n_blocks: int):
    """``(tokens, blocks, entries)`` of the tokens whose slot is in the cache; of several tokens
    with one slot, the last."""
    slots = slot_mapping.to(torch.int64)
    valid = (slots >= 0) & (slots < n_blocks * block_size)
    tokens = valid.nonzero().squeeze(1)
    chosen = slots[tokens]
    order = torch.argsort(chosen, stable=True)
    last = torch.ones_like(order, dtype=torch.bool)
    last[:-1] = chosen[order][1:] != chosen[order][:-1]
    tokens, chosen = tokens[order[last]], chosen[order[last]]
    return tokens, torch.div(chosen, block_size, rounding_mode="floor"), chosen % block_size


@torch.no_grad()
def append_kv_cache(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    cache: torch.Tensor,
    kpe_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    *,
    cache_format: str,
    kv_scale: float | torch.Tensor | None,
    interleaved_in: bool,
    interleaved_out: bool,
) -> None:
    """Write each token's entry into its slot (checked inputs; ``k_pe: [T, R]``).

    ``cache``: ``concat`` ``[num_blocks, block_size, L + R]``, ``split`` ``ckv [num_pages,
    page_size, L]`` with ``kpe_cache [num_pages, page_size, R]``, ``fp8_656`` records, or an
    ``fp8_584`` cache (each token's data row and the first 7 bytes of its scale row; the pad byte
    and a block's padding are left alone). Two tokens with one slot: the later token's entry is
    written (the kernels leave it undefined).
    """
    rope = rotate_rope(
        k_pe, cos, sin, positions, interleaved_in=interleaved_in, interleaved_out=interleaved_out
    )
    latent = kv_c.shape[1]
    if cache_format == "fp8_656":
        records = fp8_656_records(cache)
        tokens, blocks, entries = _slots(slot_mapping, records.shape[1], records.shape[0])
        x = kv_c[tokens].to(torch.float32).reshape(-1, latent // FP8_656_TILE, FP8_656_TILE)
        scales = pow2_tile_scales(x)
        codes = e4m3_encode(x * (1.0 / scales).unsqueeze(-1)).reshape(-1, latent)
        record = torch.cat(
            (codes, scales.view(torch.uint8), _bf16_bytes(rope[tokens])),
            dim=1,
        )
        _write(records, blocks, entries, record)
        return
    if cache_format == "fp8_584":
        data, scale_rows = fp8_584_rows(cache)
        tokens, blocks, entries = _slots(slot_mapping, data.shape[1], data.shape[0])
        x = kv_c[tokens].to(torch.float32).reshape(-1, FP8_584_TILES, FP8_584_TILE)
        scales = pow2_tile_scales(x)
        codes = e4m3_encode(x * (1.0 / scales).unsqueeze(-1)).reshape(-1, latent)
        row = torch.cat((codes, _bf16_bytes(rope[tokens])), dim=1)
        _write(data, blocks, entries, row)
        _write(scale_rows, blocks, entries, e8m0_encode(scales))
        return
    dtype = cache.dtype
    if cache_format == "concat":
        tokens, blocks, entries = _slots(slot_mapping, cache.shape[1], cache.shape[0])
        entry = torch.cat(
            (_store_latent(kv_c[tokens], dtype, kv_scale), _round(rope[tokens], dtype, kv_scale)),
            dim=1,
        )
        _write(as_codes(cache) if _is_fp8(dtype) else cache, blocks, entries, entry)
        return
    tokens, blocks, entries = _slots(slot_mapping, cache.shape[1], cache.shape[0])
    for target, values in (
        (cache, _store_latent(kv_c[tokens], dtype, kv_scale)),
        (kpe_cache, _round(rope[tokens], dtype, kv_scale)),
    ):
        _write(as_codes(target) if _is_fp8(dtype) else target, blocks, entries, values)


def _bf16_bytes(x: torch.Tensor) -> torch.Tensor:
    """fp32 rope values as the bytes of their bf16 (a NaN as the canonical ``0x7FC0``)."""
    return canonical_nan(x.to(torch.bfloat16)).view(torch.uint8)


def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.uint8)


def _store_latent(x: torch.Tensor, dtype: torch.dtype, scale) -> torch.Tensor:
    return quantize(x, scale) if _is_fp8(dtype) else x.to(dtype)


def _write(target: torch.Tensor, blocks, entries, rows: torch.Tensor) -> None:
    """``target[block, entry, :width] = row`` for each token (distinct slots)."""
    target[blocks, entries, : rows.shape[1]] = rows


@torch.no_grad()
def read_kv_cache(
    cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    slots: torch.Tensor,
    *,
    cache_format: str,
    rope_dim: int | None = None,
    kv_scale: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read entries back and dequantize them: ``(latent [n, L], rope [n, R])`` in fp32 for the
    ``n`` slots in ``slots`` (``[n]`` int32/int64, on the cache's device).

    ``cache`` as :func:`mlarope.serving.rope_append_kv_cache` takes it (a ``(ckv, kpe)`` pair for
    ``split``); ``rope_dim``: ``R``, required for ``concat`` (one of 32, 64, 128), checked
    against the cache for the others; ``kv_scale``: the dequant scale of an FP8 ``concat`` or
    ``split`` cache (a real number or a 1-element fp32 tensor), None otherwise. ``fp8_656`` and
    ``fp8_584`` latents are ``code * s_j`` in fp32 (exact: ``s_j`` is a power of two), as
    FlashMLA's kernels dequantize them.

    Every slot must name an entry, ``[0, num_blocks * block_size)``: the slot values are read
    (a sync) and one outside, or -1 (the writers' padding marker, which names no entry),
    raises ``ValueError`` naming its index and value. So does a cache that is not the format's
    shape or dtype, a ``rope_dim`` that does not fit it, or a scale that is missing or not
    wanted; a wrong type raises ``TypeError``.
    """
    tensors, slots, rope_dim, scale = checks.check_read_call(
        cache, slots, cache_format, rope_dim, kv_scale
    )
    if cache_format == "fp8_656":
        records = fp8_656_records(tensors[0])
        rec = records[torch.div(slots, records.shape[1], rounding_mode="floor"),
                      slots % records.shape[1]]  # fmt: skip
        n_tiles = FP8_656_LATENT // FP8_656_TILE
        codes = rec[:, :FP8_656_SCALES_AT].reshape(-1, n_tiles, FP8_656_TILE)
        scales = rec[:, FP8_656_SCALES_AT:FP8_656_ROPE_AT].contiguous().view(torch.float32)
        latent = (e4m3_decode(codes) * scales.unsqueeze(-1)).reshape(-1, FP8_656_LATENT)
        rope = rec[:, FP8_656_ROPE_AT:].contiguous().view(torch.bfloat16).to(torch.float32)
        return latent, rope
    if cache_format == "fp8_584":
        data, scale_rows = fp8_584_rows(tensors[0])
        rows, scales = _gather(data, slots), _gather(scale_rows, slots)[:, :FP8_584_TILES]
        codes = rows[:, :FP8_584_ROPE_AT].reshape(-1, FP8_584_TILES, FP8_584_TILE)
        latent = e4m3_decode(codes) * e8m0_decode(scales).unsqueeze(-1)
        latent = latent.reshape(-1, FP8_584_LATENT)
        rope = rows[:, FP8_584_ROPE_AT:].contiguous().view(torch.bfloat16).to(torch.float32)
        return latent, rope
    if cache_format == "split":
        parts = [_gather(tensors[0], slots), _gather(tensors[1], slots)]
    else:
        rows = _gather(tensors[0], slots)
        parts = [rows[:, : rows.shape[1] - rope_dim], rows[:, rows.shape[1] - rope_dim :]]
    if scale is not None:
        return e4m3_decode(parts[0]) * scale, e4m3_decode(parts[1]) * scale
    return parts[0].to(torch.float32), parts[1].to(torch.float32)


def _gather(t: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return t[torch.div(slots, t.shape[1], rounding_mode="floor"), slots % t.shape[1]]


# -------------------------------------------------------------------------------- decode query
@torch.no_grad()
def decode_query(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    q_scale: float | torch.Tensor | None,
    interleaved_in: bool,
    interleaved_out: bool,
) -> torch.Tensor:
    """``[q_nope | rotate(q_pe)]``: ``q_nope: [T, H, L]``, ``q_pe: [T, H, R]`` -> ``[T, H, L + R]``
    in ``out_dtype`` (``torch.float8_e4m3fn``: codes of ``x / q_scale``)."""
    rope = rotate_rope(
        q_pe, cos, sin, positions, interleaved_in=interleaved_in, interleaved_out=interleaved_out
    )
    if out_dtype == torch.float8_e4m3fn:
        out = torch.cat((quantize(q_nope, q_scale), quantize(rope, q_scale)), dim=-1)
        return out.view(torch.float8_e4m3fn)
    return torch.cat((q_nope.to(out_dtype), canonical_nan(rope.to(out_dtype))), dim=-1)


# ------------------------------------------------------------------ the public calls, in PyTorch
def rope_append_kv_cache(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    slot_mapping: torch.Tensor,
    *,
    cache_format: str,
    kv_scale: float | torch.Tensor | None = None,
    interleaved: bool = True,
    interleaved_out: bool = True,
    pair_tables: bool = False,
    validate: bool = False,
) -> None:
    """:func:`mlarope.serving.rope_append_kv_cache` in plain PyTorch: the same arguments, checks
    and errors, written by :func:`append_kv_cache` (of two tokens with one slot, the later)."""
    call = checks.check_append_call(
        kv_c, k_pe, cos, sin, positions, cache, slot_mapping, cache_format, kv_scale,
        interleaved, interleaved_out, pair_tables,
    )  # fmt: skip
    if validation_requested(validate):
        checks.validate_append_on_device(call)
    append_kv_cache(
        call.kv_c, call.k_pe, call.cos, call.sin, call.positions, call.cache, call.kpe_cache,
        call.slot_mapping, cache_format=call.cache_format,
        kv_scale=call.scale if call.scale is not None else call.scale_value,
        interleaved_in=call.interleaved, interleaved_out=call.interleaved_out,
    )  # fmt: skip


def rope_decode_query(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    q_scale: float | torch.Tensor | None = None,
    interleaved: bool = True,
    interleaved_out: bool = True,
    pair_tables: bool = False,
    validate: bool = False,
) -> torch.Tensor:
    """:func:`mlarope.serving.rope_decode_query` in plain PyTorch: the same arguments, checks,
    errors and result (``out`` itself when given), computed by :func:`decode_query`."""
    call = checks.check_query_call(
        q_nope, q_pe, cos, sin, positions, out, out_dtype, q_scale, interleaved,
        interleaved_out, pair_tables,
    )  # fmt: skip
    if validation_requested(validate):
        checks.validate_query_on_device(call)
    result = decode_query(
        call.q_nope, call.q_pe, call.cos, call.sin, call.positions,
        out_dtype=torch.float8_e4m3fn if call.fp8 else call.q_nope.dtype,
        q_scale=(call.scale if call.scale is not None else call.scale_value) if call.fp8 else None,
        interleaved_in=call.interleaved, interleaved_out=call.interleaved_out,
    )  # fmt: skip
    if call.out is None:
        return result
    with torch.no_grad():
        call.out.copy_(result)
    return call.out


# ------------------------------------------------------------------------- the attention output
@torch.no_grad()
def inverse_quant_output(
    o: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    *,
    groups: int,
    scale_dtype: torch.dtype,
    interleaved_in: bool,
    interleaved_out: bool,
    pair_tables: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``o: [T, H, D]`` (checked; ``D`` a multiple of 128, the trailing ``R = cos.shape[-1]``
    channels rotary, ``2 * cos.shape[-1]`` with ``pair_tables``) -> ``(codes, scales)``:
    ``codes`` ``uint8`` e4m3 ``[T, G, (H / G) * D]`` (``G = groups``; head ``h`` at ``[:, h //
    (H / G), (h % (H / G)) * D:][:D]``), the rope slice rotated by the inverse angle in fp32
    and every channel ``e4m3(x / s)`` with ``s`` its
    128-channel block's :func:`ue8m0_block_exponents` scale; ``scales`` ``[T, G, (H / G) * D /
    128]`` as ``scale_dtype``: fp32 values, UE8M0 bytes (``float8_e8m0fnu`` or ``uint8``), or
    int32 (``[.., / 4]``: four bytes to an element, block ``k`` in byte ``k % 4``)."""
    n_tokens, n_heads, head_dim = o.shape
    rope_dim = cos.shape[1] * (2 if pair_tables else 1)
    nope = head_dim - rope_dim
    rope = rotate_rope(
        o[..., nope:], cos, sin, positions, interleaved_in=interleaved_in,
        interleaved_out=interleaved_out, inverse=True,
    )  # fmt: skip
    x = torch.cat((o[..., :nope].to(torch.float32), rope), dim=-1)
    x = x.reshape(n_tokens, n_heads, head_dim // OUTPUT_BLOCK, OUTPUT_BLOCK)
    exponent = ue8m0_block_exponents(x)
    inverse = ((254 - exponent) << 23).view(torch.float32)
    width = n_heads // groups * head_dim  # given, not inferred: a batch may be empty
    codes = e4m3_encode(x * inverse.unsqueeze(-1)).reshape(n_tokens, groups, width)
    exponent = exponent.reshape(n_tokens, groups, width // OUTPUT_BLOCK)
    if scale_dtype == torch.float32:
        scales = (exponent << 23).view(torch.float32)
    elif scale_dtype == torch.int32:
        scales = exponent.to(torch.uint8).reshape(n_tokens, groups, width // 512, 4)
        scales = scales.view(torch.int32)
        scales = scales.squeeze(-1)
    else:
        scales = exponent.to(torch.uint8).view(scale_dtype)
    return codes, scales


def rope_inverse_quant_output(
    o: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    *,
    groups: int = 1,
    out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
    scale_dtype: torch.dtype | None = None,
    interleaved: bool = True,
    interleaved_out: bool = True,
    pair_tables: bool = False,
    validate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`mlarope.serving.rope_inverse_quant_output` in plain PyTorch: the same arguments,
    checks, errors and result (``out`` and ``scale_out`` themselves when given), computed by
    :func:`inverse_quant_output`."""
    call = checks.check_output_call(
        o, cos, sin, positions, groups, out, scale_out, scale_dtype, interleaved,
        interleaved_out, pair_tables,
    )  # fmt: skip
    if validation_requested(validate):
        checks.validate_output_on_device(call)
    codes, scales = inverse_quant_output(
        call.o, call.cos, call.sin, call.positions, groups=call.groups,
        scale_dtype=call.scale_dtype, interleaved_in=call.interleaved,
        interleaved_out=call.interleaved_out, pair_tables=call.pair_tables,
    )  # fmt: skip
    result = (
        call.out if call.out is not None else torch.empty_like(codes, dtype=torch.float8_e4m3fn)
    )
    scale = call.scale_out if call.scale_out is not None else torch.empty_like(scales)
    with torch.no_grad():
        result.view(torch.uint8).copy_(codes)
        scale.copy_(scales)
    return result, scale
