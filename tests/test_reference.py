"""Tests of the reference (``mlarope.reference``, the spec and the CPU backend) against formulations
written here without it, and of the public API's float64 path (which runs the reference with the
hand-written backward).

Oracles, each independent of ``mlarope``:

- complex multiplication in float64: the pair ``(a, b)`` is ``z = a + i b``, and the rotation by
  angle ``theta`` with attention factor ``m`` is ``z * m * exp(i theta)`` (``inverse``: the
  conjugate), for tables ``cos = m cos(cat(theta, theta))``, ``sin = m sin(cat(theta, theta))``;
- general tables (``c[j] != c[half + j]``): the formulas of docs/design.md restated as a
  per-element loop;
- ``torch.autograd.gradcheck`` in float64 (fast mode: random projections of the numerical
  Jacobian) for the backward, through the reference's autograd and the hand-written one;
- the load-balanced context-parallel split built chunk by chunk from the full sequence (also
  run through the public API in float32 on ``device``, so the kernels' own lookup is checked);
- transformers' DeepSeek-V3 ``apply_rotary_pos_emb_interleave`` (float64, and float32 kernels
  on ``device`` within tests/errmodel.py's model).

Error model for float64 comparisons: a rotated element is ``a*c - b*s`` (two products and one
add, each within half a float64 ulp), so it is within ``2 * 2**-53 * (|a*c| + |b*s|)`` of the
exact value; two such formulations differ by at most twice that. The tolerance below is
``4 * 2**-53 * (|a| + |b|) * max|table|``, per pair, which that bounds. Pass-through rows (nope
channels, padding tokens) are compared exactly.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import mlarope
from mlarope import reference
from mlarope.positions import Positions
from tests.errmodel import assert_close_elementwise, join_pairs, rope_tolerance, split_pairs

U64 = 2.0**-53
H, N, R = 2, 4, 32  # heads, nope channels, rope channels
K, V = 4, 6  # key-nope and value widths of kv
S, B = 5, 2  # sbhd / bshd sequence and batch
P = 16  # table rows
SCALE = 1.25  # attention factor folded into the tables (YaRN's mscale)
CU = [0, 3, 3, 4, 9]  # thd: lengths 3, 0 (empty), 1 (one token), 5
PAD = 2  # thd padding rows past cu_seqlens[-1]
T = CU[-1] + PAD

LAYOUTS = ["sbhd", "bshd", "thd"]
BOOLS = [False, True]


# ---------------------------------------------------------------------------------------------
# independent helpers
# ---------------------------------------------------------------------------------------------


def angle_tables(rows: int, rope_dim: int = R, *, scale: float = SCALE, base: float = 10000.0):
    """``theta: [P, half]``, float64 tables ``cos, sin: [P, R]`` in cat(freqs, freqs) layout."""
    inv_freq = base ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    theta = torch.arange(rows, dtype=torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat((theta, theta), dim=-1)
    return theta, scale * emb.cos(), scale * emb.sin()


def general_tables(rows: int, rope_dim: int = R, dtype=torch.float64):
    """Random tables whose two halves differ: exercises every table entry the formulas name."""
    return torch.randn(rows, rope_dim, dtype=dtype), torch.randn(rows, rope_dim, dtype=dtype)


def token_shape(layout: str, seq: int = S, batch: int = B, tokens: int = T) -> tuple[int, ...]:
    return {"sbhd": (seq, batch), "bshd": (batch, seq), "thd": (tokens,)}[layout]


def explicit_positions(layout: str, shape: tuple[int, ...], cu: list[int] | None = None):
    """Position of every token (``None`` for thd padding), as a nested list of ``shape``.

    Written from docs/design.md without ``mlarope.positions``: the index along S, or ``t - cu[i]``.
    """
    if layout == "sbhd":
        return [[s for _ in range(shape[1])] for s in range(shape[0])]
    if layout == "bshd":
        return [list(range(shape[1])) for _ in range(shape[0])]
    if cu is None:
        return list(range(shape[0]))
    out: list[int | None] = []
    for t in range(shape[0]):
        seq = [i for i in range(len(cu) - 1) if cu[i] <= t < cu[i + 1]]
        out.append(t - cu[seq[0]] if seq else None)
    return out


def flat_positions(pos) -> list[int | None]:
    return [p for row in pos for p in row] if pos and isinstance(pos[0], list) else list(pos)


def gather_rows(table: torch.Tensor, pos: list[int | None], shape) -> torch.Tensor:
    """``table[p]`` per token (zeros for padding) -> ``[tokens..., W]``."""
    rows = [table[p] if p is not None else torch.zeros_like(table[0]) for p in pos]
    return torch.stack(rows).reshape(*shape, table.shape[-1])


def padding_mask(pos: list[int | None], shape) -> torch.Tensor:
    return torch.tensor([p is None for p in pos]).reshape(shape)


def complex_rotate(
    x: torch.Tensor,
    theta: torch.Tensor,
    pad: torch.Tensor,
    *,
    interleaved_in: bool,
    interleaved_out: bool,
    inverse: bool,
    scale: float = SCALE,
) -> torch.Tensor:
    """``x: [tokens..., H, R]`` rotated as complex numbers by ``theta: [tokens..., half]``.

    Padding tokens pass through (``pad: [tokens...]``), written in the output layout.
    """
    a, b = split_pairs(x, interleaved_in)
    z = torch.complex(a, b)
    w = scale * torch.exp(1j * theta.to(torch.complex128)).unsqueeze(-2)
    y = z * (w.conj() if inverse else w)
    p = pad[..., None, None]
    return join_pairs(torch.where(p, a, y.real), torch.where(p, b, y.imag), interleaved_out)


def fp64_tolerance(x_rope: torch.Tensor, interleaved_in: bool, interleaved_out: bool, bound):
    a, b = split_pairs(x_rope.abs(), interleaved_in)
    tol = 4 * U64 * (a + b) * bound
    return join_pairs(tol, tol, interleaved_out)


def assert_fp64_close(out: torch.Tensor, truth: torch.Tensor, tol: torch.Tensor, what: str):
    assert out.dtype == torch.float64 and out.shape == truth.shape, (out.shape, truth.shape)
    err = (out - truth).abs()
    if not bool((err <= tol).all()):
        flat = int((err - tol).flatten().argmax())
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), err.shape))
        raise AssertionError(
            f"{what}: {int((err > tol).sum())} elements outside the float64 error model; worst at "
            f"{list(idx)}: got {out[idx].item()!r}, expected {truth[idx].item()!r}"
        )


def thd_kwargs(layout: str, cu: list[int] = CU) -> dict:
    return {"cu_seqlens": torch.tensor(cu, dtype=torch.int32)} if layout == "thd" else {}


# ---------------------------------------------------------------------------------------------
# complex multiplication in float64
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("inverse", BOOLS, ids=["fwd", "inverse"])
@pytest.mark.parametrize("interleaved_out", BOOLS, ids=["out_half", "out_inter"])
@pytest.mark.parametrize("interleaved", BOOLS, ids=["in_half", "in_inter"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_q_matches_complex_multiplication(layout, interleaved, interleaved_out, inverse):
    theta, cos, sin = angle_tables(P)
    shape = token_shape(layout)
    q = torch.randn(*shape, H, N + R, dtype=torch.float64)
    q_before = q.clone()
    out = reference.apply_rope_q(
        q, cos, sin, layout=layout, interleaved=interleaved, interleaved_out=interleaved_out,
        inverse=inverse, **thd_kwargs(layout),
    )  # fmt: skip
    pos = flat_positions(explicit_positions(layout, shape, CU if layout == "thd" else None))
    pad = padding_mask(pos, shape)
    truth = complex_rotate(
        q[..., N:], gather_rows(theta, pos, shape), pad, interleaved_in=interleaved,
        interleaved_out=interleaved_out, inverse=inverse,
    )  # fmt: skip
    tol = fp64_tolerance(q[..., N:], interleaved, interleaved_out, SCALE)
    assert torch.equal(q, q_before), "the input was modified"
    assert torch.equal(out[..., :N], q[..., :N]), "nope channels not copied"
    assert_fp64_close(out[..., N:], truth, tol, "rope channels")
    if layout == "thd":  # padding rows: the same pairs, only re-laid out, bit for bit
        assert torch.equal(out[pad][..., N:], truth[pad])


@pytest.mark.parametrize("interleaved_out", BOOLS, ids=["out_half", "out_inter"])
@pytest.mark.parametrize("interleaved", BOOLS, ids=["in_half", "in_inter"])
@pytest.mark.parametrize("k_pe_rank", ["1R", "R"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kv_matches_complex_multiplication(layout, k_pe_rank, interleaved, interleaved_out):
    theta, cos, sin = angle_tables(P)
    shape = token_shape(layout)
    kv = torch.randn(*shape, H, K + V, dtype=torch.float64)
    k_pe = torch.randn(*shape, 1, R, dtype=torch.float64)
    k_pe_arg = k_pe if k_pe_rank == "1R" else k_pe.squeeze(-2)
    k, v = reference.apply_rope_kv(
        kv, k_pe_arg, cos, sin, k_dim=K, layout=layout, interleaved=interleaved,
        interleaved_out=interleaved_out, **thd_kwargs(layout),
    )  # fmt: skip
    pos = flat_positions(explicit_positions(layout, shape, CU if layout == "thd" else None))
    pad = padding_mask(pos, shape)
    truth = complex_rotate(
        k_pe, gather_rows(theta, pos, shape), pad, interleaved_in=interleaved,
        interleaved_out=interleaved_out, inverse=False,
    ).expand(*shape, H, R)  # fmt: skip
    tol = fp64_tolerance(k_pe, interleaved, interleaved_out, SCALE).expand(*shape, H, R)
    assert k.shape == (*shape, H, K + R) and v.shape == (*shape, H, V)
    assert torch.equal(k[..., :K], kv[..., :K])
    assert torch.equal(v, kv[..., K:])
    assert_fp64_close(k[..., K:], truth, tol, "k rope channels")


# ---------------------------------------------------------------------------------------------
# general tables: the formulas of docs/design.md, element by element
# ---------------------------------------------------------------------------------------------


def loop_rotate(x, c, s, pos, *, interleaved_in, interleaved_out, inverse, transpose=False):
    """docs/design.md per element. ``x: [T, H, R]`` list-of-lists, ``c, s: [P][R]``, ``pos: [T]``.

    Forward ``out_a = a c[j] - b s[j]``, ``out_b = b c[h+j] + a s[h+j]``; backward (transpose)
    ``da = ga c[j] + gb s[h+j]``, ``db = -ga s[j] + gb c[h+j]``; ``inverse`` negates s; padding
    (``pos is None``) passes through; an out-of-range position gives NaN.
    """
    half = len(x[0][0]) // 2
    out = []
    for t, heads in enumerate(x):
        p = pos[t]
        rows = []
        for row in heads:
            res = [0.0] * (2 * half)
            for j in range(half):
                a, b = (row[2 * j], row[2 * j + 1]) if interleaved_in else (row[j], row[half + j])
                if p is None:
                    oa, ob = a, b
                elif not 0 <= p < len(c):
                    oa = ob = math.nan
                else:
                    sign = -1.0 if inverse else 1.0
                    ca, cb = c[p][j], c[p][half + j]
                    sa, sb = sign * s[p][j], sign * s[p][half + j]
                    if transpose:
                        oa, ob = a * ca + b * sb, -a * sa + b * cb
                    else:
                        oa, ob = a * ca - b * sa, b * cb + a * sb
                if interleaved_out:
                    res[2 * j], res[2 * j + 1] = oa, ob
                else:
                    res[j], res[half + j] = oa, ob
            rows.append(res)
        out.append(rows)
    return torch.tensor(out, dtype=torch.float64)


def loop_bound(x: torch.Tensor, c, s, interleaved_in, interleaved_out):
    big = max(c.abs().max().item(), s.abs().max().item())
    return fp64_tolerance(x, interleaved_in, interleaved_out, big)


def flatten_tokens(x: torch.Tensor, layout: str) -> torch.Tensor:
    return x.reshape(-1, *x.shape[-2:]) if layout != "thd" else x


@pytest.mark.parametrize("inverse", BOOLS, ids=["fwd", "inverse"])
@pytest.mark.parametrize("interleaved_out", BOOLS, ids=["out_half", "out_inter"])
@pytest.mark.parametrize("interleaved", BOOLS, ids=["in_half", "in_inter"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_q_general_tables_loop(layout, interleaved, interleaved_out, inverse):
    cos, sin = general_tables(P)
    shape = token_shape(layout, seq=3, tokens=T)
    q = torch.randn(*shape, H, N + R, dtype=torch.float64, requires_grad=True)
    kw = dict(layout=layout, interleaved=interleaved, interleaved_out=interleaved_out)
    out = reference.apply_rope_q(q, cos, sin, inverse=inverse, **kw, **thd_kwargs(layout))
    pos = flat_positions(explicit_positions(layout, shape, CU if layout == "thd" else None))
    x = flatten_tokens(q.detach()[..., N:], layout)
    truth = loop_rotate(
        x.tolist(), cos.tolist(), sin.tolist(), pos, interleaved_in=interleaved,
        interleaved_out=interleaved_out, inverse=inverse,
    )  # fmt: skip
    tol = loop_bound(x, cos, sin, interleaved, interleaved_out)
    assert_fp64_close(flatten_tokens(out.detach()[..., N:], layout), truth, tol, "forward")
    assert torch.equal(out[..., :N], q[..., :N])

    # The public float64 path: same forward, and the backward formula of docs/design.md per element.
    q2 = q.detach().clone().requires_grad_(True)
    out2 = mlarope.apply_rope_q(q2, cos, sin, inverse=inverse, **kw, **thd_kwargs(layout))
    assert torch.equal(out2, out)
    grad = torch.randn_like(out2)
    out2.backward(grad)
    g = flatten_tokens(grad[..., N:], layout)
    dtruth = loop_rotate(
        g.tolist(), cos.tolist(), sin.tolist(), pos, interleaved_in=interleaved_out,
        interleaved_out=interleaved, inverse=inverse, transpose=True,
    )  # fmt: skip
    dtol = loop_bound(g, cos, sin, interleaved_out, interleaved)
    assert_fp64_close(flatten_tokens(q2.grad[..., N:], layout), dtruth, dtol, "backward")
    assert torch.equal(q2.grad[..., :N], grad[..., :N])


@pytest.mark.parametrize("interleaved_out", BOOLS, ids=["out_half", "out_inter"])
@pytest.mark.parametrize("interleaved", BOOLS, ids=["in_half", "in_inter"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kv_general_tables_loop(layout, interleaved, interleaved_out):
    cos, sin = general_tables(P)
    shape = token_shape(layout, seq=3, tokens=T)
    heads = 3
    kv = torch.randn(*shape, heads, K + V, dtype=torch.float64, requires_grad=True)
    k_pe = torch.randn(*shape, 1, R, dtype=torch.float64, requires_grad=True)
    kw = dict(layout=layout, interleaved=interleaved, interleaved_out=interleaved_out)
    k, v = mlarope.apply_rope_kv(kv, k_pe, cos, sin, k_dim=K, **kw, **thd_kwargs(layout))
    k_ref, v_ref = reference.apply_rope_kv(kv, k_pe, cos, sin, k_dim=K, **kw, **thd_kwargs(layout))
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    pos = flat_positions(explicit_positions(layout, shape, CU if layout == "thd" else None))
    x = flatten_tokens(k_pe.detach(), layout)
    truth = loop_rotate(
        x.tolist(), cos.tolist(), sin.tolist(), pos, interleaved_in=interleaved,
        interleaved_out=interleaved_out, inverse=False,
    ).expand(-1, heads, R)  # fmt: skip
    tol = loop_bound(x, cos, sin, interleaved, interleaved_out).expand(-1, heads, R)
    assert_fp64_close(flatten_tokens(k.detach()[..., K:], layout), truth, tol, "k forward")
    assert torch.equal(k[..., :K], kv[..., :K]) and torch.equal(v, kv[..., K:])

    # Backward: dkv = [dk[..., :K], dv]; dk_pe = transpose rotation of the head sum of dk[..., K:].
    dk, dv = torch.randn_like(k), torch.randn_like(v)
    torch.autograd.backward((k, v), (dk, dv))
    assert torch.equal(kv.grad, torch.cat((dk[..., :K], dv), dim=-1))
    head_sum = flatten_tokens(dk[..., K:], layout).sum(-2, keepdim=True)
    dtruth = loop_rotate(
        head_sum.tolist(), cos.tolist(), sin.tolist(), pos, interleaved_in=interleaved_out,
        interleaved_out=interleaved, inverse=False, transpose=True,
    )  # fmt: skip
    # the head sum adds (H - 1) roundings of the summed magnitudes
    abs_sum = flatten_tokens(dk[..., K:].abs(), layout).sum(-2, keepdim=True)
    dtol = loop_bound(abs_sum, cos, sin, interleaved_out, interleaved) * (heads + 2)
    assert k_pe.grad.shape == k_pe.shape
    assert_fp64_close(flatten_tokens(k_pe.grad, layout), dtruth, dtol, "dk_pe")


# ---------------------------------------------------------------------------------------------
# gradcheck in float64: the reference (autograd through torch ops) and the public API (the
# hand-written backward, the autograd functions of mlarope.autograd, with transpose=True)
# ---------------------------------------------------------------------------------------------

GRAD_CASES = [
    # (layout, extra kwargs builder, id)
    ("sbhd", lambda: {}, "sbhd"),
    ("bshd", lambda: {}, "bshd"),
    ("thd", lambda: {"cu_seqlens": torch.tensor([0, 2, 2, 3, 7])}, "thd-cu-pad"),
    ("thd", lambda: {}, "thd-one-seq"),
    ("sbhd", lambda: {"cp_size": 2, "cp_rank": 1}, "sbhd-cp2r1"),
    (
        "thd",
        lambda: {"cu_seqlens": torch.tensor([0, 4, 12]), "cp_size": 2, "cp_rank": 1},
        "thd-cp2",
    ),
    ("bshd", lambda: {"position_ids": torch.tensor([[3, 0, 1, 7], [5, 5, 2, 0]])}, "bshd-pos"),
]
# gradcheck's fast mode: random projections u, v, comparing v^T J u from the backward with the
# numerical one (a wrong backward fails with probability 1); full Jacobians cost ~3 s per case
GRAD_TOKENS = {"sbhd": (4, 2), "bshd": (2, 4), "thd": (9,)}  # thd-cp2: 6 local + 3 padding


def _grad_case(case):
    layout, kwargs, _ = case
    return layout, GRAD_TOKENS[layout], kwargs()


@pytest.mark.parametrize(
    "flags", [(True, False, False), (False, True, True)], ids=["i-h", "h-i-inv"]
)
@pytest.mark.parametrize("case", GRAD_CASES, ids=[c[2] for c in GRAD_CASES])
@pytest.mark.parametrize("api", ["reference", "public", "public-inplace"])
def test_gradcheck_q(api, case, flags):
    layout, shape, kwargs = _grad_case(case)
    interleaved, interleaved_out, inverse = flags
    cos, sin = general_tables(P)
    q = torch.randn(*shape, 2, 2 + R, dtype=torch.float64, requires_grad=True)
    kw = dict(layout=layout, interleaved=interleaved, interleaved_out=interleaved_out, **kwargs)
    kw["inverse"] = inverse
    if api == "reference":
        fn = lambda x: reference.apply_rope_q(x, cos, sin, **kw)
    elif api == "public":
        fn = lambda x: mlarope.apply_rope_q(x, cos, sin, **kw)
    else:
        fn = lambda x: mlarope.apply_rope_q(x.clone(), cos, sin, inplace=True, **kw)
    assert torch.autograd.gradcheck(fn, (q,), eps=1e-6, atol=1e-9, rtol=1e-7, fast_mode=True)
    if api != "reference":
        ref = reference.apply_rope_q(q.detach(), cos, sin, **kw)
        assert torch.equal(fn(q).detach(), ref)


@pytest.mark.parametrize("flags", [(True, False), (False, True)], ids=["i-h", "h-i"])
@pytest.mark.parametrize("case", GRAD_CASES, ids=[c[2] for c in GRAD_CASES])
@pytest.mark.parametrize("api", ["reference", "public-copy_v", "public-view_v"])
def test_gradcheck_kv(api, case, flags):
    copy_v = api == "public-copy_v"
    layout, shape, kwargs = _grad_case(case)
    interleaved, interleaved_out = flags
    cos, sin = general_tables(P)
    kv = torch.randn(*shape, 3, 2 + 3, dtype=torch.float64, requires_grad=True)
    k_pe = torch.randn(*shape, 1, R, dtype=torch.float64, requires_grad=True)
    kw = dict(layout=layout, interleaved=interleaved, interleaved_out=interleaved_out, **kwargs)
    if api == "reference":
        fn = lambda x, y: reference.apply_rope_kv(x, y, cos, sin, k_dim=2, **kw)
    else:
        fn = lambda x, y: mlarope.apply_rope_kv(x, y, cos, sin, k_dim=2, copy_v=copy_v, **kw)
    assert torch.autograd.gradcheck(fn, (kv, k_pe), eps=1e-6, atol=1e-9, rtol=1e-7, fast_mode=True)


@pytest.mark.parametrize("inplace", BOOLS, ids=["out_of_place", "inplace"])
def test_q_backward_leaves_grad_output_untouched(inplace):
    """A gradient tensor can be shared: ``a + b`` hands the same one to both branches, and the
    caller's ``grad_output`` is theirs. Rotating it in place would corrupt the other branch."""
    cos, sin = general_tables(P)
    x = torch.randn(4, 2, H, N + R, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 2, H, N + R, dtype=torch.float64, requires_grad=True)
    b = w * 2  # created first, so its backward runs after the rope's
    a = mlarope.apply_rope_q(x.clone(), cos, sin, inplace=inplace)
    grad = torch.randn_like(a)
    grad_before = grad.clone()
    (a + b).backward(grad)
    assert torch.equal(grad, grad_before), "the backward wrote into grad_output"
    assert torch.equal(w.grad, 2 * grad_before), "the other branch got a corrupted gradient"
    x_ref = x.detach().clone().requires_grad_(True)
    reference.apply_rope_q(x_ref, cos, sin).backward(grad_before)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-13, atol=1e-13)


