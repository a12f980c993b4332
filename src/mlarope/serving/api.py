"""The public serving calls: plan or checks -> (validation) -> custom op or implementation."""

from __future__ import annotations

import contextlib

import torch

# Core import point (validation switch, shared with the core ops).
from .._checks import validation_requested
from . import _plans, checks, ops


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
    """Rotate ``k_pe`` and write each token's MLA cache entry into its slot, in one launch.

    Token ``t`` goes to slot ``s = slot_mapping[t]``: entry ``s % block_size`` of block
    ``s // block_size``. A slot of -1 marks a padding token (nothing is written for it; its
    rows of the inputs may be read); a slot outside the cache is never written
    (``validate=True`` raises).

    Args:
        kv_c: ``[T, L]`` latent (``L = 512`` for DeepSeek-V3), bf16, fp16 or fp32; last dim
            contiguous.
        k_pe: ``[T, R]`` or ``[T, 1, R]`` positional key, ``kv_c``'s dtype and device.
        cos, sin: ``[P, R]`` tables (``YarnConfig.cos_sin``), fp32 preferred; with
            ``pair_tables=True``, ``[P, R / 2]``.
        positions: ``[T]`` int32/int64, each token's position. A position outside ``[0, P)``
            writes NaN rope values (FP8: the NaN code ``0x7F``).
        cache: ``cache_format="concat"``: ``[num_blocks, block_size, L + R]`` of ``kv_c``'s
            dtype or FP8 e4m3 (``float8_e4m3fn``, or ``uint8`` codes); ``"split"``: a pair
            ``(ckv [num_pages, page_size, L], kpe [num_pages, page_size, R])`` as above;
            ``"fp8_656"``: FlashMLA's records, ``[num_blocks, block_size, 656]`` or
            ``[num_blocks, block_size, 1, 656]`` bytes (``L = 512``, ``R = 64``);
            ``"fp8_584"``: DeepSeek-V4's cache as FlashMLA allocates it, ``[num_blocks,
            block_size, 1, 584]`` (or 3-D) bytes, blocks a multiple of 576 bytes apart
            (``L = 448``, ``R = 64``).
        slot_mapping: ``[T]`` int32/int64 slots.
        cache_format: ``"concat"``, ``"split"``, ``"fp8_656"`` or ``"fp8_584"``
            (docs/serving.md).
        kv_scale: the per-tensor DEQUANT scale of an FP8 ``concat`` / ``split`` cache
            (``stored = e4m3(x / kv_scale)``, ``x = stored * kv_scale``; FlashInfer's
            ``quant_scale_kv`` is its reciprocal): a real number (``numbers.Real`` but bool:
            numpy's scalars too), or a 1-element fp32 tensor on the device (read by the kernel,
            so a CUDA graph can change it). None otherwise.
        interleaved: ``k_pe``'s pairs are ``(x[2j], x[2j+1])`` (True, DeepSeek checkpoints) or
            ``(x[j], x[R/2 + j])``.
        interleaved_out: write the rotated pairs interleaved (True, default: the bytes vLLM and
            FlashMLA caches hold for DeepSeek models) or half-split. The query must use the
            same layout (:func:`rope_decode_query`).
        pair_tables: ``cos, sin`` are pair tables ``[P, R / 2]``, one entry per rotated pair,
            standing for the tables ``[P, R]`` whose two halves repeat it (the library's
            tables: ``cos[:, :R // 2]``; an engine's ``cos_sin_cache [P, R]``, cos then sin:
            its two column views). The full tables' bits, half the table bytes a token.
        validate: check device data (slots in the cache and distinct, positions in the table,
            a tensor scale), raising ``ValueError``; costs a sync. Also ``MLAROPE_VALIDATE=1``.

    fp32 math with the exact tables, one rounding or quantization per stored element; FP8
    saturates to +-448. ``fp8_656`` and ``fp8_584`` compute each token's tile scales (FlashMLA's
    power-of-two rule: four fp32 scales of 128 channels, or seven UE8M0 bytes of 64) and store
    the rope part in bf16. Not differentiable.
    """
    signature = _plans.append_signature(
        kv_c, k_pe, cos, sin, positions, cache, slot_mapping, cache_format, kv_scale,
        interleaved, interleaved_out, pair_tables, validate,
    )  # fmt: skip
    plan = _plans.find(signature)
    if plan.__class__ is _plans.Plan:  # a repeated eager call
        if plan(signature[1], signature[2], signature[3]) is not _plans.MISSING:
            return
        plan = None
    call = checks.check_append_call(
        kv_c, k_pe, cos, sin, positions, cache, slot_mapping, cache_format, kv_scale,
        interleaved, interleaved_out, pair_tables,
    )  # fmt: skip
    if validation_requested(validate):
        checks.validate_append_on_device(call)
    if torch.compiler.is_compiling():
        ops.rope_append_kv_cache_op(*call.op_args())
        return
    with _recording(signature if plan is _plans.MISSING else None, call.kv_c) as launches:
        ops.rope_append_kv_cache_impl(*call.op_args())
    if launches is not None:
        written = (6,) if call.kpe_cache is None else (6, 7)
        _plans.record(signature, launches, written)


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
    """Build the absorbed MLA decode query ``[q_nope | rotate(q_pe)]`` in one launch.

    Args:
        q_nope: ``[T, H, L]``, the nope query already absorbed (``q_nope @ W_UK``), bf16, fp16
            or fp32; last dim contiguous, any token and head strides.
        q_pe: ``[T, H, R]``, ``q_nope``'s dtype and device.
        cos, sin: ``[P, R]`` tables, fp32 preferred; with ``pair_tables=True``, ``[P, R / 2]``.
        positions: ``[T]`` int32/int64. A position outside ``[0, P)`` writes NaN rope values.
        out: a ``[T, H, L + R]`` buffer to write (last dim contiguous), or None for a new
            contiguous tensor. Given, the call allocates nothing (CUDA graphs).
        out_dtype: ``q_nope``'s dtype (default) or ``torch.float8_e4m3fn``; taken from ``out``
            when given.
        q_scale: the per-tensor DEQUANT scale of an FP8 output (``stored = e4m3(x /
            q_scale)``); a real number or a 1-element fp32 tensor on the device, as
            ``kv_scale`` in :func:`rope_append_kv_cache`; None otherwise.
        interleaved, interleaved_out: the rope pair layouts, as in
            :func:`rope_append_kv_cache` (default interleaved in and out: match the cache).
        pair_tables: ``cos, sin`` are pair tables ``[P, R / 2]``, as in
            :func:`rope_append_kv_cache`.
        validate: check positions and a tensor scale on the device (a sync).

    Returns:
        ``[T, H, L + R]``: ``out`` itself when given. fp32 math, one rounding or quantization
        per element. Not differentiable.
    """
    signature = _plans.query_signature(
        q_nope, q_pe, cos, sin, positions, out, out_dtype, q_scale, interleaved,
        interleaved_out, pair_tables, validate,
    )  # fmt: skip
    plan = _plans.find(signature)
    if plan.__class__ is _plans.Plan:  # a repeated eager call
        result = plan(signature[1], signature[2], signature[3])
        if result is not _plans.MISSING:
            return out if out is not None else result
        plan = None
    call = checks.check_query_call(
        q_nope, q_pe, cos, sin, positions, out, out_dtype, q_scale, interleaved,
        interleaved_out, pair_tables,
    )  # fmt: skip
    if validation_requested(validate):
        checks.validate_query_on_device(call)
    inputs = (call.q_nope, call.q_pe, call.cos, call.sin, call.positions)
    if torch.compiler.is_compiling():
        if call.out is None:
            return ops.rope_decode_query_op(*inputs, call.fp8, *call.op_args())
        ops.rope_decode_query_out_op(*inputs, call.out, *call.op_args())
        return call.out
    with _recording(signature if plan is _plans.MISSING else None, call.q_nope) as launches:
        if call.out is None:
            result = ops.rope_decode_query_impl(*inputs, call.fp8, *call.op_args())
        else:
            ops.rope_decode_query_out_impl(*inputs, call.out, *call.op_args())
            result = call.out
    if launches is not None:
        if call.out is None:
            _plans.record(signature, launches, (), out=result)
        else:
            _plans.record(signature, launches, (len(signature[1]) - 1,))
    return result


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
    """DeepSeek-V4's attention output for its FP8 grouped output projection, in one launch:
    inverse RoPE on the trailing rope slice of each head, then FP8 e4m3 with one power-of-two
    (UE8M0) scale per 128 contiguous channels.

    Args:
        o: ``[T, H, D]`` attention output, heads ``[nope | rope]`` (DeepSeek-V4: ``D = 512``,
            rope the last ``R = 64``), bf16, fp16 or fp32; last dim contiguous, any token and
            head strides. ``D`` a positive multiple of 128.
        cos, sin: ``[P, R]`` tables of the positions' rope set, fp32 preferred; with
            ``pair_tables=True``, ``[P, R / 2]``. ``R`` comes from the tables, so an engine's
            ``cos_sin_cache`` halves without the flag are refused.
        positions: ``[T]`` int32/int64, each token's (query) position. A position outside
            ``[0, P)`` gives NaN rope values (e4m3 code ``0x7F``); ``validate=True`` raises.
        groups: ``G``, the output projection's head groups (DeepSeek-V4's ``o_groups`` on this
            rank; each holds ``H / G`` consecutive heads).
        out: ``[T, G, (H / G) * D]`` e4m3 codes (``torch.float8_e4m3fn`` or ``uint8``), last dim
            contiguous, any token and group strides (vLLM's group-major ``[G, T, ..]`` buffer
            transposed, say); None: a new contiguous one.
        scale_out: the dequant scales, ``[T, G, (H / G) * D / 128]`` of fp32 or UE8M0 bytes
            (``torch.float8_e8m0fnu`` or ``uint8``: the biased exponent), or ``[T, G, (H / G) *
            D / 512]`` int32 (four UE8M0 bytes each, block ``k`` in byte ``k % 4``: DeepGEMM's
            packed scales), any strides (MN-major and padded included); None: a new contiguous
            one of ``scale_dtype``.
        scale_dtype: the scales' dtype when ``scale_out`` is None (default fp32); taken from
            ``scale_out`` when given.
        interleaved, interleaved_out: the rope pairs' layout in ``o`` and in ``out``
            (DeepSeek-V4: interleaved in and out, the defaults).
        pair_tables: ``cos, sin`` are pair tables ``[P, R / 2]``, as in
            :func:`rope_append_kv_cache`.
        validate: check the positions on the device (a sync). Also ``MLAROPE_VALIDATE=1``.

    Returns:
        ``(out, scale_out)``: the given tensors themselves when given. fp32 math (the inverse
        rotation's products and sums each rounded to fp32, as PyTorch's, never fused: the same
        bytes on every backend), one quantization per element: ``code = e4m3(x / s)``
        saturating, ``s = 2 ** ceil(log2(max(amax, 1e-4) / 448))`` over the 128-channel block
        (NaN not counted), DeepSeek's ``act_quant`` rule with ``scale_fmt="ue8m0"``. No device
        sync; given ``out`` and ``scale_out`` nothing is allocated (CUDA graphs). Not
        differentiable: without quantization, ``mlarope.apply_rope_q(o, cos, sin, layout="thd",
        position_ids=positions, interleaved=True, interleaved_out=True, inverse=True)`` is the
        same rotation with a backward (docs/serving.md).
    """
    signature = _plans.output_signature(
        o, cos, sin, positions, groups, out, scale_out, scale_dtype, interleaved,
        interleaved_out, pair_tables, validate,
    )  # fmt: skip
    plan = _plans.find(signature)
    if plan.__class__ is _plans.Plan:  # a repeated eager call
        result = plan(signature[1], signature[2], signature[3])
        if result is not _plans.MISSING:
            new = iter(() if result is None else result if isinstance(result, tuple) else (result,))
            return (
                out if out is not None else next(new),
                scale_out if scale_out is not None else next(new),
            )
        plan = None
    call = checks.check_output_call(
        o, cos, sin, positions, groups, out, scale_out, scale_dtype, interleaved,
        interleaved_out, pair_tables,
    )  # fmt: skip
    if validation_requested(validate):
        checks.validate_output_on_device(call)
    new_out = call.out
    if new_out is None:
        new_out = call.o.new_empty((o.shape[0], groups, call.width), dtype=torch.float8_e4m3fn)
    new_scale = call.scale_out
    if new_scale is None:
        new_scale = call.o.new_empty(call.scale_shape(), dtype=call.scale_dtype)
    if torch.compiler.is_compiling():
        ops.rope_inverse_quant_output_op(*call.op_args(new_out, new_scale))
        return new_out, new_scale
    with _recording(signature if plan is _plans.MISSING else None, call.o) as launches:
        ops.rope_inverse_quant_output_impl(*call.op_args(new_out, new_scale))
    if launches is not None:
        n = len(signature[1])
        written = tuple(range(4, n))  # out and scale_out where given
        allocated = tuple(t for t, given in ((new_out, call.out), (new_scale, call.scale_out))
                          if given is None)  # fmt: skip
        _plans.record(signature, launches, written, out=allocated or None)
    return new_out, new_scale


def _recording(signature, first: torch.Tensor):
    """Note the call's launches when it is to get a plan and runs a kernel."""
    if signature is None or not ops.use_triton(first):
        return contextlib.nullcontext()
    from .._recording import recording

    return recording()
