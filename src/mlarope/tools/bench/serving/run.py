"""The serving benchmark's command: its options, the run over cases and ops, and the timing of
one row (ours, the unfused sequence, a copy of the same bytes, host times, FlashInfer)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import torch

from ..cases import rotation_sets
from ..model import target_status
from ..timers import CpuTimer, CudaTimer
from .calls import compare, ours, unfused
from .flashinfer import flashinfer_calls, import_flashinfer
from .inputs import make_inputs
from .launch_configs import run_decode_sweep, run_sweep
from .model import CASES, HOST_TARGET_US, OPS_BY_KEY, PREFILL_TARGET, SMOKE_CASES, Dims, bytes_moved
from .report import Row, markdown_table, run_meta, sweep_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", metavar="DIR", help="write DIR/serving.json and serving.md")
    parser.add_argument("--cases", default="all", help=f"comma list of {','.join(CASES)}")
    parser.add_argument("--ops", default="all", help=f"comma list of {','.join(OPS_BY_KEY)}")
    parser.add_argument("--sweep", action="store_true", help="also time other launch configs")
    parser.add_argument("--no-flashinfer", action="store_true", help="skip FlashInfer's rows")
    parser.add_argument(
        "--tables", choices=("pair", "full"), default="pair",
        help="every op's tables: pair [P, R / 2] (default) or full [P, R]",
    )  # fmt: skip
    parser.add_argument("--warmup-ms", type=float, default=25.0)
    parser.add_argument("--rep-ms", type=float, default=100.0)
    parser.add_argument("--copy-mib", type=int, default=1024)
    parser.add_argument("--host-calls", type=int, default=1000)
    parser.add_argument("--max-graph-calls", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cpu-smoke", action="store_true",
        help="tiny shapes on the CPU with host timers: checks the harness, measures nothing real",
    )  # fmt: skip
    parser.add_argument("--cpu-reps", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the bytes")


def _select(spec: str, choices, what: str) -> list[str]:
    if spec == "all":
        return list(choices)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in choices]
    if unknown:
        raise ValueError(f"unknown {what} {unknown}; choose from {list(choices)}")
    return names


def run(args: argparse.Namespace) -> int:
    dims = Dims(heads=8, positions=4096, heads_per_group=4) if args.cpu_smoke else Dims()
    dims = dataclasses.replace(dims, pair_tables=args.tables == "pair")
    cases = SMOKE_CASES if args.cpu_smoke else CASES
    try:
        case_keys = _select(args.cases, cases, "cases")
        op_keys = _select(args.ops, OPS_BY_KEY, "ops")
    except ValueError as exc:
        print(f"mlarope.tools.bench.serving: {exc}")
        return 2
    if args.dry_run:
        for key in case_keys:
            for op in op_keys:
                mb = bytes_moved(OPS_BY_KEY[op], cases[key], dims) / 1e6
                print(f"{key:10s} {op:22s} {mb:10.3f} MB")
        return 0
    if args.cpu_smoke:
        device = torch.device("cpu")
        timer: CudaTimer | CpuTimer = CpuTimer(args, device)
        copy_mib = 4
    else:
        if not torch.cuda.is_available():
            print(
                "mlarope.tools.bench.serving: no CUDA device (use --cpu-smoke to check the harness)"
            )
            return 2
        device = torch.device(args.device)
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        timer = CudaTimer(args, device)
        copy_mib = args.copy_mib
    started = time.perf_counter()
    fi, fi_version = (None, "skipped (--no-flashinfer)")
    if not args.no_flashinfer and not args.cpu_smoke:
        fi, fi_version = import_flashinfer()
    copy_timing, copy_bytes = timer.copy(copy_mib, torch.bfloat16)
    copy_tbps = copy_bytes / (copy_timing.median * 1e-3) / 1e12
    meta = run_meta(args, device, dims, fi_version, copy_bytes, copy_timing, copy_tbps)
    print(f"copy ceiling: {copy_tbps:.3f} TB/s; flashinfer: {fi_version}")
    from mlarope.yarn import YarnConfig

    cos, sin = YarnConfig.deepseek_v3().cos_sin(dims.positions, device=device)
    gen = torch.Generator().manual_seed(args.seed)
    rows: list[Row] = []
    for case in case_keys:
        tokens = cases[case]
        prefill = case == "prefill"
        for key in op_keys:
            op = OPS_BY_KEY[key]
            row = Row(case, tokens, key, op.label, bytes_moved(op, tokens, dims))
            try:
                _measure(row, op, tokens, prefill, dims, device, gen, cos, sin, timer, fi)
                row.pct_copy = _pct(row, copy_tbps)
                if not args.cpu_smoke:
                    _judge(row, prefill)
                if case == case_keys[0]:
                    row.check = compare(op, dims, device, cos, sin, args.seed, fi)
            except Exception as exc:  # one row's failure is reported, the run goes on
                row.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                traceback.print_exc()
            rows.append(row)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(f"  done {case} ({time.perf_counter() - started:.0f} s)")
    sweep: list[dict] = []
    if args.sweep and "prefill" in case_keys:
        sweep = run_sweep(
            op_keys, cases["prefill"], dims, device, gen, cos, sin, timer, copy_tbps,
            limit=2 if args.cpu_smoke else None,
        )  # fmt: skip
    decode_keys = [k for k in case_keys if k != "prefill"]
    query_keys = [k for k in op_keys if OPS_BY_KEY[k].kind == "query"]
    if args.sweep and decode_keys and query_keys:
        for case in decode_keys:
            sweep += run_decode_sweep(
                query_keys, case, cases[case], dims, device, gen, cos, sin, timer,
                limit=2 if args.cpu_smoke else None,
            )  # fmt: skip
    meta["elapsed_s"] = round(time.perf_counter() - started, 1)
    table = markdown_table(rows, meta)
    print(table)
    if sweep:
        print(sweep_table(sweep))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        payload = {"meta": meta, "rows": [asdict(r) for r in rows], "sweep": sweep}
        (out / "serving.json").write_text(json.dumps(payload, indent=1))
        (out / "serving.md").write_text(table + ("\n" + sweep_table(sweep) if sweep else ""))
    return 0


def _measure(row, op, tokens, prefill, dims, device, gen, cos, sin, timer, fi) -> None:
    use_graph = not prefill and isinstance(timer, CudaTimer)
    sets = rotation_sets(row.bytes, timer.l2_bytes, timer.max_graph_calls) if use_graph else 1
    inputs = [make_inputs(op, tokens, dims, device, gen, prefill) for _ in range(sets)]
    mine = [ours(op, inp, cos, sin, dims) for inp in inputs]
    theirs = [unfused(op, inp, cos, sin) for inp in inputs]
    t = timer.graph(mine) if use_graph else timer.large(mine[0])
    row.ours_ms, row.method = [t.q20, t.median, t.q80], t.method
    u = timer.graph(theirs) if use_graph else timer.large(theirs[0])
    row.unfused_ms = u.median
    row.speedup = u.median / t.median if t.median > 0 else None
    if prefill:
        row.same_bytes_copy_ms = _same_bytes_copy(timer, row.bytes, device)
    else:
        row.host_us = timer.host_us(mine[0])
        row.torch_op_us = timer.torch_op_us()
        row.unfused_host_us = timer.host_us(theirs[0])
    if fi is not None:
        try:
            calls = [flashinfer_calls(fi, op, inp, cos, sin) for inp in inputs]
            if calls[0] is None:
                row.flashinfer_note = "no matching op"
            else:
                f = timer.graph(calls) if use_graph else timer.large(calls[0])
                row.flashinfer_ms = f.median
        except Exception as exc:
            row.flashinfer_note = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]


def _same_bytes_copy(timer, nbytes: int, device) -> float:
    """A device-to-device copy that moves ``nbytes`` (half read, half written)."""
    src = torch.empty(max(1, nbytes // 2), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return timer.large(lambda: dst.copy_(src)).median


def _pct(row: Row, copy_tbps: float) -> float | None:
    if not row.ours_ms or row.ours_ms[1] <= 0:
        return None
    return 100.0 * row.bytes / (row.ours_ms[1] * 1e-3) / 1e12 / copy_tbps


def _judge(row: Row, prefill: bool) -> None:
    if prefill:
        row.target = f">= {PREFILL_TARGET:.0%} copy"
        row.status = target_status((row.pct_copy or 0) / 100, PREFILL_TARGET)
    else:
        row.target = f"host <= {HOST_TARGET_US:g} us"
        row.status = target_status(row.host_us, HOST_TARGET_US, higher_is_better=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mlarope.tools.bench.serving", description=sys.modules[__package__].__doc__
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
