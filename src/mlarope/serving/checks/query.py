"""The host-side checks of :func:`mlarope.serving.rope_decode_query` and its checked call."""

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
from .common import (
    check_apart,
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
    q_nope = check_input("q_nope", q_nope, 3, "[T, H, L]")
    q_pe = check_input("q_pe", q_pe, 3, "[T, H, R]")
    check_like("q_pe", q_pe, "q_nope", q_nope)
    n_tokens, n_heads, latent = q_nope.shape
    if q_pe.shape[:2] != q_nope.shape[:2]:
        raise ValueError(
            f"q_pe must be [T, H, R] with q_nope's T, H = {tuple(q_nope.shape[:2])}, got shape "
            f"{tuple(q_pe.shape)}"
        )
    rope_dim = check_rope_dim("q_pe", q_pe.shape[2])
    check_bool("pair_tables", pair_tables)
    cos2d, sin2d = check_tables(cos, sin, q_nope.device, ("q_pe", rope_dim, pair_tables))
    check_tables_constant(cos, sin)
    positions = check_index("positions", positions, n_tokens, q_nope.device)
    check_bool("interleaved", interleaved)
    check_bool("interleaved_out", interleaved_out)
    check_not_differentiated(("q_nope", q_nope), ("q_pe", q_pe))
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
        check_written("out", out)
    out_dtype = q_nope.dtype if out_dtype is None else out_dtype
    if out_dtype not in allowed:
        raise TypeError(
            f"the output dtype must be q_nope's dtype {q_nope.dtype} or torch.float8_e4m3fn, got "
            f"{out_dtype}"
        )
    fp8 = out_dtype == torch.float8_e4m3fn
    scale, scale_value = check_scale(
        "q_scale", q_scale, fp8, f"for a {out_dtype} output (only FP8 outputs are scaled)",
        q_nope.device,
    )  # fmt: skip
    if out is not None:
        read = (
            ("q_nope", q_nope), ("q_pe", q_pe), ("cos", cos2d), ("sin", sin2d),
            ("positions", positions), ("q_scale", scale),
        )  # fmt: skip
        check_apart((("out", out),), read)
    return QueryCall(
        q_nope, q_pe, cos2d, sin2d, positions, out, fp8, scale, scale_value, interleaved,
        interleaved_out,
    )  # fmt: skip


def validate_query_on_device(call: QueryCall) -> None:
    """Positions in the table and a tensor scale's value (one sync)."""
    validate_on_device(call.positions, call.cos.shape[0], scale=call.scale, scale_name="q_scale")
