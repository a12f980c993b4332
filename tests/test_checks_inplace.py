"""The error contract, in place (docs/design.md): an in-place rotation that would write
memory it also reads, memory that is not its own to write (an inference tensor outside
inference mode, a leaf that requires grad), or elements that share memory raises before
anything is written, on every backend; and an in-place call is one write on every backend.
"""

from __future__ import annotations

import pytest
import torch

import mlarope
from tests.checks_harness import B, H, N, P, R, S, inference_tensor


def test_inplace_on_a_broadcast_q_is_rejected():
    """Elements that share memory cannot be rotated in place (two programs would both rotate
    them): a ValueError naming q, never a silently wrong result."""
    cos, sin = torch.randn(64, 32), torch.randn(64, 32)
    q = torch.randn(1, 8, 2, 16 + 32).expand(4, 8, 2, 48)
    with pytest.raises(ValueError, match=r"q has elements that share memory.*\(4, 8, 2, 48\)"):
        mlarope.apply_rope_q(q, cos, sin, layout="bshd", inplace=True)
    out = mlarope.apply_rope_q(q, cos, sin, layout="bshd")  # out of place is fine
    assert out.shape == q.shape


@pytest.mark.parametrize("backend", ["kernels", "reference"])
def test_inplace_on_overlapping_rows_is_rejected(backend, device, monkeypatch):
    """Rows that overlap without a stride-0 dim (an ``as_strided`` view): a ValueError naming
    q on every backend (both accepted it and wrote different values, up to 4.1 apart)."""
    if backend == "reference":
        if torch.device(device).type != "cpu":
            pytest.skip("the reference backend runs CPU tensors")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    cos, sin = torch.randn(16, 32, device=device), torch.randn(16, 32, device=device)
    memory = torch.randn(400, device=device)
    q = memory.as_strided((6, 1, 32), (16, 32, 1))
    with pytest.raises(ValueError, match=r"q has elements that share memory.*overlapping rows"):
        mlarope.apply_rope_q(q, cos, sin, layout="thd", inplace=True)
    # rows of a fused projection, apart: accepted
    wide = torch.randn(6, 2, 3 * 48, device=device)[..., 48 : 2 * 48]
    positions = torch.arange(6, device=device)
    mlarope.apply_rope_q(wide, cos, sin, layout="thd", position_ids=positions, inplace=True)


@pytest.mark.parametrize("shared", ["cos", "sin", "position_ids"])
def test_inplace_on_memory_the_call_reads_is_rejected(shared, device):
    """q overlapping a table or the positions: the programs would read values others already
    rotated (a silently wrong result, and a race on a GPU). A ValueError naming both, also when
    the same metadata was recorded as a launch plan from a call without the overlap."""
    T, R = 16, 32
    ids = torch.arange(T - 1, -1, -1, device=device)

    def call(q, cos, sin, position_ids):
        return mlarope.apply_rope_q(
            q, cos, sin, layout="thd", position_ids=position_ids, inplace=True
        )

    def tensors(overlap: bool):
        # Every tensor a view of a [T, 2, R] block, so that both calls have one metadata.
        memory = torch.randn(T, 2, R, device=device)
        blocks = {name: torch.randn(T, 2, R, device=device) for name in ("cos", "sin", "ids")}
        if overlap:
            blocks[{"position_ids": "ids"}.get(shared, shared)] = memory
        q = memory[:, :1]  # [T, 1, R]
        position_ids = blocks["ids"].view(torch.int64)[:, 0, 0]  # the first 8 bytes of a row
        position_ids.copy_(ids)
        return q, blocks["cos"][:, 0], blocks["sin"][:, 0], position_ids

    call(*tensors(False))
    call(*tensors(False))  # recorded: a launch plan for this metadata
    with pytest.raises(ValueError, match=f"q shares memory with {shared}"):
        call(*tensors(True))


