"""Pair tables ``cos, sin: [P, R / 2]`` (one entry per rotated pair, ``pair_tables=True``) in
the append and the decode query: the same bits as the full tables ``[P, R]`` whose halves
repeat them, on each backend (the Triton kernels, and on the CPU lane the PyTorch reference
too), for every cache format, both layouts and the FP8 outputs, and through the launch plans of
repeated calls; views of one FlashInfer / vLLM-style ``cos_sin_cache [P, R]`` (cos then sin) are
taken as they are; the form is asked for, never inferred: a table of the other form's width is
refused, with the values named."""

from __future__ import annotations

import os
import re

import pytest
import torch

# Imported before a test sets TRITON_INTERPRET=0 for the PyTorch backend (see
# test_serving_append.py).
import mlarope.kernels.serving  # noqa: F401
from mlarope import serving
from tests.serving_support import model1_cache, tables

T, ROWS, BLOCK = 6, 40, 4
SLOTS = [5, -1, 0, 11, 3, 2]
POSITIONS = [3, 9, ROWS + 2, 0, ROWS - 1, 17]  # one outside the table: NaN either way


def _backends(device) -> list[str]:
    return ["kernel"] if device.type == "cuda" else ["kernel", "reference"]


def _on(backend: str, fn):
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


def _pair_tables(rope: int, device):
    """``(full, pair)``: YaRN tables ``[P, R]`` (their halves equal) and ``[P, R / 2]``."""
    cos, sin = tables(rope, ROWS, device)
    half = rope // 2
    assert torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])
    return (cos, sin), (cos[:, :half].contiguous(), sin[:, :half].contiguous())


def _cache(fmt: str, latent: int, rope: int, dtype, device):
    gen = torch.Generator().manual_seed(3)
    if fmt == "fp8_584":
        return model1_cache(3, BLOCK, device, gen=gen)[1]
    if fmt == "fp8_656":
        raw = torch.randint(0, 256, (3, BLOCK, 656), generator=gen, dtype=torch.uint8)
        return raw.to(device)

    def alloc(width):
        raw = torch.randint(0, 256, (3, BLOCK, width * dtype.itemsize), generator=gen)
        return raw.to(torch.uint8).view(dtype).to(device)

    if fmt == "concat":
        return alloc(latent + rope)
    return alloc(latent), alloc(rope)


def _bytes(cache) -> list[torch.Tensor]:
    parts = cache if isinstance(cache, tuple) else (cache,)
    return [p.view(torch.uint8).clone() for p in parts]


APPEND_CASES = [
    # (format, latent, rope, cache dtype, interleaved, interleaved_out)
    ("concat", 64, 64, torch.bfloat16, True, True),
    ("concat", 40, 32, torch.bfloat16, False, False),
    ("split", 64, 128, torch.bfloat16, True, False),
    ("split", 64, 64, torch.float8_e4m3fn, False, True),
    ("fp8_656", 512, 64, None, True, True),
    ("fp8_584", 448, 64, None, True, True),
]


@pytest.mark.parametrize(
    "fmt,latent,rope,cache_dtype,interleaved,interleaved_out",
    APPEND_CASES,
    ids=[f"{c[0]}-{c[2]}-{c[3]}-{c[4]}{c[5]}".replace("torch.", "") for c in APPEND_CASES],
)
def test_append_pair_tables_store_the_full_tables_bits(
    device, fmt, latent, rope, cache_dtype, interleaved, interleaved_out
):
    gen = torch.Generator().manual_seed(5)
    kv_c = torch.randn(T, latent, generator=gen).to(torch.bfloat16).to(device)
    k_pe = torch.randn(T, rope, generator=gen).to(torch.bfloat16).to(device)
    slots = torch.tensor(SLOTS, device=device)
    positions = torch.tensor(POSITIONS, device=device)
    full, pair = _pair_tables(rope, device)
    fp8 = cache_dtype == torch.float8_e4m3fn
    dtype = cache_dtype or torch.uint8
    results = {}
    for backend in _backends(device):
        for name, (cos, sin) in (("full", full), ("pair", pair)):
            cache = _cache(fmt, latent, rope, dtype, device)

            def call(cos=cos, sin=sin, cache=cache, name=name):
                serving.rope_append_kv_cache(
                    kv_c, k_pe, cos, sin, positions, cache, slots, cache_format=fmt,
                    kv_scale=0.07 if fp8 else None, interleaved=interleaved,
                    interleaved_out=interleaved_out, pair_tables=name == "pair",
                )  # fmt: skip

            _on(backend, call)
            results[backend, name] = _bytes(cache)
    for backend in _backends(device):
        for a, b in zip(results[backend, "full"], results[backend, "pair"], strict=True):
            assert torch.equal(a, b), f"{backend}: pair tables stored other bits"
    written = results[_backends(device)[0], "pair"]
    before = _bytes(_cache(fmt, latent, rope, dtype, device))
    assert any(not torch.equal(a, b) for a, b in zip(written, before, strict=True))


