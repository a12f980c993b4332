"""transformers' rotary-function arguments through :func:`mlarope.apply_rope_q`.

A transformers rotary function gets ``q, k`` and the tables its rotary embedding already
gathered per token: ``cos, sin: [Bc, S, R]`` (``Bc`` = 1 with default positions, ``B`` with
per-row ``position_ids``; the attention factor folded in), or DeepSeek-V2's complex
``freqs_cis: [Bc, S, R / 2]``. They become a table of ``Bc * S`` rows (a free reshape) and
``position_ids[b, s] = b * S + s``: mlarope multiplies by exactly the numbers transformers would
have, for any rope type, position offset or KV-cache step, and recomputes nothing. ``q, k: [B, H,
S, R]`` (``unsqueeze_dim=1``) or ``[B, S, H, R]`` (2) go in as a ``bshd`` view and come back as
the same view of mlarope's output.

A one-tensor function (DeepSeek-V4's ``apply_rotary_pos_emb(x, cos, sin)``) gets a whole head
``x: [B, H, S, N + R]`` (``[nope | rope]``) and rotates its trailing ``R`` channels, passing
the ``N`` before them through; with tables of one entry per pair (``cos, sin: [Bc, S, R / 2]``)
mlarope gets ``cat(cos, cos)``. That is the query op on the full head: the nope channels are
copied in the same launch. A call with ``-sin`` (DeepSeek-V4's inverse rotation of the attention
output) is the same function with another table, rotated by the table it is given.

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

from ._callables import call_signature

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
    # f(x, cos, sin, ...): one tensor x: [..., N + R], its trailing R channels rotated and the
    # N before them passed through (DeepSeek-V4's full head [nope | rope]).
    one_tensor: bool = False
    # The tables hold one entry per pair (cos: [Bc, S, R / 2], R = 2 * cos.shape[-1]), which
    # both members of the pair use; mlarope then gets cat(cos, cos).
    half_width_tables: bool = False

    @property
    def table_kind(self) -> str:
        """How the tables become mlarope's (:func:`_make_tables`)."""
        if self.complex_freqs:
            return "complex"
        if self.half_width_tables:
            return "half_width"
        return "first_half" if self.first_half_tables else "full"

    def rope_width(self, table_width: int) -> int:
        """The rotated width ``R`` for tables whose last dim is ``table_width``."""
        one_entry_a_pair = self.complex_freqs or self.half_width_tables
        return 2 * table_width if one_entry_a_pair else table_width

    def short(self) -> str:
        """``"interleaved -> half-split, first-half tables"``: the pair layouts and tables."""
        pairs = lambda interleaved: "interleaved" if interleaved else "half-split"
        text = f"{pairs(self.interleaved_in)} -> {pairs(self.interleaved_out)}"
        if self.complex_freqs:
            text += ", complex freqs"
        elif self.first_half_tables:
            text += ", first-half tables"
        elif self.half_width_tables:
            text += ", half-width tables"
        if self.result_dtype == "input":
            text += ", result x.dtype" if self.one_tensor else ", result q.dtype"
        if self.one_tensor:
            text += ", one tensor: its trailing rope channels"
        return text + (", k may be None" if self.k_optional else "")

    def describe(self) -> str:
        pairs = lambda interleaved: "interleaved" if interleaved else "half-split"
        if self.complex_freqs:
            tables = "complex freqs_cis as cat(re, re), cat(im, im)"
        elif self.first_half_tables:
            tables = "first half of cos/sin"
        elif self.half_width_tables:
            tables = "half-width cos/sin (one entry a pair) as cat(cos, cos), cat(sin, sin)"
        else:
            tables = "full cos/sin"
        dtype = "x.dtype" if self.result_dtype == "input" else "promote(x, cos)"
        extra = ", k may be None" if self.k_optional else ""
        if not self.mixed_dtypes:
            extra += ", q and k of one dtype"
        if self.one_tensor:
            width = "2 * cos.shape[-1]" if self.half_width_tables else "cos.shape[-1]"
            extra += (
                f", one tensor x = [nope | rope]: its trailing {width} channels rotated, the "
                f"others copied"
            )
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
    trailing: bool = False,
) -> bool:
    """mlarope can take these arguments (``trailing``: ``q`` may be wider than ``rope_dim``, its
    trailing ``rope_dim`` channels rotated)."""
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
    if rope_dim not in ROPE_DIMS:
        return False
    if any(x.shape[-1] < rope_dim if trailing else x.shape[-1] != rope_dim for x in xs):
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
    pair's angle, ``"half_width"`` ``(cos, sin): [..., R / 2]`` of one entry per pair (each
    becomes ``cat(t, t)``), ``"complex"`` DeepSeek-V2's ``(freqs_cis,)``."""
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
    if kind == "half_width":
        return tuple(torch.cat((t, t), dim=-1).reshape(rows, 2 * t.shape[-1]) for t in sources)
    return _flat_table(cos, rows), _flat_table(sin, rows)


