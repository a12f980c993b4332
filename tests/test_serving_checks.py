"""The serving API's host checks: each error names the value (the append, the query, the
reader, the scales, every cache format's layout), and what the checks take: every real scalar
as a scale, a zero-width latent; what they refuse: zero-size blocks."""

from __future__ import annotations

import os
import re
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch

from mlarope import serving
from mlarope._launch_cache import LAUNCH_CACHE, clear_launch_cache
from mlarope.serving import _plans
from tests.serving_calls import (
    H,
    L,
    R,
    T,
    append_args,
    call_append,
    call_query,
    on_backend,
    query_args,
)
from tests.serving_support import model1_cache, tables


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
        call_append(append_args("cpu", **change))


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
        args = append_args("cpu", cache_dtype=torch.float8_e4m3fn, kv_scale=scale)
        with pytest.raises(error, match=re.escape(message)):
            call_append(args)
    with pytest.raises(ValueError, match="kv_scale must be None for cache_format='fp8_656'"):
        call_append(append_args("cpu", fmt="fp8_656", kv_scale=0.5))


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
        args = append_args("cpu", cache_dtype=fp8, kv_scale=scale)
        query = on_backend(
            backend, lambda scale=scale: call_query(query_args("cpu"), out_dtype=fp8, q_scale=scale)
        )
        on_backend(backend, lambda args=args: call_append(args))
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
    args = append_args("cpu", cache_dtype=torch.float8_e4m3fn, kv_scale=np.float32(0.5))
    for _ in range(2):
        on_backend(backend, lambda: call_append(args))
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
            call_append(append_args("cpu", cache_dtype=torch.float8_e4m3fn, kv_scale=scale))
        with pytest.raises(TypeError, match="q_scale " + taken):
            call_query(query_args("cpu"), out_dtype=torch.float8_e4m3fn, q_scale=scale)
        cache = torch.zeros(2, 4, L + R, dtype=torch.uint8)
        with pytest.raises(TypeError, match="kv_scale " + taken):
            serving.read_kv_cache(cache, torch.tensor([0]), cache_format="concat", rope_dim=R,
                                  kv_scale=scale)  # fmt: skip
    for scale in (torch.tensor(0.5, dtype=torch.float64), torch.tensor([1], dtype=torch.int32)):
        with pytest.raises(TypeError, match=re.escape(
            "kv_scale as a tensor must be a 1-element float32 tensor on the inputs' device (the "
            "kernel reads it there), got"
        )):  # fmt: skip
            call_append(append_args("cpu", cache_dtype=torch.float8_e4m3fn, kv_scale=scale))
    for scale in (10**400, np.float64(1e300), -np.float32(1)):
        with pytest.raises(ValueError, match="kv_scale must be a finite positive float32 number"):
            call_append(append_args("cpu", cache_dtype=torch.float8_e4m3fn, kv_scale=scale))


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
            call_append(append_args("cpu", fmt="split", cache=cache))
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
            call_append(append_args("cpu", fmt="fp8_656", cache=cache))
    with pytest.raises(ValueError, match=r"holds L = 512 latent and R = 64 .* got L = kv_c.shape"):
        call_append(
            append_args("cpu", fmt="fp8_656", kv_c=torch.zeros(T, 256, dtype=torch.bfloat16))
        )


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
        call_append(append_args("cpu", fmt="fp8_584", cache=cache))


def test_fp8_584_shape_and_scale_checks():
    with pytest.raises(ValueError, match=r"holds L = 448 latent and R = 64 .* got L = kv_c.shape"):
        call_append(
            append_args("cpu", fmt="fp8_584", kv_c=torch.zeros(T, 512, dtype=torch.bfloat16))
        )
    with pytest.raises(ValueError, match="kv_scale must be None for cache_format='fp8_584'"):
        call_append(append_args("cpu", fmt="fp8_584", kv_scale=0.5))
    args = append_args("cpu", fmt="fp8_584")
    cos, sin = tables(32, 32, "cpu")
    with pytest.raises(ValueError, match=re.escape("the rope dim R = k_pe.shape[-1] = 64, got 32")):
        call_append(dict(args, cos=cos, sin=sin))
    # the 3-D form, a float8 and an int8 cache, a single block: accepted
    raw, cache = model1_cache(1, 4, "cpu", dtype=torch.float8_e4m3fn, four_d=False)
    call_append(dict(args, cache=cache, slot_mapping=torch.tensor([3, -1, 0, 2])))
    call_append(dict(args, cache=model1_cache(2, 4, "cpu", dtype=torch.int8)[1]))
    assert raw.any()


def test_append_refuses_gradients_and_inference_caches():
    kv_c = torch.zeros(T, L, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(ValueError, match="kv_c requires grad; the serving ops are not differ"):
        call_append(append_args("cpu", kv_c=kv_c))
    with torch.no_grad():
        call_append(append_args("cpu", kv_c=kv_c))  # fine without grad mode
    with torch.inference_mode():
        cache = torch.zeros(2, 4, L + R, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cache is an inference tensor"):
        call_append(append_args("cpu", cache=cache))


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
        call_query(query_args("cpu", **change))


def test_query_refuses_an_out_that_overlaps_its_inputs():
    buf = torch.zeros(T, H, 32 + R, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out and q_pe share memory"):
        call_query(query_args("cpu", q_pe=buf[..., 32:], out=buf))


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
        args = append_args(device, fmt=fmt, cache_dtype=dtype)
        call_append(args)
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
        args = append_args("cpu", fmt=fmt, cache=cache, slot_mapping=torch.full((T,), -1))
        with pytest.raises(ValueError, match=re.escape("block_size = ") + ".*" + re.escape(
            "shape[1] must be at least 1 (slot s is entry s % block_size of block s // "
            "block_size), got shape ("
        )):  # fmt: skip
            call_append(args)
    for backend in ("kernels", "reference"):
        args = append_args("cpu", kv_c=torch.zeros(T, 0, dtype=torch.bfloat16),
                            cache=torch.zeros(2, 4, R, dtype=torch.bfloat16))  # fmt: skip
        on_backend(backend, lambda args=args: call_append(args))
        latent, rope = serving.read_kv_cache(
            args["cache"], torch.tensor([3, 0, 6]), cache_format="concat", rope_dim=R
        )
        assert latent.shape == (3, 0) and rope.shape == (3, R)
        assert torch.equal(rope, args["cache"].view(-1, R)[[3, 0, 6]].float()) and rope.any()
