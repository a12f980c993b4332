"""FlashInfer's side of the serving benchmark: its fused ops on the same inputs, where one
matches (it is not a dependency: imported when present)."""

from __future__ import annotations

from collections.abc import Callable

import torch

import mlarope

from .inputs import Inputs
from .model import OpSpec, fp8_cache


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
    if op.kind == "append" and op.fmt == "split" and fp8_cache(op):
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
    if op.kind == "append" and op.fmt == "split" and not fp8_cache(op):
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
