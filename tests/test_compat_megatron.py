"""mlarope.compat.megatron against an independent fp64 restatement of Megatron-Core's semantics.

The reference below is written from Megatron-Core's ``fused_mla_yarn_rope_apply.py`` and its
unfused twin ``rope_utils._apply_rotary_pos_emb_bshd`` (NVIDIA/Megatron-LM e4ba3a30f2d8), per
token, in float64, without mlarope:

- rope channels are interleaved pairs ``a_j = x[N + 2j]``, ``b_j = x[N + 2j + 1]``;
- ``a' = a * cos[p, j] - b * sin[p, j]``, ``b' = b * cos[p, half + j] + a * sin[p, half + j]``
  (``inverse`` negates sin);
- written as halves ``[a', b']``, or as pairs ``(a'_j, b'_j)`` with ``remove_interleaving``;
- sbhd: ``p = s`` (Megatron's sbhd tables are CP-local); thd: ``cu_seqlens`` are global, the
  local cumulative lengths are ``cu // cp_size``, and local offset ``o`` of a sequence of local
  length ``L`` maps to ``r * L/2 + o`` (first half) or ``(2 cp - 1 - r) * L/2 + o - L/2``.
- thd rows past the last sequence are padding: Megatron rotates them with table row 0 (a
  documented difference); mlarope passes them through unrotated, in the output layout.

Tolerances follow mlarope's error model (fp32 arithmetic, one rounding): per element, 1 ulp of
the output dtype at the reference value plus ``c * 2**-24 * sum(|terms|)``, where ``c`` is 4 for a
rotation and ``H + 4`` for the ``k_pos_emb`` gradient (a sum over ``H`` heads first).
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import triton
import triton.language as tl

import mlarope
from mlarope import reference
from mlarope.compat import megatron as mm
from mlarope.kernels.kv import round_to_16bit
from mlarope.ops import KVCall, rope_kv_backward
from mlarope.positions import Positions

H, N, R = 3, 4, 32  # heads, nope channels, rope channels (mlarope: R in 32, 64, 128)
K, V = 4, 6  # key-nope and value widths
S, B = 6, 2  # sbhd sequence and batch
P = 16  # table rows
CU = [0, 8, 12, 24]  # global cumulative lengths, multiples of 2 * cp_size for cp_size <= 2
PAD = 2  # thd padding rows after the last sequence
U32 = 2.0**-24

# (layout, cp_size, cp_rank)
CASES = [("sbhd", 1, 0), ("sbhd", 2, 1), ("thd", 1, 0), ("thd", 2, 0), ("thd", 2, 1)]
DTYPES = [torch.bfloat16, torch.float32]


def _id(case: tuple[str, int, int]) -> str:
    return f"{case[0]}-cp{case[1]}r{case[2]}"


# ---------------------------------------------------------------------------------------------
# the independent reference
# ---------------------------------------------------------------------------------------------


def megatron_positions(layout: str, cp_size: int, cp_rank: int) -> list[int | None]:
    """Table row of every token row (rows flattened s-major for sbhd); None for padding."""
    if layout == "sbhd":
        return [s for s in range(S) for _ in range(B)]
    local = [c // cp_size for c in CU]
    out: list[int | None] = []
    for row in range(local[-1] + PAD):
        pos = None
        for i in range(len(CU) - 1):
            if local[i] <= row < local[i + 1]:
                o, length = row - local[i], local[i + 1] - local[i]
                h = length // 2
                pos = cp_rank * h + o if o < h else (2 * cp_size - 1 - cp_rank) * h + (o - h)
        out.append(pos)
    return out


def rotate_rows(
    x: torch.Tensor,
    pos: list[int | None],
    cos: torch.Tensor,
    sin: torch.Tensor,
    inverse: bool,
    pairs_out: bool,
    absolute: bool = False,
) -> torch.Tensor:
    """``x: [M, H, R]`` interleaved rope channels (fp64) -> rotated ``[M, H, R]``.

    ``absolute=True`` uses ``|cos|``, ``|sin|`` and only additions: the same linear map with
    every coefficient replaced by its magnitude (for error bounds).
    """
    half = x.shape[-1] // 2
    rows = []
    for m, p in enumerate(pos):
        a, b = x[m, :, 0::2], x[m, :, 1::2]
        if p is None:  # padding: unrotated
            oa, ob = a, b
        else:
            c1, c2 = cos[p, :half], cos[p, half:]
            s1, s2 = sin[p, :half], sin[p, half:]
            if inverse:
                s1, s2 = -s1, -s2
            if absolute:
                oa = a * c1.abs() + b * s1.abs()
                ob = b * c2.abs() + a * s2.abs()
            else:
                oa = a * c1 - b * s1
                ob = b * c2 + a * s2
        rows.append(torch.stack((oa, ob), -1).flatten(-2) if pairs_out else torch.cat((oa, ob), -1))
    return torch.stack(rows)


def ref_q(x, pos, cos, sin, inverse=False, pairs_out=False, absolute=False):
    """``x: [..., H, N + R]`` fp64 -> Megatron's query output, fp64."""
    shape = x.shape
    rows = x.reshape(-1, H, N + R)
    rope = rotate_rows(rows[..., N:], pos, cos, sin, inverse, pairs_out, absolute)
    return torch.cat((rows[..., :N], rope), -1).reshape(shape)


def megatron_kpe_grad(gk_rope, pos, cos, sin, pairs_out, rnd, round_products):
    """Megatron-Core's ``k_pos_emb`` gradient, rounded where its kernel and its unfused PyTorch
    path (autograd through ``_apply_rotary_pos_emb_bshd`` and ``expand``) round.

    ``gk_rope: [M, H, R]`` fp32, the key's rope-channel gradient in the key's layout (pairs when
    ``pairs_out``, else halves); ``cos, sin: [P, R]`` fp32 holding the tables' values. The sum
    over heads (exact in fp32 for the tests' quantized gradients) is rounded with ``rnd`` to
    the activation dtype; with ``round_products`` (tables in that dtype) each product and each
    sum of the transpose rotation is rounded too, as PyTorch's arithmetic in that dtype does
    (an exact fp32 product or sum, then one rounding). Padding rows (``pos`` None) pass
    through. Returns ``[M, R]`` fp32 in ``k_pos_emb``'s interleaved layout.
    """
    half = gk_rope.shape[-1] // 2
    total = rnd(gk_rope.sum(1))
    ga, gb = (total[:, 0::2], total[:, 1::2]) if pairs_out else (total[:, :half], total[:, half:])
    pr = rnd if round_products else (lambda x: x)
    rows = []
    for m, p in enumerate(pos):
        if p is None:
            da, db = ga[m], gb[m]
        else:
            c1, c2, s1, s2 = cos[p, :half], cos[p, half:], sin[p, :half], sin[p, half:]
            da = rnd(pr(ga[m] * c1) + pr(gb[m] * s2))
            db = rnd(pr(gb[m] * c2) - pr(ga[m] * s1))
        rows.append(torch.stack((da, db), -1).flatten())
    return torch.stack(rows)


