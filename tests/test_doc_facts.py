"""What the docs say that code knows is checked against the code, so the two cannot drift:
family counts, rope types and widths, the keys ``from_hf`` reads, cache sizes, the defaults in
the README's API table, the torch version its install step pins, and the time its stress
command takes.

Each fact is read from the text by a pattern that must match exactly once: a rewording that
drops a fact fails here, and the test is updated with it.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import mlarope
import mlarope.serving
from mlarope import _launch_cache, rope, yarn

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def doc(name: str) -> str:
    return (ROOT / "docs" / name).read_text()


def one(pattern: str, text: str, what: str) -> re.Match:
    found = list(re.finditer(pattern, text, re.S | re.M))
    assert len(found) == 1, f"{what}: {len(found)} matches of {pattern!r}, expected 1"
    return found[0]


def ints(text: str) -> list[int]:
    return [int(n.replace(",", "")) for n in re.findall(r"\d[\d,]*", text)]


def names(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


# ------------------------------------------------------------------------- transformers families
WORDS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five"}


def family_table() -> tuple[str, dict[str, str]]:
    """docs/transformers.md's families table: (its transformers version, {family: status})."""
    pattern = r"## The families \(transformers (\d+\.\d+)\.\d+\)\n(.*?)\n\n(\|.*?)\n\n"
    m = one(pattern, doc("transformers.md"), "the families table")
    rows = {}
    for line in m.group(3).splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[names(cells[0])[0]] = cells[-1]
    return m.group(1), rows


def family_claims() -> dict[str, object]:
    version, rows = family_table()
    text = doc("transformers.md")
    return dict(
        version=version,
        rows=rows,
        readme=one(r"\((\d+) of its (\d+) model types in [\d.]+ and (\d+\.\d+),.*?; the other "
                   r"(\w+) have no\s+rotary", README, "README"),
        intro=one(r"installed transformers \((\d+) in transformers (\d+\.\d+),", text, "intro"),
        older=one(r"transformers (\d+\.\d+) has (\d+) of these families \(no (.*?)\)", text,
                  "the older release"),
    )  # fmt: skip


def test_family_counts_agree_with_each_other():
    c = family_claims()
    rows, readme, intro, older = c["rows"], c["readme"], c["intro"], c["older"]
    patched = [f for f, status in rows.items() if status.startswith("patched")]
    assert readme[3] == intro[2] == c["version"], "the README, the intro and the table: one release"
    assert int(readme[2]) == int(intro[1]) == len(rows), "the number of families"
    assert int(readme[1]) == len(patched), "the number patched"
    assert readme[4] == WORDS[len(rows) - len(patched)], "the number not patched"
    absent = names(older[3])
    assert set(absent) <= set(rows) and int(older[2]) == len(rows) - len(absent)


def test_family_table_is_the_installed_transformers_report():
    transformers = pytest.importorskip("transformers")
    from mlarope.integrations import transformers as mt

    version, rows = family_table()
    installed = ".".join(transformers.__version__.split(".")[:2])
    if installed != version:
        pytest.skip(f"the docs count transformers {version}'s families; {installed} installed")
    report = {row.name: row.status for row in mt.family_report()}
    assert set(rows) == set(report)
    for family, status in rows.items():
        want = "patched" if report[family] == "patched" else report[family]
        assert status.startswith(want), f"{family}: the table says {status!r}, the report {want!r}"


def test_default_counts_are_the_measured_runs():
    """The README's "patches the N whose measured training step ... leaves the other M" and
    transformers.md's "N of 17 families meet both targets; M are off by default" are
    ``_measured``'s verdicts over the recorded run's families (config-only ones included)."""
    from mlarope.integrations.transformers import _measured, _patch

    off = [f for f in _measured.MEASURED if _measured.off_by_default(f)]
    families = len(_measured.MEASURED)
    pattern = (
        r"(\d+) got faster by the\s+target's margin, and `apply_mlarope_to_all\(\)` patches their "
        r"(\d+)\s+modeling modules.*?leaves the other (\d+)"
    )
    on, modules, left = one(pattern, README, "README").groups()
    meet, total, off_count = one(r"(\d+) of (\d+) families meet both targets; (\d+) are\s+off",
                                 doc("transformers.md"), "transformers.md").groups()  # fmt: skip
    assert (int(on), int(left)) == (families - len(off), len(off))
    if importlib.util.find_spec("transformers") is not None:
        # apply_mlarope_to_all() returns the modeling modules (model types that run another
        # family's code are patched through it)
        on_modules = {_patch.family(f).name for f in _measured.MEASURED if f not in off}
        assert int(modules) == len(on_modules)
    assert (int(meet), int(total), int(off_count)) == (families - len(off), families, len(off))


# ------------------------------------------------------------------------ rope types and widths
def test_rope_types():
    listed = one(r"every rope type transformers knows: ([a-z0-9, ]+);", README, "README")[1]
    assert listed.split(", ") == list(rope.ROPE_TYPES)
    text = doc("yarn.md")
    for header in (r"\| `rope_type` \| `inv_freq\[j\]` \|", r"\| `rope_type` \| p < 4,096 \|"):
        table = one(header + r".*?\n\n", text, header)[0]
        rows = [line for line in table.splitlines()[2:] if line.startswith("|")]
        first = [line.split("|")[1].strip().strip("`") for line in rows]
        assert first == list(rope.ROPE_TYPES), header


