"""What every serving op checks: the shared host-side checks (each error names the argument
and its value), the memory rule for written tensors, and the checks of device data.

The host checks read no device data (no sync). What needs device data (slots in the cache and
distinct, positions in the table, a tensor scale's value) is checked by
:func:`validate_on_device` when validation is asked for. While ``torch.compile`` traces, the
checks that need addresses or data are ops of the graph (``refuse_shared_op``,
``validate_on_device_op``), which check the graph's real tensors when it runs.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

# Core import point (the library's checks and the memory rule).
from ..._checks import ROPE_DIMS, check_last_dim_contiguous, check_tensor
from ..._memory import refuse_shared, refuse_written_overlap
from ..formats import FP8_DTYPES, FP32_MAX, FP32_MIN_NORMAL, INDEX_DTYPES, INPUT_DTYPES


# ------------------------------------------------------------------------------------- helpers
def describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def check_input(name: str, t: object, dims: int, shape: str) -> torch.Tensor:
    t = check_tensor(name, t)
    if t.dtype not in INPUT_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got dtype {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D {shape}, got shape {tuple(t.shape)}")
    check_last_dim_contiguous(name, t)
    return t


def check_rope_dim(name: str, width: int) -> int:
    """The rope width ``R`` of the op's rope input (the tables may be ``[P, R]`` or pair tables
    ``[P, R / 2]``, so it comes from the input)."""
    if width not in ROPE_DIMS:
        raise ValueError(
            f"the rope dim R = {name}.shape[-1] must be one of {ROPE_DIMS}, got {width}"
        )
    return width


def check_like(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} and {ref_name} must share a dtype, got {t.dtype} and {ref.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{name} must be on {ref_name}'s device {ref.device}, got {t.device}")


def check_index(name: str, t: object, n_tokens: int, device: torch.device) -> torch.Tensor:
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


def check_not_differentiated(*named: tuple[str, torch.Tensor]) -> None:
    if not torch.is_grad_enabled():
        return
    for name, t in named:
        if t.requires_grad:
            raise ValueError(
                f"{name} requires grad; the serving ops are not differentiable (they write a "
                f"cache or a decode query): call them under torch.no_grad() or "
                f"torch.inference_mode(), or pass {name}.detach()"
            )


def check_scale(
    name: str, scale: object, wanted: bool, why_not: str, device: torch.device
) -> tuple[torch.Tensor | None, float]:
    """A per-tensor dequant scale -> ``(tensor or None, value)``: a real number (any
    ``numbers.Real`` but a bool: numpy's real scalars too; finite, a normal positive fp32) or a
    1-element fp32 tensor on ``device``; ``None`` where not ``wanted``."""
    if not wanted:
        if scale is not None:
            raise ValueError(f"{name} must be None {why_not}, got {scale_repr(scale)}")
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
                f"(the kernel reads it there), got {describe(scale)}"
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


def scale_repr(scale: object) -> str:
    return describe(scale) if isinstance(scale, torch.Tensor) else repr(scale)


def check_cache_tensor(name: str, t: object, device: torch.device) -> torch.Tensor:
    t = check_tensor(name, t)
    if t.device != device:
        raise ValueError(f"{name} must be on the inputs' device {device}, got {t.device}")
    check_last_dim_contiguous(name, t)
    check_written(name, t)
    return t


def check_written(name: str, t: torch.Tensor) -> None:
    """A tensor the op writes (a cache, ``out``): each element its own memory, and not an
    inference tensor outside inference mode (PyTorch forbids writing to one; the kernels write
    through a pointer, so PyTorch's own check never runs). While ``torch.compile`` traces,
    only a stride-0 dim is looked for (strides may be symbolic); the rest is checked when the
    graph runs (:func:`check_apart`)."""
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


def check_cache_dtype(name: str, t: torch.Tensor, kv_c: torch.Tensor) -> bool:
    """True for an FP8 cache; a 16/32-bit cache must have ``kv_c``'s dtype."""
    if t.dtype in FP8_DTYPES:
        return True
    if t.dtype != kv_c.dtype:
        raise TypeError(
            f"{name} must have kv_c's dtype {kv_c.dtype} (entries are copied) or be FP8 e4m3 "
            f"(torch.float8_e4m3fn, or torch.uint8 codes), got dtype {t.dtype}"
        )
    return False


def check_apart(written: tuple[tuple[str, torch.Tensor], ...], read: tuple) -> None:
    """``_memory.refuse_shared``: no written element shares memory with another or with a read
    one. Addresses are not traced: while ``torch.compile`` traces, this puts the check into the
    graph as an op of its own (``refuse_shared_op`` below), which sees the graph's real
    tensors when it runs on every backend (the writing op's own check sees a copy of the cache
    under ``aot_eager``, whose functionalization writes into a clone and copies it back)."""
    if torch.compiler.is_compiling():
        refuse_shared_op(
            [t for _, t in written], [t for _, t in read],
            ",".join(n for n, _ in written) + ";" + ",".join(n for n, _ in read),
        )  # fmt: skip
        return
    refuse_shared(written, read)


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
    (``validate_on_device_op`` below), which reads the data and raises when the graph
    runs (a traced branch on device data broke a fullgraph)."""
    if torch.compiler.is_compiling():
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


# ---------------------------------------------------------------------- the checks as graph ops
def _refuse_shared_impl(written: list[Tensor], read: list[Tensor | None], names: str) -> None:
    """The serving checks' memory rule on a compiled graph's real tensors: each written tensor
    with elements of its own (``_memory.refuse_written_overlap``), apart from the others and
    from the read ones (``_memory.refuse_shared``). ``names``: the written tensors' names, then
    ``;`` and the read ones', each list joined by commas."""
    written_names, read_names = (part.split(",") for part in names.split(";"))
    for name, t in zip(written_names, written, strict=True):
        refuse_written_overlap(name, t)
    refuse_shared(
        tuple(zip(written_names, written, strict=True)), tuple(zip(read_names, read, strict=True))
    )


# The serving checks' memory rule inside a compiled graph (``check_apart`` puts it there
# while tracing). An op of its own, not only the writing op's check: under
# ``backend="aot_eager"`` functionalization hands the writing op a clone of the cache (and
# copies it back after), so only an op that writes nothing sees the graph's real tensors on
# every backend. It returns nothing, so it is registered as having a side effect, or dead-code
# elimination would drop it.
refuse_shared_op = torch.library.custom_op(
    "mlarope::refuse_shared", _refuse_shared_impl, mutates_args=()
)


@refuse_shared_op.register_fake
def _refuse_shared_fake(*args) -> None:
    return None


_keep = (
    getattr(torch.fx.node, "has_side_effect", None) or torch.fx.node._side_effectful_functions.add
)
_keep(torch.ops.mlarope.refuse_shared.default)

# The serving ops' device-data checks inside a compiled graph (``validate_on_device`` puts
# them there while tracing): they read the data and raise when the graph runs.
validate_on_device_op = torch.library.custom_op(
    "mlarope::serving_validate_on_device", validate_on_device, mutates_args=()
)


@validate_on_device_op.register_fake
def _validate_on_device_fake(*args) -> None:
    return None


_keep(torch.ops.mlarope.serving_validate_on_device.default)
