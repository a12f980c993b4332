"""The serving API: device validation, the eager plans, ``torch.compile``, one launch per call,
and (GPU lane) CUDA-graph capture and replay of a decode step with new positions and slots on
every replay. The host checks are tests/test_serving_checks.py."""

from __future__ import annotations

import re

import pytest
import torch

import mlarope
from mlarope import serving
from mlarope._launch_cache import LAUNCH_CACHE, clear_launch_cache
from mlarope.kernels._launch import recording
from mlarope.serving import _plans, checks
from mlarope.serving import reference as ref
from tests.serving_calls import (
    H,
    L,
    R,
    T,
    append_args,
    call_append,
    call_query,
    query_args,
)
from tests.serving_support import model1_cache, tables


# ------------------------------------------------------------------------ device validation
def test_append_validation_names_token_and_slot(device, monkeypatch):
    cases = [
        (
            dict(slot_mapping=torch.tensor([3, -1, 8, 6])),
            "slot_mapping[2] = 8 is outside the cache: slots are in [0, 8)",
        ),
        (
            dict(slot_mapping=torch.tensor([3, -2, 0, 6])),
            "slot_mapping[1] = -2 is outside the cache",
        ),
        (
            dict(slot_mapping=torch.tensor([3, -1, 6, 6])),
            "slot_mapping[3] = 6 repeats slot_mapping[2]",
        ),
        (
            dict(positions=torch.tensor([1, 5, 32, 0])),
            "positions[2] = 32 is outside the table [0, 32)",
        ),
    ]
    for change, message in cases:
        change = {k: v.to(device) for k, v in change.items()}
        args = append_args(device, **change)
        with pytest.raises(ValueError, match=re.escape(message)):
            call_append(args, validate=True)
        monkeypatch.setenv("MLAROPE_VALIDATE", "1")
        with pytest.raises(ValueError, match=re.escape(message)):
            call_append(args)
        monkeypatch.delenv("MLAROPE_VALIDATE")
    # a padding token's position is not read: no error
    call_append(
        append_args(device, positions=torch.tensor([1, 99, 0, 3], device=device)), validate=True
    )
    scale = torch.tensor([0.0], device=device)
    with pytest.raises(ValueError, match=re.escape("kv_scale = 0.0: a dequant scale must be")):
        call_append(append_args(device, cache_dtype=torch.uint8, kv_scale=scale), validate=True)


def test_query_validation(device):
    args = query_args(device, positions=torch.tensor([1, 5, -3, 0], device=device))
    with pytest.raises(ValueError, match=re.escape("positions[2] = -3 is outside the table")):
        call_query(args, validate=True)
    out = call_query(args)  # without validation: NaN rope values for that token
    assert out[2, :, 32:].float().isnan().all() and not out[[0, 1, 3]].float().isnan().any()


# ------------------------------------------------------------------------------ eager plans
@pytest.mark.parametrize(
    "fmt,cache_dtype,scale",
    [("concat", torch.bfloat16, None), ("split", torch.uint8, "tensor"), ("fp8_656", None, None),
     ("concat", torch.float8_e4m3fn, "value"), ("fp8_584", None, None)],
)  # fmt: skip
def test_append_plan_replays_the_pipeline(device, monkeypatch, fmt, cache_dtype, scale):
    """A repeated call takes its plan (no checks run) and writes what the pipeline writes, on
    new tensors of the same metadata; a Python-number scale is read on every call."""
    clear_launch_cache()
    base = append_args(device, fmt=fmt, cache_dtype=cache_dtype)
    if scale == "tensor":
        base["kv_scale"] = torch.tensor([0.05], device=device)
    call_append(base)
    call_append(base)
    key = next(iter(LAUNCH_CACHE.plans))
    assert LAUNCH_CACHE.plans[key][0][1].__class__ is _plans.Plan

    gen = torch.Generator().manual_seed(7)
    fresh = append_args(device, fmt=fmt, cache_dtype=cache_dtype)
    fresh["kv_c"] = torch.randn(T, base["kv_c"].shape[1], generator=gen).to(torch.bfloat16)
    fresh["kv_c"] = fresh["kv_c"].to(device)
    fresh["slot_mapping"] = torch.tensor([7, 2, -1, 4], device=device)
    if scale == "tensor":
        fresh["kv_scale"] = torch.tensor([0.125], device=device)
    elif scale == "value":
        fresh["kv_scale"] = 0.125
    expected = append_args(device, fmt=fmt, cache_dtype=cache_dtype, **{
        k: v for k, v in fresh.items() if k != "cache"
    })  # fmt: skip
    call_append(expected, validate=True)  # the pipeline (validation takes no plan)

    def fail(*args, **kwargs):
        raise AssertionError("the checks ran: the call did not take its plan")

    monkeypatch.setattr(checks, "check_append_call", fail)
    call_append(fresh)
    monkeypatch.undo()
    caches = (fresh["cache"], expected["cache"])
    if fmt == "split":
        caches = (torch.cat([c.view(torch.uint8) for c in caches[0]], -1),
                  torch.cat([c.view(torch.uint8) for c in caches[1]], -1))  # fmt: skip
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))


