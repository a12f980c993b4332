"""The Python host path of a repeated eager decode call, on the CPU (no GPU needed).

    PYTHONPATH=src python benchmarks/host_path_cpu.py

One decode token at DeepSeek-V3 shapes on CPU tensors under Triton's interpreter: each call is
made twice for real (the second records its launch plan), then the recorded launch is replaced
by a no-op and the plan path (signature, lookup, guard, allocation) is timed, best of 15 loops
of 2,000 calls. A proxy for the host time of the same calls on a GPU machine, minus the launch
itself: compare two versions by pointing PYTHONPATH at each (docs/perf_log.md, v12). The last
four rows are an in-place query call with gradients (forward, and forward + backward), on a
view of a projection's output and on a query that is its own tensor (v15); the three before
them are thd calls with ``cu_seqlens`` (v18): one query call without gradients, and
Megatron-Core's pair of calls (the query in place on a view, the key/value op) with gradients.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

import torch

import mlarope
from mlarope.kernels import _launch


def main() -> None:
    argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Compare two versions by pointing PYTHONPATH at each one's src/.",
    ).parse_args()
    torch.manual_seed(0)
    cos, sin = mlarope.YarnConfig.deepseek_v3().cos_sin(64)
    q = torch.randn(1, 128, 192)
    kv = torch.randn(1, 128, 256)
    k_pe = torch.randn(1, 64)
    ids = torch.tensor([5])
    thd = dict(layout="thd", position_ids=ids)
    calls = {
        "apply_rope_q inplace": lambda: mlarope.apply_rope_q(q, cos, sin, inplace=True, **thd),
        "apply_rope_q": lambda: mlarope.apply_rope_q(q, cos, sin, **thd),
        "apply_rope_kv": lambda: mlarope.apply_rope_kv(kv, k_pe, cos, sin, k_dim=128, **thd),
        "apply_rope_kv copy_v=False": lambda: mlarope.apply_rope_kv(
            kv, k_pe, cos, sin, k_dim=128, copy_v=False, **thd
        ),
    }
    # With gradients: Megatron-Core's in-place query, a view of a projection's output
    # (docs/perf_log.md v15), forward alone and forward + backward, against a query that is its
    # own tensor.
    x = torch.randn(1, 128 * 192, requires_grad=True)
    g = torch.randn(1, 128, 192)

    def with_grad(own: bool, backward: bool):
        q = (x * 1.0).view(1, 128, 192)
        out = mlarope.apply_rope_q(q.clone() if own else q, cos, sin, inplace=True, **thd)
        if backward:
            out.backward(g)

    # Megatron-Core's thd batches: cu_seqlens (a search launch, then the rotation), the query
    # in place on a view of the projection with gradients, the key/value op (perf_log v18).
    cu = torch.tensor([0, 1], dtype=torch.int32)
    k_pe_leaf = torch.randn(1, 1, 64, requires_grad=True)

    def thd_grad(backward: bool):
        q = (x * 1.0).view(1, 128, 192)
        out = mlarope.apply_rope_q(q, cos, sin, inplace=True, layout="thd", cu_seqlens=cu)
        k, v = mlarope.apply_rope_kv(kv_leaf * 1.0, k_pe_leaf, cos, sin, k_dim=128,
                                     layout="thd", cu_seqlens=cu)  # fmt: skip
        if backward:
            torch.autograd.backward((out, k, v), (g, gk, gv))

    kv_leaf = torch.randn(1, 128, 256, requires_grad=True)
    gk, gv = torch.randn(1, 128, 192), torch.randn(1, 128, 128)
    calls.update({
        "apply_rope_q thd cu_seqlens": lambda: mlarope.apply_rope_q(
            q, cos, sin, layout="thd", cu_seqlens=cu),
        "thd cu q inpl+kv grad fwd": lambda: thd_grad(False),
        "thd cu q inpl+kv grad fwd+bwd": lambda: thd_grad(True),
        "q inplace grad, view": lambda: with_grad(False, False),
        "q inplace grad, own tensor": lambda: with_grad(True, False),
        "q inplace fwd+bwd, view": lambda: with_grad(False, True),
        "q inplace fwd+bwd, own tensor": lambda: with_grad(True, True),
    })  # fmt: skip
    for call in calls.values():
        call()
        call()
    _launch.Launch.__call__ = lambda self, args: None
    # A call that takes the pipeline (no plan) launches through a DirectLauncher: noted for a
    # recording as before, not run, so that such rows time the host path too.
    _launch.DirectLauncher.__call__ = _noted_not_launched
    print(f"mlarope from {os.path.dirname(mlarope.__file__)}")
    for name, call in calls.items():
        for _ in range(200):
            call()
        gc.collect()
        loops = []
        n = 300 if "grad" in name or "bwd" in name else 2000
        for _ in range(15):
            t0 = time.perf_counter()
            for _ in range(n):
                call()
            loops.append((time.perf_counter() - t0) / n * 1e6)
        print(f"{name:30s} {min(loops):7.2f} us")


def _noted_not_launched(self, grid, num_warps, *args) -> None:
    recorded = _launch._recording.launches
    if recorded is not None:
        recorded.append((_launch.Launch(self, grid, num_warps, None, -1), args))


if __name__ == "__main__":
    main()
