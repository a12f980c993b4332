"""One real-size transformers MLA attention layer, unpatched and through mlarope, timed and checked.

For each family (default: DeepSeek-V3, GLM-4.7-Flash = glm4_moe_lite, MiniCPM3), the attention
layer transformers builds from the family's default config (the released model's widths: no
download, random weights), bf16 on one GPU, batch 1, sequence 4096, sdpa attention, causal:

- forward, and a training step (forward + backward of every parameter and the input), timed with
  CUDA events (warm-up, then alternating blocks of unpatched and patched iterations, median per
  side), in one process;
- checked: every rotation of the patched step goes through mlarope, and each tensor (output,
  input gradient, every parameter gradient) of the patched bf16 step is as close to the same
  layer run in fp32 (the same bf16-valued weights and input, unpatched) as the unpatched bf16
  step is, by Frobenius norm: ``|patched - fp32| <= 1.25 max(|unpatched - fp32|,
  |rounded once - fp32|)``, where "rounded once" is transformers' own rotary function computed
  in fp32 and rounded once (mlarope's error model, with transformers' code). Each run is the
  layer's bf16 noise, of the same size (mlarope rounds the rotation once, transformers three
  times); a wrong rotation puts the patched run O(1) away.

Prints a markdown table (and writes it to ``--out``). Exit status 1 when a check fails.

    PYTHONPATH=src python benchmarks/transformers_layers.py
        [--families deepseek_v3,glm4_moe_lite,minicpm3] [--seq 4096] [--iters 10]
        [--rounds 3] [--out FILE]
    PYTHONPATH=src python benchmarks/transformers_layers.py --device cpu --tiny  # CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import platform
import statistics
import sys
import time

import torch

import mlarope
from mlarope.integrations import transformers as mt
from mlarope.integrations.transformers import _patch

FAMILIES = ("deepseek_v3", "glm4_moe_lite", "minicpm3")
MODEL_NAMES = {
    "deepseek_v3": "DeepSeek-V3",
    "glm4_moe_lite": "GLM-4.7-Flash",
    "minicpm3": "MiniCPM3-4B",
}
RATIO = 1.25


def build(family: str, device: torch.device, tiny: bool):
    """The family's attention layer and rotary embedding, from its default config."""
    import transformers

    row = {r.name: r for r in mt.family_report()}[family]
    module = importlib.import_module(row.module)
    config_name = next(
        c for t, c in transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES.items()
        if t == family
    )  # fmt: skip
    config = getattr(transformers, config_name)()
    if tiny:
        config.hidden_size, config.num_attention_heads = 64, 4
        config.num_key_value_heads = 4
        config.q_lora_rank, config.kv_lora_rank = 32, 16
    config._attn_implementation = "sdpa"
    attention = getattr(module, row.attention[0])(config, layer_idx=0)
    rotary_names = [n for n in dir(module) if n.endswith("RotaryEmbedding")]
    (rotary_name,) = rotary_names
    rotary = getattr(module, rotary_name)(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in attention.parameters():
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=config.initializer_range)
            else:
                p.normal_(1.0, 0.02)
    attention.to(device=device, dtype=torch.bfloat16)
    rotary.to(device=device)
    return config, attention, rotary


@contextlib.contextmanager
def emulated(family: str):
    """transformers' own rotary functions computed in fp32 and rounded once to their result
    dtype: mlarope's rounding with transformers' code, a second sample of the layer's bf16
    noise next to the unpatched run (small tensors, such as a norm's weight gradient, can
    happen to get a small error in one run)."""
    fam = _patch.family(family)
    module = importlib.import_module(fam.module)
    saved = {name: getattr(module, name) for name in fam.mappings}

    def wrap(original, mapping):
        def fn(q, k, cos, sin, *args, **kwargs):
            up = [t if t is None else t.float() for t in (q, k, cos, sin)]
            q_out, k_out = original(*up, *args, **kwargs)

            def dtype(t):
                return (
                    t.dtype
                    if mapping.result_dtype == "input"
                    else torch.promote_types(t.dtype, cos.dtype)
                )

            return q_out.to(dtype(q)), None if k_out is None else k_out.to(dtype(k))

        return fn

    for name, mapping in fam.mappings.items():
        setattr(module, name, wrap(saved[name], mapping))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


