"""The serving ops' memory rule (``mlarope._memory``): nothing written may share an element with
anything read or with another written tensor, and the rule is about elements, not byte spans.

- Refused on every backend, eager, on a repeated call's plan and under ``torch.compile`` (the
  eager, aot_eager and inductor backends): one tensor for both parts of a split cache (the
  rotated ``k_pe`` overwrote the latent), a cache that holds ``kv_c``, an ``out`` that holds
  ``q_pe``, caches and outputs whose elements share memory; the errors name the tensors and
  never point at an ``inplace`` switch the serving ops do not have.
- Accepted, and written exactly as with separate tensors: the layouts engines pass, disjoint
  column views of one buffer (SGLang's FlashInfer MLA backend slices ``ckv`` and ``kpe`` out of
  one ``[pages, page_size, 576]`` buffer; a decode ``out`` beside ``q_pe``), also when a plan
  replays the call, while the same metadata one column closer is refused.
"""

from __future__ import annotations

import pytest
import torch

import mlarope.kernels.serving  # noqa: F401  (imported before a test sets TRITON_INTERPRET=0)
from mlarope import serving
from mlarope._launch_cache import LAUNCH_CACHE, clear_launch_cache
from mlarope.serving import _plans, checks
from tests.serving_support import tables

L, R, T, H = 512, 64, 4, 3
POSITIONS = [1, 5, 0, 31]
SLOTS = [3, -1, 0, 6]


@pytest.fixture(params=["kernels", "reference"])
def backend(request, device, monkeypatch):
    """The Triton kernels (GPU, or the interpreter on CPU) and the PyTorch reference (CPU)."""
    if request.param == "reference":
        if device.type != "cpu":
            pytest.skip("the reference backend runs CPU tensors")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    clear_launch_cache()
    yield request.param
    clear_launch_cache()


