"""``python -m mlarope bench``: the GPU benchmark (DESIGN.md, "Performance model").

One run on one GPU measures, for DeepSeek-V3 shapes (``H = 128, N = 128, R = 64, K = V = 128``,
bf16), every case x op x implementation:

- the ceiling: a device-to-device copy of a large bf16 tensor (bytes = read + write);
- ``mlarope``: the public API for the forwards, the op-level backward functions of
  :mod:`mlarope.ops` for the backwards (``rope_q`` / ``rope_q_`` with
  ``transpose=True``, the latter what ``inplace_backward=True`` runs;
  ``rope_kv_backward``), so only the kernel is timed;
- ``reference``: :mod:`mlarope.reference` in eager mode (its forward, and its hand-written
  transpose for the backward: the same functions the CPU backend runs);
- ``compile``: the same reference functions under ``torch.compile``;
- ``megatron``: Megatron-Core's fused MLA RoPE (``fused_apply_mla_rope_for_q/kv``), when
  ``megatron.core`` imports; its backward is its autograd function's ``backward``, called
  directly on the graph node of one forward.

Effective bandwidth is the bytes of :func:`bytes_moved` (the useful bytes, the same for every
implementation) over the median time, and is reported against the copy measured in the same
run. Timing: ``triton.testing.do_bench`` (L2 flushed before every call; quantiles 0.2, 0.5,
0.8) where the data is many times the L2, CUDA-graph replay over rotated input sets (so each
call reads data that is not in the L2) for the decode sizes, and, for the decode forwards, the
eager host overhead: wall-clock per call of a loop of calls with one sync at the end.

``--cpu-smoke`` runs tiny shapes on the CPU (host timers) to check the harness end to end;
``--dry-run`` prints the plan and the bytes model without running anything.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import importlib
import inspect
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

QUANTILES = (0.2, 0.5, 0.8)
IMPLS = ("mlarope", "reference", "compile", "megatron")
HOST_TARGET_US = 20.0
HOST_REPEATS = 5  # host-overhead loops per measurement; the median is reported
SCALING_TARGET = 1.1
DEFAULT_L2_BYTES = 50 * 2**20


# ============================================================================ bytes model
@dataclass(frozen=True)
class MlaDims:
    """Per-head widths of an MLA layer: ``H`` heads, ``N`` nope + ``R`` rope query channels,
    ``K`` key-nope and ``V`` value channels; ``elem_bytes`` of the activation dtype."""

    heads: int = 128
    nope: int = 128
    rope: int = 64
    k_dim: int = 128
    v_dim: int = 128
    elem_bytes: int = 2

    @classmethod
    def deepseek_v3(cls) -> MlaDims:
        return cls()


@dataclass(frozen=True)
class OpSpec:
    """One timed operation: the query op (in place or not) or the key/value op, one direction."""

    key: str
    op: str  # "q" | "kv"
    direction: str  # "fwd" | "bwd"
    label: str
    inplace: bool = False
    copy_v: bool = True
    target: float = 0.90  # fraction of the copy bandwidth mlarope must reach (train shapes)


OPS: tuple[OpSpec, ...] = (
    OpSpec("q_inplace_fwd", "q", "fwd", "q in place fwd", inplace=True),
    # With inplace_backward=True, as Megatron-Core's (and the reference's) in-place backward;
    # the default backward of the in-place op is the out-of-place row's kernel.
    OpSpec("q_inplace_bwd", "q", "bwd", "q in place bwd (grad in place)", inplace=True),
    OpSpec("q_fwd", "q", "fwd", "q out of place fwd"),
    OpSpec("q_bwd", "q", "bwd", "q out of place bwd"),
    OpSpec("kv_fwd", "kv", "fwd", "kv fwd (copy_v)", target=0.92),
    OpSpec("kv_fwd_no_copy_v", "kv", "fwd", "kv fwd (no copy_v)", copy_v=False, target=0.92),
    OpSpec("kv_bwd", "kv", "bwd", "kv bwd", target=0.92),
)
OPS_BY_KEY = {spec.key: spec for spec in OPS}


def bytes_moved(
    op: str,
    direction: str,
    *,
    tokens: int,
    dims: MlaDims,
    inplace: bool = False,
    copy_v: bool = True,
) -> int:
    """Fewest bytes one call must move through device memory (DESIGN.md, "Performance model").

    Each input element read once, each output element written once; the cos/sin rows and the
    positions (a few hundred bytes per token, mostly served from the L2) are not counted. With
    ``e = dims.elem_bytes`` and ``T = tokens``:

    - query op, in place (``op="q"``, ``inplace=True``), forward or backward: read and write the
      rope tail, ``T * H * 2 * R * e``;
    - query op, out of place, forward or backward: read all of ``q`` (or the gradient) and write
      all of the output, ``T * H * 2 * (N + R) * e``;
    - key/value forward, ``copy_v=True``: read ``kv`` (``K + V``) and write ``k`` (``K + R``) and
      ``v`` (``V``) per head, and read ``k_pe`` (``R``) per token:
      ``T * H * ((K + V) + (K + R + V)) * e + T * R * e``;
    - key/value forward, ``copy_v=False``: ``v`` is a view of ``kv``, so only ``kv[..., :K]`` is
      read and ``k`` written: ``T * H * (K + (K + R)) * e + T * R * e``;
    - key/value backward (the mirror; the same kernel whatever ``copy_v`` was, since ``dv``
      arrives either way): read ``dk`` (``K + R``) and ``dv`` (``V``), write ``dkv``
      (``K + V``) per head, write ``dk_pe`` (``R``) per token:
      ``T * H * ((K + R + V) + (K + V)) * e + T * R * e``.

    Effective bandwidth is this over the measured time, for every implementation alike.
    """
    if direction not in ("fwd", "bwd"):
        raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    h, n, r, k, v, e = dims.heads, dims.nope, dims.rope, dims.k_dim, dims.v_dim, dims.elem_bytes
    if op == "q":
        per_head = 2 * r if inplace else 2 * (n + r)
        return tokens * h * per_head * e
    if op == "kv":
        # without copy_v the forward reads only kv[..., :K] and writes no v
        no_v = direction == "fwd" and not copy_v
        per_head = k + (k + r) if no_v else (k + v) + (k + r + v)
        return tokens * h * per_head * e + tokens * r * e
    raise ValueError(f"op must be 'q' or 'kv', got {op!r}")


def spec_bytes(spec: OpSpec, tokens: int, dims: MlaDims) -> int:
    return bytes_moved(
        spec.op, spec.direction, tokens=tokens, dims=dims, inplace=spec.inplace,
        copy_v=spec.copy_v,
    )  # fmt: skip


def rotation_sets(footprint_bytes: int, l2_bytes: int, max_sets: int) -> int:
    """Input sets to rotate through so that one pass reads at least 3x the L2 (each call then
    finds its inputs evicted), capped at ``max_sets``."""
    if footprint_bytes <= 0:
        return 1
    return max(1, min(max_sets, math.ceil(3 * l2_bytes / footprint_bytes)))


def target_status(value: float | None, target: float, *, higher_is_better: bool = True) -> str:
    """``PASS``/``MISS`` of one measurement against its target (``n/a`` when not measured)."""
    if value is None or math.isnan(value):
        return "n/a"
    ok = value >= target if higher_is_better else value <= target
    return "PASS" if ok else "MISS"


# ============================================================================ cases
@dataclass(frozen=True)
class Case:
    """A batch shape: sbhd ``[S, B]``, thd ``[T]`` with ``n_seqs`` equal sequences
    (``cu_seqlens``), or a decode batch ``[T]`` (thd with random ``position_ids``)."""

    key: str
    label: str
    layout: str
    token_shape: tuple[int, ...]
    n_seqs: int | None = None
    decode: bool = False

    @property
    def tokens(self) -> int:
        return math.prod(self.token_shape)


@dataclass(frozen=True)
class Suite:
    dims: MlaDims
    cases: tuple[Case, ...]
    max_positions: int
    scaling_pair: tuple[str, str]  # thd case keys: few and many sequences
    dtype: torch.dtype = torch.bfloat16


def full_suite() -> Suite:
    tokens = 16384
    cases = [Case("sbhd", "sbhd 4096x4", "sbhd", (4096, 4))]
    for n in (1, 4, 64, 1024, 4096):
        cases.append(Case(f"thd{n}", f"thd 16k / {n} seq", "thd", (tokens,), n_seqs=n))
    for t in (1, 8, 64, 256):
        cases.append(Case(f"decode{t}", f"decode {t}", "thd", (t,), decode=True))
    return Suite(MlaDims.deepseek_v3(), tuple(cases), 32768, ("thd4", "thd4096"))


def smoke_suite() -> Suite:
    cases = [Case("sbhd", "sbhd 8x2", "sbhd", (8, 2))]
    for n in (1, 2, 8):
        cases.append(Case(f"thd{n}", f"thd 32 / {n} seq", "thd", (32,), n_seqs=n))
    for t in (1, 4):
        cases.append(Case(f"decode{t}", f"decode {t}", "thd", (t,), decode=True))
    dims = MlaDims(heads=4, nope=16, rope=32, k_dim=16, v_dim=8)
    return Suite(dims, tuple(cases), 64, ("thd2", "thd8"))


def select_cases(suite: Suite, spec: str | None) -> tuple[Case, ...]:
    """``spec``: a comma list of case keys or groups: ``all``, ``train`` (sbhd and thd*),
    ``decode``."""
    if not spec or spec == "all":
        return suite.cases
    keys = {c.key for c in suite.cases}
    chosen: list[Case] = []
    for word in (w.strip() for w in spec.split(",") if w.strip()):
        if word == "train":
            group = [c for c in suite.cases if not c.decode]
        elif word == "decode":
            group = [c for c in suite.cases if c.decode]
        elif word in keys:
            group = [c for c in suite.cases if c.key == word]
        else:
            raise ValueError(
                f"--cases: unknown case {word!r}; expected all, train, decode or one of "
                f"{sorted(keys)}"
            )
        chosen.extend(c for c in group if c not in chosen)
    return tuple(c for c in suite.cases if c in chosen)


def select_names(spec: str | None, choices: Sequence[str], what: str) -> tuple[str, ...]:
    if not spec:
        return tuple(choices)
    words = [w.strip() for w in spec.split(",") if w.strip()]
    for w in words:
        if w not in choices:
            raise ValueError(f"--{what}: unknown {w!r}; expected a comma list of {list(choices)}")
    return tuple(c for c in choices if c in words)


# ============================================================================ timers
@dataclass
class Timing:
    """Times of one call in milliseconds: quantiles 0.2, 0.5 (median), 0.8."""

    q20: float
    median: float
    q80: float
    method: str


def host_us_per_call(
    fn: Callable[[], object],
    sync: Callable[[], object],
    calls: int,
    repeats: int = HOST_REPEATS,
    warmup: int = 50,
) -> float:
    """Wall-clock microseconds per call of ``fn`` in a loop, one ``sync`` at the end: the
    median of ``repeats`` such loops (single loops on the H200 machine's host varied by up to
    10 us a call from one op to the next within a run)."""
    return statistics.median(host_loops(fn, sync, calls, repeats, warmup))


def host_loops(
    fn: Callable[[], object],
    sync: Callable[[], object],
    calls: int,
    repeats: int = HOST_REPEATS,
    warmup: int = 50,
) -> list[float]:
    """Microseconds per call of each of ``repeats`` loops of ``calls`` calls. Python's cyclic
    garbage collector stays on, as in a user's process, after one full collection, so that
    objects left by earlier work are not collected inside this measurement."""
    for _ in range(min(warmup, calls)):
        fn()
    sync()
    gc.collect()
    loops = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        loops.append((time.perf_counter() - t0) / calls * 1e6)
    return loops


def _quantiles(times: Sequence[float]) -> tuple[float, float, float]:
    t = torch.tensor(list(times), dtype=torch.float64)
    q = torch.quantile(t, torch.tensor(QUANTILES, dtype=torch.float64))
    return float(q[0]), float(q[1]), float(q[2])


class CudaTimer:
    """Device timings: ``do_bench`` with L2 flushes for large data, CUDA-graph replay over
    rotated input sets for small data, and wall-clock host overhead."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.device = device
        self.warmup_ms = args.warmup_ms
        self.rep_ms = args.rep_ms
        self.host_calls = args.host_calls
        self.max_graph_calls = args.max_graph_calls
        props = torch.cuda.get_device_properties(device)
        self.l2_bytes = int(getattr(props, "L2_cache_size", 0) or DEFAULT_L2_BYTES)

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def large(self, fn: Callable[[], object]) -> Timing:
        from triton.testing import do_bench

        q = do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, quantiles=list(QUANTILES))
        return Timing(q[0], q[1], q[2], "do_bench")

    def graph(self, calls: Sequence[Callable[[], object]]) -> Timing:
        """Capture ``calls`` (one per input set) in one CUDA graph; time its replays."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for fn in calls[:2]:
                fn()
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.sync()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for fn in calls:
                fn()
        g.replay()
        self.sync()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        self.sync()
        estimate = max(start.elapsed_time(end), 1e-3)
        n = max(10, min(200, int(self.rep_ms / estimate)))
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(n)
        ]
        for s, e in events:
            s.record()
            g.replay()
            e.record()
        self.sync()
        times = [s.elapsed_time(e) / len(calls) for s, e in events]
        del g
        return Timing(*_quantiles(times), f"graph x{len(calls)}")

    def host_us(self, fn: Callable[[], object], calls: int | None = None) -> float:
        """``host_us_per_call`` with this run's call count."""
        return host_us_per_call(fn, self.sync, calls or self.host_calls)

    def host_floor(self) -> dict[str, float]:
        """What any launch costs on this host: a one-element torch op, an empty Triton kernel."""
        x = torch.zeros(1, device=self.device)
        empty = _empty_triton_kernel()
        return {
            "torch_add_us": self.torch_op_us(),
            "triton_empty_us": self.host_us(lambda: empty[(1,)](x)),
        }

    def torch_op_us(self) -> float:
        """A one-element torch op's host time now (``host_floor``'s first figure)."""
        x = torch.zeros(1, device=self.device)
        return self.host_us(lambda: x.add_(1.0))

    def copy(self, mib: int, dtype: torch.dtype) -> tuple[Timing, int]:
        n = mib * 2**20 // torch.tensor([], dtype=dtype).element_size()
        src = torch.randn(n, dtype=dtype, device=self.device)
        dst = torch.empty_like(src)
        timing = self.large(lambda: dst.copy_(src))
        return timing, 2 * src.numel() * src.element_size()


