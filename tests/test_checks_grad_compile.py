"""The error contract under autograd and ``torch.compile`` (docs/design.md): the checks of a
call traced by ``torch.compile(fullgraph=True)`` raise the eager errors, a table that requires
grad is refused only when a gradient is asked for, and a key/value call without heads gives
``k_pe`` a zero gradient on every backend.
"""

from __future__ import annotations

import pytest
import torch

import mlarope
from tests.checks_harness import B, H, N, P, R, S, call, width


def test_compiled_position_ids_of_a_dynamic_token_dim():
    """Under torch.compile, once the token count is dynamic, position_ids of that count still
    broadcast to it (a static 1 and a SymInt: ``s in (1, t)`` was False there and raised)."""
    R = 32
    cos, sin = torch.randn(64, R), torch.randn(64, R)

    @torch.compile(backend="eager", fullgraph=True)
    def rope(q, ids=None):
        return mlarope.apply_rope_q(q, cos, sin, layout="thd", position_ids=ids)

    rope(torch.randn(8, 1, R))
    rope(torch.randn(12, 1, R))  # the token dim becomes dynamic
    q, ids = torch.randn(8, 1, R), torch.arange(8)
    assert torch.equal(
        rope(q, ids), mlarope.apply_rope_q(q, cos, sin, layout="thd", position_ids=ids)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["kernels", "reference"])
def test_kv_backward_with_zero_heads(dtype, device):
    """With no heads ``k_pe`` reaches no output: its gradient is zero in every row, an
    out-of-range position included, on every backend. (Before: NaN on the reference.)"""
    device = device if dtype == torch.float32 else torch.device("cpu")
    cos, sin = torch.randn(64, 32, device=device), torch.randn(64, 32, device=device)
    kv = torch.randn(4, 2, 0, 16, dtype=dtype, device=device, requires_grad=True)
    k_pe = torch.randn(4, 2, 1, 32, dtype=dtype, device=device, requires_grad=True)
    k, v = mlarope.apply_rope_kv(kv, k_pe, cos, sin, k_dim=8)
    (k.sum() + v.sum()).backward()
    assert torch.equal(k_pe.grad, torch.zeros_like(k_pe))
    ids = torch.tensor([[0, 1], [64, 2], [3, -1], [5, 6]], device=device)  # two out of range
    k_pe.grad = None
    k, v = mlarope.apply_rope_kv(kv, k_pe, cos, sin, k_dim=8, position_ids=ids)
    (k.sum() + v.sum()).backward()
    assert torch.equal(k_pe.grad, torch.zeros_like(k_pe))


@pytest.mark.parametrize("table", ["cos", "sin"])
@pytest.mark.parametrize("op", ["q", "kv"])
def test_tables_that_require_grad_work_without_grad_mode(op, table):
    """Under ``torch.no_grad()`` no gradient is asked for, so a table that requires grad is
    fine: the same result as its detached value. The reference module's own API follows the
    contract too."""
    tables = {"cos": torch.randn(P, R), "sin": torch.randn(P, R)}
    want = call(op, x=torch.ones(S, B, H, width(op)), k_pe=torch.ones(S, B, 1, R), **tables)
    tables[table].requires_grad_(True)
    with torch.no_grad():
        got = call(op, x=torch.ones(S, B, H, width(op)), k_pe=torch.ones(S, B, 1, R), **tables)
    for a, b in zip(got if op == "kv" else (got,), want if op == "kv" else (want,), strict=True):
        assert torch.equal(a, b)
    from mlarope import reference

    with pytest.raises(ValueError, match=f"{table} requires grad"):
        reference.apply_rope_q(torch.randn(S, B, H, N + R), tables["cos"], tables["sin"])


@pytest.mark.parametrize("backend", ["kernels", "reference"])
@pytest.mark.parametrize("source", ["position_ids", "cu_seqlens"])
def test_validation_in_a_fullgraph_compile(source, backend, device, monkeypatch):
    """``validate=True`` (or ``MLAROPE_VALIDATE=1``) inside ``torch.compile(fullgraph=True)``:
    the device-data checks are an op of the graph, which raises the eager error when the graph
    runs (a traced branch on device data failed the trace, found by review)."""
    if backend == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch._dynamo.reset()
    cos, sin = mlarope.YarnConfig(dim=64).cos_sin(16, device=device)
    q = torch.randn(6, 2, 70, device=device)
    good = {
        "position_ids": torch.arange(6, device=device),
        "cu_seqlens": torch.tensor([0, 2, 6], dtype=torch.int32, device=device),
    }[source]
    bad = {
        "position_ids": torch.tensor([0, 1, 2, 99, 4, 5], device=device),
        "cu_seqlens": torch.tensor([0, 4, 2], dtype=torch.int32, device=device),
    }[source]

    def rotate(q, index):
        return mlarope.apply_rope_q(q, cos, sin, layout="thd", validate=True, **{source: index})

    compiled = torch.compile(rotate, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(q, good), rotate(q, good))
    with pytest.raises(ValueError) as eager:
        rotate(q, bad)
    with pytest.raises(ValueError) as in_graph:
        compiled(q, bad)
    assert str(in_graph.value) == str(eager.value)