# ---------------------------------------------------------------------------------------------
# context parallel: the load-balanced split, built explicitly
# ---------------------------------------------------------------------------------------------

CP_LENGTHS = {1: [2, 6, 0, 4], 2: [4, 0, 8, 4], 4: [8, 0, 16]}


def cp_local_rows(lengths: list[int], cp_size: int, rank: int) -> list[int]:
    """Global token rows held by ``rank``: chunks ``rank`` and ``2*cp_size-1-rank`` of each seq."""
    rows, start = [], 0
    for length in lengths:
        chunk = length // (2 * cp_size)
        for c in (rank, 2 * cp_size - 1 - rank):
            rows += range(start + c * chunk, start + (c + 1) * chunk)
        start += length
    return rows


def _call(op: str, api: str, x, extra, cos, sin, **kw):
    mod = reference if api == "reference" else mlarope
    if op == "q":
        return mod.apply_rope_q(x, cos, sin, **kw)
    k, v = mod.apply_rope_kv(x, extra, cos, sin, k_dim=K, **kw)
    return torch.cat((k, v), dim=-1)


# reference: float64 on the CPU; public: float32 on ``device`` (the kernels' own lookup)
CP_APIS = ["reference", "public"]


def _cp_inputs(api, device, shape, width, rows):
    dev = {"dtype": torch.float64} if api == "reference" else {"device": device}
    _, cos, sin = angle_tables(rows)
    cos, sin = (cos, sin) if api == "reference" else (cos.float(), sin.float())
    x = torch.randn(*shape, H, width, dtype=torch.float64)
    k_pe = torch.randn(*shape, 1, R, dtype=torch.float64)
    to = lambda t: t.to(**dev) if api == "reference" else t.float().to(device)
    return to(x), to(k_pe), to(cos), to(sin)


