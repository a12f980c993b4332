"""The data of :mod:`mlarope.serving`: its cache formats, their byte layouts and the dtypes
each tensor may have. Nothing here checks or computes; every other serving module reads these.

Formats (``cache_format``; docs/serving.md has the byte maps and the owners' sources):

- ``"concat"`` (vLLM's MLA cache): ``cache [num_blocks, block_size, L + R]``, each entry
  ``[kv_c | rotated k_pe]``; the dtype of ``kv_c`` (bf16, fp16, fp32: copied and rounded), or
  FP8 e4m3 (``torch.float8_e4m3fn``, or ``torch.uint8`` holding e4m3 codes as vLLM allocates
  it) with a per-tensor dequant ``kv_scale`` for both parts.
- ``"split"`` (FlashInfer's paged MLA cache): ``(ckv [num_pages, page_size, L],
  kpe [num_pages, page_size, R])``, both of one dtype, as above.
- ``"fp8_656"`` (FlashMLA's FP8 record, vLLM's ``fp8_ds_mla``): ``[num_blocks, block_size,
  656]`` or ``[num_blocks, block_size, 1, 656]`` bytes (``uint8``, ``int8`` or
  ``float8_e4m3fn``); ``L = 512``, ``R = 64``; entries 656 bytes apart; 16-byte aligned.
- ``"fp8_584"`` (FlashMLA's DeepSeek-V4 cache, ``MODEL1_FP8Sparse``): ``[num_blocks,
  block_size, 584]`` or ``[num_blocks, block_size, 1, 584]`` bytes as FlashMLA allocates them
  (584 bytes a token apart, blocks a multiple of 576 bytes apart); ``L = 448``, ``R = 64``; a
  block is ``block_size`` data rows of 576 bytes, then ``block_size`` scale rows of 8.

The attention output (``rope_inverse_quant_output``): e4m3 codes ``[T, G, (H / G) * D]`` and
one UE8M0 scale per 128 channels, ``[T, G, (H / G) * D / 128]`` (fp32, UE8M0 bytes) or
``[T, G, (H / G) * D / 512]`` (int32, four UE8M0 bytes each).
"""

from __future__ import annotations

import torch

CACHE_FORMATS = ("concat", "split", "fp8_656", "fp8_584")
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn, torch.uint8)  # uint8: e4m3 codes (vLLM's FP8 cache tensor)
RECORD_DTYPES = (torch.uint8, torch.int8, torch.float8_e4m3fn)
INDEX_DTYPES = (torch.int32, torch.int64)
CODE_DTYPES = (torch.float8_e4m3fn, torch.uint8)  # the attention output's e4m3 codes
FP32_MIN_NORMAL = 2.0**-126
FP32_MAX = 3.4028234663852886e38
E4M3_MAX = 448.0
FP8_656_BYTES = 656  # per token: 512 e4m3 codes, 4 fp32 tile scales, 64 bf16 rope values
FP8_656_LATENT = 512
FP8_656_ROPE = 64
FP8_656_TILE = 128
FP8_656_SCALES_AT = 512  # byte offsets within a record
FP8_656_ROPE_AT = 528
MIN_TILE_SCALE = 2.0**-13  # FlashMLA's floor 1e-4, rounded up to a power of two
# FlashMLA's MODEL1_FP8Sparse (DeepSeek-V4) cache: a block holds ``block_size`` data rows of 576
# bytes (448 e4m3 codes, then 64 bf16 rope values), then ``block_size`` scale rows of 8 bytes
# (7 UE8M0 exponents, one pad byte); blocks are padded to a multiple of 576 bytes.
FP8_584_BYTES = 584  # per token: a 576-byte data row and an 8-byte scale row
FP8_584_LATENT = 448
FP8_584_ROPE = 64
FP8_584_TILE = 64
FP8_584_TILES = 7
FP8_584_DATA_ROW = 576
FP8_584_ROPE_AT = 448  # byte offset of the rope values within a data row
FP8_584_SCALE_ROW = 8
FP8_584_BLOCK_ALIGN = 576  # a block's stride is a multiple of this


# ------------------------------------------------------------------------- the attention output
OUTPUT_BLOCK = 128  # channels per UE8M0 scale (DeepSeek's FP8 activation block)
# fp32 scales; UE8M0 bytes (float8_e8m0fnu where this torch has it, or uint8); four UE8M0
# bytes to an int32 element.
OUTPUT_SCALE_DTYPES = tuple(
    d
    for d in (torch.float32, getattr(torch, "float8_e8m0fnu", None), torch.uint8, torch.int32)
    if d is not None
)


def output_scale_shape(n_tokens: int, groups: int, width: int, dtype: torch.dtype) -> tuple:
    """``scale_out``'s shape for ``[T, G, width]`` codes: one scale per 128 channels, four to an
    element for int32 (packed UE8M0 bytes)."""
    blocks = width // OUTPUT_BLOCK
    return (n_tokens, groups, blocks // 4 if dtype == torch.int32 else blocks)


# ------------------------------------------------------------------- the byte records, as views
def as_codes(t: torch.Tensor) -> torch.Tensor:
    """An FP8 cache as its ``uint8`` codes (a view)."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def fp8_656_records(cache: torch.Tensor) -> torch.Tensor:
    """A FlashMLA FP8 cache (``[num_blocks, block_size, 656]`` or ``[..., 1, 656]``) as its
    ``uint8`` records ``[num_blocks, block_size, 656]`` (a view)."""
    if cache.dim() == 4:
        cache = cache.squeeze(2)
    return as_codes(cache)


def fp8_584_bytes(cache: torch.Tensor) -> torch.Tensor:
    """A DeepSeek-V4 FP8 cache (``[num_blocks, block_size, 584]`` or ``[..., 1, 584]``, blocks
    a multiple of 576 bytes apart) as ``uint8`` ``[num_blocks, block_size, 584]`` with strides
    ``(block stride, 584, 1)`` (a view). The entry stride is 584 where the checks require it and
    free, as a single block's stride is, where no address depends on it (one entry a block);
    both are set so that an integer view of the cache can be made (an odd one could not)."""
    if cache.dim() == 4:
        cache = cache.squeeze(2)
    codes = as_codes(cache)
    n_blocks, block_size = codes.shape[:2]
    block_stride = block_size * FP8_584_BYTES if n_blocks == 1 else codes.stride(0)
    return codes.as_strided(codes.shape, (block_stride, FP8_584_BYTES, 1))


def fp8_584_rows(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data [num_blocks, block_size, 576], scales [num_blocks, block_size, 8])``: ``uint8``
    views of a DeepSeek-V4 FP8 cache's data rows (entry ``e`` at byte ``576 e`` of its block)
    and scale rows (at byte ``576 block_size + 8 e``)."""
    codes = fp8_584_bytes(cache)
    n_blocks, block_size = codes.shape[:2]
    stride, offset = codes.stride(0), codes.storage_offset()
    data = codes.as_strided(
        (n_blocks, block_size, FP8_584_DATA_ROW), (stride, FP8_584_DATA_ROW, 1), offset
    )
    scales = codes.as_strided(
        (n_blocks, block_size, FP8_584_SCALE_ROW), (stride, FP8_584_SCALE_ROW, 1),
        offset + block_size * FP8_584_DATA_ROW,
    )  # fmt: skip
    return data, scales
