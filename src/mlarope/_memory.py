"""Where tensors lie in memory: byte spans, elements that share memory, 16-byte alignment
(which Triton specializes on, so a launch plan's key holds it), and the rules that use them (a
leaf: no mlarope imports).

An in-place kernel rotates its target through a raw pointer while other programs read the
tables and positions: a target whose elements share memory would be rotated twice, and one
that overlaps what the call reads would feed programs values others already rotated (on a GPU,
a race). The serving ops write a cache or ``out`` while reading their inputs, under the same
rule. The public API checks this before anything runs (``_checks``, ``serving.checks``), the
custom ops again at run time (compiled graphs reach them with real tensors only there), and a
launch plan from the addresses of a repeated call (``_plans``, ``serving._plans``).

The rule between two tensors is about elements, not byte spans: :func:`overlaps` is True
exactly when an element of one and an element of the other have a byte in common, so the
disjoint column views of one buffer (FlashInfer's ``ckv`` and ``kpe`` pages as SGLang passes
them, a decode ``out`` beside ``q_pe``) do not conflict.
"""

from __future__ import annotations

from math import gcd

import torch


def byte_span(x: torch.Tensor) -> int:
    """Bytes from ``x``'s first element to the end of its last (strides are never negative)."""
    if x.numel() == 0:
        return 0
    elements = sum((n - 1) * s for n, s in zip(x.shape, x.stride(), strict=True)) + 1
    return elements * x.element_size()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether an element of ``a`` and an element of ``b`` have a byte in common (each element
    covers ``element_size()`` bytes from its address, so tensors of different dtypes compare
    exactly too). No device data is read; False for a tensor without elements or without
    storage, and for tensors on different devices.

    Exact for every stride pattern: never True for disjoint elements, never False for a shared
    one. Byte spans that do not intersect decide at once (the common case); otherwise
    :func:`share_an_element` decides by arithmetic on the strides (see there for the proof).
    """
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = _address(a), _address(b)
    if a0 is None or b0 is None:
        return False
    if not (a0 < b0 + byte_span(b) and b0 < a0 + byte_span(a)):
        return False
    if a.device != b.device:
        return False
    return share_an_element(
        a0, a.element_size(), tuple(zip(a.shape, a.stride(), strict=True)),
        b0, b.element_size(), tuple(zip(b.shape, b.stride(), strict=True)),
    )  # fmt: skip


def share_an_element(
    a0: int,
    a_bytes: int,
    a_dims: tuple[tuple[int, int], ...],
    b0: int,
    b_bytes: int,
    b_dims: tuple[tuple[int, int], ...],
) -> bool:
    """Whether two strided layouts have an element in common, exactly.

    Layout A has elements at the byte addresses ``a0 + a_bytes * sum_k s_k i_k`` for
    ``0 <= i_k < n_k`` (``a_dims``: ``(n_k, s_k)`` pairs, strides in elements, of any sign),
    each covering ``a_bytes`` bytes; B likewise. Two elements at ``p`` (of A) and ``q`` (of B)
    share a byte iff ``1 - a_bytes <= p - q <= b_bytes - 1``.

    The reduction. A dim of size 1 or stride 0 adds nothing; a negative stride is a positive
    one from the dim's last element. Writing B's indices from its last element (``j = n - 1 -
    i``) turns ``p - q`` into ``C + sum_t c_t z_t`` with every coefficient ``c_t > 0`` (A's
    ``a_bytes * s_k`` and B's ``b_bytes * s_k``), ``0 <= z_t <= N_t`` and ``C`` = A's first
    address minus B's last. So the question is whether ``S = {sum c_t z_t}`` meets the
    interval ``[lo, hi] = [1 - a_bytes - C, b_bytes - 1 - C]``: a bounded subset-sum problem
    (NP-complete in general: sizes of 2 and arbitrary strides encode subset sum, so no exact
    method is fast on every input). :func:`_reachable` decides it exactly and is fast on the
    layouts tensors have:

    1. Terms of one coefficient merge (``c x + c y``, ``x <= N``, ``y <= M``, is ``c * [0, N +
       M]``), and ``(c, N)`` absorbs ``(k c, M)`` when ``k <= N + 1`` (``{x + k y}`` is then
       every integer of ``[0, N + k M]``): both keep ``S`` the same set. A contiguous tensor,
       or the rows of a slice, collapse to one term this way.
    2. ``S`` lies in ``[0, sum c_t N_t]`` and in the multiples of ``g = gcd(c_t)``: an
       interval that holds no multiple of ``g`` in that range is not met. One term left: met
       iff it is not refused by this test (its multiples are all in ``S``).
    3. Two terms left, ``c1 > c2``: ``x`` must lie in ``[max(0, ceil((lo - c2 N2) / c1)),
       min(N1, floor(hi / c1))]``, and for such ``x`` the shifted interval ``[lo - c1 x, hi -
       c1 x]`` meets ``[0, c2 N2]``; it then holds a multiple ``c2 y`` of ``c2`` with ``0 <= y
       <= N2`` iff it holds any multiple of ``c2`` (a multiple below 0 puts 0 in it, one above
       ``c2 N2`` puts ``c2 N2`` in it), that is iff ``(c1 x - lo) mod c2 <= hi - lo``. The
       ``x`` that do are counted in closed form, ``sum_x floor((c1 x - lo) / c2) -
       floor((c1 x - lo - (hi - lo) - 1) / c2)`` (each summand is 1 exactly when the residue
       is at most ``hi - lo < c2``), by the Euclid-like floor sum (:func:`_floor_sum`,
       O(log) steps). Column slices of one buffer (ckv and kpe, out beside q_pe) end here.
    4. More terms: the largest coefficient's ``z`` ranges over the values that leave the
       rest's interval within the rest's reach (at most ``(hi - lo + reach_rest) / c + 1`` of
       them: one or two for nested layouts), each decided recursively by 2-4 (memoized on
       the interval). Every value of ``z`` that could reach ``[lo, hi]`` is tried, so the
       search is complete; each answer is a witness, so it is sound.
    """
    terms = []
    for base_bytes, dims, sign in ((a_bytes, a_dims, 1), (b_bytes, b_dims, -1)):
        for n, s in dims:
            if n > 1 and s != 0:
                terms.append((n, s, base_bytes, sign))
    first_a, last_b = a0, b0
    coefficients: list[tuple[int, int]] = []
    for n, s, size, sign in terms:
        step = s * size
        if sign > 0:  # A: from its first element up
            if step < 0:
                first_a += (n - 1) * step
            coefficients.append((abs(step), n - 1))
        else:  # B: from its last element down
            if step > 0:
                last_b += (n - 1) * step
            coefficients.append((abs(step), n - 1))
    c = first_a - last_b
    return _reachable(coefficients, 1 - a_bytes - c, b_bytes - 1 - c)


def _reachable(terms: list[tuple[int, int]], lo: int, hi: int) -> bool:
    """Whether ``sum c_t z_t`` (``0 <= z_t <= N_t``, ``terms``: ``(c_t, N_t)``, ``c_t, N_t >=
    1``) takes a value in ``[lo, hi]``: steps 1-4 of :func:`share_an_element`."""
    if lo > hi:
        return False
    merged: dict[int, int] = {}
    for c, n in terms:
        merged[c] = merged.get(c, 0) + n
    ordered = sorted(merged.items())
    i = 0
    while i < len(ordered):  # (c, N) absorbs (k c, M) for k <= N + 1; then look again
        c, n = ordered[i]
        for j in range(i + 1, len(ordered)):
            cj, nj = ordered[j]
            if cj % c == 0 and cj // c <= n + 1:
                ordered[i] = (c, n + cj // c * nj)
                del ordered[j]
                break
        else:
            i += 1
    ordered.reverse()  # largest coefficient first
    count = len(ordered)
    if count <= 2:  # the common cases, without the search's tables
        top = sum(c * n for c, n in ordered)
        lo, hi = max(lo, 0), min(hi, top)
        if lo > hi:
            return False
        if count == 0:
            return True
        g = gcd(*(c for c, _ in ordered))
        if -(-lo // g) > hi // g:
            return False
        return count == 1 or _two_terms(ordered[0], ordered[1], lo, hi)
    reach = [0] * (count + 1)
    gcds = [0] * (count + 1)
    for k in range(count - 1, -1, -1):
        c, n = ordered[k]
        reach[k] = reach[k + 1] + c * n
        gcds[k] = gcd(gcds[k + 1], c)
    memo: dict[tuple[int, int, int], bool] = {}

    def met(k: int, lo: int, hi: int) -> bool:
        lo, hi = max(lo, 0), min(hi, reach[k])
        if lo > hi:
            return False
        if k == count:
            return True  # the empty sum 0, inside [lo, hi]
        g = gcds[k]
        if -(-lo // g) > hi // g:
            return False
        if k == count - 1:
            return True
        if k == count - 2:
            return _two_terms(ordered[k], ordered[k + 1], lo, hi)
        key = (k, lo, hi)
        if key in memo:
            return memo[key]
        c, n = ordered[k]
        first = max(0, -(-(lo - reach[k + 1]) // c))
        found = any(met(k + 1, lo - c * z, hi - c * z) for z in range(first, min(n, hi // c) + 1))
        memo[key] = found
        return found

    return met(0, lo, hi)


def _two_terms(big: tuple[int, int], small: tuple[int, int], lo: int, hi: int) -> bool:
    """Whether ``c1 x + c2 y`` in ``[lo, hi]`` for ``0 <= x <= N1``, ``0 <= y <= N2``
    (``big = (c1, N1)``, ``small = (c2, N2)``, ``c1 > c2``; step 3 of
    :func:`share_an_element`)."""
    (c1, n1), (c2, n2) = big, small
    x_lo = max(0, -(-(lo - c2 * n2) // c1))
    x_hi = min(n1, hi // c1)
    if x_lo > x_hi:
        return False
    width = hi - lo
    if width >= c2 - 1:
        return True  # every interval of c2 integers holds a multiple of c2
    b = c1 * x_lo - lo
    n = x_hi - x_lo + 1
    return _floor_sum(n, c2, c1, b) - _floor_sum(n, c2, c1, b - width - 1) > 0


def _floor_sum(n: int, m: int, a: int, b: int) -> int:
    """``sum_{i=0}^{n-1} floor((a i + b) / m)`` for ``n >= 0``, ``m >= 1`` (the AtCoder
    Library's ``floor_sum``: Euclid's algorithm on ``(a, m)``, O(log m) steps)."""
    total = 0
    q, a = divmod(a, m)
    total += q * (n * (n - 1) // 2)
    q, b = divmod(b, m)
    total += q * n
    while True:
        if a >= m:
            q, a = divmod(a, m)
            total += q * (n * (n - 1) // 2)
        if b >= m:
            q, b = divmod(b, m)
            total += q * n
        y_max = a * n + b
        if y_max < m:
            return total
        n, b = divmod(y_max, m)
        m, a = a, m


def elements_overlap(x: torch.Tensor) -> bool:
    """Whether two of ``x``'s elements may share memory: its dims of size > 1, by stride, must
    each step over everything the smaller ones span (a stride-0 dim never does). A few exotic
    non-overlapping layouts (dims whose elements interleave) count as overlapping too."""
    extent = 1
    for stride, size in sorted((s, n) for n, s in zip(x.shape, x.stride(), strict=True) if n > 1):
        if stride < extent:
            return True
        extent += (size - 1) * stride
    return False


def refuse_overlap(
    name: str, x: torch.Tensor, reads: tuple[tuple[str, torch.Tensor | None], ...]
) -> None:
    """Raise ``ValueError`` if the in-place target ``x`` has elements that share memory or
    overlaps a tensor the call reads (``reads``: name, tensor or None): the core ops' rule, whose
    remedy is ``inplace=False``."""
    if elements_overlap(x):
        raise ValueError(
            f"{name} has elements that share memory (shape {tuple(x.shape)}, strides "
            f"{tuple(x.stride())}: a broadcast dim or overlapping rows), so it cannot be "
            f"rotated in place; pass inplace=False or {name}.contiguous()"
        )
    for other_name, other in reads:
        if other is not None and overlaps(x, other):
            raise ValueError(
                f"{name} shares memory with {other_name}, which the call reads, so it cannot "
                f"be rotated in place; pass inplace=False or {other_name}.clone()"
            )


def refuse_shared(
    written: tuple[tuple[str, torch.Tensor | None], ...],
    read: tuple[tuple[str, torch.Tensor | None], ...],
) -> None:
    """Raise ``ValueError`` if a tensor the call writes has an element in common with one it
    reads, or with another it writes (one tensor passed for two written arguments included):
    the serving ops' rule for caches and ``out`` (:func:`refuse_written_overlap` is the rule
    within one written tensor)."""
    for i, (w_name, w) in enumerate(written):
        if w is None:
            continue
        for other_name, other in written[i + 1 :]:
            if other is not None and overlaps(w, other):
                what = "are one tensor" if other is w else "share memory"
                raise ValueError(
                    f"{w_name} and {other_name} {what}; both are written, so one would "
                    f"overwrite the other: pass separate tensors (disjoint views of one buffer "
                    f"are fine)"
                )
        for r_name, r in read:
            if r is not None and overlaps(w, r):
                raise ValueError(
                    f"{w_name} and {r_name} share memory; {w_name} is written while {r_name} is "
                    f"read: pass separate tensors"
                )


def refuse_written_overlap(name: str, x: torch.Tensor, *, broadcast: bool = False) -> None:
    """Raise ``ValueError`` if ``x``, which a serving op writes, has elements that share memory
    (a broadcast or overlapping ``as_strided`` view: two entries would land on one address);
    ``broadcast=True``: the caller found a stride-0 dim (while tracing, where the strides may
    be symbolic and are not compared here)."""
    if broadcast or elements_overlap(x):
        raise ValueError(
            f"{name} has elements that share memory (shape {tuple(x.shape)}, strides "
            f"{tuple(x.stride())}: a broadcast dim or overlapping rows), so entries written to "
            f"it would overwrite each other; pass a tensor of its own memory (torch.empty or "
            f"torch.zeros of that shape)"
        )


def _address(x: torch.Tensor) -> int | None:
    """``x.data_ptr()``, or None for a tensor without storage (``torch.func``'s wrappers:
    not checked)."""
    try:
        return x.data_ptr()
    except RuntimeError:
        return None


def alignment(tensors: tuple) -> int | None:
    """Every tensor's address modulo 16, 4 bits each (Triton specializes on 16-byte alignment),
    or None if one is not a plain ``torch.Tensor`` with storage (a subclass, ``None`` where
    a tensor belongs, vmap's batched tensors, sparse tensors): those calls take the pipeline.
    The caller puts ``len(tensors)`` in the key beside it (with or without ``position_ids``)."""
    bits = 0
    try:
        for t in tensors:
            if t.__class__ is not torch.Tensor:
                return None
            bits = bits << 4 | (t.data_ptr() & 15)
    except RuntimeError:
        return None
    return bits


def lies_apart(inputs: tuple, apart: tuple) -> bool:
    """Whether an in-place launch plan may take ``inputs``: ``apart`` is ``()`` (nothing to
    check) or ``(target span, ((index, span), ...))``, the byte spans of the target
    ``inputs[0]`` and of each input it reads; their addresses must not overlap (the guard
    matched their metadata, not where they lie)."""
    if not apart:
        return True
    span, reads = apart
    start = inputs[0].data_ptr()
    for index, r_span in reads:
        r_start = inputs[index].data_ptr()
        if start < r_start + r_span and r_start < start + span:
            return False
    return True