def test_plan_falls_back_to_the_pipeline(device):
    clear_launch_cache()
    base = append_args(device, cache_dtype=torch.uint8)
    call_append(base)
    call_append(base)
    with pytest.raises(ValueError, match="kv_scale must be a finite positive"):
        call_append(dict(base, kv_scale=-1.0))  # out of range: not taken by the plan
    with pytest.raises(ValueError, match="cache and kv_c share memory"):
        # the same metadata, but the cache's memory now holds kv_c
        cache = torch.zeros(2, 4, L + R, dtype=torch.uint8, device=device)
        kv_c = cache.view(-1)[: T * L * 2].view(torch.bfloat16).view(T, L)
        call_append(dict(base, cache=cache, kv_c=kv_c))
    # other metadata: a new entry, not a wrong replay
    call_append(dict(base, kv_c=base["kv_c"].float(), k_pe=base["k_pe"].float()))
    assert sum(len(entries) for entries in LAUNCH_CACHE.plans.values()) == 2


@pytest.mark.parametrize("shared", ["positions_and_slots", "cos_and_sin"])
def test_plan_of_a_call_with_one_tensor_twice(device, shared):
    """A call that passes one tensor for two arguments (``positions`` and ``slot_mapping`` of a
    fresh sequence, or ``cos`` and ``sin``) and a later call with two tensors of the same
    metadata: the later call reads each of its own tensors (the plan mapped both launch
    arguments to the first, so the replay wrote the entries at slot = position)."""
    clear_launch_cache()
    base = append_args(device)
    if shared == "positions_and_slots":
        idx = torch.tensor([3, 1, 0, 6], device=device)
        first = dict(base, positions=idx, slot_mapping=idx)
        second = dict(base, positions=torch.tensor([5, 9, 2, 17], device=device),
                      slot_mapping=torch.tensor([0, 7, 4, 2], device=device))  # fmt: skip
    else:
        first = dict(base, sin=base["cos"])
        second = base
    call_append(first)
    call_append(first)
    assert not LAUNCH_CACHE.plans  # the aliased call takes the pipeline and records nothing
    cache = second["cache"]
    cache.zero_()
    call_append(second)
    call_append(second)  # a plan now, for the calls with distinct tensors
    assert sum(plan is not None for e in LAUNCH_CACHE.plans.values() for _, plan in e) == 1
    cache.zero_()
    call_append(second)  # its replay
    want = torch.zeros_like(cache)
    call_append(dict(second, cache=want), validate=True)  # the pipeline: no plan is taken
    assert torch.equal(cache, want)