QUERY_CASES = [(None, True, True), (None, False, False), (torch.float8_e4m3fn, True, False)]


@pytest.mark.parametrize("out_dtype,interleaved,interleaved_out", QUERY_CASES)
def test_query_pair_tables_give_the_full_tables_bits(
    device, out_dtype, interleaved, interleaved_out
):
    gen = torch.Generator().manual_seed(7)
    q_nope = torch.randn(T, 3, 64, generator=gen).to(torch.bfloat16).to(device)
    q_pe = torch.randn(T, 3, 64, generator=gen).to(torch.bfloat16).to(device)
    positions = torch.tensor(POSITIONS, device=device)
    full, pair = _pair_tables(64, device)
    scale = 0.05 if out_dtype is not None else None
    for backend in _backends(device):
        outs = []
        for (cos, sin), is_pair in ((full, False), (pair, True)):

            def call(cos=cos, sin=sin, is_pair=is_pair):
                return serving.rope_decode_query(
                    q_nope, q_pe, cos, sin, positions, out_dtype=out_dtype, q_scale=scale,
                    interleaved=interleaved, interleaved_out=interleaved_out,
                    pair_tables=is_pair,
                )  # fmt: skip

            outs.append(_on(backend, call))
        assert outs[1].shape == (T, 3, 128)
        assert torch.equal(outs[0].view(torch.uint8), outs[1].view(torch.uint8)), backend


def test_cos_sin_cache_views_are_taken_as_they_are(device):
    """FlashInfer's and vLLM's ``cos_sin_cache [P, R]``: cos in the first half, sin in the
    second; its two column views (row stride R, one storage) are pair tables."""
    full, pair = _pair_tables(64, device)
    cos_sin = torch.cat(pair, 1)
    views = cos_sin[:, :32], cos_sin[:, 32:]
    gen = torch.Generator().manual_seed(9)
    kv_c = torch.randn(T, 64, generator=gen).to(torch.bfloat16).to(device)
    k_pe = torch.randn(T, 64, generator=gen).to(torch.bfloat16).to(device)
    slots = torch.tensor(SLOTS, device=device)
    positions = torch.tensor(POSITIONS, device=device)
    caches = []
    for (cos, sin), is_pair in ((full, False), (views, True)):
        cache = torch.zeros(3, BLOCK, 128, dtype=torch.bfloat16, device=device)
        serving.rope_append_kv_cache(
            kv_c, k_pe, cos, sin, positions, cache, slots, cache_format="concat",
            pair_tables=is_pair,
        )  # fmt: skip
        caches.append(cache)
    assert torch.equal(caches[0].view(torch.int16), caches[1].view(torch.int16))
    assert caches[1].any()


def test_repeated_calls_take_their_own_plans(device):
    """Full-table and pair-table calls of the same shapes, in turn, several times: each repeated
    call replays a launch plan (the guard tells the tables' shapes apart, the key the flag), and
    every result is the first call's bits."""
    from mlarope._launch_cache import LAUNCH_CACHE, clear_launch_cache

    full, pair = _pair_tables(64, device)
    gen = torch.Generator().manual_seed(13)
    kv_c = torch.randn(T, 64, generator=gen).to(torch.bfloat16).to(device)
    k_pe = torch.randn(T, 64, generator=gen).to(torch.bfloat16).to(device)
    q_nope = torch.randn(T, 2, 64, generator=gen).to(torch.bfloat16).to(device)
    q_pe = torch.randn(T, 2, 64, generator=gen).to(torch.bfloat16).to(device)
    slots = torch.tensor(SLOTS, device=device)
    positions = torch.tensor(POSITIONS, device=device)
    clear_launch_cache()
    caches, queries = {}, {}
    for is_pair in (False, True, True, False, True, False):
        cos, sin = pair if is_pair else full
        cache = torch.zeros(3, BLOCK, 128, dtype=torch.bfloat16, device=device)
        serving.rope_append_kv_cache(
            kv_c, k_pe, cos, sin, positions, cache, slots, cache_format="concat",
            pair_tables=is_pair,
        )  # fmt: skip
        query = serving.rope_decode_query(
            q_nope, q_pe, cos, sin, positions, out_dtype=torch.float8_e4m3fn, q_scale=0.05,
            pair_tables=is_pair,
        )  # fmt: skip
        caches.setdefault(is_pair, cache)
        queries.setdefault(is_pair, query)
        assert torch.equal(cache.view(torch.int16), caches[is_pair].view(torch.int16))
        assert torch.equal(query.view(torch.uint8), queries[is_pair].view(torch.uint8))
    assert torch.equal(caches[True].view(torch.int16), caches[False].view(torch.int16))
    assert torch.equal(queries[True].view(torch.uint8), queries[False].view(torch.uint8))
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        keys = [k for k in LAUNCH_CACHE.plans if k[0].startswith("serving.")]
        assert len(keys) == 4, keys  # two ops x two flags


