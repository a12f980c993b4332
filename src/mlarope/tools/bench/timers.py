"""How the benchmark times a call: on the GPU, ``do_bench`` with L2 flushes for large data,
CUDA-graph replay over rotated input sets for the decode sizes, and the eager host time per
call; on the CPU (``--cpu-smoke``), host timers."""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

QUANTILES = (0.2, 0.5, 0.8)
HOST_REPEATS = 5  # host-overhead loops per measurement; the median is reported
DEFAULT_L2_BYTES = 50 * 2**20


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

    def large_graphed(self, fn: Callable[[], object]) -> Timing:
        """``large`` of one call captured in a CUDA graph: the L2 flushed before each replay,
        the call's host time left out (a launch that takes longer on the host than the flush
        takes on the GPU would otherwise be timed with its host time)."""
        g = self._capture([fn])
        timing = self.large(g.replay)
        del g
        return Timing(timing.q20, timing.median, timing.q80, "do_bench, graph")

    def _capture(self, calls: Sequence[Callable[[], object]]) -> torch.cuda.CUDAGraph:
        """``calls`` run twice each on a side stream (compiles, plans), then captured in one
        CUDA graph, replayed once."""
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
        return g

    def graph(self, calls: Sequence[Callable[[], object]]) -> Timing:
        """Capture ``calls`` (one per input set) in one CUDA graph; time its replays."""
        g = self._capture(calls)
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

    def large_graphed(self, fn: Callable[[], object]) -> Timing:
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
