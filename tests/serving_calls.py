"""The calls of the serving API tests: each op's arguments (small DeepSeek-V3-shaped inputs on
a device, any of them replaced), the calls made from them, and a call on a chosen backend."""

from __future__ import annotations

import os

import torch

from mlarope import serving
from mlarope.serving import formats
from tests.serving_support import model1_cache, tables

L, R, T, H = 512, 64, 4, 3


def append_args(device, fmt="concat", cache_dtype=torch.bfloat16, **changes):
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


def query_args(device, **changes):
    gen = torch.Generator().manual_seed(1)
    cos, sin = tables(R, 32, device)
    args = dict(
        q_nope=torch.randn(T, H, 32, generator=gen).to(torch.bfloat16).to(device),
        q_pe=torch.randn(T, H, R, generator=gen).to(torch.bfloat16).to(device),
        cos=cos, sin=sin, positions=torch.tensor([1, 5, 0, 31], device=device),
    )  # fmt: skip
    args.update(changes)
    return args


def call_append(args, **kw):
    a = dict(args)
    return serving.rope_append_kv_cache(
        a.pop("kv_c"), a.pop("k_pe"), a.pop("cos"), a.pop("sin"), a.pop("positions"),
        a.pop("cache"), a.pop("slot_mapping"), **a, **kw,
    )  # fmt: skip


def call_query(args, **kw):
    a = dict(args)
    return serving.rope_decode_query(
        a.pop("q_nope"), a.pop("q_pe"), a.pop("cos"), a.pop("sin"), a.pop("positions"), **a, **kw
    )


def on_backend(backend: str, fn):
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
