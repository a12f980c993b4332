"""The query op's Triton kernels against the fp64 reference, over the issue's matrix; launch
configurations, the public API, autograd and ``inplace_backward``, ``torch.compile``, and (GPU
lane) correct rounding and CUDA graphs.

Runs on the ``device`` fixture: CPU tensors under Triton's interpreter in the CPU lane, CUDA in
the GPU lane. The harness (cases, inputs, launches into NaN-poisoned outputs, the fp64 truth and
the error model's tolerances) is ``tests/q_harness.py``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import mlarope
from mlarope import reference
from mlarope.kernels.q import QLaunchConfig, choose_q_config
from tests.errmodel import assert_close_elementwise
from tests.harness import random_tables
from tests.q_harness import (
    THD_TOKENS,
    Case,
    check_case,
    host_checked,
    launch,
    make_inputs,
    truth_and_tolerance,
)


def cases():
    yield from (Case(layout=lay) for lay in ("sbhd", "bshd"))
    yield Case(layout="thd", tokens=(15,), source="cu")
    yield Case(layout="thd", tokens=(11,), source="seq")
    yield Case(layout="thd", tokens=(9,), source="ids")
    yield Case(layout="sbhd", tokens=(4, 3), source="ids")
    yield Case(layout="bshd", tokens=(2, 5), source="ids")
    for cp_size in (2, 4):
        for rank in range(cp_size):
            yield Case(layout="thd", tokens=THD_TOKENS[cp_size], source="cu", cp_size=cp_size,
                       cp_rank=rank)  # fmt: skip
        yield Case(layout="sbhd", tokens=(4, 2), cp_size=cp_size, cp_rank=cp_size - 1)
        yield Case(layout="bshd", tokens=(2, 6), cp_size=cp_size, cp_rank=1)
    for dtype, table_dtype in itertools.product(
        (torch.float32, torch.float16, torch.bfloat16),
        (torch.float32, torch.bfloat16, torch.float16),
    ):
        yield Case(dtype=dtype, table_dtype=table_dtype)
    for rope in (32, 128):
        yield Case(rope=rope)
    for nope in (0, 1, 5, 128, 512):
        yield Case(nope=nope, tokens=(3, 1) if nope >= 128 else (5, 2))
    for heads in (1, 2, 5, 7, 16, 33):
        yield Case(heads=heads, tokens=(2, 2))
    for il, il_out, inv in itertools.product((True, False), (True, False), (False, True)):
        yield Case(layout="thd", tokens=(15,), source="cu", interleaved=il,
                   interleaved_out=il_out, inverse=inv)  # fmt: skip
    yield Case(strided=True)
    yield Case(strided=True, layout="bshd", tokens=(2, 3))
    yield Case(strided=True, layout="thd", tokens=(15,), source="cu")


CASES = list(cases())


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_q_matrix(case: Case, device):
    check_case(case, device)


def candidate_configs(n_tokens: int, heads: int, nope: int, rope: int) -> list[QLaunchConfig]:
    """The heuristic's pick and the other tilings it can produce for other shapes."""
    picked = choose_q_config(n_tokens, heads, nope, rope)
    others = [
        QLaunchConfig(block_t, block_h, block_n, warps)
        for block_t, block_h, block_n, warps in (
            (1, 1, 16, 1), (1, 2, 32, 1), (2, 4, 16, 2), (4, 8, 64, 4), (8, 1, 128, 8),
            (1, 16, 16, 4),
        )
    ]  # fmt: skip
    return [picked, *others]


@pytest.mark.parametrize("layout", ["sbhd", "thd"])
def test_q_identical_for_every_launch_config(layout, device):
    case = Case(layout=layout, tokens=(6, 2) if layout == "sbhd" else (15,),
                source="cu" if layout == "thd" else "seq", heads=5, nope=24)  # fmt: skip
    q, cos, sin, kwargs = make_inputs(case, device)
    q, cos2d, sin2d, positions = host_checked(q, cos, sin, case, kwargs)
    n_tokens = q.shape[0] * (q.shape[1] if q.dim() == 4 else 1)
    for transpose in (False, True):
        results = [
            launch(q, cos2d, sin2d, positions, case, transpose=transpose, config=config)
            for config in candidate_configs(n_tokens, case.heads, case.nope, case.rope)
        ]
        for other in results[1:]:
            assert torch.equal(other, results[0])
        inplace = q.clone()
        launch(inplace, cos2d, sin2d, positions, case, transpose=transpose, inplace=True,
               config=QLaunchConfig(1, 2, 16, 1))  # fmt: skip
        assert torch.equal(inplace, results[0])


