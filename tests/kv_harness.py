"""The key/value op's test harness: cases, inputs, launches into NaN-poisoned outputs, and the
fp64 truth with the error model's per-element tolerances. ``tests/test_kv_*.py`` and
``tests/test_autograd.py`` build on it.

Shapes (``tokens...`` is ``[S, B]`` for sbhd, ``[B, S]`` for bshd, ``[T]`` for thd):

- inputs ``kv: [tokens..., H, K + V]`` and ``k_pe: [tokens..., 1, R]`` or ``[tokens..., R]``
  as the user passes it (``[tokens..., R]`` after the host checks);
- forward outputs ``k: [tokens..., H, K + R]`` and ``v: [tokens..., H, V]``;
- upstream gradients ``dk``, ``dv`` shaped like ``k``, ``v``; backward outputs ``dkv`` shaped
  like ``kv`` and ``dk_pe: [tokens..., R]``.

The launchers are called directly with NaN-poisoned outputs, so an element the kernels never
write fails. What the checks compare, element by element (the error model: docs/design.md,
``tests/errmodel.py``):

- forward ``k[..., :K]`` and ``v``: exact copies of ``kv``;
- forward ``k[..., K:]``: the rotated ``k_pe``, within the rotation tolerance, the same bits in
  every head;
- backward ``dkv``: an exact copy of ``dk[..., :K]`` and ``dv``;
- backward ``dk_pe``: within the head-sum tolerance derived at :func:`dk_pe_tolerance`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlarope import _checks, reference
from mlarope.kernels.kv import rope_kv_backward_launch, rope_kv_launch
from tests.errmodel import assert_close_elementwise, join_pairs, poisoned_like, rope_tolerance
from tests.harness import bitwise_equal, random_tables

# ---------------------------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One key/value call: shapes, dtypes, layouts, position source and memory layout."""

    layout: str = "thd"
    tokens: tuple[int, ...] = (6,)
    heads: int = 3
    k_dim: int = 48
    v_dim: int = 40
    rope: int = 64
    dtype: torch.dtype = torch.bfloat16
    table_dtype: torch.dtype = torch.float32
    interleaved: bool = True
    interleaved_out: bool = False
    copy_v: bool = True
    pe_form: str = "1R"  # "1R": k_pe [..., 1, R]; "R": k_pe [..., R]
    source: str = "seq"  # seq (index along S) | cu (cu_seqlens) | ids (position_ids)
    cu: tuple[int, ...] = ()
    ids_shape: tuple[int, ...] | None = None  # position_ids shape (broadcast); None: tokens
    cp_size: int = 1
    cp_rank: int = 0
    view: str = "contiguous"  # contiguous | fused (misaligned slices) | strided (+ token strides)
    table_rows: int = 48


def case_id(case: Case) -> str:
    """A short test id: only the fields that differ from the default case."""
    default = Case()
    parts = []
    for name in Case.__dataclass_fields__:
        value = getattr(case, name)
        if value != getattr(default, name):
            if isinstance(value, torch.dtype):
                value = str(value).removeprefix("torch.")
            elif isinstance(value, tuple):
                value = "x".join(map(str, value)) or "none"
            parts.append(f"{name}={value}")
    return ",".join(parts) or "default"


# thd with cu_seqlens: an empty first sequence, 5 tokens, a one-token sequence, another empty
# one, 7 tokens, then 3 padding tokens (the tensor has 16 tokens, cu_seqlens[-1] = 13).
CU_EDGES = (0, 0, 5, 6, 6, 13)

# ---------------------------------------------------------------------------------------------
# inputs and upstream gradients
# ---------------------------------------------------------------------------------------------


