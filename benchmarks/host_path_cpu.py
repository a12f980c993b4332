"""The Python host path of a repeated eager decode call, on the CPU (no GPU needed).

    PYTHONPATH=src python benchmarks/host_path_cpu.py

One decode token at DeepSeek-V3 shapes on CPU tensors under Triton's interpreter: each call is
made twice for real (the second records its launch plan), then the recorded launch is replaced
by a no-op and the plan path (signature, lookup, guard, allocation) is timed, best of 15 loops
of 2,000 calls. A proxy for the host time of the same calls on a GPU machine, minus the launch
itself: compare two versions by pointing PYTHONPATH at each (docs/perf_log.md, v12).
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
    for call in calls.values():
        call()
        call()
    _launch.Launch.__call__ = lambda self, args: None
    print(f"mlarope from {os.path.dirname(mlarope.__file__)}")
    for name, call in calls.items():
        for _ in range(200):
            call()
        gc.collect()
        loops = []
        for _ in range(15):
            t0 = time.perf_counter()
            for _ in range(2000):
                call()
            loops.append((time.perf_counter() - t0) / 2000 * 1e6)
        print(f"{name:28s} {min(loops):6.2f} us")


if __name__ == "__main__":
    main()
