"""The results and what is made of them: the rows and their JSON, the verdicts against the
targets, the table on the terminal, the Markdown table, the plot, and the merge of runs."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cases import Case, Suite, full_suite, smoke_suite
from .impls import IMPLS
from .model import HOST_TARGET_US, OPS, SCALING_TARGET, OpSpec, spec_bytes, target_status


@dataclass
class Row:
    case: str
    case_label: str
    op: str
    op_label: str
    direction: str
    impl: str
    tokens: int
    bytes: int
    ms_q20: float | None = None
    ms: float | None = None
    ms_q80: float | None = None
    method: str = ""
    tbps: float | None = None
    pct_copy: float | None = None
    host_us: float | None = None
    # A one-element torch op's host time, measured right after host_us: the host's own speed
    # in that minute (on the H200 machine's shared host it moved by up to 1.7x within minutes).
    host_floor_us: float | None = None
    target: str = ""
    status: str = ""
    note: str = ""
    wall_s: float = 0.0  # harness time of this row: build, compile, warm-up, timing


@dataclass
class Results:
    meta: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    checks: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "meta": self.meta,
            "rows": [dataclasses.asdict(r) for r in self.rows],
            "checks": self.checks,
        }


def load_results(path: str | Path) -> Results:
    data = json.loads(Path(path).read_text())
    known = {f.name for f in dataclasses.fields(Row)}
    rows = [Row(**{k: v for k, v in r.items() if k in known}) for r in data["rows"]]
    return Results(data["meta"], rows, data.get("checks", []))


def merge_results(parts: Sequence[Results]) -> Results:
    """One result set from several runs: the first run's meta (each run's copy ceiling and
    command kept under ``runs``), rows in order, a later run's row replacing an earlier one of
    the same (case, op, impl); the thd scaling checks recomputed over the merged rows."""
    if not parts:
        raise ValueError("nothing to merge")
    meta = {k: v for k, v in parts[0].meta.items() if k != "partial"}
    meta["runs"] = [
        {k: p.meta.get(k) for k in ("date", "device", "command", "copy", "elapsed_s", "partial")}
        for p in parts
    ]
    rows: dict[tuple[str, str, str], Row] = {}
    for part in parts:
        for r in part.rows:
            rows.pop((r.case, r.op, r.impl), None)
            rows[(r.case, r.op, r.impl)] = r
    suite = smoke_suite() if meta.get("mode") == "cpu-smoke" else full_suite()
    order = {c.key: i for i, c in enumerate(suite.cases)}
    op_order = {s.key: i for i, s in enumerate(OPS)}
    merged = sorted(
        rows.values(),
        key=lambda r: (order.get(r.case, 99), op_order.get(r.op, 99), IMPLS.index(r.impl)),
    )
    checks = scaling_checks(merged, suite) if meta.get("mode") != "cpu-smoke" else []
    return Results(meta, merged, checks)


def judge(row: Row, spec: OpSpec, case: Case) -> None:
    """Targets apply to mlarope: bandwidth on the training shapes, host overhead on the decode
    forwards (decode kernels are launch-bound; their bandwidth is reported, not judged)."""
    if row.impl != "mlarope" or row.note:
        return
    if not case.decode:
        row.target = f">= {spec.target * 100:.0f}% copy"
        row.status = target_status(row.pct_copy, spec.target * 100)
    elif spec.direction == "fwd":
        row.target = f"host <= {HOST_TARGET_US:.0f} us"
        row.status = target_status(row.host_us, HOST_TARGET_US, higher_is_better=False)


def scaling_checks(rows: list[Row], suite: Suite) -> list[dict[str, Any]]:
    """thd with many sequences must cost no more than ``SCALING_TARGET`` x few sequences."""
    few, many = suite.scaling_pair
    by = {(r.case, r.op): r for r in rows if r.impl == "mlarope" and r.ms}
    checks = []
    for spec in OPS:
        a, b = by.get((few, spec.key)), by.get((many, spec.key))
        if a is None or b is None:
            continue
        ratio = b.ms / a.ms
        checks.append(
            {
                "name": f"{spec.label}: {many} / {few}",
                "op": spec.key,
                "value": ratio,
                "target": f"<= {SCALING_TARGET}x",
                "status": target_status(ratio, SCALING_TARGET, higher_is_better=False),
            }
        )
    return checks


def say(console, text: str) -> None:
    if console is not None:
        console.print(text, highlight=False)
    else:
        print(text)


def _fmt_ms(ms: float | None) -> str:
    return "-" if ms is None else f"{ms * 1e3:.1f}"


def _pivot(results: Results, impls: Sequence[str]):
    """Rows keyed by (case, op) in run order, each with the row of every implementation."""
    table: dict[tuple[str, str], dict[str, Row]] = {}
    for r in results.rows:
        table.setdefault((r.case, r.op), {})[r.impl] = r
    return table


def _cell(r: Row | None) -> str:
    if r is None:
        return "-"
    if r.ms is None:
        return r.note.split(":")[0] if r.note else "-"
    pct = f" ({r.pct_copy:.0f}%)" if r.pct_copy is not None else ""
    return f"{_fmt_ms(r.ms)}{pct}"


def print_plan(console, suite: Suite, cases, specs, impls) -> None:
    say(console, f"dims {dataclasses.asdict(suite.dims)}, dtype {suite.dtype}, impls {impls}")
    for case in cases:
        for spec in specs:
            nbytes = spec_bytes(spec, case.tokens, suite.dims)
            say(console, f"{case.key:10s} {spec.key:18s} tokens {case.tokens:6d} "
                 f"bytes {nbytes:>13,d}")  # fmt: skip


def print_results(console, results: Results, impls: Sequence[str]) -> None:
    pivot = _pivot(results, impls)
    header = ["case", "op", "MB", "mlarope us [q20-q80]", "TB/s", "% copy"]
    header += [f"{i} us (%)" for i in impls if i != "mlarope"]
    header += ["host us (torch op)", "target", "status"]
    lines = []
    for (_case, _op), by_impl in pivot.items():
        any_row = next(iter(by_impl.values()))
        ours = by_impl.get("mlarope")
        if ours is not None and ours.ms is not None:
            ours_cell = f"{_fmt_ms(ours.ms)} [{_fmt_ms(ours.ms_q20)}-{_fmt_ms(ours.ms_q80)}]"
            tbps = f"{ours.tbps:.2f}" if ours.tbps is not None else "-"
            pct = f"{ours.pct_copy:.1f}" if ours.pct_copy is not None else "-"
        else:
            ours_cell, tbps, pct = (_cell(ours), "-", "-")
        host = [_host_cell(r) for r in by_impl.values() if r.impl == "mlarope" and r.host_us]
        line = [any_row.case_label, any_row.op_label, f"{any_row.bytes / 1e6:.2f}", ours_cell,
                tbps, pct]  # fmt: skip
        line += [_cell(by_impl.get(i)) for i in impls if i != "mlarope"]
        line += [host[0] if host else "-"]
        line += [ours.target if ours else "", ours.status if ours else ""]
        lines.append(line)
    copy = results.meta.get("copy", {})
    title = (
        f"mlarope bench on {results.meta['device']} (copy {copy.get('tbps', 0):.3f} TB/s; "
        f"times in us, medians; (%) = % of copy)"
    )
    if console is not None:
        from rich.table import Table

        table = Table(title=title)
        for h in header:
            table.add_column(h, justify="left" if h in ("case", "op", "target") else "right")
        previous = None
        for line in lines:
            if previous is not None and line[0] != previous:
                table.add_section()
            previous = line[0]
            status = line[-1]
            color = {"PASS": "green", "MISS": "red"}.get(status)
            line = [*line[:-1], f"[{color}]{status}[/{color}]" if color else status]
            table.add_row(*line)
        console.print(table)
    else:
        print(title)
        print(" | ".join(header))
        for line in lines:
            print(" | ".join(line))
    floor = results.meta.get("host_floor") or {}
    if floor and "error" not in floor:
        parts = ", ".join(f"{k.removesuffix('_us')} {v:.1f} us" for k, v in floor.items())
        say(console, f"host floor per call (no work): {parts}")
    for c in results.checks:
        say(console, f"thd scaling {c['name']}: {c['value']:.3f}x (target {c['target']}) "
             f"{c['status']}")  # fmt: skip
    notes = sorted({f"{r.impl}: {r.note}" for r in results.rows if r.note.startswith("error")})
    for n in notes:
        say(console, f"error {n}")
    if results.meta.get("mode") == "cpu-smoke":
        say(console, "targets: not judged (--cpu-smoke: the targets are the GPU's)")
        return
    statuses = [r.status for r in results.rows] + [c["status"] for c in results.checks]
    say(console, f"targets: {statuses.count('PASS')} PASS, {statuses.count('MISS')} MISS")


def _host_cell(row: Row) -> str:
    """``16.7 (6.6)``: the op's host time per call, and in brackets a one-element torch op's,
    measured right after it."""
    floor = f" ({row.host_floor_us:.1f})" if row.host_floor_us is not None else ""
    return f"{row.host_us:.1f}{floor}"


def markdown_table(results: Results, impls: Sequence[str]) -> str:
    """The results as a Markdown table (medians in us, % of copy), for docs/benchmarks.md."""
    pivot = _pivot(results, impls)
    head = [
        "case",
        "op",
        "MB",
        *[f"{i} us (% copy)" for i in impls],
        "host us (torch op)",
        "target",
        "status",
    ]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for by_impl in pivot.values():
        any_row = next(iter(by_impl.values()))
        ours = by_impl.get("mlarope")
        host = _host_cell(ours) if ours is not None and ours.host_us else ""
        cells = [any_row.case_label, any_row.op_label, f"{any_row.bytes / 1e6:.2f}"]
        cells += [_cell(by_impl.get(i)) for i in impls]
        cells += [host, ours.target if ours else "", ours.status if ours else ""]
        out.append("| " + " | ".join(cells) + " |")
    for c in results.checks:
        out.append(f"\nthd scaling, {c['name']}: {c['value']:.3f}x ({c['target']}) {c['status']}")
    return "\n".join(out) + "\n"


def write_plot(results: Results, impls: Sequence[str], path: str | Path) -> None:
    """Bar chart: % of the copy bandwidth per case (x) and implementation (bars), one panel
    per op."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [s for s in OPS if any(r.op == s.key for r in results.rows)]
    cases: list[tuple[str, str]] = []
    for r in results.rows:
        if (r.case, r.case_label) not in cases:
            cases.append((r.case, r.case_label))
    cols = 2
    nrows = max(1, math.ceil(len(ops) / cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(7.5 * cols, 3.2 * nrows), squeeze=False)
    width = 0.8 / max(1, len(impls))
    by = {(r.case, r.op, r.impl): r for r in results.rows}
    for ax, spec in zip(axes.flat, ops, strict=False):
        for i, impl in enumerate(impls):
            values = []
            for key, _ in cases:
                r = by.get((key, spec.key, impl))
                values.append(r.pct_copy if r is not None and r.pct_copy is not None else 0.0)
            xs = [j + (i - (len(impls) - 1) / 2) * width for j in range(len(cases))]
            ax.bar(xs, values, width, label=impl)
        ax.axhline(100.0, color="black", linewidth=0.8)
        ax.axhline(spec.target * 100, color="red", linewidth=0.8, linestyle="--")
        ax.set_title(spec.label)
        ax.set_ylabel("% of copy")
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels([label for _, label in cases], rotation=30, ha="right", fontsize=7)
        top = max([110.0] + [r.pct_copy or 0.0 for r in results.rows if r.op == spec.key])
        ax.set_ylim(0, top * 1.05)
    for ax in list(axes.flat)[len(ops) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    copy = results.meta.get("copy", {}).get("tbps", 0.0)
    fig.legend(handles, labels, loc="upper right", ncol=len(impls))
    fig.suptitle(f"mlarope bench, {results.meta['device']}: % of copy ({copy:.2f} TB/s)")
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _output_paths(args) -> dict[str, Path]:
    paths: dict[str, Path] = {}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"json": out / "bench.json", "plot": out / "bench.png", "md": out / "bench.md"}
    if args.json:
        paths["json"] = Path(args.json)
    if args.plot:
        paths["plot"] = Path(args.plot)
    return paths


def write_partial(args, results: Results) -> None:
    """The JSON so far, after each case, so that a run cut short still leaves its numbers."""
    path = _output_paths(args).get("json")
    if path is not None:
        partial = results.to_json()
        partial["meta"] = {**partial["meta"], "partial": True}
        path.write_text(json.dumps(partial, indent=1) + "\n")


def write_outputs(console, args, results: Results, impls: Sequence[str]) -> None:
    paths = _output_paths(args)
    if "json" in paths:
        paths["json"].write_text(json.dumps(results.to_json(), indent=1) + "\n")
    if "md" in paths:
        paths["md"].write_text(markdown_table(results, impls))
    if "plot" in paths:
        try:
            write_plot(results, impls, paths["plot"])
        except ImportError as exc:
            say(console, f"plot skipped: {exc}")
            del paths["plot"]
    for kind, p in paths.items():
        say(console, f"wrote {kind}: {p}")
