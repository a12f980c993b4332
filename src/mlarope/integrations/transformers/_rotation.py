"""transformers' rotary-function arguments through :func:`mlarope.apply_rope_q`.

A transformers rotary function gets ``q, k`` and the tables its rotary embedding already
gathered per token: ``cos, sin: [Bc, S, R]`` (``Bc`` = 1 with default positions, ``B`` with
per-row ``position_ids``; the attention factor folded in), or DeepSeek-V2's complex
``freqs_cis: [Bc, S, R / 2]``. They become a table of ``Bc * S`` rows (a free reshape) and
``position_ids[b, s] = b * S + s``: mlarope multiplies by exactly the numbers transformers would
have, for any rope type, position offset or KV-cache step, and recomputes nothing. ``q, k: [B, H,
S, R]`` (``unsqueeze_dim=1``) or ``[B, S, H, R]`` (2) go in as a ``bshd`` view and come back as
the same view of mlarope's output.

:class:`Mapping` says how one function's pairs and tables map onto mlarope's query op; the probe
(``_probe``) finds it by running the function. :func:`make_replacement` wraps a function with
its mapping: a call mlarope cannot take goes to the original, unchanged.
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.autograd import forward_ad

import mlarope

# The rope widths mlarope's ops take (mlarope.apply_rope_q raises for others; those calls go to
# transformers' function instead).
ROPE_DIMS = mlarope.SUPPORTED_ROPE_DIMS
_REAL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class Mapping:
    """How a transformers rotary function maps onto :func:`mlarope.apply_rope_q`."""

    interleaved_in: bool  # pairs (x[2j], x[2j+1]) (True) or (x[j], x[half+j]) (False) in
    interleaved_out: bool  # ... and out
    # The function rotates pair j by cos[..., j], sin[..., j] only (the first half of the tables)
    # for both members; mlarope then gets cat(cos[..., :half], cos[..., :half]).
    first_half_tables: bool = False
    complex_freqs: bool = False  # (q, k, freqs_cis) with complex freqs_cis: [Bc, S, R / 2]
    k_optional: bool = False  # k may be None: returns (q_out, None)
    # The result dtype: "promoted" = promote_types(x.dtype, table dtype) (computed in it),
    # "input" = x.dtype (computed in fp32 by transformers).
    result_dtype: str = "promoted"
    # The rule above also holds when q and k differ in dtype (probed with bf16 / fp32 pairs);
    # where it does not (hy_v4_vl returns both in q's dtype), such calls stay transformers'.
    mixed_dtypes: bool = True

    def short(self) -> str:
        """``"interleaved -> half-split, first-half tables"``: the pair layouts and tables."""
        pairs = lambda interleaved: "interleaved" if interleaved else "half-split"
        text = f"{pairs(self.interleaved_in)} -> {pairs(self.interleaved_out)}"
        if self.complex_freqs:
            text += ", complex freqs"
        elif self.first_half_tables:
            text += ", first-half tables"
        if self.result_dtype == "input":
            text += ", result q.dtype"
        return text + (", k may be None" if self.k_optional else "")

    def describe(self) -> str:
        pairs = lambda interleaved: "interleaved" if interleaved else "half-split"
        if self.complex_freqs:
            tables = "complex freqs_cis as cat(re, re), cat(im, im)"
        elif self.first_half_tables:
            tables = "first half of cos/sin"
        else:
            tables = "full cos/sin"
        dtype = "x.dtype" if self.result_dtype == "input" else "promote(x, cos)"
        extra = ", k may be None" if self.k_optional else ""
        if not self.mixed_dtypes:
            extra += ", q and k of one dtype"
        return (
            f"{pairs(self.interleaved_in)} in, {pairs(self.interleaved_out)} out, {tables}, "
            f"result {dtype}{extra}"
        )


def _token_dims(
    q: torch.Tensor, k: torch.Tensor | None, table: torch.Tensor, heads_dim: int
) -> tuple[int, int] | None:
    """``(Bc, S)`` when ``q, k`` (4-D, heads at ``heads_dim``) and ``table: [Bc, S, *]`` agree."""
    seq_dim = 2 if heads_dim == 1 else 1
    batch, seq = q.shape[0], q.shape[seq_dim]
    if k is not None and (k.shape[0] != batch or k.shape[seq_dim] != seq or k.numel() == 0):
        return None
    if table.shape[1] != seq or table.shape[0] not in (1, batch) or q.numel() == 0:
        return None
    return table.shape[0], seq


def _usable(
    q: object,
    k: object,
    tables: tuple[object, ...],
    rope_dim: int,
    *,
    complex_ok: bool,
    mixed_dtypes: bool = True,
) -> bool:
    xs = (q,) if k is None else (q, k)
    if not all(isinstance(t, torch.Tensor) for t in (*xs, *tables)):
        return False
    if not mixed_dtypes and k is not None and k.dtype != q.dtype:
        return False
    if any(x.dim() != 4 or x.dtype not in _REAL_DTYPES for x in xs):
        return False
    if any(t.dim() != 3 for t in tables):
        return False
    if not all(t.dtype in _REAL_DTYPES or (complex_ok and t.is_complex()) for t in tables):
        return False
    if rope_dim not in ROPE_DIMS or any(x.shape[-1] != rope_dim for x in xs):
        return False
    if any(t.device != q.device for t in (*xs, *tables)):
        return False
    # mlarope does not differentiate the tables: keep transformers' path when they need a
    # gradient (mistral_large4's learnable alpha in training) or carry a forward-mode tangent.
    if torch.is_grad_enabled() and any(t.requires_grad for t in tables):
        return False
    return not (
        forward_ad._current_level >= 0
        and any(forward_ad.unpack_dual(t).tangent is not None for t in tables)
    )


def _bshd(x: torch.Tensor, heads_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """``x: [B, H, S, R]`` (``heads_dim=1``) or ``[B, S, H, R]`` (2) as the ``[B, S, H, R]``
    view mlarope rotates, in the result dtype, its last dim contiguous."""
    xb = x.transpose(1, 2) if heads_dim == 1 else x
    if xb.dtype != dtype:
        xb = xb.to(dtype)
    return xb if xb.stride(-1) == 1 else xb.contiguous()


def _flat_table(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``[Bc, S, R]`` -> ``[Bc * S, R]`` with a contiguous last dim (a view when it can be)."""
    t = t.reshape(rows, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _first_halves(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``cat(t[..., :R/2], t[..., :R/2])`` as ``[rows, R]``: both halves get each pair's angle."""
    half = t.shape[-1] // 2
    t = t.reshape(rows, t.shape[-1])
    return torch.cat((t[:, :half], t[:, :half]), dim=-1)


def _make_tables(sources: tuple, rows: int, kind: str) -> tuple:
    """``(cos, sin)`` as ``[rows, R]`` from a rotary function's tables (``sources``): ``"full"``
    ``(cos, sin)`` as they are, ``"first_half"`` ``(cos, sin)`` whose first half holds each
    pair's angle, ``"complex"`` DeepSeek-V2's ``(freqs_cis,)``."""
    if kind == "complex":
        (freqs_cis,) = sources
        real, imag = freqs_cis.real, freqs_cis.imag
        rope_dim = 2 * freqs_cis.shape[-1]
        return (
            torch.cat((real, real), dim=-1).reshape(rows, rope_dim),
            torch.cat((imag, imag), dim=-1).reshape(rows, rope_dim),
        )
    cos, sin = sources
    if kind == "first_half":
        return _first_halves(cos, rows), _first_halves(sin, rows)
    return _flat_table(cos, rows), _flat_table(sin, rows)


class _Prepared:
    """The tables of the last rotary call, made ready for mlarope (:func:`_make_tables`), and
    reused while later calls pass the same table objects: every layer of one model forward
    does (the rotary embedding runs once per forward), so the conversions (two concatenations
    for first-half and complex tables) run once per forward, not once per layer. Weak
    references to the tensors they were made from; a new version counter (an in-place write),
    row count or kind makes them anew."""

    __slots__ = ("key", "sources", "tables")

    def __init__(self) -> None:
        self.sources: tuple = ()
        self.key = None
        self.tables = None

    def get(self, sources: tuple, rows: int, kind: str) -> tuple:
        key = (*(t._version for t in sources), rows, kind)
        if (
            self.key == key
            and len(self.sources) == len(sources)
            and all(ref() is t for ref, t in zip(self.sources, sources, strict=True))
        ):
            return self.tables
        self.tables = _make_tables(sources, rows, kind)
        self.sources, self.key = tuple(weakref.ref(t) for t in sources), key
        return self.tables


_PREPARED = threading.local()


def _tables(sources: tuple, rows: int, kind: str) -> tuple:
    """A rotary function's tables (``[Bc, S, R]`` or complex ``[Bc, S, R / 2]``) -> the
    ``[Bc * S, R]`` tables mlarope rotates by."""
    if torch.compiler.is_compiling() or (
        sources[0].is_cuda and torch.cuda.is_current_stream_capturing()
    ):
        # Compiled, the graph makes them; inside a CUDA graph, the graph's own (a kept table
        # could be replaced, and freed, while the graph still reads it).
        return _make_tables(sources, rows, kind)
    prepared = getattr(_PREPARED, "last", None)
    if prepared is None:
        prepared = _PREPARED.last = _Prepared()
    return prepared.get(sources, rows, kind)


def _row_ids(batch_rows: int, seq: int, device: torch.device) -> torch.Tensor:
    """``position_ids[b, s] = b * S + s``: row ``(b, s)`` of the flattened gathered table."""
    return torch.arange(batch_rows * seq, device=device).view(batch_rows, seq)


def _result_dtype(mapping: Mapping, x: torch.Tensor, table_dtype: torch.dtype) -> torch.dtype:
    return x.dtype if mapping.result_dtype == "input" else torch.promote_types(x.dtype, table_dtype)


def _both(
    mapping: Mapping,
    q: torch.Tensor,
    k: torch.Tensor | None,
    heads_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    batch_rows: int,
    table_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate ``q`` and ``k`` by the flattened tables ``cos, sin: [Bc * S, R]``: with one row
    per position (``Bc = 1``) a token's row is its sequence index, the bshd layout's own
    position; with a row per batch entry and position, ``position_ids = b * S + s``."""
    seq = q.shape[2 if heads_dim == 1 else 1]
    ids = None if batch_rows == 1 else _row_ids(batch_rows, seq, q.device)
    flags = dict(
        layout="bshd", position_ids=ids, interleaved=mapping.interleaved_in,
        interleaved_out=mapping.interleaved_out,
    )  # fmt: skip
    qb = _bshd(q, heads_dim, _result_dtype(mapping, q, table_dtype))
    if k is None:
        q_out = mlarope.apply_rope_q(qb, cos, sin, **flags)
        return (q_out.transpose(1, 2) if heads_dim == 1 else q_out), None
    kb = _bshd(k, heads_dim, _result_dtype(mapping, k, table_dtype))
    if kb.dtype == qb.dtype:
        q_out, k_out = mlarope.apply_rope_qk(qb, kb, cos, sin, **flags)
    else:
        q_out = mlarope.apply_rope_q(qb, cos, sin, **flags)
        k_out = mlarope.apply_rope_q(kb, cos, sin, **flags)
    if heads_dim == 1:
        return q_out.transpose(1, 2), k_out.transpose(1, 2)
    return q_out, k_out


def rotate_cos_sin(
    mapping: Mapping, q: object, k: object, cos: object, sin: object, heads_dim: int
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``f(q, k, cos, sin)`` through mlarope, or None if it cannot take these arguments."""
    rope_dim = cos.shape[-1] if isinstance(cos, torch.Tensor) and cos.dim() > 0 else 0
    if k is None and not mapping.k_optional:
        return None
    if not _usable(q, k, (cos, sin), rope_dim, complex_ok=False, mixed_dtypes=mapping.mixed_dtypes):
        return None
    if cos.shape != sin.shape or cos.dtype != sin.dtype:
        return None
    dims = _token_dims(q, k, cos, heads_dim)
    if dims is None:
        return None
    batch_rows, seq = dims
    kind = "first_half" if mapping.first_half_tables else "full"
    cos2, sin2 = _tables((cos, sin), batch_rows * seq, kind)
    return _both(mapping, q, k, heads_dim, cos2, sin2, batch_rows, cos.dtype)


def rotate_freqs_cis(
    mapping: Mapping, xq: object, xk: object, freqs_cis: object
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """DeepSeek-V2's ``f(xq, xk, freqs_cis)`` through mlarope, or None if it cannot take them."""
    if not isinstance(freqs_cis, torch.Tensor) or not freqs_cis.is_complex():
        return None
    if xk is None and not mapping.k_optional:
        return None
    rope_dim = 2 * freqs_cis.shape[-1] if freqs_cis.dim() > 0 else 0
    if not _usable(
        xq, xk, (freqs_cis,), rope_dim, complex_ok=True, mixed_dtypes=mapping.mixed_dtypes
    ):
        return None
    dims = _token_dims(xq, xk, freqs_cis, 1)
    if dims is None:
        return None
    batch_rows, seq = dims
    cos, sin = _tables((freqs_cis,), batch_rows * seq, "complex")
    return _both(mapping, xq, xk, 1, cos, sin, batch_rows, cos.dtype)


def extra_args_reader(original: Callable) -> Callable[[tuple, dict], int | None]:
    """Read ``unsqueeze_dim`` from the arguments after ``(q, k, cos, sin)``, by the original's
    signature (DeepSeek-V3-style functions put an ignored ``position_ids`` before it, others do
    not have it). Returns the heads dim of ``q`` (1 or 2), or None: hand over the call."""
    try:
        params = list(inspect.signature(original).parameters.values())[4:]
    except (TypeError, ValueError):
        params = []
    by_position = [
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    known = {p.name for p in params} & {"position_ids", "unsqueeze_dim"}
    default = next((p.default for p in params if p.name == "unsqueeze_dim"), 1)

    def heads_dim(args: tuple, kwargs: dict) -> int | None:
        if not args and not kwargs:
            dim = default
        else:
            if len(args) > len(by_position):
                return None
            given = dict(zip(by_position, args, strict=False))
            if set(given) & set(kwargs):
                return None
            given.update(kwargs)
            if not set(given) <= known:
                return None
            dim = given.get("unsqueeze_dim", default)
        if isinstance(dim, bool) or not isinstance(dim, int) or not -4 <= dim <= 3:
            return None
        dim = dim + 4 if dim < 0 else dim  # cos [Bc, S, R] is unsqueezed into 4-D
        return dim if dim in (1, 2) else None

    return heads_dim


def make_replacement(original: Callable, mapping: Mapping, name: str) -> Callable:
    """``original``'s replacement: mlarope where it can take the call, else ``original``."""
    if mapping.complex_freqs:

        def rope(xq, xk, freqs_cis, *args, **kwargs):
            out = None if args or kwargs else rotate_freqs_cis(mapping, xq, xk, freqs_cis)
            return original(xq, xk, freqs_cis, *args, **kwargs) if out is None else out

    else:
        read_heads_dim = extra_args_reader(original)

        def rope(q, k, cos, sin, *args, **kwargs):
            heads_dim = read_heads_dim(args, kwargs)
            out = None if heads_dim is None else rotate_cos_sin(mapping, q, k, cos, sin, heads_dim)
            return original(q, k, cos, sin, *args, **kwargs) if out is None else out

    functools.update_wrapper(rope, original)
    rope.__doc__ = (
        f"mlarope replacement of transformers' ``{name}`` ({mapping.describe()}; see "
        f"mlarope.integrations.transformers); falls back to the original for inputs mlarope "
        f"cannot take.\n\n{original.__doc__ or ''}"
    )
    return rope
