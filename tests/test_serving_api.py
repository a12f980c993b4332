"""The serving API: host checks (each error names the value), device validation, the eager
plans, ``torch.compile``, one launch per call, and (GPU lane) CUDA-graph capture and replay of
a decode step with new positions and slots on every replay."""

from __future__ import annotations

import os
import re
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch

import mlarope
from mlarope import serving
from mlarope._launch_cache import LAUNCH_CACHE, clear_launch_cache
from mlarope.kernels._launch import recording
from mlarope.serving import _plans, checks, formats
from mlarope.serving import reference as ref
from tests.serving_support import model1_cache, tables

L, R, T, H = 512, 64, 4, 3


def _append_args(device, fmt="concat", cache_dtype=torch.bfloat16, **changes):
    gen = torch.Generator().manual_seed(0)
    latent = 448 if fmt == "fp8_584" else L
    kv_c = torch.randn(T, latent, generator=gen).to(torch.bfloat16).to(device)
    k_pe = torch.randn(T, R, generator=gen).to(torch.bfloat16).to(device)
    cos, sin = tables(R, 32, device)
    positions = torch.tensor([1, 5, 0, 31], device=device)
    slots = torch.tensor([3, -1, 0, 6], device=device)
    if fmt == "concat":
        cache = torch.zeros(2, 4, L + R, dtype=cache_dtype, device=device)
    elif fmt == "split":
        cache = (
            torch.zeros(2, 4, L, dtype=cache_dtype, device=device),
            torch.zeros(2, 4, R, dtype=cache_dtype, device=device),
        )
    elif fmt == "fp8_584":
        cache = model1_cache(2, 4, device)[1]
    else:
        cache = torch.zeros(2, 4, 656, dtype=torch.uint8, device=device)
    args = dict(
        kv_c=kv_c, k_pe=k_pe, cos=cos, sin=sin, positions=positions, cache=cache,
        slot_mapping=slots, cache_format=fmt,
        kv_scale=0.05 if cache_dtype in formats.FP8_DTYPES and fmt in ("concat", "split") else None,
    )  # fmt: skip
    args.update(changes)
    return args


def _query_args(device, **changes):
    gen = torch.Generator().manual_seed(1)
    cos, sin = tables(R, 32, device)
    args = dict(
        q_nope=torch.randn(T, H, 32, generator=gen).to(torch.bfloat16).to(device),
        q_pe=torch.randn(T, H, R, generator=gen).to(torch.bfloat16).to(device),
        cos=cos, sin=sin, positions=torch.tensor([1, 5, 0, 31], device=device),
    )  # fmt: skip
    args.update(changes)
    return args


def _append(args, **kw):
    a = dict(args)
    return serving.rope_append_kv_cache(
        a.pop("kv_c"), a.pop("k_pe"), a.pop("cos"), a.pop("sin"), a.pop("positions"),
        a.pop("cache"), a.pop("slot_mapping"), **a, **kw,
    )  # fmt: skip


def _query(args, **kw):
    a = dict(args)
    return serving.rope_decode_query(
        a.pop("q_nope"), a.pop("q_pe"), a.pop("cos"), a.pop("sin"), a.pop("positions"), **a, **kw
    )


# ------------------------------------------------------------------------------- host checks
def _u8(n, offset=0):
    return torch.zeros(n + offset, dtype=torch.uint8)[offset:]


_SHARED = torch.zeros(2, 4, L + R, dtype=torch.bfloat16)
APPEND_ERRORS = [
    (dict(cache_format=3), TypeError, "cache_format must be a str"),
    (dict(cache_format="paged"), ValueError, "cache_format must be one of"),
    (dict(kv_c=torch.zeros(T, L, dtype=torch.float64)), TypeError, "kv_c must be bfloat16"),
    (dict(kv_c=torch.zeros(T, 2, L, dtype=torch.bfloat16)), ValueError, "kv_c must be 2-D"),
    (
        dict(kv_c=torch.zeros(L, T, dtype=torch.bfloat16).t()),
        ValueError,
        "kv_c must have a contiguous last dim",
    ),
    (
        dict(k_pe=torch.zeros(T, R, dtype=torch.float16)),
        TypeError,
        "k_pe and kv_c must share a dtype",
    ),
    (
        dict(k_pe=torch.zeros(T, 2, R, dtype=torch.bfloat16)),
        ValueError,
        "k_pe must be [T, R] or [T, 1, R]",
    ),
    (
        dict(k_pe=torch.zeros(T, 32, dtype=torch.bfloat16)),
        ValueError,
        "cos.shape[-1] must be the rope dim R = k_pe.shape[-1] = 32, got 64 (cos shape (32, 64))",
    ),
    (
        dict(k_pe=torch.zeros(T, 48, dtype=torch.bfloat16)),
        ValueError,
        "the rope dim R = k_pe.shape[-1] must be one of (32, 64, 128), got 48",
    ),
    (dict(positions=torch.zeros(T)), TypeError, "positions must be int32 or int64"),
    (
        dict(positions=torch.zeros(T + 1, dtype=torch.int64)),
        ValueError,
        "positions must be 1-D [T] with T = 4",
    ),
    (
        dict(slot_mapping=torch.zeros(1, T, dtype=torch.int64)),
        ValueError,
        "slot_mapping must be 1-D [T]",
    ),
    (
        dict(cache=torch.zeros(2, 4, L, dtype=torch.bfloat16)),
        ValueError,
        "a concat cache must be [num_blocks, block_size, L + R]",
    ),
    (
        dict(cache=torch.zeros(2, 4, L + R, dtype=torch.float16)),
        TypeError,
        "cache must have kv_c's dtype torch.bfloat16",
    ),
    (
        dict(cache=torch.zeros(2, 4, L + R, dtype=torch.int32)),
        TypeError,
        "cache must have kv_c's dtype",
    ),
    (
        dict(cache=torch.zeros(2, 4, L + R, dtype=torch.uint8)),
        ValueError,
        "kv_scale is required for an FP8 concat cache",
    ),
    (dict(kv_scale=0.5), ValueError, "kv_scale must be None for a torch.bfloat16 cache"),
    (dict(interleaved=1), TypeError, "interleaved must be a bool"),
    (dict(interleaved_out="yes"), TypeError, "interleaved_out must be a bool"),
    (dict(kv_c=_SHARED.view(-1)[: T * L].view(T, L), cache=_SHARED), ValueError, "share memory"),
]