def _empty_triton_kernel():
    """A Triton kernel that does nothing: its launch cost is the floor of any Triton op's."""
    import triton

    @triton.jit
    def _empty(x_ptr):
        pass

    return _empty


class CpuTimer:
    """Host timers for ``--cpu-smoke``: the CPU is synchronous, so each call is timed alone."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.device = device
        self.reps = args.cpu_reps
        self.l2_bytes = 0
        self.max_graph_calls = 1

    def sync(self) -> None:
        pass

    def _time(self, calls: Sequence[Callable[[], object]], method: str) -> Timing:
        calls[0]()
        times = []
        for i in range(self.reps):
            t0 = time.perf_counter()
            calls[i % len(calls)]()
            times.append((time.perf_counter() - t0) * 1e3)
        return Timing(*_quantiles(times), method)

    def large(self, fn: Callable[[], object]) -> Timing:
        return self._time([fn], "cpu")

    def graph(self, calls: Sequence[Callable[[], object]]) -> Timing:
        return self._time(calls, "cpu")

    def host_us(self, fn: Callable[[], object], calls: int | None = None) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(self.reps):
            fn()
        return (time.perf_counter() - t0) / self.reps * 1e6

    def host_floor(self) -> dict[str, float]:
        return {"torch_add_us": self.torch_op_us()}

    def torch_op_us(self) -> float:
        x = torch.zeros(1)
        return self.host_us(lambda: x.add_(1.0))

    def copy(self, mib: int, dtype: torch.dtype) -> tuple[Timing, int]:
        n = mib * 2**20 // torch.tensor([], dtype=dtype).element_size()
        src = torch.randn(n, dtype=dtype)
        dst = torch.empty_like(src)
        return self._time([lambda: dst.copy_(src)], "cpu"), 2 * src.numel() * src.element_size()


# ============================================================================ inputs
@dataclass
class Inputs:
    """One input set of a (case, op): activations and gradients as the op needs them."""

    x: torch.Tensor  # q [tokens..., H, N + R] | kv [tokens..., H, K + V] | grad of q
    k_pe: torch.Tensor | None = None  # [tokens..., 1, R] (kv fwd)
    dk: torch.Tensor | None = None  # [tokens..., H, K + R] (kv bwd)
    dv: torch.Tensor | None = None  # [tokens..., H, V] (kv bwd)


@dataclass
class Positional:
    """Position source and tables of a case, shared by every input set."""

    layout: str
    cu_seqlens: torch.Tensor | None
    position_ids: torch.Tensor | None
    cos: torch.Tensor  # [P, R] fp32 (mlarope, reference)
    sin: torch.Tensor
    cos_m: torch.Tensor  # [P, 1, 1, R] activation dtype, contiguous (Megatron)
    sin_m: torch.Tensor


def make_positional(suite: Suite, case: Case, device: torch.device, gen: torch.Generator):
    from mlarope.yarn import YarnConfig

    cos, sin = YarnConfig.deepseek_v3(dim=suite.dims.rope).cos_sin(suite.max_positions, device)
    cu = ids = None
    if case.decode:
        ids = torch.randint(0, suite.max_positions, case.token_shape, generator=gen)
        ids = ids.to(device)
    elif case.layout == "thd":
        n, t = case.n_seqs or 1, case.tokens
        cu = torch.arange(0, n + 1, dtype=torch.int32) * (t // n)
        cu = cu.to(device)
    shape = (cos.shape[0], 1, 1, cos.shape[1])
    cos_m = cos.to(suite.dtype).reshape(shape).contiguous()
    sin_m = sin.to(suite.dtype).reshape(shape).contiguous()
    return Positional(case.layout, cu, ids, cos, sin, cos_m, sin_m)


def make_inputs(suite: Suite, case: Case, spec: OpSpec, device: torch.device, sets: int):
    d, ts, dt = suite.dims, case.token_shape, suite.dtype

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn((*ts, *shape), dtype=dt, device=device)

    out = []
    for _ in range(sets):
        if spec.op == "q":
            out.append(Inputs(randn(d.heads, d.nope + d.rope)))
        elif spec.direction == "fwd":
            out.append(Inputs(randn(d.heads, d.k_dim + d.v_dim), k_pe=randn(1, d.rope)))
        else:
            kv = torch.empty(0, device=device)
            out.append(Inputs(kv, dk=randn(d.heads, d.k_dim + d.rope), dv=randn(d.heads, d.v_dim)))
    return out


# ============================================================================ implementations
# Every builder returns a zero-argument callable (one call of the op on one input set), or
# raises Unsupported with the reason the implementation has no such call.
class Unsupported(Exception):
    pass


def _ref_q(q, cos, sin, cu, ids, *, layout: str, inplace: bool, transpose: bool):
    """The reference query op (forward, or its transpose for the backward), in place or not."""
    from mlarope import reference
    from mlarope.positions import Positions, token_positions

    positions = Positions(layout, cu, ids, 0, 1)
    il_in, il_out = (False, True) if transpose else (True, False)
    if not inplace:
        return reference.rope_q(
            q, cos, sin, positions, interleaved_in=il_in, interleaved_out=il_out, inverse=False,
            transpose=transpose,
        )  # fmt: skip
    nope = q.shape[-1] - cos.shape[-1]
    dtype = reference.compute_dtype(q.dtype)
    pos, is_padding = token_positions(positions, q.shape[:-2], q.device)
    c, s, in_range = reference.gather_tables(cos, sin, pos, dtype)
    rotated = reference.rotate_pairs(
        q[..., nope:].to(dtype), c, s, is_padding, in_range, interleaved_in=il_in,
        interleaved_out=il_out, inverse=False, transpose=transpose,
    )  # fmt: skip
    q[..., nope:].copy_(rotated)
    return q


def _ref_kv(kv, k_pe, cos, sin, cu, ids, *, layout: str, k_dim: int, copy_v: bool):
    from mlarope import reference
    from mlarope.positions import Positions

    positions = Positions(layout, cu, ids, 0, 1)
    k, v = reference.rope_kv(
        kv, k_pe, cos, sin, positions, k_dim=k_dim, interleaved_in=True, interleaved_out=False
    )
    return k, (v.contiguous() if copy_v else v)


def _ref_kv_bwd(dk, dv, cos, sin, cu, ids, *, layout: str, k_dim: int):
    from mlarope import reference
    from mlarope.positions import Positions

    positions = Positions(layout, cu, ids, 0, 1)
    return reference.rope_kv_backward(
        dk, dv, cos, sin, positions, k_dim=k_dim, interleaved_in=True, interleaved_out=False
    )


class Builders:
    """Make the timed callables of each implementation."""

    def __init__(self, suite: Suite, compile_mode: str, megatron: Any | None) -> None:
        self.suite = suite
        self.compile_mode = compile_mode
        self.megatron = megatron
        self._compiled: dict[Any, Callable] = {}

    # ------------------------------------------------------------------ mlarope
    def mlarope(self, spec: OpSpec, inp: Inputs, pos: Positional) -> Callable[[], object]:
        import mlarope
        from mlarope import ops

        d = self.suite.dims
        where = dict(layout=pos.layout, cu_seqlens=pos.cu_seqlens, position_ids=pos.position_ids)
        if spec.direction == "fwd":
            if spec.op == "q":
                return lambda: mlarope.apply_rope_q(
                    inp.x, pos.cos, pos.sin, inplace=spec.inplace, **where
                )
            return lambda: mlarope.apply_rope_kv(
                inp.x, inp.k_pe, pos.cos, pos.sin, k_dim=d.k_dim, copy_v=spec.copy_v, **where
            )
        # The op-level backward functions, as the autograd functions (mlarope.autograd) call
        # them: the tables are [P, R] fp32, and thd positions are the forward's cu_seqlens
        # search, run once here as the forward runs it (ops.search_for_backward).
        grad = inp.x if spec.op == "q" else inp.dk
        if spec.op == "q":
            # The forward kernel with transpose=True and the interleaving flags swapped. The
            # in-place row rotates the gradient in place: the backward of apply_rope_q(...,
            # inplace_backward=True). Without it, the backward is the out-of-place row's kernel
            # (a shared gradient must not be rotated in place; docs/semantics.md).
            call = ops.QueryCall(
                pos.cos, pos.sin, pos.cu_seqlens, pos.position_ids, None, pos.layout, 0, 1,
                False, True, False, True,
            )  # fmt: skip
            call = ops.search_for_backward(grad, call)
            if spec.inplace:
                return lambda: ops.rope_q_(inp.x, call)
            return lambda: ops.rope_q(inp.x, call)
        call = ops.KVCall(
            pos.cos, pos.sin, pos.cu_seqlens, pos.position_ids, None, pos.layout, 0, 1, d.k_dim,
            True, False, True, False,
        )  # fmt: skip
        call = ops.search_for_backward(grad, call)
        return lambda: ops.rope_kv_backward(inp.dk, inp.dv, call)

    # ------------------------------------------------------------------ reference / compile
    def _ref_fn(self, name: str, fn: Callable, compiled: bool, **static: Any) -> Callable:
        if not compiled:
            return lambda *a: fn(*a, **static)
        key = (name, tuple(sorted(static.items())))
        if key not in self._compiled:
            import functools

            self._compiled[key] = torch.compile(
                functools.partial(fn, **static), mode=self.compile_mode
            )
        return self._compiled[key]

    def reference(
        self, spec: OpSpec, inp: Inputs, pos: Positional, *, compiled: bool = False
    ) -> Callable[[], object]:
        d = self.suite.dims
        where = (pos.cos, pos.sin, pos.cu_seqlens, pos.position_ids)
        if spec.op == "q":
            f = self._ref_fn(
                "q", _ref_q, compiled, layout=pos.layout, inplace=spec.inplace,
                transpose=spec.direction == "bwd",
            )  # fmt: skip
            return lambda: f(inp.x, *where)
        if spec.direction == "fwd":
            f = self._ref_fn(
                "kv", _ref_kv, compiled, layout=pos.layout, k_dim=d.k_dim, copy_v=spec.copy_v
            )
            k_pe = inp.k_pe.squeeze(-2)
            return lambda: f(inp.x, k_pe, *where)
        f = self._ref_fn("kv_bwd", _ref_kv_bwd, compiled, layout=pos.layout, k_dim=d.k_dim)
        return lambda: f(inp.dk, inp.dv, *where)

    def compile(self, spec: OpSpec, inp: Inputs, pos: Positional) -> Callable[[], object]:
        return self.reference(spec, inp, pos, compiled=True)

    # ------------------------------------------------------------------ megatron
    def megatron_impl(self, spec: OpSpec, inp: Inputs, pos: Positional) -> Callable[[], object]:
        mc = self.megatron
        if mc is None:
            raise Unsupported("megatron.core not importable")
        if retune_megatron(mc) == 0:
            warnings.warn(
                "megatron: no autotuner found to clear; its thd cases may all run the "
                "configuration tuned on the first",
                stacklevel=2,
            )
        d = self.suite.dims
        device = (inp.dk if inp.dk is not None else inp.x).device
        if device.type != "cuda":
            raise Unsupported("needs CUDA")
        cu = pos.cu_seqlens
        ids = pos.position_ids
        if spec.op == "q":
            if ids is not None:
                return self._megatron_q_position_ids(spec, inp, pos)
            if spec.direction == "fwd":
                fwd = mc.fused_apply_mla_rope_for_q
                args = (pos.cos_m, pos.sin_m, d.nope, d.rope, cu)
                if spec.inplace:
                    return lambda: fwd(inp.x, *args)
                # Megatron's query op is in place only; out of place is a clone first (what its
                # own fused_mla_rope_out_of_place does).
                return lambda: fwd(inp.x.clone(), *args)
            if not spec.inplace:
                raise Unsupported("its backward is the in-place one (see q in place bwd)")
            node = _forward_node(
                lambda t: mc.fused_apply_mla_rope_for_q(
                    t, pos.cos_m, pos.sin_m, d.nope, d.rope, cu
                ),
                inp.x,
            )
            return lambda: node.apply(inp.x)
        if ids is not None:
            raise Unsupported("no position_ids in fused_apply_mla_rope_for_kv")
        if spec.direction == "fwd":
            if not spec.copy_v:
                raise Unsupported("always writes v")
            fwd = mc.fused_apply_mla_rope_for_kv
            args = (pos.cos_m, pos.sin_m, d.rope, d.k_dim, d.v_dim, cu)
            return lambda: fwd(inp.x, inp.k_pe, *args)
        kv = torch.randn((*inp.dk.shape[:-1], d.k_dim + d.v_dim), dtype=inp.dk.dtype, device=device)
        k_pe = torch.randn((*inp.dk.shape[:-2], 1, d.rope), dtype=inp.dk.dtype, device=device)
        node = _forward_node(
            lambda a, b: mc.fused_apply_mla_rope_for_kv(
                a, b, pos.cos_m, pos.sin_m, d.rope, d.k_dim, d.v_dim, cu
            ),
            kv,
            k_pe,
        )
        return lambda: node.apply(inp.dk, inp.dv)

    def _megatron_q_position_ids(self, spec: OpSpec, inp: Inputs, pos: Positional):
        """Newer Megatron-Core has ``fused_mla_rope_inplace(..., position_ids=)`` (thd only)."""
        fn = getattr(self.megatron, "fused_mla_rope_inplace", None)
        if fn is None or "position_ids" not in inspect.signature(fn).parameters:
            raise Unsupported("no position_ids in this megatron-core")
        if spec.direction == "bwd":
            raise Unsupported("decode backward not benchmarked for megatron")
        d = self.suite.dims
        t = pos.position_ids.shape[0]
        cu = torch.tensor([0, t], dtype=torch.int32, device=pos.position_ids.device)
        kwargs = dict(cu_seqlens_q=cu, position_ids=pos.position_ids)
        args = (pos.cos_m, pos.sin_m, d.nope, d.rope)
        if spec.inplace:
            return lambda: fn(inp.x, *args, **kwargs)
        return lambda: fn(inp.x.clone(), *args, **kwargs)


def retune_megatron(module: Any) -> int:
    """Clear the autotuner caches of Megatron-Core's fused MLA RoPE kernels (the module's
    ``triton.autotune`` objects), so that the case about to be timed runs the configuration
    tuned for its own shape: Megatron at its best. Its autotune key is the head and channel
    counts and the arguments' dtypes, not the number of sequences, so in one process every thd
    batch runs the configuration tuned on the first (docs/benchmarks.md). Returns how many
    caches it cleared."""
    from triton.runtime.autotuner import Autotuner

    cleared = 0
    for obj in vars(module).values():
        if isinstance(obj, Autotuner):
            obj.cache.clear()
            cleared += 1
    return cleared


def _forward_node(fwd: Callable[..., Any], *inputs: torch.Tensor):
    """Run ``fwd`` once with autograd on copies of ``inputs``; return its custom autograd node,
    whose ``apply(*grads)`` calls the function's ``backward`` directly (no autograd engine)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    with torch.enable_grad():
        out = fwd(*(leaf * 1 for leaf in leaves))
    first = out[0] if isinstance(out, tuple | list) else out
    todo, seen = [first.grad_fn], set()
    while todo:
        node = todo.pop(0)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if hasattr(node, "_forward_cls"):
            node._bench_keep = (leaves, out)  # keep the saved tensors' graph alive
            return node
        todo.extend(n for n, _ in node.next_functions)
    raise Unsupported("could not find the autograd node of the forward")


