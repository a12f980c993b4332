"""The calls the serving benchmark times and compares: ours through the public API, the unfused
torch sequence it replaces, and what each wrote, read back."""

from __future__ import annotations

from collections.abc import Callable

import torch

import mlarope
from mlarope.serving.reference import e4m3_decode, read_kv_cache

from .flashinfer import flashinfer_calls
from .inputs import Inputs, clone_inputs, make_inputs, rope_tables
from .model import Dims, OpSpec, fp8_cache, takes_pair_tables


def ours(op: OpSpec, inp: Inputs, cos, sin, dims: Dims) -> Callable[[], object]:
    """The call through the public API (its eager plan after the first call)."""
    from mlarope.serving import rope_append_kv_cache, rope_decode_query, rope_inverse_quant_output

    cos, sin = rope_tables(op, dims, cos, sin)
    pair = takes_pair_tables(op, dims)

    if op.kind == "output":
        return lambda: rope_inverse_quant_output(
            inp.o, cos, sin, inp.positions, groups=inp.groups, out=inp.out,
            scale_out=inp.scale_out, pair_tables=pair,
        )  # fmt: skip
    if op.kind == "append":
        scale = inp.scale if fp8_cache(op) else None
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
            # sequence capturable in a CUDA graph (a boolean mask syncs, which a capture refuses).
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
        fp8 = fp8_cache(op)
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
    scale = inp.scale if fp8_cache(op) else None
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
    fp8 = fp8_cache(op) or op.fp8_out or op.fmt in ("fp8_656", "fp8_584")
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
        _readback(op, (b := clone_inputs(a)), unfused(op, b, cos, sin)(), dims)
    )
    if fi is not None:
        c = clone_inputs(a)
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
