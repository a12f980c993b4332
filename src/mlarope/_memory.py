"""Where tensors lie in memory: byte spans, elements that share memory, and the in-place rule
that uses them (a leaf: no mlarope imports).

An in-place kernel rotates its target through a raw pointer while other programs read the
tables and positions: a target whose elements share memory would be rotated twice, and one
that overlaps what the call reads would feed programs values others already rotated (on a GPU,
a race). The public API checks this before anything runs (``_checks``), the in-place custom op
again at run time (compiled graphs reach it with real tensors only there), and a launch plan
from the addresses of a repeated call (``_plans``).
"""

from __future__ import annotations

import torch


def byte_span(x: torch.Tensor) -> int:
    """Bytes from ``x``'s first element to the end of its last (strides are never negative)."""
    if x.numel() == 0:
        return 0
    elements = sum((n - 1) * s for n, s in zip(x.shape, x.stride(), strict=True)) + 1
    return elements * x.element_size()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges of ``a`` and ``b`` intersect (no device data read; False for a
    tensor without elements or without storage)."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = _address(a), _address(b)
    if a0 is None or b0 is None:
        return False
    return a0 < b0 + byte_span(b) and b0 < a0 + byte_span(a)


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
    overlaps a tensor the call reads (``reads``: name, tensor or None)."""
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
    """Raise ``ValueError`` if a tensor the call writes overlaps one it reads (or another it
    writes, when ``read`` lists it): the serving ops' rule for caches and ``out``."""
    for w_name, w in written:
        for r_name, r in read:
            if w is not None and r is not None and w is not r and overlaps(w, r):
                raise ValueError(
                    f"{w_name} and {r_name} share memory; {w_name} is written while {r_name} is "
                    f"read: pass separate tensors"
                )


def _address(x: torch.Tensor) -> int | None:
    """``x.data_ptr()``, or None for a tensor without storage (``torch.func``'s wrappers:
    not checked)."""
    try:
        return x.data_ptr()
    except RuntimeError:
        return None
