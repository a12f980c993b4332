"""``python -m mlarope stress``: randomized trials of both ops against the fp64 reference.

Each trial draws an op (query or key/value), a layout and position source (sbhd, bshd, thd with
``cu_seqlens`` incl. empty and one-token sequences and a padded tail, explicit ids, context
parallel ranks), a shape, dtypes, interleaving, in place or not, and a launch configuration
(the heuristic's or another valid tiling); it runs forward and backward through the launchers
with NaN-poisoned outputs and counts the elements outside the error model
(:mod:`mlarope.tools.errmodel`).

The negative control runs the deliberately racy in-place kernel
(:mod:`mlarope.tools.racy_control`) through the same comparison, to show that the harness
sees races where they exist. The interpreter runs programs one after another, so there the
control cannot race; its failure rate is a GPU figure.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass

import torch

from mlarope import reference
from mlarope.kernels._triton_compat import INTERPRETED
from mlarope.kernels.kv import KVLaunchConfig, rope_kv_backward_launch, rope_kv_launch
from mlarope.kernels.q import QLaunchConfig, rope_q_launch
from mlarope.positions import Positions

from ._console import Console, Table
from .errmodel import poisoned_like, rope_tolerance, wrong_elements
from .racy_control import racy_rope_inplace

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Trial:
    op: str
    layout: str
    source: str
    tokens: tuple
    heads: int
    nope: int
    rope: int
    v_dim: int
    dtype: str
    table_dtype: str
    interleaved: bool
    interleaved_out: bool
    inverse: bool
    inplace: bool
    cp_size: int
    cp_rank: int
    config: tuple | None
    seq_lens: tuple = ()
    variant: int = 0
    copy_v: bool = True  # key/value op only


def draw_trial(rng: random.Random, small: bool) -> Trial:
    variant_index = rng.randrange(len(variant_pool()))
    variant = variant_pool()[variant_index]
    dtype, table_dtype, interleaved, interleaved_out, inverse, inplace, config, dims = variant
    op, rope, heads, nope, v_dim = dims
    if small:
        heads, nope, v_dim = min(heads, 3), min(nope, 16), min(v_dim, 24)
    layout = rng.choice(["sbhd", "bshd", "thd", "thd"])
    source = (
        rng.choice(["cu", "cu", "ids", "seq"])
        if layout == "thd"
        else rng.choice(["seq", "seq", "ids"])
    )
    cp_size = rng.choice([1, 1, 2, 4]) if source != "ids" else 1
    cp_rank = rng.randrange(cp_size)
    budget = (1 << 12) if small else (1 << 21)  # elements per tensor
    per_token = heads * (nope + rope + v_dim)
    max_tokens = max(2, min(4096, budget // per_token))
    seq_lens: tuple = ()
    if layout == "thd":
        unit = 2 * cp_size
        if source == "cu":
            n_seqs = rng.choice([1, 3, 8, 64])
            lens = [unit * rng.randrange(0, max(1, max_tokens // (n_seqs * unit)) + 1) for _ in
                    range(n_seqs)]  # fmt: skip
            lens[rng.randrange(n_seqs)] = unit  # a short sequence (one token per chunk)
            seq_lens = tuple(lens)
            n_tokens = sum(lens) // cp_size + rng.choice([0, 0, 3])  # maybe a padded tail
        else:
            n_tokens = max(unit, (rng.randrange(1, max_tokens) // unit) * unit)
        tokens: tuple = (n_tokens,)
    else:
        seq = max(2 * cp_size, (rng.randrange(1, max(2, max_tokens // 2)) // (2 * cp_size)) * 2
                  * cp_size)  # fmt: skip
        batch = rng.choice([1, 2, 3])
        tokens = (seq, batch) if layout == "sbhd" else (batch, seq)
    return Trial(
        op=op, layout=layout, source=source, tokens=tokens, heads=heads, nope=nope, rope=rope,
        v_dim=v_dim, dtype=dtype, table_dtype=table_dtype, interleaved=interleaved,
        interleaved_out=interleaved_out, inverse=inverse, inplace=inplace, cp_size=cp_size,
        cp_rank=cp_rank, config=config, seq_lens=seq_lens, variant=variant_index,
        copy_v=op == "q" or not inplace,  # the variant's in-place flag picks copy_v for kv
    )  # fmt: skip


# Launch configurations: None is the heuristic's pick for the trial's shape; the others are
# (block_t, block_h, block_n or block_c, num_warps), from one-element tiles to wide ones.
_CONFIGS = [None, (1, 2, 16, 1), (2, 4, 32, 2), (4, 16, 64, 4), (1, 1, 16, 8), (1, 8, 128, 1)]


_DIMS = [  # (op, R, H, N or K, V): DeepSeek-V3, its tensor-parallel shards, odd head counts
    ("q", 64, 128, 128, 128), ("q", 64, 16, 128, 128), ("q", 32, 3, 48, 40),
    ("q", 128, 5, 0, 40), ("kv", 64, 128, 128, 128), ("kv", 64, 16, 128, 128),
    ("kv", 32, 3, 48, 40), ("kv", 128, 5, 16, 40),
]  # fmt: skip


@functools.cache
def variant_pool(size: int = 24) -> list[tuple]:
    """Kernel variants (the compile-time choices: dtypes, interleaving, inverse, in place,
    launch config, and the op with its channel widths), drawn once from a fixed seed; every
    launch configuration of ``_CONFIGS`` appears with both ops. Trials
    sample token counts, layouts, position sources and ranks freely but variants from this
    pool, so a GPU run compiles a bounded set of kernels."""
    rng = random.Random(1234)
    pool = []
    for index in range(size):
        pool.append((
            rng.choice(list(DTYPES)), rng.choice(["fp32", "fp32", "bf16"]), rng.random() < 0.7,
            rng.random() < 0.3, rng.random() < 0.2, rng.random() < 0.5,
            _CONFIGS[index % len(_CONFIGS)], _DIMS[index % len(_DIMS)],
        ))  # fmt: skip
    return pool


def _positions(trial: Trial, device, table_rows: int, gen: torch.Generator) -> Positions:
    cu = ids = None
    if trial.source == "cu":
        lens = torch.tensor((0, *trial.seq_lens), dtype=torch.int64)
        cu = lens.cumsum(0).to(torch.int32).to(device)
    elif trial.source == "ids":
        ids = torch.randint(0, table_rows, trial.tokens, generator=gen, device=device)
    return Positions(trial.layout, cu, ids, trial.cp_rank, trial.cp_size)


def _randn(shape, dtype, device, gen) -> torch.Tensor:
    """Random inputs made on the device (the host-side generator was the GPU run's bottleneck
    once kernels were compiled)."""
    return torch.randn(shape, generator=gen, device=device).to(dtype)


def _tables(rows: int, rope: int, dtype, device, gen):
    theta = torch.rand(rows, rope, generator=gen, dtype=torch.float64, device=device) * 6.3
    return theta.cos().to(dtype), theta.sin().to(dtype)


def _count(out, truth, x_rope, cos, sin, positions, dtype, il_in, il_out, rope_at, terms=1):
    tol = torch.zeros_like(truth)
    tol[..., rope_at:] = rope_tolerance(
        x_rope, cos, sin, positions, truth[..., rope_at:], dtype, interleaved_in=il_in,
        interleaved_out=il_out, summed_terms=terms,
    )  # fmt: skip
    return wrong_elements(out, truth, tol)


def run_q_trial(trial: Trial, device, gen) -> int:
    dtype = DTYPES[trial.dtype]
    table_rows = 8192
    cos, sin = _tables(table_rows, trial.rope, DTYPES[trial.table_dtype], device, gen)
    positions = _positions(trial, device, table_rows, gen)
    shape = (*trial.tokens, trial.heads, trial.nope + trial.rope)
    config = QLaunchConfig(*trial.config) if trial.config else None
    wrong = 0
    for transpose in (False, True):
        x = _randn(shape, dtype, device, gen)
        il_in, il_out = trial.interleaved, trial.interleaved_out
        if transpose:
            il_in, il_out = il_out, il_in
        out = x.clone() if trial.inplace else poisoned_like(x)
        rope_q_launch(
            out if trial.inplace else x, out, cos, sin, positions, interleaved_in=il_in,
            interleaved_out=il_out, inverse=trial.inverse, transpose=transpose, config=config,
        )  # fmt: skip
        truth = reference.rope_q(
            x.double(), cos.double(), sin.double(), positions, interleaved_in=il_in,
            interleaved_out=il_out, inverse=trial.inverse, transpose=transpose,
        )  # fmt: skip
        wrong += _count(
            out, truth, x[..., trial.nope :].double(), cos, sin, positions, dtype, il_in, il_out,
            trial.nope,
        )  # fmt: skip
    return wrong


def run_kv_trial(trial: Trial, device, gen) -> int:
    dtype = DTYPES[trial.dtype]
    table_rows = 8192
    cos, sin = _tables(table_rows, trial.rope, DTYPES[trial.table_dtype], device, gen)
    positions = _positions(trial, device, table_rows, gen)
    k_dim = max(trial.nope, 16)
    kv = _randn((*trial.tokens, trial.heads, k_dim + trial.v_dim), dtype, device, gen)
    k_pe = _randn((*trial.tokens, trial.rope), dtype, device, gen)
    config = KVLaunchConfig(*trial.config) if trial.config else None
    il_in, il_out = trial.interleaved, trial.interleaved_out
    k = poisoned_like(kv, (*kv.shape[:-1], k_dim + trial.rope))
    v = poisoned_like(kv, (*kv.shape[:-1], trial.v_dim)) if trial.copy_v else None
    rope_kv_launch(
        kv, k_pe, k, v, cos, sin, positions, k_dim=k_dim, interleaved_in=il_in,
        interleaved_out=il_out, config=config,
    )  # fmt: skip
    k_truth, v_truth = reference.rope_kv(
        kv.double(), k_pe.double(), cos.double(), sin.double(), positions, k_dim=k_dim,
        interleaved_in=il_in, interleaved_out=il_out,
    )  # fmt: skip
    x_rope = k_pe.double().unsqueeze(-2).expand(*kv.shape[:-1], trial.rope)
    wrong = _count(k, k_truth, x_rope, cos, sin, positions, dtype, il_in, il_out, k_dim)
    if v is not None:
        wrong += int((v.double() != v_truth).sum())

    dk = _randn(k.shape, dtype, device, gen)
    dv = _randn((*kv.shape[:-1], trial.v_dim), dtype, device, gen)
    dkv = poisoned_like(kv)
    dk_pe = poisoned_like(k_pe)
    rope_kv_backward_launch(
        dk, dv, dkv, dk_pe, cos, sin, positions, k_dim=k_dim, interleaved_in=il_in,
        interleaved_out=il_out, config=config,
    )  # fmt: skip
    dkv_truth, dpe_truth = reference.rope_kv_backward(
        dk.double(), dv.double(), cos.double(), sin.double(), positions, k_dim=k_dim,
        interleaved_in=il_in, interleaved_out=il_out,
    )  # fmt: skip
    wrong += int((dkv.double() != dkv_truth).sum())
    g_abs = dk[..., k_dim:].double().abs().sum(-2, keepdim=True)
    wrong += _count(
        dk_pe.unsqueeze(-2), dpe_truth.unsqueeze(-2), g_abs, cos, sin, positions, dtype, il_out,
        il_in, 0, terms=trial.heads,
    )  # fmt: skip
    return wrong


def run_control_trial(
    device, gen, block_h: int, num_warps: int, skew_steps: int = 0, rope: int = 64
) -> int:
    """The racy in-place kernel on a packed thd batch (bf16), in place.

    Which threads own which channels is Triton's layout choice: at ``rope = 64`` a head's 32
    pairs fill one warp (32 lanes, one pair each), so every load and store of a row is in one
    warp and the missing barrier cannot show; at ``rope = 128`` a row spans two warps, which is
    the incumbent's cross-warp race (docs/race.md)."""
    on_gpu = torch.device(device).type == "cuda"
    n_seqs, heads = (64, 32) if on_gpu else (4, 4)
    lens = torch.randint(1, 12, (n_seqs,), generator=gen, device=device)
    cu = torch.cat((lens.new_zeros(1), lens.cumsum(0))).to(torch.int32)
    n_tokens = int(cu[-1])
    positions = Positions("thd", cu, None, 0, 1)
    cos, sin = _tables(64, rope, torch.float32, device, gen)
    x = _randn((n_tokens, heads, rope), torch.bfloat16, device, gen)
    out = x.clone()
    racy_rope_inplace(
        out, cos, sin, positions.cu_seqlens, block_h=block_h, num_warps=num_warps,
        skew_steps=skew_steps,
    )  # fmt: skip
    truth = reference.rope_q(
        x.double(), cos.double(), sin.double(), positions, interleaved_in=True,
        interleaved_out=False, inverse=False,
    )  # fmt: skip
    return _count(out, truth, x.double(), cos, sin, positions, torch.bfloat16, True, False, 0)


