"""Context parallelism with real process groups: 2 and 4 CPU processes over gloo (the Triton
kernels under the interpreter; CPU lane, CI) and 2 GPUs over NCCL (``-m gpu``).

Each rank (tests/cp_worker.py) holds the load-balanced shard of a packed thd batch (or of the
sequence dim of sbhd / bshd input): chunks ``r`` and ``2 * cp_size - 1 - r`` of every sequence.
It runs both ops forward and backward with its ``cp_rank`` and the global ``cu_seqlens``; the
gathered outputs and gradients, put back in global order, must be bitwise equal to one process
on the whole batch. A wrong ``cp_rank`` must not be (a negative control: the oracle can fail).

One launch per world size runs every case (process start and torch import cost seconds); the
tests below read its per-case verdicts. A hang fails after ``MLAROPE_CP_TIMEOUT`` seconds
(default 180) instead of blocking CI. See docs/context_parallel.md.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import mlarope
from mlarope.positions import Positions, token_positions
from tests.cp_worker import (
    CASES,
    Case,
    global_batch,
    sbhd_length,
    seq_lengths,
    shard_index,
    unshard,
)

WORKER = Path(__file__).with_name("cp_worker.py")
# What rank 0 compares with the single-process result, bitwise.
COMPARED = {"q_out", "dq", "q_out_inplace", "dq_inplace", "k", "v", "dkv", "dk_pe"}
TIMEOUT_S = float(os.environ.get("MLAROPE_CP_TIMEOUT", "180"))
# Mandatory on our GPU machines (NVLink multicast / NVLS off).
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1"}  # fmt: skip


# --------------------------------------------------------------------------- launching
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_env(device: str) -> dict[str, str]:
    env = dict(os.environ)
    # The children import the same mlarope as this process, installed or from src/.
    pkg_root = str(Path(mlarope.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"  # several ranks share a few CPU cores
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
        env.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
    else:
        env.pop("TRITON_INTERPRET", None)
        env.update(GPU_ENV)
    return env


@dataclass
class Launch:
    """The ranks' JSON reports, or why there are none."""

    reports: list[dict]
    error: str | None
    seconds: float


def _tail(path: Path, n: int = 4000) -> str:
    text = path.read_text(errors="replace") if path.exists() else "(no output)"
    return text[-n:]


def launch(world_size: int, backend: str, device: str, out: Path) -> Launch:
    """Start ``world_size`` worker processes on a free 127.0.0.1 port; wait at most TIMEOUT_S.
    Another program may take the port between our probe and rank 0's bind: then retry once."""
    run = _launch_once(world_size, backend, device, out / "try0")
    if run.error is not None and "address already in use" in run.error.lower():
        run = _launch_once(world_size, backend, device, out / "try1")
    return run


def _launch_once(world_size: int, backend: str, device: str, out: Path) -> Launch:
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    env = _worker_env(device)
    started = time.monotonic()
    procs, logs = [], []
    for rank in range(world_size):
        log = out / f"rank{rank}.log"
        cmd = [
            sys.executable, str(WORKER), "--rank", str(rank), "--world-size", str(world_size),
            "--port", str(port), "--backend", backend, "--device", device, "--out", str(out),
            "--timeout", str(max(TIMEOUT_S - 10, 10)), "--launched-at", str(time.time()),
        ]  # fmt: skip
        with open(log, "wb") as f:
            procs.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT))
        logs.append(log)

    error = None
    deadline = started + TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed:
                # The others wait in a collective for the dead rank: give them a moment to
                # report their own error, then stop them.
                grace = time.monotonic() + 5
                while any(p.poll() is None for p in procs) and time.monotonic() < grace:
                    time.sleep(0.05)
                error = f"rank(s) {failed} exited with an error"
                break
            if time.monotonic() > deadline:
                error = f"timed out after {TIMEOUT_S:.0f} s (MLAROPE_CP_TIMEOUT)"
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    if error is None and any(p.returncode != 0 for p in procs):
        error = f"exit codes {[p.returncode for p in procs]}"
    reports = []
    for rank in range(world_size):
        path = out / f"rank{rank}.json"
        reports.append(json.loads(path.read_text()) if path.exists() else {})
    if error is None and not all(reports):
        error = "a rank wrote no report"
    if error is not None:
        logs_text = "\n".join(f"--- rank {r} ---\n{_tail(log)}" for r, log in enumerate(logs))
        error = f"{world_size} x {backend} ({device}): {error}\n{logs_text}"
    return Launch(reports, error, time.monotonic() - started)