def test_plans_live_in_the_one_launch_cache(device):
    """The serving plans are entries of the core's launch cache, apart from the core's keys,
    and ``clear_launch_cache()`` forgets them (they were kept in a table of their own, which
    the core's reset left alone)."""
    clear_launch_cache()
    base = append_args(device, cache_dtype=torch.uint8)
    call_append(base)
    call_append(base)
    args = query_args(device)
    call_query(args)
    keys = list(LAUNCH_CACHE.plans)
    assert sorted(k[0] for k in keys) == ["serving.append", "serving.query"]
    clear_launch_cache()
    assert not LAUNCH_CACHE.plans


def test_query_plan(device, monkeypatch):
    clear_launch_cache()
    args = query_args(device)
    first = call_query(args, out_dtype=torch.float8_e4m3fn, q_scale=0.02)
    call_query(args, out_dtype=torch.float8_e4m3fn, q_scale=0.02)
    monkeypatch.setattr(checks, "check_query_call", lambda *a: 1 / 0)
    again = call_query(args, out_dtype=torch.float8_e4m3fn, q_scale=0.02)
    other_scale = call_query(args, out_dtype=torch.float8_e4m3fn, q_scale=0.04)
    monkeypatch.undo()
    assert again.data_ptr() != first.data_ptr()  # a new tensor each call
    assert torch.equal(again.view(torch.uint8), first.view(torch.uint8))
    want = call_query(args, out_dtype=torch.float8_e4m3fn, q_scale=0.04, validate=True)
    assert torch.equal(other_scale.view(torch.uint8), want.view(torch.uint8))
    out = torch.empty(T, H, 32 + R, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        assert call_query(args, out=out) is out
    assert torch.equal(out, call_query(args))


def test_one_launch_per_call(device):
    """Each op is one kernel launch (the pipeline, validated so that it records no plan of its
    own; a plan replays that one launch)."""
    for fmt, dtype in (
        ("concat", torch.uint8), ("split", torch.bfloat16), ("fp8_656", None), ("fp8_584", None),
    ):  # fmt: skip
        with recording() as launches:
            call_append(append_args(device, fmt=fmt, cache_dtype=dtype), validate=True)
        assert len(launches) == 1, fmt
    with recording() as launches:
        call_query(query_args(device), out_dtype=torch.float8_e4m3fn, q_scale=1.0, validate=True)
    assert len(launches) == 1


# --------------------------------------------------------------------------- torch.compile
def test_torch_compile_fullgraph(device):
    """Both ops traced whole (custom ops with their mutations declared) write what eager
    writes."""
    torch._dynamo.reset()
    a = append_args(device, cache_dtype=torch.uint8)
    q = query_args(device)
    scale = torch.tensor([0.05], device=device)

    def step(kv_c, k_pe, q_nope, q_pe, positions, slots, cache, out):
        serving.rope_append_kv_cache(
            kv_c, k_pe, a["cos"], a["sin"], positions, cache, slots, cache_format="concat",
            kv_scale=scale,
        )  # fmt: skip
        serving.rope_decode_query(q_nope, q_pe, a["cos"], a["sin"], positions, out=out)
        return serving.rope_decode_query(
            q_nope, q_pe, a["cos"], a["sin"], positions, out_dtype=torch.float8_e4m3fn,
            q_scale=0.5,
        )  # fmt: skip

    def run(fn):
        cache = torch.zeros(2, 4, L + R, dtype=torch.uint8, device=device)
        out = torch.empty(T, H, 32 + R, dtype=torch.bfloat16, device=device)
        fp8 = fn(a["kv_c"], a["k_pe"], q["q_nope"], q["q_pe"], a["positions"],
                 a["slot_mapping"], cache, out)  # fmt: skip
        return cache, out, fp8.view(torch.uint8)

    eager = run(step)
    compiled = run(torch.compile(step, fullgraph=True))
    for e, c in zip(eager, compiled, strict=True):
        assert torch.equal(e, c)


def test_torch_compile_fp8_584(device):
    """The DeepSeek-V4 cache under torch.compile(fullgraph=True): the custom op writes the
    strided cache view (blocks padded to 576 bytes) as eager does, padding untouched."""
    torch._dynamo.reset()
    a = append_args(device, fmt="fp8_584")

    def step(kv_c, k_pe, positions, slots, cache):
        serving.rope_append_kv_cache(
            kv_c, k_pe, a["cos"], a["sin"], positions, cache, slots, cache_format="fp8_584"
        )

    raws = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        raw, cache = model1_cache(2, 4, device, gen=torch.Generator().manual_seed(4))
        fn(a["kv_c"], a["k_pe"], a["positions"], a["slot_mapping"], cache)
        raws.append(raw)
    assert torch.equal(raws[0], raws[1])


def test_torch_compile_refuses_shared_memory(device):
    """Under torch.compile(fullgraph=True), where tracing sees no addresses, a cache that holds
    kv_c and an out that holds q_pe are still refused, when the graph runs (the eager checks
    skip while tracing, and the compiled ops wrote through the overlap)."""
    torch._dynamo.reset()
    base = append_args(device, cache_dtype=torch.uint8)
    cache = torch.zeros(2, 4, L + R, dtype=torch.uint8, device=device)
    kv_c = cache.view(-1)[: T * L * 2].view(torch.bfloat16).view(T, L)

    @torch.compile(backend="eager", fullgraph=True)
    def append(kv_c, cache):
        serving.rope_append_kv_cache(
            kv_c, base["k_pe"], base["cos"], base["sin"], base["positions"], cache,
            base["slot_mapping"], cache_format="concat", kv_scale=0.05,
        )  # fmt: skip

    with pytest.raises(ValueError, match="cache and kv_c share memory"):
        append(kv_c, cache)

    q = query_args(device)
    out = torch.empty(T, H, 32 + R, dtype=torch.bfloat16, device=device)
    q_pe = out[..., 32:]

    @torch.compile(backend="eager", fullgraph=True)
    def query(q_pe, out):
        serving.rope_decode_query(q["q_nope"], q_pe, q["cos"], q["sin"], q["positions"], out=out)

    with pytest.raises(ValueError, match="out and q_pe share memory"):
        query(q_pe, out)


# ---------------------------------------------------------------------------- GPU: graphs
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["concat", "fp8_656", "fp8_584"])
def test_cuda_graph_decode_step(fmt):
    """One decode step (query and cache append) captured once, replayed with new positions,
    slots, scale and inputs each time: each replay writes what the reference writes."""
    device = torch.device("cuda")
    cos, sin = tables(R, 64, device)
    n_tok, heads = 8, 16
    gen = torch.Generator().manual_seed(3)
    latent = 448 if fmt == "fp8_584" else L
    kv_c = torch.zeros(n_tok, latent, dtype=torch.bfloat16, device=device)
    k_pe = torch.zeros(n_tok, R, dtype=torch.bfloat16, device=device)
    q_nope = torch.zeros(n_tok, heads, L, dtype=torch.bfloat16, device=device)
    q_pe = torch.zeros(n_tok, heads, R, dtype=torch.bfloat16, device=device)
    positions = torch.zeros(n_tok, dtype=torch.int64, device=device)
    slots = torch.full((n_tok,), -1, dtype=torch.int64, device=device)
    scale = torch.tensor([1.0], device=device)
    out = torch.empty(n_tok, heads, L + R, dtype=torch.float8_e4m3fn, device=device)
    if fmt == "fp8_584":
        raw, cache = model1_cache(16, 4, device)
    else:
        shape = (16, 4, 656) if fmt == "fp8_656" else (16, 4, L + R)
        raw = cache = torch.zeros(shape, dtype=torch.uint8, device=device)
    kv_scale = None if fmt in ("fp8_656", "fp8_584") else scale

    def step():
        serving.rope_append_kv_cache(
            kv_c, k_pe, cos, sin, positions, cache, slots, cache_format=fmt, kv_scale=kv_scale
        )
        serving.rope_decode_query(q_nope, q_pe, cos, sin, positions, out=out, q_scale=scale)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles and records outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for replay in range(3):
        new = {
            kv_c: torch.randn(n_tok, latent, generator=gen),
            k_pe: torch.randn(n_tok, R, generator=gen),
            q_nope: torch.randn(n_tok, heads, L, generator=gen),
            q_pe: torch.randn(n_tok, heads, R, generator=gen),
            positions: torch.randint(0, 64, (n_tok,), generator=gen),
            slots: torch.randperm(64, generator=gen)[:n_tok].masked_fill(
                torch.arange(n_tok) % 3 == 1, -1),
            scale: torch.tensor([0.01 * (replay + 1)]),
        }  # fmt: skip
        for dst, src in new.items():
            dst.copy_(src)
        expected_raw = raw.cpu()  # before the step, then written by the reference
        expected_cache = (
            expected_raw[:, : 4 * 584].view(16, 4, 1, 584) if fmt == "fp8_584" else expected_raw
        )
        ref.append_kv_cache(
            kv_c.cpu(), k_pe.cpu(), cos.cpu(), sin.cpu(), positions.cpu(), expected_cache, None,
            slots.cpu(), cache_format=fmt, kv_scale=None if kv_scale is None else scale.cpu(),
            interleaved_in=True, interleaved_out=True,
        )  # fmt: skip
        graph.replay()
        torch.cuda.synchronize()
        expected_q = ref.decode_query(
            q_nope.cpu(), q_pe.cpu(), cos.cpu(), sin.cpu(), positions.cpu(),
            out_dtype=torch.float8_e4m3fn, q_scale=scale.cpu(), interleaved_in=True,
            interleaved_out=True,
        )  # fmt: skip
        got_q = out.cpu().view(torch.uint8)
        want_q = expected_q.view(torch.uint8)
        assert torch.equal(got_q[..., :L], want_q[..., :L])
        # rope codes: at most one step apart (fused multiply-adds in the kernel)
        _assert_codes_close(got_q[..., L:], want_q[..., L:])
        _assert_cache_close(raw.cpu(), expected_raw, fmt)


