"""The benchmark harness (``mlarope.tools.bench``): the bytes model by hand, the target logic, and a
CPU smoke run end to end (table, JSON, Markdown, PNG). The GPU numbers come from the GPU lane's
``python -m mlarope bench``; the ``gpu`` test here only checks that the real path runs."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from mlarope.tools import bench, cli
from mlarope.tools.bench.cases import (
    Case,
    Inputs,
    Suite,
    full_suite,
    make_inputs,
    make_positional,
    rotation_sets,
    select_cases,
    smoke_suite,
)
from mlarope.tools.bench.cli import select_names
from mlarope.tools.bench.impls import IMPLS, Builders, Unsupported, retune_megatron
from mlarope.tools.bench.model import (
    OPS,
    OPS_BY_KEY,
    MlaDims,
    bytes_moved,
    spec_bytes,
    target_status,
)
from mlarope.tools.bench.report import Row, judge, scaling_checks

TINY = MlaDims(heads=2, nope=4, rope=8, k_dim=6, v_dim=5, elem_bytes=2)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


# ----------------------------------------------------------------------------- bytes model
@pytest.mark.parametrize(
    ("op", "direction", "inplace", "copy_v", "expected"),
    [
        # T=3 tokens, H=2 heads, N=4, R=8, K=6, V=5, 2 bytes; counted element by element:
        # q in place: read + write the rope tail, 3*2*(8+8)*2
        ("q", "fwd", True, True, 3 * 2 * 16 * 2),
        ("q", "bwd", True, True, 3 * 2 * 16 * 2),
        # q out of place: read 12 + write 12 channels per head
        ("q", "fwd", False, True, 3 * 2 * 24 * 2),
        ("q", "bwd", False, True, 3 * 2 * 24 * 2),
        # kv fwd: read kv 11, write k 14 and v 5 per head; read k_pe 8 per token
        ("kv", "fwd", False, True, 3 * 2 * (11 + 14 + 5) * 2 + 3 * 8 * 2),
        # kv fwd without copy_v: read kv[..., :K] 6, write k 14 per head; k_pe 8 per token
        ("kv", "fwd", False, False, 3 * 2 * (6 + 14) * 2 + 3 * 8 * 2),
        # kv bwd: read dk 14 and dv 5, write dkv 11 per head; write dk_pe 8 per token
        ("kv", "bwd", False, True, 3 * 2 * (14 + 5 + 11) * 2 + 3 * 8 * 2),
        ("kv", "bwd", False, False, 3 * 2 * (14 + 5 + 11) * 2 + 3 * 8 * 2),
    ],
)
def test_bytes_model_tiny_by_hand(op, direction, inplace, copy_v, expected):
    got = bytes_moved(op, direction, tokens=3, dims=TINY, inplace=inplace, copy_v=copy_v)
    assert got == expected


def test_bytes_model_deepseek_v3_per_token():
    d = MlaDims.deepseek_v3()
    assert (d.heads, d.nope, d.rope, d.k_dim, d.v_dim, d.elem_bytes) == (128, 128, 64, 128, 128, 2)
    assert bytes_moved("q", "fwd", tokens=1, dims=d, inplace=True) == 128 * 256
    assert bytes_moved("q", "fwd", tokens=1, dims=d) == 128 * 768
    assert bytes_moved("kv", "fwd", tokens=1, dims=d) == 128 * 1152 + 128
    assert bytes_moved("kv", "fwd", tokens=1, dims=d, copy_v=False) == 128 * 640 + 128
    assert bytes_moved("kv", "bwd", tokens=1, dims=d) == 128 * 1152 + 128
    # linear in tokens
    assert bytes_moved("kv", "bwd", tokens=16384, dims=d) == 16384 * (128 * 1152 + 128)


def test_bytes_model_spec_table_matches_function():
    for spec in OPS:
        want = bytes_moved(
            spec.op, spec.direction, tokens=5, dims=TINY, inplace=spec.inplace,
            copy_v=spec.copy_v,
        )  # fmt: skip
        assert spec_bytes(spec, 5, TINY) == want


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(op="x", direction="fwd"), "op must be"),
        (dict(op="q", direction="up"), "direction must be"),
    ],
)
def test_bytes_model_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        bytes_moved(tokens=1, dims=TINY, **kwargs)


# ----------------------------------------------------------------------------- targets
def test_rotation_sets():
    l2 = 50 * 2**20
    assert rotation_sets(10 * l2, l2, 2048) == 1
    assert rotation_sets(l2, l2, 2048) == 3
    assert rotation_sets(1000, l2, 2048) == 2048
    assert rotation_sets(0, l2, 2048) == 1


def test_target_status():
    assert target_status(91.0, 90.0) == "PASS"
    assert target_status(89.9, 90.0) == "MISS"
    assert target_status(19.0, 20.0, higher_is_better=False) == "PASS"
    assert target_status(21.0, 20.0, higher_is_better=False) == "MISS"
    assert target_status(None, 20.0) == "n/a"


def _row(case: str, op: str, impl: str = "mlarope", ms: float | None = 1.0, **kw) -> Row:
    return Row(case, case, op, op, "fwd", impl, 16384, 10**9, ms=ms, **kw)


def test_judge_bandwidth_and_host_targets():
    suite = full_suite()
    cases = {c.key: c for c in suite.cases}
    q_inplace, kv_bwd = OPS_BY_KEY["q_inplace_fwd"], OPS_BY_KEY["kv_bwd"]

    r = _row("sbhd", "q_inplace_fwd", pct_copy=90.5)
    judge(r, q_inplace, cases["sbhd"])
    assert (r.target, r.status) == (">= 90% copy", "PASS")
    r = _row("sbhd", "kv_bwd", pct_copy=91.0)
    judge(r, kv_bwd, cases["sbhd"])
    assert (r.target, r.status) == (">= 92% copy", "MISS")
    r = _row("decode8", "q_inplace_fwd", host_us=25.0)
    judge(r, q_inplace, cases["decode8"])
    assert (r.target, r.status) == ("host <= 20 us", "MISS")
    r = _row("decode8", "q_inplace_fwd", impl="reference", host_us=5.0)  # only mlarope judged
    judge(r, q_inplace, cases["decode8"])
    assert r.status == ""


def test_scaling_checks():
    suite = full_suite()
    rows = [_row("thd4", "q_fwd", ms=1.0), _row("thd4096", "q_fwd", ms=1.05)]
    rows += [_row("thd4", "kv_bwd", ms=1.0), _row("thd4096", "kv_bwd", ms=1.2)]
    rows += [_row("thd4", "kv_fwd", ms=1.0)]  # no partner: no check
    checks = {c["op"]: c for c in scaling_checks(rows, suite)}
    assert set(checks) == {"q_fwd", "kv_bwd"}
    assert checks["q_fwd"]["status"] == "PASS"
    assert checks["kv_bwd"]["status"] == "MISS"
    assert checks["kv_bwd"]["value"] == pytest.approx(1.2)


def test_select_cases_and_names():
    suite = full_suite()
    assert [c.key for c in select_cases(suite, "decode")] == [
        "decode1", "decode8", "decode64", "decode256",
    ]  # fmt: skip
    assert [c.key for c in select_cases(suite, "thd4096,sbhd")] == ["sbhd", "thd4096"]
    assert len(select_cases(suite, "train")) == 6
    with pytest.raises(ValueError, match="unknown case 'thd5'"):
        select_cases(suite, "thd5")
    with pytest.raises(ValueError, match="unknown 'triton'"):
        select_names("triton", IMPLS, "impls")


def test_full_suite_shapes():
    suite = full_suite()
    thd = [c for c in suite.cases if c.layout == "thd" and not c.decode]
    assert {c.tokens for c in thd} == {16384}
    assert [c.n_seqs for c in thd] == [1, 4, 64, 1024, 4096]
    assert suite.cases[0].token_shape == (4096, 4)
    assert [c.tokens for c in suite.cases if c.decode] == [1, 8, 64, 256]


# ----------------------------------------------------------------------------- end to end
def test_dry_run_and_bad_options(capsys):
    assert bench.run(_args("--dry-run")) == 0
    out = capsys.readouterr().out
    assert "thd4096" in out and "kv_bwd" in out
    assert bench.run(_args("--dry-run", "--cases", "nope")) == 2
    assert bench.run(_args("--dry-run", "--impls", "mlarope,triton")) == 2


def test_cpu_smoke_writes_table_json_markdown_and_plot(tmp_path, capsys, monkeypatch):
    # The harness, not the kernels, is under test: CPU tensors take the PyTorch reference.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    out = tmp_path / "out"
    assert bench.run(_args("--cpu-smoke", "--out", str(out), "--cpu-reps", "3")) == 0
    printed = capsys.readouterr().out
    assert "copy ceiling" in printed and "kv fwd (no copy_v)" in printed

    data = json.loads((out / "bench.json").read_text())
    suite = smoke_suite()
    assert data["meta"]["mode"] == "cpu-smoke"
    assert "partial" not in data["meta"]
    assert data["meta"]["copy"]["tbps"] > 0
    rows = data["rows"]
    assert len(rows) == len(suite.cases) * len(OPS) * 2  # mlarope and reference
    for r in rows:
        assert r["note"] == "", r
        assert 0 < r["ms_q20"] <= r["ms"] <= r["ms_q80"], r
        assert r["bytes"] == spec_bytes(OPS_BY_KEY[r["op"]], r["tokens"], suite.dims)
        assert r["pct_copy"] > 0
        decode_fwd = r["case"].startswith("decode") and r["direction"] == "fwd"
        assert (r["host_us"] is not None) == decode_fwd, r
        assert (r["host_floor_us"] is not None) == decode_fwd, r
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "bench.md").read_text()
    assert md.startswith("| case | op | MB | mlarope us (% copy) | reference us (% copy) |")
    assert md.count("\n") >= len(suite.cases) * len(OPS) + 2

    # --merge of a run with itself gives the same rows, and writes explicit paths
    merged_json, merged_png = tmp_path / "m.json", tmp_path / "m.png"
    args = _args(
        "--merge", str(out / "bench.json"), str(out / "bench.json"),
        "--json", str(merged_json), "--plot", str(merged_png),
    )  # fmt: skip
    assert bench.run(args) == 0
    merged = json.loads(merged_json.read_text())
    assert [(r["case"], r["op"], r["impl"]) for r in merged["rows"]] == [
        (r["case"], r["op"], r["impl"]) for r in rows
    ]
    assert len(merged["meta"]["runs"]) == 2
    assert merged_png.exists()


def test_cli_knows_bench():
    assert cli.main(["bench", "--dry-run", "--cases", "decode1", "--ops", "q_fwd"]) == 0


@pytest.mark.gpu
def test_gpu_bench_runs_a_small_subset(tmp_path):
    args = _args(
        "--cases", "decode1,decode64", "--ops", "q_inplace_fwd,kv_bwd", "--impls",
        "mlarope,reference", "--rep-ms", "5", "--warmup-ms", "2", "--host-calls", "50",
        "--copy-mib", "256", "--json", str(tmp_path / "b.json"),
    )  # fmt: skip
    assert bench.run(args) == 0
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert len(rows) == 8
    assert all(r["note"] == "" and r["ms"] > 0 and r["method"].startswith("graph") for r in rows)


@pytest.mark.parametrize("op", [s.key for s in OPS])
def test_builders_agree_with_the_reference(op, device):
    """Each timed mlarope callable computes what the reference callable of the same row does
    (in place ones in their input set), so a row never times the wrong kernel: fp32 data, the
    Triton kernels against the PyTorch reference, within a few units of fp32 rounding."""
    suite, spec, inp, pos = _tiny_thd_case(op, torch.device(device))
    builders = Builders(suite, "default", None)
    results = []
    for build in (builders.mlarope, builders.reference):
        mine = Inputs(*(t.clone() if t is not None else None for t in vars(inp).values()))
        out = build(spec, mine, pos)()
        if spec.op == "q" and spec.inplace and build == builders.mlarope:
            # In place, both directions: the input set itself is rotated (the forward returns
            # it, the op-level backward returns nothing).
            assert out is (None if spec.direction == "bwd" else mine.x)
            assert not torch.equal(mine.x, inp.x)
        outs = out if isinstance(out, tuple) else (mine.x,) if out is None else (out,)
        results.append([t for t in outs if t.numel()])
    for got, want in zip(*results, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_retune_megatron_clears_every_autotuner_cache():
    """Megatron-Core's kernels keep one tuned configuration per (head and channel counts,
    dtypes): ``retune_megatron`` empties those caches before each case, and touches nothing
    else in the module."""
    import types

    import triton
    import triton.language as tl

    @triton.autotune(configs=[triton.Config({"B": 1}), triton.Config({"B": 2})], key=["n"])
    @triton.jit
    def kernel(x_ptr, n, B: tl.constexpr):
        pass

    plain = {"kept": 1}
    module = types.SimpleNamespace(rotary_fwd_q_kernel=kernel, other=plain, name="x")
    kernel.cache[(64, "torch.bfloat16")] = triton.Config({"B": 1})
    assert retune_megatron(module) == 1
    assert kernel.cache == {} and plain == {"kept": 1}
    # The Megatron builder clears them before it builds a case's callable (here it then stops:
    # CPU tensors are not Megatron's).
    suite, spec, inp, pos = _tiny_thd_case("q_inplace_fwd", torch.device("cpu"))
    kernel.cache[(64, "torch.bfloat16")] = triton.Config({"B": 1})
    with pytest.raises(Unsupported, match="needs CUDA"):
        Builders(suite, "default", module).megatron_impl(spec, inp, pos)
    assert kernel.cache == {}
    no_kernels = Builders(suite, "default", types.SimpleNamespace())
    with pytest.warns(UserWarning, match="no autotuner"), pytest.raises(Unsupported):
        no_kernels.megatron_impl(spec, inp, pos)


def _tiny_thd_case(op: str, device: torch.device):
    suite = Suite(
        MlaDims(heads=3, nope=16, rope=32, k_dim=16, v_dim=8), (), 64, ("", ""), torch.float32
    )
    case = Case("thd3", "thd 24 / 3 seq", "thd", (24,), n_seqs=3)
    spec = OPS_BY_KEY[op]
    pos = make_positional(suite, case, device, torch.Generator().manual_seed(0))
    (inp,) = make_inputs(suite, case, spec, device, 1)
    return suite, spec, inp, pos


@pytest.mark.parametrize("op", [spec.key for spec in OPS])
def test_timed_calls_search_as_the_ops_do(op, device, monkeypatch):
    """A timed forward with ``cu_seqlens`` searches on every call, as the public API does; a
    timed backward reads one search made when its callable is built, as an autograd backward
    reads its forward's (``ops.search_for_backward``). A repeated call's launch plan replays
    the search launch (tests/test_thd_plans.py): counted there too."""
    from mlarope.kernels import _launch, lookup

    suite, spec, inp, pos = _tiny_thd_case(op, torch.device(device))
    searches = []
    search = lookup.launch_cu_seqlens_search
    monkeypatch.setattr(
        lookup, "launch_cu_seqlens_search", lambda *a, **k: (searches.append(1), search(*a, **k))
    )
    replay = _launch.Launch.__call__

    def counted_replay(self, args):
        if self.launcher is lookup._launch_search:
            searches.append(1)
        return replay(self, args)

    monkeypatch.setattr(_launch.Launch, "__call__", counted_replay)
    call = Builders(suite, "default", None).mlarope(spec, inp, pos)
    built = len(searches)
    call()
    call()
    if spec.direction == "bwd":
        assert (built, len(searches)) == (1, 1)
    else:
        assert (built, len(searches)) == (0, 2)