def trial_for(seed: int, index: int, small: bool) -> Trial:
    """Trial ``index`` of a run: drawn from its own seed, so results do not depend on how
    trials are split among worker processes or in which order they run."""
    return draw_trial(random.Random(seed * 1_000_003 + index), small)


def run_trials(seed: int, indices: tuple[int, ...], device: str, small: bool) -> dict:
    """Run the given trials; count the wrong elements of each."""
    failures, counts, coverage = [], {"q": 0, "kv": 0}, Counter()
    for index in indices:
        trial = trial_for(seed, index, small)
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + index)
        counts[trial.op] += 1
        coverage.update(coverage_keys(trial))
        wrong = (run_q_trial if trial.op == "q" else run_kv_trial)(trial, device, gen)
        if wrong:
            failures.append({"trial": index, "wrong_elements": wrong, **asdict(trial)})
    return {"failures": failures, "counts": counts, "count": len(indices), "coverage": coverage}


def coverage_keys(trial: Trial) -> list[str]:
    """What a trial exercised, for the summary's coverage table (both directions each time:
    forward and backward of the op)."""
    config = "heuristic" if trial.config is None else "x".join(map(str, trial.config))
    return [
        f"op={trial.op}",
        f"layout={trial.layout}/{trial.source}",
        f"dtype={trial.dtype}",
        f"table={trial.table_dtype}",
        f"config={config}",
        f"cp_size={trial.cp_size}",
        f"rope={trial.rope}",
        f"heads={trial.heads}",
        f"interleaved={trial.interleaved}->{trial.interleaved_out}",
    ] + (
        [f"inplace={trial.inplace}", f"inverse={trial.inverse}"]
        if trial.op == "q"
        else [f"copy_v={trial.copy_v}"]
    )