def test_the_form_is_asked_for_not_inferred():
    """A table of half the rope width is refused without ``pair_tables=True`` (a table of the
    wrong width is not read as pair tables), one of the full width with it; the output op, whose
    rope width comes from the tables, checks the flag's type and the width it implies."""
    kv_c = torch.zeros(T, 64, dtype=torch.bfloat16)
    k_pe = torch.zeros(T, 64, dtype=torch.bfloat16)
    cache = torch.zeros(3, BLOCK, 128, dtype=torch.bfloat16)
    index = torch.zeros(T, dtype=torch.int64)
    half, full = torch.zeros(ROWS, 32), torch.zeros(ROWS, 64)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "cos.shape[-1] must be the rope dim R = k_pe.shape[-1] = 64, got 32 (cos shape "
            "(40, 32)); for pair tables [P, R / 2] (one entry per pair) pass pair_tables=True"
        ),
    ):
        serving.rope_append_kv_cache(
            kv_c, k_pe, half, half, index, cache, index, cache_format="concat"
        )
    with pytest.raises(
        ValueError,
        match=re.escape(
            "with pair_tables=True, cos.shape[-1] must be R / 2 = 32 (pair tables [P, R / 2], "
            "R = k_pe.shape[-1] = 64), got 64"
        ),
    ):
        serving.rope_append_kv_cache(
            kv_c, k_pe, full, full, index, cache, index, cache_format="concat", pair_tables=True
        )
    q = torch.zeros(T, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=re.escape("pass pair_tables=True")):
        serving.rope_decode_query(q, q, half, half, index)
    with pytest.raises(TypeError, match="pair_tables must be a bool"):
        serving.rope_decode_query(q, q, half, half, index, pair_tables=1)
    o = torch.zeros(T, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="pair_tables must be a bool"):
        serving.rope_inverse_quant_output(o, half, half, index, pair_tables="yes")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "with pair_tables=True, the rope dim R = 2 * cos.shape[-1] must be one of (32, 64, "
            "128), got 256 (cos shape (40, 128))"
        ),
    ):
        serving.rope_inverse_quant_output(o, *[torch.zeros(ROWS, 128)] * 2, index,
                                          pair_tables=True)  # fmt: skip


def test_table_width_neither_r_nor_half_is_refused():
    kv_c = torch.zeros(T, 64, dtype=torch.bfloat16)
    k_pe = torch.zeros(T, 64, dtype=torch.bfloat16)
    cache = torch.zeros(3, BLOCK, 128, dtype=torch.bfloat16)
    index = torch.zeros(T, dtype=torch.int64)
    cos = torch.zeros(ROWS, 128)
    with pytest.raises(
        ValueError, match=re.escape("must be the rope dim R = k_pe.shape[-1] = 64, got 128")
    ):
        serving.rope_append_kv_cache(
            kv_c, k_pe, cos, cos, index, cache, index, cache_format="concat"
        )
    q = torch.zeros(T, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=re.escape("must be R / 2 = 32 (pair tables")):
        serving.rope_decode_query(
            q, q, torch.zeros(ROWS, 16), torch.zeros(ROWS, 16), index, pair_tables=True
        )
    with pytest.raises(ValueError, match=re.escape("R = k_pe.shape[-1] must be one of")):
        serving.rope_append_kv_cache(
            kv_c, k_pe[:, :48], cos[:, :24], cos[:, :24], index,
            torch.zeros(3, BLOCK, 112, dtype=torch.bfloat16), index, cache_format="concat",
        )  # fmt: skip