def import_megatron() -> tuple[Any | None, str]:
    """Megatron-Core's fused MLA RoPE module and its version, or ``(None, reason)``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mod = importlib.import_module("megatron.core.fusions.fused_mla_yarn_rope_apply")
    except Exception as exc:  # any import failure means "not available"; say why
        return None, f"not importable ({type(exc).__name__}: {exc})"
    version = "unknown"
    with contextlib.suppress(Exception):
        from importlib.metadata import version as dist_version

        version = dist_version("megatron-core")
    return mod, version


# ============================================================================ the run
@dataclass
class Row:
    case: str
    case_label: str
    op: str
    op_label: str
    direction: str
    impl: str
    tokens: int
    bytes: int
    ms_q20: float | None = None
    ms: float | None = None
    ms_q80: float | None = None
    method: str = ""
    tbps: float | None = None
    pct_copy: float | None = None
    host_us: float | None = None
    # A one-element torch op's host time, measured right after host_us: the host's own speed
    # in that minute (on the H200 machine's shared host it moved by up to 1.7x within minutes).
    host_floor_us: float | None = None
    target: str = ""
    status: str = ""
    note: str = ""
    wall_s: float = 0.0  # harness time of this row: build, compile, warm-up, timing


@dataclass
class Results:
    meta: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    checks: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "meta": self.meta,
            "rows": [dataclasses.asdict(r) for r in self.rows],
            "checks": self.checks,
        }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m mlarope bench``."""
    parser.add_argument("--device", default="cuda", help="CUDA device (default: cuda)")
    parser.add_argument(
        "--cpu-smoke", action="store_true",
        help="tiny shapes on the CPU with host timers: checks the harness, measures nothing real",
    )  # fmt: skip
    parser.add_argument(
        "--dry-run", action="store_true", help="print the cases, ops and bytes model; run nothing"
    )
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG bar chart of %% of copy")
    parser.add_argument(
        "--out", metavar="DIR",
        help="write DIR/bench.json, DIR/bench.png and DIR/bench.md (a results table)",
    )  # fmt: skip
    parser.add_argument(
        "--impls", metavar="LIST",
        help=f"comma list of {','.join(IMPLS)} (default: all; --cpu-smoke: mlarope,reference)",
    )  # fmt: skip
    parser.add_argument(
        "--ops", metavar="LIST", help=f"comma list of {','.join(OPS_BY_KEY)} (default: all)"
    )
    parser.add_argument(
        "--cases", metavar="LIST",
        help="comma list of case keys (sbhd, thd1, thd4, thd64, thd1024, thd4096, decode1, "
        "decode8, decode64, decode256) or groups all, train, decode (default: all)",
    )  # fmt: skip
    parser.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warm-up (ms)")
    parser.add_argument(
        "--rep-ms", type=float, default=100.0, help="do_bench / graph replay time per case (ms)"
    )
    parser.add_argument(
        "--copy-mib", type=int, default=1024,
        help="size of the copied tensor for the ceiling, MiB (bytes moved: twice that)",
    )  # fmt: skip
    parser.add_argument(
        "--host-calls", type=int, default=1000, help="calls per host-overhead measurement"
    )
    parser.add_argument(
        "--max-graph-calls", type=int, default=2048,
        help="most calls (rotated input sets) captured in one CUDA graph (decode sizes)",
    )  # fmt: skip
    parser.add_argument(
        "--compile-mode", default="default", help="torch.compile mode for the compile baseline"
    )
    parser.add_argument(
        "--merge", nargs="+", metavar="JSON",
        help="combine the JSON of earlier runs (e.g. train and decode cases run as separate "
        "commands) into one table, JSON, plot; later files win for the same row; runs nothing",
    )  # fmt: skip
    parser.add_argument("--cpu-reps", type=int, default=5, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help="random seed of the inputs")
    parser.add_argument(
        "--strict", action="store_true", help="exit 1 when a target is missed (default: 0)"
    )


