"""One rank of the context-parallel test (tests/test_context_parallel.py), run as a script.

Every rank builds the same global batch from a fixed seed, takes its load-balanced shard
(rank ``r`` holds chunks ``r`` and ``2 * cp_size - 1 - r`` of every sequence), runs the query op
(out of place and in place) and the key/value op forward and backward with its ``cp_rank`` and
the *global* ``cu_seqlens``, all-gathers every rank's outputs and gradients, puts the tokens back
in global order and compares them bitwise (``torch.equal``) with the single-process result on
the whole batch (``cp_size=1``, same dtype and device). The verdicts go to ``<out>/rank<r>.json``.

The split helpers at the top import nothing from mlarope, so the test module can import them.
``main`` sets ``TRITON_INTERPRET`` (CPU) before mlarope, and with it triton, is first imported.

    python tests/cp_worker.py --rank 0 --world-size 2 --port 29500 --backend gloo \\
        --device cpu --out /tmp/cp
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch

# Shapes: H heads, N nope and R rope channels of q, K and V channels of kv (R = the table's width).
H, N, R, K, V = 3, 16, 32, 16, 24
TABLE_ROWS = 64
SEED = 1234


# ----------------------------------------------------------------------------- the split
def seq_lengths(cp_size: int) -> list[int]:
    """Global lengths of the packed thd batch: multiples of ``2 * cp_size`` in 0..24 tokens, with
    an empty sequence in the middle and chunks of odd length (cp_size 2: chunks of 3, 5, 2)."""
    unit = 2 * cp_size
    multiples = (3, 0, 5, 2) if unit * 5 <= 24 else (3, 0, 1, 2)
    return [unit * m for m in multiples]


def sbhd_length(cp_size: int) -> int:
    """Global sequence length of the sbhd/bshd cases (chunks of 5 tokens for cp 2, 3 for cp 4)."""
    return 2 * cp_size * (5 if cp_size <= 2 else 3)


def shard_index(lengths: list[int], cp_size: int, cp_rank: int, padding: int = 0) -> torch.Tensor:
    """Global token indices that rank ``cp_rank`` holds, in its local order (int64 ``[T / cp]``).

    Sequences are packed one after another; sequence ``i`` (length ``L``, cut into ``2 * cp_size``
    chunks of ``L / (2 * cp_size)`` tokens) contributes chunk ``cp_rank`` then chunk
    ``2 * cp_size - 1 - cp_rank``. ``padding`` tokens per rank follow, taken from the global
    padding after ``sum(lengths)`` (rank ``r`` gets the ``r``-th slice of ``padding`` tokens).
    """
    parts = []
    start = 0
    for length in lengths:
        if length % (2 * cp_size) != 0:
            raise ValueError(f"length {length} is not a multiple of 2*cp_size = {2 * cp_size}")
        chunk = length // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            parts.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
        start += length
    parts.append(torch.arange(start + cp_rank * padding, start + (cp_rank + 1) * padding))
    return torch.cat(parts).to(torch.int64)


def unshard(local: list[torch.Tensor], index: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Inverse of the split: every rank's ``local`` tensor put back at its global ``index``
    along ``dim`` (0 for thd and sbhd, 1 for bshd)."""
    n_global = sum(int(i.numel()) for i in index)
    shape = list(local[0].shape)
    shape[dim] = n_global
    out = local[0].new_empty(shape)
    for x, i in zip(local, index, strict=True):
        out.index_copy_(dim, i.to(out.device), x)
    return out


# ----------------------------------------------------------------------------- the cases
@dataclass(frozen=True)
class Case:
    name: str
    layout: str  # "thd" | "sbhd" | "bshd"
    dtype: torch.dtype
    padding: int = 0  # thd: unrotated padding tokens per rank after the sequences
    cu_dtype: torch.dtype = torch.int32
    interleaved: bool = True
    interleaved_out: bool = False
    batch: int = 2  # sbhd / bshd


CASES = {
    c.name: c
    for c in (
        Case("thd-bf16", "thd", torch.bfloat16),
        # fp32, int64 cu_seqlens, the other pair layouts on both sides.
        Case(
            "thd-fp32",
            "thd",
            torch.float32,
            cu_dtype=torch.int64,
            interleaved=False,
            interleaved_out=True,
        ),
        Case("thd-bf16-padded", "thd", torch.bfloat16, padding=3),
        # float64 always runs the PyTorch reference backend (mlarope.reference).
        Case("thd-fp64-reference", "thd", torch.float64),
        Case("sbhd-bf16", "sbhd", torch.bfloat16),
        Case("bshd-bf16", "bshd", torch.bfloat16),
    )
}


def _randn(gen: torch.Generator, shape: tuple[int, ...], dtype, device) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype).to(device)


