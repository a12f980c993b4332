"""The attention-output op of :mod:`mlarope.serving` (DeepSeek-V4): its checked call and every
host-side check of :func:`mlarope.serving.rope_inverse_quant_output`.

``o: [T, H, D]`` (``[nope | rope]`` heads, ``D`` a multiple of 128) is inverse-rotated on its
trailing ``R`` channels and quantized to FP8 e4m3 with one UE8M0 scale per 128 channels, for
DeepSeek's FP8 grouped output projection: the codes ``[T, G, (H / G) * D]`` (``G`` groups of
``H / G`` heads, each group's channels contiguous), the scales ``[T, G, (H / G) * D / 128]``
(fp32, UE8M0 bytes) or ``[T, G, (H / G) * D / 512]`` (int32, four UE8M0 bytes each), in any
strides the caller gives (vLLM's group-major codes and MN-major scales included).

The checks read no device data (no sync); ``validate_output_on_device`` checks the positions
when validation is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Core import point (the library's checks).
from ..._checks import (
    ROPE_DIMS,
    check_bool,
    check_last_dim_contiguous,
    check_tables,
    check_tables_constant,
    check_tensor,
)
from ..formats import CODE_DTYPES, OUTPUT_BLOCK, OUTPUT_SCALE_DTYPES, output_scale_shape
from .common import (
    check_apart,
    check_index,
    check_input,
    check_not_differentiated,
    check_written,
    validate_on_device,
)


@dataclass(frozen=True)
class OutputCall:
    """A checked ``rope_inverse_quant_output`` call (``op_args()`` for the custom op, in order;
    ``out`` and ``scale_out`` None where the call allocates them)."""

    o: torch.Tensor  # [T, H, D]
    cos: torch.Tensor  # [P, R], or pair tables [P, R / 2]
    sin: torch.Tensor  # [P, R], or pair tables [P, R / 2]
    positions: torch.Tensor  # [T]
    out: torch.Tensor | None  # [T, G, (H / G) * D] e4m3 codes
    scale_out: torch.Tensor | None  # [T, G, K]
    groups: int
    scale_dtype: torch.dtype
    interleaved: bool
    interleaved_out: bool
    pair_tables: bool

    @property
    def width(self) -> int:
        """Channels of a group: ``(H / G) * D``."""
        return self.o.shape[1] // self.groups * self.o.shape[2]

    def scale_shape(self) -> tuple:
        return output_scale_shape(self.o.shape[0], self.groups, self.width, self.scale_dtype)

    def op_args(self, out: torch.Tensor, scale_out: torch.Tensor) -> tuple:
        return (
            self.o, self.cos, self.sin, self.positions, out, scale_out, self.groups,
            self.interleaved, self.interleaved_out, self.pair_tables,
        )  # fmt: skip


def _dtype_names(dtypes) -> str:
    return ", ".join(str(d) for d in dtypes)


def check_output_call(
    o: object,
    cos: object,
    sin: object,
    positions: object,
    groups: object,
    out: object,
    scale_out: object,
    scale_dtype: object,
    interleaved: object,
    interleaved_out: object,
    pair_tables: object = False,
) -> OutputCall:
    """All host-side checks of a ``rope_inverse_quant_output`` call."""
    o = check_input("o", o, 3, "[T, H, D]")
    n_tokens, n_heads, head_dim = o.shape
    if head_dim % OUTPUT_BLOCK != 0 or head_dim == 0:
        raise ValueError(
            f"o's head dim D = o.shape[-1] must be a positive multiple of {OUTPUT_BLOCK} (one "
            f"scale per {OUTPUT_BLOCK} channels), got shape {tuple(o.shape)}"
        )
    check_bool("pair_tables", pair_tables)
    cos2d, sin2d = _check_output_tables(cos, sin, o.device, pair_tables)
    check_tables_constant(cos, sin)
    positions = check_index("positions", positions, n_tokens, o.device)
    if isinstance(groups, bool) or not isinstance(groups, int):
        raise TypeError(f"groups must be an int, got {groups!r} ({type(groups).__name__})")
    if groups < 1 or n_heads % groups != 0:
        raise ValueError(
            f"groups must be a positive divisor of the head count H = o.shape[1] = {n_heads} "
            f"(the output projection's head groups), got {groups}"
        )
    check_bool("interleaved", interleaved)
    check_bool("interleaved_out", interleaved_out)
    check_not_differentiated(("o", o))
    width = n_heads // groups * head_dim

    if scale_dtype is not None and not isinstance(scale_dtype, torch.dtype):
        raise TypeError(f"scale_dtype must be a torch.dtype or None, got {scale_dtype!r}")
    if out is not None:
        out = check_tensor("out", out)
        wanted = (n_tokens, groups, width)
        if tuple(out.shape) != wanted:
            raise ValueError(
                f"out must be [T, G, (H / G) * D] = {list(wanted)} (G = groups = {groups}), got "
                f"shape {tuple(out.shape)}"
            )
        if out.dtype not in CODE_DTYPES:
            raise TypeError(
                f"out holds e4m3 codes: torch.float8_e4m3fn or torch.uint8, got dtype {out.dtype}"
            )
        if out.device != o.device:
            raise ValueError(f"out must be on o's device {o.device}, got {out.device}")
        check_last_dim_contiguous("out", out)
        check_written("out", out)
    if scale_out is not None:
        scale_out = check_tensor("scale_out", scale_out)
        if scale_dtype is not None and scale_out.dtype != scale_dtype:
            raise TypeError(
                f"scale_out has dtype {scale_out.dtype} but scale_dtype is {scale_dtype}"
            )
        scale_dtype = scale_out.dtype
    scale_dtype = torch.float32 if scale_dtype is None else scale_dtype
    if scale_dtype not in OUTPUT_SCALE_DTYPES:
        raise TypeError(
            f"the scale dtype must be one of {_dtype_names(OUTPUT_SCALE_DTYPES)} (fp32 scales, "
            f"UE8M0 bytes, or four UE8M0 bytes to an int32), got {scale_dtype}"
        )
    blocks = width // OUTPUT_BLOCK
    if scale_dtype == torch.int32 and blocks % 4 != 0:
        raise ValueError(
            f"int32 scales pack four UE8M0 bytes each: a group's {blocks} blocks of "
            f"{OUTPUT_BLOCK} channels are not a multiple of 4 (o shape {tuple(o.shape)}, "
            f"groups {groups})"
        )
    if scale_out is not None:
        wanted = output_scale_shape(n_tokens, groups, width, scale_dtype)
        if tuple(scale_out.shape) != wanted:
            what = (
                "[T, G, (H / G) * D / 512]"
                if scale_dtype == torch.int32
                else ("[T, G, (H / G) * D / 128]")
            )
            raise ValueError(
                f"scale_out must be {what} = {list(wanted)} for {scale_dtype} scales, got shape "
                f"{tuple(scale_out.shape)}"
            )
        if scale_out.device != o.device:
            raise ValueError(f"scale_out must be on o's device {o.device}, got {scale_out.device}")
        check_written("scale_out", scale_out)
    written = tuple((n, t) for n, t in (("out", out), ("scale_out", scale_out)) if t is not None)
    if written:
        read = (("o", o), ("cos", cos2d), ("sin", sin2d), ("positions", positions))
        check_apart(written, read)
    return OutputCall(
        o, cos2d, sin2d, positions, out, scale_out, groups, scale_dtype, interleaved,
        interleaved_out, pair_tables,
    )  # fmt: skip


def _check_output_tables(
    cos: object, sin: object, device: torch.device, pair_tables: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin: [P, R]``, or with ``pair_tables`` ``[P, R / 2]``: the rope width ``R`` comes
    from the tables (``o`` does not say where its rope slice starts), so the form is the flag's.
    The two halves of one ``[P, R]`` buffer without it are refused: an engine's
    ``cos_sin_cache`` read as full tables of ``R / 2`` channels rotates the wrong slice."""
    if not pair_tables:
        cos2d, sin2d = check_tables(cos, sin, device)
        refuse_table_halves(cos2d, sin2d)
        return cos2d, sin2d
    c = check_tensor("cos", cos)
    rope_dim = 2 * c.shape[-1] if c.dim() else 0
    if rope_dim not in ROPE_DIMS:
        raise ValueError(
            f"with pair_tables=True, the rope dim R = 2 * cos.shape[-1] must be one of "
            f"{ROPE_DIMS}, got {rope_dim} (cos shape {tuple(c.shape)})"
        )
    return check_tables(cos, sin, device, ("2 * cos", rope_dim, True))


def refuse_table_halves(cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Refuse ``cos, sin: [P, W]`` that are the two column halves of one ``[P, 2 W]`` buffer
    (``sin`` starts where ``cos``'s row ends; row stride ``2 W``): an engine's ``cos_sin_cache``,
    cos then sin, whose halves are pair tables. From the addresses, so not while
    ``torch.compile`` traces; the custom op checks the graph's tensors when it runs."""
    if torch.compiler.is_compiling():
        return
    width = cos.shape[-1]
    if (
        cos.stride(0) == sin.stride(0) == 2 * width
        and sin.data_ptr() - cos.data_ptr() == width * cos.element_size()
    ):
        raise ValueError(
            f"cos and sin are the two halves of one [P, {2 * width}] buffer (an engine's "
            f"cos_sin_cache [P, R]: cos, then sin), the pair tables [P, R / 2] of R = "
            f"{2 * width}: pass pair_tables=True (full [P, {width}] tables that lie side by side "
            f"in one buffer: pass cos.contiguous() and sin.contiguous())"
        )


def validate_output_on_device(call: OutputCall) -> None:
    """Positions in the table (one sync)."""
    validate_on_device(call.positions, call.cos.shape[0])