@pytest.mark.parametrize("api", CP_APIS)
@pytest.mark.parametrize("interleaved_out", BOOLS, ids=["out_half", "out_inter"])
@pytest.mark.parametrize("op", ["q", "kv"])
@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_cp_mapping_thd(cp_size, op, interleaved_out, api, device):
    lengths = CP_LENGTHS[cp_size]
    total = sum(lengths)
    width = N + R if op == "q" else K + V
    x, k_pe, cos, sin = _cp_inputs(api, device, (total,), width, max(lengths))
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64, device=x.device)
    kw = dict(layout="thd", interleaved=True, interleaved_out=interleaved_out, cu_seqlens=cu)
    full = _call(op, api, x, k_pe, cos, sin, **kw)
    seen = []
    for rank in range(cp_size):
        rows = cp_local_rows(lengths, cp_size, rank)
        seen += rows
        rows_t = torch.tensor(rows, dtype=torch.int64, device=x.device)
        local = _call(
            op, api, x[rows_t], k_pe[rows_t], cos, sin, cp_rank=rank, cp_size=cp_size, **kw
        )
        assert torch.equal(local, full[rows_t]), f"rank {rank}"
    assert sorted(seen) == list(range(total))  # the ranks partition the batch


@pytest.mark.parametrize("api", CP_APIS)
@pytest.mark.parametrize("op", ["q", "kv"])
@pytest.mark.parametrize("layout", ["sbhd", "bshd"])
@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_cp_mapping_sbhd(cp_size, layout, op, api, device):
    seq = 2 * cp_size * 2
    seq_dim = 0 if layout == "sbhd" else 1
    width = N + R if op == "q" else K + V
    shape = token_shape(layout, seq=seq, batch=2)
    x, k_pe, cos, sin = _cp_inputs(api, device, shape, width, seq)
    full = _call(op, api, x, k_pe, cos, sin, layout=layout)
    for rank in range(cp_size):
        rows = torch.tensor(cp_local_rows([seq], cp_size, rank), device=x.device)
        local = _call(
            op, api, x.index_select(seq_dim, rows), k_pe.index_select(seq_dim, rows), cos, sin,
            layout=layout, cp_rank=rank, cp_size=cp_size,
        )  # fmt: skip
        assert torch.equal(local, full.index_select(seq_dim, rows)), f"rank {rank}"


