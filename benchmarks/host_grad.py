"""Host time per call with gradients: mlarope against transformers' own rotary functions.

    PYTHONPATH=src python3 -m benchmarks.host_grad [--seq 16] [--calls 300] [--out FILE]

At tiny sizes (batch 1, ``--seq`` tokens: the GPU idles, so a loop's wall-clock time per call,
with one sync at the end, is the host's), on the same tensors:

- every rotary function of every patched transformers family, at the family's head count and
  rope width (``q: [1, H, S, R]``, a slice of ``[1, H, S, N + R]`` as the attention passes it;
  ``k: [1, 1, S, R]``; bf16 tables, as the family's rotary embedding returns them):
  transformers' function and mlarope's replacement, forward without grad, and forward plus
  backward with grad;
- the public ops with gradients: ``apply_rope_q`` (out of place and in place), ``apply_rope_qk``,
  ``apply_rope_kv``, and ``mlarope.compat.megatron``'s two legacy functions, forward plus
  backward;
- for scale, the same loop around an empty harness (clone, ``requires_grad_``, backward of a
  multiplication) and a one-element torch op.

Each figure is the median of 5 loops of ``--calls`` calls. Prints a markdown table (and writes
it to ``--out``).
"""

from __future__ import annotations

import argparse
import importlib
import sys

import torch

import mlarope
from mlarope.compat import megatron as compat
from mlarope.integrations import transformers as mt
from mlarope.integrations.transformers import _patch
from mlarope.tools.bench.timers import host_us_per_call


def per_call(fn, calls: int) -> float:
    return host_us_per_call(fn, torch.cuda.synchronize, calls, repeats=5, warmup=100)


