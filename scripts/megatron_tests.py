"""Megatron-LM's own MLA RoPE test file against mlarope.compat.megatron and against Megatron-Core's
kernels, side by side (the GPU lane's ``megatron_tests`` step; docs/megatron.md).

    python scripts/megatron_tests.py --megatron PATH --out DIR

``PATH`` is a Megatron-LM checkout (``megatron/`` and
``tests/unit_tests/fusions/test_mla_yarn_rope_apply.py`` are what is read; default
``$MEGATRON_LM``). The test file is copied, unmodified, into a scratch folder laid out as
Megatron's ``tests`` package, beside mlarope's stand-in for ``tests/unit_tests/test_utilities.py``
(``scripts/megatron_shim``); a root conftest there picks the implementation the file imports
(``MLAROPE_MEGATRON_IMPL``: ``megatron`` or ``mlarope``, ``mlarope_swap``). Then:

1. the whole file in ``--processes`` separate pytest processes per implementation (Megatron's
   flake is decided per process, by its autotuner's pick), several at a time: every test's
   pass / fail count, side by side;
2. the in-place and key/value test bodies, every parametrization, repeated ``--thd-repeats``
   (thd) and ``--sbhd-repeats`` (sbhd) times in one process per implementation;
3. the ``k_pos_emb`` gradient of the key/value test on its own inputs (captured from the test
   body), against an fp64 truth computed from the same bf16 inputs and tables: the test's
   PyTorch reference, Megatron's kernel, mlarope's default (Megatron's rounding) and
   ``rounding="exact"``;
4. mlarope's Megatron-Core layer test (``tests/test_integration_megatron.py``, the MLA layer
   with the patch against Megatron's unfused path).

Writes ``DIR/megatron_tests.md`` (the tables for docs/megatron.md) and
``DIR/megatron_tests.json`` (everything). ``--worker`` runs one piece in this process (the
script calls itself).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

from _megatron_report import ATOL, IMPLS, RTOL, markdown, verdict

REPO = Path(__file__).resolve().parent.parent
SHIM = Path(__file__).resolve().parent / "megatron_shim"
TEST_FILE = Path("tests/unit_tests/fusions/test_mla_yarn_rope_apply.py")


# ---------------------------------------------------------------------------------------------
# the scratch folder and the environment of every child process
# ---------------------------------------------------------------------------------------------


def make_workspace(megatron: Path) -> Path:
    """``tests/unit_tests/{test_utilities.py, fusions/test_mla_yarn_rope_apply.py}`` as packages,
    the swap plugin as the root conftest, and a pytest.ini (the scratch folder is the rootdir)."""
    source = megatron / TEST_FILE
    if not source.is_file():
        raise SystemExit(f"{source} not found: --megatron must be a Megatron-LM checkout")
    root = Path(tempfile.mkdtemp(prefix="mlarope-megatron-tests-"))
    fusions = root / TEST_FILE.parent
    fusions.mkdir(parents=True)
    for package in (root / "tests", root / "tests/unit_tests", fusions):
        (package / "__init__.py").write_text("")
    shutil.copy(source, fusions / TEST_FILE.name)
    shutil.copy(SHIM / "test_utilities.py", root / "tests/unit_tests/test_utilities.py")
    for name in ("conftest.py", "mlarope_swap.py", "pytest.ini"):
        shutil.copy(SHIM / name, root / name)
    return root


def child_env(workspace: Path, megatron: Path, impl: str | None = None) -> dict[str, str]:
    """The scratch folder first (Megatron's ``tests`` package is the stand-in's), then the
    Megatron-LM checkout (ahead of any installed megatron-core), then mlarope's sources."""
    env = dict(os.environ)
    paths = [str(workspace), str(megatron), str(REPO / "src")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    env["MEGATRON_LM"] = str(megatron)
    if impl is not None:
        env["MLAROPE_MEGATRON_IMPL"] = impl
    return env


def run(cmd: list[str], env: dict, cwd: Path, timeout: float) -> tuple[int, str, float]:
    start = time.perf_counter()
    try:
        done = subprocess.run(
            cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
        )
        rc, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        rc = 124
        out = f"timed out after {timeout:.0f} s\n{(e.stdout or b'')!s}{(e.stderr or b'')!s}"
    return rc, out, time.perf_counter() - start


# ---------------------------------------------------------------------------------------------
# 1. the whole file, one process at a time per run
# ---------------------------------------------------------------------------------------------


def parse_junit(path: Path) -> dict[str, dict]:
    """``{test id: {"outcome": passed|failed|error|skipped, "message": first line}}``."""
    results: dict[str, dict] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        classname = case.get("classname", "").rpartition(".")[2]
        name = case.get("name", "")
        module = "test_mla_yarn_rope_apply"
        test_id = name if classname == module else f"{classname}::{name}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = (child.get("message") or child.text or "").strip().splitlines()
                message = message[0][:300] if message else ""
                break
        results[test_id] = {"outcome": outcome, "message": message}
    return results


def pytest_run(workspace: Path, megatron: Path, impl: str, index: int, timeout: float) -> dict:
    junit = workspace / f"junit-{impl}-{index}.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        str(TEST_FILE),
        f"--junitxml={junit}",
        "-o",
        "junit_family=xunit1",
    ]
    rc, out, seconds = run(cmd, child_env(workspace, megatron, impl), workspace, timeout)
    results = parse_junit(junit) if junit.exists() else {}
    return {
        "impl": impl,
        "index": index,
        "rc": rc,
        "seconds": round(seconds, 1),
        "tests": results,
        "tail": out[-1500:] if rc not in (0, 1) or not results else "",
    }