def global_batch(case: Case, cp_size: int, device: torch.device) -> dict:
    """The whole batch (identical on every rank: fixed seed, generated on the CPU), upstream
    gradients included, plus each rank's shard index along the token dim ``seq_dim``."""
    gen = torch.Generator().manual_seed(SEED)
    if case.layout == "thd":
        lengths = seq_lengths(cp_size)
        tokens: tuple[int, ...] = (sum(lengths) + cp_size * case.padding,)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=case.cu_dtype)
        seq_dim = 0
    else:
        lengths = [sbhd_length(cp_size)]
        seq, batch = lengths[0], case.batch
        tokens = (seq, batch) if case.layout == "sbhd" else (batch, seq)
        cu = None
        seq_dim = 0 if case.layout == "sbhd" else 1
    shapes = {
        "q": (*tokens, H, N + R),
        "kv": (*tokens, H, K + V),
        "k_pe": (*tokens, 1, R),
        "g_q": (*tokens, H, N + R),
        "g_k": (*tokens, H, K + R),
        "g_v": (*tokens, H, V),
    }
    data = {name: _randn(gen, shape, case.dtype, device) for name, shape in shapes.items()}
    data["cu_seqlens"] = cu.to(device) if cu is not None else None
    data["index"] = [
        shard_index(lengths, cp_size, r, case.padding if case.layout == "thd" else 0)
        for r in range(cp_size)
    ]
    data["seq_dim"] = seq_dim
    return data


# ----------------------------------------------------------------------------- the ops
def run_ops(mlarope, case: Case, x: dict, cos, sin, cu_seqlens, cp_rank: int, cp_size: int):
    """Query op out of place and in place, key/value op, forward and backward.

    ``x`` holds this process's ``q, kv, k_pe`` and upstream gradients ``g_q, g_k, g_v``. Returns
    the outputs and gradients by name, and whether the in-place call returned its input.
    """
    kw = dict(layout=case.layout, cu_seqlens=cu_seqlens, cp_rank=cp_rank, cp_size=cp_size)
    flags = dict(interleaved=case.interleaved, interleaved_out=case.interleaved_out)
    validate = cu_seqlens is not None  # host checks of the global cu_seqlens under CP
    res = {}

    q = x["q"].detach().clone().requires_grad_()
    out = mlarope.apply_rope_q(q, cos, sin, **kw, **flags, validate=validate)
    # A fresh gradient each time: the in-place backward may rotate its incoming gradient in place.
    out.backward(x["g_q"].clone())
    res["q_out"], res["dq"] = out.detach(), q.grad

    q = x["q"].detach().clone().requires_grad_()
    q_in = q.clone()
    out = mlarope.apply_rope_q(q_in, cos, sin, **kw, **flags, inplace=True, validate=validate)
    same_tensor = out is q_in
    out.backward(x["g_q"].clone())
    res["q_out_inplace"], res["dq_inplace"] = out.detach(), q.grad

    kv = x["kv"].detach().clone().requires_grad_()
    k_pe = x["k_pe"].detach().clone().requires_grad_()
    k, v = mlarope.apply_rope_kv(kv, k_pe, cos, sin, k_dim=K, **kw, **flags, validate=validate)
    torch.autograd.backward([k, v], [x["g_k"].clone(), x["g_v"].clone()])
    res.update(k=k.detach(), v=v.detach(), dkv=kv.grad, dk_pe=k_pe.grad)
    return res, same_tensor


