"""Which modules a call's host path walks through, in order: entries and climbs, on the CPU.

    PYTHONPATH=src python -m benchmarks.host_path_trace [--verbose]

Each case is called three times under ``sys.setprofile``: a first call through the pipeline,
a second (which, with autograd, records its backward's launches) and a replayed call, which
finds the first one's launch plan (reported: the first and the third). An *entry* is a Python
call from one module of the package into another; a layer (``LAYERS``, the order the host
path should read in, docs/architecture.md) is *entered* by an entry from another layer (leaf
modules, which every layer may use, are not layers); a *climb* is an entry into a layer above
the caller's. Kernel bodies run by Triton's interpreter are left out (on a GPU they are not
host code), and so are module imports (once per process). The counts measure "each module
entered once, nothing back up" (docs/perf_log.md v18).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported

import torch

import mlarope

# Top to bottom; a module not listed (a leaf such as positions or _launch_cache) is not ranked.
LAYERS = ("api", "_plans", "_pipeline", "_checks", "autograd", "ops", "_launch_plans", "kernels")


def _rank(module: str) -> int | None:
    name = module.removeprefix("mlarope.")
    for i, layer in enumerate(LAYERS):
        if name == layer or name.startswith(layer + "."):
            return i
    return None


def trace(call) -> list[tuple[str, str, str]]:
    """``(caller module, callee module, callee function)`` of every entry ``call()`` makes."""
    entries = []

    def profile(frame, event, _arg):
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("mlarope"):
            return
        caller, back = None, frame.f_back
        while back is not None:
            name = back.f_globals.get("__name__", "")
            if name.startswith("triton.runtime.interpreter"):
                return  # a kernel body under the interpreter
            if caller is None and name.startswith("mlarope"):
                caller = name
            back = back.f_back
        function = frame.f_code.co_name
        if caller is not None and caller != module and function != "<module>":
            entries.append((caller, module, function))

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return entries


def layer(module: str) -> str | None:
    """The layer of ``LAYERS`` a module belongs to (``kernels`` for all of ``kernels/``), or
    None for a leaf (data and predicates every layer may use: ``_records``, ``_modes``,
    ``positions``, ``_memory``, ``_launch_cache``)."""
    rank = _rank(module)
    return None if rank is None else LAYERS[rank]


def layer_entries(entries) -> list[tuple[str, str, str]]:
    """The entries from one layer into another (or from the caller into ``api``), leaves left
    out: what "each layer entered once" counts."""
    return [
        (caller, callee, function)
        for caller, callee, function in entries
        if layer(callee) is not None and layer(caller) != layer(callee)
    ]


def climbs(entries) -> list[tuple[str, str, str]]:
    out = []
    for caller, callee, function in entries:
        a, b = _rank(caller), _rank(callee)
        if a is not None and b is not None and b < a:
            out.append((caller, callee, function))
    return out


def cases() -> dict:
    torch.manual_seed(0)
    cos, sin = mlarope.YarnConfig.deepseek_v3().cos_sin(64)
    x = torch.randn(4 * 2 * 192, requires_grad=True)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    return {
        "apply_rope_q sbhd": lambda: mlarope.apply_rope_q(torch.randn(4, 1, 2, 192), cos, sin),
        "apply_rope_q thd cu_seqlens": lambda: mlarope.apply_rope_q(
            torch.randn(4, 2, 192), cos, sin, layout="thd", cu_seqlens=cu),
        "apply_rope_q in place, grad": lambda: mlarope.apply_rope_q(
            (x * 1).view(4, 1, 2, 192), cos, sin, inplace=True).sum().backward(),
        "apply_rope_kv": lambda: mlarope.apply_rope_kv(
            torch.randn(4, 1, 2, 256), torch.randn(4, 1, 64), cos, sin, k_dim=128),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="print every entry")
    args = parser.parse_args(argv)
    short = lambda m: m.removeprefix("mlarope.")
    print("| call | which | module entries | layers entered | entered more than once | climbs |")
    print("|---|---|---|---|---|---|")
    for name, call in cases().items():
        for which in ("first", "second", "replayed"):
            entries = trace(call)
            if which == "second":  # a call that needs autograd records its backward's plan
                continue
            counts = Counter(layer(callee) for _, callee, _ in layer_entries(entries))
            again = ", ".join(f"{m} {n}x" for m, n in counts.most_common() if n > 1) or "-"
            up = climbs(entries)
            print(f"| {name} | {which} | {len(entries)} | {len(counts)} | {again} | {len(up)} |")
            if args.verbose:
                for caller, callee, function in entries:
                    mark = "  ^" if (caller, callee, function) in up else ""
                    print(f"    {short(caller)} -> {short(callee)}.{function}{mark}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