def tally(runs: list[dict]) -> dict[str, dict[str, dict]]:
    """``{test id: {impl: {"passed": n, "failed": n, "skipped": n, "messages": [...]}}}``."""
    table: dict[str, dict[str, dict]] = {}
    for r in runs:
        for test_id, res in r["tests"].items():
            cell = table.setdefault(test_id, {}).setdefault(
                r["impl"], {"passed": 0, "failed": 0, "skipped": 0, "messages": []}
            )
            key = "failed" if res["outcome"] in ("failed", "error") else res["outcome"]
            cell[key] += 1
            if key == "failed" and res["message"] not in cell["messages"]:
                cell["messages"].append(res["message"])
    return table


# ---------------------------------------------------------------------------------------------
# workers: run inside a child process, with the implementation installed before the import
# ---------------------------------------------------------------------------------------------


def load_test_module(impl: str):
    import importlib

    import mlarope_swap

    mlarope_swap.install(impl)
    return importlib.import_module("tests.unit_tests.fusions.test_mla_yarn_rope_apply")


def worker_repeat(impl: str, thd_repeats: int, sbhd_repeats: int) -> dict:
    """2. Every parametrization of the in-place and key/value bodies, repeated in one process."""
    mod = load_test_module(impl)
    inplace, kv_split = mod._test_fused_mla_rope_inplace, mod._test_fused_mla_rope_kv_split
    bodies = []
    for fmt in ("sbhd", "thd"):
        for inverse in (False, True):
            for ril in (False, True):
                name = f"inplace[{fmt}-inverse={inverse}-ril={ril}]"
                body = functools.partial(inplace, fmt, inverse=inverse, remove_interleaving=ril)
                bodies.append((name, fmt, body))
        for ril in (False, True):
            body = functools.partial(kv_split, fmt, remove_interleaving=ril)
            bodies.append((f"kv_split[{fmt}-ril={ril}]", fmt, body))
    results = {}
    for name, fmt, body in bodies:
        repeats = thd_repeats if fmt == "thd" else sbhd_repeats
        failed, messages, start = 0, [], time.perf_counter()
        for _ in range(repeats):
            try:
                body()
            except AssertionError as e:
                failed += 1
                line = str(e).strip().splitlines()[0][:200] if str(e).strip() else "AssertionError"
                if line not in messages:
                    messages.append(line)
            except Exception as e:  # an error, not a mismatch: report it, do not count it
                return {
                    "error": f"{name}: {type(e).__name__}: {e}",
                    "trace": traceback.format_exc(),
                }
        seconds = time.perf_counter() - start
        results[name] = {
            "runs": repeats,
            "failed": failed,
            "messages": messages[:3],
            "seconds": round(seconds, 1),
        }
    return {"impl": impl, "bodies": results}


def _kv_truth(rec: dict, emb_dim: int, k_dim: int):
    """fp64 ``k_pos_emb`` gradient from the captured bf16 key gradient and bf16 tables:
    the sum over heads, then the transpose rotation, written as interleaved pairs."""
    import torch

    dk = rec["dk"].double()
    tokens = dk.shape[:-2]
    g = dk[..., k_dim:].sum(-2).reshape(-1, emb_dim)  # [M, R], the key's rope layout
    half = emb_dim // 2
    if rec["ril"]:
        ga, gb = g[:, 0::2], g[:, 1::2]
    else:
        ga, gb = g[:, :half], g[:, half:]
    cos = rec["cos"].double().reshape(-1, emb_dim)
    sin = rec["sin"].double().reshape(-1, emb_dim)
    if rec["cu"] is None:
        pos = torch.arange(tokens[0], device=g.device).repeat_interleave(tokens[1])
    else:
        cu = rec["cu"].long()
        t = torch.arange(g.shape[0], device=g.device)
        seq = torch.searchsorted(cu, t, right=True) - 1
        pos = t - cu[seq]
    c, s = cos[pos], sin[pos]
    da = ga * c[:, :half] + gb * s[:, half:]
    db = gb * c[:, half:] - ga * s[:, :half]
    return torch.stack((da, db), -1).reshape(*tokens, 1, emb_dim)


