"""One DeepSeek-V3-size Megatron-Core MLA layer: Megatron's fused RoPE, mlarope's patch, unfused.

Megatron-Core's own ``MLASelfAttention``, built as ``tests/test_integration_megatron.py`` builds
it (``benchmarks/megatron_layer.py``: an ``MLATransformerConfig`` with DeepSeek-V3's YaRN
settings, the local spec's linear layers and RMSNorms, a PyTorch core attention), at
DeepSeek-V3's MLA widths (hidden 7168, 128 heads, q/kv LoRA ranks 1536/512, nope/rope/value
128/64/128), one layer, bf16, batch 1, on one device, three ways on the same weights and inputs:

- ``megatron``: ``apply_rope_fusion=True``, Megatron-Core's own fused Triton kernels
  (``megatron.core.fusions.fused_mla_yarn_rope_apply``). Its kernels are ``triton.autotune``d
  with a key that omits the sequence count, so their caches are cleared at the start of every
  case: each case runs the block size tuned for itself (Megatron at its best; docs/benchmarks.md,
  "Megatron-Core's autotuner and the number of sequences");
- ``mlarope``: the same layer under ``mlarope.integrations.megatron.mlarope_patched()`` (the
  default ``rounding="megatron"``), which rebinds the fused functions to
  ``mlarope.compat.megatron``'s;
- ``unfused``: ``apply_rope_fusion=False`` (Megatron's PyTorch rotation,
  ``rope_utils.apply_rotary_pos_emb``).

Cases (``--cases``, ``layout:tokens[/sequences]``): sbhd ``[4096, 1]``; thd with one packed
sequence of 4,096 tokens; thd with 4,096 packed sequences of 4 tokens (16,384 tokens); and sbhd
``[128, 1]``, where the GPU idles and the step is bound by the host. The 4,096 sequences are 4
tokens long because Megatron-Core's ``PackedSeqParams`` takes any lengths at context-parallel
size 1 (``thd:4096/4096``, 1-token sequences, runs too) but with context parallelism every
sequence must be a multiple of ``2 * cp_size``, so 4 is the shortest that a two-rank run packs;
and because 16,384 tokens in 4,096 sequences is the kernel benchmark's ``thd4096`` case
(docs/benchmarks.md), so the row reads beside those kernel rows. The sequences are equal, so the
core attention runs them as one batched call (``TorchCoreAttention``): no sync, and the same
attention for all three.

For each case:

- a check, one training step each: the calls reaching the RoPE functions are counted (the
  patched step calls mlarope's query and key/value functions once each and Megatron's never;
  Megatron's step the reverse; the unfused step only ``apply_rotary_pos_emb``, twice), and for
  the output, the input's
  gradient and every parameter's gradient, each bf16 step's distance (Frobenius norm) from the
  same layer in fp32 (the same bf16-valued weights and input, the unfused path) is measured.
  The patched step passes when its distance is at most 1.25 times the unfused step's for every
  tensor: the integration test's bound. mlarope rounds the rotation once where Megatron (fused
  and unfused) rounds three times, so downstream each run is the layer's bf16 noise, of the
  same size, while a wrong rotation (layout, sign, table row) puts the run O(1) away. Measured
  on the CPU at the layer test's widths, 64 tokens, 8 seeds: 0.97-1.01 for the output, the
  input's gradient and every weight matrix's; 0.89-1.10 for the two norm weights (192 and 128
  elements), the noisiest norms (at DeepSeek-V3's widths they have 1,536 and 512). Megatron's
  fused step's ratio is printed beside it (it computes in bf16 as the unfused path does: about
  1; its in-place race would show as more);
- the forward (under ``no_grad``) and the training step (forward, then backward of every
  parameter and the input with a fixed upstream gradient), timed with CUDA events: warm-up,
  then ``--rounds`` alternating blocks of ``--iters`` iterations of each implementation, the
  median per implementation, in one process.

Targets, the transformers families' (docs/transformers.md) applied to the patch: the training step
through mlarope at <= 0.98x Megatron's fused step at 4,096 tokens and more, and <= 1.00x in the
host-bound case (128 tokens). They are printed (PASS / MISS), not enforced.

What differs from DeepSeek-V3's layer in a Megatron-Core model: no TransformerEngine on the GPU
lane, so Megatron's local linear layers (``ColumnParallelLinear`` / ``RowParallelLinear``,
tensor-parallel size 1, no sequence parallelism) and ``torch.nn.RMSNorm`` (no apex) instead of
TransformerEngine's fused ones, and ``scaled_dot_product_attention`` instead of its fused
attention (in thd Megatron pads the value to the query's 192 channels for the core attention,
as it does for TransformerEngine); Megatron's ``layernorm_epsilon`` default (1e-5; DeepSeek-V3:
1e-6); random weights (Megatron's init: normal, std 0.02, the output projection's
0.02 / sqrt(2)). The widths, YaRN settings (factor 40 over
4,096 positions, beta 32/1, mscale and mscale_all_dim 1) and head dims are DeepSeek-V3's:
Megatron-Core's config takes them as they are.

Prints progress and a markdown table (written to ``--out`` after every case); exit status 1
when a check fails or a case cannot run, 2 without the device.

    MEGATRON_LM=.megatron-lm PYTHONPATH=src python -m benchmarks.megatron_layers [--out FILE]
        [--cases sbhd:4096,thd:4096/1,thd:16384/4096,sbhd:128] [--iters 10] [--rounds 3]
    MEGATRON_LM=.megatron-lm PYTHONPATH=src python -m benchmarks.megatron_layers \\
        --device cpu --tiny  # CPU smoke (PyTorch backend: TRITON_INTERPRET unset)

On the CPU, Megatron's fused kernels cannot run (they are ``triton.autotune``d, and the autotuner
needs a GPU driver to time them, even under ``TRITON_INTERPRET=1``), so the smoke runs the patch
and the unfused path only; the Megatron columns say so.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

import mlarope
from benchmarks import megatron_layer
from mlarope.integrations import megatron as integration

MLA = "megatron.core.transformer.multi_latent_attention"
FUSED = "megatron.core.fusions.fused_mla_yarn_rope_apply"
FUSED_NAMES = ("fused_apply_mla_rope_for_q", "fused_apply_mla_rope_for_kv")
IMPLS = ("megatron", "mlarope", "unfused")
RATIO = 1.25
DEFAULT_CASES = "sbhd:4096,thd:4096/1,thd:16384/4096,sbhd:128"
TINY_CASES = "sbhd:64,thd:64/1,thd:64/16,sbhd:16"
HOST_BOUND_TOKENS = 128  # at and below: the host-bound target


@dataclass(frozen=True)
class Case:
    """sbhd ``[tokens, 1]``, or thd ``[tokens]`` in ``seqs`` equal packed sequences."""

    layout: str
    tokens: int
    seqs: int = 1

    @classmethod
    def parse(cls, spec: str) -> Case:
        layout, _, size = spec.partition(":")
        tokens, _, seqs = size.partition("/")
        case = cls(layout, int(tokens), int(seqs or 1))
        if layout not in ("sbhd", "thd") or case.tokens < 1 or case.seqs < 1:
            raise ValueError(f"--cases: {spec!r} is not sbhd:TOKENS or thd:TOKENS/SEQUENCES")
        if layout == "sbhd" and case.seqs != 1:
            raise ValueError(f"--cases: {spec!r}: sbhd has one sequence (batch 1)")
        if case.tokens % case.seqs:
            raise ValueError(f"--cases: {spec!r}: the sequences must be equal")
        return case

    @property
    def label(self) -> str:
        if self.layout == "sbhd":
            return f"sbhd {self.tokens} x 1"
        return f"thd {self.tokens} / {self.seqs} seq"

    @property
    def target(self) -> float:
        return 1.00 if self.tokens <= HOST_BOUND_TOKENS else 0.98

    def packed_seq_params(self, device):
        if self.layout == "sbhd":
            return None
        length = self.tokens // self.seqs
        return megatron_layer.packed_seq_params(range(0, self.tokens + 1, length), device)


def log(start: float, message: str) -> None:
    print(f"megatron_layers [{time.perf_counter() - start:6.1f} s] {message}", flush=True)


def timed(fn, device: torch.device) -> float:
    """Milliseconds of one call (CUDA events on the GPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def forward(layer, x0: torch.Tensor, psp) -> None:
    """The layer's forward of ``x0: [S, 1, hidden]`` (sbhd) or ``[T, 1, hidden]`` (thd, with
    ``psp``, Megatron's ``PackedSeqParams``), without autograd."""
    with torch.no_grad():
        layer(x0, attention_mask=None, packed_seq_params=psp)


def training_step(layer, x0: torch.Tensor, g0: torch.Tensor, psp) -> dict[str, torch.Tensor]:
    """Forward and backward of ``x0: [S, 1, hidden]`` with the upstream gradient ``g0`` (same
    shape): the output, the input's gradient and every parameter's gradient."""
    x = x0.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    out, _ = layer(x, attention_mask=None, packed_seq_params=psp)
    out.backward(g0)
    result = {"output": out.detach(), "input gradient": x.grad}
    result.update({n: p.grad for n, p in layer.named_parameters() if p.grad is not None})
    return result


@contextlib.contextmanager
def counted(mla):
    """Count the calls of the RoPE functions ``mla`` (``multi_latent_attention``) makes in the
    block: ``megatron`` (Megatron-Core's fused functions), ``mlarope`` (the patch's) and
    ``unfused`` (``apply_rotary_pos_emb``). Wraps what is bound at entry; restores it on exit."""
    calls = dict.fromkeys(IMPLS, 0)
    names = (*FUSED_NAMES, "apply_rotary_pos_emb")
    saved = {name: getattr(mla, name) for name in names}

    def owner(name, fn):
        if name == "apply_rotary_pos_emb":
            return "unfused"
        return "mlarope" if getattr(fn, "func", fn).__module__.startswith("mlarope") else "megatron"

    def wrap(name, fn):
        who = owner(name, fn)

        def counting(*args, **kwargs):
            calls[who] += 1
            return fn(*args, **kwargs)

        return counting

    for name, fn in saved.items():
        if fn is not None:
            setattr(mla, name, wrap(name, fn))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(mla, name, fn)


def megatron_runs(device: torch.device, mla) -> str | None:
    """None if Megatron's fused kernels can run here, else why not."""
    if any(getattr(mla, name) is None for name in FUSED_NAMES):
        return "Megatron's fused module did not import"
    if device.type != "cuda":  # its autotuner times the kernels: Triton's interpreter cannot
        return "autotuned Triton kernels: GPU only"
    return None


class Layers:
    """The fused layer (Megatron's functions, or mlarope's under the patch), the unfused one and
    the fp32 one (unfused), all with the fused layer's weights."""

    def __init__(self, widths: megatron_layer.Widths, device: torch.device):
        self.fused = megatron_layer.build_mla(True, torch.bfloat16, device, widths)
        self.unfused = megatron_layer.build_mla(False, torch.bfloat16, device, widths)
        self.exact = megatron_layer.build_mla(False, torch.float32, device, widths)
        weights = {k: v for k, v in self.fused.state_dict().items() if v is not None}
        for layer in (self.unfused, self.exact):
            layer.load_state_dict({k: v.to(next(layer.parameters()).dtype)
                                   for k, v in weights.items()}, strict=False)  # fmt: skip
            for k, v in layer.state_dict().items():
                assert v is None or torch.equal(v.double(), weights[k].double()), k
        for layer in (self.fused, self.unfused, self.exact):
            layer.train()

    def of(self, impl: str):
        return self.unfused if impl == "unfused" else self.fused


def patch_for(impl: str):
    """The patch for ``mlarope``; nothing (and nothing may be applied) otherwise."""
    if impl == "mlarope":
        return integration.mlarope_patched()
    assert not integration.is_mlarope_applied_to_megatron()
    return contextlib.nullcontext()


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm())


