"""What the query and key/value harnesses share (``tests/q_harness.py``, ``tests/kv_harness.py``):
general random tables and a bit-for-bit comparison."""

from __future__ import annotations

import torch


def random_tables(
    rows: int, rope: int, dtype: torch.dtype, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """General tables ``cos, sin: [rows, rope]`` in ``dtype``: random angles, and the two halves
    of a row differ (the formulas use both, so a kernel that mixes them up fails); ``|c|, |s|``
    up to 1.5, like a YaRN attention factor."""
    theta = torch.rand(rows, rope, dtype=torch.float64) * 6.3
    scale = 1.0 + 0.5 * torch.rand(rows, 1, dtype=torch.float64)
    cos = (theta.cos() * scale).to(dtype).to(device)
    sin = (theta.sin() * scale).to(dtype).to(device)
    return cos, sin


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (NaN == NaN with the same payload, -0.0 != 0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))