# ----------------------------------------------------------------------------- gathering
def all_gather_tensors(tensors: dict[str, torch.Tensor], world: int) -> list[dict]:
    """Every rank's ``tensors`` (same names, shapes and dtypes on all ranks), as raw bytes in one
    ``all_gather``, so the transport is bitwise whatever the backend supports for the dtype."""
    import torch.distributed as dist

    names = list(tensors)
    buf = torch.cat([tensors[n].detach().contiguous().view(torch.uint8).reshape(-1) for n in names])
    sizes = [torch.zeros(1, dtype=torch.int64, device=buf.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([buf.numel()], dtype=torch.int64, device=buf.device))
    if any(int(s) != buf.numel() for s in sizes):
        raise RuntimeError(f"ranks hold different amounts of data: {[int(s) for s in sizes]}")
    bufs = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(bufs, buf)
    gathered = []
    for b in bufs:
        offset, one = 0, {}
        for n in names:
            t = tensors[n]
            nbytes = t.numel() * t.element_size()
            one[n] = b[offset : offset + nbytes].clone().view(t.dtype).reshape(t.shape)
            offset += nbytes
        gathered.append(one)
    return gathered


def compare(name: str, got: torch.Tensor, want: torch.Tensor, expect_equal: bool = True) -> dict:
    equal = got.shape == want.shape and torch.equal(got, want)
    result = {"name": name, "equal": bool(equal), "expect_equal": expect_equal}
    if got.shape != want.shape:
        result["detail"] = f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    elif not equal:
        diff = (got.double() - want.double()).abs()
        bad = ~((got == want) | (got.isnan() & want.isnan()))
        result["detail"] = (
            f"{int(bad.sum())} of {got.numel()} elements differ, max |diff| "
            f"{float(diff.nan_to_num(float('inf')).max()):.4g}"
        )
    return result


def run_case(mlarope, case: Case, rank: int, world: int, device: torch.device) -> dict:
    data = global_batch(case, world, device)
    cfg = mlarope.YarnConfig(dim=R)
    cos, sin = cfg.cos_sin(TABLE_ROWS, device=device)
    names = ("q", "kv", "k_pe", "g_q", "g_k", "g_v")
    dim = data["seq_dim"]

    # This rank's shard, its cp_rank and the global cu_seqlens.
    index = data["index"]
    local = {n: data[n].index_select(dim, index[rank].to(device)).contiguous() for n in names}
    mine, same_tensor = run_ops(mlarope, case, local, cos, sin, data["cu_seqlens"], rank, world)
    # Negative control: the same shard with a wrong cp_rank must not match (the oracle can fail).
    mine["q_out_wrong_rank"] = mlarope.apply_rope_q(
        local["q"], cos, sin, layout=case.layout, cu_seqlens=data["cu_seqlens"],
        cp_rank=(rank + 1) % world, cp_size=world, interleaved=case.interleaved,
        interleaved_out=case.interleaved_out,
    )  # fmt: skip
    gathered = all_gather_tensors(mine, world)
    checks = [{"name": "inplace returns its input", "equal": same_tensor, "expect_equal": True}]

    if rank == 0:  # the gathered data is the same everywhere: one rank compares (CPU time)
        ref, _ = run_ops(mlarope, case, data, cos, sin, data["cu_seqlens"], 0, 1)
        for name, want in ref.items():
            got = unshard([g[name] for g in gathered], index, dim)
            checks.append(compare(name, got, want))
        got = unshard([g["q_out_wrong_rank"] for g in gathered], index, dim)
        checks.append(compare("q_out_wrong_rank (control)", got, ref["q_out"], False))
    return {
        "checks": checks,
        "triton_kernels": mlarope.ops.use_triton(local["q"]),
        "local_tokens": int(index[rank].numel()),
        "global_tokens": int(sum(i.numel() for i in index)),
    }


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--backend", choices=("gloo", "nccl"), required=True)
    p.add_argument("--device", choices=("cpu", "cuda"), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--timeout", type=float, default=60.0, help="collective timeout, seconds")
    p.add_argument("--launched-at", type=float, default=None, help="time.time() of the launch")
    args = p.parse_args(argv)
    launched = args.launched_at or time.time()

    def log(msg: str) -> None:
        print(f"rank {args.rank}: {time.time() - launched:6.2f} s after launch: {msg}", flush=True)

    log("torch imported")

    if args.device == "cpu":
        # The CPU lane runs the Triton kernels under the interpreter: set before triton loads.
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set")
        os.environ["TRITON_INTERPRET"] = "1"
    import torch.distributed as dist

    import mlarope

    if args.device == "cuda":
        torch.cuda.set_device(args.rank)
        device = torch.device("cuda", args.rank)
    else:
        device = torch.device("cpu")
    log("mlarope imported")
    started = time.perf_counter()
    dist.init_process_group(
        backend=args.backend,
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=args.rank,
        world_size=args.world_size,
        timeout=timedelta(seconds=args.timeout),
        **({"device_id": device} if args.device == "cuda" else {}),
    )
    report = {
        "rank": args.rank,
        "world_size": args.world_size,
        "backend": args.backend,
        "device": str(device),
        "torch": torch.__version__,
        "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
        "cases": {},
    }
    log(f"process group up ({args.backend}, {args.world_size} ranks)")
    try:
        for name in args.cases.split(","):
            t0 = time.perf_counter()
            try:
                result = run_case(mlarope, CASES[name], args.rank, args.world_size, device)
            except Exception:
                result = {"error": traceback.format_exc()}
                report["cases"][name] = result
                raise  # the other ranks are stuck in a collective now: stop, let the parent see
            result["seconds"] = round(time.perf_counter() - t0, 3)
            log(f"{name} done")
            report["cases"][name] = result
    finally:
        report["seconds"] = round(time.perf_counter() - started, 3)
        path = os.path.join(args.out, f"rank{args.rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(path + ".tmp", path)
    dist.barrier()
    dist.destroy_process_group()
    log("finished")
    return 0


if __name__ == "__main__":
    code = main()
    # Skip the interpreter's teardown (about a second per process, and ranks share few cores):
    # the report is written and the process group destroyed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
