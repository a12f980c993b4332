"""The summary of ``scripts/megatron_tests.py``: its Markdown tables (``megatron_tests.md``, the
tables for docs/megatron.md) and its verdict, from the summary the script collects. Beside the
script, which imports it (``python scripts/megatron_tests.py`` puts this folder first on the
path).
"""

from __future__ import annotations

IMPLS = ("megatron", "mlarope")
ATOL, RTOL = 5.0e-2, 2.0e-2  # the test file's bf16 tolerances (dtype_tols)


def _cell(c: dict | None) -> str:
    if c is None:
        return "-"
    runs = c["passed"] + c["failed"] + c["skipped"]
    if c["skipped"] == runs:
        return f"skipped ({runs})"
    return f"{c['passed']} / {runs}" + (f", **{c['failed']} failed**" if c["failed"] else "")


def markdown(summary: dict) -> str:
    lines = [
        "# Megatron-LM's MLA RoPE tests: Megatron-Core's kernels and mlarope.compat.megatron",
        "",
        f"- {summary['when']}, {summary['device']}; torch {summary['torch']}, triton "
        f"{summary['triton']}, Python {summary['python']}",
        f"- Megatron-LM: `{summary['megatron_path']}` ({summary['megatron_commit']})",
        f"- command: `{summary['command']}`",
        f"- wall time {summary['seconds']:.0f} s",
        "",
    ]
    procs = summary["processes"]
    lines += [
        f"## Every test, {procs} separate processes per implementation (passed / ran)",
        "",
        *(
            [f"{summary['not_run']} processes not run (out of the step's time budget).", ""]
            if summary["not_run"]
            else []
        ),
        "| test | Megatron-Core's kernel | mlarope.compat.megatron | why it fails |",
        "|---|---|---|---|",
    ]
    for test_id, cells in sorted(summary["per_test"].items()):
        why = sorted({m for c in cells.values() for m in c["messages"]})
        lines.append(
            f"| `{test_id}` | {_cell(cells.get('megatron'))} | {_cell(cells.get('mlarope'))} | "
            f"{'; '.join(w.replace('|', '/') for w in why)[:300]} |"
        )
    for impl in IMPLS:
        bad = [r for r in summary["runs"] if r["impl"] == impl and (r["tail"] or not r["tests"])]
        if bad:
            lines += [
                "",
                f"{len(bad)} {impl} process(es) ended abnormally; first tail:",
                "",
                "```",
                bad[0]["tail"][-1200:],
                "```",
            ]
    lines += ["", "## Test bodies repeated in one process (failed / runs)", ""]
    repeat = summary["repeat"]
    names = []
    for impl in IMPLS:
        if "bodies" in repeat.get(impl, {}):
            names = list(repeat[impl]["bodies"])
            break
    if names:
        lines += ["| body | Megatron-Core's kernel | mlarope.compat.megatron |", "|---|---|---|"]
        for name in names:
            cells = []
            for impl in IMPLS:
                b = repeat.get(impl, {}).get("bodies", {}).get(name)
                if b is None:
                    cells.append("-")
                else:
                    why = f" ({'; '.join(b['messages'])[:120]})" if b["failed"] else ""
                    cells.append(f"{b['failed']} / {b['runs']}{why}")
            lines.append(f"| `{name}` | {cells[0]} | {cells[1]} |")
    for impl in IMPLS:
        if "error" in repeat.get(impl, {}):
            lines += ["", f"repeat worker ({impl}): {repeat[impl]['error']}"]
            tail = repeat[impl].get("tail", repeat[impl].get("trace", ""))
            if tail:
                lines += ["", "```", tail[-1500:], "```"]
    lines += ["", "## The key/value test's k_pos_emb gradient against fp64", ""]
    fp64 = summary["fp64"]
    if "rows" in fp64:
        lines += [
            "fp64 truth from the test's own bf16 inputs and bf16 tables (captured from the test "
            f"body); tolerance as the test's: {ATOL} + {RTOL} |truth|; correctly rounded: within "
            "half a bf16 ulp (the worst trial); test fails: trials whose comparison with the "
            "test's reference fails.",
            "",
            "| layout | result | trials | elements beyond tolerance | trials with any | max abs "
            "error | correctly rounded | test fails |",
            "|---|---|---|---|---|---|---|---|",
        ]
        labels = {
            "reference": "the test's PyTorch reference",
            "megatron": "Megatron's kernel",
            "mlarope": 'mlarope, rounding="megatron" (default)',
            "mlarope_exact": 'mlarope, rounding="exact"',
        }
        for fmt, rows in fp64["rows"].items():
            for name, r in rows.items():
                fails = "-" if name == "reference" else str(r["test_fails"])
                lines.append(
                    f"| {fmt} | {labels[name]} | {r['trials']} | {r['beyond_tol']} | "
                    f"{r['trials_beyond_tol']} | {r['max_abs_err']:.4g} | "
                    f"{100 * r['correctly_rounded']:.3f} % | {fails} |"
                )
    else:
        lines += [f"fp64 worker: {fp64.get('error')}"]
        if fp64.get("tail"):
            lines += ["", "```", fp64["tail"][-1500:], "```"]
    layer = summary["layer"]
    lines += ["", "## mlarope's Megatron-Core layer test (tests/test_integration_megatron.py)", ""]
    if layer.get("tests"):
        lines += ["| test | outcome |", "|---|---|"]
        lines += [f"| `{k}` | {v} |" for k, v in sorted(layer["tests"].items())]
    if layer.get("rc") not in (0, None) or not layer.get("tests"):
        lines += ["", "```", layer.get("tail", "")[-2000:], "```"]
    lines += ["", "## Verdict", "", summary["verdict"], ""]
    return "\n".join(lines)