def plan_jobs(seed: int, trials: int, small: bool, chunk: int) -> list[tuple[int, ...]]:
    """Trial indices grouped into jobs of one kernel variant and position mode each, ordered so
    that consecutive jobs differ: parallel workers then compile different kernels at the same
    time, and a worker reuses what it compiled for the rest of its job (a GPU run was
    compile-bound when every worker met every variant at once)."""
    groups: dict[tuple, list[int]] = {}
    for index in range(trials):
        t = trial_for(seed, index, small)
        groups.setdefault((t.variant, t.layout, t.source), []).append(index)
    chunked = [[tuple(g[i : i + chunk]) for i in range(0, len(g), chunk)] for g in groups.values()]
    jobs = []
    for round_ in range(max((len(c) for c in chunked), default=0)):
        jobs += [c[round_] for c in chunked if round_ < len(c)]
    return jobs


def _run_chunk(job: tuple) -> dict:
    return run_trials(*job)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trials", type=int, default=20000, help="randomized trials of our ops")
    parser.add_argument(
        "--control-trials", type=int, default=500,
        help="trials of the deliberately racy control kernel (0 to skip)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seed of the trial generator")
    parser.add_argument(
        "--device",
        default=None,
        help="cuda (default when present) or cpu (needs TRITON_INTERPRET=1)",
    )
    parser.add_argument(
        "--small", action="store_true", help="small shapes (the default on the CPU interpreter)"
    )
    parser.add_argument(
        "--workers", type=int, default=1,
        help="worker processes sharing the device (they compile kernel variants in parallel)",
    )  # fmt: skip
    parser.add_argument(
        "--max-seconds", type=float, default=None,
        help="stop starting new trials after this many seconds (the summary says how many ran)",
    )  # fmt: skip
    parser.add_argument("--json", default=None, help="write the summary as JSON to this path")