@pytest.mark.parametrize("change,error,message", APPEND_ERRORS)
def test_append_checks(change, error, message):
    with pytest.raises(error, match=re.escape(message)):
        _append(_append_args("cpu", **change))


def test_append_scale_checks():
    for scale, error, message in [
        (None, ValueError, "kv_scale is required"),
        (
            True,
            TypeError,
            "kv_scale must be a real number (an int, a float or another "
            "numbers.Real: numpy's real scalars, fractions.Fraction; not a bool) or a 1-element "
            "float32 tensor on the inputs' device, got True (bool)",
        ),
        (0.0, ValueError, "kv_scale must be a finite positive float32 number"),
        (-1.0, ValueError, "got -1.0"),
        (float("inf"), ValueError, "got inf"),
        (1e-40, ValueError, "got 1e-40"),
        (torch.tensor([0.5], dtype=torch.float64), TypeError, "1-element float32 tensor"),
        (torch.tensor([0.5, 1.0]), TypeError, "(the kernel reads it there), got shape (2,)"),
    ]:
        args = _append_args("cpu", cache_dtype=torch.float8_e4m3fn, kv_scale=scale)
        with pytest.raises(error, match=re.escape(message)):
            _append(args)
    with pytest.raises(ValueError, match="kv_scale must be None for cache_format='fp8_656'"):
        _append(_append_args("cpu", fmt="fp8_656", kv_scale=0.5))


SCALES = [0.5, 1, np.float32(0.5), np.float16(0.5), np.float64(0.5), np.int64(1),
          np.uint8(1), np.longdouble(0.5), Fraction(1, 2)]  # fmt: skip


@pytest.mark.parametrize("backend", ["kernels", "reference"])
def test_every_real_scalar_is_a_scale(backend):
    """``kv_scale=np.float32(0.5)`` raised a TypeError while ``np.float64(0.5)`` (a float
    subclass) was taken (issue 36). Every real number is a scale, with the bytes of its float
    value, in the append, the query and the reader; a repeated call with one takes a plan."""
    results = {}
    fp8 = torch.float8_e4m3fn
    for scale in SCALES:
        args = _append_args("cpu", cache_dtype=fp8, kv_scale=scale)
        query = _on_backend(
            backend, lambda scale=scale: _query(_query_args("cpu"), out_dtype=fp8, q_scale=scale)
        )
        _on_backend(backend, lambda args=args: _append(args))
        read = serving.read_kv_cache(args["cache"], torch.tensor([3, 0]), cache_format="concat",
                                     rope_dim=R, kv_scale=scale)  # fmt: skip
        results.setdefault(float(scale), []).append(
            (args["cache"].view(torch.uint8), query.view(torch.uint8), *read)
        )
    for same in results.values():
        for got in same[1:]:
            for g, w in zip(got, same[0], strict=True):
                assert torch.equal(g, w)
    clear_launch_cache()
    args = _append_args("cpu", cache_dtype=torch.float8_e4m3fn, kv_scale=np.float32(0.5))
    for _ in range(2):
        _on_backend(backend, lambda: _append(args))
    if backend == "kernels" and os.environ.get("TRITON_INTERPRET") == "1":
        ((_, plan),) = next(iter(LAUNCH_CACHE.plans.values()))
        assert plan.__class__ is _plans.Plan


def test_what_is_not_a_real_scale_is_refused():
    """bool, complex (Python's, numpy's), strings and ``Decimal`` (not a ``numbers.Real``) are
    refused with the list of what is taken; a tensor scale is a 1-element float32 tensor (the
    kernel reads it, so a CUDA graph may change it: a conversion would copy it); an int too
    large for a float32 is out of range."""
    taken = re.escape(
        "must be a real number (an int, a float or another numbers.Real: numpy's real scalars, "
        "fractions.Fraction; not a bool) or a 1-element float32 tensor on the inputs' device, got"
    )
    for scale in (True, np.True_, 1 + 0j, np.complex64(0.5), "0.5", Decimal("0.5"), [0.5]):
        with pytest.raises(TypeError, match="kv_scale " + taken):
            _append(_append_args("cpu", cache_dtype=torch.float8_e4m3fn, kv_scale=scale))
        with pytest.raises(TypeError, match="q_scale " + taken):
            _query(_query_args("cpu"), out_dtype=torch.float8_e4m3fn, q_scale=scale)
        cache = torch.zeros(2, 4, L + R, dtype=torch.uint8)
        with pytest.raises(TypeError, match="kv_scale " + taken):
            serving.read_kv_cache(cache, torch.tensor([0]), cache_format="concat", rope_dim=R,
                                  kv_scale=scale)  # fmt: skip
    for scale in (torch.tensor(0.5, dtype=torch.float64), torch.tensor([1], dtype=torch.int32)):
        with pytest.raises(TypeError, match=re.escape(
            "kv_scale as a tensor must be a 1-element float32 tensor on the inputs' device (the "
            "kernel reads it there), got"
        )):  # fmt: skip
            _append(_append_args("cpu", cache_dtype=torch.float8_e4m3fn, kv_scale=scale))
    for scale in (10**400, np.float64(1e300), -np.float32(1)):
        with pytest.raises(ValueError, match="kv_scale must be a finite positive float32 number"):
            _append(_append_args("cpu", cache_dtype=torch.float8_e4m3fn, kv_scale=scale))


def test_split_and_fp8_656_cache_checks():
    ckv = torch.zeros(2, 4, L, dtype=torch.bfloat16)
    for cache, error, message in [
        (ckv, TypeError, "a split cache must be a pair"),
        ((ckv, torch.zeros(2, 4, 32, dtype=torch.bfloat16)), ValueError, "kpe (cache[1]) must be"),
        (
            (ckv[:, :, :64], torch.zeros(2, 4, R, dtype=torch.bfloat16)),
            ValueError,
            "ckv (cache[0]) must be [num_pages, page_size, L] with L = 512",
        ),
        ((ckv, torch.zeros(2, 4, R, dtype=torch.float16)), TypeError, "must share a dtype"),
        ((ckv, ckv[:, :, :R]), ValueError, "ckv (cache[0]) and kpe (cache[1]) share memory"),
    ]:
        with pytest.raises(error, match=re.escape(message)):
            _append(_append_args("cpu", fmt="split", cache=cache))
    padded = torch.zeros(2, 4, 672, dtype=torch.uint8)[:, :, :656]
    misaligned = _u8(2 * 4 * 656, offset=1).view(2, 4, 656)
    for cache, error, message in [
        (torch.zeros(2, 4, 656, dtype=torch.float32), TypeError, "an fp8_656 cache holds bytes"),
        (
            torch.zeros(2, 4, 655, dtype=torch.uint8),
            ValueError,
            "must be [num_blocks, block_size, 656]",
        ),
        (
            torch.zeros(2, 4, 2, 656, dtype=torch.uint8),
            ValueError,
            "or [num_blocks, block_size, 1, 656]",
        ),
        (padded, ValueError, "must be 656 bytes apart"),
        (misaligned, ValueError, "must be 16-byte aligned"),
    ]:
        with pytest.raises(error, match=re.escape(message)):
            _append(_append_args("cpu", fmt="fp8_656", cache=cache))
    with pytest.raises(ValueError, match=r"holds L = 512 latent and R = 64 .* got L = kv_c.shape"):
        _append(_append_args("cpu", fmt="fp8_656", kv_c=torch.zeros(T, 256, dtype=torch.bfloat16)))