def random_activation(
    tokens: tuple[int, ...], inner: tuple[int, ...], dtype, device, view: str, offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``randn(*tokens, *inner)`` in ``dtype``, laid out as asked -> (tensor, owning buffer).

    ``contiguous``: a plain tensor (its own owner); ``fused``: a slice
    ``big[..., offset : offset + inner[-1]]`` of a wider fused projection (last dim contiguous,
    token and head dims strided, misaligned by ``offset`` elements); ``strided``: the same, with
    the token dims transposed in memory (two token dims) or every other token (thd).
    """
    if view == "contiguous":
        t = torch.randn(*tokens, *inner).to(dtype).to(device)
        return t, t
    extra = 7 + offset
    wide = (*inner[:-1], inner[-1] + extra)
    if view == "fused":
        big = torch.randn(*tokens, *wide).to(dtype).to(device)
        owner = big
    elif len(tokens) == 2:
        owner = torch.randn(tokens[1], tokens[0], *wide).to(dtype).to(device)
        big = owner.transpose(0, 1)
    else:
        owner = torch.randn(2 * tokens[0], *wide).to(dtype).to(device)
        big = owner[::2]
    t = big[..., offset : offset + inner[-1]]
    assert t.stride(-1) == 1 and not t.is_contiguous()
    return t, owner


@dataclass
class Inputs:
    """A case's arguments to ``apply_rope_kv``, and every buffer behind them."""

    kv: torch.Tensor  # [tokens..., H, K + V]
    k_pe: torch.Tensor  # [tokens..., 1, R] or [tokens..., R], as the user passes it
    cos: torch.Tensor  # [P, R]
    sin: torch.Tensor  # [P, R]
    kwargs: dict  # layout and position source, as apply_rope_kv takes them
    owners: list  # every buffer the op must leave untouched


def make_inputs(case: Case, device) -> Inputs:
    """Random ``kv``, ``k_pe`` (laid out as ``case.view`` says), general tables and the case's
    position source (``position_ids`` random in ``[0, table_rows)``)."""
    kv, kv_owner = random_activation(
        case.tokens, (case.heads, case.k_dim + case.v_dim), case.dtype, device, case.view, 3
    )
    pe_inner = (1, case.rope) if case.pe_form == "1R" else (case.rope,)
    k_pe, pe_owner = random_activation(case.tokens, pe_inner, case.dtype, device, case.view, 37)
    cos, sin = random_tables(case.table_rows, case.rope, case.table_dtype, device)
    kwargs = dict(layout=case.layout, cp_rank=case.cp_rank, cp_size=case.cp_size)
    owners = [kv_owner, pe_owner, cos, sin]
    if case.source == "cu":
        kwargs["cu_seqlens"] = torch.tensor(case.cu, dtype=torch.int32, device=device)
    elif case.source == "ids":
        shape = case.ids_shape or case.tokens
        kwargs["position_ids"] = torch.randint(0, case.table_rows, shape).to(device)
    owners += [t for t in kwargs.values() if isinstance(t, torch.Tensor)]
    return Inputs(kv, k_pe, cos, sin, kwargs, owners)


def host_checked(inp: Inputs, case: Case):
    """The public API's host checks -> what the launchers take: ``(kv [tokens..., H, K + V],
    k_pe [tokens..., R], cos2d [P, R], sin2d [P, R], positions)``."""
    kv, k_pe, _, cos2d, sin2d, positions = _checks.check_kv_call(
        inp.kv,
        inp.k_pe,
        inp.cos,
        inp.sin,
        case.k_dim,
        case.layout,
        inp.kwargs.get("cu_seqlens"),
        inp.kwargs.get("position_ids"),
        case.cp_rank,
        case.cp_size,
        case.interleaved,
        case.interleaved_out,
    )
    return kv, k_pe, cos2d, sin2d, positions


def make_upstream_grads(kv: torch.Tensor, case: Case):
    """Upstream gradients ``dk: [tokens..., H, K + R]``, ``dv: [tokens..., H, V]``, laid out
    like the case's inputs (strided views for the view cases) -> (dk, dv, owners)."""
    tokens = tuple(kv.shape[:-2])
    dk, dk_owner = random_activation(
        tokens, (case.heads, case.k_dim + case.rope), kv.dtype, kv.device, case.view, 2
    )
    dv, dv_owner = random_activation(
        tokens, (case.heads, case.v_dim), kv.dtype, kv.device, case.view, 1
    )
    return dk, dv, [dk_owner, dv_owner]


def snapshot(tensors) -> list[torch.Tensor]:
    """Clones, to compare with :func:`assert_untouched` after a call."""
    return [t.clone() for t in tensors]


def assert_untouched(before: list, after: list, what: str) -> None:
    """Every buffer in ``after`` has the bits of its :func:`snapshot` in ``before``."""
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        assert bitwise_equal(b, a), f"{what}: input buffer {i} was modified"


# ---------------------------------------------------------------------------------------------
# launches into poisoned (and, for strided views, guarded) outputs
# ---------------------------------------------------------------------------------------------

GUARD = 5  # NaN channels on either side of a guarded output's rows


def guarded_rows(shape: tuple[int, ...], dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN-poisoned strided view ``shape`` with ``GUARD`` NaN channels before and after every
    row -> (view, buffer ``[*shape[:-1], shape[-1] + 2 GUARD]``)."""
    buf = torch.full((*shape[:-1], shape[-1] + 2 * GUARD), float("nan"), dtype=dtype, device=device)
    return buf[..., GUARD : GUARD + shape[-1]], buf


def guarded_flat(shape: tuple[int, ...], dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A contiguous NaN-poisoned tensor ``shape`` with ``GUARD`` NaN elements before and after
    it -> (tensor, flat buffer)."""
    n = 1
    for s in shape:
        n *= s
    buf = torch.full((n + 2 * GUARD,), float("nan"), dtype=dtype, device=device)
    return buf[GUARD : GUARD + n].view(shape), buf


def assert_guards_nan(buf: torch.Tensor, flat: bool, what: str) -> None:
    """The guard elements of a :func:`guarded_flat` (``flat``) or :func:`guarded_rows` buffer
    are all still NaN."""
    guards = (
        torch.cat((buf[:GUARD], buf[-GUARD:]))
        if flat
        else torch.cat((buf[..., :GUARD], buf[..., -GUARD:]), dim=-1)
    )
    assert bool(guards.isnan().all()), f"{what}: the kernel wrote outside its output"


def launch_flags(case: Case) -> dict:
    """The case's ``k_dim`` and rope layouts, as both launchers take them. (The fp64 reference
    calls spell them out on their own, so that a mistake here cannot hide in both sides.)"""
    return dict(
        k_dim=case.k_dim, interleaved_in=case.interleaved, interleaved_out=case.interleaved_out
    )


def launch_forward(kv, k_pe, cos2d, sin2d, positions, case: Case, config=None, guard=False):
    """``rope_kv_launch`` into NaN-poisoned ``k: [tokens..., H, K + R]`` and
    ``v: [tokens..., H, V]`` (``v`` only with ``copy_v``, else None) -> (k, v). With ``guard``,
    into :func:`guarded_rows` views whose guards must stay NaN."""
    k_shape = (*kv.shape[:-1], case.k_dim + case.rope)
    v_shape = (*kv.shape[:-1], case.v_dim)
    if guard:
        (k, k_buf), (v, v_buf) = (
            guarded_rows(k_shape, kv.dtype, kv.device),
            guarded_rows(v_shape, kv.dtype, kv.device),
        )
    else:
        k, v = poisoned_like(kv, k_shape), poisoned_like(kv, v_shape)
    v_out = v if case.copy_v else None
    rope_kv_launch(kv, k_pe, k, v_out, cos2d, sin2d, positions, **launch_flags(case), config=config)
    if guard:
        assert_guards_nan(k_buf, False, "forward k")
        assert_guards_nan(v_buf, False, "forward v")
    return k, v_out


def launch_backward(dk, dv, cos2d, sin2d, positions, case: Case, config=None, guard=False):
    """``rope_kv_backward_launch`` into NaN-poisoned ``dkv: [tokens..., H, K + V]`` and
    (contiguous) ``dk_pe: [tokens..., R]`` -> (dkv, dk_pe). With ``guard``, into a
    :func:`guarded_rows` ``dkv`` and a :func:`guarded_flat` ``dk_pe``."""
    dkv_shape = (*dk.shape[:-1], case.k_dim + case.v_dim)
    pe_shape = (*dk.shape[:-2], case.rope)
    if guard:
        dkv, dkv_buf = guarded_rows(dkv_shape, dk.dtype, dk.device)
        dk_pe, pe_buf = guarded_flat(pe_shape, dk.dtype, dk.device)
    else:
        dkv, dk_pe = poisoned_like(dk, dkv_shape), poisoned_like(dk, pe_shape)
    rope_kv_backward_launch(
        dk, dv, dkv, dk_pe, cos2d, sin2d, positions, **launch_flags(case), config=config
    )
    if guard:
        assert_guards_nan(dkv_buf, False, "backward dkv")
        assert_guards_nan(pe_buf, True, "backward dk_pe")
    return dkv, dk_pe


# ---------------------------------------------------------------------------------------------
# the fp64 reference and the error model
# ---------------------------------------------------------------------------------------------


def forward_truth(kv, k_pe, cos2d, sin2d, positions, case: Case):
    """fp64 ``k_rope: [tokens..., 1, R]`` (the same for every head) and its per-element
    tolerance, the same shape."""
    cos64, sin64 = cos2d.double(), sin2d.double()
    k_ref, _ = reference.rope_kv(
        kv.double(),
        k_pe.double(),
        cos64,
        sin64,
        positions,
        k_dim=case.k_dim,
        interleaved_in=case.interleaved,
        interleaved_out=case.interleaved_out,
    )
    truth = k_ref[..., :1, case.k_dim :]
    # One rotation of exact inputs with exact (upcast) table entries, rounded once to the dtype.
    tol = rope_tolerance(
        k_pe.double().unsqueeze(-2),
        cos64,
        sin64,
        positions,
        truth,
        kv.dtype,
        interleaved_in=case.interleaved,
        interleaved_out=case.interleaved_out,
    )
    return truth, tol


def dk_pe_tolerance(dk, cos2d, sin2d, positions, truth, case: Case) -> torch.Tensor:
    """Per-element tolerance of ``dk_pe: [tokens..., R]``, from the error model.

    The kernel forms ``G = ((g_0 + g_1) + g_2) + ... + g_{H-1}`` in fp32 (the g_h are exact:
    bf16/fp16/fp32 upcast), then rotates ``G`` by the transpose (``d_a = G_a*c_a + G_b*s_b``,
    ``d_b = G_b*c_b - G_a*s_a``) in fp32 and rounds once to the dtype. Let ``u = 2**-24``.

    1. Recursive summation: ``|G_hat - G| <= (H - 1) * u * sum_h |g_h|`` (each of the ``H - 1``
       additions errs by at most ``u`` times a partial sum, and every partial sum is bounded by
       ``sum_h |g_h|``; the second-order ``O(H^2 u^2)`` term is far below the slack in 3).
    2. That error goes through the rotation: ``|c*dG_a + s*dG_b| <= (|dG_a| + |dG_b|) * m``,
       ``m = max(|c_a|, |c_b|, |s_a|, |s_b|)``, i.e. at most
       ``(H - 1) * u * (sum|g_a| + sum|g_b|) * m``.
    3. The fp32 rotation of ``G_hat`` itself: two products and one add, ``<= 3u * (|G_a c| +
       |G_b s|) <= 3u * (sum|g_a| + sum|g_b|) * m`` (the errmodel's rotation term, with the
       sums of absolute values standing in for ``|G|``).
    4. One rounding to the output dtype: 1 ulp at ``|truth| + arith`` (half an ulp when
       correctly rounded; the interpreter truncates, within one).

    Total: ``(3 + H - 1) * u * (sum|g_a| + sum|g_b|) * m + ulp``, which is
    ``rope_tolerance`` fed ``sum_h |g_h|`` with ``summed_terms = H``. The pairs are read in
    ``k``'s rope layout (``interleaved_out``) and written in ``k_pe``'s (``interleaved``).
    """
    abs_sum = dk[..., case.k_dim :].double().abs().sum(dim=-2, keepdim=True)  # [tokens, 1, R]
    return rope_tolerance(
        abs_sum,
        cos2d.double(),
        sin2d.double(),
        positions,
        truth.unsqueeze(-2),
        dk.dtype,
        interleaved_in=case.interleaved_out,
        interleaved_out=case.interleaved,
        summed_terms=dk.shape[-2],
    ).squeeze(-2)


def check_forward(kv, k_pe, k, v, cos2d, sin2d, positions, case: Case) -> None:
    """``k[..., :K]`` and ``v`` (unless None) are ``kv`` bit for bit; ``k[..., K:]`` is within
    the error model of the fp64 rotation of ``k_pe`` and the same bits in every head."""
    what = f"forward {case_id(case)}"
    assert k.shape == (*kv.shape[:-1], case.k_dim + case.rope), what
    assert bitwise_equal(k[..., : case.k_dim], kv[..., : case.k_dim]), f"{what}: k[..., :K]"
    if v is not None:
        assert bitwise_equal(v, kv[..., case.k_dim :]), f"{what}: v"
    truth, tol = forward_truth(kv, k_pe, cos2d, sin2d, positions, case)
    k_rope = k[..., case.k_dim :]
    assert_close_elementwise(k_rope, truth.expand_as(k_rope), tol.expand_as(k_rope), what)
    # Every head carries the same rounded rotation (one rounding, shared).
    assert bitwise_equal(k_rope, k_rope[..., :1, :].expand_as(k_rope)), f"{what}: heads differ"


def check_backward(dk, dv, dkv, dk_pe, cos2d, sin2d, positions, case: Case) -> None:
    """``dkv`` is ``[dk[..., :K], dv]`` bit for bit; ``dk_pe`` is within
    :func:`dk_pe_tolerance` of the fp64 reference."""
    what = f"backward {case_id(case)}"
    expected_dkv = torch.cat((dk[..., : case.k_dim], dv), dim=-1)
    assert bitwise_equal(dkv, expected_dkv), f"{what}: dkv is not an exact copy"
    dkv_ref, truth = reference.rope_kv_backward(
        dk.double(),
        dv.double(),
        cos2d.double(),
        sin2d.double(),
        positions,
        k_dim=case.k_dim,
        interleaved_in=case.interleaved,
        interleaved_out=case.interleaved_out,
    )
    assert torch.equal(dkv.double(), dkv_ref), f"{what}: dkv against the reference"
    tol = dk_pe_tolerance(dk, cos2d, sin2d, positions, truth, case)
    assert_close_elementwise(dk_pe, truth, tol, f"{what}: dk_pe")


def check_case(case: Case, device, inp: Inputs | None = None) -> None:
    """Forward and backward launchers, poisoned outputs, fp64 reference, inputs untouched.
    Strided-view cases write into guarded strided outputs."""
    guard = case.view != "contiguous"
    inp = inp or make_inputs(case, device)
    before = snapshot(inp.owners)
    kv, k_pe, cos2d, sin2d, positions = host_checked(inp, case)
    k, v = launch_forward(kv, k_pe, cos2d, sin2d, positions, case, guard=guard)
    assert_untouched(before, inp.owners, f"forward {case_id(case)}")
    check_forward(kv, k_pe, k, v, cos2d, sin2d, positions, case)

    dk, dv, grad_owners = make_upstream_grads(kv, case)
    grads_before = snapshot(grad_owners)
    dkv, dk_pe = launch_backward(dk, dv, cos2d, sin2d, positions, case, guard=guard)
    assert_untouched(grads_before, grad_owners, f"backward {case_id(case)} (dk, dv)")
    assert_untouched(before, inp.owners, f"backward {case_id(case)} (tables, positions)")
    check_backward(dk, dv, dkv, dk_pe, cos2d, sin2d, positions, case)


# ---------------------------------------------------------------------------------------------
# the rope channels' layouts and the head sum, restated
# ---------------------------------------------------------------------------------------------


def relayout(x: torch.Tensor, il_in: bool, il_out: bool) -> torch.Tensor:
    """Rope channels ``[..., R]`` read as pairs in one layout (``il_in``: interleaved, else
    halves) and written in the other (``il_out``), values untouched."""
    half = x.shape[-1] // 2
    a, b = (x[..., 0::2], x[..., 1::2]) if il_in else (x[..., :half], x[..., half:])
    return join_pairs(a, b, il_out)


def fixed_order_head_sum(g: torch.Tensor) -> torch.Tensor:
    """``[T, H, R] -> [T, R]`` in fp32, in the order kernels/kv.py documents: chunks of 16
    heads (missing heads are -0.0), each summed as a pairwise tree (``h + (h + 8)``, then
    ``+ 4``, ``+ 2``, ``+ 1``), the chunks added in head order."""
    n_tokens, heads, rope = g.shape
    padded_heads = 16 * max(1, -(-heads // 16))
    padded = torch.full((n_tokens, padded_heads, rope), -0.0, dtype=g.dtype, device=g.device)
    padded[:, :heads] = g
    total = None
    for h0 in range(0, padded_heads, 16):
        chunk = padded[:, h0 : h0 + 16]
        while chunk.shape[1] > 1:
            half = chunk.shape[1] // 2
            chunk = chunk[:, :half] + chunk[:, half:]
        total = chunk[:, 0] if total is None else total + chunk[:, 0]
    return total
