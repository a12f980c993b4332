"""The serving benchmark's report: a row of the main table, the Markdown tables and the run's
metadata."""

from __future__ import annotations

import contextlib
import datetime
import math
import platform
import sys
from dataclasses import asdict, dataclass, field

import torch

from .model import HOST_TARGET_US, PREFILL_TARGET


@dataclass
class Row:
    case: str
    tokens: int
    op: str
    label: str
    bytes: int
    ours_ms: list[float] | None = None
    method: str = ""
    pct_copy: float | None = None
    same_bytes_copy_ms: float | None = None
    unfused_ms: float | None = None
    speedup: float | None = None
    host_us: float | None = None
    torch_op_us: float | None = None
    unfused_host_us: float | None = None
    flashinfer_ms: float | None = None
    flashinfer_note: str = ""
    target: str = ""
    status: str = ""
    check: dict = field(default_factory=dict)
    error: str = ""


def _fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def markdown_table(rows: list[Row], meta: dict) -> str:
    head = (
        f"serving bench, {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, "
        f"copy {meta['copy']['tbps']:.3f} TB/s, flashinfer: {meta['flashinfer']}, "
        f"{'pair tables [P, R / 2]' if meta['dims']['pair_tables'] == 'True' else 'full tables'}"
        "\n\n"
        "| case | op | MB | ours us (% copy) | same-bytes copy us | unfused us | speed-up | "
        "host us (torch op) | unfused host us | flashinfer us | check | target | status |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        if r.error:
            lines.append(f"| {r.case} | {r.label} | {r.bytes / 1e6:.2f} | ERROR {r.error} |"
                         + " |" * 9)  # fmt: skip
            continue
        ours_us = _fmt(r.ours_ms[1] * 1e3 if r.ours_ms else None, ".1f")
        pct = _fmt(r.pct_copy, ".0f")
        host = "" if r.host_us is None else f"{r.host_us:.1f} ({r.torch_op_us:.1f})"
        fi = _fmt(None if r.flashinfer_ms is None else r.flashinfer_ms * 1e3, ".1f",
                  r.flashinfer_note or "-")  # fmt: skip
        check = "" if not r.check else ("ok" if r.check["ok"] else "DIFF")
        if "flashinfer_ok" in r.check:
            check += ", flashinfer " + ("ok" if r.check["flashinfer_ok"] else "DIFF")
        lines.append(
            f"| {r.case} | {r.label} | {r.bytes / 1e6:.2f} | {ours_us} ({pct}%) | "
            f"{_fmt(None if r.same_bytes_copy_ms is None else r.same_bytes_copy_ms * 1e3, '.1f')}"
            f" | {_fmt(None if r.unfused_ms is None else r.unfused_ms * 1e3, '.1f')} | "
            f"{_fmt(r.speedup, '.2f')}x | {host} | {_fmt(r.unfused_host_us, '.1f')} | {fi} | "
            f"{check} | {r.target} | {r.status} |"
        )
    return head + "\n".join(lines) + "\n"


def sweep_table(sweep: list[dict]) -> str:
    lines = ["| op | variant | us | % copy |", "|---|---|---|---|"]
    for s in sweep:
        if "error" in s:
            lines.append(f"| {s['op']} | {s['variant']} | ERROR {s['error']} | |")
        else:
            pct = "-" if s["pct_copy"] is None else f"{s['pct_copy']:.0f}%"
            lines.append(f"| {s['op']} | {s['variant']} | {s['ms'] * 1e3:.2f} | {pct} |")
    return "\n".join(lines) + "\n"


def run_meta(args, device, dims, fi_version, copy_bytes, copy_timing, copy_tbps) -> dict:
    import mlarope

    with contextlib.suppress(ImportError):
        import triton  # noqa: F401 (its version below)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "mode": "cpu-smoke" if args.cpu_smoke else "gpu",
        "mlarope": mlarope.__version__,
        "torch": torch.__version__,
        "triton": getattr(sys.modules.get("triton"), "__version__", "not installed"),
        "python": platform.python_version(),
        "command": " ".join(["python -m mlarope.tools.bench.serving", *sys.argv[1:]]),
        "dims": {k: str(v) for k, v in asdict(dims).items()},
        "flashinfer": fi_version,
        "copy": {"bytes": copy_bytes, "ms": copy_timing.median, "tbps": copy_tbps},
        "targets": {"prefill_pct_copy": PREFILL_TARGET, "decode_host_us": HOST_TARGET_US},
    }