def _fp8_584_bad_caches():
    """Caches that are not FlashMLA's MODEL1 layout, each with the error naming it."""
    raw, good = model1_cache(2, 4, "cpu")
    contiguous = torch.zeros(2, 4, 1, 584, dtype=torch.uint8)  # blocks 2,336 bytes apart
    # blocks a multiple of 576 apart, but overlapping (1,728 < 2,336)
    short = torch.zeros(2 * 2880, dtype=torch.uint8).as_strided((2, 4, 584), (576 * 3, 584, 1))
    misaligned = torch.zeros(2 * 2880 + 16, dtype=torch.uint8)[8:].as_strided(
        (2, 4, 584), (2880, 584, 1)
    )
    entries_apart = torch.zeros(2, 4, 1, 592, dtype=torch.uint8)[..., :584]
    return [
        (good.view(torch.float16)[..., :292], TypeError, "an fp8_584 cache holds bytes"),
        (raw[:, : 4 * 584].view(2, 4, 2, 292), ValueError,
         "must be [num_blocks, block_size, 584] or [num_blocks, block_size, 1, 584]"),
        (good[..., :583], ValueError, "got shape (2, 4, 1, 583)"),
        (entries_apart, ValueError, "must be 584 bytes apart within a block"),
        (contiguous, ValueError, "must be a multiple of 576 bytes apart, and at least "
                                 "block_size * 584 = 2336"),
        (short, ValueError, "got strides (1728, 584, 1)"),
        (misaligned, ValueError, "an fp8_584 cache must be 16-byte aligned"),
        (good.transpose(0, 1), ValueError, "must be 584 bytes apart within a block"),
    ]  # fmt: skip


@pytest.mark.parametrize("index", range(len(_fp8_584_bad_caches())))
def test_fp8_584_cache_checks(index):
    """A cache that is not DeepSeek-V4's FP8 layout as FlashMLA allocates it is refused, with
    an error that names it: the format did not exist (``cache_format must be one of``)."""
    cache, error, message = _fp8_584_bad_caches()[index]
    with pytest.raises(error, match=re.escape(message)):
        _append(_append_args("cpu", fmt="fp8_584", cache=cache))