def _console():
    """rich on a terminal (when installed); None, plain text, in a pipe or a log."""
    from ._console import rich_console

    return rich_console()


def _say(console, text: str) -> None:
    if console is not None:
        console.print(text, highlight=False)
    else:
        print(text)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 on success (1 with ``--strict`` when a target is missed, 2 when
    the run cannot start: no CUDA device, bad option)."""
    console = _console()
    suite = smoke_suite() if args.cpu_smoke else full_suite()
    try:
        cases = select_cases(suite, args.cases)
        specs = [OPS_BY_KEY[k] for k in select_names(args.ops, list(OPS_BY_KEY), "ops")]
        default_impls = "mlarope,reference" if args.cpu_smoke else None
        impls = select_names(args.impls or default_impls, IMPLS, "impls")
    except ValueError as exc:
        _say(console, f"mlarope bench: {exc}")
        return 2
    if args.dry_run:
        _print_plan(console, suite, cases, specs, impls)
        return 0
    if args.merge:
        return _merge(console, args)
    if args.cpu_smoke:
        device = torch.device("cpu")
        timer: CudaTimer | CpuTimer = CpuTimer(args, device)
        copy_mib = min(args.copy_mib, 16)
    else:
        if not torch.cuda.is_available():
            _say(console, "mlarope bench: no CUDA device (use --cpu-smoke to check the harness)")
            return 2
        device = torch.device(args.device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        timer = CudaTimer(args, device)
        copy_mib = args.copy_mib
    _raise_compile_limits()

    megatron, megatron_version = (None, "not tried")
    if "megatron" in impls:
        megatron, megatron_version = import_megatron()
        if megatron is None:
            _say(console, f"[megatron] skipped: megatron.core {megatron_version}")
    results = Results(_meta(args, device, suite, timer, megatron_version))

    torch.manual_seed(args.seed)
    copy_timing, copy_bytes = timer.copy(copy_mib, suite.dtype)
    copy_tbps = copy_bytes / (copy_timing.median * 1e-3) / 1e12
    results.meta["copy"] = {
        "bytes": copy_bytes,
        "ms": [copy_timing.q20, copy_timing.median, copy_timing.q80],
        "tbps": copy_tbps,
    }
    _say(console, f"copy ceiling: {copy_bytes / 2**30:.2f} GiB moved in "
         f"{copy_timing.median * 1e3:.1f} us -> {copy_tbps:.3f} TB/s")  # fmt: skip

    try:
        results.meta["host_floor"] = timer.host_floor()
    except Exception as exc:  # informative only
        results.meta["host_floor"] = {"error": f"{type(exc).__name__}: {exc}"}

    builders = Builders(suite, args.compile_mode, megatron)
    gen = torch.Generator().manual_seed(args.seed)
    started = time.perf_counter()
    for case in cases:
        pos = make_positional(suite, case, device, gen)
        for spec in specs:
            nbytes = spec_bytes(spec, case.tokens, suite.dims)
            use_graph = case.decode and isinstance(timer, CudaTimer)
            sets = rotation_sets(nbytes, timer.l2_bytes, timer.max_graph_calls) if use_graph else 1
            inputs = make_inputs(suite, case, spec, device, sets)
            for impl in impls:
                row = Row(
                    case.key, case.label, spec.key, spec.label, spec.direction, impl,
                    case.tokens, nbytes,
                )  # fmt: skip
                t0 = time.perf_counter()
                _measure(row, builders, impl, spec, case, inputs, pos, timer, use_graph)
                row.wall_s = round(time.perf_counter() - t0, 2)
                _rate(row, copy_tbps)
                if not args.cpu_smoke:  # the targets are the GPU's
                    judge(row, spec, case)
                results.rows.append(row)
            del inputs
            if device.type == "cuda":
                torch.cuda.empty_cache()
        _say(console, f"  done {case.label} ({time.perf_counter() - started:.0f} s)")
        _write_partial(args, results)

    if device.type == "cuda":
        end_timing, _ = timer.copy(copy_mib, suite.dtype)
        results.meta["copy_end_tbps"] = copy_bytes / (end_timing.median * 1e-3) / 1e12
    if not args.cpu_smoke:
        results.checks = scaling_checks(results.rows, suite)
    results.meta["elapsed_s"] = round(time.perf_counter() - started, 1)

    _print_results(console, results, impls)
    _write_outputs(console, args, results, impls)
    missed = [r for r in results.rows if r.status == "MISS"]
    missed += [c for c in results.checks if c["status"] == "MISS"]
    return 1 if (args.strict and missed) else 0


def load_results(path: str | Path) -> Results:
    data = json.loads(Path(path).read_text())
    known = {f.name for f in dataclasses.fields(Row)}
    rows = [Row(**{k: v for k, v in r.items() if k in known}) for r in data["rows"]]
    return Results(data["meta"], rows, data.get("checks", []))


def merge_results(parts: Sequence[Results]) -> Results:
    """One result set from several runs: the first run's meta (each run's copy ceiling and
    command kept under ``runs``), rows in order, a later run's row replacing an earlier one of
    the same (case, op, impl); the thd scaling checks recomputed over the merged rows."""
    if not parts:
        raise ValueError("nothing to merge")
    meta = {k: v for k, v in parts[0].meta.items() if k != "partial"}
    meta["runs"] = [
        {k: p.meta.get(k) for k in ("date", "device", "command", "copy", "elapsed_s", "partial")}
        for p in parts
    ]
    rows: dict[tuple[str, str, str], Row] = {}
    for part in parts:
        for r in part.rows:
            rows.pop((r.case, r.op, r.impl), None)
            rows[(r.case, r.op, r.impl)] = r
    suite = smoke_suite() if meta.get("mode") == "cpu-smoke" else full_suite()
    order = {c.key: i for i, c in enumerate(suite.cases)}
    op_order = {s.key: i for i, s in enumerate(OPS)}
    merged = sorted(
        rows.values(),
        key=lambda r: (order.get(r.case, 99), op_order.get(r.op, 99), IMPLS.index(r.impl)),
    )
    checks = scaling_checks(merged, suite) if meta.get("mode") != "cpu-smoke" else []
    return Results(meta, merged, checks)


def _merge(console, args) -> int:
    try:
        results = merge_results([load_results(p) for p in args.merge])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        _say(console, f"mlarope bench --merge: {exc}")
        return 2
    impls = tuple(i for i in IMPLS if any(r.impl == i for r in results.rows))
    _print_results(console, results, impls)
    _write_outputs(console, args, results, impls)
    return 0


def _raise_compile_limits() -> None:
    """The compile baseline compiles one function per op for several shapes and position
    sources; keep dynamo from falling back to eager after its default 8 recompiles."""
    with contextlib.suppress(Exception):
        cfg = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, max(getattr(cfg, name), 256))
        for name in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, max(getattr(cfg, name), 4096))


def _measure(row, builders, impl, spec, case, inputs, pos, timer, use_graph) -> None:
    try:
        build = {
            "mlarope": builders.mlarope,
            "reference": builders.reference,
            "compile": builders.compile,
            "megatron": builders.megatron_impl,
        }[impl]
        calls = [build(spec, inp, pos) for inp in inputs]
        if use_graph:
            # Cap the captured calls by host time too, so a many-kernel eager reference does not
            # put hundreds of thousands of nodes in one graph.
            per_call_us = timer.host_us(calls[0], 20)
            cap = max(8, int(0.25e6 / max(per_call_us, 1.0)))
            t = timer.graph(calls[: min(len(calls), cap)])
        else:
            t = timer.large(calls[0])
        row.ms_q20, row.ms, row.ms_q80, row.method = t.q20, t.median, t.q80, t.method
        if case.decode and spec.direction == "fwd":
            row.host_us = timer.host_us(calls[0])
            row.host_floor_us = timer.torch_op_us()
    except Unsupported as exc:
        row.note = f"n/a: {exc}"
    except Exception as exc:  # one failing implementation must not end the run
        row.note = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        traceback.print_exc(limit=3, file=sys.stderr)
        with contextlib.suppress(Exception):
            timer.sync()


def _rate(row: Row, copy_tbps: float) -> None:
    if row.ms is None or row.ms <= 0:
        return
    row.tbps = row.bytes / (row.ms * 1e-3) / 1e12
    row.pct_copy = 100.0 * row.tbps / copy_tbps if copy_tbps > 0 else None


def judge(row: Row, spec: OpSpec, case: Case) -> None:
    """Targets apply to mlarope: bandwidth on the training shapes, host overhead on the decode
    forwards (decode kernels are launch-bound; their bandwidth is reported, not judged)."""
    if row.impl != "mlarope" or row.note:
        return
    if not case.decode:
        row.target = f">= {spec.target * 100:.0f}% copy"
        row.status = target_status(row.pct_copy, spec.target * 100)
    elif spec.direction == "fwd":
        row.target = f"host <= {HOST_TARGET_US:.0f} us"
        row.status = target_status(row.host_us, HOST_TARGET_US, higher_is_better=False)


def scaling_checks(rows: list[Row], suite: Suite) -> list[dict[str, Any]]:
    """thd with many sequences must cost no more than ``SCALING_TARGET`` x few sequences."""
    few, many = suite.scaling_pair
    by = {(r.case, r.op): r for r in rows if r.impl == "mlarope" and r.ms}
    checks = []
    for spec in OPS:
        a, b = by.get((few, spec.key)), by.get((many, spec.key))
        if a is None or b is None:
            continue
        ratio = b.ms / a.ms
        checks.append(
            {
                "name": f"{spec.label}: {many} / {few}",
                "op": spec.key,
                "value": ratio,
                "target": f"<= {SCALING_TARGET}x",
                "status": target_status(ratio, SCALING_TARGET, higher_is_better=False),
            }
        )
    return checks


def _program() -> str:
    argv0 = sys.argv[0] if sys.argv else ""
    if argv0.endswith("__main__.py"):
        return "python -m mlarope"
    if argv0.endswith("bench.py"):
        return "python -m mlarope.tools.bench"
    return Path(argv0).name


def _meta(args, device: torch.device, suite: Suite, timer, megatron_version: str) -> dict:
    import mlarope

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    backend = "triton" if device.type == "cuda" else (
        "triton interpreter" if os.environ.get("TRITON_INTERPRET", "0") == "1" else "reference"
    )  # fmt: skip
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": gpu or "cpu",
        "mode": "cpu-smoke" if args.cpu_smoke else "gpu",
        "mlarope": mlarope.__version__,
        "mlarope_backend": backend,
        "torch": torch.__version__,
        "triton": triton_version,
        "megatron_core": megatron_version,
        "python": platform.python_version(),
        "command": " ".join([_program(), *sys.argv[1:]]),
        "dims": dataclasses.asdict(suite.dims),
        "dtype": str(suite.dtype).removeprefix("torch."),
        "max_positions": suite.max_positions,
        "l2_bytes": timer.l2_bytes,
        "quantiles": list(QUANTILES),
        "warmup_ms": args.warmup_ms,
        "rep_ms": args.rep_ms,
        "compile_mode": args.compile_mode,
        "targets": {
            "bandwidth": {s.key: s.target for s in OPS},
            "host_us": HOST_TARGET_US,
            "thd_scaling": SCALING_TARGET,
        },
    }


# ============================================================================ reports
def _fmt_ms(ms: float | None) -> str:
    return "-" if ms is None else f"{ms * 1e3:.1f}"


def _pivot(results: Results, impls: Sequence[str]):
    """Rows keyed by (case, op) in run order, each with the row of every implementation."""
    table: dict[tuple[str, str], dict[str, Row]] = {}
    for r in results.rows:
        table.setdefault((r.case, r.op), {})[r.impl] = r
    return table


def _cell(r: Row | None) -> str:
    if r is None:
        return "-"
    if r.ms is None:
        return r.note.split(":")[0] if r.note else "-"
    pct = f" ({r.pct_copy:.0f}%)" if r.pct_copy is not None else ""
    return f"{_fmt_ms(r.ms)}{pct}"


def _print_plan(console, suite: Suite, cases, specs, impls) -> None:
    _say(console, f"dims {dataclasses.asdict(suite.dims)}, dtype {suite.dtype}, impls {impls}")
    for case in cases:
        for spec in specs:
            nbytes = spec_bytes(spec, case.tokens, suite.dims)
            _say(console, f"{case.key:10s} {spec.key:18s} tokens {case.tokens:6d} "
                 f"bytes {nbytes:>13,d}")  # fmt: skip


def _print_results(console, results: Results, impls: Sequence[str]) -> None:
    pivot = _pivot(results, impls)
    header = ["case", "op", "MB", "mlarope us [q20-q80]", "TB/s", "% copy"]
    header += [f"{i} us (%)" for i in impls if i != "mlarope"]
    header += ["host us (torch op)", "target", "status"]
    lines = []
    for (_case, _op), by_impl in pivot.items():
        any_row = next(iter(by_impl.values()))
        ours = by_impl.get("mlarope")
        if ours is not None and ours.ms is not None:
            ours_cell = f"{_fmt_ms(ours.ms)} [{_fmt_ms(ours.ms_q20)}-{_fmt_ms(ours.ms_q80)}]"
            tbps = f"{ours.tbps:.2f}" if ours.tbps is not None else "-"
            pct = f"{ours.pct_copy:.1f}" if ours.pct_copy is not None else "-"
        else:
            ours_cell, tbps, pct = (_cell(ours), "-", "-")
        host = [_host_cell(r) for r in by_impl.values() if r.impl == "mlarope" and r.host_us]
        line = [any_row.case_label, any_row.op_label, f"{any_row.bytes / 1e6:.2f}", ours_cell,
                tbps, pct]  # fmt: skip
        line += [_cell(by_impl.get(i)) for i in impls if i != "mlarope"]
        line += [host[0] if host else "-"]
        line += [ours.target if ours else "", ours.status if ours else ""]
        lines.append(line)
    copy = results.meta.get("copy", {})
    title = (
        f"mlarope bench on {results.meta['device']} (copy {copy.get('tbps', 0):.3f} TB/s; "
        f"times in us, medians; (%) = % of copy)"
    )
    if console is not None:
        from rich.table import Table

        table = Table(title=title)
        for h in header:
            table.add_column(h, justify="left" if h in ("case", "op", "target") else "right")
        previous = None
        for line in lines:
            if previous is not None and line[0] != previous:
                table.add_section()
            previous = line[0]
            status = line[-1]
            color = {"PASS": "green", "MISS": "red"}.get(status)
            line = [*line[:-1], f"[{color}]{status}[/{color}]" if color else status]
            table.add_row(*line)
        console.print(table)
    else:
        print(title)
        print(" | ".join(header))
        for line in lines:
            print(" | ".join(line))
    floor = results.meta.get("host_floor") or {}
    if floor and "error" not in floor:
        parts = ", ".join(f"{k.removesuffix('_us')} {v:.1f} us" for k, v in floor.items())
        _say(console, f"host floor per call (no work): {parts}")
    for c in results.checks:
        _say(console, f"thd scaling {c['name']}: {c['value']:.3f}x (target {c['target']}) "
             f"{c['status']}")  # fmt: skip
    notes = sorted({f"{r.impl}: {r.note}" for r in results.rows if r.note.startswith("error")})
    for n in notes:
        _say(console, f"error {n}")
    if results.meta.get("mode") == "cpu-smoke":
        _say(console, "targets: not judged (--cpu-smoke: the targets are the GPU's)")
        return
    statuses = [r.status for r in results.rows] + [c["status"] for c in results.checks]
    _say(console, f"targets: {statuses.count('PASS')} PASS, {statuses.count('MISS')} MISS")


def _host_cell(row: Row) -> str:
    """``16.7 (6.6)``: the op's host time per call, and in brackets a one-element torch op's,
    measured right after it."""
    floor = f" ({row.host_floor_us:.1f})" if row.host_floor_us is not None else ""
    return f"{row.host_us:.1f}{floor}"


def markdown_table(results: Results, impls: Sequence[str]) -> str:
    """The results as a Markdown table (medians in us, % of copy), for docs/benchmarks.md."""
    pivot = _pivot(results, impls)
    head = [
        "case",
        "op",
        "MB",
        *[f"{i} us (% copy)" for i in impls],
        "host us (torch op)",
        "target",
        "status",
    ]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for by_impl in pivot.values():
        any_row = next(iter(by_impl.values()))
        ours = by_impl.get("mlarope")
        host = _host_cell(ours) if ours is not None and ours.host_us else ""
        cells = [any_row.case_label, any_row.op_label, f"{any_row.bytes / 1e6:.2f}"]
        cells += [_cell(by_impl.get(i)) for i in impls]
        cells += [host, ours.target if ours else "", ours.status if ours else ""]
        out.append("| " + " | ".join(cells) + " |")
    for c in results.checks:
        out.append(f"\nthd scaling, {c['name']}: {c['value']:.3f}x ({c['target']}) {c['status']}")
    return "\n".join(out) + "\n"


def write_plot(results: Results, impls: Sequence[str], path: str | Path) -> None:
    """Bar chart: % of the copy bandwidth per case (x) and implementation (bars), one panel
    per op."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [s for s in OPS if any(r.op == s.key for r in results.rows)]
    cases: list[tuple[str, str]] = []
    for r in results.rows:
        if (r.case, r.case_label) not in cases:
            cases.append((r.case, r.case_label))
    cols = 2
    nrows = max(1, math.ceil(len(ops) / cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(7.5 * cols, 3.2 * nrows), squeeze=False)
    width = 0.8 / max(1, len(impls))
    by = {(r.case, r.op, r.impl): r for r in results.rows}
    for ax, spec in zip(axes.flat, ops, strict=False):
        for i, impl in enumerate(impls):
            values = []
            for key, _ in cases:
                r = by.get((key, spec.key, impl))
                values.append(r.pct_copy if r is not None and r.pct_copy is not None else 0.0)
            xs = [j + (i - (len(impls) - 1) / 2) * width for j in range(len(cases))]
            ax.bar(xs, values, width, label=impl)
        ax.axhline(100.0, color="black", linewidth=0.8)
        ax.axhline(spec.target * 100, color="red", linewidth=0.8, linestyle="--")
        ax.set_title(spec.label)
        ax.set_ylabel("% of copy")
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels([label for _, label in cases], rotation=30, ha="right", fontsize=7)
        top = max([110.0] + [r.pct_copy or 0.0 for r in results.rows if r.op == spec.key])
        ax.set_ylim(0, top * 1.05)
    for ax in list(axes.flat)[len(ops) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    copy = results.meta.get("copy", {}).get("tbps", 0.0)
    fig.legend(handles, labels, loc="upper right", ncol=len(impls))
    fig.suptitle(f"mlarope bench, {results.meta['device']}: % of copy ({copy:.2f} TB/s)")
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _output_paths(args) -> dict[str, Path]:
    paths: dict[str, Path] = {}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"json": out / "bench.json", "plot": out / "bench.png", "md": out / "bench.md"}
    if args.json:
        paths["json"] = Path(args.json)
    if args.plot:
        paths["plot"] = Path(args.plot)
    return paths


def _write_partial(args, results: Results) -> None:
    """The JSON so far, after each case, so that a run cut short still leaves its numbers."""
    path = _output_paths(args).get("json")
    if path is not None:
        partial = results.to_json()
        partial["meta"] = {**partial["meta"], "partial": True}
        path.write_text(json.dumps(partial, indent=1) + "\n")


def _write_outputs(console, args, results: Results, impls: Sequence[str]) -> None:
    paths = _output_paths(args)
    if "json" in paths:
        paths["json"].write_text(json.dumps(results.to_json(), indent=1) + "\n")
    if "md" in paths:
        paths["md"].write_text(markdown_table(results, impls))
    if "plot" in paths:
        try:
            write_plot(results, impls, paths["plot"])
        except ImportError as exc:
            _say(console, f"plot skipped: {exc}")
            del paths["plot"]
    for kind, p in paths.items():
        _say(console, f"wrote {kind}: {p}")


def main(argv: list[str] | None = None) -> int:
    """``python -m mlarope.tools.bench`` (the same as ``python -m mlarope bench``)."""
    parser = argparse.ArgumentParser(prog="python -m mlarope bench", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
