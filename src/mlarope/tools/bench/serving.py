"""``python -m mlarope.tools.bench.serving``: the serving ops on one GPU, in one run, side by side.

DeepSeek-V3 shapes (``L = 512``, ``R = 64``, ``H = 128`` query heads, bf16 activations, fp32
YaRN tables of 32,768 positions, pages of 64 tokens) for a prefill batch (16,384 tokens) and
decode batches (1, 8, 64, 256 tokens); DeepSeek-V4's for its FP8 cache (``fp8_584``: ``L =
448``) and its attention output (``[T, 128, 512]``, V4-Pro's heads, 16 groups of 8: the inverse
RoPE with FP8 quantization for the grouped output projection). For each cache format, the
decode query and the output op:

- the bytes model (:func:`bytes_moved`) and the time: ``do_bench`` with the L2 flushed for the
  prefill batch, CUDA-graph replay over rotated input sets for decode batches (the method of
  ``mlarope.tools.bench``);
- % of the device-to-device copy bandwidth measured at the start of the run (1 GiB), and the
  time of a copy of the same bytes (what a plain copy reaches at that size);
- decode: the host time of an eager call (median of loops of ``--host-calls`` calls), with a
  one-element torch op's host time measured right after it;
- the unfused sequence it replaces: mlarope's rotation (``apply_rope_q``), ``torch.cat``, the
  FP8 quantization and ``index_copy_`` into the cache (the output op: the inverse rotation,
  then DeepSeek's ``act_quant`` recipe in torch: block amax, UE8M0 scale, division, clamp,
  conversion); its time and host time, the speed-up, and a check that both wrote the same
  values (within one rounding or one e4m3 step);
- FlashInfer's ``rope_quantize_fp8_append_paged_kv_cache`` (the split FP8 cache),
  ``mla_rope_quantize_fp8`` (the FP8 query) and ``append_paged_mla_kv_cache`` (the split bf16
  cache; a plain append without rotation, handed the rotated values) on the same inputs, when
  ``flashinfer`` imports (it is not a dependency).

Targets (judged on the GPU): prefill >= 90 % of the copy; decode host time <= 15 us.
``--sweep`` also times other launch configurations and the integer FP8 encoder on the prefill
batch, and the decode query's launch configurations at each decode batch. Writes
``OUT/serving.json`` and ``OUT/serving.md`` with ``--out OUT``.
What the compiler makes of the serving kernels (no GPU) is
``python benchmarks/serving_kernel_report.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import mlarope
from mlarope.serving.reference import e4m3_decode, read_kv_cache

from .cases import rotation_sets
from .model import target_status
from .timers import CpuTimer, CudaTimer, Timing

PREFILL_TARGET = 0.90
HOST_TARGET_US = 15.0


@dataclass(frozen=True)
class Dims:
    latent: int = 512
    rope: int = 64
    heads: int = 128
    block_size: int = 64
    positions: int = 32768
    dtype: torch.dtype = torch.bfloat16
    v4_latent: int = 448  # DeepSeek-V4's nope width: fp8_584's latent
    head_dim: int = 512  # DeepSeek-V4's head, [nope 448 | rope 64]: the output op's D
    heads_per_group: int = 8  # V4's o_groups split its heads in groups of 8 (Pro: 128 / 16)
    # Every op is given pair tables [P, R / 2] (an engine's cos_sin_cache halves; FlashInfer's
    # input too), else the full tables [P, R] (--tables full).
    pair_tables: bool = True


@dataclass(frozen=True)
class OpSpec:
    key: str
    label: str
    kind: str  # "append" | "query" | "output"
    fmt: str = ""  # cache format (append)
    cache_dtype: torch.dtype | None = None  # concat / split: the cache's dtype
    fp8_out: bool = False  # query: FP8 output
    out_given: bool = False  # query, output: into a caller's buffers (output: vLLM's layout)


OPS = (
    OpSpec("append_concat_bf16", "append concat bf16", "append", "concat", torch.bfloat16),
    OpSpec("append_concat_fp8", "append concat fp8", "append", "concat", torch.float8_e4m3fn),
    OpSpec("append_split_bf16", "append split bf16", "append", "split", torch.bfloat16),
    OpSpec("append_split_fp8", "append split fp8", "append", "split", torch.float8_e4m3fn),
    OpSpec("append_fp8_656", "append fp8_656", "append", "fp8_656"),
    OpSpec("append_fp8_584", "append fp8_584 (V4)", "append", "fp8_584"),
    OpSpec("query_bf16", "decode query bf16", "query"),
    OpSpec("query_fp8", "decode query fp8", "query", fp8_out=True),
    OpSpec("query_fp8_out", "decode query fp8 into buffer", "query", fp8_out=True, out_given=True),
    OpSpec("output_fp8", "inverse rope fp8 output (V4)", "output", fp8_out=True),
    OpSpec(
        "output_fp8_vllm",
        "inverse rope fp8 output, vLLM layout",
        "output",
        fp8_out=True,
        out_given=True,
    ),
)
OPS_BY_KEY = {op.key: op for op in OPS}
CASES = {"prefill": 16384, "decode1": 1, "decode8": 8, "decode64": 64, "decode256": 256}
SMOKE_CASES = {"prefill": 16, "decode1": 1, "decode8": 8}


def bytes_moved(op: OpSpec, tokens: int, dims: Dims) -> int:
    """Fewest bytes a call moves: each input read once, each output written once, and the
    table rows the positions select (:func:`table_bytes`); positions and slots not counted (16
    bytes a token). ``e``: the activation dtype's bytes.

    - append, concat / split: read ``kv_c`` and ``k_pe`` (``(L + R) * e``), write the entry
      (``(L + R)`` elements of the cache's dtype) per token;
    - append, fp8_656: read ``(L + R) * e``, write 656 bytes per token;
    - append, fp8_584: read ``(448 + R) * e``, write 584 bytes per token;
    - decode query: read ``q_nope`` and ``q_pe``, write ``[T, H, L + R]`` in the output dtype
      (``e`` or 1 byte) per token and head;
    - output: read ``o`` (``D * e``), write ``D`` codes and ``D / 128`` fp32 scales per token
      and head.
    """
    return _data_bytes(op, tokens, dims) + table_bytes(op, tokens, dims)


def table_bytes(op: OpSpec, tokens: int, dims: Dims) -> int:
    """The fp32 ``cos`` and ``sin`` rows of the distinct positions: the benchmark's positions
    are uniform over the table's ``P`` rows, ``P * (1 - (1 - 1/P) ** T)`` distinct ones
    expected (12,893 of 16,384 prefill tokens), each row read from memory once (do_bench flushes
    the L2 before each prefill call; decode rotates input sets past it). 512 bytes a row of the
    full tables, 256 of pair tables (at prefill 6.6 or 3.3 MB: a quarter to an eleventh of an
    append's data bytes, docs/perf_log.md v16); under a thousandth of the query's."""
    p = dims.positions
    rows = round(p * -math.expm1(tokens * math.log1p(-1.0 / p)))
    width = dims.rope // 2 if _takes_pair_tables(op, dims) else dims.rope
    return rows * 2 * width * 4


def _data_bytes(op: OpSpec, tokens: int, dims: Dims) -> int:
    e = torch.empty((), dtype=dims.dtype).element_size()
    width = dims.latent + dims.rope
    if op.kind == "output":
        d = dims.head_dim
        return tokens * dims.heads * (d * e + d + d // 128 * 4)
    if op.kind == "append":
        if op.fmt == "fp8_656":
            return tokens * (width * e + 656)
        if op.fmt == "fp8_584":
            return tokens * ((dims.v4_latent + dims.rope) * e + 584)
        cache_e = torch.empty((), dtype=op.cache_dtype).element_size()
        return tokens * width * (e + cache_e)
    out_e = 1 if op.fp8_out else e
    return tokens * dims.heads * width * (e + out_e)


# ============================================================================ inputs
@dataclass
class Inputs:
    """One input set of an op: the activations, positions, slots and the destination."""

    kv_c: torch.Tensor | None = None
    k_pe: torch.Tensor | None = None
    q_nope: torch.Tensor | None = None
    q_pe: torch.Tensor | None = None
    o: torch.Tensor | None = None  # output op: [T, H, D]
    groups: int = 1  # output op: the head groups of the output projection
    scale_out: torch.Tensor | None = None  # output op, vLLM's layout: MN-major fp32 scales
    positions: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    cache: object = None
    out: torch.Tensor | None = None
    scale: torch.Tensor | None = None


def _slots(tokens: int, dims: Dims, gen, prefill: bool) -> tuple[torch.Tensor, int]:
    """``(slots, num_blocks)``: prefill tokens fill shuffled pages in order (a sequence's
    pages), decode tokens go to random slots of a cache twice their number."""
    bs = dims.block_size
    if prefill:
        n_blocks = -(-tokens // bs)
        pages = torch.randperm(n_blocks, generator=gen)
        t = torch.arange(tokens)
        return pages[t // bs] * bs + t % bs, n_blocks
    n_blocks = max(1, -(-2 * tokens // bs))
    return torch.randperm(n_blocks * bs, generator=gen)[:tokens], n_blocks


def make_inputs(op: OpSpec, tokens: int, dims: Dims, device, gen, prefill: bool) -> Inputs:
    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dims.dtype).to(device)

    positions = torch.randint(0, dims.positions, (tokens,), generator=gen).to(device)
    inp = Inputs(positions=positions, scale=torch.tensor([0.05], device=device))
    width = dims.latent + dims.rope
    if op.kind == "output":
        inp.o = randn(tokens, dims.heads, dims.head_dim)
        inp.groups = max(1, dims.heads // dims.heads_per_group)
        if op.out_given:
            inp.out, inp.scale_out = vllm_output_buffers(tokens, dims, device)
        return inp
    if op.kind == "query":
        inp.q_nope = randn(tokens, dims.heads, dims.latent)
        inp.q_pe = randn(tokens, dims.heads, dims.rope)
        if op.out_given:
            dtype = torch.float8_e4m3fn if op.fp8_out else dims.dtype
            inp.out = torch.empty(tokens, dims.heads, width, dtype=dtype, device=device)
        return inp
    # a fused projection's output, as engines slice it
    latent = dims.v4_latent if op.fmt == "fp8_584" else dims.latent
    proj = randn(tokens, latent + dims.rope)
    inp.kv_c, inp.k_pe = proj[:, :latent], proj[:, latent:]
    slots, n_blocks = _slots(tokens, dims, gen, prefill)
    inp.slots = slots.to(device)
    bs = dims.block_size
    if op.fmt == "fp8_656":
        inp.cache = torch.zeros(n_blocks, bs, 656, dtype=torch.uint8, device=device)
    elif op.fmt == "fp8_584":  # as FlashMLA allocates it: blocks padded to 576 bytes
        padded = -(-bs * 584 // 576) * 576
        raw = torch.zeros(n_blocks, padded, dtype=torch.uint8, device=device)
        inp.cache = raw[:, : bs * 584].view(n_blocks, bs, 1, 584)
    elif op.fmt == "concat":
        inp.cache = torch.zeros(n_blocks, bs, width, dtype=op.cache_dtype, device=device)
    else:
        inp.cache = (
            torch.zeros(n_blocks, bs, dims.latent, dtype=op.cache_dtype, device=device),
            torch.zeros(n_blocks, bs, dims.rope, dtype=op.cache_dtype, device=device),
        )
    return inp


def vllm_output_buffers(tokens: int, dims: Dims, device) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's buffers for DeepSeek-V4's FP8 output projection on Hopper
    (``fused_inv_rope_fp8_quant``): codes ``[G, T, W]`` and fp32 scales ``[G, K, T']`` (``T'``
    the tokens rounded up to 4, MN-major, as DeepGEMM takes them), as the ``[T, G, ..]`` views
    the op writes."""
    g = max(1, dims.heads // dims.heads_per_group)
    width = dims.heads // g * dims.head_dim
    k = width // 128
    padded = -(-tokens // 4) * 4
    codes = torch.empty(g, tokens, width, dtype=torch.float8_e4m3fn, device=device)
    scales = torch.zeros(g * k * padded, dtype=torch.float32, device=device)
    scales = scales.as_strided((g, tokens, k), (k * padded, 1, padded))
    return codes.transpose(0, 1), scales.transpose(0, 1)


def _fp8_cache(op: OpSpec) -> bool:
    return op.cache_dtype == torch.float8_e4m3fn


def _takes_pair_tables(op: OpSpec, dims: Dims) -> bool:
    """Whether ours is given pair tables: ``dims.pair_tables``, for every op."""
    return dims.pair_tables


def rope_tables(op: OpSpec, dims: Dims, cos, sin):
    """The tables ours is given: with ``dims.pair_tables`` the pair tables ``[P, R / 2]``
    (column views of the ``[P, R]`` tables, as an engine's ``cos_sin_cache`` halves are), else
    the full tables."""
    if _takes_pair_tables(op, dims):
        half = cos.shape[1] // 2
        return cos[:, :half], sin[:, :half]
    return cos, sin


def ours(op: OpSpec, inp: Inputs, cos, sin, dims: Dims) -> Callable[[], object]:
    """The call through the public API (its eager plan after the first call)."""
    from mlarope.serving import rope_append_kv_cache, rope_decode_query, rope_inverse_quant_output

    cos, sin = rope_tables(op, dims, cos, sin)
    pair = _takes_pair_tables(op, dims)

    if op.kind == "output":
        return lambda: rope_inverse_quant_output(
            inp.o, cos, sin, inp.positions, groups=inp.groups, out=inp.out,
            scale_out=inp.scale_out, pair_tables=pair,
        )  # fmt: skip
    if op.kind == "append":
        scale = inp.scale if _fp8_cache(op) else None
        return lambda: rope_append_kv_cache(
            inp.kv_c, inp.k_pe, cos, sin, inp.positions, inp.cache, inp.slots,
            cache_format=op.fmt, kv_scale=scale, pair_tables=pair,
        )  # fmt: skip
    fp8 = torch.float8_e4m3fn if op.fp8_out else None
    scale = inp.scale if op.fp8_out else None
    return lambda: rope_decode_query(
        inp.q_nope, inp.q_pe, cos, sin, inp.positions, out=inp.out, out_dtype=fp8,
        q_scale=scale, pair_tables=pair,
    )  # fmt: skip


def _quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def unfused(op: OpSpec, inp: Inputs, cos, sin) -> Callable[[], object]:
    """What a user of mlarope did before: the rotation, ``torch.cat``, the quantization and
    ``index_copy_`` (``fp8_656``: FlashMLA's own recipe for the tile scales and the record)."""
    import mlarope

    def rotate(x):  # x: [T, H, R] -> rotated, pairs kept interleaved (the cache's layout)
        return mlarope.apply_rope_q(
            x, cos, sin, layout="thd", position_ids=inp.positions, interleaved=True,
            interleaved_out=True,
        )  # fmt: skip

    if op.kind == "output":
        t, h, d = inp.o.shape

        def output():
            # the inverse rotation (rounded to o's dtype, as DeepSeek's apply_rotary_emb), then
            # DeepSeek's act_quant with UE8M0 scales, in torch
            o = mlarope.apply_rope_q(
                inp.o, cos, sin, layout="thd", position_ids=inp.positions, interleaved=True,
                interleaved_out=True, inverse=True,
            )  # fmt: skip
            x = o.float().view(t, h * d // 128, 128)
            amax = x.abs().amax(-1).clamp_min(1e-4)
            scale = torch.exp2(torch.ceil(torch.log2(amax * (1.0 / 448.0))))
            codes = (x / scale.unsqueeze(-1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            codes, scale = codes.view(t, inp.groups, -1), scale.view(t, inp.groups, -1)
            if inp.out is not None:
                inp.out.copy_(codes)
                inp.scale_out.copy_(scale)
                return inp.out, inp.scale_out
            return codes, scale

        return output

    if op.kind == "query":

        def query():
            q = torch.cat((inp.q_nope, rotate(inp.q_pe)), dim=-1)
            q = _quantize(q, inp.scale) if op.fp8_out else q
            if inp.out is not None:
                inp.out.copy_(q)
                return inp.out
            return q

        return query

    t = inp.kv_c.shape[0]

    def append():
        k_rot = rotate(inp.k_pe.unsqueeze(1)).squeeze(1)
        if op.fmt == "fp8_584":  # FlashMLA's quantize_k_cache recipe (MODEL1_FP8Sparse)
            x = inp.kv_c.float().view(t, 7, 64)
            scale = (x.abs().amax(-1) / 448.0).clamp_min(1e-4).log2().ceil().exp2()
            codes = (x / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).view(torch.uint8)
            rows = torch.cat((codes.view(t, 448), k_rot.to(torch.bfloat16).view(torch.uint8)), 1)
            ue8m0 = ((scale.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
            n_blocks, bs = inp.cache.shape[:2]
            raw = inp.cache.view(torch.uint8).squeeze(2)
            raw = raw.as_strided((n_blocks, bs * 584), (raw.stride(0), 1))
            data = raw[:, : bs * 576].unflatten(1, (bs, 576))
            scales = raw[:, bs * 576 :].unflatten(1, (bs, 8))
            # The benchmark's slots are all cache entries (no padding): indexing by them keeps the
            # sequence capturable in a CUDA graph (a boolean mask syncs: run G5 failed there).
            blocks, entries = inp.slots // bs, inp.slots % bs
            data[blocks, entries] = rows
            scales[blocks, entries, :7] = ue8m0
            return
        if op.fmt == "fp8_656":
            x = inp.kv_c.float().view(t, 4, 128)
            scale = (x.abs().amax(-1) / 448.0).clamp_min(1e-4).log2().ceil().exp2()
            codes = (x / scale.unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn)
            entry = torch.cat(
                (codes.view(torch.uint8).view(t, 512), scale.view(torch.uint8),
                 k_rot.to(torch.bfloat16).view(torch.uint8)), dim=1,
            )  # fmt: skip
            inp.cache.view(-1, 656).index_copy_(0, inp.slots, entry)
            return
        fp8 = _fp8_cache(op)
        if op.fmt == "concat":
            entry = torch.cat((inp.kv_c, k_rot), dim=1)
            if fp8:
                entry = _quantize(entry, inp.scale).view(torch.uint8)
                inp.cache.view(torch.uint8).view(-1, entry.shape[1]).index_copy_(
                    0, inp.slots, entry
                )
            else:
                inp.cache.view(-1, entry.shape[1]).index_copy_(0, inp.slots, entry)
            return
        ckv, kpe = inp.cache
        for target, values in ((ckv, inp.kv_c), (kpe, k_rot)):
            if fp8:
                values = _quantize(values, inp.scale).view(torch.uint8)
                target = target.view(torch.uint8)
            target.view(-1, values.shape[1]).index_copy_(0, inp.slots, values)

    return append


def _readback(op: OpSpec, inp: Inputs, result, dims: Dims) -> torch.Tensor:
    """What a call wrote, dequantized to fp32: ``[T, L + R]`` entries, the query, or the
    output op's ``[T, G, W]``."""
    if op.kind == "output":
        codes, scale = result if inp.out is None else (inp.out, inp.scale_out)
        t, g, w = codes.shape
        values = e4m3_decode(codes).view(t, g, w // 128, 128) * scale.float().unsqueeze(-1)
        return values.reshape(t, g, w)
    if op.kind == "query":
        q = inp.out if inp.out is not None else result
        return (e4m3_decode(q) * inp.scale) if op.fp8_out else q.float()
    scale = inp.scale if _fp8_cache(op) else None
    latent, rope = read_kv_cache(
        inp.cache, inp.slots, cache_format=op.fmt, rope_dim=dims.rope, kv_scale=scale
    )
    return torch.cat((latent, rope), dim=1)


def compare(op: OpSpec, dims: Dims, device, cos, sin, seed: int, fi=None) -> dict:
    """Ours, the unfused sequence and (when given) FlashInfer on the same inputs: the largest
    difference of what each wrote from ours, against one bf16 ulp (2**-7 relative: two single
    roundings of fp32 values that may differ in the last bit) or one e4m3 step (2**-3
    relative, and a scale-sized floor)."""
    gen = torch.Generator().manual_seed(seed)
    a = make_inputs(op, 64, dims, device, gen, prefill=True)
    x = _readback(op, a, ours(op, a, cos, sin, dims)(), dims)
    fp8 = _fp8_cache(op) or op.fp8_out or op.fmt in ("fp8_656", "fp8_584")
    rel = 2.0**-3 if fp8 else 2.0**-7
    floor = float(a.scale) * 2.0**-9 if fp8 else 0.0
    if op.kind == "output":
        # the unfused sequence rounds the rotation to bf16 first, which may move a block's
        # scale by a factor of two: one e4m3 step of the larger scale, subnormals included
        rel, floor = 2.0**-2, float(x.abs().max()) * 2.0**-12

    def against(y: torch.Tensor) -> tuple[float, bool]:
        excess = ((x - y).abs() - rel * x.abs() - floor).max().item()
        return float((x - y).abs().max()), bool(excess <= 0)

    result = {}
    result["max_abs_diff"], result["ok"] = against(
        _readback(op, (b := _clone(a)), unfused(op, b, cos, sin)(), dims)
    )
    if fi is not None:
        c = _clone(a)
        call = flashinfer_calls(fi, op, c, cos, sin)
        if call is not None:
            out = call()
            if op.kind == "query":  # (q_rope_out, k_rope_out, q_nope_out, k_nope_out)
                y = torch.cat((out[2], out[0]), dim=-1)
                y = e4m3_decode(y) * c.scale
            else:
                y = _readback(op, c, None, dims)
            result["flashinfer_max_abs_diff"], result["flashinfer_ok"] = against(y)
    return result


def _clone(a: Inputs) -> Inputs:
    def clone(v):  # with the same strides (fp8_584's padded blocks, MN-major scales)
        if not isinstance(v, torch.Tensor):
            return v
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device).copy_(v)

    b = Inputs(**{k: clone(v) for k, v in vars(a).items()})
    if isinstance(a.cache, tuple):
        b.cache = tuple(c.clone() for c in a.cache)
    if a.kv_c is not None:  # keep kv_c and k_pe slices of one projection, as engines pass them
        proj = torch.cat((a.kv_c, a.k_pe), dim=1)
        b.kv_c, b.k_pe = proj[:, : a.kv_c.shape[1]], proj[:, a.kv_c.shape[1] :]
    return b


# ============================================================================ flashinfer
def import_flashinfer():
    """``(module, version or why not)``."""
    try:
        import flashinfer  # type: ignore[import-not-found]
        import flashinfer.page  # type: ignore[import-not-found]
        import flashinfer.rope  # type: ignore[import-not-found]
    except Exception as exc:
        return None, f"not available: {type(exc).__name__}: {exc}".splitlines()[0]
    return flashinfer, getattr(flashinfer, "__version__", "unknown")


def flashinfer_calls(fi, op: OpSpec, inp: Inputs, cos, sin) -> Callable[[], object] | None:
    """FlashInfer's fused ops on the same inputs, where one matches the op: the split FP8 cache
    (``rope_quantize_fp8_append_paged_kv_cache``, MLA mode) and the FP8 decode query
    (``mla_rope_quantize_fp8``). Its ``cos_sin_cache`` is ``[P, R]`` fp32, cos then sin (each
    ``R / 2``), and its quantization scales are the reciprocals of ours."""
    cos_sin = torch.cat((cos[:, : cos.shape[1] // 2], sin[:, : sin.shape[1] // 2]), 1)
    cos_sin = cos_sin.contiguous()
    inv = 1.0 / float(inp.scale)
    if op.kind == "append" and op.fmt == "split" and _fp8_cache(op):
        t = inp.kv_c.shape[0]
        ckv, kpe = inp.cache
        bs = ckv.shape[1]
        q_rope = torch.empty(t, 1, kpe.shape[2], dtype=inp.kv_c.dtype, device=inp.kv_c.device)
        q_nope = torch.empty(t, 1, ckv.shape[2], dtype=inp.kv_c.dtype, device=inp.kv_c.device)
        # one request whose pages are the cache's in order: slot s = page * bs + entry
        kv_indices = torch.arange(ckv.shape[0], dtype=torch.int32, device=ckv.device)
        kv_indptr = torch.tensor([0, ckv.shape[0]], dtype=torch.int32, device=ckv.device)
        batch = torch.zeros(t, dtype=torch.int32, device=ckv.device)
        slots = inp.slots.to(torch.int32)
        return lambda: fi.rope.rope_quantize_fp8_append_paged_kv_cache(
            q_rope, inp.k_pe, q_nope, inp.kv_c, None, cos_sin, inp.positions, (ckv, kpe),
            kv_indices, kv_indptr, batch, slots, is_neox=False,
            quantize_dtype=torch.float8_e4m3fn, quant_scale_q=inv, quant_scale_kv=inv,
            page_size=bs,
        )  # fmt: skip
    if op.kind == "append" and op.fmt == "split" and not _fp8_cache(op):
        # append_paged_mla_kv_cache: a plain paged append, no rotation; it is handed the rope
        # values ours writes (rotated once, before the timing), so both write the same bytes.
        ckv, kpe = inp.cache
        bs = ckv.shape[1]
        rotated = mlarope.apply_rope_q(
            inp.k_pe.unsqueeze(1), cos, sin, layout="thd", position_ids=inp.positions,
            interleaved=True, interleaved_out=True,
        ).squeeze(1)  # fmt: skip
        valid = inp.slots >= 0  # FlashInfer has no padding slot: those tokens are left out
        slots, kv_c, rotated = inp.slots[valid], inp.kv_c[valid], rotated[valid]
        kv_indices = torch.arange(ckv.shape[0], dtype=torch.int32, device=ckv.device)
        kv_indptr = torch.tensor([0, ckv.shape[0]], dtype=torch.int32, device=ckv.device)
        last_page_len = torch.tensor([bs], dtype=torch.int32, device=ckv.device)
        batch = torch.zeros(slots.shape[0], dtype=torch.int32, device=ckv.device)
        positions = slots.to(torch.int32)  # one request over the pages in order: slot = position
        return lambda: fi.page.append_paged_mla_kv_cache(
            kv_c, rotated, batch, positions, ckv, kpe, kv_indices, kv_indptr, last_page_len
        )
    if op.kind == "query" and op.fp8_out:
        t, _, lat = inp.q_nope.shape
        k_rope = torch.zeros(t, inp.q_pe.shape[2], dtype=inp.q_pe.dtype, device=inp.q_pe.device)
        k_nope = torch.zeros(t, lat, dtype=inp.q_pe.dtype, device=inp.q_pe.device)
        return lambda: fi.rope.mla_rope_quantize_fp8(
            inp.q_pe, k_rope, inp.q_nope, k_nope, cos_sin, inp.positions, is_neox=False,
            quantize_dtype=torch.float8_e4m3fn, quant_scale_q=inv, quant_scale_kv=inv,
        )  # fmt: skip
    return None


# ============================================================================ the run
@dataclass
class Row:
    case: str
    tokens: int
    op: str
    label: str
    bytes: int
    ours_ms: list[float] | None = None
    method: str = ""
    pct_copy: float | None = None
    same_bytes_copy_ms: float | None = None
    unfused_ms: float | None = None
    speedup: float | None = None
    host_us: float | None = None
    torch_op_us: float | None = None
    unfused_host_us: float | None = None
    flashinfer_ms: float | None = None
    flashinfer_note: str = ""
    target: str = ""
    status: str = ""
    check: dict = field(default_factory=dict)
    error: str = ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", metavar="DIR", help="write DIR/serving.json and serving.md")
    parser.add_argument("--cases", default="all", help=f"comma list of {','.join(CASES)}")
    parser.add_argument("--ops", default="all", help=f"comma list of {','.join(OPS_BY_KEY)}")
    parser.add_argument("--sweep", action="store_true", help="also time other launch configs")
    parser.add_argument("--no-flashinfer", action="store_true", help="skip FlashInfer's rows")
    parser.add_argument(
        "--tables", choices=("pair", "full"), default="pair",
        help="the append's and the query's tables: pair [P, R / 2] (default) or full [P, R]",
    )  # fmt: skip
    parser.add_argument("--warmup-ms", type=float, default=25.0)
    parser.add_argument("--rep-ms", type=float, default=100.0)
    parser.add_argument("--copy-mib", type=int, default=1024)
    parser.add_argument("--host-calls", type=int, default=1000)
    parser.add_argument("--max-graph-calls", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cpu-smoke", action="store_true",
        help="tiny shapes on the CPU with host timers: checks the harness, measures nothing real",
    )  # fmt: skip
    parser.add_argument("--cpu-reps", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the bytes")


def _select(spec: str, choices, what: str) -> list[str]:
    if spec == "all":
        return list(choices)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in choices]
    if unknown:
        raise ValueError(f"unknown {what} {unknown}; choose from {list(choices)}")
    return names


def run(args: argparse.Namespace) -> int:
    dims = Dims(heads=8, positions=4096, heads_per_group=4) if args.cpu_smoke else Dims()
    dims = dataclasses.replace(dims, pair_tables=args.tables == "pair")
    cases = SMOKE_CASES if args.cpu_smoke else CASES
    try:
        case_keys = _select(args.cases, cases, "cases")
        op_keys = _select(args.ops, OPS_BY_KEY, "ops")
    except ValueError as exc:
        print(f"mlarope.tools.bench.serving: {exc}")
        return 2
    if args.dry_run:
        for key in case_keys:
            for op in op_keys:
                mb = bytes_moved(OPS_BY_KEY[op], cases[key], dims) / 1e6
                print(f"{key:10s} {op:22s} {mb:10.3f} MB")
        return 0
    if args.cpu_smoke:
        device = torch.device("cpu")
        timer: CudaTimer | CpuTimer = CpuTimer(args, device)
        copy_mib = 4
    else:
        if not torch.cuda.is_available():
            print(
                "mlarope.tools.bench.serving: no CUDA device (use --cpu-smoke to check the harness)"
            )
            return 2
        device = torch.device(args.device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        timer = CudaTimer(args, device)
        copy_mib = args.copy_mib
    started = time.perf_counter()
    fi, fi_version = (None, "skipped (--no-flashinfer)")
    if not args.no_flashinfer and not args.cpu_smoke:
        fi, fi_version = import_flashinfer()
    copy_timing, copy_bytes = timer.copy(copy_mib, torch.bfloat16)
    copy_tbps = copy_bytes / (copy_timing.median * 1e-3) / 1e12
    meta = _meta(args, device, dims, fi_version, copy_bytes, copy_timing, copy_tbps)
    print(f"copy ceiling: {copy_tbps:.3f} TB/s; flashinfer: {fi_version}")
    from mlarope.yarn import YarnConfig

    cos, sin = YarnConfig.deepseek_v3().cos_sin(dims.positions, device=device)
    gen = torch.Generator().manual_seed(args.seed)
    rows: list[Row] = []
    for case in case_keys:
        tokens = cases[case]
        prefill = case == "prefill"
        for key in op_keys:
            op = OPS_BY_KEY[key]
            row = Row(case, tokens, key, op.label, bytes_moved(op, tokens, dims))
            try:
                _measure(row, op, tokens, prefill, dims, device, gen, cos, sin, timer, fi)
                row.pct_copy = _pct(row, copy_tbps)
                if not args.cpu_smoke:
                    _judge(row, prefill)
                if case == case_keys[0]:
                    row.check = compare(op, dims, device, cos, sin, args.seed, fi)
            except Exception as exc:  # one row's failure is reported, the run goes on
                row.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                traceback.print_exc()
            rows.append(row)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(f"  done {case} ({time.perf_counter() - started:.0f} s)")
    sweep: list[dict] = []
    if args.sweep and "prefill" in case_keys:
        sweep = run_sweep(
            op_keys, cases["prefill"], dims, device, gen, cos, sin, timer, copy_tbps,
            limit=2 if args.cpu_smoke else None,
        )  # fmt: skip
    decode_keys = [k for k in case_keys if k != "prefill"]
    query_keys = [k for k in op_keys if OPS_BY_KEY[k].kind == "query"]
    if args.sweep and decode_keys and query_keys:
        for case in decode_keys:
            sweep += run_decode_sweep(
                query_keys, case, cases[case], dims, device, gen, cos, sin, timer,
                limit=2 if args.cpu_smoke else None,
            )  # fmt: skip
    meta["elapsed_s"] = round(time.perf_counter() - started, 1)
    table = markdown_table(rows, meta)
    print(table)
    if sweep:
        print(_sweep_table(sweep))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        payload = {"meta": meta, "rows": [asdict(r) for r in rows], "sweep": sweep}
        (out / "serving.json").write_text(json.dumps(payload, indent=1))
        (out / "serving.md").write_text(table + ("\n" + _sweep_table(sweep) if sweep else ""))
    return 0


def _measure(row, op, tokens, prefill, dims, device, gen, cos, sin, timer, fi) -> None:
    use_graph = not prefill and isinstance(timer, CudaTimer)
    sets = rotation_sets(row.bytes, timer.l2_bytes, timer.max_graph_calls) if use_graph else 1
    inputs = [make_inputs(op, tokens, dims, device, gen, prefill) for _ in range(sets)]
    mine = [ours(op, inp, cos, sin, dims) for inp in inputs]
    theirs = [unfused(op, inp, cos, sin) for inp in inputs]
    t = timer.graph(mine) if use_graph else timer.large(mine[0])
    row.ours_ms, row.method = [t.q20, t.median, t.q80], t.method
    u = timer.graph(theirs) if use_graph else timer.large(theirs[0])
    row.unfused_ms = u.median
    row.speedup = u.median / t.median if t.median > 0 else None
    if prefill:
        row.same_bytes_copy_ms = _same_bytes_copy(timer, row.bytes, device)
    else:
        row.host_us = timer.host_us(mine[0])
        row.torch_op_us = timer.torch_op_us()
        row.unfused_host_us = timer.host_us(theirs[0])
    if fi is not None:
        try:
            calls = [flashinfer_calls(fi, op, inp, cos, sin) for inp in inputs]
            if calls[0] is None:
                row.flashinfer_note = "no matching op"
            else:
                f = timer.graph(calls) if use_graph else timer.large(calls[0])
                row.flashinfer_ms = f.median
        except Exception as exc:
            row.flashinfer_note = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]


def _same_bytes_copy(timer, nbytes: int, device) -> float:
    """A device-to-device copy that moves ``nbytes`` (half read, half written)."""
    src = torch.empty(max(1, nbytes // 2), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return timer.large(lambda: dst.copy_(src)).median


def _pct(row: Row, copy_tbps: float) -> float | None:
    if not row.ours_ms or row.ours_ms[1] <= 0:
        return None
    return 100.0 * row.bytes / (row.ours_ms[1] * 1e-3) / 1e12 / copy_tbps


def _judge(row: Row, prefill: bool) -> None:
    if prefill:
        row.target = f">= {PREFILL_TARGET:.0%} copy"
        row.status = target_status((row.pct_copy or 0) / 100, PREFILL_TARGET)
    else:
        row.target = f"host <= {HOST_TARGET_US:g} us"
        row.status = target_status(row.host_us, HOST_TARGET_US, higher_is_better=False)


def run_sweep(
    op_keys, tokens, dims, device, gen, cos, sin, timer, copy_tbps, limit: int | None = None
) -> list[dict]:
    """The prefill batch under other launch configurations (the first ``limit`` of them), and
    FP8 with the integer encoder (``kernels.serving.NATIVE_CASTS = False``): kernel time and %
    of copy. Each launch is captured in a CUDA graph and its replays timed by ``do_bench``, the
    L2 flushed before each: a launch through Triton's own binder, as here, can take longer on
    the host than the flush on the GPU, and was then timed with its host time (run H3's split
    FP8 append: 24-36 us in the sweep, 17.8 in the main table). The appends also run with
    every position 0 (one table row, which stays in the L2: what the table rows cost) and with
    the other tables (full or pair)."""
    from mlarope.kernels import output_quant
    from mlarope.kernels import serving as kernels
    from mlarope.serving import checks, ops

    results = []
    for key in op_keys:
        op = OPS_BY_KEY[key]
        inp = make_inputs(op, tokens, dims, device, gen, prefill=True)
        nbytes = bytes_moved(op, tokens, dims)
        extra = []  # (label, launch, bytes): the heuristic's launch on other inputs
        if op.kind == "output":
            # The whole-row variant first (perf_log v14: every load before the first store;
            # 16 to 64 elements a thread of the row), then 1 to 16 heads a program, 4 to 32
            # elements a thread of one 128-channel block
            configs = [
                output_quant.OutputConfig(1, bh, w, whole_row=True)
                for bh in (16, 8, 4)
                for w in (8, 4)
                if 16 <= bh * dims.head_dim // (32 * w) <= 64
            ] + [
                output_quant.OutputConfig(bt, bh, w)
                for bt in (2, 1)
                for bh in (16, 8, 4, 2, 1)
                for w in (8, 4, 2, 1)
                if 4 <= bt * bh * 128 // (32 * w) <= 32
            ]
            out = torch.empty(tokens, inp.groups, dims.heads // inp.groups * dims.head_dim,
                              dtype=torch.uint8, device=device)  # fmt: skip
            scale_out = torch.empty(*out.shape[:2], out.shape[2] // 128, device=device)

            def launch(config, inp=inp, out=out, scale_out=scale_out, op=op):
                ops.output_with_kernel(
                    inp.o, *rope_tables(op, dims, cos, sin), inp.positions, out, scale_out,
                    inp.groups, True, True, _takes_pair_tables(op, dims), config=config,
                )  # fmt: skip
        elif op.kind == "append":
            scale = inp.scale if _fp8_cache(op) else None

            def checked(tables, positions, pair, inp=inp, scale=scale, op=op):
                return checks.check_append_call(
                    inp.kv_c, inp.k_pe, *tables, positions, inp.cache, inp.slots, op.fmt,
                    scale, True, True, pair,
                )  # fmt: skip

            flipped = dataclasses.replace(dims, pair_tables=not dims.pair_tables)
            tables, other = rope_tables(op, dims, cos, sin), rope_tables(op, flipped, cos, sin)
            call = checked(tables, inp.positions, dims.pair_tables)
            # 8 to 32 latent elements a thread, 1 to 16 tokens a program
            configs = [
                kernels.AppendConfig(bt, w)
                for bt in (1, 2, 4, 8, 16)
                for w in (1, 2, 4, 8)
                if bt * dims.latent // (32 * w) in (8, 16, 32)
            ]

            def launch(config, call=call):
                ops.append_with_kernel(*call.op_args(), config=config)

            # their own bytes: one table row; the other tables' rows
            one_row = nbytes - table_bytes(op, tokens, dims) + table_bytes(op, 1, dims)
            for label, c, n in (
                (
                    "heuristic, every position 0",
                    checked(tables, torch.zeros_like(inp.positions), dims.pair_tables), one_row,
                ),
                (
                    f"heuristic, {'full' if dims.pair_tables else 'pair'} tables",
                    checked(other, inp.positions, not dims.pair_tables),
                    bytes_moved(op, tokens, flipped),
                ),
            ):  # fmt: skip
                extra.append((label, lambda c=c: ops.append_with_kernel(*c.op_args()), n))
        else:
            dtype = torch.float8_e4m3fn if op.fp8_out else dims.dtype
            out = torch.empty(tokens, dims.heads, dims.latent + dims.rope, dtype=dtype,
                              device=device)  # fmt: skip
            # 16 or 32 elements a thread per copy step
            configs = [
                kernels.QueryConfig(1, bh, bc, w)
                for bh in (1, 2, 4, 8, 16, 32)
                for bc in (128, 256, 512)
                for w in (1, 2, 4, 8)
                if bh * bc // (32 * w) in (16, 32)
            ]

            def launch(config, inp=inp, out=out, op=op):
                _query_launch(op, inp, out, *rope_tables(op, dims, cos, sin), config)

        variants = [(str(c), c, True) for c in configs[:limit]]
        if op.fp8_out or _fp8_cache(op) or op.fmt in ("fp8_656", "fp8_584"):
            variants.append(("heuristic, integer e4m3 encoder", None, False))
        variants.insert(0, ("heuristic", None, True))
        runs = [
            (label, native, lambda c=config: launch(c), nbytes)
            for label, config, native in variants
        ]
        runs += [(label, True, fn, n) for label, fn, n in extra]
        for label, native, fn, n in runs:
            kernels.NATIVE_CASTS = native
            try:
                t: Timing = timer.large_graphed(fn)
                pct = 100.0 * n / (t.median * 1e-3) / 1e12 / copy_tbps
                results.append({"op": key, "variant": label, "ms": t.median, "pct_copy": pct})
            except Exception as exc:
                results.append({"op": key, "variant": label, "error": str(exc)[:200]})
            finally:
                kernels.NATIVE_CASTS = True
        del inp
    return results


def _query_launch(op, inp, out, cos, sin, config, float_scale: float | None = None) -> None:
    """The decode query kernel on ``inp`` into ``out`` under ``config`` (the sweeps' launch);
    ``float_scale``: FP8's scale as a Python float (FlashInfer's form; read from the tensor
    before any capture, which a read would break), not the tensor."""
    from mlarope.serving import ops

    scale = inp.scale if op.fp8_out and float_scale is None else None
    value = 1.0 if float_scale is None else float_scale
    ops.query_with_kernel(
        inp.q_nope, inp.q_pe, cos, sin, inp.positions, out, scale, value, True, True,
        config=config,
    )  # fmt: skip


def run_decode_sweep(
    op_keys, case: str, tokens: int, dims, device, gen, cos, sin, timer, limit: int | None = None
) -> list[dict]:
    """The decode query at a decode batch under other launch configurations (the first
    ``limit`` of them): one token a program, 1 to 16 heads, 128 to 512 latent channels a step,
    1 to 4 warps; timed by CUDA-graph replays over rotated input sets, as the main table times
    decode, but with an output buffer per input set where the main table's call allocates its
    own, so compare the rows with each other, not with the main table. Ops that write into a
    caller's buffer are left out (they would time the same launches). Rows: ``op``, ``variant``
    (``case: config``), ``ms``; ``pct_copy`` None."""
    from mlarope.kernels import serving as kernels

    configs = [
        kernels.QueryConfig(1, bh, bc, w)
        for bc in (512, 256, 128)
        for bh in (1, 2, 4, 8, 16)
        for w in (1, 2, 4)
        if 8 <= bh * bc // (32 * w) <= 32
    ]
    results = []
    for key in op_keys:
        op = OPS_BY_KEY[key]
        if op.out_given:
            continue
        use_graph = isinstance(timer, CudaTimer)
        nbytes = bytes_moved(op, tokens, dims)
        sets = rotation_sets(nbytes, timer.l2_bytes, timer.max_graph_calls) if use_graph else 1
        inputs = [make_inputs(op, tokens, dims, device, gen, False) for _ in range(sets)]
        dtype = torch.float8_e4m3fn if op.fp8_out else dims.dtype
        outs = [torch.empty(tokens, dims.heads, dims.latent + dims.rope, dtype=dtype,
                            device=device) for _ in inputs]  # fmt: skip

        tables = rope_tables(op, dims, cos, sin)
        values = [float(inp.scale) for inp in inputs]

        def calls(
            config, inputs=inputs, outs=outs, op=op, tables=tables, values=values,
            float_scale=False,
        ):  # fmt: skip
            return [
                lambda inp=inp, out=out, v=v: _query_launch(
                    op, inp, out, *tables, config, v if float_scale else None
                )
                for inp, out, v in zip(inputs, outs, values, strict=True)
            ]

        variants = [("heuristic", None), *((str(c), c) for c in configs[:limit])]
        if op.fp8_out:
            # FlashInfer's forms: the scale a float, which arrives with the launch; and, on top,
            # x * (1 / s) for x / s (RECIPROCAL_QUOTIENT: inexact near ties, measurement only)
            variants[1:1] = [("heuristic, float scale", "float"),
                             ("heuristic, float scale, x * (1 / s)", "reciprocal")]  # fmt: skip
        for label, config in variants:
            kernels.RECIPROCAL_QUOTIENT = config == "reciprocal"
            try:
                fns = (
                    calls(None, float_scale=True) if config in ("float", "reciprocal")
                    else calls(config)
                )  # fmt: skip
                t: Timing = timer.graph(fns) if use_graph else timer.large(fns[0])
                results.append({"op": key, "variant": f"{case}: {label}", "ms": t.median,
                                "pct_copy": None})  # fmt: skip
            except Exception as exc:
                results.append({"op": key, "variant": f"{case}: {label}", "error": str(exc)[:200]})
            finally:
                kernels.RECIPROCAL_QUOTIENT = False
        del inputs, outs
    return results


def _fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def markdown_table(rows: list[Row], meta: dict) -> str:
    head = (
        f"serving bench, {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, "
        f"copy {meta['copy']['tbps']:.3f} TB/s, flashinfer: {meta['flashinfer']}, "
        f"{'pair tables [P, R / 2]' if meta['dims']['pair_tables'] == 'True' else 'full tables'}"
        " (append, query)\n\n"
        "| case | op | MB | ours us (% copy) | same-bytes copy us | unfused us | speed-up | "
        "host us (torch op) | unfused host us | flashinfer us | check | target | status |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        if r.error:
            lines.append(f"| {r.case} | {r.label} | {r.bytes / 1e6:.2f} | ERROR {r.error} |"
                         + " |" * 9)  # fmt: skip
            continue
        ours_us = _fmt(r.ours_ms[1] * 1e3 if r.ours_ms else None, ".1f")
        pct = _fmt(r.pct_copy, ".0f")
        host = "" if r.host_us is None else f"{r.host_us:.1f} ({r.torch_op_us:.1f})"
        fi = _fmt(None if r.flashinfer_ms is None else r.flashinfer_ms * 1e3, ".1f",
                  r.flashinfer_note or "-")  # fmt: skip
        check = "" if not r.check else ("ok" if r.check["ok"] else "DIFF")
        if "flashinfer_ok" in r.check:
            check += ", flashinfer " + ("ok" if r.check["flashinfer_ok"] else "DIFF")
        lines.append(
            f"| {r.case} | {r.label} | {r.bytes / 1e6:.2f} | {ours_us} ({pct}%) | "
            f"{_fmt(None if r.same_bytes_copy_ms is None else r.same_bytes_copy_ms * 1e3, '.1f')}"
            f" | {_fmt(None if r.unfused_ms is None else r.unfused_ms * 1e3, '.1f')} | "
            f"{_fmt(r.speedup, '.2f')}x | {host} | {_fmt(r.unfused_host_us, '.1f')} | {fi} | "
            f"{check} | {r.target} | {r.status} |"
        )
    return head + "\n".join(lines) + "\n"


def _sweep_table(sweep: list[dict]) -> str:
    lines = ["| op | variant | us | % copy |", "|---|---|---|---|"]
    for s in sweep:
        if "error" in s:
            lines.append(f"| {s['op']} | {s['variant']} | ERROR {s['error']} | |")
        else:
            pct = "-" if s["pct_copy"] is None else f"{s['pct_copy']:.0f}%"
            lines.append(f"| {s['op']} | {s['variant']} | {s['ms'] * 1e3:.2f} | {pct} |")
    return "\n".join(lines) + "\n"


def _meta(args, device, dims, fi_version, copy_bytes, copy_timing, copy_tbps) -> dict:
    import mlarope

    with contextlib.suppress(ImportError):
        import triton  # noqa: F401 (its version below)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "mode": "cpu-smoke" if args.cpu_smoke else "gpu",
        "mlarope": mlarope.__version__,
        "torch": torch.__version__,
        "triton": getattr(sys.modules.get("triton"), "__version__", "not installed"),
        "python": platform.python_version(),
        "command": " ".join(["python -m mlarope.tools.bench.serving", *sys.argv[1:]]),
        "dims": {k: str(v) for k, v in asdict(dims).items()},
        "flashinfer": fi_version,
        "copy": {"bytes": copy_bytes, "ms": copy_timing.median, "tbps": copy_tbps},
        "targets": {"prefill_pct_copy": PREFILL_TARGET, "decode_host_us": HOST_TARGET_US},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mlarope.tools.bench.serving", description=__doc__
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
