"""Custom ops and backend dispatch of the serving ops.

The backend follows the tensors, as for the core ops: CUDA tensors run the Triton kernels
(``kernels/serving.py``), CPU tensors the PyTorch reference (:mod:`.reference`), or the same
Triton kernels under Triton's interpreter with ``TRITON_INTERPRET=1``. Each op is a
``torch.library.custom_op`` that declares what it writes (``mutates_args``), so
``torch.compile(fullgraph=True)`` traces through it; eager calls run the implementations
directly. Nothing here syncs with the device or allocates (given ``out``), so both ops can be
captured in a CUDA graph.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Core import point (the backend choice, the tables' common stride).
from .._memory import refuse_shared
from .._modes import use_triton
from ..ops import _same_table_strides
from . import formats, reference
from .checks import refuse_table_halves


def rope_append_kv_cache_impl(
    kv_c: Tensor, k_pe: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, cache: Tensor,
    kpe_cache: Tensor | None, slot_mapping: Tensor, scale: Tensor | None, scale_value: float,
    cache_format: str, interleaved: bool, interleaved_out: bool,
) -> None:  # fmt: skip
    """Write ``T`` tokens into a paged cache (a checked call: ``checks.AppendCall``'s fields).
    No written tensor may have an element in common with a read one or with the other written
    one: checked here too, since a compiled graph reaches this op with real tensors only when
    it runs (under ``aot_eager`` with a clone of the cache: ``checks.common.refuse_shared_op``
    checks the graph's own tensors before)."""
    written = (
        (("cache", cache),) if kpe_cache is None
        else (("ckv (cache[0])", cache), ("kpe (cache[1])", kpe_cache))
    )  # fmt: skip
    refuse_shared(
        written,
        (("kv_c", kv_c), ("k_pe", k_pe), ("cos", cos), ("sin", sin), ("positions", positions),
         ("slot_mapping", slot_mapping), ("kv_scale", scale)),
    )  # fmt: skip
    if not use_triton(kv_c):
        reference.append_kv_cache(
            kv_c, k_pe, cos, sin, positions, cache, kpe_cache, slot_mapping,
            cache_format=cache_format, kv_scale=scale if scale is not None else scale_value,
            interleaved_in=interleaved, interleaved_out=interleaved_out,
        )  # fmt: skip
        return
    append_with_kernel(
        kv_c, k_pe, cos, sin, positions, cache, kpe_cache, slot_mapping, scale, scale_value,
        cache_format, interleaved, interleaved_out,
    )  # fmt: skip


def append_with_kernel(
    kv_c: Tensor, k_pe: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, cache: Tensor,
    kpe_cache: Tensor | None, slot_mapping: Tensor, scale: Tensor | None, scale_value: float,
    cache_format: str, interleaved: bool, interleaved_out: bool, config=None,
) -> None:  # fmt: skip
    """The Triton backend of :func:`rope_append_kv_cache_impl`; ``config``: a
    ``kernels.serving.AppendConfig`` instead of the heuristic's (the benchmark's sweep)."""
    from ..kernels import serving as kernels

    cos, sin = _same_table_strides(cos, sin)
    if cache_format == "fp8_656":
        records = formats.fp8_656_records(cache)
        kernels.rope_append_launch(
            kv_c, k_pe, cos, sin, positions, slot_mapping, records, records.view(torch.int16),
            records.view(torch.int32), rope_offset=formats.FP8_656_ROPE_AT // 2,
            nope_mode=2, rope_mode=5, scale=None, scale_value=1.0, interleaved_in=interleaved,
            interleaved_out=interleaved_out, config=config,
        )  # fmt: skip
        return
    if cache_format == "fp8_584":
        # Three views at the cache's address (a plan maps each back to the cache): the data rows
        # (codes), the same memory as int16 (the bf16 rope values, after 448 bytes) and the
        # scale rows, which start 576 * block_size bytes into the block (TILE_OFFSET).
        codes = formats.fp8_584_bytes(cache)
        n_blocks, block_size = codes.shape[:2]
        stride = codes.stride(0)
        data = codes.as_strided((n_blocks, block_size, formats.FP8_584_DATA_ROW),
                                (stride, formats.FP8_584_DATA_ROW, 1))  # fmt: skip
        rope = codes.view(torch.int16).as_strided(
            (n_blocks, block_size, formats.FP8_584_DATA_ROW // 2),
            (stride // 2, formats.FP8_584_DATA_ROW // 2, 1),
        )
        tiles = codes.as_strided((n_blocks, block_size, formats.FP8_584_SCALE_ROW),
                                 (stride, formats.FP8_584_SCALE_ROW, 1))  # fmt: skip
        kernels.rope_append_launch(
            kv_c, k_pe, cos, sin, positions, slot_mapping, data, rope, tiles,
            rope_offset=formats.FP8_584_ROPE_AT // 2, nope_mode=6, rope_mode=5, scale=None,
            scale_value=1.0, interleaved_in=interleaved, interleaved_out=interleaved_out,
            config=config, tile_offset=block_size * formats.FP8_584_DATA_ROW,
        )  # fmt: skip
        return
    fp8 = cache.dtype in (torch.float8_e4m3fn, torch.uint8)
    nope_dst = kernels.bits(cache)
    rope_dst = nope_dst if kpe_cache is None else kernels.bits(kpe_cache)
    kernels.rope_append_launch(
        kv_c if fp8 else kernels.bits(kv_c), k_pe, cos, sin, positions, slot_mapping, nope_dst,
        rope_dst, None, rope_offset=kv_c.shape[1] if kpe_cache is None else 0,
        nope_mode=1 if fp8 else 0, rope_mode=kernels.rope_mode(cache.dtype), scale=scale,
        scale_value=scale_value, interleaved_in=interleaved, interleaved_out=interleaved_out,
        config=config,
    )  # fmt: skip


def rope_decode_query_out_impl(
    q_nope: Tensor, q_pe: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, out: Tensor,
    scale: Tensor | None, scale_value: float, interleaved: bool, interleaved_out: bool,
) -> None:  # fmt: skip
    """Write ``[q_nope | rotate(q_pe)]`` into ``out: [T, H, L + R]`` (its dtype: the inputs' or
    FP8 e4m3). ``out`` may overlap no input: checked here too (compiled graphs, as above)."""
    refuse_shared(
        (("out", out),),
        (("q_nope", q_nope), ("q_pe", q_pe), ("cos", cos), ("sin", sin),
         ("positions", positions), ("q_scale", scale)),
    )  # fmt: skip
    fp8 = out.dtype == torch.float8_e4m3fn
    if not use_triton(q_nope):
        result = reference.decode_query(
            q_nope, q_pe, cos, sin, positions, out_dtype=out.dtype,
            q_scale=(scale if scale is not None else scale_value) if fp8 else None,
            interleaved_in=interleaved, interleaved_out=interleaved_out,
        )  # fmt: skip
        with torch.no_grad():
            out.copy_(result)
        return
    query_with_kernel(
        q_nope, q_pe, cos, sin, positions, out, scale, scale_value, interleaved, interleaved_out
    )


def query_with_kernel(
    q_nope: Tensor, q_pe: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, out: Tensor,
    scale: Tensor | None, scale_value: float, interleaved: bool, interleaved_out: bool,
    config=None,
) -> None:  # fmt: skip
    """The Triton backend of :func:`rope_decode_query_out_impl` (``config``: a
    ``kernels.serving.QueryConfig``, for the benchmark's sweep)."""
    from ..kernels import serving as kernels

    fp8 = out.dtype == torch.float8_e4m3fn
    cos, sin = _same_table_strides(cos, sin)
    kernels.rope_decode_query_launch(
        q_nope if fp8 else kernels.bits(q_nope), q_pe, kernels.bits(out), cos, sin, positions,
        nope_mode=1 if fp8 else 0, rope_mode=kernels.rope_mode(out.dtype), scale=scale,
        scale_value=scale_value, interleaved_in=interleaved, interleaved_out=interleaved_out,
        config=config,
    )  # fmt: skip


def rope_inverse_quant_output_impl(
    o: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, out: Tensor, scale_out: Tensor,
    groups: int, interleaved: bool, interleaved_out: bool, pair_tables: bool,
) -> None:  # fmt: skip
    """Write DeepSeek-V4's attention output ``o: [T, H, D]``, inverse-rotated and quantized,
    into ``out`` (e4m3 codes ``[T, G, (H / G) * D]``) and ``scale_out`` (its UE8M0 scales, in
    ``scale_out``'s dtype: ``checks.OutputCall``). Neither may overlap an input or the other,
    and full tables may not be the halves of one buffer: checked here too (compiled graphs,
    as above)."""
    refuse_shared(
        (("out", out), ("scale_out", scale_out)),
        (("o", o), ("cos", cos), ("sin", sin), ("positions", positions)),
    )
    if not pair_tables:
        refuse_table_halves(cos, sin)
    if not use_triton(o):
        codes, scales = reference.inverse_quant_output(
            o, cos, sin, positions, groups=groups, scale_dtype=scale_out.dtype,
            interleaved_in=interleaved, interleaved_out=interleaved_out, pair_tables=pair_tables,
        )  # fmt: skip
        with torch.no_grad():
            out.view(torch.uint8).copy_(codes)
            scale_out.copy_(scales)
        return
    output_with_kernel(
        o, cos, sin, positions, out, scale_out, groups, interleaved, interleaved_out, pair_tables
    )


def output_with_kernel(
    o: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, out: Tensor, scale_out: Tensor,
    groups: int, interleaved: bool, interleaved_out: bool, pair_tables: bool = False,
    config=None,
) -> None:  # fmt: skip
    """The Triton backend of :func:`rope_inverse_quant_output_impl` (``config``: a
    ``kernels.output_quant.OutputConfig``, for the benchmark's sweep)."""
    from ..kernels import output_quant as kernels

    cos, sin = _same_table_strides(cos, sin)
    fp32 = scale_out.dtype == torch.float32
    packed = scale_out.dtype == torch.int32
    if fp32:
        scale_bits = scale_out.view(torch.int32)
    else:
        scale_bits = scale_out if packed else scale_out.view(torch.uint8)
    kernels.rope_inverse_quant_launch(
        o, cos, sin, positions, out.view(torch.uint8), scale_bits,
        heads_per_group=o.shape[1] // groups, pack=4 if packed else 1,
        scale_fmt=kernels.SCALE_FP32 if fp32 else kernels.SCALE_E8M0, interleaved_in=interleaved,
        interleaved_out=interleaved_out, pair_tables=pair_tables, config=config,
    )  # fmt: skip


def rope_decode_query_impl(
    q_nope: Tensor, q_pe: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, fp8: bool,
    scale: Tensor | None, scale_value: float, interleaved: bool, interleaved_out: bool,
) -> Tensor:  # fmt: skip
    """The same into a new contiguous ``[T, H, L + R]`` tensor."""
    out = q_nope.new_empty(
        (*q_nope.shape[:2], q_nope.shape[2] + q_pe.shape[2]),
        dtype=torch.float8_e4m3fn if fp8 else q_nope.dtype,
    )
    rope_decode_query_out_impl(
        q_nope, q_pe, cos, sin, positions, out, scale, scale_value, interleaved, interleaved_out
    )
    return out


# ------------------------------------------------------------------------------- custom ops
rope_append_kv_cache_op = torch.library.custom_op(
    "mlarope::rope_append_kv_cache", rope_append_kv_cache_impl, mutates_args=("cache", "kpe_cache")
)
rope_decode_query_op = torch.library.custom_op(
    "mlarope::rope_decode_query", rope_decode_query_impl, mutates_args=()
)
rope_decode_query_out_op = torch.library.custom_op(
    "mlarope::rope_decode_query_out", rope_decode_query_out_impl, mutates_args=("out",)
)
rope_inverse_quant_output_op = torch.library.custom_op(
    "mlarope::rope_inverse_quant_output", rope_inverse_quant_output_impl,
    mutates_args=("out", "scale_out"),
)  # fmt: skip


@rope_inverse_quant_output_op.register_fake
def _output_fake(*args) -> None:
    return None


@rope_append_kv_cache_op.register_fake
def _append_fake(*args) -> None:
    return None


@rope_decode_query_out_op.register_fake
def _query_out_fake(*args) -> None:
    return None


@rope_decode_query_op.register_fake
def _query_fake(q_nope, q_pe, cos, sin, positions, fp8, *args):
    return q_nope.new_empty(
        (*q_nope.shape[:2], q_nope.shape[2] + q_pe.shape[2]),
        dtype=torch.float8_e4m3fn if fp8 else q_nope.dtype,
    )