def measure(case: Case, layers: Layers, impls: list[str], args, device, mla, fused_module,
            start: float) -> dict:  # fmt: skip
    hidden = layers.fused.config.hidden_size
    gen = torch.Generator().manual_seed(1)
    x0 = torch.randn(case.tokens, 1, hidden, generator=gen).to(device, torch.bfloat16)
    g0 = torch.randn(case.tokens, 1, hidden, generator=gen).to(device, torch.bfloat16)
    psp = case.packed_seq_params(device)
    if "megatron" in impls and device.type == "cuda":
        from mlarope.tools.bench.impls import retune_megatron

        retune_megatron(fused_module)  # this case tunes its own block sizes

    def run(impl: str, backward: bool):
        layer = layers.of(impl)
        if backward:
            training_step(layer, x0, g0, psp)
        else:
            forward(layer, x0, psp)

    log(start, f"{case.label}: warm-up (Megatron's autotuner runs on its first call)")
    for backward in (False, True):
        for _ in range(args.warmup):
            for impl in impls:
                with patch_for(impl):
                    run(impl, backward)

    log(start, f"{case.label}: check against the fp32 layer")
    exact = training_step(layers.exact, x0.float(), g0.float(), psp)
    dist, calls = {}, {}
    for impl in impls:
        with patch_for(impl), counted(mla) as count:
            result = training_step(layers.of(impl), x0, g0, psp)
        calls[impl] = dict(count)
        dist[impl] = {name: distance(result[name], want) for name, want in exact.items()}
        del result
    del exact
    ratios = {}
    for impl in ("mlarope", "megatron"):
        if impl in impls:
            ratios[impl] = {
                name: d / dist["unfused"][name] if dist["unfused"][name] > 0 else float("inf")
                for name, d in dist[impl].items()
            }
    expected = {impl: {i: (2 if i == impl else 0) for i in IMPLS} for impl in impls}
    routed = all(calls[impl] == expected[impl] for impl in impls)
    worst = max(ratios["mlarope"], key=ratios["mlarope"].get)
    finite = all(math.isfinite(d) for per in dist.values() for d in per.values())
    ok = routed and finite and ratios["mlarope"][worst] <= RATIO

    log(start, f"{case.label}: timing ({args.rounds} x {args.iters} per implementation and kind)")
    times: dict[tuple[str, str], list[float]] = {}
    for backward, kind in ((False, "fwd"), (True, "step")):
        for _ in range(args.rounds):
            for impl in impls:
                with patch_for(impl):
                    times.setdefault((impl, kind), []).extend(
                        timed(lambda i=impl, b=backward: run(i, b), device)
                        for _ in range(args.iters)
                    )
    med = {f"{kind}_{impl}": statistics.median(v) for (impl, kind), v in times.items()}
    return {
        "case": case,
        "ok": ok,
        "routed": routed,
        "calls": calls,
        "ratio": ratios["mlarope"][worst],
        "worst": worst,
        "megatron_ratio": max(ratios["megatron"].values()) if "megatron" in ratios else None,
        **med,
    }


