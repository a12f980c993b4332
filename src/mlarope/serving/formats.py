"""The cache formats of :mod:`mlarope.serving` and every host-side check of its two ops.

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

The checks read no device data (no sync). What needs device data (slots in the cache and
distinct, positions in the table, a tensor scale's value) is checked by ``validate_*`` when
validation is asked for.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

# Core import point (the library's checks and error messages).
from .._checks import (
    ROPE_DIMS,
    check_bool,
    check_last_dim_contiguous,
    check_tables,
    check_tables_constant,
    check_tensor,
)
from .._memory import refuse_shared, refuse_written_overlap
from .reference import (
    FP8_584_BLOCK_ALIGN,
    FP8_584_BYTES,
    FP8_584_LATENT,
    FP8_584_ROPE,
    FP8_656_BYTES,
    FP8_656_LATENT,
    FP8_656_ROPE,
)

CACHE_FORMATS = ("concat", "split", "fp8_656", "fp8_584")
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_DTYPES = (torch.float8_e4m3fn, torch.uint8)  # uint8: e4m3 codes (vLLM's FP8 cache tensor)
RECORD_DTYPES = (torch.uint8, torch.int8, torch.float8_e4m3fn)
INDEX_DTYPES = (torch.int32, torch.int64)
FP32_MIN_NORMAL = 2.0**-126
FP32_MAX = 3.4028234663852886e38


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


@dataclass(frozen=True)
class QueryCall:
    """A checked ``rope_decode_query`` call (``op_args()`` for the custom ops, ``out`` apart)."""

    q_nope: torch.Tensor  # [T, H, L]
    q_pe: torch.Tensor  # [T, H, R]
    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor  # [T]
    out: torch.Tensor | None  # [T, H, L + R]
    fp8: bool  # the output is FP8 e4m3 (else the inputs' dtype)
    scale: torch.Tensor | None
    scale_value: float
    interleaved: bool
    interleaved_out: bool

    def op_args(self) -> tuple:
        """The arguments after ``q_nope, q_pe, cos, sin, positions`` (and ``out``)."""
        return (self.scale, self.scale_value, self.interleaved, self.interleaved_out)


# ------------------------------------------------------------------------------------- helpers
def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def _check_input(name: str, t: object, dims: int, shape: str) -> torch.Tensor:
    t = check_tensor(name, t)
    if t.dtype not in INPUT_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got dtype {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D {shape}, got shape {tuple(t.shape)}")
    check_last_dim_contiguous(name, t)
    return t


def _check_rope_dim(name: str, width: int) -> int:
    """The rope width ``R`` of the op's rope input (the tables may be ``[P, R]`` or pair tables
    ``[P, R / 2]``, so it comes from the input)."""
    if width not in ROPE_DIMS:
        raise ValueError(
            f"the rope dim R = {name}.shape[-1] must be one of {ROPE_DIMS}, got {width}"
        )
    return width


def _check_like(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} and {ref_name} must share a dtype, got {t.dtype} and {ref.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{name} must be on {ref_name}'s device {ref.device}, got {t.device}")


def _check_index(name: str, t: object, n_tokens: int, device: torch.device) -> torch.Tensor:
    t = check_tensor(name, t)
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got dtype {t.dtype}")
    if t.dim() != 1 or t.shape[0] != n_tokens:
        raise ValueError(
            f"{name} must be 1-D [T] with T = {n_tokens} tokens, got shape {tuple(t.shape)}"
        )
    if t.device != device:
        raise ValueError(f"{name} must be on the inputs' device {device}, got {t.device}")
    return t


def _check_not_differentiated(*named: tuple[str, torch.Tensor]) -> None:
    if not torch.is_grad_enabled():
        return
    for name, t in named:
        if t.requires_grad:
            raise ValueError(
                f"{name} requires grad; the serving ops are not differentiable (they write a "
                f"cache or a decode query): call them under torch.no_grad() or "
                f"torch.inference_mode(), or pass {name}.detach()"
            )


def _check_scale(
    name: str, scale: object, wanted: bool, why_not: str, device: torch.device
) -> tuple[torch.Tensor | None, float]:
    """A per-tensor dequant scale -> ``(tensor or None, value)``: a real number (any
    ``numbers.Real`` but a bool: numpy's real scalars too; finite, a normal positive fp32) or a
    1-element fp32 tensor on ``device``; ``None`` where not ``wanted``."""
    if not wanted:
        if scale is not None:
            raise ValueError(f"{name} must be None {why_not}, got {_scale_repr(scale)}")
        return None, 1.0
    if scale is None:
        raise ValueError(
            f"{name} is required {why_not}: the dequant scale (stored = e4m3(x / {name}), "
            f"value = stored * {name}); pass 1.0 for none"
        )
    if isinstance(scale, torch.Tensor):
        if scale.dtype != torch.float32 or scale.numel() != 1:
            raise TypeError(
                f"{name} as a tensor must be a 1-element float32 tensor on the inputs' device "
                f"(the kernel reads it there), got {_describe(scale)}"
            )
        if scale.device != device:
            raise ValueError(f"{name} must be on the inputs' device {device}, got {scale.device}")
        return scale.reshape(1) if scale.dim() != 1 else scale, 1.0
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(
            f"{name} must be a real number (an int, a float or another numbers.Real: numpy's "
            f"real scalars, fractions.Fraction; not a bool) or a 1-element float32 tensor on the "
            f"inputs' device, got {scale!r} ({type(scale).__name__})"
        )
    try:
        value = float(scale)
    except OverflowError:  # an int beyond any float
        value = math.inf
    if not (math.isfinite(value) and FP32_MIN_NORMAL <= value <= FP32_MAX):
        raise ValueError(
            f"{name} must be a finite positive float32 number in [2**-126, {FP32_MAX:.4g}], got "
            f"{scale!r}"
        )
    return None, value


def _scale_repr(scale: object) -> str:
    return _describe(scale) if isinstance(scale, torch.Tensor) else repr(scale)


def _check_cache_tensor(name: str, t: object, device: torch.device) -> torch.Tensor:
    t = check_tensor(name, t)
    if t.device != device:
        raise ValueError(f"{name} must be on the inputs' device {device}, got {t.device}")
    check_last_dim_contiguous(name, t)
    _check_written(name, t)
    return t


def _check_written(name: str, t: torch.Tensor) -> None:
    """A tensor the op writes (a cache, ``out``): each element its own memory, and not an
    inference tensor outside inference mode (PyTorch forbids writing to one; the kernels write
    through a pointer, so PyTorch's own check never runs). While ``torch.compile`` traces,
    only a stride-0 dim is looked for (strides may be symbolic); the rest is checked when the
    graph runs (:func:`_check_apart`)."""
    if torch.compiler.is_compiling():
        for size, stride in zip(t.shape, t.stride(), strict=True):
            if size > 1 and stride == 0:
                refuse_written_overlap(name, t, broadcast=True)
        return
    if t.is_inference() and not torch.is_inference_mode_enabled():
        raise ValueError(
            f"{name} is an inference tensor (made under torch.inference_mode()), which cannot "
            f"be written outside inference mode (PyTorch's rule): call inside "
            f"torch.inference_mode(), or allocate {name} outside it"
        )
    refuse_written_overlap(name, t)


def _check_cache_dtype(name: str, t: torch.Tensor, kv_c: torch.Tensor) -> bool:
    """True for an FP8 cache; a 16/32-bit cache must have ``kv_c``'s dtype."""
    if t.dtype in FP8_DTYPES:
        return True
    if t.dtype != kv_c.dtype:
        raise TypeError(
            f"{name} must have kv_c's dtype {kv_c.dtype} (entries are copied) or be FP8 e4m3 "
            f"(torch.float8_e4m3fn, or torch.uint8 codes), got dtype {t.dtype}"
        )
    return False


def _check_apart(written: tuple[tuple[str, torch.Tensor], ...], read: tuple) -> None:
    """``_memory.refuse_shared``: no written element shares memory with another or with a read
    one. Addresses are not traced: while ``torch.compile`` traces, this puts the check into the
    graph as an op of its own (``serving.ops.refuse_shared_op``), which sees the graph's real
    tensors when it runs on every backend (the writing op's own check sees a copy of the cache
    under ``aot_eager``, whose functionalization writes into a clone and copies it back)."""
    if torch.compiler.is_compiling():
        from .ops import refuse_shared_op

        refuse_shared_op(
            [t for _, t in written], [t for _, t in read],
            ",".join(n for n, _ in written) + ";" + ",".join(n for n, _ in read),
        )  # fmt: skip
        return
    refuse_shared(written, read)


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
    kv_c = _check_input("kv_c", kv_c, 2, "[T, L]")
    k_pe = check_tensor("k_pe", k_pe)
    _check_like("k_pe", k_pe, "kv_c", kv_c)
    n_tokens, latent = kv_c.shape
    if k_pe.dim() == 3 and k_pe.shape[1] == 1:
        k_pe = k_pe.squeeze(1)
    if k_pe.dim() != 2 or k_pe.shape[0] != n_tokens:
        raise ValueError(
            f"k_pe must be [T, R] or [T, 1, R] with kv_c's T = {n_tokens}, got shape "
            f"{tuple(k_pe.shape)}"
        )
    check_last_dim_contiguous("k_pe", k_pe)
    rope_dim = _check_rope_dim("k_pe", k_pe.shape[1])
    check_bool("pair_tables", pair_tables)
    cos2d, sin2d = check_tables(cos, sin, kv_c.device, ("k_pe", rope_dim, pair_tables))
    check_tables_constant(cos, sin)
    positions = _check_index("positions", positions, n_tokens, kv_c.device)
    slot_mapping = _check_index("slot_mapping", slot_mapping, n_tokens, kv_c.device)
    check_bool("interleaved", interleaved)
    check_bool("interleaved_out", interleaved_out)
    _check_not_differentiated(("kv_c", kv_c), ("k_pe", k_pe))

    kpe_cache = None
    if cache_format == "fp8_656":
        cache = _check_fp8_656(cache, latent, rope_dim, kv_c.device)
        fp8, why_not = False, "for cache_format='fp8_656' (its per-tile scales are computed)"
    elif cache_format == "fp8_584":
        cache = _check_fp8_584(cache, latent, rope_dim, kv_c.device)
        fp8, why_not = False, "for cache_format='fp8_584' (its per-tile scales are computed)"
    elif cache_format == "concat":
        cache = _check_cache_tensor("cache", cache, kv_c.device)
        if cache.dim() != 3 or cache.shape[2] != latent + rope_dim:
            raise ValueError(
                f"a concat cache must be [num_blocks, block_size, L + R] = [.., .., "
                f"{latent + rope_dim}] (L = {latent}, R = {rope_dim}), got shape "
                f"{tuple(cache.shape)}"
                + ("; for FlashMLA's [num_blocks, block_size, 1, L + R] view pass "
                   "cache.squeeze(2)" if cache.dim() == 4 and cache.shape[2] == 1 else "")
            )  # fmt: skip
        fp8 = _check_cache_dtype("cache", cache, kv_c)
        why_not = f"for a {cache.dtype} cache (only FP8 caches are scaled)"
    else:
        if not isinstance(cache, (tuple, list)) or len(cache) != 2:
            raise TypeError(
                f"a split cache must be a pair (ckv [num_pages, page_size, L], kpe [num_pages, "
                f"page_size, R]), got {type(cache).__name__}"
            )
        ckv = _check_cache_tensor("ckv (cache[0])", cache[0], kv_c.device)
        kpe = _check_cache_tensor("kpe (cache[1])", cache[1], kv_c.device)
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
        fp8 = _check_cache_dtype("ckv (cache[0])", ckv, kv_c)
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
    scale, scale_value = _check_scale("kv_scale", kv_scale, fp8, why_not, kv_c.device)
    inputs = (
        ("kv_c", kv_c), ("k_pe", k_pe), ("cos", cos2d), ("sin", sin2d), ("positions", positions),
        ("slot_mapping", slot_mapping), ("kv_scale", scale),
    )  # fmt: skip
    written = (
        (("cache", cache),) if kpe_cache is None
        else (("ckv (cache[0])", cache), ("kpe (cache[1])", kpe_cache))
    )  # fmt: skip
    _check_apart(written, inputs)
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
    cache = _check_cache_tensor("cache", cache, device)
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


def _fp8_584_layout(name: str, cache: torch.Tensor) -> None:
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
    _fp8_584_layout("cache", cache)
    offset = 0 if torch.compiler.is_compiling() else cache.data_ptr() % 16
    if offset:
        raise ValueError(
            f"an fp8_584 cache must be 16-byte aligned (its rows sit on 16-byte boundaries: "
            f"FlashMLA loads them 16 bytes at a time), got data_ptr % 16 = {offset}"
        )
    _check_written("cache", cache)
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


def validate_on_device(
    positions: torch.Tensor,
    table_rows: int,
    slots: torch.Tensor | None = None,
    n_blocks: int = 0,
    block_size: int = 0,
    scale: torch.Tensor | None = None,
    scale_name: str = "",
) -> None:
    """The serving ops' checks of device data (one sync): with ``slots``, each in the cache of
    ``n_blocks x block_size`` entries or -1, and distinct, and the positions of the tokens they
    write in the table; without, every position in the table; a tensor ``scale`` finite,
    positive and normal. While ``torch.compile`` traces they are an op of the graph
    (``serving.ops.validate_on_device_op``), which reads the data and raises when the graph
    runs (a traced branch on device data broke a fullgraph)."""
    if torch.compiler.is_compiling():
        from .ops import validate_on_device_op

        validate_on_device_op(positions, table_rows, slots, n_blocks, block_size, scale, scale_name)
        return
    if slots is None:
        pos = positions.detach().to(torch.int64)
        bad = (pos < 0) | (pos >= table_rows)
        if bool(bad.any()):
            t = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"positions[{t}] = {int(pos[t])} is outside the table [0, {table_rows}) "
                f"(cos.shape[0] = {table_rows})"
            )
        _validate_scale(scale_name, scale)
        return
    capacity = n_blocks * block_size
    rows = table_rows
    slots = slots.detach().cpu().tolist()
    positions = positions.detach().cpu().tolist()
    seen: dict[int, int] = {}
    for t, (slot, pos) in enumerate(zip(slots, positions, strict=True)):
        if slot == -1:
            continue
        if not 0 <= slot < capacity:
            raise ValueError(
                f"slot_mapping[{t}] = {slot} is outside the cache: slots are in [0, {capacity}) "
                f"({n_blocks} blocks x {block_size}), and -1 marks a padding token"
            )
        if slot in seen:
            raise ValueError(
                f"slot_mapping[{t}] = {slot} repeats slot_mapping[{seen[slot]}]: two tokens "
                f"cannot write one cache slot"
            )
        seen[slot] = t
        if not 0 <= pos < rows:
            raise ValueError(
                f"positions[{t}] = {pos} is outside the table [0, {rows}) (cos.shape[0] = {rows})"
            )
    _validate_scale(scale_name, scale)


def _validate_scale(name: str, scale: torch.Tensor | None) -> None:
    if scale is None:
        return
    value = float(scale.detach().reshape(()).cpu())
    if not (math.isfinite(value) and value >= FP32_MIN_NORMAL):
        raise ValueError(
            f"{name} = {value!r}: a dequant scale must be a finite positive normal float32"
        )


# ------------------------------------------------------------------------------ the query op
def check_query_call(
    q_nope: object,
    q_pe: object,
    cos: object,
    sin: object,
    positions: object,
    out: object,
    out_dtype: object,
    q_scale: object,
    interleaved: object,
    interleaved_out: object,
    pair_tables: object = False,
) -> QueryCall:
    """All host-side checks of a ``rope_decode_query`` call."""
    q_nope = _check_input("q_nope", q_nope, 3, "[T, H, L]")
    q_pe = _check_input("q_pe", q_pe, 3, "[T, H, R]")
    _check_like("q_pe", q_pe, "q_nope", q_nope)
    n_tokens, n_heads, latent = q_nope.shape
    if q_pe.shape[:2] != q_nope.shape[:2]:
        raise ValueError(
            f"q_pe must be [T, H, R] with q_nope's T, H = {tuple(q_nope.shape[:2])}, got shape "
            f"{tuple(q_pe.shape)}"
        )
    rope_dim = _check_rope_dim("q_pe", q_pe.shape[2])
    check_bool("pair_tables", pair_tables)
    cos2d, sin2d = check_tables(cos, sin, q_nope.device, ("q_pe", rope_dim, pair_tables))
    check_tables_constant(cos, sin)
    positions = _check_index("positions", positions, n_tokens, q_nope.device)
    check_bool("interleaved", interleaved)
    check_bool("interleaved_out", interleaved_out)
    _check_not_differentiated(("q_nope", q_nope), ("q_pe", q_pe))
    allowed = (q_nope.dtype, torch.float8_e4m3fn)
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"out_dtype must be a torch.dtype or None, got {out_dtype!r}")
    if out is not None:
        out = check_tensor("out", out)
        wanted = (n_tokens, n_heads, latent + rope_dim)
        if tuple(out.shape) != wanted:
            raise ValueError(
                f"out must be [T, H, L + R] = {list(wanted)}, got shape {tuple(out.shape)}"
            )
        if out.device != q_nope.device:
            raise ValueError(f"out must be on q_nope's device {q_nope.device}, got {out.device}")
        if out_dtype is not None and out.dtype != out_dtype:
            raise TypeError(f"out has dtype {out.dtype} but out_dtype is {out_dtype}")
        out_dtype = out.dtype
        check_last_dim_contiguous("out", out)
        _check_written("out", out)
    out_dtype = q_nope.dtype if out_dtype is None else out_dtype
    if out_dtype not in allowed:
        raise TypeError(
            f"the output dtype must be q_nope's dtype {q_nope.dtype} or torch.float8_e4m3fn, got "
            f"{out_dtype}"
        )
    fp8 = out_dtype == torch.float8_e4m3fn
    scale, scale_value = _check_scale(
        "q_scale", q_scale, fp8, f"for a {out_dtype} output (only FP8 outputs are scaled)",
        q_nope.device,
    )  # fmt: skip
    if out is not None:
        read = (
            ("q_nope", q_nope), ("q_pe", q_pe), ("cos", cos2d), ("sin", sin2d),
            ("positions", positions), ("q_scale", scale),
        )  # fmt: skip
        _check_apart((("out", out),), read)
    return QueryCall(
        q_nope, q_pe, cos2d, sin2d, positions, out, fp8, scale, scale_value, interleaved,
        interleaved_out,
    )  # fmt: skip


def validate_query_on_device(call: QueryCall) -> None:
    """Positions in the table and a tensor scale's value (one sync)."""
    validate_on_device(call.positions, call.cos.shape[0], scale=call.scale, scale_name="q_scale")


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
        _fp8_584_layout("cache", cache)
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
    scale, value = _check_scale("kv_scale", kv_scale, fp8, why_not, first.device)
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
