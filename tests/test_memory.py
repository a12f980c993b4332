"""``mlarope._memory``: the one memory rule, about elements, not byte spans.

``overlaps(a, b)`` must be True exactly when an element of ``a`` and an element of ``b`` have
a byte in common, for every stride pattern: checked against a brute-force enumeration of
every element's bytes, on views of one buffer (slices, transposes, expands, ``as_strided``
with overlaps, dtype views) and on raw layouts (any addresses, element sizes and strides, of
either sign). The core's in-place rule uses it too: a ``q`` that truly overlaps a table is
still refused, one that only shares its storage is rotated (and rotated right).
"""

from __future__ import annotations

import itertools
import random
import time

import pytest
import torch

import mlarope
from mlarope import _memory
from mlarope._memory import overlaps, share_an_element


def _element_bytes(base: int, size: int, dims) -> set[int]:
    """Every byte of every element of a layout, by enumeration."""
    offsets = [0]
    for n, s in dims:
        offsets = [o + i * s for o in offsets for i in range(n)]
    return {base + size * o + k for o in offsets for k in range(size)}


def _brute(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0:
        return False

    def dims(t):
        return tuple(zip(t.shape, t.stride(), strict=True))

    bytes_a = _element_bytes(a.data_ptr(), a.element_size(), dims(a))
    return not bytes_a.isdisjoint(_element_bytes(b.data_ptr(), b.element_size(), dims(b)))


_DTYPES = (torch.uint8, torch.bfloat16, torch.float32, torch.float64)


def _random_view(buffer: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """A random view of ``buffer`` (uint8, 8-byte aligned length): a typed view, then as_strided
    with any strides (zero and overlapping ones included), or a slice / transpose / expand /
    narrow of a reshaped block."""
    dtype = rng.choice(_DTYPES)
    typed = buffer.view(dtype)
    total = typed.numel()
    if rng.random() < 0.5:
        ndim = rng.randint(1, 3)
        sizes = [rng.randint(1, 6) for _ in range(ndim)]
        strides = [rng.choice([0, 1, 2, 3, 5, 7, 8, 13, 16, 24, 40]) for _ in range(ndim)]
        extent = sum((n - 1) * s for n, s in zip(sizes, strides, strict=True)) + 1
        if extent > total:
            return typed[: rng.randint(1, 8)]
        return typed.as_strided(sizes, strides, rng.randint(0, total - extent))
    rows = rng.choice([2, 4, 8])
    block = typed[: (total // rows) * rows].view(rows, -1)
    width = block.shape[1]
    lo = rng.randint(0, width - 1)
    hi = rng.randint(lo + 1, width)
    step = rng.choice([1, 1, 2, 3])
    view = block[rng.randint(0, rows - 1) :: rng.choice([1, 2]), lo:hi:step]
    kind = rng.random()
    if kind < 0.25:
        view = view.t()
    elif kind < 0.4 and view.shape[0] == 1:
        view = view.expand(3, view.shape[1])
    elif kind < 0.55 and view.shape[1] % 2 == 0 and view.stride(1) == 1:
        view = view.unflatten(1, (2, -1)).transpose(1, 2)
    return view


def test_overlaps_matches_brute_force_on_views_of_one_buffer():
    """3,000 random pairs of views of one 512-byte buffer, of four dtypes: the rule's answer is
    the enumeration's, and both answers occur often (the test can fail either way)."""
    rng = random.Random(0)
    buffer = torch.zeros(512, dtype=torch.uint8)
    answers = {True: 0, False: 0}
    byte_spans_meet = 0
    for _ in range(3000):
        a, b = _random_view(buffer, rng), _random_view(buffer, rng)
        want = _brute(a, b)
        assert overlaps(a, b) is want, (a.shape, a.stride(), a.dtype, b.shape, b.stride(), b.dtype)
        assert overlaps(b, a) is want
        answers[want] += 1
        span_a = (a.data_ptr(), a.data_ptr() + _memory.byte_span(a))
        span_b = (b.data_ptr(), b.data_ptr() + _memory.byte_span(b))
        if not want and span_a[0] < span_b[1] and span_b[0] < span_a[1]:
            byte_spans_meet += 1  # disjoint elements within intersecting spans
    assert min(answers.values()) > 500, answers
    assert byte_spans_meet > 200, byte_spans_meet


def _random_layout(rng: random.Random, big: bool, unit: int):
    """``(base, element size, dims)``; ``big``: strides near multiples of ``unit`` (up to 5e6
    bytes apart), so that large layouts still meet often."""
    dims = []
    for _ in range(rng.randint(0, 3 if not big else 2)):
        if big:
            n, s = rng.randint(1, 40), unit * rng.randint(1, 50) + rng.choice([0, 0, 0, 1, 3])
        else:
            n, s = rng.randint(1, 12), rng.choice([0, 1, 2, 3, 4, 6, 9, 64, 65, 576])
        dims.append((n, s * rng.choice([1, 1, -1])))
    base = rng.randint(0, 4000) if not big else unit * rng.randint(0, 60) + rng.randint(0, 3)
    return base, rng.choice([1, 2, 4, 8]), tuple(dims)


@pytest.mark.parametrize("big", [False, True])
def test_share_an_element_matches_brute_force_on_raw_layouts(big):
    """Raw layouts: any base address (misaligned too), element sizes 1-8 bytes, strides of
    either sign (the rule normalizes them), zero strides; ``big``: strides up to 5e6 bytes,
    where the two-term closed form and the search decide (no small reach to enumerate)."""
    rng = random.Random(1 + big)
    answers = {True: 0, False: 0}
    for _ in range(1500):
        unit = rng.randint(100, 10**5)
        a0, ea, da = _random_layout(rng, big, unit)
        b0, eb, db = _random_layout(rng, big, unit)
        want = not _element_bytes(a0, ea, da).isdisjoint(_element_bytes(b0, eb, db))
        got = share_an_element(a0, ea, da, b0, eb, db)
        assert got is want, (a0, ea, da, b0, eb, db)
        answers[want] += 1
    assert min(answers.values()) > 100, answers


def test_reachable_matches_brute_force():
    """The subset-sum core: ``sum c_t z_t`` in ``[lo, hi]``, against every ``z``."""
    rng = random.Random(3)
    for _ in range(3000):
        terms = [(rng.randint(1, 60), rng.randint(1, 5)) for _ in range(rng.randint(1, 4))]
        sums = {
            sum(c * z for (c, _), z in zip(terms, zs, strict=True))
            for zs in itertools.product(*(range(n + 1) for _, n in terms))
        }
        lo = rng.randint(-20, max(sums) + 20)
        hi = lo + rng.choice([0, 0, 1, 3, 7, 30])
        want = any(lo <= v <= hi for v in sums)
        assert _memory._reachable(terms, lo, hi) is want, (terms, lo, hi)


def test_floor_sum():
    rng = random.Random(4)
    for _ in range(2000):
        n, m = rng.randint(0, 40), rng.randint(1, 50)
        a, b = rng.randint(0, 200), rng.randint(-300, 300)
        assert _memory._floor_sum(n, m, a, b) == sum((a * i + b) // m for i in range(n))


def test_the_engines_layouts_are_apart_and_cheap():
    """SGLang's split cache (ckv and kpe column views of one [pages, page_size, 576] buffer)
    and a decode out beside q_pe: no element in common, decided by arithmetic at any size
    (100,000 pages here, described by their layout: 3.7e9 elements), a column apart or
    overlapping by one element is caught, and each answer takes well under a millisecond."""
    pages, page, width, lat = 100_000, 64, 576, 512
    outer = ((pages, page * width), (page, width))
    ckv = (*outer, (lat, 1))
    kpe = (*outer, (width - lat, 1))
    bf16 = 2
    start = time.perf_counter()
    assert not share_an_element(0, bf16, ckv, lat * bf16, bf16, kpe)
    assert share_an_element(0, bf16, ckv, (lat - 1) * bf16, bf16, kpe)  # one column into ckv
    assert share_an_element(0, bf16, ckv, lat * bf16 - 1, 1, kpe)  # a byte of ckv's last column
    assert not share_an_element(0, bf16, ckv, lat * bf16, 4, ((pages, page * width // 2),))
    # q_pe [T, H, 64] and out [T, H, 576] in one [T, H, 640] buffer
    tokens, heads = 50_000, 128
    q_pe = ((tokens, heads * 640), (heads, 640), (64, 1))
    out = ((tokens, heads * 640), (heads, 640), (576, 1))
    assert not share_an_element(576 * bf16, bf16, q_pe, 0, bf16, out)
    assert share_an_element(575 * bf16, bf16, q_pe, 0, bf16, out)
    elapsed = (time.perf_counter() - start) / 6
    assert elapsed < 1e-3, f"{elapsed * 1e6:.0f} µs a decision"


def test_overlaps_of_tensors():
    buffer = torch.zeros(4, 8, 576, dtype=torch.bfloat16)
    ckv, kpe = buffer[..., :512], buffer[..., 512:]
    assert not overlaps(ckv, kpe) and not overlaps(kpe, ckv)
    assert overlaps(buffer[..., :513], kpe)
    assert overlaps(buffer, buffer) and overlaps(ckv, ckv)
    # a byte of one element is enough: an fp32 element and the bf16 element on its upper half
    raw = torch.zeros(16, dtype=torch.uint8)
    assert overlaps(raw.view(torch.float32)[:1], raw[2:4].view(torch.bfloat16))
    assert not overlaps(raw.view(torch.float32)[:1], raw[4:6].view(torch.bfloat16))
    assert overlaps(raw[3:4], raw.view(torch.float32)[:1])
    assert not overlaps(buffer[:, :, :0], buffer)  # no elements: nothing in common


@pytest.mark.parametrize("backend", ["kernels", "reference"])
def test_core_inplace_q_beside_its_table_in_one_buffer(backend, device, monkeypatch):
    """The core's in-place rule: a ``q`` that shares a buffer with ``cos`` but no element
    (rows ``[q | cos]``) is rotated, exactly as with separate tensors, also on a repeated call
    (a plan compares byte spans and takes the pipeline); one element in common is refused."""
    if backend == "reference":
        if torch.device(device).type != "cpu":
            pytest.skip("the reference backend runs CPU tensors")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    n_tok, r = 8, 32
    cos, sin = mlarope.YarnConfig(dim=r).cos_sin(n_tok, device=device)
    q0 = torch.randn(n_tok, 1, 16 + r, device=device)
    want = mlarope.apply_rope_q(q0.clone(), cos, sin, layout="thd", inplace=True)
    for _ in range(2):
        memory = torch.empty(n_tok, 16 + r + r, device=device)
        q, table = memory[:, : 16 + r].unsqueeze(1), memory[:, 16 + r :]
        q.copy_(q0)
        table.copy_(cos)
        mlarope.apply_rope_q(q, table, sin, layout="thd", inplace=True)
        assert torch.equal(q, want)
        assert torch.equal(table, cos)
    memory = torch.empty(n_tok, 16 + r + r, device=device)
    q, table = memory[:, : 16 + r + 1].unsqueeze(1)[..., 1:], memory[:, 16 + r :]
    table.copy_(cos)
    with pytest.raises(ValueError, match="q shares memory with cos"):
        mlarope.apply_rope_q(q, table, sin, layout="thd", inplace=True)
