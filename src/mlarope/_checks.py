"""Host-side validation: every public entry point calls this module and nothing else checks.

Everything that can be checked without reading device data is checked on every call, with a
``ValueError``/``TypeError`` that names the argument, the value and what was expected. Checks
that need device data (values inside ``cu_seqlens`` and ``position_ids``) live in
:func:`check_positions_on_device`, run only when validation is asked for, since they sync.
"""

from __future__ import annotations

import torch
from torch.autograd import forward_ad as _fwad

from ._memory import refuse_overlap
from ._modes import autograd_refuses_in_place, env_validation
from ._records import KVCall, QueryCall
from .positions import Positions, token_positions

LAYOUTS = ("sbhd", "bshd", "thd")
ROPE_DIMS = (32, 64, 128)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)
# Far beyond any context-parallel group, and small enough that no position arithmetic of the
# kernels (``(t + 1) * cp_size``, ``2 * cp_size - 1 - cp_rank`` in 32 bits) can overflow.
MAX_CP_SIZE = 2**20


def _fail_type(name: str, value: object, expected: str) -> TypeError:
    return TypeError(f"{name} must be {expected}, got {value!r} ({type(value).__name__})")


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise _fail_type(name, value, "a bool")
    return value


def check_int(
    name: str, value: object, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    """An int (not a bool) in ``[minimum, maximum]`` (either bound optional)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail_type(name, value, "an int")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        if maximum is None:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")
        if minimum is None:
            raise ValueError(f"{name} must be <= {maximum}, got {value}")
        raise ValueError(f"{name} must be in [{minimum}, {maximum}], got {value}")
    return value


def check_tensor(name: str, value: object) -> torch.Tensor:
    """A dense (strided) ``torch.Tensor`` whose memory holds its values: the kernels read memory
    through strides, which sparse, nested and other layouts do not have, and a lazily negated
    view's memory holds its values un-negated."""
    if not isinstance(value, torch.Tensor):
        raise _fail_type(name, value, "a torch.Tensor")
    if value.layout is not torch.strided or value.is_nested:
        kind = "nested" if value.is_nested else str(value.layout).removeprefix("torch.")
        hint = "" if value.is_nested else f": pass {name}.to_dense()"
        raise TypeError(
            f"{name} is a {kind} tensor; mlarope supports dense (strided) tensors only{hint}"
        )
    refuse_negated_view(name, value)
    return value


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def check_float_tensor(name: str, t: object) -> torch.Tensor:
    t = check_tensor(name, t)
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be float32, float16, bfloat16 or float64, got dtype {t.dtype}"
        )
    return t


def refuse_negated_view(name: str, t: torch.Tensor) -> None:
    """A lazily negated view (``torch._neg_view``) holds the values un-negated in memory, which
    the kernels read (the reference would read, or write, the negated ones). Not checked while
    Dynamo traces (it cannot trace ``is_neg()``)."""
    if not torch.compiler.is_compiling() and t.is_neg():
        raise ValueError(
            f"{name} is a negated view (is_neg() is True: its memory holds -{name}); call "
            f"{name}.resolve_neg() first"
        )


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name} must have a contiguous last dim (stride(-1) == 1), got strides "
            f"{tuple(t.stride())} for shape {tuple(t.shape)}; call .contiguous() first"
        )