def _assert_codes_close(got: torch.Tensor, want: torch.Tensor) -> None:
    a, b = ref.e4m3_decode(got).double(), ref.e4m3_decode(want).double()
    assert bool(((a - b).abs() <= ref.e4m3_step(torch.maximum(a.abs(), b.abs()))).all())


def _assert_cache_close(got, want, fmt):
    if fmt == "fp8_584":  # raw blocks: data rows of 576 (448 codes, 64 bf16), then scale rows
        rows, rows_want = got[:, : 4 * 576].reshape(-1, 576), want[:, : 4 * 576].reshape(-1, 576)
        assert torch.equal(rows[:, :448], rows_want[:, :448])  # codes: exact
        assert torch.equal(got[:, 4 * 576 :], want[:, 4 * 576 :])  # scale rows, pad, padding
        rope_got = rows[:, 448:].contiguous().view(torch.bfloat16).float()
        rope_want = rows_want[:, 448:].contiguous().view(torch.bfloat16).float()
        assert torch.allclose(rope_got, rope_want, rtol=2**-7, atol=0, equal_nan=True)
    elif fmt == "fp8_656":
        assert torch.equal(got[..., :528], want[..., :528])  # codes and tile scales: exact
        rope_got = got[..., 528:].contiguous().view(torch.bfloat16).float()
        rope_want = want[..., 528:].contiguous().view(torch.bfloat16).float()
        assert torch.allclose(rope_got, rope_want, rtol=2**-7, atol=0)
    else:
        assert torch.equal(got[..., :L], want[..., :L])
        _assert_codes_close(got[..., L:], want[..., L:])