def _device_problem(device: str) -> str | None:
    """Why the kernels cannot run on ``device``, or None. The trials call the Triton launchers
    directly: CUDA needs a CUDA device, and CPU tensors need Triton's interpreter, which
    ``TRITON_INTERPRET=1`` turns on only when set before triton is first imported."""
    try:
        kind = torch.device(device).type
    except RuntimeError:
        return f"--device must be cuda or cpu, got {device!r}"
    if kind == "cuda":
        if not torch.cuda.is_available():
            return "--device cuda, but no CUDA device is available"
        return None
    if kind != "cpu":
        return f"--device must be cuda or cpu, got {device!r}"
    if not INTERPRETED:
        return (
            ("no CUDA device; " if not torch.cuda.is_available() else "")
            + "on the CPU the trials run the Triton kernels under Triton's interpreter, which is "
            "off: set TRITON_INTERPRET=1 before Python starts "
            "(TRITON_INTERPRET=1 python -m mlarope stress)"
        )
    return None


def run(args: argparse.Namespace) -> int:
    """Exit code 0 when every requested trial of ours ran with 0 wrong elements; 1 when a trial
    failed or ``--max-seconds`` stopped the run before all trials ran; 2 when the kernels
    cannot run on the device (no CUDA device and no interpreter, an unknown device)."""
    console = Console()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    problem = _device_problem(device)
    if problem:
        console.print(f"mlarope stress: {problem}", style="red")
        return 2
    small = args.small or device == "cpu"
    chunk = max(1, min(50, args.trials // max(1, 4 * args.workers)))
    jobs = [
        (args.seed, indices, device, small)
        for indices in plan_jobs(args.seed, args.trials, small, chunk)
    ]
    failures: list[dict] = []
    counts = {"q": 0, "kv": 0}
    coverage: Counter = Counter()
    start = time.perf_counter()
    with console.progress("mlarope trials", args.trials) as advance:
        if args.workers > 1:
            pool = multiprocessing.get_context("spawn").Pool(args.workers)
            results = pool.imap_unordered(_run_chunk, jobs)
        else:
            pool, results = None, map(_run_chunk, jobs)
        for result in results:
            failures += result["failures"]
            for op, n in result["counts"].items():
                counts[op] += n
            coverage.update(result["coverage"])
            advance(result["count"])
            if args.max_seconds and time.perf_counter() - start > args.max_seconds:
                break
        if pool is not None:
            pool.terminate()
            pool.join()
    control_failed = 0
    control_by_config: dict[str, list[int]] = {}
    with console.progress("racy control", args.control_trials) as advance:
        gen = torch.Generator(device=device).manual_seed(args.seed)
        # The faithful control (no barrier, the incumbent's lookup) at R = 64 and R = 128 and,
        # on the GPU, the same kernel with warp 0 delayed (racy_control's skew injector).
        configs = [(64, 1, 4, 0), (64, 2, 8, 0), (128, 1, 4, 0), (128, 1, 8, 0)]
        if torch.device(device).type == "cuda":
            configs += [(64, 2, 8, 256), (128, 1, 4, 256)]
        for index in range(args.control_trials):
            rope, block_h, warps, skew = configs[index % len(configs)]
            wrong = run_control_trial(device, gen, block_h, warps, skew, rope)
            key = f"rope={rope},block_h={block_h},num_warps={warps},skew={skew}"
            stats = control_by_config.setdefault(key, [0, 0])
            stats[0] += 1
            stats[1] += wrong > 0
            control_failed += wrong > 0
            advance(1)
    failures.sort(key=lambda f: f["trial"])
    elapsed = time.perf_counter() - start
    summary = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "trials": counts["q"] + counts["kv"],
        "trials_requested": args.trials,
        "trials_by_op": counts,
        "failed_trials": len(failures),
        "wrong_elements": sum(f["wrong_elements"] for f in failures),
        "control_trials": args.control_trials,
        "control_failed_trials": control_failed,
        "control_by_config": control_by_config,
        "seconds": round(elapsed, 1),
        "coverage": dict(sorted(coverage.items())),
        "failures": failures[:20],
    }
    table = Table(title="mlarope stress")
    table.add_column("kernel")
    table.add_column("trials", justify="right")
    table.add_column("failed trials", justify="right")
    table.add_column("wrong elements", justify="right")
    table.add_row("mlarope (ours)", f"{summary['trials']} of {args.trials}", str(len(failures)),
                  str(summary["wrong_elements"]))  # fmt: skip
    table.add_row("racy control", str(args.control_trials), str(control_failed), "-")
    console.print(table)
    console.print(f"control by launch config: {control_by_config}; {elapsed:.1f} s on {device}")
    if device != "cuda" and args.control_trials:
        console.print(
            "the racy control cannot fail here: Triton's interpreter runs a launch's programs "
            "one after another, so no store can overtake another program's load; its failure "
            "rate is a GPU figure (docs/race.md)"
        )
    if summary["trials"] < args.trials:
        console.print(
            f"stopped early: {summary['trials']} of {args.trials} trials ran in the "
            f"--max-seconds limit; exit code 1",
            style="bold red",
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2, default=str)
    return 1 if failures or summary["trials"] < args.trials else 0


def main(argv: list[str] | None = None) -> int:
    """``python -m mlarope.tools.stress`` (the same as ``python -m mlarope stress``)."""
    parser = argparse.ArgumentParser(prog="python -m mlarope stress", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