def test_q_repeated_runs_bitwise(device):
    case = Case(layout="thd", tokens=(15,), source="cu")
    q, cos, sin, kwargs = make_inputs(case, device)
    first = mlarope.apply_rope_q(q, cos, sin, **kwargs)
    for _ in range(5):
        assert torch.equal(
            mlarope.apply_rope_q(q, cos, sin, **kwargs).nan_to_num(1), first.nan_to_num(1)
        )


@pytest.mark.parametrize("inplace", [False, True])
def test_q_public_api_autograd(inplace, device):
    """Gradients through the public API equal the backward kernel on the upstream gradient."""
    case = Case(layout="thd", tokens=(15,), source="cu", dtype=torch.float32)
    q0, cos, sin, kwargs = make_inputs(case, device)
    leaf = q0.clone().requires_grad_(True)
    x = leaf * 1.0 if inplace else leaf
    out = mlarope.apply_rope_q(x, cos, sin, inplace=inplace, **kwargs)
    if inplace:
        assert out is x, "in place returns its input"
    else:
        assert torch.equal(leaf.detach(), q0), "out of place leaves its input untouched"
    grad = torch.randn_like(out)
    (out * grad).sum().backward()
    qc, cos2d, sin2d, positions = host_checked(q0, cos, sin, case, kwargs)
    forward = launch(qc, cos2d, sin2d, positions, case, transpose=False)
    assert torch.equal(out.detach(), forward)
    expected = launch(grad, cos2d, sin2d, positions, case, transpose=True)
    if inplace:
        expected[..., : case.nope] = grad[..., : case.nope]
    assert torch.equal(leaf.grad, expected)


INPLACE_BACKWARD_CASES = [
    Case(layout="thd", tokens=(15,), source="cu"),
    Case(layout="sbhd", tokens=(5, 2), interleaved=False, interleaved_out=True, inverse=True),
    Case(layout="bshd", tokens=(2, 3), source="ids", rope=32, dtype=torch.float16),
]


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("case", INPLACE_BACKWARD_CASES, ids=["thd-cu", "sbhd-layouts", "ids"])
def test_q_inplace_backward_rotates_the_gradient_in_place(case, inplace, device):
    """``inplace_backward=True``: the gradient of ``q`` is the incoming gradient tensor itself,
    rotated in place, bitwise equal to the default (out-of-place) backward, which leaves the
    incoming gradient untouched."""
    q0, cos, sin, kwargs = make_inputs(case, device)
    flags = dict(interleaved=case.interleaved, interleaved_out=case.interleaved_out)
    flags.update(inverse=case.inverse, inplace=inplace, **kwargs)
    g0 = torch.randn(q0.shape, device=device).to(q0.dtype)
    grads = {}
    for inplace_backward in (False, True):
        leaf = q0.clone().requires_grad_(True)
        x = leaf * 1 if inplace else leaf
        out = mlarope.apply_rope_q(x, cos, sin, inplace_backward=inplace_backward, **flags)
        g = g0.clone()
        (dq,) = torch.autograd.grad(out, leaf, g)
        if inplace_backward:
            assert torch.equal(g.nan_to_num(7), dq.nan_to_num(7)), "g itself is rotated"
            if not inplace:  # no op between the leaf and ours: autograd returns our tensor
                assert dq.data_ptr() == g.data_ptr()
        else:
            assert torch.equal(g, g0), "the default backward leaves the gradient as it was"
            assert dq.data_ptr() != g.data_ptr()
        grads[inplace_backward] = dq.clone()
    assert torch.equal(grads[True].nan_to_num(7), grads[False].nan_to_num(7))
    _, cos2d, sin2d, positions = host_checked(q0, cos, sin, case, kwargs)
    expected = launch(g0, cos2d, sin2d, positions, case, transpose=True)
    assert torch.equal(grads[True].nan_to_num(7), expected.nan_to_num(7))


def test_q_inplace_backward_on_the_reference_backend(device):
    """float64 runs the PyTorch reference: ``inplace_backward`` rotates the gradient in place
    there too, with the default backward's values, and double backward falls back."""
    case = Case(layout="thd", tokens=(15,), source="cu", dtype=torch.float64)
    q0, cos, sin, kwargs = make_inputs(case, device)
    g0 = torch.randn(q0.shape, dtype=torch.float64, device=device)
    grads = []
    for inplace_backward in (False, True):
        leaf = q0.clone().requires_grad_(True)
        out = mlarope.apply_rope_q(leaf, cos, sin, inplace_backward=inplace_backward, **kwargs)
        g = g0.clone()
        (dq,) = torch.autograd.grad(out, leaf, g)
        assert (dq.data_ptr() == g.data_ptr()) == inplace_backward
        grads.append(dq)
    assert torch.equal(grads[0], grads[1])
    # A gradient that requires grad (create_graph) is never rotated in place.
    leaf = q0.clone().requires_grad_(True)
    out = mlarope.apply_rope_q(leaf, cos, sin, inplace_backward=True, **kwargs)
    g = g0.clone().requires_grad_(True)
    (dq,) = torch.autograd.grad(out, leaf, g, create_graph=True)
    assert torch.equal(g.detach(), g0) and torch.equal(dq.detach(), grads[0])