def test_compiled_inplace_on_memory_the_call_reads_is_rejected():
    """Under torch.compile(fullgraph=True) without grad (the in-place op itself runs in the
    graph): the overlap is refused when the graph runs, since tracing sees no addresses."""
    T, R = 16, 32
    memory = torch.randn(T, 2, R)
    q, cos, sin = memory[:, :1], memory[:, 0], torch.randn(T, R)

    @torch.compile(backend="eager", fullgraph=True)
    def rope(q, cos, sin):
        return mlarope.apply_rope_q(q, cos, sin, layout="thd", inplace=True)

    with torch.no_grad(), pytest.raises(ValueError, match="q shares memory with cos"):
        rope(q, cos, sin)


def test_inplace_on_an_inference_tensor():
    """Outside inference mode an inference tensor cannot be rotated in place (PyTorch's rule):
    a ``ValueError`` before anything is written. Inside inference mode it is rotated."""
    cos, sin = torch.randn(P, R), torch.randn(P, R)
    q = inference_tensor(torch.randn(S, B, H, N + R))
    before = q.clone()
    with pytest.raises(ValueError, match="q is an inference tensor"):
        mlarope.apply_rope_q(q, cos, sin, inplace=True)
    assert torch.equal(q, before), "nothing was written"
    with torch.inference_mode():
        out = mlarope.apply_rope_q(q, cos, sin, inplace=True)
    assert out is q and torch.equal(q, mlarope.apply_rope_q(before, cos, sin))


@pytest.mark.cpu  # switches between the interpreter's kernels and the reference on CPU tensors
@pytest.mark.parametrize("inplace_backward", [False, True])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_in_place_bumps_the_version_alike_on_every_backend(
    requires_grad, inplace_backward, monkeypatch
):
    """An in-place rotation is one write on every backend: the reference backend bumped ``q``'s
    version counter once more than the kernels (its copy, then the call's own bump; found by
    review: autograd's "is at version" messages differed by backend)."""
    from mlarope._launch_cache import clear_launch_cache

    cos, sin = mlarope.YarnConfig(dim=64).cos_sin(8)
    bumps = {}
    for backend in ("kernels", "reference"):
        monkeypatch.setenv("TRITON_INTERPRET", "1" if backend == "kernels" else "0")
        clear_launch_cache()
        q = torch.randn(4, 2, 70, requires_grad=requires_grad).clone()
        g = torch.randn(4, 2, 70)
        before = q._version
        out = mlarope.apply_rope_q(q, cos, sin, layout="thd", inplace=True,
                                   inplace_backward=inplace_backward)  # fmt: skip
        bumps[backend] = [q._version - before]
        if requires_grad:
            before = g._version
            out.backward(g)
            bumps[backend].append(g._version - before)
    assert bumps["kernels"] == bumps["reference"], bumps
    if not requires_grad:
        assert bumps["kernels"] == [1]


@pytest.mark.parametrize("backend", ["kernels", "reference"])
@pytest.mark.parametrize("view", [False, True])
def test_in_place_on_a_leaf_that_requires_grad_writes_nothing(view, backend, monkeypatch):
    """autograd forbids writing a leaf that requires grad (or a view of one) in place: the call
    raises before anything is written, as PyTorch's in-place ops do (the kernels wrote, then
    mark_dirty raised; found by review), also when repeated (no plan is recorded)."""
    if backend == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    cos, sin = mlarope.YarnConfig(dim=64).cos_sin(8)
    leaf = torch.randn(4, 2, 70, requires_grad=True)
    before = leaf.detach().clone()
    q = leaf[:, :1] if view else leaf
    # A launch plan recorded by calls on a non-leaf of the same metadata (its guard does not
    # tell a leaf): the leaf is refused before the plan is looked up.
    activation = torch.randn(4, 2, 70, requires_grad=True) * 1
    for _ in range(2):
        mlarope.apply_rope_q(activation[:, :1] if view else activation, cos, sin, layout="thd",
                             inplace=True)  # fmt: skip
    for _ in range(2):
        with pytest.raises(RuntimeError, match="q is a leaf Variable that requires grad"):
            mlarope.apply_rope_q(q, cos, sin, layout="thd", inplace=True)
        assert torch.equal(leaf.detach(), before)
    with torch.no_grad():  # outside autograd it is an ordinary tensor
        mlarope.apply_rope_q(q, cos, sin, layout="thd", inplace=True)
    assert not torch.equal(leaf.detach(), before)