def _grade(x, truth, reference=None) -> dict:
    """Elements beyond the test's tolerance against the truth, the worst error, the share that
    is correctly rounded (within half a bf16 ulp of the truth), and, given the test's reference,
    whether the test's own comparison (reference vs this result) fails."""
    import torch

    x64 = x.double()
    err = (x64 - truth).abs()
    exponent = torch.floor(torch.log2(truth.abs().clamp_min(2.0**-126)))
    half_ulp = torch.exp2(exponent - 8)
    out = {
        "beyond_tol": int((err > ATOL + RTOL * truth.abs()).sum()),
        "max_abs_err": float(err.max()),
        "correctly_rounded": float((err <= half_ulp).double().mean()),
    }
    if reference is not None:
        diff = (reference.double() - x64).abs()
        out["test_fails"] = bool((diff > ATOL + RTOL * x64.abs()).any())
    return out


def worker_fp64(sbhd_trials: int, thd_trials: int, impl: str = "megatron") -> dict:
    """3. The key/value test body, run with ``impl``'s function (Megatron's kernel) through a
    recorder that keeps its inputs and upstream gradients; then each implementation's
    ``k_pos_emb`` gradient on them."""
    import torch
    from megatron.core.models.common.embeddings import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mlarope.compat import megatron as ours

    mod = load_test_module(impl)
    theirs = mod.fused_mla_rope_kv_split
    records: list[dict] = []

    def recorder(
        kv,
        emb,
        cos,
        sin,
        emb_dim,
        k_dim,
        v_dim,
        cu_seqlens_kv=None,
        remove_interleaving=False,
        **kwargs,
    ):
        rec = {
            "kv": kv.detach().clone(),
            "emb_leaf": emb,
            "emb": emb.detach().clone(),
            "cos": cos,
            "sin": sin,
            "cu": cu_seqlens_kv,
            "ril": remove_interleaving,
        }
        key, value = theirs(
            kv,
            emb,
            cos,
            sin,
            emb_dim,
            k_dim,
            v_dim,
            cu_seqlens_kv=cu_seqlens_kv,
            remove_interleaving=remove_interleaving,
            **kwargs,
        )
        key.register_hook(lambda g: rec.__setitem__("dk", g.detach().clone()))
        value.register_hook(lambda g: rec.__setitem__("dv", g.detach().clone()))
        records.append(rec)
        return key, value

    mod.fused_mla_rope_kv_split = recorder
    emb_dim, k_dim, v_dim, heads = 64, 128, 128, 32
    config = TransformerConfig(
        num_attention_heads=heads,
        num_layers=1,
        rotary_interleaved=False,
        multi_latent_attention=True,
    )
    rows = {}
    for fmt, trials in (("sbhd", sbhd_trials), ("thd", thd_trials)):
        seqlen = 1024 if fmt == "sbhd" else 45  # the test's table lengths
        freqs, mscale = YarnRotaryEmbedding(emb_dim, original_max_position_embeddings=seqlen)(
            seqlen, 0
        )
        grades: dict[str, list[dict]] = {
            k: [] for k in ("reference", "megatron", "mlarope", "mlarope_exact")
        }
        for trial in range(trials):
            records.clear()
            # Megatron's kernel against the reference: graded below, whatever the test says.
            with contextlib.suppress(AssertionError):
                mod._test_fused_mla_rope_kv_split(fmt, remove_interleaving=bool(trial % 2))
            (rec,) = records
            cos_ref = (torch.cos(freqs) * mscale).to(rec["cos"].dtype)
            if not torch.equal(cos_ref.reshape(rec["cos"].shape), rec["cos"]):
                raise RuntimeError("the recomputed table differs from the test's")
            # the test's PyTorch reference, recomputed on the captured inputs
            emb_ref = rec["emb"].clone().requires_grad_()
            pe = apply_rotary_pos_emb(
                emb_ref,
                freqs,
                config,
                cu_seqlens=rec["cu"],
                mscale=mscale,
                max_seqlen=None if rec["cu"] is None else seqlen,
                cp_group=mod.FakeCPGroup(),
                mla_rotary_interleaved=True,
                mla_output_remove_interleaving=rec["ril"],
            )
            pe = pe.expand(*pe.shape[:-2], heads, emb_dim)
            kv_ref = rec["kv"].clone().requires_grad_()
            k_nope, v_ref = torch.split(kv_ref, [k_dim, v_dim], dim=-1)
            k_ref = torch.cat([k_nope, pe], dim=-1)
            torch.autograd.backward((k_ref, v_ref), (rec["dk"], rec["dv"]))
            results = {"reference": emb_ref.grad, "megatron": rec["emb_leaf"].grad}
            for rounding in ("megatron", "exact"):
                kv = rec["kv"].clone().requires_grad_()
                emb = rec["emb"].clone().requires_grad_()
                key, value = ours.fused_mla_rope_kv_split(
                    kv,
                    emb,
                    rec["cos"],
                    rec["sin"],
                    emb_dim,
                    k_dim,
                    v_dim,
                    cu_seqlens_kv=rec["cu"],
                    remove_interleaving=rec["ril"],
                    rounding=rounding,
                )
                torch.autograd.backward((key, value), (rec["dk"], rec["dv"]))
                results["mlarope" if rounding == "megatron" else "mlarope_exact"] = emb.grad
            truth = _kv_truth(rec, emb_dim, k_dim)
            for name, grad in results.items():
                ref = None if name == "reference" else results["reference"]
                grades[name].append(_grade(grad, truth, ref))
        rows[fmt] = {
            name: {
                "trials": len(g),
                "beyond_tol": sum(x["beyond_tol"] for x in g),
                "trials_beyond_tol": sum(x["beyond_tol"] > 0 for x in g),
                "max_abs_err": max(x["max_abs_err"] for x in g),
                "correctly_rounded": min(x["correctly_rounded"] for x in g),
                "test_fails": sum(x.get("test_fails", False) for x in g),
            }
            for name, g in grades.items()
        }
    return {"rows": rows}