def test_every_rope_type_transformers_knows():
    pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    # what the installed transformers knows (an older release may know fewer)
    assert {"default", *ROPE_INIT_FUNCTIONS} <= set(rope.ROPE_TYPES)


ROPE_WIDTHS = [
    ("README.md", r"`R` in \{([\d, ]+)\}"),
    ("docs/semantics.md", r"\*\*`R` in \{([\d, ]+)\}\*\*"),
    ("docs/design.md", r"`R` \(([\d, or]+), the"),
    ("docs/serving.md", r"\(`R` in ([\d, ]+)\)"),
    ("docs/megatron.md", r"mlarope's kernels support \(([\d, or]+);"),
    ("docs/transformers.md", r"a rope width other than ([\d, or]+);"),
]


@pytest.mark.parametrize(("path", "pattern"), ROPE_WIDTHS, ids=[p for p, _ in ROPE_WIDTHS])
def test_rope_widths(path, pattern):
    assert ints(one(pattern, (ROOT / path).read_text(), path)[1]) == list(
        mlarope.SUPPORTED_ROPE_DIMS
    )


def test_what_yarn_from_hf_reads():
    m = one(
        r"`from_hf` accepts `rope_type`/`type` (.*?) or None \(plain RoPE\), and the keys(.*?)\.\n",
        doc("yarn.md"),
        "from_hf",
    )
    assert [ast.literal_eval(n) for n in names(m[1])] == list(yarn._HF_ROPE_TYPES)
    assert {"rope_type", "type", *names(m[2])} == set(yarn._HF_KEYS)


def test_cache_sizes():
    assert ints(one(r"small module-level LRU\n\((\d+) entries;", doc("yarn.md"), "yarn")[1]) == [
        yarn._CACHE_MAX_ENTRIES
    ]
    keys = one(r"The cache keeps ([\d,]+) keys", doc("semantics.md"), "plans")[1]
    assert ints(keys) == [_launch_cache.MAX_ENTRIES]


# -------------------------------------------------------------------------- the README's API table
API_ROWS = {
    "apply_rope_q": mlarope.apply_rope_q,
    "apply_rope_kv": mlarope.apply_rope_kv,
    "apply_rope_qk": mlarope.apply_rope_qk,
    "rmsnorm_rope_latent": mlarope.rmsnorm_rope_latent,
    "YarnConfig": mlarope.YarnConfig,
    "mlarope.serving.rope_append_kv_cache": mlarope.serving.rope_append_kv_cache,
    "mlarope.serving.rope_decode_query": mlarope.serving.rope_decode_query,
    "mlarope.serving.rope_inverse_quant_output": mlarope.serving.rope_inverse_quant_output,
}


@pytest.mark.parametrize("call", list(API_ROWS))
def test_api_table_shows_the_signature(call):
    """The row's parameters are the function's, in order, with ``*`` where the keyword-only
    ones start and each default as the code has it; ``...`` may stand for some."""
    shown = one(r"^\| `" + re.escape(call) + r"\((.*?)\)`", README, call)[1].split(", ")
    params = list(inspect.signature(API_ROWS[call]).parameters.values())
    order = [p.name for p in params]
    at, elided = 0, False
    for item in shown:
        if item == "...":
            elided = True
            continue
        if item == "*":
            first_kw = next(p.name for p in params if p.kind is p.KEYWORD_ONLY)
            assert order.index(first_kw) == at, f"{call}: '*' before {first_kw}"
            continue
        name, eq, value = item.partition("=")
        assert name in order[at:], f"{call}: {name!r} is not the next parameter ({order[at:]})"
        skipped = order[at : order.index(name)]
        assert elided or not skipped, f"{call}: {skipped} left out without '...'"
        param = params[order.index(name)]
        if param.default is inspect.Parameter.empty:
            assert not eq, f"{call}: {name} has no default, the row shows {item!r}"
        else:
            assert eq, f"{call}: {name} defaults to {param.default!r}, the row does not say so"
            assert ast.literal_eval(value) == param.default, f"{call}: {item!r}"
        at, elided = order.index(name) + 1, False
    assert elided or at == len(order), f"{call}: {order[at:]} left out without '...'"


# ---------------------------------------------------------------------- the README's install step
def test_install_step_pins_the_cpu_lanes_torch():
    pin = one(r'TORCH_PIN="torch==([\d.]+)"', (ROOT / "scripts" / "_env.sh").read_text(), "pin")[1]
    assert one(r"\| torch \| ([\d.]+) \(CPU lanes\)", README, "versions")[1] == pin
    install = README[README.index("## Install") : README.index("## Set-up")]
    assert f"pip install torch=={pin}" in install


# --------------------------------------------------------------------- the README's stress figure
@pytest.mark.cpu
def test_stress_command_takes_the_time_the_readme_says(tmp_path):
    """The README's interpreter stress command passes and takes the time it says, within a
    factor of 3 either way (a shared 2-core machine is slower at times; an order-of-magnitude
    error, as "about a minute" for 5-13 s was, fails)."""
    m = one(
        r"`(TRITON_INTERPRET=1 python\s+-m mlarope stress [^`]*)` takes (\d+) to (\d+) s on two",
        README,
        "stress",
    )
    argv = m[1].split()[3:]  # after TRITON_INTERPRET=1 python -m
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    took = time.perf_counter() - start
    assert result.returncode == 0, result.stdout + result.stderr
    low, high = int(m[2]), int(m[3])
    assert low / 3 <= took <= 3 * high, f"took {took:.1f} s; the README says {low} to {high} s"