# ---------------------------------------------------------------------------------------------
# padding, empty and one-token sequences, out-of-range positions
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("interleaved_out", BOOLS, ids=["out_half", "out_inter"])
@pytest.mark.parametrize("interleaved", BOOLS, ids=["in_half", "in_inter"])
def test_padding_rows_pass_through(interleaved, interleaved_out):
    cos, sin = general_tables(P)
    cu = [0, 1, 1, 1, 4]  # one token, two empty sequences, three tokens; then padding
    tokens = 7
    q = torch.randn(tokens, H, N + R, dtype=torch.float64)
    kv = torch.randn(tokens, H, K + V, dtype=torch.float64)
    k_pe = torch.randn(tokens, R, dtype=torch.float64)
    kw = dict(layout="thd", interleaved=interleaved, interleaved_out=interleaved_out)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    out = reference.apply_rope_q(q, cos, sin, cu_seqlens=cu_t, **kw)
    k, _ = reference.apply_rope_kv(kv, k_pe, cos, sin, k_dim=K, cu_seqlens=cu_t, **kw)

    def relayout(x):
        return join_pairs(*split_pairs(x, interleaved), interleaved_out)

    pad = slice(cu[-1], tokens)
    assert torch.equal(out[pad, :, N:], relayout(q[pad, :, N:]))
    assert torch.equal(out[pad, :, :N], q[pad, :, :N])
    assert torch.equal(k[pad, :, K:], relayout(k_pe[pad, None, :]).expand(-1, H, R))
    # The one-token sequence and the first token of the last use table row 0, not padding.
    loop = loop_rotate(
        q[:, :, N:].tolist(), cos.tolist(), sin.tolist(), [0, 0, 1, 2, None, None, None],
        interleaved_in=interleaved, interleaved_out=interleaved_out, inverse=False,
    )  # fmt: skip
    assert_fp64_close(
        out[..., N:], loop, loop_bound(q[..., N:], cos, sin, interleaved, interleaved_out), "q"
    )
    # No sequences at all ([0]) or a zero-length batch: everything is padding.
    everything = reference.apply_rope_q(q, cos, sin, cu_seqlens=torch.tensor([0]), **kw)
    assert torch.equal(everything[..., N:], relayout(q[..., N:]))
    nothing = reference.apply_rope_q(q, cos, sin, cu_seqlens=torch.tensor([0, 0, 0]), **kw)
    assert torch.equal(nothing, everything)