def test_a_recorded_plan_does_not_skip_the_form_check():
    """A full-table call recorded as a launch plan, then the same tensors with
    ``pair_tables=True``: the flag is in the plan's key, so the call takes the checks and is
    refused (a replay would have skipped them); the PyTorch forms refuse it as well."""
    from mlarope._launch_cache import clear_launch_cache
    from mlarope.serving import reference

    full, _ = _pair_tables(64, "cpu")
    kv_c = torch.zeros(T, 64, dtype=torch.bfloat16)
    k_pe = torch.zeros(T, 64, dtype=torch.bfloat16)
    cache = torch.zeros(3, BLOCK, 128, dtype=torch.bfloat16)
    positions, slots = torch.tensor(POSITIONS), torch.tensor(SLOTS)
    q_nope, q_pe = torch.zeros(T, 2, 64, dtype=torch.bfloat16), torch.zeros(T, 2, 64)
    q_pe = q_pe.to(torch.bfloat16)
    clear_launch_cache()
    for _ in range(3):
        serving.rope_append_kv_cache(
            kv_c, k_pe, *full, positions, cache, slots, cache_format="concat"
        )
        serving.rope_decode_query(q_nope, q_pe, *full, positions)
    message = re.escape("with pair_tables=True, cos.shape[-1] must be R / 2 = 32")
    for append in (serving.rope_append_kv_cache, reference.rope_append_kv_cache):
        with pytest.raises(ValueError, match=message):
            append(
                kv_c, k_pe, *full, positions, cache, slots, cache_format="concat",
                pair_tables=True,
            )  # fmt: skip
    for query in (serving.rope_decode_query, reference.rope_decode_query):
        with pytest.raises(ValueError, match=message):
            query(q_nope, q_pe, *full, positions, pair_tables=True)
        with pytest.raises(TypeError, match="pair_tables must be a bool"):
            query(q_nope, q_pe, *full, positions, pair_tables=None)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_pair_tables_under_torch_compile(device, backend):
    """The three ops with pair tables traced whole write what eager writes with the full
    tables."""
    torch._dynamo.reset()
    full, pair = _pair_tables(64, device)
    gen = torch.Generator().manual_seed(17)
    kv_c = torch.randn(T, 64, generator=gen).to(torch.bfloat16).to(device)
    k_pe = torch.randn(T, 64, generator=gen).to(torch.bfloat16).to(device)
    q_nope = torch.randn(T, 2, 64, generator=gen).to(torch.bfloat16).to(device)
    q_pe = torch.randn(T, 2, 64, generator=gen).to(torch.bfloat16).to(device)
    slots = torch.tensor(SLOTS, device=device)
    positions = torch.tensor(POSITIONS, device=device)

    def step(tables, is_pair, cache):
        serving.rope_append_kv_cache(
            kv_c, k_pe, *tables, positions, cache, slots, cache_format="concat",
            pair_tables=is_pair,
        )  # fmt: skip
        query = serving.rope_decode_query(
            q_nope, q_pe, *tables, positions, out_dtype=torch.float8_e4m3fn, q_scale=0.05,
            pair_tables=is_pair,
        )  # fmt: skip
        out, scale = serving.rope_inverse_quant_output(
            o, *tables, positions, groups=2, pair_tables=is_pair
        )
        return query, out, scale

    o = torch.randn(T, 2, 128, generator=gen).to(torch.bfloat16).to(device)
    caches = [torch.zeros(3, BLOCK, 128, dtype=torch.bfloat16, device=device) for _ in range(2)]
    eager = step(full, False, caches[0])
    compiled = torch.compile(step, fullgraph=True, backend=backend)(pair, True, caches[1])
    assert torch.equal(caches[0].view(torch.int16), caches[1].view(torch.int16))
    assert caches[1].any()
    for e, c in zip(eager, compiled, strict=True):
        assert torch.equal(e.view(torch.uint8), c.view(torch.uint8))
    # an engine's cos_sin_cache halves without the flag: refused when the graph runs
    cos_sin = torch.cat(pair, 1)

    def output(cos, sin):
        return serving.rope_inverse_quant_output(o, cos, sin, positions, groups=2)

    with pytest.raises(ValueError, match=re.escape("pass pair_tables=True")):
        torch.compile(output, fullgraph=True, backend=backend)(cos_sin[:, :32], cos_sin[:, 32:])


# ------------------------------------------------------------------------ the attention output
OUTPUT_CASES = [
    # (tokens, heads, head dim D, rope R, groups, interleaved, interleaved_out)
    (4, 4, 512, 64, 2, True, True),  # DeepSeek-V4's head
    (3, 2, 256, 128, 1, False, True),
    (6, 2, 128, 32, 2, True, False),
]