def rounder(dtype: torch.dtype, device) -> object:
    """Rounding of fp32 values to ``dtype`` as every backend does it at Megatron's rounding
    points: to nearest even (the kernel rounds with integer arithmetic,
    ``kernels.kv.round_to_16bit``, so Triton's interpreter, which truncates its own fp32 ->
    bf16 conversions, rounds to nearest even there too). ``device`` is kept for the callers."""
    del device
    return lambda x: x.to(dtype).float()


def quantized(*shape: int, dtype: torch.dtype, seed: int, device="cpu") -> torch.Tensor:
    """Gradients that are multiples of 2^-6 below 4 in magnitude: exact in bf16 and fp16, and
    their sums over a few heads exact in fp32 in any order (so a bitwise comparison with
    :func:`megatron_kpe_grad` does not depend on the order of the head sum)."""
    x = randn(*shape, dtype=torch.float32, seed=seed)
    x = (x * 64).round().clamp(-255, 255) / 64
    return x.to(dtype).to(device)


def ref_kv(kv, kpe, pos, cos, sin, pairs_out=False, absolute=False):
    """``kv: [..., H, K + V]``, ``kpe: [..., 1, R]`` fp64 -> (key, value), fp64."""
    tokens = kv.shape[:-2]
    rows = kv.reshape(-1, H, K + V)
    rope = rotate_rows(kpe.reshape(-1, 1, R), pos, cos, sin, False, pairs_out, absolute)
    key = torch.cat((rows[..., :K], rope.expand(-1, H, R)), -1)
    return key.reshape(*tokens, H, K + R), rows[..., K:].reshape(*tokens, H, V)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def make_tables(dtype: torch.dtype, device="cpu", seed: int = 0):
    """Megatron-style ``[P, 1, 1, R]`` tables in the activation dtype.

    The angles of the two halves differ on purpose (real tables repeat them), so that mixing
    up ``cos[j]`` and ``cos[half + j]`` is caught; the 1.3 plays YaRN's folded mscale.
    """
    g = torch.Generator().manual_seed(seed)
    theta = torch.rand(P, R, generator=g, dtype=torch.float64) * 2 * math.pi
    cos, sin = (1.3 * theta.cos()).to(dtype), (1.3 * theta.sin()).to(dtype)
    return cos.view(P, 1, 1, R).to(device), sin.view(P, 1, 1, R).to(device)


def tables64(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return cos.double().cpu().reshape(-1, R), sin.double().cpu().reshape(-1, R)


def tokens_shape(layout: str, cp_size: int) -> tuple[int, ...]:
    return (S, B) if layout == "sbhd" else (CU[-1] // cp_size + PAD,)


def cu_arg(layout: str, device="cpu") -> torch.Tensor | None:
    return None if layout == "sbhd" else torch.tensor(CU, dtype=torch.int32, device=device)


def randn(*shape: int, dtype: torch.dtype, seed: int, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype).to(device)


def f64(x: torch.Tensor) -> torch.Tensor:
    return x.detach().double().cpu()


def assert_within(actual, ref, mag, dtype, terms: float, what: str) -> None:
    """``|actual - ref| <= ulp_dtype(ref) + terms * 2**-24 * mag``, element by element."""
    assert actual.shape == ref.shape, (what, actual.shape, ref.shape)
    assert actual.dtype == dtype, (what, actual.dtype)
    actual = f64(actual)
    fi = torch.finfo(dtype)
    ulp = fi.eps * torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(fi.tiny))))
    tol = ulp + terms * U32 * mag
    err = (actual - ref).abs()
    bad = ~(err <= tol)
    if bad.any():
        i = int((err - tol).argmax())
        pytest.fail(
            f"{what}: {int(bad.sum())} of {err.numel()} elements off; worst at flat index {i}: "
            f"got {actual.flatten()[i].item()!r}, want {ref.flatten()[i].item()!r}, "
            f"tolerance {tol.flatten()[i].item():.3g}"
        )


def q_reference(x, g, pos, cos, sin, inverse, pairs_out):
    """Reference output and input gradient for upstream ``g``, with their error magnitudes."""
    c64, s64 = tables64(cos, sin)
    x64, g64 = f64(x).requires_grad_(), f64(g)
    out = ref_q(x64, pos, c64, s64, inverse, pairs_out)
    (grad,) = torch.autograd.grad(out, x64, g64)
    mag_out = ref_q(x64.detach().abs(), pos, c64, s64, inverse, pairs_out, absolute=True)
    absout = ref_q(x64, pos, c64, s64, inverse, pairs_out, absolute=True)
    (mag_grad,) = torch.autograd.grad(absout, x64, g64.abs())
    return out.detach(), grad, mag_out, mag_grad


# ---------------------------------------------------------------------------------------------
# query
# ---------------------------------------------------------------------------------------------

# (function, inverse, remove_interleaving); the legacy function has neither argument.
Q_VARIANTS = [
    ("fused_apply_mla_rope_for_q", False, False),
    ("fused_mla_rope_inplace", False, False),
    ("fused_mla_rope_inplace", True, False),
    ("fused_mla_rope_inplace", False, True),
    ("fused_mla_rope_inplace", True, True),
    ("fused_mla_rope_out_of_place", False, False),
    ("fused_mla_rope_out_of_place", True, True),
]