def _nan_rows(out: torch.Tensor, x: torch.Tensor, bad: torch.Tensor, nope: int) -> None:
    """Rope channels NaN exactly in ``bad`` token rows; nope copied and finite everywhere."""
    rope_nan = out[..., nope:].isnan()
    assert torch.equal(rope_nan.all(-1).all(-1), bad), "NaN rows"
    assert torch.equal(rope_nan.any(-1).any(-1), bad), "NaN leaked into in-range rows"
    assert torch.equal(out[..., :nope], x[..., :nope])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_out_of_range_positions_give_nan_rows(device, dtype):
    """Reference (float64) and, for float32 on ``device``, the kernels."""
    _, cos, sin = angle_tables(P)
    cos, sin = cos.float().to(device), sin.float().to(device)
    dev = dict(dtype=dtype, device=device)
    q = torch.randn(2, 4, H, N + R, **dev)
    kv = torch.randn(2, 4, H, K + V, **dev)
    k_pe = torch.randn(2, 4, 1, R, **dev)
    ids = torch.tensor([[0, P, 3, -1], [P - 1, 2, P + 5, 1]], device=device)
    bad = ((ids < 0) | (ids >= P)).cpu()
    for fn in (reference.apply_rope_q, mlarope.apply_rope_q):
        out = fn(q, cos, sin, layout="bshd", position_ids=ids)
        _nan_rows(out.cpu(), q.cpu(), bad, N)
    for fn in (reference.apply_rope_kv, mlarope.apply_rope_kv):
        k, v = fn(kv, k_pe, cos, sin, k_dim=K, layout="bshd", position_ids=ids)
        _nan_rows(k.cpu(), kv.cpu(), bad, K)
        assert torch.equal(v.cpu(), kv[..., K:].cpu())

    # cu_seqlens with a sequence longer than the table: its tokens at p >= P are NaN.
    cu = torch.tensor([0, 3, 3 + P + 2], device=device)
    tokens = 3 + P + 2 + 1  # and one padding row
    qt = torch.randn(tokens, H, N + R, **dev)
    bad_t = torch.zeros(tokens, dtype=torch.bool)
    bad_t[3 + P : 3 + P + 2] = True
    for fn in (reference.apply_rope_q, mlarope.apply_rope_q):
        out = fn(qt, cos, sin, layout="thd", cu_seqlens=cu)
        _nan_rows(out.cpu(), qt.cpu(), bad_t, N)