@pytest.mark.parametrize("case", OUTPUT_CASES, ids=lambda c: "-".join(map(str, c)))
def test_output_pair_tables_give_the_full_tables_bits(device, case):
    """``rope_inverse_quant_output`` with pair tables (contiguous, and an engine's
    ``cos_sin_cache`` halves taken as they are) writes the codes and scales of the full tables,
    on each backend and in the PyTorch form."""
    from mlarope.serving import reference

    tokens, heads, head_dim, rope, groups, interleaved, interleaved_out = case
    full, pair = _pair_tables(rope, device)
    cos_sin = torch.cat(pair, 1)
    views = cos_sin[:, : rope // 2], cos_sin[:, rope // 2 :]
    gen = torch.Generator().manual_seed(19)
    o = torch.randn(tokens, heads, head_dim, generator=gen).to(torch.bfloat16).to(device)
    positions = torch.tensor(POSITIONS[:tokens], device=device)
    for backend in _backends(device):
        results = []
        for fn in (serving.rope_inverse_quant_output, reference.rope_inverse_quant_output):
            for given, is_pair in ((full, False), (pair, True), (views, True)):

                def call(fn=fn, given=given, is_pair=is_pair):
                    return fn(
                        o, *given, positions, groups=groups, interleaved=interleaved,
                        interleaved_out=interleaved_out, pair_tables=is_pair,
                    )  # fmt: skip

                out, scale = _on(backend, call)
                results.append((out.view(torch.uint8).cpu(), scale.cpu()))
        for out, scale in results[1:]:
            assert torch.equal(out, results[0][0]) and torch.equal(scale, results[0][1]), backend
    # the rope slice was rotated: the identity tables would give other codes
    ones, zeros = torch.ones_like(full[0]), torch.zeros_like(full[1])
    plain, _ = serving.rope_inverse_quant_output(o, ones, zeros, positions, groups=groups)
    assert not torch.equal(plain.view(torch.uint8).cpu(), results[0][0])


def _cos_sin_cache_call():
    """The case of issue 36: an engine's ``cos_sin_cache [P, 64]`` halves, ``o: [4, 16, 512]``."""
    _, pair = _pair_tables(64, "cpu")
    cos_sin = torch.cat(pair, 1)
    gen = torch.Generator().manual_seed(23)
    o = torch.randn(4, 16, 512, generator=gen).to(torch.bfloat16)
    return o, cos_sin[:, :32], cos_sin[:, 32:], torch.tensor([3, 9, 0, 17])


def test_output_refuses_cos_sin_cache_halves_without_the_flag():
    """The two halves of one ``[P, R]`` buffer (cos, then sin) without ``pair_tables=True`` were
    read as full tables of ``R / 2`` channels: 3,148 of 32,768 codes wrong, without an error.
    They are refused, naming the flag, by the public call and the PyTorch form; with the flag
    they give the full tables' bits (above)."""
    from mlarope.serving import reference

    o, cos, sin, positions = _cos_sin_cache_call()
    message = re.escape(
        "cos and sin are the two halves of one [P, 64] buffer (an engine's cos_sin_cache [P, R]: "
        "cos, then sin), the pair tables [P, R / 2] of R = 64: pass pair_tables=True"
    )
    for fn in (serving.rope_inverse_quant_output, reference.rope_inverse_quant_output):
        with pytest.raises(ValueError, match=message):
            fn(o, cos, sin, positions, groups=2)
    # full tables of R / 2 that lie side by side in one buffer: copies are taken as full tables
    out, _ = serving.rope_inverse_quant_output(
        o, cos.contiguous(), sin.contiguous(), positions, groups=2
    )
    assert out.shape == (4, 2, 8 * 512)


def test_a_recorded_output_plan_does_not_take_the_halves():
    """A launch plan recorded from full tables of the halves' shape and strides (two buffers),
    then the halves of one buffer: the call takes the checks, which refuse it (a replay would
    have read them as full tables)."""
    from mlarope._launch_cache import clear_launch_cache

    o, cos, sin, positions = _cos_sin_cache_call()
    clear_launch_cache()
    apart = [torch.randn(ROWS, 64)[:, :32] for _ in range(2)]
    assert apart[0].stride() == cos.stride() and apart[1].stride() == sin.stride()
    for _ in range(3):
        serving.rope_inverse_quant_output(o, *apart, positions, groups=2)
    with pytest.raises(ValueError, match=re.escape("pass pair_tables=True")):
        serving.rope_inverse_quant_output(o, cos, sin, positions, groups=2)
    for _ in range(2):  # and the other way round: a pair-table plan, then the flag dropped
        serving.rope_inverse_quant_output(o, cos, sin, positions, groups=2, pair_tables=True)
    with pytest.raises(ValueError, match=re.escape("pass pair_tables=True")):
        serving.rope_inverse_quant_output(o, cos, sin, positions, groups=2)