def kernel_profile(case: Case, layers: Layers, impls: list[str], device, start: float) -> None:
    """Print each implementation's GPU time per training step by kernel (torch.profiler, one
    step after the timing): where a row's difference between implementations goes."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(2)
    hidden = layers.fused.config.hidden_size
    x0 = torch.randn(case.tokens, 1, hidden, generator=gen).to(device, torch.bfloat16)
    g0 = torch.randn(case.tokens, 1, hidden, generator=gen).to(device, torch.bfloat16)
    psp = case.packed_seq_params(device)
    for impl in impls:
        with patch_for(impl):
            training_step(layers.of(impl), x0, g0, psp)
            torch.cuda.synchronize(device)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                training_step(layers.of(impl), x0, g0, psp)
                torch.cuda.synchronize(device)
        events = [e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
        events.sort(key=lambda e: -e.self_device_time_total)
        total = sum(e.self_device_time_total for e in events) / 1e3
        log(start, f"{case.label}: profile {impl}: {total:.3f} ms of GPU kernels a step")
        for e in events[:14]:
            log(start, f"  {impl:8s} {e.self_device_time_total / 1e3:8.3f} ms {e.count:4d}x "
                       f"{e.key[:110]}")  # fmt: skip


def _ms(row: dict, key: str) -> str:
    return f"{row[key]:.2f} ms" if key in row else "n/a"


def row_text(r: dict) -> str:
    """One case's markdown row (``n/a`` for an implementation that did not run)."""
    case = r["case"]
    if "error" in r:
        return f"| {case.label} | | | | | | | | FAILED: {r['error']} |"
    cells = [case.label]
    for kind in ("fwd", "step"):
        cells.append(_ms(r, f"{kind}_megatron"))
        versus = [f"{r[f'{kind}_mlarope'] / r[f'{kind}_{i}']:.3f}x {name}"
                  for i, name in (("megatron", "Megatron"), ("unfused", "unfused"))
                  if f"{kind}_{i}" in r]  # fmt: skip
        cells.append(f"{_ms(r, f'{kind}_mlarope')} ({', '.join(versus)})")
        cells.append(_ms(r, f"{kind}_unfused"))
    if "step_megatron" in r:
        verdict = "PASS" if r["step_mlarope"] / r["step_megatron"] <= case.target else "MISS"
        cells.append(f"<= {case.target:.2f}x Megatron {verdict}")
    else:
        cells.append(f"<= {case.target:.2f}x Megatron (not run)")
    calls = r["calls"]["mlarope"]["mlarope"]
    check = (
        f"{'ok' if r['ok'] else 'FAILED'}: {calls}/2 rotations through mlarope"
        f"{'' if r['routed'] else ' (calls per step: ' + str(r['calls']) + ')'}; distance "
        f"from fp32, mlarope / unfused: max {r['ratio']:.3f} ({r['worst']})"
    )
    if r["megatron_ratio"] is not None:
        check += f"; Megatron fused / unfused: max {r['megatron_ratio']:.3f}"
    cells.append(check)
    return "| " + " | ".join(cells) + " |"


