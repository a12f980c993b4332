"""The checks of :func:`mlarope.serving.read_kv_cache`: the cache against its format, as the
writers check it, ``rope_dim``, the scale and the slots (whose values it reads)."""

from __future__ import annotations

import torch

# Core import point (the library's checks).
from ..._checks import ROPE_DIMS, check_tensor
from ..formats import (
    CACHE_FORMATS,
    FP8_584_ROPE,
    FP8_656_BYTES,
    FP8_656_ROPE,
    FP8_DTYPES,
    INDEX_DTYPES,
    INPUT_DTYPES,
    RECORD_DTYPES,
)
from .append import fp8_584_layout
from .common import check_scale


# ------------------------------------------------------------------------------- the reader
def check_read_call(
    cache: object, slots: object, cache_format: object, rope_dim: object, kv_scale: object
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, int, torch.Tensor | None]:
    """All checks of a ``read_kv_cache`` call -> ``(tensors, slots, rope_dim, scale)``: the
    cache's tensors (``(cache,)``, or ``(ckv, kpe)`` for ``split``), the slots as int64, ``R``
    and the FP8 dequant scale as a 0-d fp32 tensor (None for a 16/32-bit cache or
    ``fp8_656``). Reads the slots' values (a sync: the reader returns device data anyway): each
    must name an entry of the cache; -1, the writers' padding marker, names none and is
    refused."""
    if not isinstance(cache_format, str):
        raise TypeError(f"cache_format must be a str, got {cache_format!r}")
    if cache_format not in CACHE_FORMATS:
        raise ValueError(f"cache_format must be one of {CACHE_FORMATS}, got {cache_format!r}")
    if rope_dim is not None and (isinstance(rope_dim, bool) or not isinstance(rope_dim, int)):
        raise TypeError(f"rope_dim must be an int or None, got {rope_dim!r}")
    if cache_format == "split":
        if not isinstance(cache, (tuple, list)) or len(cache) != 2:
            raise TypeError(
                f"a split cache must be a pair (ckv [num_pages, page_size, L], kpe [num_pages, "
                f"page_size, R]), got {_what(cache)}"
            )
        ckv = check_tensor("ckv (cache[0])", cache[0])
        kpe = check_tensor("kpe (cache[1])", cache[1])
        for name, t in (("ckv (cache[0])", ckv), ("kpe (cache[1])", kpe)):
            if t.dim() != 3:
                raise ValueError(
                    f"{name} must be 3-D [num_pages, page_size, width], got shape {tuple(t.shape)}"
                )
        if kpe.shape[:2] != ckv.shape[:2] or kpe.device != ckv.device:
            raise ValueError(
                f"kpe (cache[1]) must have ckv's pages {list(ckv.shape[:2])} on its device "
                f"{ckv.device}, got shape {tuple(kpe.shape)} on {kpe.device}"
            )
        if kpe.shape[2] not in ROPE_DIMS:
            raise ValueError(
                f"kpe (cache[1]) must be [num_pages, page_size, R] with R one of {ROPE_DIMS}, "
                f"got shape {tuple(kpe.shape)}"
            )
        if kpe.dtype != ckv.dtype:
            raise TypeError(
                f"ckv and kpe (cache) must share a dtype, got {ckv.dtype} and {kpe.dtype}"
            )
        _check_read_dtype("ckv (cache[0])", ckv)
        if rope_dim is not None and rope_dim != kpe.shape[2]:
            raise ValueError(
                f"rope_dim = {rope_dim} does not match the split cache's kpe width "
                f"{kpe.shape[2]} (rope_dim may be left out for 'split')"
            )
        tensors, rope, fp8 = (ckv, kpe), kpe.shape[2], ckv.dtype in FP8_DTYPES
    elif cache_format == "concat":
        cache = _one_cache_tensor(cache, "[num_blocks, block_size, L + R]", "'split'")
        if cache.dim() != 3:
            raise ValueError(
                f"a concat cache must be 3-D [num_blocks, block_size, L + R], got shape "
                f"{tuple(cache.shape)}"
            )
        _check_read_dtype("cache", cache)
        if rope_dim is None:
            raise ValueError("rope_dim (R) is required for cache_format='concat'")
        if rope_dim not in ROPE_DIMS or rope_dim > cache.shape[2]:
            raise ValueError(
                f"rope_dim must be one of {ROPE_DIMS} and at most the concat cache's entry "
                f"width L + R = {cache.shape[2]}, got {rope_dim}"
            )
        tensors, rope, fp8 = (cache,), rope_dim, cache.dtype in FP8_DTYPES
    elif cache_format == "fp8_584":
        cache = _one_cache_tensor(cache, "[num_blocks, block_size, 584]", "'split'")
        fp8_584_layout("cache", cache)
        if rope_dim is not None and rope_dim != FP8_584_ROPE:
            raise ValueError(
                f"an fp8_584 cache holds R = {FP8_584_ROPE} rope values, got rope_dim = {rope_dim}"
            )
        tensors, rope, fp8 = (cache,), FP8_584_ROPE, False
    else:
        cache = _one_cache_tensor(cache, "[num_blocks, block_size, 656]", "'split'")
        if cache.dtype not in RECORD_DTYPES:
            raise TypeError(
                f"an fp8_656 cache holds bytes (uint8, int8 or float8_e4m3fn), got dtype "
                f"{cache.dtype}"
            )
        four_d = cache.dim() == 4 and cache.shape[2] == 1
        if not (cache.dim() == 3 or four_d) or cache.shape[-1] != FP8_656_BYTES:
            raise ValueError(
                f"an fp8_656 cache must be [num_blocks, block_size, 656] or [num_blocks, "
                f"block_size, 1, 656], got shape {tuple(cache.shape)}"
            )
        if rope_dim is not None and rope_dim != FP8_656_ROPE:
            raise ValueError(
                f"an fp8_656 record holds R = {FP8_656_ROPE} rope values, got rope_dim = {rope_dim}"
            )
        tensors, rope, fp8 = (cache,), FP8_656_ROPE, False
    first = tensors[0]
    if fp8:
        why_not = f"for an FP8 {cache_format} cache"
    elif cache_format in ("fp8_656", "fp8_584"):
        why_not = f"for cache_format='{cache_format}' (its tile scales are in the cache)"
    else:
        why_not = f"for a {first.dtype} cache (only FP8 caches are scaled)"
    scale, value = check_scale("kv_scale", kv_scale, fp8, why_not, first.device)
    if fp8 and scale is None:
        scale = torch.tensor(value, dtype=torch.float32, device=first.device)
    slots = _check_slots(slots, first.shape[0], first.shape[1], first.device)
    return tensors, slots, rope, None if scale is None else scale.reshape(())