def test_fp8_584_shape_and_scale_checks():
    with pytest.raises(ValueError, match=r"holds L = 448 latent and R = 64 .* got L = kv_c.shape"):
        _append(_append_args("cpu", fmt="fp8_584", kv_c=torch.zeros(T, 512, dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match="kv_scale must be None for cache_format='fp8_584'"):
        _append(_append_args("cpu", fmt="fp8_584", kv_scale=0.5))
    args = _append_args("cpu", fmt="fp8_584")
    cos, sin = tables(32, 32, "cpu")
    with pytest.raises(ValueError, match=re.escape("the rope dim R = k_pe.shape[-1] = 64, got 32")):
        _append(dict(args, cos=cos, sin=sin))
    # the 3-D form, a float8 and an int8 cache, a single block: accepted
    raw, cache = model1_cache(1, 4, "cpu", dtype=torch.float8_e4m3fn, four_d=False)
    _append(dict(args, cache=cache, slot_mapping=torch.tensor([3, -1, 0, 2])))
    _append(dict(args, cache=model1_cache(2, 4, "cpu", dtype=torch.int8)[1]))
    assert raw.any()


def test_append_refuses_gradients_and_inference_caches():
    kv_c = torch.zeros(T, L, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(ValueError, match="kv_c requires grad; the serving ops are not differ"):
        _append(_append_args("cpu", kv_c=kv_c))
    with torch.no_grad():
        _append(_append_args("cpu", kv_c=kv_c))  # fine without grad mode
    with torch.inference_mode():
        cache = torch.zeros(2, 4, L + R, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cache is an inference tensor"):
        _append(_append_args("cpu", cache=cache))


QUERY_ERRORS = [
    (
        dict(q_nope=torch.zeros(T, 32, dtype=torch.bfloat16)),
        ValueError,
        "q_nope must be 3-D [T, H, L]",
    ),
    (
        dict(q_pe=torch.zeros(T, H + 1, R, dtype=torch.bfloat16)),
        ValueError,
        "q_pe must be [T, H, R] with q_nope's T, H",
    ),
    (
        dict(q_pe=torch.zeros(T, H, 32, dtype=torch.bfloat16)),
        ValueError,
        "cos.shape[-1] must be the rope dim R = q_pe.shape[-1] = 32",
    ),
    (dict(q_pe=torch.zeros(T, H, R)), TypeError, "q_pe and q_nope must share a dtype"),
    (dict(out_dtype="fp8"), TypeError, "out_dtype must be a torch.dtype or None"),
    (dict(out_dtype=torch.float16), TypeError, "the output dtype must be q_nope's dtype"),
    (
        dict(out_dtype=torch.float8_e4m3fn),
        ValueError,
        "q_scale is required for a torch.float8_e4m3fn output",
    ),
    (dict(q_scale=0.5), ValueError, "q_scale must be None for a torch.bfloat16 output"),
    (
        dict(out=torch.zeros(T, H, 32 + R + 1, dtype=torch.bfloat16)),
        ValueError,
        "out must be [T, H, L + R] = [4, 3, 96]",
    ),
    (
        dict(out=torch.zeros(T, H, 96), out_dtype=torch.bfloat16),
        TypeError,
        "out has dtype torch.float32 but out_dtype is torch.bfloat16",
    ),
    (
        dict(positions=torch.zeros(2, dtype=torch.int32)),
        ValueError,
        "positions must be 1-D [T] with T = 4",
    ),
]


@pytest.mark.parametrize("change,error,message", QUERY_ERRORS)
def test_query_checks(change, error, message):
    with pytest.raises(error, match=re.escape(message)):
        _query(_query_args("cpu", **change))


def test_query_refuses_an_out_that_overlaps_its_inputs():
    buf = torch.zeros(T, H, 32 + R, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out and q_pe share memory"):
        _query(_query_args("cpu", q_pe=buf[..., 32:], out=buf))


def _read_cases():
    concat = torch.zeros(2, 4, L + R, dtype=torch.bfloat16)
    fp8 = torch.zeros(2, 4, L + R, dtype=torch.uint8)
    split = (torch.zeros(2, 4, L, dtype=torch.bfloat16), torch.zeros(2, 4, R, dtype=torch.bfloat16))
    records = torch.zeros(2, 4, 656, dtype=torch.uint8)
    v4 = model1_cache(2, 4, "cpu")[1]
    ok = torch.tensor([0, 7])
    return [
        # slots: -1 (padding) read the last slot's entry, floats were truncated
        ((concat, torch.tensor([0, -1]), "concat", R, None), ValueError,
         "slots[1] = -1, the padding marker: a padding token has no entry"),
        ((concat, torch.tensor([8]), "concat", R, None), ValueError,
         "slots[0] = 8 is outside the cache: slots are in [0, 8) (2 blocks x 4)"),
        ((records, torch.tensor([3, -2]), "fp8_656", None, None), ValueError,
         "slots[1] = -2 is outside the cache"),
        ((concat, torch.tensor([1.7]), "concat", R, None), TypeError,
         "slots must be int32 or int64, got dtype torch.float32"),
        ((concat, [0, 1], "concat", R, None), TypeError, "slots must be a torch.Tensor"),
        ((concat, ok.view(2, 1), "concat", R, None), ValueError, "slots must be 1-D [n]"),
        # the format against the cache: a concat cache read as split gave shape-(1,) tensors
        ((concat, ok, "split", None, None), TypeError,
         "a split cache must be a pair (ckv [num_pages, page_size, L], kpe [num_pages, "
         "page_size, R]), got a tensor of shape (2, 4, 576)"),
        ((split, ok, "concat", R, None), TypeError,
         "this cache format is one tensor [num_blocks, block_size, L + R], got a tuple of 2"),
        ((concat, ok, "fp8_656", None, None), TypeError, "an fp8_656 cache holds bytes"),
        ((fp8[..., :600], ok, "fp8_656", None, None), ValueError,
         "an fp8_656 cache must be [num_blocks, block_size, 656]"),
        ((concat[0], ok, "concat", R, None), ValueError, "a concat cache must be 3-D"),
        ((concat.int(), ok, "concat", R, None), TypeError,
         "cache must be bfloat16, float16, float32 or FP8 e4m3"),
        ((split[::-1], ok, "split", None, None), ValueError,
         "kpe (cache[1]) must be [num_pages, page_size, R] with R one of (32, 64, 128), got "
         "shape (2, 4, 512)"),
        (((split[0], split[1][:1]), ok, "split", None, None), ValueError,
         "kpe (cache[1]) must have ckv's pages [2, 4]"),
        ((split[0][:1], ok, "split", None, None), TypeError, "a split cache must be a pair"),
        ((concat, ok, "paged", R, None), ValueError, "cache_format must be one of"),
        # rope_dim: a bad one gave torch's size error, or another split of the entry
        ((concat, ok, "concat", None, None), ValueError, "rope_dim (R) is required"),
        ((concat, ok, "concat", 1000, None), ValueError,
         "rope_dim must be one of (32, 64, 128) and at most the concat cache's entry width "
         "L + R = 576, got 1000"),
        ((concat, ok, "concat", 48, None), ValueError, "got 48"),
        ((concat, ok, "concat", 64.0, None), TypeError, "rope_dim must be an int or None"),
        ((split, ok, "split", 32, None), ValueError, "rope_dim = 32 does not match"),
        ((records, ok, "fp8_656", 32, None), ValueError, "holds R = 64 rope values"),
        # scales: required for FP8, refused elsewhere
        ((fp8, ok, "concat", R, None), ValueError, "kv_scale is required for an FP8 concat"),
        ((fp8, ok, "concat", R, -1.0), ValueError, "kv_scale must be a finite positive"),
        ((concat, ok, "concat", R, 0.5), ValueError, "kv_scale must be None for a torch.bfloat16"),
        ((records, ok, "fp8_656", None, 0.5), ValueError,
         "kv_scale must be None for cache_format='fp8_656'"),
        # fp8_584: FlashMLA's layout, checked as the writer checks it
        ((v4, ok, "fp8_584", None, 0.5), ValueError,
         "kv_scale must be None for cache_format='fp8_584'"),
        ((v4, ok, "fp8_584", 32, None), ValueError, "an fp8_584 cache holds R = 64 rope values"),
        ((records, ok, "fp8_584", None, None), ValueError,
         "an fp8_584 cache must be [num_blocks, block_size, 584]"),
        ((torch.zeros(2, 4, 584, dtype=torch.uint8), ok, "fp8_584", None, None), ValueError,
         "the blocks of an fp8_584 cache must be a multiple of 576 bytes apart"),
        ((v4.view(torch.int16)[..., :292], ok, "fp8_584", None, None), TypeError,
         "an fp8_584 cache holds bytes"),
        ((v4, torch.tensor([8]), "fp8_584", None, None), ValueError,
         "slots[0] = 8 is outside the cache: slots are in [0, 8) (2 blocks x 4)"),
        ((v4, torch.tensor([2, -1]), "fp8_584", None, None), ValueError,
         "slots[1] = -1, the padding marker"),
    ]  # fmt: skip


@pytest.mark.parametrize("index", range(len(_read_cases())))
def test_read_kv_cache_checks(index):
    """``read_kv_cache`` checked nothing: slot -1 (the writers' padding marker) returned the
    last slot's entry, a concat cache read as ``"split"`` gave shape-(1,) tensors, float slots
    were truncated, a bad ``rope_dim`` gave torch's size error. Each is an error naming the
    value now."""
    (cache, slots, fmt, rope_dim, scale), error, message = _read_cases()[index]
    with pytest.raises(error, match=re.escape(message)):
        serving.read_kv_cache(cache, slots, cache_format=fmt, rope_dim=rope_dim, kv_scale=scale)


def test_read_kv_cache_reads_what_was_written(device):
    """The checked reader still reads every format back, slots of either index dtype."""
    for fmt, dtype in (
        ("concat", torch.uint8), ("split", torch.bfloat16), ("fp8_656", None), ("fp8_584", None),
    ):  # fmt: skip
        args = _append_args(device, fmt=fmt, cache_dtype=dtype)
        _append(args)
        written = torch.tensor([3, 0, 6], dtype=torch.int32, device=device)
        latent, rope = serving.read_kv_cache(
            args["cache"], written, cache_format=fmt, rope_dim=R, kv_scale=args["kv_scale"]
        )
        width = args["kv_c"].shape[1]
        assert latent.shape == (3, width) and rope.shape == (3, R) and latent.dtype == torch.float32
        want = args["kv_c"][[0, 2, 3]].float()
        tolerance = 0.0 if fmt == "split" else 0.07 * want.abs() + 0.05
        assert bool(((latent - want).abs() <= tolerance).all()), fmt


def test_zero_sizes():
    """A cache block of no entries (``block_size = 0``) passed the checks and the kernels divided
    slots by it: refused for every format, naming the shape. A zero-width latent (``L = 0``) is
    written by every backend alike, and the concat reader, which refused it, reads it back."""
    for fmt, cache in (
        ("concat", torch.zeros(2, 0, L + R, dtype=torch.bfloat16)),
        ("split", (torch.zeros(2, 0, L, dtype=torch.bfloat16),
                   torch.zeros(2, 0, R, dtype=torch.bfloat16))),
        ("fp8_656", torch.zeros(2, 0, 656, dtype=torch.uint8)),
        ("fp8_584", torch.zeros(1, 0, 1, 584, dtype=torch.uint8)),
    ):  # fmt: skip
        args = _append_args("cpu", fmt=fmt, cache=cache, slot_mapping=torch.full((T,), -1))
        with pytest.raises(ValueError, match=re.escape("block_size = ") + ".*" + re.escape(
            "shape[1] must be at least 1 (slot s is entry s % block_size of block s // "
            "block_size), got shape ("
        )):  # fmt: skip
            _append(args)
    for backend in ("kernels", "reference"):
        args = _append_args("cpu", kv_c=torch.zeros(T, 0, dtype=torch.bfloat16),
                            cache=torch.zeros(2, 4, R, dtype=torch.bfloat16))  # fmt: skip
        _on_backend(backend, lambda args=args: _append(args))
        latent, rope = serving.read_kv_cache(
            args["cache"], torch.tensor([3, 0, 6]), cache_format="concat", rope_dim=R
        )
        assert latent.shape == (3, 0) and rope.shape == (3, R)
        assert torch.equal(rope, args["cache"].view(-1, R)[[3, 0, 6]].float()) and rope.any()


def _on_backend(backend: str, fn):
    """``fn()`` on the kernels (the lane's backend) or the PyTorch backend."""
    previous = os.environ.get("TRITON_INTERPRET")
    if backend == "reference":
        os.environ["TRITON_INTERPRET"] = "0"
    try:
        return fn()
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


# ------------------------------------------------------------------------ device validation
def test_append_validation_names_token_and_slot(device, monkeypatch):
    cases = [
        (
            dict(slot_mapping=torch.tensor([3, -1, 8, 6])),
            "slot_mapping[2] = 8 is outside the cache: slots are in [0, 8)",
        ),
        (
            dict(slot_mapping=torch.tensor([3, -2, 0, 6])),
            "slot_mapping[1] = -2 is outside the cache",
        ),
        (
            dict(slot_mapping=torch.tensor([3, -1, 6, 6])),
            "slot_mapping[3] = 6 repeats slot_mapping[2]",
        ),
        (
            dict(positions=torch.tensor([1, 5, 32, 0])),
            "positions[2] = 32 is outside the table [0, 32)",
        ),
    ]
    for change, message in cases:
        change = {k: v.to(device) for k, v in change.items()}
        args = _append_args(device, **change)
        with pytest.raises(ValueError, match=re.escape(message)):
            _append(args, validate=True)
        monkeypatch.setenv("MLAROPE_VALIDATE", "1")
        with pytest.raises(ValueError, match=re.escape(message)):
            _append(args)
        monkeypatch.delenv("MLAROPE_VALIDATE")
    # a padding token's position is not read: no error
    _append(
        _append_args(device, positions=torch.tensor([1, 99, 0, 3], device=device)), validate=True
    )
    scale = torch.tensor([0.0], device=device)
    with pytest.raises(ValueError, match=re.escape("kv_scale = 0.0: a dequant scale must be")):
        _append(_append_args(device, cache_dtype=torch.uint8, kv_scale=scale), validate=True)


def test_query_validation(device):
    args = _query_args(device, positions=torch.tensor([1, 5, -3, 0], device=device))
    with pytest.raises(ValueError, match=re.escape("positions[2] = -3 is outside the table")):
        _query(args, validate=True)
    out = _query(args)  # without validation: NaN rope values for that token
    assert out[2, :, 32:].float().isnan().all() and not out[[0, 1, 3]].float().isnan().any()


# ------------------------------------------------------------------------------ eager plans
@pytest.mark.parametrize(
    "fmt,cache_dtype,scale",
    [("concat", torch.bfloat16, None), ("split", torch.uint8, "tensor"), ("fp8_656", None, None),
     ("concat", torch.float8_e4m3fn, "value"), ("fp8_584", None, None)],
)  # fmt: skip
def test_append_plan_replays_the_pipeline(device, monkeypatch, fmt, cache_dtype, scale):
    """A repeated call takes its plan (no checks run) and writes what the pipeline writes, on
    new tensors of the same metadata; a Python-number scale is read on every call."""
    clear_launch_cache()
    base = _append_args(device, fmt=fmt, cache_dtype=cache_dtype)
    if scale == "tensor":
        base["kv_scale"] = torch.tensor([0.05], device=device)
    _append(base)
    _append(base)
    key = next(iter(LAUNCH_CACHE.plans))
    assert LAUNCH_CACHE.plans[key][0][1].__class__ is _plans.Plan

    gen = torch.Generator().manual_seed(7)
    fresh = _append_args(device, fmt=fmt, cache_dtype=cache_dtype)
    fresh["kv_c"] = torch.randn(T, base["kv_c"].shape[1], generator=gen).to(torch.bfloat16)
    fresh["kv_c"] = fresh["kv_c"].to(device)
    fresh["slot_mapping"] = torch.tensor([7, 2, -1, 4], device=device)
    if scale == "tensor":
        fresh["kv_scale"] = torch.tensor([0.125], device=device)
    elif scale == "value":
        fresh["kv_scale"] = 0.125
    expected = _append_args(device, fmt=fmt, cache_dtype=cache_dtype, **{
        k: v for k, v in fresh.items() if k != "cache"
    })  # fmt: skip
    _append(expected, validate=True)  # the pipeline (validation takes no plan)

    def fail(*args, **kwargs):
        raise AssertionError("the checks ran: the call did not take its plan")

    monkeypatch.setattr(checks, "check_append_call", fail)
    _append(fresh)
    monkeypatch.undo()
    caches = (fresh["cache"], expected["cache"])
    if fmt == "split":
        caches = (torch.cat([c.view(torch.uint8) for c in caches[0]], -1),
                  torch.cat([c.view(torch.uint8) for c in caches[1]], -1))  # fmt: skip
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))


def test_plan_falls_back_to_the_pipeline(device):
    clear_launch_cache()
    base = _append_args(device, cache_dtype=torch.uint8)
    _append(base)
    _append(base)
    with pytest.raises(ValueError, match="kv_scale must be a finite positive"):
        _append(dict(base, kv_scale=-1.0))  # out of range: not taken by the plan
    with pytest.raises(ValueError, match="cache and kv_c share memory"):
        # the same metadata, but the cache's memory now holds kv_c
        cache = torch.zeros(2, 4, L + R, dtype=torch.uint8, device=device)
        kv_c = cache.view(-1)[: T * L * 2].view(torch.bfloat16).view(T, L)
        _append(dict(base, cache=cache, kv_c=kv_c))
    # other metadata: a new entry, not a wrong replay
    _append(dict(base, kv_c=base["kv_c"].float(), k_pe=base["k_pe"].float()))
    assert sum(len(entries) for entries in LAUNCH_CACHE.plans.values()) == 2


@pytest.mark.parametrize("shared", ["positions_and_slots", "cos_and_sin"])
def test_plan_of_a_call_with_one_tensor_twice(device, shared):
    """A call that passes one tensor for two arguments (``positions`` and ``slot_mapping`` of a
    fresh sequence, or ``cos`` and ``sin``) and a later call with two tensors of the same
    metadata: the later call reads each of its own tensors (the plan mapped both launch
    arguments to the first, so the replay wrote the entries at slot = position)."""
    clear_launch_cache()
    base = _append_args(device)
    if shared == "positions_and_slots":
        idx = torch.tensor([3, 1, 0, 6], device=device)
        first = dict(base, positions=idx, slot_mapping=idx)
        second = dict(base, positions=torch.tensor([5, 9, 2, 17], device=device),
                      slot_mapping=torch.tensor([0, 7, 4, 2], device=device))  # fmt: skip
    else:
        first = dict(base, sin=base["cos"])
        second = base
    _append(first)
    _append(first)
    assert not LAUNCH_CACHE.plans  # the aliased call takes the pipeline and records nothing
    cache = second["cache"]
    cache.zero_()
    _append(second)
    _append(second)  # a plan now, for the calls with distinct tensors
    assert sum(plan is not None for e in LAUNCH_CACHE.plans.values() for _, plan in e) == 1
    cache.zero_()
    _append(second)  # its replay
    want = torch.zeros_like(cache)
    _append(dict(second, cache=want), validate=True)  # the pipeline: no plan is taken
    assert torch.equal(cache, want)


def test_plans_live_in_the_one_launch_cache(device):
    """The serving plans are entries of the core's launch cache, apart from the core's keys,
    and ``clear_launch_cache()`` forgets them (they were kept in a table of their own, which
    the core's reset left alone)."""
    clear_launch_cache()
    base = _append_args(device, cache_dtype=torch.uint8)
    _append(base)
    _append(base)
    args = _query_args(device)
    _query(args)
    keys = list(LAUNCH_CACHE.plans)
    assert sorted(k[0] for k in keys) == ["serving.append", "serving.query"]
    clear_launch_cache()
    assert not LAUNCH_CACHE.plans


def test_query_plan(device, monkeypatch):
    clear_launch_cache()
    args = _query_args(device)
    first = _query(args, out_dtype=torch.float8_e4m3fn, q_scale=0.02)
    _query(args, out_dtype=torch.float8_e4m3fn, q_scale=0.02)
    monkeypatch.setattr(checks, "check_query_call", lambda *a: 1 / 0)
    again = _query(args, out_dtype=torch.float8_e4m3fn, q_scale=0.02)
    other_scale = _query(args, out_dtype=torch.float8_e4m3fn, q_scale=0.04)
    monkeypatch.undo()
    assert again.data_ptr() != first.data_ptr()  # a new tensor each call
    assert torch.equal(again.view(torch.uint8), first.view(torch.uint8))
    want = _query(args, out_dtype=torch.float8_e4m3fn, q_scale=0.04, validate=True)
    assert torch.equal(other_scale.view(torch.uint8), want.view(torch.uint8))
    out = torch.empty(T, H, 32 + R, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        assert _query(args, out=out) is out
    assert torch.equal(out, _query(args))


def test_one_launch_per_call(device):
    """Each op is one kernel launch (the pipeline, validated so that it records no plan of its
    own; a plan replays that one launch)."""
    for fmt, dtype in (
        ("concat", torch.uint8), ("split", torch.bfloat16), ("fp8_656", None), ("fp8_584", None),
    ):  # fmt: skip
        with recording() as launches:
            _append(_append_args(device, fmt=fmt, cache_dtype=dtype), validate=True)
        assert len(launches) == 1, fmt
    with recording() as launches:
        _query(_query_args(device), out_dtype=torch.float8_e4m3fn, q_scale=1.0, validate=True)
    assert len(launches) == 1


# --------------------------------------------------------------------------- torch.compile
def test_torch_compile_fullgraph(device):
    """Both ops traced whole (custom ops with their mutations declared) write what eager
    writes."""
    torch._dynamo.reset()
    a = _append_args(device, cache_dtype=torch.uint8)
    q = _query_args(device)
    scale = torch.tensor([0.05], device=device)

    def step(kv_c, k_pe, q_nope, q_pe, positions, slots, cache, out):
        serving.rope_append_kv_cache(
            kv_c, k_pe, a["cos"], a["sin"], positions, cache, slots, cache_format="concat",
            kv_scale=scale,
        )  # fmt: skip
        serving.rope_decode_query(q_nope, q_pe, a["cos"], a["sin"], positions, out=out)
        return serving.rope_decode_query(
            q_nope, q_pe, a["cos"], a["sin"], positions, out_dtype=torch.float8_e4m3fn,
            q_scale=0.5,
        )  # fmt: skip

    def run(fn):
        cache = torch.zeros(2, 4, L + R, dtype=torch.uint8, device=device)
        out = torch.empty(T, H, 32 + R, dtype=torch.bfloat16, device=device)
        fp8 = fn(a["kv_c"], a["k_pe"], q["q_nope"], q["q_pe"], a["positions"],
                 a["slot_mapping"], cache, out)  # fmt: skip
        return cache, out, fp8.view(torch.uint8)

    eager = run(step)
    compiled = run(torch.compile(step, fullgraph=True))
    for e, c in zip(eager, compiled, strict=True):
        assert torch.equal(e, c)


def test_torch_compile_fp8_584(device):
    """The DeepSeek-V4 cache under torch.compile(fullgraph=True): the custom op writes the
    strided cache view (blocks padded to 576 bytes) as eager does, padding untouched."""
    torch._dynamo.reset()
    a = _append_args(device, fmt="fp8_584")

    def step(kv_c, k_pe, positions, slots, cache):
        serving.rope_append_kv_cache(
            kv_c, k_pe, a["cos"], a["sin"], positions, cache, slots, cache_format="fp8_584"
        )

    raws = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        raw, cache = model1_cache(2, 4, device, gen=torch.Generator().manual_seed(4))
        fn(a["kv_c"], a["k_pe"], a["positions"], a["slot_mapping"], cache)
        raws.append(raw)
    assert torch.equal(raws[0], raws[1])


def test_torch_compile_refuses_shared_memory(device):
    """Under torch.compile(fullgraph=True), where tracing sees no addresses, a cache that holds
    kv_c and an out that holds q_pe are still refused, when the graph runs (the eager checks
    skip while tracing, and the compiled ops wrote through the overlap)."""
    torch._dynamo.reset()
    base = _append_args(device, cache_dtype=torch.uint8)
    cache = torch.zeros(2, 4, L + R, dtype=torch.uint8, device=device)
    kv_c = cache.view(-1)[: T * L * 2].view(torch.bfloat16).view(T, L)

    @torch.compile(backend="eager", fullgraph=True)
    def append(kv_c, cache):
        serving.rope_append_kv_cache(
            kv_c, base["k_pe"], base["cos"], base["sin"], base["positions"], cache,
            base["slot_mapping"], cache_format="concat", kv_scale=0.05,
        )  # fmt: skip

    with pytest.raises(ValueError, match="cache and kv_c share memory"):
        append(kv_c, cache)

    q = _query_args(device)
    out = torch.empty(T, H, 32 + R, dtype=torch.bfloat16, device=device)
    q_pe = out[..., 32:]

    @torch.compile(backend="eager", fullgraph=True)
    def query(q_pe, out):
        serving.rope_decode_query(q["q_nope"], q_pe, q["cos"], q["sin"], q["positions"], out=out)

    with pytest.raises(ValueError, match="out and q_pe share memory"):
        query(q_pe, out)


# ---------------------------------------------------------------------------- GPU: graphs
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["concat", "fp8_656", "fp8_584"])
def test_cuda_graph_decode_step(fmt):
    """One decode step (query and cache append) captured once, replayed with new positions,
    slots, scale and inputs each time: each replay writes what the reference writes."""
    device = torch.device("cuda")
    cos, sin = tables(R, 64, device)
    n_tok, heads = 8, 16
    gen = torch.Generator().manual_seed(3)
    latent = 448 if fmt == "fp8_584" else L
    kv_c = torch.zeros(n_tok, latent, dtype=torch.bfloat16, device=device)
    k_pe = torch.zeros(n_tok, R, dtype=torch.bfloat16, device=device)
    q_nope = torch.zeros(n_tok, heads, L, dtype=torch.bfloat16, device=device)
    q_pe = torch.zeros(n_tok, heads, R, dtype=torch.bfloat16, device=device)
    positions = torch.zeros(n_tok, dtype=torch.int64, device=device)
    slots = torch.full((n_tok,), -1, dtype=torch.int64, device=device)
    scale = torch.tensor([1.0], device=device)
    out = torch.empty(n_tok, heads, L + R, dtype=torch.float8_e4m3fn, device=device)
    if fmt == "fp8_584":
        raw, cache = model1_cache(16, 4, device)
    else:
        shape = (16, 4, 656) if fmt == "fp8_656" else (16, 4, L + R)
        raw = cache = torch.zeros(shape, dtype=torch.uint8, device=device)
    kv_scale = None if fmt in ("fp8_656", "fp8_584") else scale

    def step():
        serving.rope_append_kv_cache(
            kv_c, k_pe, cos, sin, positions, cache, slots, cache_format=fmt, kv_scale=kv_scale
        )
        serving.rope_decode_query(q_nope, q_pe, cos, sin, positions, out=out, q_scale=scale)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles and records outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for replay in range(3):
        new = {
            kv_c: torch.randn(n_tok, latent, generator=gen),
            k_pe: torch.randn(n_tok, R, generator=gen),
            q_nope: torch.randn(n_tok, heads, L, generator=gen),
            q_pe: torch.randn(n_tok, heads, R, generator=gen),
            positions: torch.randint(0, 64, (n_tok,), generator=gen),
            slots: torch.randperm(64, generator=gen)[:n_tok].masked_fill(
                torch.arange(n_tok) % 3 == 1, -1),
            scale: torch.tensor([0.01 * (replay + 1)]),
        }  # fmt: skip
        for dst, src in new.items():
            dst.copy_(src)
        expected_raw = raw.cpu()  # before the step, then written by the reference
        expected_cache = (
            expected_raw[:, : 4 * 584].view(16, 4, 1, 584) if fmt == "fp8_584" else expected_raw
        )
        ref.append_kv_cache(
            kv_c.cpu(), k_pe.cpu(), cos.cpu(), sin.cpu(), positions.cpu(), expected_cache, None,
            slots.cpu(), cache_format=fmt, kv_scale=None if kv_scale is None else scale.cpu(),
            interleaved_in=True, interleaved_out=True,
        )  # fmt: skip
        graph.replay()
        torch.cuda.synchronize()
        expected_q = ref.decode_query(
            q_nope.cpu(), q_pe.cpu(), cos.cpu(), sin.cpu(), positions.cpu(),
            out_dtype=torch.float8_e4m3fn, q_scale=scale.cpu(), interleaved_in=True,
            interleaved_out=True,
        )  # fmt: skip
        got_q = out.cpu().view(torch.uint8)
        want_q = expected_q.view(torch.uint8)
        assert torch.equal(got_q[..., :L], want_q[..., :L])
        # rope codes: at most one step apart (fused multiply-adds in the kernel)
        _assert_codes_close(got_q[..., L:], want_q[..., L:])
        _assert_cache_close(raw.cpu(), expected_raw, fmt)


def _assert_codes_close(got: torch.Tensor, want: torch.Tensor) -> None:
    a, b = ref.e4m3_decode(got).double(), ref.e4m3_decode(want).double()
    assert bool(((a - b).abs() <= ref.e4m3_step(torch.maximum(a.abs(), b.abs()))).all())


def _assert_cache_close(got, want, fmt):
    if fmt == "fp8_584":  # raw blocks: data rows of 576 (448 codes, 64 bf16), then scale rows
        rows, rows_want = got[:, : 4 * 576].reshape(-1, 576), want[:, : 4 * 576].reshape(-1, 576)
        assert torch.equal(rows[:, :448], rows_want[:, :448])  # codes: exact
        assert torch.equal(got[:, 4 * 576 :], want[:, 4 * 576 :])  # scale rows, pad, padding
        rope_got = rows[:, 448:].contiguous().view(torch.bfloat16).float()
        rope_want = rows_want[:, 448:].contiguous().view(torch.bfloat16).float()
        assert torch.allclose(rope_got, rope_want, rtol=2**-7, atol=0, equal_nan=True)
    elif fmt == "fp8_656":
        assert torch.equal(got[..., :528], want[..., :528])  # codes and tile scales: exact
        rope_got = got[..., 528:].contiguous().view(torch.bfloat16).float()
        rope_want = want[..., 528:].contiguous().view(torch.bfloat16).float()
        assert torch.allclose(rope_got, rope_want, rtol=2**-7, atol=0)
    else:
        assert torch.equal(got[..., :L], want[..., :L])
        _assert_codes_close(got[..., L:], want[..., L:])


@pytest.mark.gpu
def test_one_cuda_kernel_per_call():
    """On the GPU each op runs exactly one kernel (the profiler counts them)."""
    device = torch.device("cuda")
    args = _append_args(device, cache_dtype=torch.uint8)
    qargs = _query_args(device)
    _append(args)
    _query(qargs, out_dtype=torch.float8_e4m3fn, q_scale=0.5)
    torch.cuda.synchronize()
    for call in (lambda: _append(args),
                 lambda: _query(qargs, out_dtype=torch.float8_e4m3fn, q_scale=0.5)):  # fmt: skip
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert len(kernels) == 1, [e.name for e in kernels]


def test_demo_serving(device, capsys):
    """``python -m mlarope demo --serving`` on this lane's backend: decode steps through the
    FP8 cache, checked against the reference."""
    from mlarope.tools import demo

    assert demo.main(["--serving", "--device", device.type, "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "fp8_656 cache" in out and "demo passed" in out


def test_docs_example_runs_as_pasted(tmp_path):
    """docs/serving.md's first example, on the lane's device."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300,
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    expected = "torch.Size([4, 16, 576]) torch.Size([2, 512]) torch.Size([2, 64])"
    assert result.stdout.strip() == expected


@pytest.mark.parametrize("backend", ["kernels", "reference"])
def test_negated_views_are_refused(backend, monkeypatch):
    """A lazily negated view's memory holds its values un-negated, which the kernels read and
    the reference did not: the serving ops accepted them for every tensor (found by review)."""
    if backend == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    cos, sin = mlarope.YarnConfig(dim=64).cos_sin(64)
    kv_c = torch.randn(2, 512, dtype=torch.bfloat16)
    k_pe = torch.randn(2, 64, dtype=torch.bfloat16)
    cache = torch.zeros(2, 4, 576, dtype=torch.bfloat16)
    args = dict(kv_c=kv_c, k_pe=k_pe, positions=torch.tensor([1, 2]), cache=cache,
                slot_mapping=torch.tensor([0, 1]))  # fmt: skip
    for name in args:
        bad = {**args, name: torch._neg_view(args[name])}
        with pytest.raises(ValueError, match=f"{name} is a negated view"):
            serving.rope_append_kv_cache(cos=cos, sin=sin, cache_format="concat", **bad)
    assert not cache.any()


@pytest.mark.parametrize("backend", ["kernels", "reference"])
def test_validation_in_a_fullgraph_compile(backend, monkeypatch):
    """``validate=True`` inside ``torch.compile(fullgraph=True)``: the serving ops' device-data
    checks are an op of the graph, which raises the eager error when the graph runs (a traced
    branch on the slots failed every trace, as the core ops' did; found by review)."""
    if backend == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch._dynamo.reset()
    cos, sin = mlarope.YarnConfig(dim=64).cos_sin(64)
    kv_c = torch.randn(2, 512, dtype=torch.bfloat16)
    k_pe = torch.randn(2, 64, dtype=torch.bfloat16)
    cache = torch.zeros(2, 4, 576, dtype=torch.bfloat16)
    q = torch.randn(2, 2, 512, dtype=torch.bfloat16), torch.randn(2, 2, 64, dtype=torch.bfloat16)
    o = torch.randn(2, 2, 512, dtype=torch.bfloat16)

    def append(positions, slots):
        serving.rope_append_kv_cache(kv_c, k_pe, cos, sin, positions, cache, slots,
                                     cache_format="concat", validate=True)  # fmt: skip

    def query(positions, slots):
        return serving.rope_decode_query(*q, cos, sin, positions, validate=True)

    def output(positions, slots):
        return serving.rope_inverse_quant_output(o, cos, sin, positions, validate=True)

    good, bad_position = torch.tensor([1, 2]), torch.tensor([1, 64])
    slots, repeated = torch.tensor([0, 1]), torch.tensor([0, 0])
    cases = [(append, bad_position, slots), (append, good, repeated),
             (query, bad_position, slots), (output, bad_position, slots)]  # fmt: skip
    for op, positions, op_slots in cases:
        compiled = torch.compile(op, fullgraph=True, backend="aot_eager")
        compiled(good, slots)
        with pytest.raises(ValueError) as eager:
            op(positions, op_slots)
        with pytest.raises(ValueError) as in_graph:
            compiled(positions, op_slots)
        assert str(in_graph.value) == str(eager.value), op.__name__