def _inputs(device, latent=L, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kv_c = torch.randn(T, latent, generator=gen).to(torch.bfloat16).to(device)
    k_pe = torch.randn(T, R, generator=gen).to(torch.bfloat16).to(device)
    cos, sin = tables(R, 32, device)
    positions = torch.tensor(POSITIONS, device=device)
    slots = torch.tensor(SLOTS, device=device)
    return kv_c, k_pe, cos, sin, positions, slots


def _append_split(device, ckv, kpe, seed=0, **kw):
    kv_c, k_pe, cos, sin, positions, slots = _inputs(device, ckv.shape[2], seed)
    serving.rope_append_kv_cache(
        kv_c, k_pe, cos, sin, positions, (ckv, kpe), slots, cache_format="split", **kw
    )


def _split_buffer(device, latent=L):
    return torch.zeros(2, 4, latent + R, dtype=torch.bfloat16, device=device)


# ------------------------------------------------------------------ 1. misuse that is refused
def test_one_tensor_for_both_parts_of_a_split_cache_is_refused(backend, device):
    """``(c, c)`` with L == R passed every check, and the rotated ``k_pe`` overwrote the latent;
    two views of one storage were refused, so the rule was inconsistent too. Refused, naming
    both, with nothing written, also after a plan was recorded for that metadata."""
    for recorded in (False, True):
        if recorded:  # the same metadata, distinct tensors: a plan
            _append_split(device, *_split_buffer(device, R).split(R, dim=2))
            _append_split(device, *_split_buffer(device, R).split(R, dim=2))
            assert backend == "reference" or _plan_recorded()
        c = torch.zeros(2, 4, R, dtype=torch.bfloat16, device=device)
        with pytest.raises(ValueError, match=r"ckv \(cache\[0\]\) and kpe \(cache\[1\]\) are one"):
            _append_split(device, c, c)
        assert not c.any()


def test_written_tensors_whose_elements_share_memory_are_refused_without_inplace():
    """A broadcast cache or ``out``, an ``as_strided`` cache whose rows overlap, an inference
    cache: refused with the serving ops' own remedy; the messages said "pass inplace=False", an
    argument these ops do not have (the core's in-place message, which stays the core's)."""
    kv_c, k_pe, cos, sin, positions, slots = _inputs("cpu")
    broadcast = torch.zeros(1, 1, L + R, dtype=torch.bfloat16).expand(2, 4, L + R)
    rows = torch.zeros(4 * (L + R) * 2, dtype=torch.bfloat16).as_strided((2, 4, L + R), (L, 8, 1))
    with torch.inference_mode():
        inference = torch.zeros(2, 4, L + R, dtype=torch.bfloat16)
    cases = [
        (broadcast, "cache has elements that share memory (shape (2, 4, 576), strides (0, 0, 1)"),
        (rows, "cache has elements that share memory"),
        (inference, "cache is an inference tensor"),
        ((broadcast[..., :L], broadcast[..., L:]), "ckv (cache[0]) has elements that share"),
    ]
    for cache, message in cases:
        fmt = "split" if isinstance(cache, tuple) else "concat"
        with pytest.raises(ValueError) as error:
            serving.rope_append_kv_cache(
                kv_c, k_pe, cos, sin, positions, cache, slots, cache_format=fmt
            )
        assert message in str(error.value)
        assert "inplace" not in str(error.value), str(error.value)
    q_nope = torch.randn(T, H, 32, dtype=torch.bfloat16)
    q_pe = torch.randn(T, H, R, dtype=torch.bfloat16)
    buffer = torch.zeros(T, H, 32 + 2 * R, dtype=torch.bfloat16)
    outs = [
        (torch.zeros(1, H, 32 + R, dtype=torch.bfloat16).expand(T, H, 32 + R), q_pe, "out has"),
        (buffer[..., : 32 + R], buffer[..., 32 : 32 + R], "out and q_pe share memory"),
    ]
    for out, pe, message in outs:
        with pytest.raises(ValueError) as error:
            serving.rope_decode_query(q_nope, pe, cos, sin, positions, out=out)
        assert message in str(error.value)
        assert "inplace" not in str(error.value), str(error.value)
    # the core's in-place rule keeps its remedy, which its ops do have
    import mlarope

    q = torch.randn(1, 2, 16 + R).expand(4, 2, 16 + R)
    with pytest.raises(ValueError, match="pass inplace=False"):
        mlarope.apply_rope_q(q, cos, sin, layout="thd", position_ids=positions, inplace=True)


@pytest.mark.parametrize("compiler", ["eager", "aot_eager", "inductor"])
def test_torch_compile_refuses_shared_memory_on_every_backend(device, compiler):
    """A cache that holds ``kv_c``, one tensor for both parts of a split cache, a cache whose
    rows overlap, an ``out`` that holds ``q_pe``: refused when the graph runs, with nothing
    written, on every compiler backend. ``aot_eager`` accepted the first: its
    functionalization hands the writing op a clone of the cache (and copies it back after), so
    the op's own check saw two separate tensors; the check is now an op of its own in the
    graph, which writes nothing and sees the real tensors. Every backend accepted the second
    and third (tracing sees no addresses, and only a stride-0 dim among the strides)."""
    torch._dynamo.reset()
    kv_c0, k_pe, cos, sin, positions, slots = _inputs(device)
    cache = torch.zeros(2, 4, L + R, dtype=torch.bfloat16, device=device)
    kv_c = cache.view(-1)[: T * L].view(T, L)

    @torch.compile(backend=compiler, fullgraph=True)
    def append(kv_c, cache):
        serving.rope_append_kv_cache(
            kv_c, k_pe, cos, sin, positions, cache, slots, cache_format="concat"
        )

    with pytest.raises(ValueError, match="cache and kv_c share memory"):
        append(kv_c, cache)
    assert not cache.any()  # refused before anything was written

    @torch.compile(backend=compiler, fullgraph=True)
    def split(ckv, kpe):
        serving.rope_append_kv_cache(
            kv_c0[:, :R], k_pe, cos, sin, positions, (ckv, kpe), slots, cache_format="split"
        )

    c = torch.zeros(2, 4, R, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match=r"are one tensor"):
        split(c, c)
    assert not c.any()

    # rows that overlap (not a stride-0 dim, which tracing sees): refused when the graph runs
    memory = torch.zeros(4 * (L + R) * 2, dtype=torch.bfloat16, device=device)
    rows = memory.as_strided((2, 4, L + R), (L, 8, 1))
    with pytest.raises(ValueError, match="cache has elements that share memory"):
        append(kv_c0, rows)
    assert not memory.any()

    q_nope = torch.randn(T, H, 32, dtype=torch.bfloat16, device=device)
    out = torch.zeros(T, H, 32 + R, dtype=torch.bfloat16, device=device)

    @torch.compile(backend=compiler, fullgraph=True)
    def query(q_pe, out):
        serving.rope_decode_query(q_nope, q_pe, cos, sin, positions, out=out)

    with pytest.raises(ValueError, match="out and q_pe share memory"):
        query(out[..., 32:], out)


# ------------------------------------------------------- 2. layouts real engines pass: accepted
def test_split_cache_as_column_views_of_one_buffer(backend, device, monkeypatch):
    """SGLang's FlashInfer MLA layout: ``ckv = buf[..., :512]``, ``kpe = buf[..., 512:]`` of one
    ``[pages, page_size, 576]`` buffer was refused as "share memory" (byte spans); accepted now,
    written exactly as into separate tensors, and a repeated call takes its plan (no checks)
    and writes the same again. The same metadata with ``kpe`` one column onto ``ckv`` is
    refused with nothing written, also where a plan was recorded (it compares the offset it
    recorded, and takes the pipeline for another); ``kpe`` first, then ``ckv``: accepted."""
    want_ckv = torch.zeros(2, 4, L, dtype=torch.bfloat16, device=device)
    want_kpe = torch.zeros(2, 4, R, dtype=torch.bfloat16, device=device)
    _append_split(device, want_ckv, want_kpe, validate=True)
    for call in range(3):
        buf = _split_buffer(device)
        if call == 2 and backend == "kernels":  # the plan recorded by the first call
            monkeypatch.setattr(checks, "check_append_call", _no_checks)
        _append_split(device, buf[..., :L], buf[..., L:])
        monkeypatch.undo()
        assert torch.equal(buf[..., :L], want_ckv) and torch.equal(buf[..., L:], want_kpe)
    assert backend == "reference" or _plan_recorded()
    buf = _split_buffer(device)
    with pytest.raises(ValueError, match=r"ckv \(cache\[0\]\) and kpe \(cache\[1\]\) share"):
        _append_split(device, buf[..., :L], buf[..., L - 1 : L - 1 + R])
    assert not buf.any()
    buf = _split_buffer(device)
    _append_split(device, buf[..., R:], buf[..., :R])
    assert torch.equal(buf[..., R:], want_ckv) and torch.equal(buf[..., :R], want_kpe)


def _no_checks(*args, **kwargs):
    raise AssertionError("the checks ran: the call did not take its plan")


def _plan_recorded() -> bool:
    return any(p.__class__ is _plans.Plan for e in LAUNCH_CACHE.plans.values() for _, p in e)


def test_decode_out_beside_q_pe_in_one_buffer(backend, device, monkeypatch):
    """A decode ``out`` that lies beside ``q_pe`` in one buffer (``[T, H, L + R | R]``) was
    refused as "share memory"; accepted now, equal to a call with separate tensors, on a
    repeated call's plan too. ``q_pe`` one column into ``out``: refused."""
    gen = torch.Generator().manual_seed(2)
    cos, sin = tables(R, 32, device)
    positions = torch.tensor(POSITIONS, device=device)
    q_nope = torch.randn(T, H, 32, generator=gen).to(torch.bfloat16).to(device)
    pe = torch.randn(T, H, R, generator=gen).to(torch.bfloat16).to(device)
    want = serving.rope_decode_query(q_nope, pe, cos, sin, positions, validate=True)
    for call in range(3):
        buf = torch.zeros(T, H, 32 + 2 * R, dtype=torch.bfloat16, device=device)
        out, q_pe = buf[..., : 32 + R], buf[..., 32 + R :]
        q_pe.copy_(pe)
        if call == 2 and backend == "kernels":
            monkeypatch.setattr(checks, "check_query_call", _no_checks)
        assert serving.rope_decode_query(q_nope, q_pe, cos, sin, positions, out=out) is out
        monkeypatch.undo()
        assert torch.equal(out, want) and torch.equal(q_pe, pe)
    buf = torch.zeros(T, H, 32 + 2 * R, dtype=torch.bfloat16, device=device)
    out, q_pe = buf[..., : 32 + R], buf[..., 32 + R - 1 : -1]
    with pytest.raises(ValueError, match="out and q_pe share memory"):
        serving.rope_decode_query(q_nope, q_pe, cos, sin, positions, out=out)


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_torch_compile_accepts_column_views(device, compiler):
    """The engines' layouts inside a compiled graph: accepted, and written as eager writes."""
    torch._dynamo.reset()
    want = _split_buffer(device)
    _append_split(device, want[..., :L], want[..., L:])
    kv_c, k_pe, cos, sin, positions, slots = _inputs(device)

    @torch.compile(backend=compiler, fullgraph=True)
    def append(ckv, kpe):
        serving.rope_append_kv_cache(
            kv_c, k_pe, cos, sin, positions, (ckv, kpe), slots, cache_format="split"
        )

    buf = _split_buffer(device)
    append(buf[..., :L], buf[..., L:])
    assert torch.equal(buf, want)
