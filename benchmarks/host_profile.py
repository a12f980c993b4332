"""Where the host time of one eager decode call goes (GPU lane; docs/benchmarks.md).

    PYTHONPATH=src python3 benchmarks/host_profile.py [--by-size]

Prints the wall-clock per call, in a loop with one sync at the end, of: the public API for one
decode token at DeepSeek-V3 shapes (repeated calls: the launch-plan path, mlarope._plans); the
launchers alone (the pipeline without checks and allocations); the pieces of a call (checks,
an allocation, the direct launcher's key, the plan key, a plan's launch); the host floor (a
one-element torch op, an empty Triton kernel through Triton and through our launcher); then
cProfile's top entries for two public calls. ``--by-size``: the key/value op per decode size
beside the allocations it makes.
"""

from __future__ import annotations

import cProfile
import pstats

import torch
import triton
import triton.language as tl

import mlarope
from mlarope import _checks, _plans
from mlarope.kernels._launch import DirectLauncher, recording
from mlarope.kernels.kv import rope_kv_launch
from mlarope.kernels.q import rope_q_launch
from mlarope.positions import Positions
from mlarope.tools.bench.timers import host_us_per_call


@triton.jit
def _empty(x_ptr, BLOCK: tl.constexpr):
    pass


def per_call_us(fn, calls: int = 1000, repeats: int = 5) -> float:
    """The benchmark's host measurement (``host_us_per_call`` of ``mlarope.tools.bench.timers``),
    warmed up with 200 calls."""
    return host_us_per_call(fn, torch.cuda.synchronize, calls, repeats, warmup=200)


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
    x = torch.zeros(1, device=dev)
    empty_direct = DirectLauncher(_empty)
    rope_q_launch(q, q, cos, sin, pos, inverse=False, transpose=False, **flags)
    # The query kernel's launcher and arguments, for timing its launch key alone: recording()
    # returns every launch this thread makes through a DirectLauncher (with position_ids, one).
    # The key function and the backend it takes have no public name: they are what is timed.
    with recording() as launches:
        rope_q_launch(q, q, cos, sin, pos, inverse=False, transpose=False, **flags)
    ((q_launch, q_args),) = launches
    q_key_args = (q_launch.num_warps, *q_args)
    key = q_launch.launcher._key
    backend = q_launch.launcher._backend
    mlarope.apply_rope_q(q, cos, sin, layout="thd", position_ids=ids, inplace=True)
    q_signature = _plans.query_signature(
        q, cos, sin, "thd", None, ids, 0, 1, True, False, False, True, False, False
    )
    q_plan = _plans._entry(q_signature)
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
        "check_q_call": lambda: _checks.check_q_call(
            q, cos, sin, "thd", None, ids, 0, 1, True, False, False
        ),
        "check_kv_call": lambda: _checks.check_kv_call(
            kv, k_pe, cos, sin, 128, "thd", None, ids, 0, 1, True, False
        ),
        "q launch key (direct launcher)": lambda: key(backend, 0, *q_key_args),
        "q plan signature (query_signature)": lambda: _plans.query_signature(
            q, cos, sin, "thd", None, ids, 0, 1, True, False, False, True, False, False
        ),
        "q plan lookup (_entry: dict + guard)": lambda: _plans._entry(q_signature),
        "q plan, in place (launch only)": lambda: q_plan((q, cos, sin, ids)),
        "torch.empty [1, 128, 192]": lambda: torch.empty(
            (1, 128, 192), dtype=torch.bfloat16, device=dev
        ),
        "torch.Tensor.add_ (floor)": lambda: x.add_(0),
        "empty Triton kernel, Triton path": lambda: _empty[(1,)](x, 16),
        "empty Triton kernel, direct": lambda: empty_direct((1,), 4, x, 16),
    }
    for name, fn in calls.items():
        print(f"{name:34s} {per_call_us(fn):7.2f} us", flush=True)
    for name in ("apply_rope_q inplace", "apply_rope_kv"):
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(2000):
            calls[name]()
        profile.disable()
        print(f"--- {name}: cProfile, 2000 calls")
        pstats.Stats(profile).sort_stats("tottime").print_stats(22)


def kv_calls(t: int, cos: torch.Tensor, sin: torch.Tensor) -> dict:
    """The key/value op at ``t`` decode tokens and the allocations it makes."""
    kv = torch.randn(t, 128, 256, dtype=torch.bfloat16, device=cos.device)
    k_pe = torch.randn(t, 1, 64, dtype=torch.bfloat16, device=cos.device)
    ids = torch.randint(0, 4096, (t,), device=cos.device)
    where = dict(k_dim=128, layout="thd", position_ids=ids)
    return {
        "apply_rope_kv": lambda: mlarope.apply_rope_kv(kv, k_pe, cos, sin, **where),
        "copy_v=False": lambda: mlarope.apply_rope_kv(kv, k_pe, cos, sin, copy_v=False, **where),
        "empty k": lambda: kv.new_empty((t, 128, 192)),
        "empty k, v": lambda: (kv.new_empty((t, 128, 192)), kv.new_empty((t, 128, 128))),
    }


def by_size() -> None:
    """The key/value op's host time per decode size, beside the two allocations it makes."""
    cos, sin = mlarope.YarnConfig.deepseek_v3().cos_sin(4096, device="cuda")
    for t in (1, 8, 64, 256):
        cells = ", ".join(f"{k} {per_call_us(fn):.1f}" for k, fn in kv_calls(t, cos, sin).items())
        print(f"decode {t}: {cells} (us)", flush=True)


if __name__ == "__main__":
    import sys

    by_size() if "--by-size" in sys.argv else main()