@pytest.mark.parametrize("how", ["broadcast", "slice", "transposed"])
def test_q_inplace_backward_falls_back_for_gradients_it_cannot_own(how, device):
    """A broadcast gradient (``out.sum()``'s) or a strided slice of a wider tensor is not
    rotated in place: the backward writes a new tensor, with the same values. A dense permuted
    gradient is rotated in place."""
    case = Case(layout="thd", tokens=(15,), source="cu", dtype=torch.float32)
    q0, cos, sin, kwargs = make_inputs(case, device)
    width = case.nope + case.rope
    if how == "broadcast":
        g = torch.randn(1, 1, width, device=device).expand(15, case.heads, width)
    elif how == "slice":
        g = torch.randn(15, case.heads, width + 5, device=device)[..., :width]
    else:
        g = torch.randn(case.heads, 15, width, device=device).transpose(0, 1)
    g_before = g.clone()
    results = []
    for inplace_backward in (False, True):
        leaf = q0.clone().requires_grad_(True)
        out = mlarope.apply_rope_q(leaf, cos, sin, inplace_backward=inplace_backward, **kwargs)
        (dq,) = torch.autograd.grad(out, leaf, g)
        results.append(dq.clone())
        if how != "transposed" or not inplace_backward:
            assert torch.equal(g, g_before)
            assert dq.data_ptr() != g.data_ptr()
        else:
            assert dq.data_ptr() == g.data_ptr()
    assert torch.equal(results[0], results[1])


def test_q_inplace_backward_dense_test():
    """``_grad_rotatable_in_place``: dense and non-overlapping in any dim order, not a graph
    tensor."""
    from mlarope.autograd import _grad_rotatable_in_place

    x = torch.zeros(4, 3, 8)
    assert _grad_rotatable_in_place(x)
    assert _grad_rotatable_in_place(x.transpose(0, 1))
    assert _grad_rotatable_in_place(torch.zeros(4, 1, 8)[:, :, :])
    assert not _grad_rotatable_in_place(x[:, :, :6])
    assert not _grad_rotatable_in_place(x[:, :1].expand(4, 3, 8))
    assert not _grad_rotatable_in_place(torch.zeros(48).as_strided((4, 3, 8), (8, 8, 1)))
    assert not _grad_rotatable_in_place(x.clone().requires_grad_(True))
    with torch.inference_mode():
        made_in_inference = torch.zeros(4, 3, 8)
    assert not _grad_rotatable_in_place(made_in_inference)


@pytest.mark.parametrize("inplace", [False, True])
def test_q_inplace_backward_compiled(inplace, device):
    """Compiled, ``inplace_backward`` changes nothing: the backward is out of place and the
    gradients equal eager's."""
    case = Case(layout="thd", tokens=(15,), source="cu", dtype=torch.float32)
    q0, cos, sin, kwargs = make_inputs(case, device)

    def f(q):
        return mlarope.apply_rope_q(
            q * 1, cos, sin, inplace=inplace, inplace_backward=True, **kwargs
        )

    torch._dynamo.reset()
    q1 = q0.clone().requires_grad_(True)
    q2 = q0.clone().requires_grad_(True)
    g = torch.randn(q0.shape, device=device)
    g_before = g.clone()
    torch.compile(f, fullgraph=True)(q2).backward(g)
    assert torch.equal(g, g_before)
    f(q1).backward(g.clone())
    assert torch.equal(q1.grad, q2.grad)


