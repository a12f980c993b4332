"""The round trip that proves each cache layout: a tiny DeepSeek-V3-shaped MLA decode step.

Context tokens are appended into a paged cache (random slots, padding tokens among them) with
``rope_append_kv_cache``; the decode queries are built with ``rope_decode_query``; the cache is
read back by slot with ``read_kv_cache`` (written from the owners' documented layouts) and
dequantized, and absorbed-MLA attention runs on it in float64 (MQA over ``[c | k_rope]``, the
model's softmax scale, ``o = W_UV (p @ c)``). It must equal non-absorbed attention
(``k_nope = W_UK c``, ``v = W_UV c``, float64 rotations) on the same weights, within the error
model of what the cache and the query hold:

- the latent is a copy (16-bit caches) or exactly ``e4m3(c / s) * s`` (FP8: ``s`` the
  per-tensor scale, or FlashMLA's tile scale from a float64 rule), so the non-absorbed side
  uses that value (computed here with torch's own conversion, not read from the cache);
- each rotated value is its float64 rotation rounded once (bf16) or quantized once (e4m3), and
  may be one step off only where a rounding boundary lies within the fp32 arithmetic's reach
  of the truth (``stored_model``);
- the absorbed bf16 query is the float64 ``q_nope @ W_UK`` rounded once; an FP8 query is exactly
  the e4m3 of that, and the non-absorbed side then takes the ``q_nope`` whose absorption is
  that value (``W_UK`` square there).

So, element by element, every value read back is within its bound of the model, and the
attention outputs differ by at most what those bounds allow, propagated rigorously: a score
moves by at most ``E = sigma * sum_i (|q_i| dk_i + dq_i |k_i| + dq_i dk_i)``, each probability by
a factor within ``exp(+-2E)``, so ``|do| <= (exp(2E) - 1) * sum_t p_t |v_t|``. A deliberately
misread cache (rope pairs in the other layout, FP8 tile scales in the wrong order) fails both:
the check can fail.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from mlarope import serving
from mlarope.serving import reference as ref
from mlarope.tools.errmodel import ulp
from tests.serving_support import exact_tile_scales, rope_arith, rope_truth, stored_model, tables

HEADS, V_DIM, ROPE = 4, 16, 64
N_CTX, N_QUERIES, BLOCK_SIZE, N_BLOCKS = 9, 3, 4, 5
KV_SCALE, Q_SCALE = 0.05, 0.01


@dataclass(frozen=True)
class Setup:
    fmt: str
    cache_dtype: torch.dtype  # fp8_656: uint8 records
    q_fp8: bool
    latent: int = 128
    nope: int = 16  # the query's nope channels before absorption (P)


SETUPS = [
    Setup("concat", torch.bfloat16, False),
    Setup("concat", torch.float8_e4m3fn, True, latent=32, nope=32),
    Setup("split", torch.bfloat16, False),
    Setup("split", torch.uint8, False),
    Setup("fp8_656", torch.uint8, False, latent=512),
]


def _ids(s: Setup) -> str:
    return f"{s.fmt}-{str(s.cache_dtype).removeprefix('torch.')}-q_{'fp8' if s.q_fp8 else 'bf16'}"


def _fp8(dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.uint8)


def _attention(q, k, v, sigma):
    """float64 ``softmax(sigma q k^T)`` and the output: ``q: [S, H, D]``, ``k: [H, T, D]``,
    ``v(p)`` the output of the probabilities ``[S, H, T]``."""
    p = torch.softmax(sigma * torch.einsum("shd,htd->sht", q, k), dim=-1)
    return p, v(p)


def _latent_model(setup: Setup, c: torch.Tensor) -> torch.Tensor:
    """What the cache's latent holds, from torch's own conversion, dequantized as the reader
    does (``code * scale`` in fp32)."""
    c32 = c.float()
    if setup.fmt == "fp8_656":
        s = exact_tile_scales(c).repeat_interleave(128, dim=1)
    elif _fp8(setup.cache_dtype):
        s = torch.tensor(KV_SCALE, dtype=torch.float32)
    else:
        return c.double()
    return ((c32 / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).double()


@pytest.mark.parametrize("setup", SETUPS, ids=_ids)
def test_absorbed_decode_through_the_cache(device, setup):
    gen = torch.Generator().manual_seed(21)
    lat, nope = setup.latent, setup.nope
    sigma = (nope + ROPE) ** -0.5 * 1.3  # a softmax scale with an mscale factor, as DeepSeek-V3's
    cos, sin = tables(ROPE, 64, device)
    w_uk = torch.randn(HEADS, nope, lat, generator=gen, dtype=torch.float64) / lat**0.5
    w_uv = torch.randn(HEADS, V_DIM, lat, generator=gen, dtype=torch.float64) / lat**0.5
    c = torch.randn(N_CTX, lat, generator=gen)
    if setup.fmt == "fp8_656":
        c *= torch.tensor([0.01, 1.0, 4.0, 0.25]).repeat_interleave(128)
    c = c.to(torch.bfloat16)
    k_pe = torch.randn(N_CTX, ROPE, generator=gen).to(torch.bfloat16)
    ctx_pos = torch.arange(N_CTX) + 5
    qn = torch.randn(N_QUERIES, HEADS, nope, generator=gen, dtype=torch.float64)
    q_pe = torch.randn(N_QUERIES, HEADS, ROPE, generator=gen).to(torch.bfloat16)
    q_pos = torch.tensor([N_CTX + 5, N_CTX + 9, 40])

    # -- the engine's side: append the context (two padding tokens among it), build the query
    slots = torch.randperm(N_BLOCKS * BLOCK_SIZE, generator=gen)[:N_CTX]
    order = torch.tensor([0, 1, 2, -1, 3, 4, 5, 6, -1, 7, 8])
    pick = order.clamp(min=0)
    batch_slots = torch.where(order >= 0, slots[pick], -1)
    if setup.fmt == "fp8_656":
        cache = torch.zeros(N_BLOCKS, BLOCK_SIZE, 656, dtype=torch.uint8, device=device)
    elif setup.fmt == "concat":
        shape = (N_BLOCKS, BLOCK_SIZE, lat + ROPE)
        cache = torch.zeros(shape, dtype=setup.cache_dtype, device=device)
    else:
        cache = (
            torch.zeros(N_BLOCKS, BLOCK_SIZE, lat, dtype=setup.cache_dtype, device=device),
            torch.zeros(N_BLOCKS, BLOCK_SIZE, ROPE, dtype=setup.cache_dtype, device=device),
        )
    kv_scale = KV_SCALE if _fp8(setup.cache_dtype) and setup.fmt != "fp8_656" else None
    serving.rope_append_kv_cache(
        c[pick].to(device), k_pe[pick].to(device), cos, sin, ctx_pos[pick].to(device), cache,
        batch_slots.to(device), cache_format=setup.fmt, kv_scale=kv_scale,
    )  # fmt: skip
    q_lat = torch.einsum("shp,hpl->shl", qn, w_uk)  # absorbed, float64
    q_lat16 = q_lat.to(torch.bfloat16)
    q_cat = serving.rope_decode_query(
        q_lat16.to(device), q_pe.to(device), cos, sin, q_pos.to(device),
        out_dtype=torch.float8_e4m3fn if setup.q_fp8 else None,
        q_scale=Q_SCALE if setup.q_fp8 else None,
    ).cpu()  # fmt: skip

    # -- read back and dequantize
    c_hat, kr_hat = serving.read_kv_cache(
        cache, slots.to(device), cache_format=setup.fmt, rope_dim=ROPE, kv_scale=kv_scale
    )
    c_hat, kr_hat = c_hat.cpu().double(), kr_hat.cpu().double()
    q_scale32 = torch.tensor(Q_SCALE, dtype=torch.float32)  # dequantized in fp32, as the cache
    q_hat = (ref.e4m3_decode(q_cat) * q_scale32).double() if setup.q_fp8 else q_cat.double()

    # -- what each part must hold (the model), and how far it may be from it
    flags = dict(interleaved_in=True, interleaved_out=True)
    kr_dtype = torch.bfloat16 if setup.fmt == "fp8_656" else setup.cache_dtype
    kr_model, b_kr = stored_model(
        rope_truth(k_pe, cos, sin, ctx_pos, **flags),
        rope_arith(k_pe, cos, sin, ctx_pos, **flags), kr_dtype, KV_SCALE,
    )  # fmt: skip
    q_dtype = torch.float8_e4m3fn if setup.q_fp8 else torch.bfloat16
    qr_model, b_qr = stored_model(
        rope_truth(q_pe, cos, sin, q_pos, **flags), rope_arith(q_pe, cos, sin, q_pos, **flags),
        q_dtype, Q_SCALE,
    )  # fmt: skip
    c_model = _latent_model(setup, c)
    if setup.q_fp8:  # exactly e4m3 of the bf16 input; the q_nope that absorbs to it
        q_lat_model = (q_lat16.float() / q_scale32).clamp(-448, 448)
        q_lat_model = (q_lat_model.to(torch.float8_e4m3fn).float() * q_scale32).double()
        b_qn = torch.zeros_like(q_lat)
        target = q_lat_model.transpose(0, 1).unsqueeze(-1)  # [H, S, L, 1]
        qn_used = torch.linalg.solve(w_uk.transpose(1, 2).unsqueeze(1), target)
        qn_used = qn_used.squeeze(-1).transpose(0, 1)
    else:  # the float64 absorption rounded once to bf16 (the op copies it)
        # half an ulp, and torch's float64 -> bf16 conversion rounds through fp32 first
        b_qn = ulp(q_lat.abs(), torch.bfloat16) / 2 + q_lat.abs() * 2.0**-24
        q_lat_model, qn_used = q_lat, qn

    # 1. element by element
    _within(c_hat, c_model, torch.zeros_like(c_model), "latent read back")
    _within(kr_hat, kr_model, b_kr, "k rope read back")
    _within(q_hat[..., :lat], q_lat_model, b_qn, "query nope")
    _within(q_hat[..., lat:], qr_model, b_qr, "query rope")

    # 2. attention: non-absorbed on the model's values vs absorbed on what was read back
    k_nope = torch.einsum("hpl,tl->htp", w_uk, c_model)
    v = torch.einsum("hvl,tl->htv", w_uv, c_model)
    k_full = torch.cat((k_nope, kr_model.expand(HEADS, -1, -1)), -1)
    p, o = _attention(
        torch.cat((qn_used, qr_model), -1), k_full,
        lambda p: torch.einsum("sht,htv->shv", p, v), sigma,
    )  # fmt: skip
    q_abs = torch.cat((q_lat_model, qr_model), -1)
    k_abs = torch.cat((c_model, kr_model), -1)  # [T, L + R]
    _, o_absorbed = _attention(
        q_abs, k_abs.expand(HEADS, -1, -1),
        lambda p: torch.einsum("hvl,shl->shv", w_uv, p @ c_model), sigma,
    )  # fmt: skip
    assert torch.allclose(o_absorbed, o, rtol=0, atol=1e-12), "the absorption identity"

    def absorbed(c_read, kr_read):
        k_read = torch.cat((c_read, kr_read), -1).expand(HEADS, -1, -1)
        return _attention(
            q_hat, k_read, lambda p: torch.einsum("hvl,shl->shv", w_uv, p @ c_read), sigma
        )[1]

    b_q = torch.cat((b_qn, b_qr), -1)
    b_k = torch.cat((torch.zeros_like(c_model), b_kr), -1)
    err_score = sigma * (
        torch.einsum("shd,td->sht", q_abs.abs(), b_k)
        + torch.einsum("shd,td->sht", b_q, k_abs.abs())
        + torch.einsum("shd,td->sht", b_q, b_k)
    )
    e_max = err_score.amax(-1, keepdim=True)
    bound = (torch.exp(2 * e_max) - 1) * torch.einsum("sht,htv->shv", p, v.abs()) + 1e-12
    err = (absorbed(c_hat, kr_hat) - o).abs()
    assert bool((err <= bound).all()), (
        f"absorbed attention through the {setup.fmt} cache is off by {float(err.max()):.3e}, "
        f"beyond the error model's {float(bound.flatten()[err.flatten().argmax()]):.3e}"
    )

    # 3. a misread cache fails: rope pairs read in the other layout, or tile scales swapped
    misread_kr = kr_hat.view(N_CTX, ROPE // 2, 2).transpose(1, 2).reshape(N_CTX, ROPE)
    assert not _is_within(misread_kr, kr_model, b_kr)
    assert not bool((absorbed(c_hat, misread_kr) - o).abs().le(bound).all())
    if setup.fmt == "fp8_656":
        s = exact_tile_scales(c).double().view(N_CTX, 4, 1)
        misread_c = (c_hat.view(N_CTX, 4, 128) / s * s.flip(1)).view(N_CTX, -1)
        assert not _is_within(misread_c, c_model, torch.zeros_like(c_model))
        assert not bool((absorbed(misread_c, kr_hat) - o).abs().le(bound).all())


def _is_within(got, want, bound) -> bool:
    return bool(((got - want).abs() <= bound).all())


def _within(got, want, bound, what: str) -> None:
    err = (got - want).abs()
    assert bool((err <= bound).all()), (
        f"{what}: {int((err > bound).sum())} elements outside the error model, worst "
        f"{float((err - bound).max()):.3e} over"
    )
