"""The command: its options, the run (every case x op x implementation, measured and judged),
and ``--merge``. The package's docstring is its ``--help`` description."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import os
import platform
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

import torch

import mlarope

from .._console import rich_console
from .cases import (
    Suite,
    full_suite,
    make_inputs,
    make_positional,
    rotation_sets,
    select_cases,
    smoke_suite,
)
from .impls import IMPLS, Builders, Unsupported, import_megatron, raise_compile_limits
from .model import HOST_TARGET_US, OPS, OPS_BY_KEY, SCALING_TARGET, spec_bytes
from .report import (
    Results,
    Row,
    judge,
    load_results,
    merge_results,
    print_plan,
    print_results,
    say,
    scaling_checks,
    write_outputs,
    write_partial,
)
from .timers import QUANTILES, CpuTimer, CudaTimer


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


def select_names(spec: str | None, choices: Sequence[str], what: str) -> tuple[str, ...]:
    if not spec:
        return tuple(choices)
    words = [w.strip() for w in spec.split(",") if w.strip()]
    for w in words:
        if w not in choices:
            raise ValueError(f"--{what}: unknown {w!r}; expected a comma list of {list(choices)}")
    return tuple(c for c in choices if c in words)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 on success (1 with ``--strict`` when a target is missed, 2 when
    the run cannot start: no CUDA device, bad option)."""
    console = rich_console()
    suite = smoke_suite() if args.cpu_smoke else full_suite()
    try:
        cases = select_cases(suite, args.cases)
        specs = [OPS_BY_KEY[k] for k in select_names(args.ops, list(OPS_BY_KEY), "ops")]
        default_impls = "mlarope,reference" if args.cpu_smoke else None
        impls = select_names(args.impls or default_impls, IMPLS, "impls")
    except ValueError as exc:
        say(console, f"mlarope bench: {exc}")
        return 2
    if args.dry_run:
        print_plan(console, suite, cases, specs, impls)
        return 0
    if args.merge:
        return _merge(console, args)
    if args.cpu_smoke:
        device = torch.device("cpu")
        timer: CudaTimer | CpuTimer = CpuTimer(args, device)
        copy_mib = min(args.copy_mib, 16)
    else:
        if not torch.cuda.is_available():
            say(console, "mlarope bench: no CUDA device (use --cpu-smoke to check the harness)")
            return 2
        device = torch.device(args.device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        timer = CudaTimer(args, device)
        copy_mib = args.copy_mib
    raise_compile_limits()

    megatron, megatron_version = (None, "not tried")
    if "megatron" in impls:
        megatron, megatron_version = import_megatron()
        if megatron is None:
            say(console, f"[megatron] skipped: megatron.core {megatron_version}")
    results = Results(_meta(args, device, suite, timer, megatron_version))

    torch.manual_seed(args.seed)
    copy_timing, copy_bytes = timer.copy(copy_mib, suite.dtype)
    copy_tbps = copy_bytes / (copy_timing.median * 1e-3) / 1e12
    results.meta["copy"] = {
        "bytes": copy_bytes,
        "ms": [copy_timing.q20, copy_timing.median, copy_timing.q80],
        "tbps": copy_tbps,
    }
    say(console, f"copy ceiling: {copy_bytes / 2**30:.2f} GiB moved in "
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
        say(console, f"  done {case.label} ({time.perf_counter() - started:.0f} s)")
        write_partial(args, results)

    if device.type == "cuda":
        end_timing, _ = timer.copy(copy_mib, suite.dtype)
        results.meta["copy_end_tbps"] = copy_bytes / (end_timing.median * 1e-3) / 1e12
    if not args.cpu_smoke:
        results.checks = scaling_checks(results.rows, suite)
    results.meta["elapsed_s"] = round(time.perf_counter() - started, 1)

    print_results(console, results, impls)
    write_outputs(console, args, results, impls)
    missed = [r for r in results.rows if r.status == "MISS"]
    missed += [c for c in results.checks if c["status"] == "MISS"]
    return 1 if (args.strict and missed) else 0


def _merge(console, args) -> int:
    try:
        results = merge_results([load_results(p) for p in args.merge])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        say(console, f"mlarope bench --merge: {exc}")
        return 2
    impls = tuple(i for i in IMPLS if any(r.impl == i for r in results.rows))
    print_results(console, results, impls)
    write_outputs(console, args, results, impls)
    return 0


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


def _program() -> str:
    argv0 = sys.argv[0] if sys.argv else ""
    if argv0.endswith(os.path.join("bench", "__main__.py")):
        return "python -m mlarope.tools.bench"
    if argv0.endswith("__main__.py"):
        return "python -m mlarope"
    return Path(argv0).name


def _meta(args, device: torch.device, suite: Suite, timer, megatron_version: str) -> dict:
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


def main(argv: list[str] | None = None) -> int:
    """``python -m mlarope.tools.bench`` (the same as ``python -m mlarope bench``)."""
    # The package imports this module, so it is in sys.modules; its docstring is the overview.
    overview = sys.modules[__package__].__doc__
    parser = argparse.ArgumentParser(prog="python -m mlarope bench", description=overview)
    add_arguments(parser)
    return run(parser.parse_args(argv))