def test_q_inplace_caught_by_version_counter(device):
    leaf = torch.randn(4, 2, 3, 16 + 32, device=device, requires_grad=True)
    cos, sin = random_tables(8, 32, torch.float32, device)
    x = leaf * 1.0
    saved = x.sin()  # sin saves x for its backward
    mlarope.apply_rope_q(x, cos, sin, inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.sum().backward()


def test_q_inplace_without_grad_bumps_version(device):
    x = torch.randn(4, 2, 3, 16 + 32, device=device)
    cos, sin = random_tables(8, 32, torch.float32, device)
    before = x._version
    mlarope.apply_rope_q(x, cos, sin, inplace=True)
    assert x._version > before


@pytest.mark.parametrize("calls", ["out_of_place", "in_place", "both"])
def test_q_torch_compile_fullgraph(calls, device):
    """Compiled with fullgraph=True (no graph break): the same kernel outputs and gradients, for
    an out-of-place call, an in-place call, and both on one input in one graph. (The in-place
    cases failed on CUDA with torch 2.11 until the compiled in-place path with autograd became
    out of place plus a copy: docs/gpu_lane.md.)"""
    case = Case(layout="thd", tokens=(15,), source="cu", dtype=torch.float32)
    q0, cos, sin, kwargs = make_inputs(case, device)

    def f(q):
        outs = []
        if calls != "in_place":
            outs.append(mlarope.apply_rope_q(q, cos, sin, **kwargs))
        if calls != "out_of_place":
            y = q * 1.0
            mlarope.apply_rope_q(y, cos, sin, inplace=True, **kwargs)
            outs.append(y)
        return tuple(outs)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    q1 = q0.clone().requires_grad_(True)
    q2 = q0.clone().requires_grad_(True)
    eager = f(q1)
    got = compiled(q2)
    grads = [torch.randn_like(t).nan_to_num(0) for t in eager]
    torch.autograd.backward(eager, grads)
    torch.autograd.backward(got, grads)
    for e, g in zip(eager, got, strict=True):
        assert torch.equal(e.nan_to_num(0.5), g.nan_to_num(0.5))
    assert torch.equal(q1.grad, q2.grad)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,min_fraction", [(torch.bfloat16, 0.9999), (torch.float16, 0.999)])
def test_q_correctly_rounded_on_gpu(dtype, min_fraction, device):
    """On the GPU the single rounding is round-to-nearest: compare with fp64 rounded once."""
    q = torch.randn(512, 4, 16, 128 + 64, device=device).to(dtype)
    cos, sin = mlarope.YarnConfig.deepseek_v3().cos_sin(4096, device=device)
    out = mlarope.apply_rope_q(q, cos[:512], sin[:512])
    truth = reference.apply_rope_q(q.double(), cos[:512].double(), sin[:512].double())
    rope = slice(128, None)
    rounded = truth[..., rope].to(dtype)
    fraction = (out[..., rope] == rounded).double().mean().item()
    assert fraction >= min_fraction, f"{dtype}: only {fraction:.6f} correctly rounded"


@pytest.mark.gpu
def test_q_cuda_graph_capture(device):
    q = torch.randn(8, 128, 192, device=device, dtype=torch.bfloat16)
    cos, sin = mlarope.YarnConfig.deepseek_v3().cos_sin(4096, device=device)
    ids = torch.randint(0, 4096, (8,), device=device)
    expected = mlarope.apply_rope_q(q, cos, sin, layout="thd", position_ids=ids)
    static_out = torch.empty_like(expected)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            static_out.copy_(mlarope.apply_rope_q(q, cos, sin, layout="thd", position_ids=ids))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out.copy_(mlarope.apply_rope_q(q, cos, sin, layout="thd", position_ids=ids))
    static_out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, expected)


@pytest.mark.parametrize("cp_size", [1, 2])
def test_q_many_sequences_lookup(cp_size, device):
    """The multi-step search in cu_seqlens: hundreds of sequences (empty ones too) and a tail."""
    gen = torch.Generator().manual_seed(3)
    lens = torch.randint(0, 3, (300,), generator=gen) * 2 * cp_size
    cu = torch.cat((torch.zeros(1, dtype=torch.int64), lens.cumsum(0))).to(torch.int32)
    n_tokens = int(cu[-1]) // cp_size + 5
    case = Case(layout="thd", tokens=(n_tokens,), heads=2, nope=0, rope=32, table_rows=8)
    q, cos, sin, _ = make_inputs(case, device)
    for rank in range(cp_size):
        kwargs = dict(layout="thd", cu_seqlens=cu.to(device), cp_rank=rank, cp_size=cp_size)
        qc, cos2d, sin2d, positions = host_checked(
            q, cos, sin, Case(**{**case.__dict__, "cp_size": cp_size, "cp_rank": rank}), kwargs
        )
        out = launch(qc, cos2d, sin2d, positions, case, transpose=False)
        truth, tol = truth_and_tolerance(qc, cos2d, sin2d, positions, case, transpose=False)
        assert_close_elementwise(out, truth, tol, f"300 sequences, rank {rank}/{cp_size}")
