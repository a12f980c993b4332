"""Where the benchmark's decode host times spread (GPU lane; docs/benchmarks.md, host overhead).

For each decode case and forward op, the benchmark's own inputs (as many rotated input sets as
it makes) and callables, timed with its host loop (5 loops of 1,000 calls, every loop shown):

- ``fresh``: before any CUDA-graph timing of the case;
- ``after graph``: after ``CudaTimer.graph`` captured and replayed the calls, as the benchmark
  does before it measures host time;
- ``gc off``: the same with Python's cyclic garbage collector disabled;
- ``gc frozen``: collector on, every existing object moved out of its reach (``gc.freeze()``);
- ``empty x2``: the two ``torch.empty`` of the key/value outputs alone.

    PYTHONPATH=src python3 benchmarks/host_variance.py
"""

from __future__ import annotations

import argparse
import gc
import statistics

import torch

from mlarope.tools import bench
from mlarope.tools.bench.cases import full_suite, make_inputs, make_positional, rotation_sets
from mlarope.tools.bench.impls import Builders
from mlarope.tools.bench.model import OPS_BY_KEY, spec_bytes
from mlarope.tools.bench.timers import CudaTimer, host_loops


def loops(fn, sync) -> list[float]:
    return host_loops(fn, sync, calls=1000, repeats=5)


def show(label: str, values: list[float]) -> None:
    spread = " ".join(f"{v:5.1f}" for v in values)
    print(f"  {label:12s} median {statistics.median(values):5.1f}  loops {spread}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args([])
    device = torch.device("cuda")
    timer = CudaTimer(args, device)
    suite = full_suite()
    builders = Builders(suite, "default", None)
    gen = torch.Generator().manual_seed(0)
    sync = timer.sync
    print(f"host floor: {timer.host_floor()}")
    for case in (c for c in suite.cases if c.decode):
        pos = make_positional(suite, case, device, gen)
        for key in ("q_inplace_fwd", "q_fwd", "kv_fwd", "kv_fwd_no_copy_v"):
            spec = OPS_BY_KEY[key]
            nbytes = spec_bytes(spec, case.tokens, suite.dims)
            sets = rotation_sets(nbytes, timer.l2_bytes, timer.max_graph_calls)
            inputs = make_inputs(suite, case, spec, device, sets)
            calls = [builders.mlarope(spec, inp, pos) for inp in inputs]
            print(f"{case.key} {key} ({sets} input sets)", flush=True)
            show("fresh", loops(calls[0], sync))
            per_call_us = timer.host_us(calls[0], 20)
            cap = max(8, int(0.25e6 / max(per_call_us, 1.0)))
            timer.graph(calls[: min(len(calls), cap)])
            show("after graph", loops(calls[0], sync))
            gc.disable()
            show("gc off", loops(calls[0], sync))
            gc.enable()
            gc.freeze()
            show("gc frozen", loops(calls[0], sync))
            gc.unfreeze()
            if key == "kv_fwd":
                d = suite.dims
                k_shape = (*case.token_shape, d.heads, d.k_dim + d.rope)
                v_shape = (*case.token_shape, d.heads, d.v_dim)
                kw = dict(dtype=suite.dtype, device=device)

                def empties(k_shape=k_shape, v_shape=v_shape, kw=kw):
                    return torch.empty(k_shape, **kw), torch.empty(v_shape, **kw)

                show("empty x2", loops(empties, sync))
            del calls, inputs


if __name__ == "__main__":
    main()
