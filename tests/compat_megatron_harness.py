"""The harness of ``mlarope.compat.megatron``'s tests (``tests/test_compat_megatron_*.py``):
an independent fp64 restatement of Megatron-Core's semantics, and the inputs and tolerances
the tests share.

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

import math

import pytest
import torch

from mlarope.compat import megatron as mm

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


def case_id(case: tuple[str, int, int]) -> str:
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


def call_q(name, t, cos, sin, cu, cp_rank, cp_size, inverse, ril, position_ids=None):
    fn = getattr(mm, name)
    if name == "fused_apply_mla_rope_for_q":  # positional, as multi_latent_attention.py calls it
        assert not inverse and not ril and position_ids is None
        return fn(t, cos, sin, N, R, cu, cp_rank, cp_size)
    return fn(
        t, cos, sin, N, R, cu_seqlens_q=cu, cp_rank=cp_rank, cp_size=cp_size, inverse=inverse,
        remove_interleaving=ril, position_ids=position_ids,
    )  # fmt: skip