def _family_shapes(family: str) -> tuple[int, int, int]:
    """``(heads, nope, rope)`` of the family's default config (its text config)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from benchmarks.transformers_layers import _build_model_type

    text = CONFIG_MAPPING[_build_model_type(family)]().get_text_config()

    def read(name, default):
        try:
            value = getattr(text, name, None)
        except Exception:  # per-layer attributes
            value = None
        return default if value is None else value

    heads, rope = read("num_attention_heads", 16), read("qk_rope_head_dim", 64)
    head_dim = read("head_dim", None)  # DeepSeek-V4: a whole head [nope | rope]
    nope = read("qk_nope_head_dim", head_dim - rope if head_dim else 128)
    return heads, nope, rope


def family_rows(seq: int, calls: int, dev) -> list[tuple]:
    rows = []
    for row in mt.family_report():
        if row.status != "patched" or row.runs_on is not None:
            continue
        fam = _patch.family(row.name)
        module = importlib.import_module(fam.module)
        heads, nope, rope = _family_shapes(row.name)
        with mt.mlarope_patched(row.name):
            replacements = {name: getattr(module, name) for name in fam.mappings}
        for name, mapping in fam.mappings.items():
            original = getattr(module, name)
            q_full = torch.randn(1, heads, seq, nope + rope, device=dev, dtype=torch.bfloat16)
            k0 = torch.randn(1, 1, seq, rope, device=dev, dtype=torch.bfloat16)
            q0 = q_full[..., nope:]
            if mapping.complex_freqs:
                angle = torch.randn(1, seq, rope // 2, device=dev)
                tables = (torch.polar(torch.ones_like(angle), angle),)
            else:
                tables = tuple(
                    torch.randn(1, seq, rope, device=dev).to(torch.bfloat16) for _ in range(2)
                )
            grads = (torch.randn_like(q0), torch.randn_like(k0))
            if getattr(mapping, "one_tensor", False):
                # (x, cos, sin): the whole head [nope | rope], tables one entry per pair when
                # half-width (DeepSeek-V4's)
                width = rope // 2 if getattr(mapping, "half_width_tables", False) else rope
                tables = tuple(t[..., :width].contiguous() for t in tables)
                q0, k0, grads = q_full, None, (torch.randn_like(q_full),)
            for label, fn in (("transformers", original), ("mlarope", replacements[name])):
                forward, training = _calls(fn, q0, k0, tables, grads)
                rows.append((
                    f"{row.name}.{name}", f"{heads} x {nope}+{rope}", label,
                    per_call(forward, calls), per_call(training, calls),
                ))  # fmt: skip
    return rows


def _calls(fn, q0, k0, tables, grads):
    """``(forward without grad, forward + backward)`` of a rotary function on these tensors
    (``k0`` None: a one-tensor function, ``fn(x, cos, sin)``)."""

    xs = (q0,) if k0 is None else (q0, k0)

    def forward():
        with torch.no_grad():
            fn(*xs, *tables)

    def training():
        leaves = [x.detach().requires_grad_(True) for x in xs]
        out = fn(*leaves, *tables)
        torch.autograd.backward(out if isinstance(out, tuple) else (out,), grads)

    return forward, training


def op_rows(seq: int, calls: int, dev) -> list[tuple]:
    heads, nope, rope, v = 128, 128, 64, 128
    cos, sin = mlarope.YarnConfig.deepseek_v3().cos_sin(4096, device=dev)
    q0 = torch.randn(seq, 1, heads, nope + rope, device=dev, dtype=torch.bfloat16)
    k0 = torch.randn(seq, 1, 1, rope, device=dev, dtype=torch.bfloat16)
    kv0 = torch.randn(seq, 1, heads, nope + v, device=dev, dtype=torch.bfloat16)
    g = torch.randn_like(q0)
    gk, gv = (
        torch.randn(seq, 1, heads, nope + rope, device=dev),
        torch.randn(seq, 1, heads, v, device=dev),
    )
    gk, gv = gk.to(torch.bfloat16), gv.to(torch.bfloat16)
    mc, ms = cos.view(-1, 1, 1, rope), sin.view(-1, 1, 1, rope)

    def q_out():
        q = q0.detach().requires_grad_(True)
        mlarope.apply_rope_q(q, cos, sin).backward(g)

    def q_in():
        leaf = q0.detach().requires_grad_(True)
        mlarope.apply_rope_q(leaf * 1, cos, sin, inplace=True).backward(g)

    def qk():
        q, k = q0.detach().requires_grad_(True), k0.detach().requires_grad_(True)
        a, b = mlarope.apply_rope_qk(q, k, cos, sin)
        torch.autograd.backward((a, b), (g, torch.ones_like(b)))

    def kv():
        x, k_pe = kv0.detach().requires_grad_(True), k0.detach().requires_grad_(True)
        k, vv = mlarope.apply_rope_kv(x, k_pe, cos, sin, k_dim=nope)
        torch.autograd.backward((k, vv), (gk, gv))

    def megatron_q():
        q = q0.detach().requires_grad_(True) * 1
        out = compat.fused_apply_mla_rope_for_q(q, mc, ms, nope, rope)
        out.backward(g)

    def megatron_kv():
        x, k_pe = kv0.detach().requires_grad_(True), k0.detach().requires_grad_(True)
        k, vv = compat.fused_apply_mla_rope_for_kv(x, k_pe, mc, ms, rope, nope, v)
        torch.autograd.backward((k, vv), (gk, gv))

    def harness():
        q = q0.detach().requires_grad_(True)
        (q * 1).backward(g)

    one = torch.zeros(1, device=dev)
    shape = f"sbhd [{seq}, 1, {heads}, {nope}+{rope}]"
    rows = [
        ("harness: (q * 1).backward(g)", shape, "torch", None, per_call(harness, calls)),
        ("a one-element torch op", "[1]", "torch", per_call(lambda: one.add_(1), calls), None),
    ]
    for name, fn in (("apply_rope_q", q_out), ("apply_rope_q inplace", q_in),
                     ("apply_rope_qk (q, k_pe)", qk), ("apply_rope_kv", kv),
                     ("compat.megatron fused_apply_mla_rope_for_q", megatron_q),
                     ("compat.megatron fused_apply_mla_rope_for_kv", megatron_kv)):  # fmt: skip
        rows.append((name, shape, "mlarope", None, per_call(fn, calls)))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_grad: no CUDA device", file=sys.stderr)
        return 2
    import transformers

    dev = torch.device("cuda")
    rows = family_rows(args.seq, args.calls, dev) + op_rows(args.seq, args.calls, dev)
    lines = [
        f"{torch.cuda.get_device_name(dev)}; torch {torch.__version__}, transformers "
        f"{transformers.__version__}, mlarope {mlarope.__version__}; batch 1, sequence "
        f"{args.seq}, bf16; host us per call (median of 5 loops of {args.calls})",
        "",
        "| call | shape | by | forward, no grad | forward + backward |",
        "|---|---|---|---|---|",
    ]
    fmt = lambda x: "-" if x is None else f"{x:.1f}"
    for name, shape, by, fwd, train in rows:
        lines.append(f"| {name} | {shape} | {by} | {fmt(fwd)} | {fmt(train)} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
