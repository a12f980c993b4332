"""``rope_append_kv_cache``: the Triton kernels (interpreter in the CPU lane, GPU in the GPU
lane) and the PyTorch reference backend, per cache format, against the float64 truth.

Caches start as random bytes; for every case, on both backends:

- every byte outside the written entries is unchanged (padding, out-of-range slots, other
  slots), bitwise;
- the latent part is exact: a copy of ``kv_c`` (16-bit / fp32 caches), or torch's e4m3
  conversion of ``kv_c / kv_scale`` (FP8), or of ``kv_c / s_j`` with ``s_j`` FlashMLA's tile
  scale from a float64 rule (``fp8_656``), whose scale bits are stored exactly;
- the rope part is within one rounding (or one e4m3 step) of the float64 rotation, NaN where
  the position is outside the table;
- the two backends store the same bits everywhere but in the rope values (whose fp32
  arithmetic may differ in the last bit: fused multiply-adds in the kernels).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

# Imported before a test sets TRITON_INTERPRET=0 for the PyTorch backend: Triton decides at a
# kernel's import whether it runs interpreted.
import mlarope.kernels.q
import mlarope.kernels.serving  # noqa: F401
from mlarope import serving
from mlarope.serving import reference as ref
from tests.serving_support import (
    assert_within,
    exact_tile_scales,
    rope_arith,
    rope_truth,
    stored_tolerance,
    tables,
)


@dataclass(frozen=True)
class Case:
    fmt: str = "concat"
    dtype: torch.dtype = torch.bfloat16  # kv_c, k_pe
    cache_dtype: torch.dtype | None = None  # None: the inputs' dtype (fp8_656: uint8)
    latent: int = 64
    rope: int = 64
    interleaved: bool = True
    interleaved_out: bool = True
    scale: str = "value"  # FP8: "value" (a float) or "tensor"
    index_dtype: torch.dtype = torch.int64
    fused: bool = False  # kv_c, k_pe: slices of one [T, L + R] projection output
    padded_blocks: bool = False  # the cache's block stride has one extra entry
    pe_3d: bool = False  # k_pe [T, 1, R]
    record_4d: bool = False  # fp8_656 cache [blocks, block_size, 1, 656]
    tokens: int = 7
    block_size: int = 4  # a power of two (a shift in the kernel) or not (a division)


CASES = [
    Case(),
    Case(dtype=torch.float16),
    Case(dtype=torch.float32, latent=40, rope=32, interleaved=False),
    Case(interleaved_out=False, pe_3d=True, index_dtype=torch.int32),
    Case(fused=True, padded_blocks=True),
    Case(cache_dtype=torch.float8_e4m3fn),
    Case(cache_dtype=torch.uint8, scale="tensor", interleaved=False, interleaved_out=False),
    Case(dtype=torch.float16, cache_dtype=torch.float8_e4m3fn, fused=True),
    # a page size that is not a power of two (the kernel divides), pages padded so that the
    # division matters: slot * entry stride is no longer the address
    Case(fmt="split", block_size=3, padded_blocks=True),
    Case(fmt="split", dtype=torch.float32, rope=32, padded_blocks=True, index_dtype=torch.int32),
    Case(fmt="split", cache_dtype=torch.float8_e4m3fn, scale="tensor"),
    Case(fmt="fp8_656", latent=512, tokens=5),
    Case(
        fmt="fp8_656",
        latent=512,
        dtype=torch.float16,
        record_4d=True,
        padded_blocks=True,
        interleaved_out=False,
        fused=True,
        tokens=5,
    ),
]
N_BLOCKS, ROWS = 3, 40
KV_SCALE = 0.0625 * 1.1


def _case_id(case: Case) -> str:
    default = Case()
    parts = []
    for name in Case.__dataclass_fields__:
        value = getattr(case, name)
        if value != getattr(default, name):
            value = str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value
            parts.append(f"{name}={value}")
    return ",".join(parts) or "default"


def _random_bytes(shape, dtype, device, gen) -> torch.Tensor:
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape).to(device)


def _make_cache(case: Case, device, gen):
    """The cache (as the op takes it) and its byte views ``[blocks, block_size, entry_bytes]``."""
    entries = case.block_size + (1 if case.padded_blocks else 0)

    def alloc(width, dtype):
        full = _random_bytes((N_BLOCKS, entries, width), dtype, device, gen)
        return full[:, : case.block_size]

    if case.fmt == "fp8_656":
        records = alloc(656, torch.uint8)
        return (records.unsqueeze(2) if case.record_4d else records), [records]
    dtype = case.cache_dtype or case.dtype
    if case.fmt == "concat":
        cache = alloc(case.latent + case.rope, dtype)
        return cache, [cache]
    ckv, kpe = alloc(case.latent, dtype), alloc(case.rope, dtype)
    return (ckv, kpe), [ckv, kpe]


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _inputs(case: Case, device, gen):
    t, latent, rope = case.tokens, case.latent, case.rope
    proj = torch.randn(t, latent + rope + 3, generator=gen)
    if case.fmt == "fp8_656":  # tiles of very different magnitudes, one all zero
        proj[:, :latent] *= torch.tensor([1e-3, 1.0, 300.0, 0.0]).repeat_interleave(128)
    proj = proj.to(case.dtype).to(device)
    if case.fused:
        kv_c, k_pe = proj[:, :latent], proj[:, latent + 3 :]
    else:
        kv_c, k_pe = proj[:, :latent].contiguous(), proj[:, latent + 3 :].contiguous()
    capacity = N_BLOCKS * case.block_size
    # padding (-1), a negative slot, one past the cache; one position past the table
    slots = [5, -1, 0, capacity, capacity - 1, -5, 7, 2, 8][:t]
    positions = [3, 9, ROWS + 2, 0, ROWS - 1, 17, 1, 30, 12][:t]
    slots = torch.tensor(slots, dtype=case.index_dtype, device=device)
    positions = torch.tensor(positions, dtype=case.index_dtype, device=device)
    return kv_c, (k_pe.unsqueeze(1) if case.pe_3d else k_pe), slots, positions


def _scale(case: Case, device):
    dtype = case.cache_dtype
    if case.fmt == "fp8_656" or dtype not in (torch.float8_e4m3fn, torch.uint8):
        return None
    if case.scale == "tensor":
        return torch.tensor([KV_SCALE], dtype=torch.float32, device=device)
    return KV_SCALE


def _run(case: Case, device, backend: str):
    gen = torch.Generator().manual_seed(11)
    cache, byte_tensors = _make_cache(case, device, gen)
    kv_c, k_pe, slots, positions = _inputs(case, device, gen)
    cos, sin = tables(case.rope, ROWS, device)
    before = [_byte_view(b).clone() for b in byte_tensors]
    previous = os.environ.get("TRITON_INTERPRET")
    if backend == "reference":
        os.environ["TRITON_INTERPRET"] = "0"
    try:
        serving.rope_append_kv_cache(
            kv_c, k_pe, cos, sin, positions, cache, slots, cache_format=case.fmt,
            kv_scale=_scale(case, device), interleaved=case.interleaved,
            interleaved_out=case.interleaved_out,
        )  # fmt: skip
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous
    after = [_byte_view(b).clone() for b in byte_tensors]
    return before, after, cache, (kv_c, k_pe.reshape(case.tokens, -1), slots, positions, cos, sin)


def _written(slots: torch.Tensor, block_size: int) -> list[tuple[int, int]]:
    """``(token, slot)`` of every written token."""
    capacity = N_BLOCKS * block_size
    return [(t, s) for t, s in enumerate(slots.tolist()) if 0 <= s < capacity]


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_append_against_truth(device, case):
    backends = ["kernel"] if device.type == "cuda" else ["kernel", "reference"]
    results = {b: _run(case, device, b) for b in backends}
    *_, (kv_c, k_pe, slots, positions, cos, sin) = results["kernel"]
    written = _written(slots.cpu(), case.block_size)
    bs = case.block_size

    for backend, (b0, b1, c, _) in results.items():
        # untouched bytes
        for i, (x0, x1) in enumerate(zip(b0, b1, strict=True)):
            touched = torch.zeros(x0.shape[:2], dtype=torch.bool)
            for _, s in written:
                touched[s // bs, s % bs] = True
            changed = (x0 != x1).cpu() & ~touched[..., None]
            assert not changed.any(), f"{backend}: bytes of tensor {i} outside the written slots"
        _check_entries(case, c, kv_c, k_pe, slots, positions, cos, sin, written, backend)

    if "reference" in results:
        k1, r1 = results["kernel"][1], results["reference"][1]
        for i, (x, y) in enumerate(zip(k1, r1, strict=True)):
            mask = _rope_mask(case, x.shape, written, i)
            assert torch.equal(x[~mask], y[~mask]), f"kernel and reference differ in tensor {i}"


def _rope_mask(case: Case, shape, written, tensor_index: int) -> torch.Tensor:
    mask = torch.zeros(shape, dtype=torch.bool)
    dtype = torch.uint8 if case.fmt == "fp8_656" else case.cache_dtype or case.dtype
    elem = torch.empty((), dtype=dtype).element_size()
    for _, s in written:
        b, e = s // case.block_size, s % case.block_size
        if case.fmt == "fp8_656":
            mask[b, e, ref.FP8_656_ROPE_AT :] = True
        elif case.fmt == "concat":
            mask[b, e, case.latent * elem :] = True
        elif tensor_index == 1:
            mask[b, e, :] = True
    return mask


def _check_entries(case, cache, kv_c, k_pe, slots, positions, cos, sin, written, backend):
    tokens = torch.tensor([t for t, _ in written])
    chosen = torch.tensor([s for _, s in written])
    scale = _scale(case, kv_c.device)
    latent, rope = serving.read_kv_cache(
        cache, chosen.to(kv_c.device), cache_format=case.fmt, rope_dim=case.rope, kv_scale=scale
    )
    latent, rope = latent.cpu(), rope.cpu()
    x = kv_c.cpu()[tokens].float()
    what = f"{backend} {case.fmt}"
    # latent: exact
    if case.fmt == "fp8_656":
        records = ref.fp8_656_records(cache).cpu()
        rec = records[chosen // case.block_size, chosen % case.block_size]
        want_scales = exact_tile_scales(x)
        scales = rec[:, 512:528].contiguous().view(torch.float32)
        assert torch.equal(scales, want_scales), f"{what}: tile scales"
        want = (x.reshape(-1, 4, 128) / want_scales[..., None]).reshape(-1, 512)
        want = want.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        assert torch.equal(rec[:, :512], want), f"{what}: latent codes"
        rope_dtype = torch.bfloat16
    else:
        dtype = case.cache_dtype or case.dtype
        if dtype in (torch.float8_e4m3fn, torch.uint8):
            target = cache if case.fmt == "concat" else cache[0]
            codes = target.cpu().view(torch.uint8)[
                chosen // case.block_size, chosen % case.block_size
            ]
            want = (x / torch.tensor(KV_SCALE, dtype=torch.float32)).clamp(-448, 448)
            assert torch.equal(
                codes[:, : case.latent], want.to(torch.float8_e4m3fn).view(torch.uint8)
            ), f"{what}: latent codes"
        else:
            assert torch.equal(latent, x), f"{what}: latent copy"
        rope_dtype = dtype
    # rope: one rounding (or one e4m3 step) of the float64 rotation
    flags = dict(interleaved_in=case.interleaved, interleaved_out=case.interleaved_out)
    truth = rope_truth(k_pe[tokens], cos, sin, positions[tokens], **flags)
    arith = rope_arith(k_pe[tokens], cos, sin, positions[tokens], **flags)
    tol = stored_tolerance(truth, arith, rope_dtype, KV_SCALE)
    assert_within(rope, truth, tol, f"{what}: rope values")
    assert truth.isnan().any(), "the cases include a position outside the table"


def test_append_writes_nothing_for_no_tokens(device):
    cos, sin = tables(64, ROWS, device)
    cache = torch.zeros(2, 4, 128, dtype=torch.bfloat16, device=device)
    empty = torch.empty(0, 64, dtype=torch.bfloat16, device=device)
    index = torch.empty(0, dtype=torch.int64, device=device)
    serving.rope_append_kv_cache(empty, empty, cos, sin, index, cache, index, cache_format="concat")
    assert not cache.any()