def worker_main(args) -> None:
    if args.worker == "repeat":
        result = worker_repeat(args.impl, args.thd_repeats, args.sbhd_repeats)
    else:
        result = worker_fp64(args.fp64_sbhd_trials, args.fp64_thd_trials, args.impl or "megatron")
    Path(args.result).write_text(json.dumps(result))


def run_worker(
    workspace: Path,
    megatron: Path,
    name: str,
    extra: list[str],
    timeout: float,
    impl: str | None = None,
) -> dict:
    result = workspace / f"{name}-{impl or 'both'}.json"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        name,
        "--result",
        str(result),
        *extra,
    ]
    if impl is not None:
        cmd += ["--impl", impl]
    rc, out, seconds = run(cmd, child_env(workspace, megatron), workspace, timeout)
    if rc != 0 or not result.exists():
        return {"error": f"worker {name} ({impl}) exited {rc}", "tail": out[-3000:]}
    data = json.loads(result.read_text())
    data["seconds"] = round(seconds, 1)
    return data


# ---------------------------------------------------------------------------------------------
# 4. mlarope's Megatron-Core layer test
# ---------------------------------------------------------------------------------------------


def layer_test(workspace: Path, megatron: Path, device: str, timeout: float) -> dict:
    junit = workspace / "junit-layer.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/test_integration_megatron.py",
        "--device",
        device,
        f"--junitxml={junit}",
        "-o",
        "junit_family=xunit1",
    ]
    env = child_env(workspace, megatron)
    env["PYTHONPATH"] = os.pathsep.join(  # mlarope's own tests package, not the scratch one
        p for p in env["PYTHONPATH"].split(os.pathsep) if p != str(workspace)
    )
    rc, out, seconds = run(cmd, env, REPO, timeout)
    tests = {}
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            outcome = "passed"
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[
                        child.tag
                    ]
            tests[case.get("name")] = outcome
    return {"rc": rc, "seconds": round(seconds, 1), "tests": tests, "tail": out[-2500:]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--megatron",
        default=os.environ.get("MEGATRON_LM"),
        help="Megatron-LM checkout (default: $MEGATRON_LM)",
    )
    p.add_argument("--out", default=None, help="folder for megatron_tests.{md,json}")
    p.add_argument("--processes", type=int, default=20)
    p.add_argument("--parallel", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)))
    p.add_argument("--thd-repeats", type=int, default=200)
    p.add_argument("--sbhd-repeats", type=int, default=20)
    p.add_argument("--fp64-sbhd-trials", type=int, default=10)
    p.add_argument("--fp64-thd-trials", type=int, default=100)
    p.add_argument(
        "--device",
        default=None,
        help="cuda (default when available) or cpu: on cpu only the plumbing runs (the test "
        "file's CUDA tests skip themselves)",
    )
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per child process")
    p.add_argument(
        "--budget",
        type=float,
        default=480.0,
        help="seconds for the whole step: pytest processes not started 60 s before it are "
        "reported as not run, and the summary is written in time (default 480)",
    )
    p.add_argument("--worker", choices=("repeat", "fp64"), help=argparse.SUPPRESS)
    p.add_argument("--impl", choices=IMPLS, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker_main(args)
        return 0
    if not args.megatron:
        p.error("--megatron (or MEGATRON_LM) must name a Megatron-LM checkout")
    import torch
    import triton

    megatron = Path(args.megatron).resolve()
    out = Path(args.out or os.environ.get("OUT") or "gpu-out")
    out.mkdir(parents=True, exist_ok=True)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    workspace = make_workspace(megatron)
    start = time.perf_counter()
    print(f"scratch folder {workspace}; device {device}", flush=True)

    deadline = start + args.budget
    cuda = device == "cuda"

    def remaining() -> float:
        return max(30.0, deadline - time.perf_counter())

    # Run 0 of each implementation first, alone: it compiles the kernels into Triton's cache.
    runs = [pytest_run(workspace, megatron, impl, 0, args.timeout) for impl in IMPLS]
    print(f"1. first processes: {time.perf_counter() - start:.0f} s", flush=True)

    def later_run(impl: str, index: int) -> dict | None:
        if time.perf_counter() > deadline - 60:  # out of budget: report it as not run
            return None
        return pytest_run(workspace, megatron, impl, index, min(args.timeout, remaining()))

    # Then everything else at once: the other processes ``parallel`` at a time, beside the
    # layer test and (on a GPU) the repeat and fp64 workers, each a process of its own.
    extras = 4 if cuda else 1
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.parallel + extras) as pool:
        layer_future = pool.submit(layer_test, workspace, megatron, device, remaining())
        if cuda:
            counts = [
                "--thd-repeats",
                str(args.thd_repeats),
                "--sbhd-repeats",
                str(args.sbhd_repeats),
            ]
            trials = [
                "--fp64-sbhd-trials",
                str(args.fp64_sbhd_trials),
                "--fp64-thd-trials",
                str(args.fp64_thd_trials),
            ]
            repeat_futures = {
                impl: pool.submit(
                    run_worker, workspace, megatron, "repeat", counts, remaining(), impl
                )
                for impl in IMPLS
            }
            fp64_future = pool.submit(run_worker, workspace, megatron, "fp64", trials, remaining())
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.parallel) as runners:
            jobs = [(impl, i) for i in range(1, args.processes) for impl in IMPLS]
            futures = [runners.submit(later_run, impl, i) for impl, i in jobs]
            later = [f.result() for f in futures]
        runs += [r for r in later if r is not None]
        not_run = sum(r is None for r in later)
        print(
            f"   whole file: {len(runs)} processes ({not_run} not run, out of budget), "
            f"{time.perf_counter() - start:.0f} s",
            flush=True,
        )
        if cuda:
            repeat = {impl: f.result() for impl, f in repeat_futures.items()}
            fp64 = fp64_future.result()
        else:
            repeat = {
                impl: {"error": "needs CUDA (the test bodies allocate on cuda)"} for impl in IMPLS
            }
            fp64 = {"error": "needs CUDA (the test bodies allocate on cuda)"}
        layer = layer_future.result()
    per_test = tally(runs)
    print(
        f"2-4. repeats, fp64, layer test (rc {layer['rc']}): {time.perf_counter() - start:.0f} s",
        flush=True,
    )

    text, ok = verdict(per_test, repeat, fp64, layer)
    commit = "unknown commit"
    head = megatron / "COMMIT"
    if head.exists():
        commit = head.read_text().strip()
    elif (megatron / ".git").exists():
        git = ["git", "-C", str(megatron), "rev-parse", "--short=12", "HEAD"]
        commit = subprocess.run(git, capture_output=True, text=True, check=False).stdout.strip()
    summary = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "CPU (plumbing only)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "megatron_path": str(megatron),
        "megatron_commit": commit,
        "command": " ".join(sys.argv),
        "processes": args.processes,
        "not_run": not_run,
        "seconds": time.perf_counter() - start,
        "per_test": per_test,
        "runs": runs,
        "repeat": repeat,
        "fp64": fp64,
        "layer": layer,
        "verdict": text,
        "ok": ok,
    }
    (out / "megatron_tests.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "megatron_tests.md").write_text(markdown(summary))
    print(markdown(summary))
    shutil.rmtree(workspace, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