def verdict(per_test: dict, repeat: dict, fp64: dict, layer: dict) -> tuple[str, bool]:
    """0 failures of mlarope in every test that passes with Megatron's kernel in every process,
    in every repeated body, and the layer test passing."""
    problems = []
    for test_id, cells in per_test.items():
        mega, ours = cells.get("megatron"), cells.get("mlarope")
        if not ours or not ours["failed"]:
            continue
        # Allowed only where Megatron's kernel fails in every process, for the same reason
        # (the environment, e.g. no TransformerEngine), never where it passes even once.
        same = mega and set(ours["messages"]) <= set(mega["messages"])
        if not mega or mega["passed"] or not same:
            passed = mega["passed"] if mega else 0
            problems.append(
                f"{test_id}: mlarope failed {ours['failed']} "
                f"({'; '.join(ours['messages'])[:200]}); Megatron's kernel passed "
                f"{passed}"
            )
    for name, b in repeat.get("mlarope", {}).get("bodies", {}).items():
        if b["failed"]:
            problems.append(f"repeated {name}: mlarope failed {b['failed']} / {b['runs']}")
    if "error" in repeat.get("mlarope", {}):
        problems.append(f"repeat worker: {repeat['mlarope']['error']}")
    for fmt, rows in fp64.get("rows", {}).items():
        if rows["mlarope"]["test_fails"]:
            problems.append(f"fp64 {fmt}: mlarope's default fails the test's comparison")
    if "error" in fp64:
        problems.append(f"fp64 worker: {fp64['error']}")
    failed_layer = [k for k, v in layer.get("tests", {}).items() if v not in ("passed",)]
    if layer.get("rc") != 0 or failed_layer or not layer.get("tests"):
        problems.append(f"layer test: rc {layer.get('rc')}, not passed: {failed_layer}")
    both = sorted(
        t
        for t, c in per_test.items()
        if c.get("megatron", {}).get("failed") and c.get("mlarope", {}).get("failed")
    )
    text = (
        "PASS: no test fails with mlarope that passes with Megatron's kernel."
        if not problems
        else "FAIL:\n\n" + "\n".join(f"- {p}" for p in problems)
    )
    if both:
        text += (
            "\n\nFailing with both implementations (the reason is in the first table): "
            + ", ".join(f"`{t}`" for t in both)
        )
    return text, not problems