def step(attention, rotary, x, grad, *, backward: bool) -> dict[str, torch.Tensor]:
    position_ids = torch.arange(x.shape[1], device=x.device)[None]
    cos, sin = rotary(x, position_ids)
    out, _ = attention(hidden_states=x, position_embeddings=(cos, sin), attention_mask=None)
    if not backward:
        return {"output": out}
    out.backward(grad)
    result = {"output": out.detach(), "input gradient": x.grad}
    result.update({n: p.grad for n, p in attention.named_parameters() if p.grad is not None})
    return result


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


def measure(family: str, args, device: torch.device) -> dict:
    config, attention, rotary = build(family, device, args.tiny)
    gen = torch.Generator().manual_seed(1)
    x0 = torch.randn(1, args.seq, config.hidden_size, generator=gen).to(device, torch.bfloat16)
    g0 = torch.randn(1, args.seq, config.hidden_size, generator=gen).to(device, torch.bfloat16)

    def run(backward: bool):
        x = x0.clone().requires_grad_(backward)
        attention.zero_grad(set_to_none=True)
        if backward:
            return step(attention, rotary, x, g0, backward=True)
        with torch.no_grad():
            return step(attention, rotary, x, g0, backward=False)

    # the check: bf16 unpatched and patched against the same layer in fp32
    exact_layer = copy.deepcopy(attention).float()
    x = x0.float().clone().requires_grad_(True)
    exact = {
        k: v.double() for k, v in step(exact_layer, rotary, x, g0.float(), backward=True).items()
    }
    del exact_layer, x
    unpatched = {k: v.double() for k, v in run(True).items()}
    with emulated(family):
        rounded_once = {k: v.double() for k, v in run(True).items()}
    calls = []
    real = mlarope.apply_rope_q

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    mlarope.apply_rope_q = counting
    try:
        with mt.mlarope_patched(family):
            patched = {k: v.double() for k, v in run(True).items()}
    finally:
        mlarope.apply_rope_q = real
    ratios = {}
    for name, want in exact.items():
        theirs = max(float((s[name] - want).norm()) for s in (unpatched, rounded_once))
        ours = float((patched[name] - want).norm())
        ratios[name] = ours / theirs if theirs > 0 else (0.0 if ours == 0 else float("inf"))
    worst = max(ratios, key=ratios.get)
    ok = ratios[worst] <= RATIO and len(calls) == 2
    del unpatched, patched, exact

    times: dict[str, list[float]] = {"fwd": [], "fwd_patched": [], "step": [], "step_patched": []}
    for backward, key in ((False, "fwd"), (True, "step")):
        for _ in range(args.warmup):
            run(backward)
            with mt.mlarope_patched(family):
                run(backward)
        for _ in range(args.rounds):
            times[key] += [timed(lambda b=backward: run(b), device) for _ in range(args.iters)]
            with mt.mlarope_patched(family):
                times[f"{key}_patched"] += [
                    timed(lambda b=backward: run(b), device) for _ in range(args.iters)
                ]
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "family": family,
        "config": config,
        "ratio": ratios[worst],
        "worst": worst,
        "calls": len(calls),
        "ok": ok,
        **med,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per block")
    parser.add_argument("--rounds", type=int, default=3, help="alternating blocks per side")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="small widths (a CPU smoke run)")
    parser.add_argument("--out", default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("transformers_layers: no CUDA device", file=sys.stderr)
        return 2
    import transformers

    rows = [measure(f, args, device) for f in args.families.split(",")]
    what = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    lines = [
        f"{what}; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"mlarope {mlarope.__version__}; bf16, batch 1, sequence {args.seq}, sdpa (causal); "
        f"median of {args.rounds} x {args.iters} iterations per side, alternating blocks",
        "",
        "| model (family) | hidden, heads, nope/rope/v | forward unpatched | forward mlarope "
        "| training step unpatched | training step mlarope | check |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = r["config"]
        check = (
            f"{'ok' if r['ok'] else 'FAILED'}: {r['calls']} rotations through mlarope, "
            f"max |mlarope - fp32| / |transformers - fp32| = {r['ratio']:.3f} ({r['worst']})"
        )
        lines.append(
            f"| {MODEL_NAMES.get(r['family'], r['family'])} ({r['family']}) | {c.hidden_size}, "
            f"{c.num_attention_heads}, {c.qk_nope_head_dim}/{c.qk_rope_head_dim}/{c.v_head_dim} "
            f"| {r['fwd']:.2f} ms | {r['fwd_patched']:.2f} ms | {r['step']:.2f} ms "
            f"| {r['step_patched']:.2f} ms | {check} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
