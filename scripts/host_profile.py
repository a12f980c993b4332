"""Where the host time of one eager decode call goes (GPU lane; docs/benchmarks.md).

    PYTHONPATH=src python3 scripts/host_profile.py

Prints the wall-clock per call of the public API and of the launchers alone (checks and
allocations skipped; what remains is our argument plumbing plus Triton's launch), for one
decode token at DeepSeek-V3 shapes, with a one-element torch op as the floor, then cProfile's
top entries for the query op in place and the key/value op.
"""

from __future__ import annotations

import cProfile
import pstats
import time

import torch

import mlarope
from mlarope._checks import Positions
from mlarope.kernels.kv import rope_kv_launch
from mlarope.kernels.q import rope_q_launch


def per_call_us(fn, calls: int = 2000) -> float:
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    dev = "cuda"
    cos, sin = mlarope.YarnConfig.deepseek_v3().cos_sin(4096, device=dev)
    q = torch.randn(1, 128, 192, dtype=torch.bfloat16, device=dev)
    kv = torch.randn(1, 128, 256, dtype=torch.bfloat16, device=dev)
    k_pe = torch.randn(1, 64, dtype=torch.bfloat16, device=dev)
    k = torch.empty(1, 128, 192, dtype=torch.bfloat16, device=dev)
    v = torch.empty(1, 128, 128, dtype=torch.bfloat16, device=dev)
    ids = torch.randint(0, 4096, (1,), device=dev)
    pos = Positions("thd", None, ids, 0, 1)
    flags = dict(interleaved_in=True, interleaved_out=False)
    calls = {
        "apply_rope_q inplace": lambda: mlarope.apply_rope_q(
            q, cos, sin, layout="thd", position_ids=ids, inplace=True
        ),
        "apply_rope_q": lambda: mlarope.apply_rope_q(q, cos, sin, layout="thd", position_ids=ids),
        "apply_rope_kv": lambda: mlarope.apply_rope_kv(
            kv, k_pe, cos, sin, k_dim=128, layout="thd", position_ids=ids
        ),
        "apply_rope_kv copy_v=False": lambda: mlarope.apply_rope_kv(
            kv, k_pe, cos, sin, k_dim=128, layout="thd", position_ids=ids, copy_v=False
        ),
        "rope_q_launch (no checks)": lambda: rope_q_launch(
            q, q, cos, sin, pos, inverse=False, transpose=False, **flags
        ),
        "rope_kv_launch (no checks)": lambda: rope_kv_launch(
            kv, k_pe, k, v, cos, sin, pos, k_dim=128, **flags
        ),
        "torch.add_ (floor)": lambda: q.add_(0),
    }
    for name, fn in calls.items():
        print(f"{name:32s} {per_call_us(fn):7.1f} us", flush=True)
    for name in ("apply_rope_q inplace", "apply_rope_kv"):
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(2000):
            calls[name]()
        profile.disable()
        print(f"--- {name}: cProfile, 2000 calls")
        pstats.Stats(profile).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