def call_q(name, t, cos, sin, cu, cp_rank, cp_size, inverse, ril, position_ids=None):
    fn = getattr(mm, name)
    if name == "fused_apply_mla_rope_for_q":  # positional, as multi_latent_attention.py calls it
        assert not inverse and not ril and position_ids is None
        return fn(t, cos, sin, N, R, cu, cp_rank, cp_size)
    return fn(
        t, cos, sin, N, R, cu_seqlens_q=cu, cp_rank=cp_rank, cp_size=cp_size, inverse=inverse,
        remove_interleaving=ril, position_ids=position_ids,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("variant", Q_VARIANTS, ids=lambda v: f"{v[0]}-inv{v[1]:d}-ril{v[2]:d}")
def test_q_matches_megatron(variant, case, dtype, device):
    name, inverse, ril = variant
    layout, cp_size, cp_rank = case
    inplace = name != "fused_mla_rope_out_of_place"
    cos, sin = make_tables(dtype, device)
    shape = (*tokens_shape(layout, cp_size), H, N + R)
    leaf = randn(*shape, dtype=dtype, seed=1, device=device).requires_grad_()
    g = randn(*shape, dtype=dtype, seed=2, device=device)
    pos = megatron_positions(layout, cp_size, cp_rank)
    want, want_grad, mag, mag_grad = q_reference(leaf, g, pos, cos, sin, inverse, ril)

    t = leaf.clone()  # a non-leaf, as Megatron's q (a view of a projection) is
    before = t.detach().clone()
    out = call_q(name, t, cos, sin, cu_arg(layout, device), cp_rank, cp_size, inverse, ril)

    if inplace:
        assert out.data_ptr() == t.data_ptr()  # Megatron returns t's storage, rotated
        assert torch.equal(t.detach(), out.detach())
    else:
        assert out.data_ptr() != t.data_ptr()
        assert torch.equal(t.detach(), before)  # input untouched
    assert torch.equal(out.detach()[..., :N], before[..., :N])  # nope channels exact
    assert_within(out, want, mag, dtype, 4, "output")

    out.backward(g)
    assert_within(leaf.grad, want_grad, mag_grad, dtype, 4, "grad t")
    assert torch.equal(leaf.grad[..., :N], g[..., :N])


@pytest.mark.parametrize("name", ["fused_mla_rope_inplace", "fused_mla_rope_out_of_place"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_q_position_ids(name, dtype, device):
    """thd position_ids replace the cu_seqlens/CP mapping (cp_rank/cp_size then play no part)."""
    cos, sin = make_tables(dtype, device, seed=3)
    T = 10
    leaf = randn(T, H, N + R, dtype=dtype, seed=4, device=device).requires_grad_()
    g = randn(T, H, N + R, dtype=dtype, seed=5, device=device)
    ids = [0, 15, 3, 3, 7, 1, 14, 2, 9, 0]
    want, want_grad, mag, mag_grad = q_reference(leaf, g, ids, cos, sin, True, True)
    ids_t = torch.tensor(ids, dtype=torch.int64, device=device)
    cu = torch.tensor([0, 4, 8], dtype=torch.int32, device=device)  # ignored, as in Megatron
    out = call_q(name, leaf.clone(), cos, sin, cu, 1, 2, True, True, position_ids=ids_t)
    assert_within(out, want, mag, dtype, 4, "output")
    out.backward(g)
    assert_within(leaf.grad, want_grad, mag_grad, dtype, 4, "grad t")


def test_q_inverse_undoes_forward(device):
    """With a real (unit, half-repeated) table, ``inverse`` undoes the rotation.

    ``remove_interleaving=True`` keeps the pairs where they were, so the inverse call reads what
    the forward call wrote; the nope channels pass through both.
    """
    inv_freq = 10000.0 ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)
    theta = torch.arange(P, dtype=torch.float64)[:, None] * inv_freq
    theta = torch.cat((theta, theta), -1)
    cos = theta.cos().float().view(P, 1, 1, R).to(device)
    sin = theta.sin().float().view(P, 1, 1, R).to(device)
    x = randn(S, B, H, N + R, dtype=torch.float32, seed=7, device=device)
    y = mm.fused_mla_rope_out_of_place(x, cos, sin, N, R, remove_interleaving=True)
    z = mm.fused_mla_rope_out_of_place(y, cos, sin, N, R, inverse=True, remove_interleaving=True)
    # two fp32 rotations by a table rounded to fp32: a few units of 2^-24 of |x|-sized terms
    pos = megatron_positions("sbhd", 1, 0)
    c64, s64 = tables64(cos, sin)
    absx = f64(x).abs()
    mag = ref_q(ref_q(absx, pos, c64, s64, False, True, True), pos, c64, s64, True, True, True)
    assert_within(z, f64(x), mag, torch.float32, 16, "round trip")


def test_q_in_place_on_a_projection_view(device):
    """As multi_latent_attention.py calls it: ``q`` is a view of a linear layer's output.

    The rotation lands in the projection's storage, and the weight gradient equals the one
    through the out-of-place function (the same backward op, so bitwise).
    """
    cos, sin = make_tables(torch.float32, device, seed=18)
    x = randn(S, B, 5, dtype=torch.float32, seed=19, device=device)
    g = randn(S, B, H, N + R, dtype=torch.float32, seed=20, device=device)
    grads = []
    for name in ("fused_apply_mla_rope_for_q", "fused_mla_rope_out_of_place"):
        w = randn(5, H * (N + R), dtype=torch.float32, seed=21, device=device).requires_grad_()
        proj = x @ w  # [S, B, H * (N + R)]
        q = proj.view(S, B, H, N + R)
        out = getattr(mm, name)(q, cos, sin, N, R)
        if name == "fused_apply_mla_rope_for_q":
            assert out.data_ptr() == proj.data_ptr()
            assert torch.equal(proj.detach().view_as(out), out.detach())
        out.backward(g)
        grads.append(w.grad)
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_q_accepts_mlarope_fp32_tables(dtype, device):
    """mlarope's own ``[P, R]`` fp32 tables (exact) work for any activation dtype."""
    cfg = mlarope.YarnConfig(
        dim=R, base=10000.0, factor=40.0, original_max_position_embeddings=4,
        beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
    )  # fmt: skip
    cos, sin = cfg.cos_sin(P, device=device)
    assert cos.shape == (P, R) and cos.dtype == torch.float32
    x = randn(S, B, H, N + R, dtype=dtype, seed=22, device=device)
    out = mm.fused_mla_rope_out_of_place(x, cos, sin, N, R)
    pos = megatron_positions("sbhd", 1, 0)
    c64, s64 = tables64(cos, sin)
    want = ref_q(f64(x), pos, c64, s64)
    mag = ref_q(f64(x).abs(), pos, c64, s64, absolute=True)
    assert_within(out, want, mag, dtype, 4, "output")


# ---------------------------------------------------------------------------------------------
# key/value
# ---------------------------------------------------------------------------------------------

KV_VARIANTS = [
    ("fused_apply_mla_rope_for_kv", False),
    ("fused_mla_rope_kv_split", False),
    ("fused_mla_rope_kv_split", True),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("variant", KV_VARIANTS, ids=lambda v: f"{v[0]}-ril{v[1]:d}")
def test_kv_matches_megatron(variant, case, dtype, device):
    name, ril = variant
    layout, cp_size, cp_rank = case
    cos, sin = make_tables(dtype, device, seed=8)
    tokens = tokens_shape(layout, cp_size)
    kv = randn(*tokens, H, K + V, dtype=dtype, seed=9, device=device).requires_grad_()
    kpe = randn(*tokens, 1, R, dtype=dtype, seed=10, device=device).requires_grad_()
    gk = quantized(*tokens, H, K + R, dtype=dtype, seed=11, device=device)
    gv = randn(*tokens, H, V, dtype=dtype, seed=12, device=device)
    pos = megatron_positions(layout, cp_size, cp_rank)
    c64, s64 = tables64(cos, sin)

    kv64, kpe64 = f64(kv).requires_grad_(), f64(kpe).requires_grad_()
    key64, val64 = ref_kv(kv64, kpe64, pos, c64, s64, ril)
    dkv64, dkpe64 = torch.autograd.grad((key64, val64), (kv64, kpe64), (f64(gk), f64(gv)))
    mag_key, _ = ref_kv(kv64.detach().abs(), kpe64.detach().abs(), pos, c64, s64, ril, True)
    akey, _ = ref_kv(kv64, kpe64, pos, c64, s64, ril, True)
    (mag_dkpe,) = torch.autograd.grad(akey, kpe64, f64(gk).abs())

    fn = getattr(mm, name)
    cu = cu_arg(layout, device)
    if name == "fused_apply_mla_rope_for_kv":  # positional, as multi_latent_attention.py does
        key, value = fn(kv, kpe, cos, sin, R, K, V, cu, cp_rank, cp_size)
    else:
        key, value = fn(
            kv, kpe, cos, sin, R, K, V, cu_seqlens_kv=cu, cp_rank=cp_rank, cp_size=cp_size,
            remove_interleaving=ril,
        )  # fmt: skip

    assert value.untyped_storage().data_ptr() != kv.untyped_storage().data_ptr()  # a new tensor
    assert torch.equal(key.detach()[..., :K], kv.detach()[..., :K])
    assert torch.equal(value.detach(), kv.detach()[..., K:])
    assert_within(key, key64.detach(), mag_key, dtype, 4, "key")
    rope = key.detach()[..., K:]
    assert torch.equal(rope, rope[..., :1, :].expand_as(rope))  # the same for every head

    torch.autograd.backward((key, value), (gk, gv))
    assert torch.equal(f64(kv.grad), dkv64)  # dkv: plain copies of dk's nope part and dv
    if dtype == torch.float32:  # fp32 tables and activations: Megatron's rounding is fp32's
        assert_within(kpe.grad, dkpe64, mag_dkpe, dtype, H + 4, "grad k_pos_emb")
    else:  # the default rounding="megatron": bit for bit as Megatron's unfused path
        rope_grad = gk.detach().float().cpu().reshape(-1, H, K + R)[..., K:]
        want = megatron_kpe_grad(rope_grad, pos, *tables64(cos, sin), ril, rounder(dtype, device),
                                 True)  # fmt: skip
        assert torch.equal(kpe.grad.float().cpu().reshape(-1, R), want)


def _kv_grads(name, dtype, table_dtype, layout, rounding, device):
    """k_pos_emb's gradient through ``name`` (thd: cp 2, rank 1) and what it needs to check it."""
    cos, sin = make_tables(table_dtype, device, seed=33)
    tokens = tokens_shape(layout, 2)
    kv = randn(*tokens, H, K + V, dtype=dtype, seed=34, device=device).requires_grad_()
    kpe = randn(*tokens, 1, R, dtype=dtype, seed=35, device=device).requires_grad_()
    gk = quantized(*tokens, H, K + R, dtype=dtype, seed=36, device=device)
    gv = randn(*tokens, H, V, dtype=dtype, seed=37, device=device)
    kwargs = {} if rounding is None else {"rounding": rounding}
    key, value = getattr(mm, name)(
        kv, kpe, cos, sin, R, K, V, cu_arg(layout, device), 1, 2, **kwargs
    )
    torch.autograd.backward((key, value), (gk, gv))
    pos = megatron_positions(layout, 2, 1)
    return kpe.grad, gk.detach().float().cpu().reshape(-1, H, K + R)[..., K:], pos, cos, sin


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["sbhd", "thd"])
@pytest.mark.parametrize("ril", [False, True])
def test_reference_backend_rounds_as_megatron(ril, layout, dtype):
    """The PyTorch backend (CPU tensors without Triton's interpreter) rounds the k_pos_emb
    gradient to nearest even at Megatron's rounding points, bit for bit; without the flag it
    is the exact result."""
    cos, sin = make_tables(dtype, seed=38)
    tokens = tokens_shape(layout, 2)
    dk = quantized(*tokens, H, K + R, dtype=dtype, seed=39)
    dv = randn(*tokens, H, V, dtype=dtype, seed=40)
    cu = None if layout == "sbhd" else torch.tensor(CU, dtype=torch.int32)
    cp_rank, cp_size = (0, 1) if layout == "sbhd" else (1, 2)
    positions = Positions(layout, cu, None, cp_rank, cp_size)
    tables = (cos.view(P, R), sin.view(P, R))
    kw = dict(k_dim=K, interleaved_in=True, interleaved_out=ril)
    grads = [
        reference.rope_kv_backward(dk, dv, *tables, positions, **kw, megatron_rounding=rounded)
        for rounded in (True, False)
    ]
    pos = megatron_positions(layout, cp_size, cp_rank)
    rope_grad = dk.float().reshape(-1, H, K + R)[..., K:]
    rne = rounder(dtype, "cuda")  # to nearest even, as PyTorch rounds on any device
    want = megatron_kpe_grad(rope_grad, pos, *tables64(cos, sin), ril, rne, True)
    assert torch.equal(grads[0][1].float().reshape(-1, R), want)
    assert torch.equal(grads[0][0], grads[1][0])  # dkv untouched by the flag
    assert not torch.equal(grads[0][1], grads[1][1])
    assert reference.megatron_product_dtype(dtype, dtype) == dtype
    assert reference.megatron_product_dtype(dtype, torch.float32) is None
    assert reference.megatron_product_dtype(torch.bfloat16, torch.float16) is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["sbhd", "thd"])
@pytest.mark.parametrize("ril", [False, True])
def test_kernel_rounds_as_the_reference(ril, layout, dtype, device):
    """The key/value backward kernel with Megatron's rounding equals the PyTorch reference's
    bit for bit (``ops.rope_kv_backward``, the flag both backends share), on every lane.
    (On the H200 this failed in up to 24 ulps while the kernel rounded with
    ``x.to(fp16).to(fp32)``, which the compiler folded away; ``round_to_16bit`` rounds with
    integer arithmetic.)"""
    cos, sin = make_tables(dtype, device, seed=41)
    tokens = tokens_shape(layout, 2)
    dk = quantized(*tokens, H, K + R, dtype=dtype, seed=42, device=device)
    dv = randn(*tokens, H, V, dtype=dtype, seed=43, device=device)
    cu = cu_arg(layout, device)
    cp_rank, cp_size = (0, 1) if layout == "sbhd" else (1, 2)
    call = KVCall(cos.view(P, R), sin.view(P, R), cu, None, None, layout, cp_rank, cp_size, K,
                  True, ril, True, True)  # fmt: skip
    dkv, dkpe = rope_kv_backward(dk, dv, call)
    tables = (cos.view(P, R).cpu(), sin.view(P, R).cpu())
    kw = dict(k_dim=K, interleaved_in=True, interleaved_out=ril, megatron_rounding=True)
    positions = Positions(layout, None if cu is None else cu.cpu(), None, cp_rank, cp_size)
    want_dkv, want = reference.rope_kv_backward(dk.cpu(), dv.cpu(), *tables, positions, **kw)
    assert torch.equal(dkv.cpu(), want_dkv)
    assert torch.equal(dkpe.cpu().view(torch.int16), want.view(torch.int16))


def transpose_rows(total, pos, cos, sin):
    """The exact transpose rotation of ``total: [M, R]`` fp64 (halves, the key's layout) ->
    ``k_pos_emb``'s gradient ``[M, R]`` (pairs) and its error-model magnitudes ``[M, R]``
    (``(|g_a| + |g_b|) * max|table|`` per pair); padding rows (``pos`` None) pass through."""
    half = total.shape[-1] // 2
    want, mag = [], []
    for m, p in enumerate(pos):
        ga, gb = total[m, :half], total[m, half:]
        if p is None:
            da, db, bound = ga, gb, torch.zeros_like(ga)
        else:
            da = ga * cos[p, :half] + gb * sin[p, half:]
            db = gb * cos[p, half:] - ga * sin[p, :half]
            bound = (ga.abs() + gb.abs()) * torch.cat((cos[p], sin[p])).abs().max()
        want.append(torch.stack((da, db), -1).flatten())
        mag.append(torch.stack((bound, bound), -1).flatten())
    return torch.stack(want), torch.stack(mag)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("layout", ["sbhd", "thd"])
def test_kv_exact_rounding_switch(layout, dtype, device):
    """``rounding="exact"``: the k_pos_emb gradient of the fp64 reference, rounded once (as
    mlarope.apply_rope_kv); the default (Megatron's roundings) differs from it here."""
    name = "fused_apply_mla_rope_for_kv"
    exact, gk_rope, pos, cos, sin = _kv_grads(name, dtype, dtype, layout, "exact", device)
    default = _kv_grads(name, dtype, dtype, layout, None, device)[0]
    want, mag = transpose_rows(gk_rope.double().sum(1), pos, *tables64(cos, sin))
    assert_within(exact.reshape(-1, R), want, mag, dtype, H + 4, "exact grad k_pos_emb")
    assert not torch.equal(exact, default)


@pytest.mark.parametrize("table_dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["fused_mla_rope_kv_split", "fused_apply_mla_rope_for_kv"])
def test_kv_megatron_rounding_with_other_tables(name, table_dtype, device):
    """bf16 activations with tables of another dtype: Megatron's kernel promotes the products
    to fp32 (bf16 x fp32, and bf16 x fp16 alike), so only the head sum is rounded to bf16;
    the rotation is then exact within fp32 arithmetic."""
    dtype = torch.bfloat16
    got, gk_rope, pos, cos, sin = _kv_grads(name, dtype, table_dtype, "thd", None, device)
    total = rounder(dtype, device)(gk_rope.sum(1)).double()
    want, mag = transpose_rows(total, pos, *tables64(cos, sin))
    assert_within(got.reshape(-1, R), want, mag, dtype, 4, "grad k_pos_emb")


# ---------------------------------------------------------------------------------------------
# behaviour around autograd and aliasing
# ---------------------------------------------------------------------------------------------


LEAF_CASES = [("sbhd", 1, 0), ("thd", 2, 1)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", LEAF_CASES, ids=_id)
@pytest.mark.parametrize("name", ["fused_mla_rope_inplace", "fused_apply_mla_rope_for_q"])
def test_inplace_on_grad_leaf_as_megatron(name, case, dtype, device):
    """Megatron's tests pass a leaf that requires grad (``x.detach().requires_grad_(True)``)
    straight to the in-place function: it is rotated in place, the returned tensor is on its
    storage, and the leaf's gradient is the rotated-back upstream gradient."""
    layout, cp_size, cp_rank = case
    cos, sin = make_tables(dtype, device, seed=23)
    shape = (*tokens_shape(layout, cp_size), H, N + R)
    leaf = randn(*shape, dtype=dtype, seed=24, device=device).requires_grad_()
    g = randn(*shape, dtype=dtype, seed=25, device=device)
    pos = megatron_positions(layout, cp_size, cp_rank)
    want, want_grad, mag, mag_grad = q_reference(leaf, g, pos, cos, sin, False, False)
    before = leaf.detach().clone()
    version = leaf._version

    out = call_q(name, leaf, cos, sin, cu_arg(layout, device), cp_rank, cp_size, False, False)
    assert out.data_ptr() == leaf.data_ptr() and out.grad_fn is not None
    assert leaf._version > version  # other ops that saved the leaf will notice
    assert torch.equal(leaf.detach(), out.detach())  # the leaf itself holds the rotation
    assert torch.equal(out.detach()[..., :N], before[..., :N])
    assert_within(out, want, mag, dtype, 4, "output")

    out.backward(g)
    assert_within(leaf.grad, want_grad, mag_grad, dtype, 4, "grad t")
    assert torch.equal(leaf.grad[..., :N], g[..., :N])


def test_inplace_on_view_of_grad_leaf(device):
    """A view of a leaf that requires grad is refused by autograd too; Megatron rotates it."""
    cos, sin = make_tables(torch.float32, device, seed=26)
    base = randn(S, B, H, N + R + 3, dtype=torch.float32, seed=27, device=device)
    base.requires_grad_()
    t = base[..., 3:]
    g = randn(S, B, H, N + R, dtype=torch.float32, seed=28, device=device)
    pos = megatron_positions("sbhd", 1, 0)
    want, want_grad, mag, mag_grad = q_reference(t.detach(), g, pos, cos, sin, True, True)
    out = mm.fused_mla_rope_inplace(t, cos, sin, N, R, inverse=True, remove_interleaving=True)
    assert out.data_ptr() == t.data_ptr()
    assert torch.equal(base.detach()[..., 3:], out.detach())
    assert_within(out, want, mag, torch.float32, 4, "output")
    out.backward(g)
    assert torch.equal(base.grad[..., :3], torch.zeros_like(base.grad[..., :3]))
    assert_within(base.grad[..., 3:], want_grad, mag_grad, torch.float32, 4, "grad t")


def test_inplace_on_grad_leaf_saved_by_another_op_raises_at_backward(device):
    """The leaf's version counter moves, so an op that saved it for its backward still raises
    (Megatron's kernel left it unchanged: that op's gradient was silently wrong)."""
    cos, sin = make_tables(torch.float32, device, seed=29)
    leaf = randn(S, B, H, N + R, dtype=torch.float32, seed=30, device=device).requires_grad_()
    saved = leaf * leaf  # mul saves the leaf for its backward
    out = mm.fused_mla_rope_inplace(leaf, cos, sin, N, R)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (saved.sum() + out.sum()).backward()


def test_inplace_on_grad_leaf_inference_paths(device):
    """Without autograd (no_grad, or a leaf that does not require grad) the leaf is rotated in
    place and returned itself; the native API keeps autograd's rule and refuses a leaf that
    requires grad."""
    cos, sin = make_tables(torch.float32, device)
    leaf = randn(S, B, H, N + R, dtype=torch.float32, seed=13, device=device).requires_grad_()
    with torch.no_grad():
        out = mm.fused_mla_rope_inplace(leaf, cos, sin, N, R)
    assert out is leaf
    plain = randn(S, B, H, N + R, dtype=torch.float32, seed=13, device=device)
    assert mm.fused_apply_mla_rope_for_q(plain, cos, sin, N, R) is plain
    assert torch.equal(plain, leaf.detach())
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        mlarope.apply_rope_q(leaf, cos, sin, inplace=True)


def test_inplace_on_grad_leaf_compiled(device):
    """Under ``torch.compile(fullgraph=True)`` the leaf case gives the eager values (written
    into the leaf, its version moved) and the eager gradient; the returned tensor has its own
    storage there (Dynamo cannot keep the alias's autograd edge)."""
    cos, sin = make_tables(torch.float32, device, seed=44)
    x0 = randn(S, B, H, N + R, dtype=torch.float32, seed=45, device=device)
    g = randn(S, B, H, N + R, dtype=torch.float32, seed=46, device=device)

    def rotate(t):
        return mm.fused_mla_rope_inplace(t, cos, sin, N, R, inverse=True)

    results = []
    for fn in (rotate, torch.compile(rotate, fullgraph=True)):
        leaf = x0.clone().requires_grad_()
        version = leaf._version
        out = fn(leaf)
        out.backward(g)
        assert leaf._version > version
        results.append((leaf.detach(), out.detach(), leaf.grad))
    for eager, compiled in zip(*results, strict=True):
        assert torch.equal(eager, compiled)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_inplace_on_a_non_leaf_compiled(backend, device):
    """The usual Megatron case, an activation (not a leaf) that requires grad, rotated in place
    inside ``torch.compile(fullgraph=True)``, and a view of a leaf: the eager values and
    gradient (the check for a view of a leaf called ``_is_view()``, which Dynamo cannot trace,
    and a view of a leaf then went to the native in-place op; found by review)."""
    torch._dynamo.reset()
    cos, sin = make_tables(torch.float32, device, seed=44)
    x0 = randn(S, B, H, N + R, dtype=torch.float32, seed=45, device=device)
    g = randn(S, B, H, N + R, dtype=torch.float32, seed=46, device=device)

    def rotate(t):
        return mm.fused_mla_rope_inplace(t * 1, cos, sin, N, R)

    def rotate_a_view_of_the_leaf(t):
        return mm.fused_mla_rope_inplace(t[:, :], cos, sin, N, R)

    for fn in (rotate, rotate_a_view_of_the_leaf):
        results = []
        for run in (fn, torch.compile(fn, fullgraph=True, backend=backend)):
            x = x0.clone().requires_grad_()
            out = run(x)
            out.backward(g)
            results.append((out.detach(), x.detach(), x.grad))
        for eager, compiled in zip(*results, strict=True):
            assert torch.equal(eager, compiled), fn.__name__


@pytest.mark.parametrize("layout", ["sbhd", "thd"])
def test_out_of_place_equals_in_place_bitwise(layout, device):
    """Megatron's test_out_of_place_inverse_rope_preserves_upstream_saved_output compares the
    two with ``atol=0``: the same bits, and the out-of-place input left as it was."""
    cos, sin = make_tables(torch.bfloat16, device, seed=31)
    x = randn(*tokens_shape(layout, 1), H, N + R, dtype=torch.bfloat16, seed=32, device=device)
    before = x.clone()
    cu = cu_arg(layout, device)
    kwargs = dict(cu_seqlens_q=cu, inverse=True, remove_interleaving=True)
    out = mm.fused_mla_rope_out_of_place(x, cos, sin, N, R, **kwargs)
    ref = mm.fused_mla_rope_inplace(x.clone(), cos, sin, N, R, **kwargs)
    assert torch.equal(x, before) and out.data_ptr() != x.data_ptr()
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))


def test_inplace_on_tensor_saved_for_backward_raises_at_backward(device):
    """Megatron's kernel silently corrupted the saved tensor; mlarope declares the mutation."""
    cos, sin = make_tables(torch.float32, device)
    leaf = randn(S, B, H, N + R, dtype=torch.float32, seed=14, device=device).requires_grad_()
    t = leaf * 2.0
    saved = t * t  # mul saves t for its backward
    mm.fused_mla_rope_inplace(t, cos, sin, N, R)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.sum().backward()


def test_out_of_place_on_tensor_saved_for_backward_is_safe(device):
    cos, sin = make_tables(torch.float32, device)
    leaf = randn(S, B, H, N + R, dtype=torch.float32, seed=15, device=device).requires_grad_()
    t = leaf * 2.0
    saved = t * t
    out = mm.fused_mla_rope_out_of_place(t, cos, sin, N, R, inverse=True)
    (saved.sum() + out.sum()).backward()
    assert leaf.grad is not None and torch.isfinite(leaf.grad).all()


# ---------------------------------------------------------------------------------------------
# signatures and argument checks
# ---------------------------------------------------------------------------------------------

_Q_NEW = [
    ("t", inspect.Parameter.empty), ("cos", inspect.Parameter.empty),
    ("sin", inspect.Parameter.empty), ("nope_dim", inspect.Parameter.empty),
    ("emb_dim", inspect.Parameter.empty), ("cu_seqlens_q", None), ("cp_rank", 0),
    ("cp_size", 1), ("rotary_interleaved", False), ("inverse", False),
    ("remove_interleaving", False), ("position_ids", None),
]  # fmt: skip
_KV = [
    ("kv", inspect.Parameter.empty), ("k_pos_emb", inspect.Parameter.empty),
    ("cos", inspect.Parameter.empty), ("sin", inspect.Parameter.empty),
    ("emb_dim", inspect.Parameter.empty), ("k_dim", inspect.Parameter.empty),
    ("v_dim", inspect.Parameter.empty), ("cu_seqlens_kv", None), ("cp_rank", 0),
    ("cp_size", 1), ("rotary_interleaved", False),
]  # fmt: skip
SIGNATURES = {
    "fused_apply_mla_rope_for_q": [*_Q_NEW[:3], ("qk_head_dim", inspect.Parameter.empty),
                                   *_Q_NEW[4:9]],
    "fused_mla_rope_inplace": _Q_NEW,
    "fused_mla_rope_out_of_place": _Q_NEW,
    "fused_apply_mla_rope_for_kv": _KV,
    "fused_mla_rope_kv_split": [*_KV, ("remove_interleaving", False)],
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signature_matches_megatron(name):
    params = list(inspect.signature(getattr(mm, name)).parameters.values())
    positional = [(p.name, p.default) for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == SIGNATURES[name]
    extra = [p for p in params if p.kind is not p.POSITIONAL_OR_KEYWORD]
    assert all(p.kind is p.KEYWORD_ONLY for p in extra)  # extras never shift positions
    assert name in mm.__all__


def _q_args(**over):
    cos, sin = make_tables(torch.float32)
    args = dict(t=torch.zeros(S, B, H, N + R), cos=cos, sin=sin, nope_dim=N, emb_dim=R)
    args.update(over)
    return args


THD_Q = torch.zeros(CU[-1], H, N + R)
CU_T = torch.tensor(CU, dtype=torch.int32)

Q_BAD = [
    (dict(rotary_interleaved=True), ValueError, "rotary_interleaved"),
    (dict(emb_dim=R - 2), ValueError, "emb_dim"),
    (dict(emb_dim=0), ValueError, "emb_dim"),
    (dict(nope_dim=5), ValueError, "nope_dim"),
    (dict(nope_dim=True), TypeError, "nope_dim"),
    (dict(nope_dim=4.0), TypeError, "nope_dim"),
    (dict(t=torch.zeros(S, H, N + R)), ValueError, "t must be"),
    (dict(t=THD_Q), ValueError, "cu_seqlens_q is None"),
    (dict(t=torch.zeros(S, B, H, N + R), cu_seqlens_q=CU_T), ValueError, "thd"),
    (dict(t="q"), TypeError, "t must be a torch.Tensor"),
    (dict(cos=None), TypeError, "cos"),
    (dict(sin=torch.zeros(P, 1, 1, R + 2)), ValueError, "sin"),
    (dict(cp_size=0), ValueError, "cp_size"),
    (dict(cp_rank=2, cp_size=2), ValueError, "cp_rank"),
    (dict(cp_rank=-1), ValueError, "cp_rank"),
    (dict(inverse=1), TypeError, "inverse"),
    (dict(remove_interleaving=None), TypeError, "remove_interleaving"),
    (dict(t=THD_Q, cu_seqlens_q=CU_T.float()), ValueError, "cu_seqlens_q"),
    (dict(t=THD_Q, cu_seqlens_q=CU_T.view(2, 2)), ValueError, "cu_seqlens_q"),
    (dict(position_ids=torch.zeros(S, dtype=torch.int64)), ValueError, "position_ids"),
    (dict(t=THD_Q, cu_seqlens_q=CU_T, position_ids=torch.zeros(3, dtype=torch.int64)),
     ValueError, "position_ids"),
    (dict(t=THD_Q, cu_seqlens_q=CU_T, position_ids=torch.zeros(CU[-1])), ValueError,
     "position_ids"),
]  # fmt: skip


@pytest.mark.parametrize("over, exc, match", Q_BAD, ids=lambda v: None)
@pytest.mark.parametrize("name", ["fused_mla_rope_inplace", "fused_mla_rope_out_of_place"])
def test_q_bad_arguments(name, over, exc, match):
    with pytest.raises(exc, match=match):
        getattr(mm, name)(**_q_args(**over))


def test_legacy_q_names_qk_head_dim():
    cos, sin = make_tables(torch.float32)
    with pytest.raises(ValueError, match="qk_head_dim"):
        mm.fused_apply_mla_rope_for_q(torch.zeros(S, B, H, N + R), cos, sin, N + 1, R)


def test_mlarope_errors_name_the_megatron_function():
    """A table too short for the sequence is caught by mlarope and reported under our name."""
    cos, sin = make_tables(torch.float32)
    with pytest.raises(ValueError, match="fused_apply_mla_rope_for_q"):
        mm.fused_apply_mla_rope_for_q(torch.zeros(P + 1, B, H, N + R), cos, sin, N, R)


def _kv_args(**over):
    cos, sin = make_tables(torch.float32)
    args = dict(
        kv=torch.zeros(S, B, H, K + V), k_pos_emb=torch.zeros(S, B, 1, R), cos=cos, sin=sin,
        emb_dim=R, k_dim=K, v_dim=V,
    )  # fmt: skip
    args.update(over)
    return args


KV_BAD = [
    (dict(rotary_interleaved=True), ValueError, "rotary_interleaved"),
    (dict(v_dim=V + 1), ValueError, "k_dim \\+ v_dim"),
    (dict(k_dim=0), ValueError, "k_dim"),
    (dict(emb_dim=R + 2), ValueError, "emb_dim"),
    (dict(k_pos_emb=torch.zeros(S, B, 1, R + 2)), ValueError, "k_pos_emb"),
    (dict(k_pos_emb=torch.zeros(S, B + 1, 1, R)), ValueError, "k_pos_emb"),
    (dict(k_pos_emb=torch.zeros(S, B, 1, R, dtype=torch.bfloat16)), TypeError, "k_pos_emb"),
    (dict(kv=torch.zeros(S, H, K + V)), ValueError, "kv must be"),
    (dict(cu_seqlens_kv=CU_T), ValueError, "kv must be"),
    (dict(cp_rank=1), ValueError, "cp_rank"),
    (dict(remove_interleaving=0), TypeError, "remove_interleaving"),
    (dict(rounding="fast"), ValueError, "rounding"),
    (dict(rounding=None), TypeError, "rounding"),
    (dict(kv=None), TypeError, "kv"),
]  # fmt: skip


@pytest.mark.parametrize("over, exc, match", KV_BAD, ids=lambda v: None)
def test_kv_bad_arguments(over, exc, match):
    with pytest.raises(exc, match=match):
        mm.fused_mla_rope_kv_split(**_kv_args(**over))


def test_k_pos_emb_without_head_axis_is_accepted():
    """``[S, B, R]`` works like ``[S, B, 1, R]`` (Megatron views it flat too)."""
    cos, sin = make_tables(torch.float32)
    kv = randn(S, B, H, K + V, dtype=torch.float32, seed=16)
    kpe = randn(S, B, 1, R, dtype=torch.float32, seed=17)
    k1, v1 = mm.fused_apply_mla_rope_for_kv(kv, kpe, cos, sin, R, K, V)
    k2, v2 = mm.fused_apply_mla_rope_for_kv(kv, kpe.view(S, B, R), cos, sin, R, K, V)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)


@triton.jit
def _round_kernel(x_ptr, y_ptr, n, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    tl.store(y_ptr + o, round_to_16bit(tl.load(x_ptr + o, mask=m), DTYPE), mask=m)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_round_to_16bit_is_torchs_rounding(dtype, device):
    """``kernels.kv.round_to_16bit`` (Megatron's rounding points in the kernel) rounds fp32 to
    ``dtype`` exactly as PyTorch's conversion does: ties, subnormals of both formats, the
    largest finite values and overflow, infinities and NaN, on both lanes. A kernel that rounds
    through ``x.to(dtype).to(fp32)`` fails this on the GPU (the compiler folds the pair)."""
    g = torch.Generator().manual_seed(5)
    finfo = torch.finfo(dtype)
    lowp = torch.randn(4096, generator=g).to(dtype).float()
    mantissa_bits = 7 if dtype == torch.bfloat16 else 10
    step = lowp.abs() * 2.0 ** -(mantissa_bits + 1)  # about half a spacing: ties, and near them
    specials = torch.tensor(
        [0.0, -0.0, finfo.max, -finfo.max, finfo.tiny, finfo.tiny / 2, finfo.tiny / 3,
         2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -25, 2.0 ** -26, 65504.0, 65519.0, 65520.0, 65536.0,
         1e30, -1e30, 3.4e38, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-45],
    )  # fmt: skip
    x = torch.cat((
        lowp + step, lowp - step, lowp + step / 3, torch.randn(4096, generator=g) * 1e-5,
        torch.randn(2048, generator=g) * 1e4, torch.randn(2048, generator=g), specials,
    ))  # fmt: skip
    x = x.to(device)
    y = torch.empty_like(x)
    n = x.numel()
    tl_dtype = tl.bfloat16 if dtype == torch.bfloat16 else tl.float16
    _round_kernel[(triton.cdiv(n, 1024),)](x, y, n, tl_dtype, 1024)
    want = x.cpu().to(dtype).float()
    got = y.cpu()
    same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
    assert bool(same.all()), (
        f"{int((~same).sum())} of {n} differ; first x = {x.cpu()[~same][:4].tolist()}: "
        f"got {got[~same][:4].tolist()}, want {want[~same][:4].tolist()}"
    )


def test_inplace_on_a_leaf_under_torch_func_and_forward_ad(device):
    """The in-place functions on a leaf (``_LeafAlias``) under ``torch.func.grad`` and
    forward-mode AD: the out-of-place function's gradient and tangent (torch.func refused a
    Function without ``setup_context``, forward AD one without ``jvp``; found by review)."""
    from torch.autograd import forward_ad as fwad

    cos, sin = make_tables(torch.float32, device, seed=47)
    x = randn(S, B, H, N + R, dtype=torch.float32, seed=48, device=device)
    w = randn(S, B, H, N + R, dtype=torch.float32, seed=49, device=device)
    tangent = randn(S, B, H, N + R, dtype=torch.float32, seed=50, device=device)

    def in_place(t):
        return mm.fused_mla_rope_inplace(t, cos, sin, N, R)

    def out_of_place(t):
        return mm.fused_mla_rope_out_of_place(t, cos, sin, N, R)

    want = torch.func.grad(lambda t: (out_of_place(t) * w).sum())(x)
    got = torch.func.grad(lambda t: (in_place(t) * w).sum())(x.clone())
    assert torch.equal(got, want)
    with fwad.dual_level():
        want = fwad.unpack_dual(out_of_place(fwad.make_dual(x, tangent))).tangent
        leaf = x.clone().requires_grad_()
        got = fwad.unpack_dual(in_place(fwad.make_dual(leaf, tangent))).tangent
    assert torch.equal(got, want)