def check_layout(layout: object) -> str:
    if not isinstance(layout, str):
        raise _fail_type("layout", layout, "a str")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def check_tables(
    cos: object, sin: object, device: torch.device, rope: tuple[str, int, bool] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate ``cos, sin: [P, R]`` (singleton dims between allowed) -> two 2-D views.

    ``rope``: ``(name, R, pair_tables)`` where the rope width comes from an input (the serving
    ops' ``k_pe`` and ``q_pe``), not from the tables: they must be ``[P, R]``, or with
    ``pair_tables`` pair tables ``[P, R / 2]``, one entry per rotated pair (``c[j] = c[R / 2 +
    j]``, as the library's ``cat(freqs, freqs)`` tables have; vLLM's and FlashInfer's
    ``cos_sin_cache`` halves), which halves the table bytes a token reads. The form is asked
    for, never inferred, so that a table of the wrong width is refused, not read as the
    other form."""
    cos = check_float_tensor("cos", cos)
    sin = check_float_tensor("sin", sin)
    if cos.shape != sin.shape:
        raise ValueError(
            f"cos and sin must have the same shape, got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if cos.dtype != sin.dtype:
        raise TypeError(f"cos and sin must share a dtype, got {cos.dtype} and {sin.dtype}")
    if cos.dim() < 2 or any(s != 1 for s in cos.shape[1:-1]):
        raise ValueError(
            f"cos must be [P, R] (singleton dims between allowed, e.g. [P, 1, 1, R]), "
            f"got shape {tuple(cos.shape)}"
        )
    for name, t in (("cos", cos), ("sin", sin)):
        if t.device != device:
            raise ValueError(f"{name} must be on the input's device {device}, got {t.device}")
        check_last_dim_contiguous(name, t)
    rope_dim = cos.shape[-1]
    if rope is not None:
        name, width, pair = rope
        if pair and rope_dim != width // 2:
            raise ValueError(
                f"with pair_tables=True, cos.shape[-1] must be R / 2 = {width // 2} (pair tables "
                f"[P, R / 2], R = {name}.shape[-1] = {width}), got {rope_dim} (cos shape "
                f"{tuple(cos.shape)})"
            )
        if not pair and rope_dim != width:
            hint = (
                "; for pair tables [P, R / 2] (one entry per pair) pass pair_tables=True"
                if rope_dim == width // 2
                else ""
            )
            raise ValueError(
                f"cos.shape[-1] must be the rope dim R = {name}.shape[-1] = {width}, got "
                f"{rope_dim} (cos shape {tuple(cos.shape)}){hint}"
            )
    elif rope_dim not in ROPE_DIMS:
        raise ValueError(
            f"rope dim R = cos.shape[-1] must be one of {ROPE_DIMS}, got {rope_dim} "
            f"(cos shape {tuple(cos.shape)})"
        )
    if cos.shape[0] < 1:
        raise ValueError(f"cos must have at least one row (position), got shape {tuple(cos.shape)}")
    if cos.dim() == 2:
        return cos, sin
    return cos.reshape(cos.shape[0], rope_dim), sin.reshape(sin.shape[0], rope_dim)


def token_dims(layout: str) -> int:
    return 1 if layout == "thd" else 2


def check_activation(name: str, x: object, layout: str) -> torch.Tensor:
    """``x: [S, B, H, D]`` (sbhd), ``[B, S, H, D]`` (bshd) or ``[T, H, D]`` (thd)."""
    x = check_float_tensor(name, x)
    want = token_dims(layout) + 2
    if x.dim() != want:
        shape = (
            "[T, H, D]" if layout == "thd" else f"[{layout[0].upper()}, {layout[1].upper()}, H, D]"
        )
        hint = (
            " (the default layout; pass layout='thd' for [T, H, D] or layout='bshd' for "
            "[B, S, H, D])"
            if layout == "sbhd"
            else ""
        )
        raise ValueError(
            f"{name} must be {want}-D {shape} for layout={layout!r}{hint}, got shape "
            f"{tuple(x.shape)}"
        )
    check_last_dim_contiguous(name, x)
    return x


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether ``shape`` broadcasts to exactly ``target`` (cheaper than torch.broadcast_shapes,
    which matters on the decode path)."""
    if len(shape) > len(target):
        return False
    # ``s == 1 or s == t``, not ``s in (1, t)``: under Dynamo a static int is not ``in`` a
    # tuple holding an equal SymInt, which rejected valid position_ids when compiling.
    return all(s == 1 or s == t for s, t in zip(reversed(shape), reversed(target), strict=False))


def check_positions(
    x: torch.Tensor,
    table_rows: int,
    *,
    layout: str,
    cu_seqlens: object,
    position_ids: object,
    cp_rank: object,
    cp_size: object,
) -> Positions:
    """Check the position source against ``x``'s token dims and the table length."""
    cp_size = check_int("cp_size", cp_size, minimum=1, maximum=MAX_CP_SIZE)
    cp_rank = check_int("cp_rank", cp_rank, minimum=0)
    if cp_rank >= cp_size:
        raise ValueError(f"cp_rank must be in [0, cp_size={cp_size}), got {cp_rank}")
    tokens = tuple(x.shape[: token_dims(layout)])

    if cu_seqlens is not None:
        cu_seqlens = check_tensor("cu_seqlens", cu_seqlens)
        if layout != "thd":
            raise ValueError(f"cu_seqlens is only valid with layout='thd', got layout={layout!r}")
        if position_ids is not None:
            raise ValueError("give either cu_seqlens or position_ids, not both")
        if cu_seqlens.dtype not in INDEX_DTYPES:
            raise TypeError(f"cu_seqlens must be int32 or int64, got dtype {cu_seqlens.dtype}")
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
            raise ValueError(
                f"cu_seqlens must be 1-D [n + 1] with n >= 0, got shape {tuple(cu_seqlens.shape)}"
            )
        if cu_seqlens.device != x.device:
            raise ValueError(
                f"cu_seqlens must be on the input's device {x.device}, got {cu_seqlens.device}"
            )
        if cu_seqlens.stride(0) != 1 and cu_seqlens.shape[0] > 1:
            cu_seqlens = cu_seqlens.contiguous()

    if position_ids is not None:
        position_ids = check_tensor("position_ids", position_ids)
        if position_ids.dtype not in INDEX_DTYPES:
            raise TypeError(f"position_ids must be int32 or int64, got dtype {position_ids.dtype}")
        if position_ids.device != x.device:
            raise ValueError(
                f"position_ids must be on the input's device {x.device}, got {position_ids.device}"
            )
        if cp_size != 1:
            raise ValueError(
                f"position_ids are global positions already; they cannot be combined with "
                f"cp_size={cp_size} (pass cp_size=1)"
            )
        if not _broadcasts_to(tuple(position_ids.shape), tokens):
            raise ValueError(
                f"position_ids must match the token dims {tokens} of layout={layout!r} "
                f"(or broadcast to them), got shape {tuple(position_ids.shape)}"
            )
        if tuple(position_ids.shape) != tokens:
            position_ids = position_ids.expand(tokens)

    if cu_seqlens is None and position_ids is None:
        seq_len = tokens[1] if layout == "bshd" else tokens[0]
        if cp_size > 1 and seq_len % 2 != 0:
            raise ValueError(
                f"with cp_size={cp_size} each rank holds two equal chunks of the sequence, so the "
                f"local sequence length must be even, got {seq_len}"
            )
        if seq_len * cp_size > table_rows:
            raise ValueError(
                f"the table has {table_rows} positions (cos.shape[0]) but the sequence needs "
                f"{seq_len * cp_size} (local length {seq_len} x cp_size {cp_size})"
            )
    return Positions(layout, cu_seqlens, position_ids, cp_rank, cp_size)


def check_inplace_target(
    name: str, x: torch.Tensor, reads: tuple[tuple[str, torch.Tensor | None], ...] = ()
) -> None:
    """An in-place target must not have elements that share memory (a broadcast, stride-0
    dim, or rows that overlap): two programs would rotate the same element, which is wrong
    and, on a GPU, a race. Nor overlap a tensor the call reads (``reads``: name, tensor), which
    programs would read after others wrote it (``_memory.refuse_overlap``; while
    ``torch.compile`` traces, only the stride-0 test: addresses are not traceable, and the
    in-place op checks the rest when it runs). Nor be an inference tensor outside inference
    mode, which PyTorch forbids writing to (the kernels write through a raw pointer, so
    PyTorch's own check never runs: raise first)."""
    if torch.compiler.is_compiling():
        for size, stride in zip(x.shape, x.stride(), strict=True):
            if size > 1 and stride == 0:
                raise ValueError(
                    f"{name} has elements that share memory (shape {tuple(x.shape)}, strides "
                    f"{tuple(x.stride())}: a broadcast dim), so it cannot be rotated in place; "
                    f"pass inplace=False or {name}.contiguous()"
                )
        return
    if x.is_inference() and not torch.is_inference_mode_enabled():
        raise ValueError(
            f"{name} is an inference tensor (made under torch.inference_mode()), which cannot "
            f"be modified in place outside inference mode (PyTorch's rule); pass inplace=False, "
            f"call inside torch.inference_mode(), or pass {name}.clone()"
        )
    refuse_in_place_leaf(name, x)
    refuse_overlap(name, x, reads)


def refuse_in_place_leaf(name: str, x: torch.Tensor) -> None:
    """autograd's own error comes from ``mark_dirty``, after the kernel wrote: raise first (the
    public call asks before it looks for a launch plan, whose guard does not tell a leaf)."""
    if autograd_refuses_in_place(x):
        raise RuntimeError(
            f"{name} is a leaf Variable that requires grad, or a view of one, which autograd "
            f"forbids modifying in place (nothing was written); pass inplace=False or "
            f"{name}.clone()"
        )


def check_tables_constant(cos: torch.Tensor, sin: torch.Tensor) -> None:
    """mlarope does not differentiate the tables: a table that requires grad (with grad mode on)
    or carries a forward-mode tangent is rejected, on every backend, rather than get no
    gradient without a word."""
    for name, t in (("cos", cos), ("sin", sin)):
        if t.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                f"{name} requires grad; mlarope does not differentiate the tables (no gradient "
                f"flows to cos or sin): pass {name}.detach()"
            )
        if _fwad._current_level >= 0 and _fwad.unpack_dual(t).tangent is not None:
            raise ValueError(
                f"{name} carries a forward-mode tangent; mlarope does not differentiate the "
                f"tables: pass its primal (forward_ad.unpack_dual({name}).primal)"
            )


def validation_requested(validate: object) -> bool:
    check_bool("validate", validate)
    return validate or env_validation()


def check_positions_on_device(positions: Positions, n_tokens: int, table_rows: int) -> None:
    """The checks that read device data (one sync): positions in range, cu_seqlens well formed.
    While a graph is traced (``torch.compile``) they are an op of the graph, which reads the
    data and raises when the graph runs (a traced branch on device data broke a fullgraph)."""
    if torch.compiler.is_compiling():
        if positions.cu_seqlens is not None or positions.position_ids is not None:
            check_positions_op(
                positions.cu_seqlens, positions.position_ids, positions.layout,
                positions.cp_rank, positions.cp_size, n_tokens, table_rows,
            )  # fmt: skip
        return
    cu = positions.cu_seqlens
    cp = positions.cp_size
    if cu is not None:
        cu_host = cu.detach().cpu().tolist()
        if cu_host[0] != 0:
            raise ValueError(f"cu_seqlens[0] must be 0, got {cu_host[0]}")
        for i in range(1, len(cu_host)):
            if cu_host[i] < cu_host[i - 1]:
                raise ValueError(
                    f"cu_seqlens must be non-decreasing, got cu_seqlens[{i}] = {cu_host[i]} < "
                    f"cu_seqlens[{i - 1}] = {cu_host[i - 1]}"
                )
            length = cu_host[i] - cu_host[i - 1]
            if length % (2 * cp) != 0 and cp > 1:
                raise ValueError(
                    f"with cp_size={cp} every sequence length in cu_seqlens must be a multiple of "
                    f"2*cp_size={2 * cp}, got sequence {i - 1} of length {length}"
                )
            if length > table_rows:
                raise ValueError(
                    f"cu_seqlens: sequence {i - 1} has length {length} > the {table_rows} table "
                    f"positions (cos.shape[0])"
                )
        if cu_host[-1] // cp > n_tokens:
            raise ValueError(
                f"cu_seqlens[-1] = {cu_host[-1]} (local {cu_host[-1] // cp} with cp_size={cp}) is "
                f"more than the {n_tokens} tokens of the input"
            )
    if positions.position_ids is not None:
        pos, _ = token_positions(
            positions, positions.position_ids.shape, positions.position_ids.device
        )
        bad = (pos < 0) | (pos >= table_rows)
        if bool(bad.any()):
            index = tuple(int(i) for i in bad.nonzero()[0].tolist())
            raise ValueError(
                f"position_ids{list(index)} = {int(pos[index])} is outside the table "
                f"[0, {table_rows}) (cos.shape[0] = {table_rows})"
            )


def check_kv_inputs(
    kv: object, k_pe: object, k_dim: object, layout: str
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``kv: [..., H, K + V]``, ``k_pe: [..., 1, R]`` or ``[..., R]`` -> (kv, k_pe [..., R], K)."""
    kv = check_activation("kv", kv, layout)
    k_pe = check_float_tensor("k_pe", k_pe)
    k_dim = check_int("k_dim", k_dim, minimum=1)
    if k_dim >= kv.shape[-1]:
        raise ValueError(
            f"k_dim must be less than kv.shape[-1] = {kv.shape[-1]} (kv holds K + V channels, "
            f"V >= 1), got k_dim={k_dim}"
        )
    if k_pe.dtype != kv.dtype:
        raise TypeError(f"k_pe and kv must share a dtype, got {k_pe.dtype} and {kv.dtype}")
    if k_pe.device != kv.device:
        raise ValueError(f"k_pe must be on kv's device {kv.device}, got {k_pe.device}")
    tokens = tuple(kv.shape[:-2])
    if k_pe.dim() == len(tokens) + 2:
        if k_pe.shape[-2] != 1:
            raise ValueError(
                f"k_pe must be [..., 1, R] or [..., R] (shared by all heads), got shape "
                f"{tuple(k_pe.shape)}"
            )
        k_pe = k_pe.squeeze(-2)
    if k_pe.dim() != len(tokens) + 1 or tuple(k_pe.shape[:-1]) != tokens:
        raise ValueError(
            f"k_pe must have kv's token dims {tokens} then [1, R] or [R], got shape "
            f"{tuple(k_pe.shape)} (kv shape {tuple(kv.shape)})"
        )
    check_last_dim_contiguous("k_pe", k_pe)
    return kv, k_pe, k_dim


def check_rope_width(name: str, channels: int, rope_dim: int) -> int:
    """``N = channels - R`` must be >= 0 (the rope channels are the tail)."""
    if channels < rope_dim:
        raise ValueError(
            f"{name}.shape[-1] = {channels} is smaller than the rope dim R = {rope_dim} "
            f"(cos.shape[-1]); {name} must be [..., H, N + R]"
        )
    return channels - rope_dim


def check_same_rope_dim(name: str, t: torch.Tensor, rope_dim: int) -> None:
    if t.shape[-1] != rope_dim:
        raise ValueError(
            f"{name}.shape[-1] must equal the rope dim R = cos.shape[-1] = {rope_dim}, got "
            f"{t.shape[-1]} ({_describe(t)})"
        )


def check_q_call(
    q: object,
    cos: object,
    sin: object,
    layout: object,
    cu_seqlens: object,
    position_ids: object,
    cp_rank: object,
    cp_size: object,
    interleaved: object,
    interleaved_out: object,
    inverse: object,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Positions]:
    """All host-side checks of a query-op call -> (q, cos [P, R], sin [P, R], positions)."""
    layout = check_layout(layout)
    q = check_activation("q", q, layout)
    cos2d, sin2d = check_tables(cos, sin, q.device)
    check_tables_constant(cos, sin)
    check_rope_width("q", q.shape[-1], cos2d.shape[-1])
    for name, flag in (
        ("interleaved", interleaved),
        ("interleaved_out", interleaved_out),
        ("inverse", inverse),
    ):
        check_bool(name, flag)
    positions = check_positions(
        q, cos2d.shape[0], layout=layout, cu_seqlens=cu_seqlens, position_ids=position_ids,
        cp_rank=cp_rank, cp_size=cp_size,
    )  # fmt: skip
    return q, cos2d, sin2d, positions


def check_pair_key(k: object, q: torch.Tensor, layout: str, rope_dim: int) -> torch.Tensor:
    """``k`` of ``apply_rope_qk``: a query-op input of ``q``'s tokens, device and rope width."""
    k = check_activation("k", k, layout)
    check_rope_width("k", k.shape[-1], rope_dim)
    dims = token_dims(layout)
    if k.shape[:dims] != q.shape[:dims]:
        raise ValueError(
            f"k must have q's token dims {tuple(q.shape[:dims])} (layout={layout!r}), got shape "
            f"{tuple(k.shape)} (q shape {tuple(q.shape)})"
        )
    if k.device != q.device:
        raise ValueError(f"k must be on q's device {q.device}, got {k.device}")
    return k


def check_kv_call(
    kv: object,
    k_pe: object,
    cos: object,
    sin: object,
    k_dim: object,
    layout: object,
    cu_seqlens: object,
    position_ids: object,
    cp_rank: object,
    cp_size: object,
    interleaved: object,
    interleaved_out: object,
) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor, Positions]:
    """All host-side checks of a key/value-op call -> (kv, k_pe [..., R], K, cos, sin, pos)."""
    layout = check_layout(layout)
    kv, k_pe, k_dim = check_kv_inputs(kv, k_pe, k_dim, layout)
    cos2d, sin2d = check_tables(cos, sin, kv.device)
    check_tables_constant(cos, sin)
    check_same_rope_dim("k_pe", k_pe, cos2d.shape[-1])
    check_bool("interleaved", interleaved)
    check_bool("interleaved_out", interleaved_out)
    positions = check_positions(
        kv, cos2d.shape[0], layout=layout, cu_seqlens=cu_seqlens, position_ids=position_ids,
        cp_rank=cp_rank, cp_size=cp_size,
    )  # fmt: skip
    return kv, k_pe, k_dim, cos2d, sin2d, positions


def _check_positions_impl(
    cu_seqlens: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    layout: str,
    cp_rank: int,
    cp_size: int,
    n_tokens: int,
    table_rows: int,
) -> None:
    positions = Positions(layout, cu_seqlens, position_ids, cp_rank, cp_size)
    check_positions_on_device(positions, n_tokens, table_rows)


# An op that returns nothing, so registered as having a side effect (dead-code elimination
# would drop it otherwise).
check_positions_op = torch.library.custom_op(
    "mlarope::check_positions", _check_positions_impl, mutates_args=()
)


@check_positions_op.register_fake
def _check_positions_fake(*args) -> None:
    return None


(getattr(torch.fx.node, "has_side_effect", None) or torch.fx.node._side_effectful_functions.add)(
    torch.ops.mlarope.check_positions.default
)


# ---------------------------------------------------------------- one call each: the records
def check_query_call(
    q: object, cos: object, sin: object, layout: object, cu_seqlens: object,
    position_ids: object, cp_rank: object, cp_size: object, interleaved: object,
    interleaved_out: object, inverse: object, inplace: object, inplace_backward: object,
    validate: object,
) -> tuple[torch.Tensor, QueryCall]:  # fmt: skip
    """Every check of an ``apply_rope_q`` call -> ``(q, its record)``: the arguments, the
    in-place rule, and with validation the device data."""
    q, cos2d, sin2d, positions = check_q_call(
        q, cos, sin, layout, cu_seqlens, position_ids, cp_rank, cp_size, interleaved,
        interleaved_out, inverse,
    )  # fmt: skip
    if check_bool("inplace", inplace):
        reads = (
            ("cos", cos2d), ("sin", sin2d), ("position_ids", positions.position_ids),
            ("cu_seqlens", positions.cu_seqlens),
        )  # fmt: skip
        check_inplace_target("q", q, reads)
    check_bool("inplace_backward", inplace_backward)
    if validation_requested(validate):
        check_positions_on_device(positions, _n_tokens(q), cos2d.shape[0])
    return q, QueryCall(
        cos2d, sin2d, positions.cu_seqlens, positions.position_ids, None, positions.layout,
        positions.cp_rank, positions.cp_size, interleaved, interleaved_out, inverse, False,
    )  # fmt: skip


def check_key_value_call(
    kv: object, k_pe: object, cos: object, sin: object, k_dim: object, layout: object,
    cu_seqlens: object, position_ids: object, cp_rank: object, cp_size: object,
    interleaved: object, interleaved_out: object, copy_v: object, validate: object,
    megatron_rounding: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, KVCall]:  # fmt: skip
    """Every check of an ``apply_rope_kv`` call -> ``(kv, k_pe [..., R], its record)``
    (``megatron_rounding``: ``mlarope.compat.megatron``'s call)."""
    kv, k_pe, k_dim, cos2d, sin2d, positions = check_kv_call(
        kv, k_pe, cos, sin, k_dim, layout, cu_seqlens, position_ids, cp_rank, cp_size,
        interleaved, interleaved_out,
    )  # fmt: skip
    check_bool("copy_v", copy_v)
    if validation_requested(validate):
        check_positions_on_device(positions, _n_tokens(kv), cos2d.shape[0])
    return kv, k_pe, KVCall(
        cos2d, sin2d, positions.cu_seqlens, positions.position_ids, None, positions.layout,
        positions.cp_rank, positions.cp_size, k_dim, interleaved, interleaved_out, copy_v,
        megatron_rounding,
    )  # fmt: skip


def check_pair_call(
    q: object, k: object, cos: object, sin: object, layout: object, cu_seqlens: object,
    position_ids: object, cp_rank: object, cp_size: object, interleaved: object,
    interleaved_out: object, inverse: object, validate: object,
) -> tuple[torch.Tensor, torch.Tensor, QueryCall]:  # fmt: skip
    """Every check of an ``apply_rope_qk`` call -> ``(q, k, their one record)``."""
    q, cos2d, sin2d, positions = check_q_call(
        q, cos, sin, layout, cu_seqlens, position_ids, cp_rank, cp_size, interleaved,
        interleaved_out, inverse,
    )  # fmt: skip
    k = check_pair_key(k, q, positions.layout, cos2d.shape[-1])
    if validation_requested(validate):
        check_positions_on_device(positions, _n_tokens(q), cos2d.shape[0])
    return q, k, QueryCall(
        cos2d, sin2d, positions.cu_seqlens, positions.position_ids, None, positions.layout,
        positions.cp_rank, positions.cp_size, interleaved, interleaved_out, inverse, False,
    )  # fmt: skip


def _n_tokens(x: torch.Tensor) -> int:
    return x.shape[0] if x.dim() == 3 else x.shape[0] * x.shape[1]