def megatron_commit(path: str | None) -> str:
    if not path:
        return "installed megatron-core"
    commit = Path(path) / "COMMIT"
    if commit.is_file():
        return f"Megatron-LM {commit.read_text().strip()}"
    if not (Path(path) / ".git").exists():  # an archive: git would name the enclosing repo
        return "Megatron-LM (unknown commit: no COMMIT file, no .git)"
    try:
        out = subprocess.run(["git", "-C", path, "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, timeout=10)  # fmt: skip
        return f"Megatron-LM {out.stdout.strip() or '(unknown commit)'}"
    except (OSError, subprocess.SubprocessError):
        return "Megatron-LM (unknown commit)"


def table(rows: list[dict], header: str) -> str:
    return "\n".join([
        header,
        "",
        "| case | forward, Megatron fused | forward, mlarope | forward, unfused "
        "| training step, Megatron fused | training step, mlarope | training step, unfused "
        "| target | check |",
        "|---|---|---|---|---|---|---|---|---|",
        *(row_text(r) for r in rows),
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=None,
                        help=f"layout:tokens[/sequences], comma-separated (default "
                             f"{DEFAULT_CASES}; --tiny: {TINY_CASES})")  # fmt: skip
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per block")
    parser.add_argument("--rounds", type=int, default=3, help="alternating blocks per side")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="the integration test's widths and short cases (a CPU smoke run)",
    )
    parser.add_argument(
        "--megatron",
        default=os.environ.get("MEGATRON_LM"),
        help="a Megatron-LM checkout (default $MEGATRON_LM; else installed)",
    )
    parser.add_argument("--out", default=None, help="also write the table to this file")
    parser.add_argument("--profile", action="store_true",
                        help="also print each implementation's GPU time by kernel, one "
                             "training step per case (CUDA only)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        cases = [Case.parse(s) for s in (args.cases or (TINY_CASES if args.tiny else
                                                         DEFAULT_CASES)).split(",")]  # fmt: skip
    except ValueError as exc:
        parser.error(str(exc))
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("megatron_layers: no CUDA device", file=sys.stderr)
        return 2
    widths = megatron_layer.SMALL if args.tiny else megatron_layer.DEEPSEEK_V3
    start = time.perf_counter()
    rows: list[dict] = []
    megatron = os.path.abspath(args.megatron) if args.megatron else None
    with megatron_layer.megatron_core(megatron), megatron_layer.yarn_on(device):
        mla = importlib.import_module(MLA)
        fused_module = sys.modules.get(FUSED)
        skipped = megatron_runs(device, mla)
        impls = [i for i in IMPLS if i != "megatron" or skipped is None]
        log(start, f"building the layers ({widths}); implementations: {', '.join(impls)}"
                   + (f"; megatron: not run ({skipped})" if skipped else ""))  # fmt: skip
        layers = Layers(widths, device)
        what = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
        w = widths
        header = (
            f"{what or platform.machine()}; torch {torch.__version__}, "
            f"{megatron_commit(megatron)}, mlarope {mlarope.__version__}; MLASelfAttention "
            f"hidden {w.hidden}, {w.heads} heads, q/kv LoRA {w.q_lora}/{w.kv_lora}, "
            f"nope/rope/v {w.nope}/{w.rope}/{w.v}, bf16, batch 1, PyTorch SDPA core attention "
            f"(causal); median of {args.rounds} x {args.iters} iterations per implementation, "
            f"alternating blocks"
            + (f"; Megatron's fused kernels not run ({skipped})" if skipped else "")
        )
        for case in cases:
            try:
                rows.append(measure(case, layers, impls, args, device, mla, fused_module, start))
            except Exception as exc:  # a case that cannot run is a failed row
                traceback.print_exc()
                first = str(exc).splitlines()[0][:160] if str(exc) else ""
                rows.append({"case": case, "error": f"{type(exc).__name__}: {first}", "ok": False})
            print(row_text(rows[-1]), flush=True)
            if args.profile and device.type == "cuda" and "error" not in rows[-1]:
                try:
                    kernel_profile(case, layers, impls, device, start)
                except Exception:  # the profile is a diagnosis: the row stands without it
                    traceback.print_exc()
            if args.out:
                with open(args.out, "w", encoding="utf-8") as f:
                    f.write(table(rows, header) + "\n")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    text = table(rows, header)
    print(text)
    log(start, "done")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
