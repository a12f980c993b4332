"""The error contract's test harness (docs/design.md): a valid call of ``apply_rope_q`` or
``apply_rope_kv`` on small CPU tensors, with any argument replaced, and the shapes it is built
from. ``tests/test_checks_messages.py``, ``tests/test_checks_inplace.py`` and
``tests/test_checks_grad_compile.py`` build on it.
"""

from __future__ import annotations

import torch

import mlarope

S, B, H = 4, 2, 2  # sequence, batch, heads
N, R = 8, 32  # q: nope and rope channels
K, V = 4, 6  # kv: key-nope and value channels
P = 16  # table rows
T = 8  # thd tokens


def width(op: str) -> int:
    return N + R if op == "q" else K + V


def act(op: str, tokens: tuple[int, ...], **kw) -> torch.Tensor:
    """The activation of ``op``: ``q: [tokens..., H, N + R]`` or ``kv: [tokens..., H, K + V]``."""
    return torch.randn(*tokens, H, width(op), **kw)


def call(op: str, *, tokens=(S, B), layout="sbhd", x=None, k_pe=None, cos=None, sin=None, **kw):
    """A valid call of ``op`` with ``tokens`` token dims, with the given arguments replaced."""
    x = act(op, tokens) if x is None else x
    cos = torch.randn(P, R) if cos is None else cos
    sin = torch.randn(P, R) if sin is None else sin
    if op == "q":
        return mlarope.apply_rope_q(x, cos, sin, layout=layout, **kw)
    k_pe = torch.randn(*tokens, 1, R) if k_pe is None else k_pe
    kw.setdefault("k_dim", K)
    return mlarope.apply_rope_kv(x, k_pe, cos, sin, layout=layout, **kw)


def inference_tensor(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` made under ``torch.inference_mode()`` (an inference tensor)."""
    with torch.inference_mode():
        return t.clone()


def thd(**kw) -> dict:
    return {"tokens": (T,), "layout": "thd", **kw}


def strided_last(shape: tuple[int, ...]) -> torch.Tensor:
    """A view of ``shape`` whose last dim has stride 2."""
    return torch.randn(*shape[:-1], 2 * shape[-1])[..., ::2]
