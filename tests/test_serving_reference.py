"""``mlarope.serving.reference.rope_append_kv_cache`` / ``rope_decode_query`` are the public
serving calls in plain PyTorch (docs/serving.md): the same parameters with the same defaults,
the same checks and errors, and, on the PyTorch backend, the same bytes.

The public calls run the PyTorch backend here (CPU tensors with ``TRITON_INTERPRET=0``), so a
difference is in what the reference's calls pass on (a flag, a default, a scale, the split
cache's pair, ``out``), not in the arithmetic (the kernels' own agreement with the reference
is in test_serving_append.py and test_serving_query.py).
"""

from __future__ import annotations

import inspect

import pytest
import torch

from mlarope import serving
from mlarope.serving import reference as ref
from tests.serving_support import model1_cache, tables

ROWS, T, H = 64, 6, 2


def _parameters(fn) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("name", ["rope_append_kv_cache", "rope_decode_query"])
def test_same_parameters_and_defaults(name):
    assert _parameters(getattr(ref, name)) == _parameters(getattr(serving, name))


@pytest.fixture
def pytorch_backend(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _cache(fmt: str, dtype: torch.dtype, latent: int, rope: int):
    gen = torch.Generator().manual_seed(1)
    if fmt == "fp8_656":
        return torch.randint(0, 256, (3, 4, 656), dtype=torch.uint8, generator=gen)
    if fmt == "fp8_584":
        return model1_cache(3, 4, "cpu", gen=gen)[1]
    if fmt == "split":
        return (
            torch.randn(3, 4, latent, generator=gen).to(dtype),
            torch.randn(3, 4, rope, generator=gen).to(dtype),
        )
    return torch.randn(3, 4, latent + rope, generator=gen).to(dtype)


def _clone(cache):
    if isinstance(cache, tuple):
        return tuple(c.clone() for c in cache)
    # with the same strides (fp8_584: blocks padded to a multiple of 576 bytes)
    return torch.empty_strided(cache.shape, cache.stride(), dtype=cache.dtype).copy_(cache)


def _bytes(cache):
    parts = cache if isinstance(cache, tuple) else (cache,)
    return [p.contiguous().view(torch.uint8) for p in parts]


APPEND = [
    ("concat", torch.bfloat16, {}),
    ("concat", torch.float8_e4m3fn, {"kv_scale": 0.02, "interleaved_out": False}),
    ("split", torch.float16, {"interleaved": False}),
    ("split", torch.uint8, {"kv_scale": torch.tensor([0.03])}),
    ("fp8_656", torch.uint8, {"interleaved": False, "interleaved_out": False}),
    ("fp8_584", torch.uint8, {"interleaved_out": False}),
]


@pytest.mark.parametrize(
    ("fmt", "cache_dtype", "kw"),
    APPEND,
    ids=["concat-bf16", "concat-fp8", "split-fp16", "split-tensor-scale", "fp8_656", "fp8_584"],
)
def test_append_writes_what_the_public_call_writes(pytorch_backend, fmt, cache_dtype, kw):
    latent, rope = {"fp8_656": (512, 64), "fp8_584": (448, 64)}.get(fmt, (32, 32))
    dtype = torch.bfloat16 if cache_dtype in (torch.float8_e4m3fn, torch.uint8) else cache_dtype
    cos, sin = tables(rope, ROWS, "cpu")
    kv_c = torch.randn(T, latent).to(dtype)
    k_pe = torch.randn(T, rope).to(dtype)
    positions = torch.tensor([0, 5, 63, 7, 64, 2])  # 64: outside the table (NaN rope values)
    slots = torch.tensor([3, -1, 11, 0, 6, 12])  # -1: padding; 12: outside the cache
    public = _cache(fmt, cache_dtype, latent, rope)
    mine = _clone(public)
    args = (kv_c, k_pe, cos, sin, positions)
    serving.rope_append_kv_cache(*args, public, slots, cache_format=fmt, **kw)
    assert ref.rope_append_kv_cache(*args, mine, slots, cache_format=fmt, **kw) is None
    for got, want in zip(_bytes(mine), _bytes(public), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"interleaved": False},
        {"interleaved_out": False, "out_dtype": torch.float8_e4m3fn, "q_scale": 0.05},
        {"out": "bf16"},
        {"out": "fp8", "q_scale": torch.tensor([0.04])},
    ],
    ids=["defaults", "half-split-in", "fp8-float-scale", "out-bf16", "out-fp8-tensor-scale"],
)
def test_decode_query_returns_what_the_public_call_returns(pytorch_backend, kw):
    cos, sin = tables(64, ROWS, "cpu")
    q_nope = torch.randn(T, H, 32).to(torch.bfloat16)
    q_pe = torch.randn(T, H, 64).to(torch.bfloat16)
    positions = torch.tensor([0, 5, 63, 7, 64, 2])
    results = []
    for fn in (serving.rope_decode_query, ref.rope_decode_query):
        call = dict(kw)
        if "out" in call:
            dtype = torch.bfloat16 if call["out"] == "bf16" else torch.float8_e4m3fn
            call["out"] = torch.zeros(T, H, 96, dtype=dtype)
        result = fn(q_nope, q_pe, cos, sin, positions, **call)
        if "out" in call:
            assert result is call["out"]
        results.append(result)
    public, mine = results
    assert mine.dtype == public.dtype and mine.shape == public.shape
    assert torch.equal(mine.view(torch.uint8), public.view(torch.uint8))


def _error(fn, *args, **kw) -> tuple[type, str]:
    with pytest.raises((TypeError, ValueError)) as info:
        fn(*args, **kw)
    return info.type, str(info.value)


def test_same_errors():
    cos, sin = tables(64, ROWS, "cpu")
    kv_c, k_pe = torch.randn(T, 32), torch.randn(T, 64)
    positions, slots = torch.arange(T), torch.arange(T)
    cache = torch.zeros(3, 4, 96)
    for kw in (
        {"cache_format": "paged"},
        {"cache_format": "concat", "kv_scale": 0.5},  # a scale for a 16-bit cache
        {"cache_format": "concat", "validate": True, "slots": torch.full((T,), 99)},
    ):
        kw = dict(kw)
        slot_mapping = kw.pop("slots", slots)
        args = (kv_c, k_pe, cos, sin, positions, cache, slot_mapping)
        assert _error(ref.rope_append_kv_cache, *args, **kw) == _error(
            serving.rope_append_kv_cache, *args, **kw
        )
    q_nope, q_pe = torch.randn(T, H, 32), torch.randn(T, H, 64)
    for kw in ({"q_scale": 0.5}, {"validate": True, "positions": torch.full((T,), ROWS)}):
        kw = dict(kw)
        pos = kw.pop("positions", positions)
        args = (q_nope, q_pe, cos, sin, pos)
        assert _error(ref.rope_decode_query, *args, **kw) == _error(
            serving.rope_decode_query, *args, **kw
        )