class _Entry:
    """Tables made ready for mlarope (:func:`_make_tables`: new tensors, not views) and what
    they were made from: weak references to the source tensors and a key of their version
    counters, addresses and dtypes (an in-place write, or new data set through ``.data``,
    makes them anew; a write that bypasses the version counter, through ``.data`` in place or
    numpy, is not seen, as autograd does not see it either), the row count and the kind. When
    a source tensor is freed the tables are dropped with it (a single attribute store, safe
    from the thread that frees it), so a kept entry holds no memory past its model's forward."""

    __slots__ = ("__weakref__", "key", "sources", "tables")

    def __init__(self, sources: tuple, key: tuple, tables: tuple) -> None:
        release = weakref.WeakMethod(self._release)
        self.sources = tuple(weakref.ref(t, lambda _, r=release: _call(r)) for t in sources)
        self.key = key
        self.tables: tuple | None = tables

    def _release(self) -> None:
        self.tables = None

    def made_from(self, sources: tuple, key: tuple) -> bool:
        return (
            self.tables is not None
            and self.key == key
            and len(self.sources) == len(sources)
            and all(ref() is t for ref, t in zip(self.sources, sources, strict=True))
        )


def _call(method: weakref.WeakMethod) -> None:
    bound = method()
    if bound is not None:
        bound()


class _Prepared:
    """Prepared tables, reused while later calls pass the same table objects.

    Every layer of one model forward passes the same tables (the rotary embedding runs once per
    forward), so their conversions (two concatenations for first-half, half-width and complex
    tables) run once per forward, not once per layer. Two kinds of entries: the tables of the
    last call (``recent``), and up to :data:`_KEPT` whose tables came again (``kept``, the most
    recently used first). A model's own tables come again (``q`` then ``k``, layer after layer)
    and are kept; tables a call makes for itself come once and only pass through ``recent``
    (DeepSeek-V4's compressors and indexer rotate by tables of their own positions, its
    inverse rotation of the output by a fresh ``-sin``), so they never push out a model's
    tables (its "main" and "compress" sets, dots3_note's per layer type)."""

    __slots__ = ("kept", "recent")

    def __init__(self) -> None:
        self.recent: _Entry | None = None
        self.kept: list[_Entry] = []

    def get(self, sources: tuple, rows: int, kind: str) -> tuple:
        try:
            key = (*((t._version, t.data_ptr(), t.dtype) for t in sources), rows, kind)
        except RuntimeError:  # a source without memory (a batched tensor): nothing to key on
            return _make_tables(sources, rows, kind)
        self.kept = [entry for entry in self.kept if entry.tables is not None]
        for i, entry in enumerate(self.kept):
            if entry.made_from(sources, key):
                self.kept.insert(0, self.kept.pop(i))
                return entry.tables
        recent = self.recent
        if recent is not None and recent.made_from(sources, key):
            self.kept = [recent, *self.kept[: _KEPT - 1]]
            self.recent = None
            return recent.tables
        self.recent = _Entry(sources, key, _make_tables(sources, rows, kind))
        return self.recent.tables


# The model-wide table sets kept (a model has one, or one per rope type or layer type).
_KEPT = 4
_PREPARED = threading.local()


