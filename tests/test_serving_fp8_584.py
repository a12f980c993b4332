"""``rope_append_kv_cache(..., cache_format="fp8_584")``: DeepSeek-V4's FP8 KV cache as FlashMLA
defines it (``FP8KVCacheLayout.MODEL1_FP8Sparse`` in its ``tests/quant.py``), on the Triton
kernels (the interpreter in the CPU lane, the GPU in the GPU lane) and the PyTorch backend.

Caches are allocated as FlashMLA allocates them (blocks padded to a multiple of 576 bytes, the
view ``[num_blocks, block_size, 1, 584]``) and start as random bytes; for every case:

- the bytes FlashMLA's quantizer writes for the tokens (its rule transcribed here: fp32
  ``amax / 448``, ``2 ** ceil(log2(max(., 1e-4)))`` with torch's fp32 ``log2``, UE8M0 scales,
  torch's e4m3 conversion of ``x / s``; data rows at ``576 e``, scale rows at ``576 block_size
  + 8 e``) are what ours writes, byte for byte, latent codes and scale bytes;
- every other byte (other slots, padding and out-of-range tokens, each scale row's pad byte,
  the block padding past ``584 block_size``) is unchanged;
- the rope values (bf16) are within one rounding of the float64 rotation (NaN outside the
  table), and the two backends store the same bytes everywhere but there (fused multiply-adds
  in the kernels).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

# Imported before a test sets TRITON_INTERPRET=0 for the PyTorch backend: Triton decides at a
# kernel's import whether it runs interpreted.
import mlarope
import mlarope.kernels.serving
from mlarope import serving
from mlarope.serving import reference as ref
from tests.serving_support import (
    assert_within,
    flashmla_model1_scales,
    model1_cache,
    rope_arith,
    rope_truth,
    stored_tolerance,
    tables,
)

L, R, N_BLOCKS, ROWS = 448, 64, 3, 40


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype = torch.bfloat16
    cache_dtype: torch.dtype = torch.uint8
    four_d: bool = True
    block_size: int = 4
    interleaved: bool = True
    interleaved_out: bool = True
    fused: bool = True  # kv_c, k_pe: slices of one [T, 512] projection output (V4's wkv)
    index_dtype: torch.dtype = torch.int64


CASES = [
    Case(),
    Case(dtype=torch.float16, four_d=False, index_dtype=torch.int32),
    Case(dtype=torch.float32, cache_dtype=torch.float8_e4m3fn, interleaved=False),
    Case(cache_dtype=torch.int8, interleaved_out=False, fused=False),
    Case(block_size=3),  # not a power of two: the kernel divides
    Case(block_size=2),  # FlashMLA's smallest test block (1,168 bytes, padded to 1,728)
    Case(block_size=72),  # 72 * 584 is a multiple of 576: no padding
]


def _case_id(case: Case) -> str:
    default = Case()
    parts = []
    for name in Case.__dataclass_fields__:
        value = getattr(case, name)
        if value != getattr(default, name):
            value = str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value
            parts.append(f"{name}={value}")
    return ",".join(parts) or "default"


def _inputs(case: Case, device, gen):
    bs = case.block_size
    capacity = N_BLOCKS * bs
    # padding (-1), a negative slot, one past the cache, the last slot; one position past the
    # table; tiles of very different magnitudes, one all zero
    slots = [1, -1, 0, capacity, capacity - 1, -5, 2]
    positions = [3, 9, ROWS + 2, 0, ROWS - 1, 17, 30]
    t = len(slots)
    proj = torch.randn(t, L + R, generator=gen)
    proj[:, :L] *= torch.tensor([1e-3, 1.0, 300.0, 0.0, 2.0**-20, 7.0, 1e4]).repeat_interleave(64)
    proj = proj.to(case.dtype).to(device)
    kv_c, k_pe = proj[:, :L], proj[:, L:]
    if not case.fused:
        kv_c, k_pe = kv_c.contiguous(), k_pe.contiguous()
    slots = torch.tensor(slots, dtype=case.index_dtype, device=device)
    positions = torch.tensor(positions, dtype=case.index_dtype, device=device)
    return kv_c, k_pe, slots, positions


def _run(case: Case, device, backend: str):
    gen = torch.Generator().manual_seed(5)
    raw, cache = model1_cache(N_BLOCKS, case.block_size, device, dtype=case.cache_dtype,
                              four_d=case.four_d, gen=gen)  # fmt: skip
    kv_c, k_pe, slots, positions = _inputs(case, device, gen)
    cos, sin = tables(R, ROWS, device)
    before = raw.cpu().clone()
    previous = os.environ.get("TRITON_INTERPRET")
    if backend == "reference":
        os.environ["TRITON_INTERPRET"] = "0"
    try:
        serving.rope_append_kv_cache(
            kv_c, k_pe, cos, sin, positions, cache, slots, cache_format="fp8_584",
            interleaved=case.interleaved, interleaved_out=case.interleaved_out,
        )  # fmt: skip
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous
    inputs = (kv_c.cpu(), k_pe.cpu(), slots.cpu(), positions, cos, sin)
    return before, raw.cpu().clone(), cache, inputs


def _written(slots: torch.Tensor, block_size: int) -> list[tuple[int, int]]:
    capacity = N_BLOCKS * block_size
    return [(t, s) for t, s in enumerate(slots.tolist()) if 0 <= s < capacity]


def _rope_bytes(block_size: int, written) -> torch.Tensor:
    """Where the written tokens' rope values lie in the raw blocks."""
    mask = torch.zeros(N_BLOCKS, -(-block_size * 584 // 576) * 576, dtype=torch.bool)
    for _, s in written:
        b, e = divmod(s, block_size)
        mask[b, 576 * e + 448 : 576 * e + 576] = True
    return mask


def flashmla_bytes(before, kv_c, rope_bits, written, block_size) -> torch.Tensor:
    """The raw blocks after FlashMLA's MODEL1 quantizer wrote the tokens ``written`` into
    ``before`` (its recipe, transcribed: the tile scales of ``flashmla_model1_scales`` stored as
    UE8M0, the codes torch's e4m3 conversion of ``x / s``, the rope part's bf16 bits
    ``rope_bits [T, 64]`` (int16) after the codes, the scale rows after all data rows)."""
    out = before.clone()
    x = kv_c.float()
    scales = flashmla_model1_scales(x)
    e8m0 = scales.to(torch.float8_e8m0fnu).view(torch.uint8)
    codes = (x.reshape(-1, 7, 64) / scales.unsqueeze(-1)).to(torch.float8_e4m3fn)
    codes = codes.view(torch.uint8).reshape(-1, L)
    for t, s in written:
        b, e = divmod(s, block_size)
        out[b, 576 * e : 576 * e + 448] = codes[t]
        out[b, 576 * e + 448 : 576 * e + 576] = rope_bits[t].view(torch.uint8)
        out[b, 576 * block_size + 8 * e : 576 * block_size + 8 * e + 7] = e8m0[t]
    return out


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_fp8_584_is_flashmla_bytes(device, case):
    backends = ["kernel"] if device.type == "cuda" else ["kernel", "reference"]
    results = {b: _run(case, device, b) for b in backends}
    before, _, _, (kv_c, k_pe, slots, positions, cos, sin) = results["kernel"]
    bs = case.block_size
    written = _written(slots, bs)
    rope_mask = _rope_bytes(bs, written)
    tokens = torch.tensor([t for t, _ in written])
    chosen = torch.tensor([s for _, s in written])
    for backend, (_, after, cache, _) in results.items():
        what = f"{backend} {_case_id(case)}"
        # everything but the rope values: FlashMLA's bytes, and untouched bytes elsewhere
        # (the rope bits are taken from what was written, and checked below)
        rope_bits = torch.zeros(kv_c.shape[0], R, dtype=torch.int16)
        for t, s in written:
            b, e = divmod(s, bs)
            rope_bits[t] = after[b, 576 * e + 448 : 576 * e + 576].view(torch.int16)
        want = flashmla_bytes(before, kv_c, rope_bits, written, bs)
        differ = (after != want).nonzero()
        first = differ[:4].tolist()
        assert differ.numel() == 0, f"{what}: {differ.shape[0]} bytes differ, first at {first}"
        # the rope values: one rounding of the float64 rotation
        _, rope = serving.read_kv_cache(cache, chosen.to(cache.device), cache_format="fp8_584")
        flags = dict(interleaved_in=case.interleaved, interleaved_out=case.interleaved_out)
        truth = rope_truth(k_pe[tokens], cos, sin, positions[tokens], **flags)
        arith = rope_arith(k_pe[tokens], cos, sin, positions[tokens], **flags)
        assert_within(rope.cpu(), truth, stored_tolerance(truth, arith, torch.bfloat16),
                      f"{what}: rope values")  # fmt: skip
        assert truth.isnan().any(), "the cases include a position outside the table"
    if "reference" in results:
        k, r = results["kernel"][1], results["reference"][1]
        assert torch.equal(k[~rope_mask], r[~rope_mask]), "kernel and reference differ"


def test_fp8_584_reads_back_what_flashmla_dequantizes(device):
    """``read_kv_cache`` gives FlashMLA's dequantization (``dequantize_k_cache``: codes times
    the UE8M0 scale, exact in bf16 as in fp32) and the rope values."""
    gen = torch.Generator().manual_seed(2)
    _, cache = model1_cache(2, 4, device)
    kv_c = (torch.randn(5, L, generator=gen) * 3).to(torch.bfloat16).to(device)
    k_pe = torch.randn(5, R, generator=gen).to(torch.bfloat16).to(device)
    cos, sin = tables(R, ROWS, device)
    slots = torch.tensor([6, 0, 3, 7, 1], device=device)
    positions = torch.tensor([0, 1, 2, 3, 4], device=device)
    serving.rope_append_kv_cache(kv_c, k_pe, cos, sin, positions, cache, slots,
                                 cache_format="fp8_584")  # fmt: skip
    latent, rope = serving.read_kv_cache(cache, slots, cache_format="fp8_584")
    x = kv_c.cpu().float()
    scales = flashmla_model1_scales(x)
    codes = (x.reshape(-1, 7, 64) / scales[..., None]).to(torch.float8_e4m3fn)
    flashmla = (codes.to(torch.bfloat16) * scales.to(torch.bfloat16)[..., None]).reshape(-1, L)
    assert torch.equal(latent.cpu(), flashmla.float())
    assert rope.shape == (5, R) and rope.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scale_rule_is_flashmlas_for_every_16_bit_tile_maximum(dtype):
    """For every bf16 (fp16) value as a tile's maximum, the exact rule (``pow2_tile_scales``,
    from the bits) gives FlashMLA's fp32 ``2 ** ceil(log2(max(amax / 448, 1e-4)))``: a 16-bit
    ``amax / 448`` is never within a few fp32 ulp above a power of two, where FlashMLA's fp32
    ``log2`` rounds down to the integer (DeepSeek-V4's latent is bf16)."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype).float()
    amax = every[every.isfinite()].abs()
    tiles = torch.zeros(amax.shape[0], 1, 64)
    tiles[:, 0, 0] = amax
    ours = ref.pow2_tile_scales(tiles)[:, 0]
    flashmla = torch.pow(2, (amax / 448.0).clamp_min(1e-4).log2().ceil())
    assert torch.equal(ours, flashmla)
    assert torch.equal(ref.e8m0_encode(ours), ours.to(torch.float8_e8m0fnu).view(torch.uint8))


def test_fp32_latents_where_flashmlas_log2_rounds_down():
    """An fp32 tile maximum whose quotient is an ulp above a power of two: FlashMLA's fp32
    ``log2`` returns the integer below, so its scale is half the ceiling (and the tile's
    largest code saturates at 448); ours is the exact ceiling, so nothing saturates. The one
    documented difference (docs/serving.md), and only for fp32 inputs."""
    # the quotient is 2**-5 (1 + 2**-23); FlashMLA's fp32 log2 of it is exactly -5
    amax = torch.tensor([448.0 * 2.0**-5]).nextafter(torch.tensor([float("inf")]))
    x = torch.zeros(1, L)
    x[0, 0] = amax
    flashmla = flashmla_model1_scales(x)[0, 0]
    ours = ref.pow2_tile_scales(x.reshape(1, 7, 64))[0, 0]
    assert float(flashmla) == 2.0**-5 and float(ours) == 2.0**-4
    assert float(amax) / float(ours) <= 448.0 < float(amax) / float(flashmla)


@pytest.mark.parametrize("backend", ["kernels", "reference"])
def test_fp8_584_strides_no_address_depends_on(device, backend, monkeypatch):
    """An entry stride with one entry a block, and a block stride with one block, are strides no
    byte's address depends on, and the checks let them be anything: an odd one broke the
    kernels' int16 view of the cache (block size 1: every call; one block: the plan's replay,
    from the second call on). Both backends, three calls each, write FlashMLA's bytes."""
    if backend == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    cos, sin = mlarope.YarnConfig(dim=64).cos_sin(64, device=device)
    g = torch.Generator().manual_seed(5)
    kv_c = torch.randn(2, 448, generator=g).to(torch.bfloat16).to(device)
    k_pe = torch.randn(2, 64, generator=g).to(torch.bfloat16).to(device)
    pos = torch.tensor([1, 2], device=device)
    layouts = [  # (raw bytes, shape, strides, slots)
        ((2, 1152), (2, 1, 1, 584), (1152, 7, 7, 1), [0, 1]),  # block size 1, odd entry stride
        ((1, 2944), (1, 5, 1, 584), (2921, 584, 584, 1), [0, 4]),  # one block, odd block stride
    ]
    for raw_shape, shape, strides, slots in layouts:
        raw = torch.zeros(raw_shape, dtype=torch.uint8, device=device)
        cache = raw.as_strided(shape, strides)
        want = torch.zeros(raw_shape, dtype=torch.uint8)
        ref.append_kv_cache(kv_c.cpu(), k_pe.cpu(), cos.cpu(), sin.cpu(), pos.cpu(),
                            want.as_strided(shape, strides), None, torch.tensor(slots),
                            cache_format="fp8_584", kv_scale=None, interleaved_in=True,
                            interleaved_out=True)  # fmt: skip
        for _ in range(3):
            raw.zero_()
            serving.rope_append_kv_cache(kv_c, k_pe, cos, sin, pos, cache,
                                         torch.tensor(slots, device=device),
                                         cache_format="fp8_584")  # fmt: skip
            assert torch.equal(raw.cpu(), want), (shape, strides)