@pytest.mark.gpu
def test_one_cuda_kernel_per_call():
    """On the GPU each op runs exactly one kernel (the profiler counts them)."""
    device = torch.device("cuda")
    args = append_args(device, cache_dtype=torch.uint8)
    qargs = query_args(device)
    call_append(args)
    call_query(qargs, out_dtype=torch.float8_e4m3fn, q_scale=0.5)
    torch.cuda.synchronize()
    fp8 = torch.float8_e4m3fn
    for call in (lambda: call_append(args),
                 lambda: call_query(qargs, out_dtype=fp8, q_scale=0.5)):  # fmt: skip
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert len(kernels) == 1, [e.name for e in kernels]


def test_demo_serving(device, capsys):
    """``python -m mlarope demo --serving`` on this lane's backend: decode steps through the
    FP8 cache, checked against the reference."""
    from mlarope.tools import demo

    assert demo.main(["--serving", "--device", device.type, "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "fp8_656 cache" in out and "demo passed" in out


def test_docs_example_runs_as_pasted(tmp_path):
    """docs/serving.md's first example, on the lane's device."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300,
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    expected = "torch.Size([4, 16, 576]) torch.Size([2, 512]) torch.Size([2, 64])"
    assert result.stdout.strip() == expected


@pytest.mark.parametrize("backend", ["kernels", "reference"])
def test_negated_views_are_refused(backend, monkeypatch):
    """A lazily negated view's memory holds its values un-negated, which the kernels read and
    the reference did not: the serving ops accepted them for every tensor (found by review)."""
    if backend == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    cos, sin = mlarope.YarnConfig(dim=64).cos_sin(64)
    kv_c = torch.randn(2, 512, dtype=torch.bfloat16)
    k_pe = torch.randn(2, 64, dtype=torch.bfloat16)
    cache = torch.zeros(2, 4, 576, dtype=torch.bfloat16)
    args = dict(kv_c=kv_c, k_pe=k_pe, positions=torch.tensor([1, 2]), cache=cache,
                slot_mapping=torch.tensor([0, 1]))  # fmt: skip
    for name in args:
        bad = {**args, name: torch._neg_view(args[name])}
        with pytest.raises(ValueError, match=f"{name} is a negated view"):
            serving.rope_append_kv_cache(cos=cos, sin=sin, cache_format="concat", **bad)
    assert not cache.any()


@pytest.mark.parametrize("backend", ["kernels", "reference"])
def test_validation_in_a_fullgraph_compile(backend, monkeypatch):
    """``validate=True`` inside ``torch.compile(fullgraph=True)``: the serving ops' device-data
    checks are an op of the graph, which raises the eager error when the graph runs (a traced
    branch on the slots failed every trace, as the core ops' did; found by review)."""
    if backend == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch._dynamo.reset()
    cos, sin = mlarope.YarnConfig(dim=64).cos_sin(64)
    kv_c = torch.randn(2, 512, dtype=torch.bfloat16)
    k_pe = torch.randn(2, 64, dtype=torch.bfloat16)
    cache = torch.zeros(2, 4, 576, dtype=torch.bfloat16)
    q = torch.randn(2, 2, 512, dtype=torch.bfloat16), torch.randn(2, 2, 64, dtype=torch.bfloat16)
    o = torch.randn(2, 2, 512, dtype=torch.bfloat16)

    def append(positions, slots):
        serving.rope_append_kv_cache(kv_c, k_pe, cos, sin, positions, cache, slots,
                                     cache_format="concat", validate=True)  # fmt: skip

    def query(positions, slots):
        return serving.rope_decode_query(*q, cos, sin, positions, validate=True)

    def output(positions, slots):
        return serving.rope_inverse_quant_output(o, cos, sin, positions, validate=True)

    good, bad_position = torch.tensor([1, 2]), torch.tensor([1, 64])
    slots, repeated = torch.tensor([0, 1]), torch.tensor([0, 0])
    cases = [(append, bad_position, slots), (append, good, repeated),
             (query, bad_position, slots), (output, bad_position, slots)]  # fmt: skip
    for op, positions, op_slots in cases:
        compiled = torch.compile(op, fullgraph=True, backend="aot_eager")
        compiled(good, slots)
        with pytest.raises(ValueError) as eager:
            op(positions, op_slots)
        with pytest.raises(ValueError) as in_graph:
            compiled(positions, op_slots)
        assert str(in_graph.value) == str(eager.value), op.__name__