def _tables(sources: tuple, rows: int, kind: str) -> tuple:
    """A rotary function's tables (``[Bc, S, R]``, ``[Bc, S, R / 2]`` half-width or complex)
    -> the ``[Bc * S, R]`` tables mlarope rotates by."""
    if kind == "full":
        return _make_tables(sources, rows, kind)  # views: nothing to keep
    if (
        torch.compiler.is_compiling()
        or (sources[0].is_cuda and torch.cuda.is_current_stream_capturing())
        or torch.is_inference_mode_enabled()
        or any(t.is_inference() for t in sources)
    ):
        # Compiled, the graph makes them; inside a CUDA graph, the graph's own (a kept table
        # could be replaced, and freed, while the graph still reads it); inference tensors
        # have no version counter to tell an in-place write by, and tables made under
        # inference mode are inference tensors, which a later call with autograd cannot save.
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
    cos2, sin2 = _tables((cos, sin), batch_rows * seq, mapping.table_kind)
    return _both(mapping, q, k, heads_dim, cos2, sin2, batch_rows, cos.dtype)


def rotate_one(
    mapping: Mapping, x: object, cos: object, sin: object, heads_dim: int
) -> torch.Tensor | None:
    """A one-tensor ``f(x, cos, sin)`` through mlarope, or None if it cannot take these
    arguments: ``x: [B, H, S, N + R]`` (``[B, S, H, N + R]`` with ``heads_dim=2``), its trailing
    ``R`` channels rotated by ``cos, sin: [Bc, S, T]`` (``R = 2T`` with half-width tables), the
    ``N`` before them copied in the same launch; the result has ``x``'s shape."""
    table_width = cos.shape[-1] if isinstance(cos, torch.Tensor) and cos.dim() > 0 else 0
    rope_dim = mapping.rope_width(table_width)
    if not _usable(x, None, (cos, sin), rope_dim, complex_ok=False, trailing=True):
        return None
    if cos.shape != sin.shape or cos.dtype != sin.dtype:
        return None
    dims = _token_dims(x, None, cos, heads_dim)
    if dims is None:
        return None
    batch_rows, seq = dims
    cos2, sin2 = _tables((cos, sin), batch_rows * seq, mapping.table_kind)
    return _both(mapping, x, None, heads_dim, cos2, sin2, batch_rows, cos.dtype)[0]


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


def extra_args_reader(original: Callable, leading: int = 4) -> Callable[[tuple, dict], int | None]:
    """Read ``unsqueeze_dim`` from the arguments after the ``leading`` tensors (``(q, k, cos,
    sin)``, or ``(x, cos, sin)`` for a one-tensor function), by the original's signature
    (DeepSeek-V3-style functions put an ignored ``position_ids`` before it, others do not have
    it). Returns the heads dim of ``q`` (1 or 2), or None: hand over the call."""
    sig = call_signature(original)
    params = [] if sig is None else list(sig.parameters.values())[leading:]
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

    elif mapping.one_tensor:
        read_heads_dim = extra_args_reader(original, leading=3)

        def rope(x, cos, sin, *args, **kwargs):
            heads_dim = read_heads_dim(args, kwargs)
            out = None if heads_dim is None else rotate_one(mapping, x, cos, sin, heads_dim)
            return original(x, cos, sin, *args, **kwargs) if out is None else out

    else:
        read_heads_dim = extra_args_reader(original)

        def rope(q, k, cos, sin, *args, **kwargs):
            heads_dim = read_heads_dim(args, kwargs)
            out = None if heads_dim is None else rotate_cos_sin(mapping, q, k, cos, sin, heads_dim)
            return original(q, k, cos, sin, *args, **kwargs) if out is None else out

    # Not the module's __dict__ when transformers made the function an nn.Module (kernels'
    # hub layer): the replacement is a function, with the signature a call is bound by.
    functools.update_wrapper(rope, original, updated=())
    if isinstance(original, torch.nn.Module):
        rope.__name__ = rope.__qualname__ = name
    sig = call_signature(original)
    if sig is not None:
        rope.__signature__ = sig
    rope.__doc__ = (
        f"mlarope replacement of transformers' ``{name}`` ({mapping.describe()}; see "
        f"mlarope.integrations.transformers); falls back to the original for inputs mlarope "
        f"cannot take.\n\n{original.__doc__ or ''}"
    )
    return rope