@pytest.mark.parametrize("how", ["argument", "env"])
def test_validate_rejects_out_of_range(how, monkeypatch):
    _, cos, sin = angle_tables(P)
    if how == "env":
        monkeypatch.setenv("MLAROPE_VALIDATE", "1")
        kw = {}
    else:
        monkeypatch.delenv("MLAROPE_VALIDATE", raising=False)
        kw = {"validate": True}
    q = torch.randn(2, 4, H, N + R, dtype=torch.float64)
    kv = torch.randn(2, 4, H, K + V, dtype=torch.float64)
    k_pe = torch.randn(2, 4, R, dtype=torch.float64)
    for bad_value in (P, P + 7, -1):
        ids = torch.tensor([[0, 1, 2, 3], [0, bad_value, 2, 3]])
        with pytest.raises(ValueError, match=rf"position_ids.*= {bad_value}\b"):
            mlarope.apply_rope_q(q, cos, sin, layout="bshd", position_ids=ids, **kw)
        with pytest.raises(ValueError, match=rf"position_ids.*= {bad_value}\b"):
            mlarope.apply_rope_kv(
                kv, k_pe, cos, sin, k_dim=K, layout="bshd", position_ids=ids, **kw
            )
    # a sequence longer than the table
    long = P + 3
    cu = torch.tensor([0, 2, 2 + long])
    qt = torch.randn(2 + long, H, N + R, dtype=torch.float64)
    with pytest.raises(ValueError, match=rf"cu_seqlens.*\b{long}\b"):
        mlarope.apply_rope_q(qt, cos, sin, layout="thd", cu_seqlens=cu, **kw)
    # in range: no error, same result as without validation
    ok = torch.tensor([[0, 1, 2, 3], [0, P - 1, 2, 3]])
    out = mlarope.apply_rope_q(q, cos, sin, layout="bshd", position_ids=ok, **kw)
    assert torch.equal(out, reference.apply_rope_q(q, cos, sin, layout="bshd", position_ids=ok))