def _what(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return type(value).__name__


def _one_cache_tensor(cache: object, shape: str, pair_format: str) -> torch.Tensor:
    if isinstance(cache, (tuple, list)):
        raise TypeError(
            f"this cache format is one tensor {shape}, got {_what(cache)} (a split cache's "
            f"pair? pass cache_format={pair_format})"
        )
    return check_tensor("cache", cache)


def _check_read_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in INPUT_DTYPES + FP8_DTYPES:
        raise TypeError(
            f"{name} must be bfloat16, float16, float32 or FP8 e4m3 (torch.float8_e4m3fn, or "
            f"torch.uint8 codes), got dtype {t.dtype}"
        )


def _check_slots(slots: object, n_blocks: int, block_size: int, device) -> torch.Tensor:
    slots = check_tensor("slots", slots)
    if slots.dtype not in INDEX_DTYPES:
        raise TypeError(f"slots must be int32 or int64, got dtype {slots.dtype}")
    if slots.dim() != 1:
        raise ValueError(f"slots must be 1-D [n], got shape {tuple(slots.shape)}")
    if slots.device != device:
        raise ValueError(f"slots must be on the cache's device {device}, got {slots.device}")
    capacity = n_blocks * block_size
    values = slots.detach().to(torch.int64)
    bad = ((values < 0) | (values >= capacity)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        value = int(values[i])
        if value == -1:
            raise ValueError(
                f"slots[{i}] = -1, the padding marker: a padding token has no entry, so there "
                f"is nothing to read; pass the written tokens' slots only (slots[slots >= 0])"
            )
        raise ValueError(
            f"slots[{i}] = {value} is outside the cache: slots are in [0, {capacity}) "
            f"({n_blocks} blocks x {block_size})"
        )
    return values