def check_case(run: Launch, case: str) -> None:
    """Every rank ran ``case`` on the real kernels and every comparison came out as expected."""
    if run.error is not None:
        pytest.fail(run.error, pytrace=False)
    problems = []
    for report in run.reports:
        result = report["cases"][case]
        rank = report["rank"]
        if "error" in result:
            problems.append(f"rank {rank}: {result['error']}")
            continue
        expect_triton = CASES[case].dtype != torch.float64
        if result["triton_kernels"] != expect_triton:
            backend = "reference" if expect_triton else "Triton"
            interpret = report["triton_interpret"]
            problems.append(
                f"rank {rank}: ran the {backend} backend (TRITON_INTERPRET={interpret!r})"
            )
        for c in result["checks"]:
            if c["equal"] != c["expect_equal"]:
                what = "differs from" if c["expect_equal"] else "unexpectedly equals"
                problems.append(
                    f"rank {rank}: {c['name']} {what} the single-process result: "
                    f"{c.get('detail', '')}"
                )
    compared = {c["name"] for c in run.reports[0]["cases"][case].get("checks", [])}
    missing = sorted(COMPARED - compared)
    if missing:
        problems.append(f"rank 0 compared nothing for {missing}")
    assert not problems, f"{case}:\n" + "\n".join(problems)


# --------------------------------------------------------------------------- CPU lane: gloo
@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"gloo{n}")
def gloo_run(request, tmp_path_factory) -> Launch:
    n = request.param
    return launch(n, "gloo", "cpu", tmp_path_factory.mktemp(f"cp_gloo{n}"))


@pytest.mark.parametrize("case", list(CASES))
def test_gloo_cpu_matches_single_process(gloo_run, case):
    check_case(gloo_run, case)


# --------------------------------------------------------------------------- GPU lane: NCCL
@pytest.fixture(scope="module")
def nccl_run(tmp_path_factory) -> Launch:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs at least 2 CUDA devices")
    return launch(2, "nccl", "cuda", tmp_path_factory.mktemp("cp_nccl2"))


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_nccl_gpu_matches_single_process(nccl_run, case):
    check_case(nccl_run, case)


# --------------------------------------------------------------------------- the split itself
@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_shards_partition_the_batch(cp_size):
    """The shard indices cover every global token exactly once and ``unshard`` inverts them."""
    for lengths, padding in ((seq_lengths(cp_size), 0), (seq_lengths(cp_size), 3),
                             ([sbhd_length(cp_size)], 0)):  # fmt: skip
        index = [shard_index(lengths, cp_size, r, padding) for r in range(cp_size)]
        total = sum(lengths) + cp_size * padding
        assert torch.equal(torch.cat(index).sort().values, torch.arange(total))
        x = torch.randn(total, 2)
        assert torch.equal(unshard([x[i] for i in index], index, 0), x)
    assert shard_index([8], 2, 0).tolist() == [0, 1, 6, 7]  # chunks 0 and 3
    assert shard_index([8], 2, 1).tolist() == [2, 3, 4, 5]  # chunks 1 and 2


@pytest.mark.parametrize("cp_size", [2, 4])
@pytest.mark.parametrize("layout", ["thd", "sbhd", "bshd"])
def test_library_positions_follow_the_split(layout, cp_size):
    """mlarope's position map (the spec the kernels match) gives each local token the global
    position of the token the split put there; single process, no process group."""
    case = Case("positions", layout, torch.float32)
    data = global_batch(case, cp_size, torch.device("cpu"))
    if layout == "thd":
        cu = data["cu_seqlens"]
        seq = torch.repeat_interleave(torch.arange(cu.numel() - 1), cu.diff())
        global_pos = torch.arange(int(cu[-1])) - cu[seq]
        tokens = lambda r: (data["index"][r].numel(),)
    else:
        global_pos = torch.arange(sbhd_length(cp_size))
        tokens = lambda r: (
            (data["index"][r].numel(), 2) if layout == "sbhd" else (2, data["index"][r].numel())
        )
    for r in range(cp_size):
        positions = Positions(layout, data["cu_seqlens"], None, r, cp_size)
        pos, padding = token_positions(positions, tokens(r), torch.device("cpu"))
        assert not padding.any()
        pos = pos if layout != "sbhd" else pos[:, 0]
        pos = pos if layout != "bshd" else pos[0]
        assert torch.equal(pos, global_pos[data["index"][r]]), f"rank {r}"