def test_out_of_range_without_validation_does_not_raise(monkeypatch):
    monkeypatch.delenv("MLAROPE_VALIDATE", raising=False)
    _, cos, sin = angle_tables(P)
    q = torch.randn(4, H, N + R, dtype=torch.float64)
    out = mlarope.apply_rope_q(q, cos, sin, layout="thd", position_ids=torch.tensor([0, P, 1, 2]))
    assert out[1, :, N:].isnan().all() and not out[[0, 2, 3]].isnan().any()


# ---------------------------------------------------------------------------------------------
# transformers' DeepSeek-V3
# ---------------------------------------------------------------------------------------------


def _hf_tables(ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """What transformers' DeepseekV3RotaryEmbedding returns: ``[B, S, R]`` rows of the
    cat(freqs, freqs) tables at ``position_ids``."""
    return cos[ids], sin[ids]


@pytest.mark.parametrize("with_ids", BOOLS, ids=["arange", "position_ids"])
def test_matches_transformers_deepseek_v3(device, with_ids):
    hf = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    rope_dim, batch, seq, heads, nope = 64, 2, 6, 3, 8
    _, cos64, sin64 = angle_tables(P, rope_dim, scale=1.3)
    cos32, sin32 = cos64.float(), sin64.float()
    ids = (
        torch.randint(0, P, (batch, seq))
        if with_ids
        else torch.arange(seq).expand(batch, seq).contiguous()
    )
    kw_cpu = {"position_ids": ids} if with_ids else {}
    kw_dev = {"position_ids": ids.to(device)} if with_ids else {}
    q = torch.randn(batch, seq, heads, nope + rope_dim).float()
    k_pe = torch.randn(batch, seq, 1, rope_dim).float()
    kv = torch.randn(batch, seq, heads, K + V).float()

    # transformers, float64, on [B, H, S, D] with the fp32 tables upcast: the truth.
    c, s = _hf_tables(ids, cos32.double(), sin32.double())
    q_hf, k_hf = hf.apply_rotary_pos_emb_interleave(
        q[..., nope:].double().transpose(1, 2), k_pe.double().transpose(1, 2), c, s
    )
    q_hf, k_hf = q_hf.transpose(1, 2), k_hf.transpose(1, 2)  # back to [B, S, H, R]
    common = dict(layout="bshd", interleaved=True, interleaved_out=False, **kw_cpu)
    common_dev = dict(layout="bshd", interleaved=True, interleaved_out=False, **kw_dev)

    # float64 through the public API (the reference backend): equal within the fp64 model.
    out64 = mlarope.apply_rope_q(q.double(), cos32.double(), sin32.double(), **common)
    tol = fp64_tolerance(q[..., nope:].double(), True, False, 1.3)
    assert_fp64_close(out64[..., nope:], q_hf, tol, "q vs transformers (fp64)")
    k64, _ = mlarope.apply_rope_kv(
        kv.double(), k_pe.double(), cos32.double(), sin32.double(), k_dim=K, **common
    )
    tol_k = fp64_tolerance(k_pe.double(), True, False, 1.3).expand_as(k64[..., K:])
    assert_fp64_close(k64[..., K:], k_hf.expand_as(k64[..., K:]), tol_k, "k vs transformers")

    # float32 on the device (the kernels): within mlarope's error model of the fp64 truth.
    positions = Positions("bshd", None, ids if with_ids else None, 0, 1)
    out32 = mlarope.apply_rope_q(q.to(device), cos32.to(device), sin32.to(device), **common_dev)
    tol32 = rope_tolerance(
        q[..., nope:].double(), cos32, sin32, positions, q_hf, torch.float32,
        interleaved_in=True, interleaved_out=False,
    )  # fmt: skip
    assert_close_elementwise(out32[..., nope:].cpu(), q_hf, tol32, "q fp32 vs transformers")
    k32, _ = mlarope.apply_rope_kv(
        kv.to(device),
        k_pe.to(device),
        cos32.to(device),
        sin32.to(device),
        k_dim=K,
        **common_dev,
    )
    tol32k = rope_tolerance(
        k_pe.double(), cos32, sin32, positions, k_hf, torch.float32,
        interleaved_in=True, interleaved_out=False,
    ).expand_as(k32[..., K:])  # fmt: skip
    assert_close_elementwise(
        k32[..., K:].cpu(), k_hf.expand_as(k32[..., K:]), tol32k.cpu(), "k fp32 vs transformers"
    )
