"""The host-side checks of :func:`mlarope.serving.rope_append_kv_cache` and its checked call."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Core import point (the library's checks).
from ..._checks import (
    check_bool,
    check_last_dim_contiguous,
    check_tables,
    check_tables_constant,
    check_tensor,
)
from ..formats import (
    CACHE_FORMATS,
    FP8_584_BLOCK_ALIGN,
    FP8_584_BYTES,
    FP8_584_LATENT,
    FP8_584_ROPE,
    FP8_656_BYTES,
    FP8_656_LATENT,
    FP8_656_ROPE,
    RECORD_DTYPES,
)
from .common import (
    check_apart,
    check_cache_dtype,
    check_cache_tensor,
    check_index,
    check_input,
    check_like,
    check_not_differentiated,
    check_rope_dim,
    check_scale,
    check_written,
    validate_on_device,
)


@dataclass(frozen=True)
class AppendCall:
    """A checked ``rope_append_kv_cache`` call, as the custom op and the backends take it
    (``op_args()``, in this order)."""

    kv_c: torch.Tensor  # [T, L]
    k_pe: torch.Tensor  # [T, R]
    cos: torch.Tensor  # [P, R], or pair tables [P, R / 2]
    sin: torch.Tensor  # [P, R], or pair tables [P, R / 2]
    positions: torch.Tensor  # [T]
    cache: torch.Tensor  # concat / fp8_656: the cache as given; split: ckv
    kpe_cache: torch.Tensor | None  # split: kpe
    slot_mapping: torch.Tensor  # [T]
    scale: torch.Tensor | None  # a 1-element fp32 dequant scale, read by the kernel
    scale_value: float  # the dequant scale given as a number (1.0 when unused)
    cache_format: str
    interleaved: bool
    interleaved_out: bool

    def op_args(self) -> tuple:
        return tuple(getattr(self, f) for f in _APPEND_FIELDS)


_APPEND_FIELDS = tuple(AppendCall.__dataclass_fields__)


# ----------------------------------------------------------------------------- the append op
def check_append_call(
    kv_c: object,
    k_pe: object,
    cos: object,
    sin: object,
    positions: object,
    cache: object,
    slot_mapping: object,
    cache_format: object,
    kv_scale: object,
    interleaved: object,
    interleaved_out: object,
    pair_tables: object = False,
) -> AppendCall:
    """All host-side checks of a ``rope_append_kv_cache`` call."""
    if not isinstance(cache_format, str):
        raise TypeError(f"cache_format must be a str, got {cache_format!r}")
    if cache_format not in CACHE_FORMATS:
        raise ValueError(f"cache_format must be one of {CACHE_FORMATS}, got {cache_format!r}")
    kv_c = check_input("kv_c", kv_c, 2, "[T, L]")
    k_pe = check_tensor("k_pe", k_pe)
    check_like("k_pe", k_pe, "kv_c", kv_c)
    n_tokens, latent = kv_c.shape
    if k_pe.dim() == 3 and k_pe.shape[1] == 1:
        k_pe = k_pe.squeeze(1)
    if k_pe.dim() != 2 or k_pe.shape[0] != n_tokens:
        raise ValueError(
            f"k_pe must be [T, R] or [T, 1, R] with kv_c's T = {n_tokens}, got shape "
            f"{tuple(k_pe.shape)}"
        )
    check_last_dim_contiguous("k_pe", k_pe)
    rope_dim = check_rope_dim("k_pe", k_pe.shape[1])
    check_bool("pair_tables", pair_tables)
    cos2d, sin2d = check_tables(cos, sin, kv_c.device, ("k_pe", rope_dim, pair_tables))
    check_tables_constant(cos, sin)
    positions = check_index("positions", positions, n_tokens, kv_c.device)
    slot_mapping = check_index("slot_mapping", slot_mapping, n_tokens, kv_c.device)
    check_bool("interleaved", interleaved)
    check_bool("interleaved_out", interleaved_out)
    check_not_differentiated(("kv_c", kv_c), ("k_pe", k_pe))

    kpe_cache = None
    if cache_format == "fp8_656":
        cache = _check_fp8_656(cache, latent, rope_dim, kv_c.device)
        fp8, why_not = False, "for cache_format='fp8_656' (its per-tile scales are computed)"
    elif cache_format == "fp8_584":
        cache = _check_fp8_584(cache, latent, rope_dim, kv_c.device)
        fp8, why_not = False, "for cache_format='fp8_584' (its per-tile scales are computed)"
    elif cache_format == "concat":
        cache = check_cache_tensor("cache", cache, kv_c.device)
        if cache.dim() != 3 or cache.shape[2] != latent + rope_dim:
            raise ValueError(
                f"a concat cache must be [num_blocks, block_size, L + R] = [.., .., "
                f"{latent + rope_dim}] (L = {latent}, R = {rope_dim}), got shape "
                f"{tuple(cache.shape)}"
                + ("; for FlashMLA's [num_blocks, block_size, 1, L + R] view pass "
                   "cache.squeeze(2)" if cache.dim() == 4 and cache.shape[2] == 1 else "")
            )  # fmt: skip
        fp8 = check_cache_dtype("cache", cache, kv_c)
        why_not = f"for a {cache.dtype} cache (only FP8 caches are scaled)"
    else:
        if not isinstance(cache, (tuple, list)) or len(cache) != 2:
            raise TypeError(
                f"a split cache must be a pair (ckv [num_pages, page_size, L], kpe [num_pages, "
                f"page_size, R]), got {type(cache).__name__}"
            )
        ckv = check_cache_tensor("ckv (cache[0])", cache[0], kv_c.device)
        kpe = check_cache_tensor("kpe (cache[1])", cache[1], kv_c.device)
        if ckv.dim() != 3 or ckv.shape[2] != latent:
            raise ValueError(
                f"ckv (cache[0]) must be [num_pages, page_size, L] with L = {latent}, got shape "
                f"{tuple(ckv.shape)}"
            )
        if kpe.dim() != 3 or tuple(kpe.shape) != (*ckv.shape[:2], rope_dim):
            raise ValueError(
                f"kpe (cache[1]) must be [num_pages, page_size, R] = "
                f"{[*ckv.shape[:2], rope_dim]} (ckv's pages, R = {rope_dim}), got shape "
                f"{tuple(kpe.shape)}"
            )
        if kpe.dtype != ckv.dtype:
            raise TypeError(
                f"ckv and kpe (cache) must share a dtype, got {ckv.dtype} and {kpe.dtype}"
            )
        fp8 = check_cache_dtype("ckv (cache[0])", ckv, kv_c)
        cache, kpe_cache = ckv, kpe
        why_not = f"for a {ckv.dtype} cache (only FP8 caches are scaled)"
    if cache.shape[1] == 0:
        name = "ckv (cache[0])" if kpe_cache is not None else "cache"
        raise ValueError(
            f"the cache's block_size = {name.split(' ')[0]}.shape[1] must be at least 1 (slot s "
            f"is entry s % block_size of block s // block_size), got shape {tuple(cache.shape)}"
        )
    if fp8:
        why_not = f"for an FP8 {cache_format} cache"
    scale, scale_value = check_scale("kv_scale", kv_scale, fp8, why_not, kv_c.device)
    inputs = (
        ("kv_c", kv_c), ("k_pe", k_pe), ("cos", cos2d), ("sin", sin2d), ("positions", positions),
        ("slot_mapping", slot_mapping), ("kv_scale", scale),
    )  # fmt: skip
    written = (
        (("cache", cache),) if kpe_cache is None
        else (("ckv (cache[0])", cache), ("kpe (cache[1])", kpe_cache))
    )  # fmt: skip
    check_apart(written, inputs)
    return AppendCall(
        kv_c, k_pe, cos2d, sin2d, positions, cache, kpe_cache, slot_mapping, scale, scale_value,
        cache_format, interleaved, interleaved_out,
    )  # fmt: skip


def _check_fp8_656(cache: object, latent: int, rope_dim: int, device) -> torch.Tensor:
    if latent != FP8_656_LATENT or rope_dim != FP8_656_ROPE:
        raise ValueError(
            f"cache_format='fp8_656' holds L = {FP8_656_LATENT} latent and R = {FP8_656_ROPE} "
            f"rope values a token, got L = kv_c.shape[1] = {latent}, R = k_pe.shape[-1] = "
            f"{rope_dim}"
        )
    cache = check_cache_tensor("cache", cache, device)
    if cache.dtype not in RECORD_DTYPES:
        raise TypeError(
            f"an fp8_656 cache holds bytes (uint8, int8 or float8_e4m3fn), got dtype {cache.dtype}"
        )
    four_d = cache.dim() == 4 and cache.shape[2] == 1
    if not (cache.dim() == 3 or four_d) or cache.shape[-1] != FP8_656_BYTES:
        raise ValueError(
            f"an fp8_656 cache must be [num_blocks, block_size, 656] or [num_blocks, block_size, "
            f"1, 656], got shape {tuple(cache.shape)}"
        )
    if cache.shape[1] > 1 and cache.stride(1) != FP8_656_BYTES:
        raise ValueError(
            f"the records of an fp8_656 cache must be 656 bytes apart within a block (FlashMLA "
            f"reads a block as one array), got strides {tuple(cache.stride())}"
        )
    offset = 0 if torch.compiler.is_compiling() else cache.data_ptr() % 16
    if offset or (cache.shape[0] > 1 and cache.stride(0) % 16 != 0):
        raise ValueError(
            f"an fp8_656 cache must be 16-byte aligned (data_ptr and block stride; its fields sit "
            f"on 16-byte boundaries), got data_ptr % 16 = {offset}, strides "
            f"{tuple(cache.stride())}"
        )
    return cache


def fp8_584_layout(name: str, cache: torch.Tensor) -> None:
    """The shape, dtype and strides of a DeepSeek-V4 FP8 cache as FlashMLA allocates it
    (``tests/quant.py``, ``quantize_k_cache`` for ``MODEL1_FP8Sparse``): ``[num_blocks,
    block_size, 1, 584]`` (or 3-D) bytes, 584 bytes a token apart (FlashMLA checks
    ``stride(1) == 584``: it reads a block as one array), blocks a multiple of 576 bytes apart
    (its allocation pads them so; its SM100 kernels require it) and at least ``block_size *
    584`` bytes."""
    if cache.dtype not in RECORD_DTYPES:
        raise TypeError(
            f"an fp8_584 cache holds bytes (uint8, int8 or float8_e4m3fn), got dtype {cache.dtype}"
        )
    four_d = cache.dim() == 4 and cache.shape[2] == 1
    if not (cache.dim() == 3 or four_d) or cache.shape[-1] != FP8_584_BYTES:
        raise ValueError(
            f"an fp8_584 cache must be [num_blocks, block_size, 584] or [num_blocks, block_size, "
            f"1, 584], got shape {tuple(cache.shape)}"
        )
    check_last_dim_contiguous(name, cache)
    n_blocks, block_size = cache.shape[0], cache.shape[1]
    if block_size > 1 and cache.stride(1) != FP8_584_BYTES:
        raise ValueError(
            f"the entries of an fp8_584 cache must be 584 bytes apart within a block (a block is "
            f"block_size data rows of 576 bytes, then block_size scale rows of 8: FlashMLA reads "
            f"it as one array), got strides {tuple(cache.stride())}"
        )
    block_stride = cache.stride(0)
    if n_blocks > 1 and (
        block_stride % FP8_584_BLOCK_ALIGN != 0 or block_stride < block_size * FP8_584_BYTES
    ):
        raise ValueError(
            f"the blocks of an fp8_584 cache must be a multiple of 576 bytes apart, and at least "
            f"block_size * 584 = {block_size * FP8_584_BYTES} (FlashMLA pads each block to a "
            f"multiple of 576 bytes: allocate [num_blocks, ceil(block_size * 584 / 576) * 576] "
            f"bytes and view [:, :block_size * 584]), got strides {tuple(cache.stride())}"
        )


def _check_fp8_584(cache: object, latent: int, rope_dim: int, device) -> torch.Tensor:
    if latent != FP8_584_LATENT or rope_dim != FP8_584_ROPE:
        raise ValueError(
            f"cache_format='fp8_584' holds L = {FP8_584_LATENT} latent and R = {FP8_584_ROPE} "
            f"rope values a token (DeepSeek-V4's head: [nope 448 | rope 64]), got L = "
            f"kv_c.shape[1] = {latent}, R = k_pe.shape[-1] = {rope_dim}"
        )
    cache = check_tensor("cache", cache)
    if cache.device != device:
        raise ValueError(f"cache must be on the inputs' device {device}, got {cache.device}")
    fp8_584_layout("cache", cache)
    offset = 0 if torch.compiler.is_compiling() else cache.data_ptr() % 16
    if offset:
        raise ValueError(
            f"an fp8_584 cache must be 16-byte aligned (its rows sit on 16-byte boundaries: "
            f"FlashMLA loads them 16 bytes at a time), got data_ptr % 16 = {offset}"
        )
    check_written("cache", cache)
    return cache


def validate_append_on_device(call: AppendCall) -> None:
    """The checks that read device data (one sync): slots in the cache and distinct, the
    positions of written tokens in the table, a tensor scale's value."""
    cache = call.cache
    if call.cache_format in ("fp8_656", "fp8_584") and cache.dim() == 4:
        cache = cache.squeeze(2)
    validate_on_device(
        call.positions, call.cos.shape[0], call.slot_mapping, cache.shape[0], cache.shape[1],
        call.scale, "kv_scale",
    )  # fmt: skip
