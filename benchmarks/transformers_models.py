"""A whole transformers MLA model's training step per family, unpatched and through mlarope.

For each family (``--families default``: the ones ``apply_mlarope_to_all()`` patches by
default; ``all``: every patched family; or a list), a causal LM of the family's default config
(the released model's widths and vocabulary; random weights, no download) with two decoder
layers, bf16, batch 1, sdpa attention where the family has it (else eager), at each ``--seq``:

- **the two layers** are both MLA attention layers with a rotary embedding: the per-layer
  settings of the attention (``layer_types``, ``indexer_types``, ``per_layer_config``, ...)
  are those of the default model's first two such layers (``bailing_hybrid``'s 6th and 12th:
  its first five are linear attention). Where the family starts with dense MLP layers
  (``first_k_dense_replace``, ``mlp_layer_types``), layer 0 is dense and layer 1 MoE (at two
  layers the defaults would give two dense layers, and the experts would not run); otherwise
  the MLPs are those of the default model's first two layers. LongCat-Flash counts two
  attention sublayers a layer: one of its layers;
- **experts cut to 8**: routed experts 8, experts per token ``min(default, 8)`` (8 where the
  config leaves it unset: DeepSeek-V2's), expert groups 1 so the router's group choice stays
  valid, LongCat-Flash's zero experts cut in proportion; MLP widths as released;
- **the training step**: zero the gradients, forward with labels (random tokens, random
  labels: the model's own causal LM loss), ``loss.backward()``.

Variants (``VARIANTS``: a name and a context manager, the first chosen is the baseline):
``unpatched``; ``patched``, ``apply_mlarope_to_all()`` with its defaults inside the block,
``revert_mlarope_all()`` after; ``patched_all``, the same with ``include_off_by_default=True``;
``fused``, ``patched`` and the attention-level path (``apply_mlarope_attention(model)``).

Measured per family, sequence and variant: the step's time (CUDA events; warm-up, then
alternating blocks of the variants, reversed every other round; the median of all iterations,
and the spread of the blocks' medians), its ratio to the baseline with the spread of the
per-round ratios and a verdict (``faster``: the variant's slowest block beats the baseline's
fastest; ``no slower``: its median is within the baseline's block spread or below; ``SLOWER``);
peak memory over one step; GPU time by category over one profiled step
(``benchmarks/step_profile.py``); host time of the step call and of a no-grad forward (wall
time until the call returns, synchronized outside the timed region); rotations reaching
mlarope per step; with ``--sync-check``, whether a step synchronizes under
``torch.cuda.set_sync_debug_mode("error")``.

    PYTHONPATH=src python -m benchmarks.transformers_models [--families default|all|a,b]
        [--seq 4096,128] [--variants unpatched,patched] [--iters 5] [--rounds 3]
        [--sync-check] [--out FILE.md] [--json FILE.json]
    PYTHONPATH=src python -m benchmarks.transformers_models --device cpu --tiny --seq 16  # smoke

On the CPU (the smoke) the times are the host's and the categories come from the profiled ops'
own CPU time; they mean nothing but exercise every path. Exit status 1 when a family cannot be
built or run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib
import importlib.metadata
import json
import platform
import shlex
import statistics
import sys
import time
import traceback
import types
from collections.abc import Callable

import torch

import mlarope
from benchmarks import step_profile
from benchmarks import transformers_layers as tl
from mlarope.integrations import transformers as mt
from mlarope.integrations.transformers import _patch

EXPERTS = 8
EXPERT_COUNTS = ("n_routed_experts", "num_experts", "num_local_experts")
TOP_K = ("num_experts_per_tok", "moe_topk", "num_experts_per_token")
GROUPS = ("n_group", "num_expert_group", "num_group", "topk_group")
MLP_LISTS = ("mlp", "expert", "moe")  # a per-layer list whose name has one of these: the MLP's


@contextlib.contextmanager
def patched_defaults(*, include_off_by_default: bool = False):
    """``apply_mlarope_to_all()`` inside the block, ``revert_mlarope_all()`` after."""
    mt.apply_mlarope_to_all(include_off_by_default=include_off_by_default)
    try:
        yield
    finally:
        mt.revert_mlarope_all()


@contextlib.contextmanager
def fused_attention(model):
    """``patched`` and the attention-level path (``apply_mlarope_attention(model)``) inside the
    block, both reverted after."""
    mt.apply_mlarope_to_all()
    outcome = mt.apply_mlarope_attention(model)
    if all(v.startswith("not fused") for v in outcome.values()):
        print(f"transformers_models: nothing fused: {outcome}", file=sys.stderr)
    try:
        yield
    finally:
        mt.revert_mlarope_attention(model)
        mt.revert_mlarope_all()


# name -> a context manager of the model that puts the variant in place for the block
VARIANTS: list[tuple[str, Callable[[torch.nn.Module], contextlib.AbstractContextManager]]] = [
    ("unpatched", lambda model: contextlib.nullcontext()),
    ("patched", lambda model: patched_defaults()),
    ("patched_all", lambda model: patched_defaults(include_off_by_default=True)),
    ("fused", fused_attention),
]


# ---------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------


def _get(text, fields: dict, name: str):
    value = fields.get(name)
    return tl._attribute(text, name) if value is None else value


def experts(text) -> int:
    """The routed experts of a (text) config; 0 for a dense model."""
    fields = text.to_dict()
    counts = [_get(text, fields, n) for n in EXPERT_COUNTS]
    return max((n for n in counts if isinstance(n, int)), default=0)


def moe_fields(text) -> tuple[dict, dict]:
    """``(config fields, fields to set after)`` that cut the experts to ``EXPERTS``: the
    second holds the top-k a config leaves unset (None), which ``_config`` does not set."""
    fields = text.to_dict()
    counts = [_get(text, fields, n) for n in EXPERT_COUNTS]
    n_experts = experts(text)
    if n_experts <= EXPERTS:
        return {}, {}
    over = {n: EXPERTS for n, v in zip(EXPERT_COUNTS, counts, strict=True) if v is not None}
    unset = {}
    for name in TOP_K:
        if name in fields or tl._attribute(text, name) is not None:
            k = _get(text, fields, name)
            (over if k is not None else unset)[name] = EXPERTS if k is None else min(k, EXPERTS)
    for name in GROUPS:
        if isinstance(_get(text, fields, name), int):
            over[name] = 1
    if isinstance(fields.get("zero_expert_num"), int):  # longcat_flash: identity experts
        over["zero_expert_num"] = round(fields["zero_expert_num"] * EXPERTS / n_experts)
    return over, unset


def _attention_classes(family: str) -> tuple[type, ...]:
    row = {r.name: r for r in mt.family_report()}[family]
    module = importlib.import_module(row.module)
    return tuple(c for c in (getattr(module, n, None) for n in row.attention) if c)


def decoder_layers(model, classes) -> torch.nn.ModuleList:
    """The model's decoder layers: its first ``ModuleList`` named ``layers`` that holds one of
    the attention ``classes`` (a composite's vision tower has layers too)."""
    for name, module in model.named_modules():
        listed = isinstance(module, torch.nn.ModuleList) and name.split(".")[-1] == "layers"
        if listed and any(isinstance(m, classes) for m in module.modules()):
            return module
    raise RuntimeError(f"no decoder layers with {[c.__name__ for c in classes]}")


def _is_mla(layer, classes) -> bool:
    return any(
        isinstance(m, classes) and getattr(m, "qk_rope_head_dim", 1) for m in layer.modules()
    )


def mla_layers(family: str, n: int = 16) -> list[int]:
    """The indices of the default model's decoder layers (of its first ``n``) that hold an MLA
    attention with a rotary embedding (built on the meta device: no memory, no time)."""
    classes = _attention_classes(family)
    model, _ = tl._model(tl._config(family, n, True), torch.device("meta"))
    layers = decoder_layers(model, classes)
    return [i for i, layer in enumerate(layers) if _is_mla(layer, classes)]


def model_config(family: str, tiny: bool):
    """The family's default config cut to two MLA layers (one dense, one MoE where it starts
    dense) and ``EXPERTS`` experts; tiny: small widths, MLPs and vocabulary too."""
    _, _, text = tl.default_config(family)
    fields = text.to_dict()
    mla = mla_layers(family)[:2]
    if len(mla) < 2:
        raise RuntimeError(f"fewer than two MLA layers with a rotary embedding: {mla}")
    kinds = fields.get("mlp_layer_types") or []
    dense = [i for i, t in enumerate(kinds) if t == "dense"]
    sparse = [i for i, t in enumerate(kinds) if t != "dense"]
    mlp = [dense[0], sparse[0]] if dense and sparse else [0, 1]
    over, unset = moe_fields(text)
    if (fields.get("first_k_dense_replace") or 0) > 0 and experts(text):
        over["first_k_dense_replace"] = 1
    if tiny:
        over = {**tl.SMALL_MLP, **over}

    def sources(name: str) -> list[int]:
        return mlp if any(w in name for w in MLP_LISTS) else mla

    config = tl._config(family, 2, tiny, mlp=over, small_vocab=tiny, sources=sources)
    for name, value in unset.items():
        setattr(config.get_text_config(), name, value)
    return config


def causal_lm(config):
    """What builds the text model's causal LM from its config (``.from_config``): the registered
    one, else its modeling module's ``*ForCausalLM`` (mistral4's is not registered), else the
    composite's ``*ForConditionalGeneration`` (mistral_large4, hy_v4_vl: its other towers are
    built, and never run: the input is text only)."""
    from transformers import AutoModel, AutoModelForCausalLM

    text = config.get_text_config()
    if type(text) in AutoModelForCausalLM._model_mapping:
        return AutoModelForCausalLM
    module = sys.modules[AutoModel._model_mapping[type(text)].__module__]
    named = {n: c for n, c in vars(module).items() if isinstance(c, type)}
    lm = next((c for n, c in named.items() if n.endswith("ForCausalLM")), None)
    if lm is not None:
        return types.SimpleNamespace(from_config=lm._from_config)
    composite = next(c for n, c in named.items() if n.endswith("ForConditionalGeneration"))

    def from_config(text):
        whole = composite.config_class(text_config=text.to_dict())
        return composite._from_config(whole, attn_implementation=text._attn_implementation)

    return types.SimpleNamespace(from_config=from_config)


def build(family: str, device: torch.device, tiny: bool) -> tuple[torch.nn.Module, dict]:
    """``(model, description)``: the family's two-layer causal LM in bf16, in training mode."""
    config = model_config(family, tiny)
    torch.manual_seed(0)
    model, implementation = tl._model(config, device, auto=causal_lm(config))
    model = model.to(torch.bfloat16).train()
    classes = _attention_classes(family)
    layers = decoder_layers(model, classes)
    kinds = []
    for i, layer in enumerate(layers):
        if not _is_mla(layer, classes):
            raise RuntimeError(f"decoder layer {i} has no MLA attention with a rotary embedding")
        moe = any(name.endswith("experts") for name, _ in layer.named_modules())
        kinds.append("MoE" if moe else "dense")
    text = model.config.get_text_config()
    fields = text.to_dict()
    top_k = next((fields[n] for n in TOP_K if fields.get(n) is not None), None)
    attention = next(m for m in layers[0].modules() if isinstance(m, classes))
    return model, {
        "family": family,
        "model": type(model).__name__,
        "layers": " + ".join(f"MLA/{k}" for k in kinds),
        "widths": tl._widths(text, attention),
        "experts": f"{experts(text)}, top {top_k}" if "MoE" in kinds else "-",
        "vocab": text.vocab_size,
        "params": sum(p.numel() for p in model.parameters()),
        "attention": implementation,
        "experts_implementation": getattr(text, "_experts_implementation", None) or "-",
    }


# ---------------------------------------------------------------------------------------------
# the measurements
# ---------------------------------------------------------------------------------------------


def train_step(model, ids, labels) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach()


def forward_no_grad(model, ids, labels) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, labels=labels).loss


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_ms(fn, device: torch.device) -> float:
    """Wall milliseconds until ``fn()`` returns (synchronized before and after, not inside)."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    elapsed = (time.perf_counter() - t0) * 1e3
    _sync(device)
    return elapsed


def peak_gib(fn, device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    _sync(device)
    return torch.cuda.max_memory_allocated(device) / 2**30


def sync_check(fn) -> str:
    """``"none"``, or the first synchronizing call ``fn()`` makes (its message's first line)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as exc:
        ours = [f for f in traceback.extract_tb(exc.__traceback__) if "/torch/" not in f.filename]
        where = f" at {ours[-1].filename.rsplit('/', 1)[-1]}:{ours[-1].lineno}" if ours else ""
        return f"sync{where}: {str(exc).splitlines()[0][:100]}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return "none"


def measure(family: str, model, seq: int, args, device, variants) -> list[dict]:
    """One row per variant for ``model`` at ``seq``."""
    text = model.config.get_text_config()
    gen = torch.Generator().manual_seed(seq)
    ids = torch.randint(text.vocab_size, (1, seq), generator=gen).to(device)
    labels = torch.randint(text.vocab_size, (1, seq), generator=gen).to(device)
    step = lambda: train_step(model, ids, labels)
    fam = _patch.family(family)
    rotary_module, rotary_names = importlib.import_module(fam.module), list(fam.mappings)
    rows = {name: {"family": family, "seq": seq, "variant": name, "blocks": []}
            for name, _ in variants}  # fmt: skip
    for name, variant in variants:
        count = tl._Count(family)
        with variant(model):
            rows[name]["loss"] = float(step())
            for _ in range(args.warmup):
                step()
            with count.mlarope():
                step()
            rows[name]["rotations"] = count.reached
    rounds = args.rounds if seq >= 1024 else 3 * args.rounds  # short steps: noisier, cheaper
    times = {name: [] for name, _ in variants}
    for r in range(rounds):
        for name, variant in variants if r % 2 == 0 else variants[::-1]:
            with variant(model):
                block = [tl.timed(step, device) for _ in range(args.iters)]
            times[name] += block
            rows[name]["blocks"].append(statistics.median(block))
    for name, variant in variants:
        row = rows[name]
        row["step_ms"] = statistics.median(times[name])
        with variant(model):
            model.zero_grad(set_to_none=True)
            row["peak_gib"] = peak_gib(step, device)
            row["host_step_ms"] = statistics.median(host_ms(step, device)
                                                    for _ in range(args.host_iters))  # fmt: skip
            row["host_forward_ms"] = statistics.median(
                host_ms(lambda: forward_no_grad(model, ids, labels), device)
                for _ in range(args.host_iters)
            )
            row["categories"] = (
                step_profile.profile_step(
                    step, device, model, rotary_module, rotary_names, args.top_kernels
                )
                if args.profile
                else None
            )
            row["sync"] = sync_check(step) if args.sync_check and device.type == "cuda" else "-"
    base = rows[variants[0][0]]
    for row in rows.values():
        ratios = [b / a for a, b in zip(base["blocks"], row["blocks"], strict=True)]
        row["ratio"] = row["step_ms"] / base["step_ms"]
        row["ratio_spread"] = (min(ratios), max(ratios))
        if row is base:
            row["verdict"] = "baseline"
        elif max(row["blocks"]) < min(base["blocks"]):
            row["verdict"] = "faster"
        elif row["step_ms"] <= max(base["blocks"]):
            row["verdict"] = "no slower"
        else:
            row["verdict"] = "SLOWER"
    return list(rows.values())


# ---------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------


def _name(family: str) -> str:
    return f"{tl.MODEL_NAMES.get(family, family)} ({family})"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def model_row(m: dict) -> str:
    if "error" in m:
        return f"| {_name(m['family'])} | FAILED: {m['error']} | | | | | |"
    return (
        f"| {_name(m['family'])} | {m['layers']} | {m['widths']} | {m['experts']} | {m['vocab']} "
        f"| {_count(m['params'])} | {m['model']}: {m['attention']}, experts "
        f"{m['experts_implementation']} |"
    )


def step_row(r: dict, base: dict | None) -> str:
    lo, hi = min(r["blocks"]), max(r["blocks"])
    step = f"{r['step_ms']:.2f} ms ({lo:.2f}-{hi:.2f})"
    ratio = f"{r['ratio']:.3f}x ({r['ratio_spread'][0]:.3f}-{r['ratio_spread'][1]:.3f})"
    if r["peak_gib"] is None:
        peak = "-"
    elif base is None or r is base:
        peak = f"{r['peak_gib']:.2f} GiB"
    else:
        peak = f"{r['peak_gib']:.2f} GiB ({(r['peak_gib'] - base['peak_gib']) * 1024:+.0f} MiB)"
    return (
        f"| {_name(r['family'])} | {r['seq']} | {r['variant']} | {step} | {ratio} | {r['verdict']} "
        f"| {peak} | {r['host_step_ms']:.1f} / {r['host_forward_ms']:.1f} ms | {r['rotations']} "
        f"| {r['loss']:.4f} | {r['sync']} |"
    )


def category_row(r: dict) -> str:
    c = r["categories"]
    cells = " | ".join(f"{c[k]:.2f}" for k in step_profile.CATEGORIES)
    return f"| {_name(r['family'])} | {r['seq']} | {r['variant']} | {c['total']:.2f} | {cells} |"


def header(args, argv: list[str], device: torch.device) -> dict:
    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    what = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": what or platform.machine(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            **{n: version(n) for n in ("triton", "transformers", "kernels")},
            "mlarope": mlarope.__version__,
        },
        "command": "python -m benchmarks.transformers_models " + shlex.join(argv),
    }


def report(head: dict, models: list[dict], rows: list[dict], args) -> str:
    v = head["versions"]
    where = "GPU" if args.device.startswith("cuda") else "CPU (self time of the profiled ops)"
    lines = [
        f"{head['date']}; {head['device']}; python {v['python']}, torch {v['torch']}, triton "
        f"{v['triton']}, transformers {v['transformers']}, kernels {v['kernels']}, mlarope "
        f"{v['mlarope']}",
        "",
        f"`{head['command']}`",
        "",
        "| model (family) | layers | hidden, heads, nope/rope/v | experts | vocab | parameters "
        "| model class: attention, experts |",
        "|---|---|---|---|---|---|---|",
        *(model_row(m) for m in models),
        "",
        f"Training step (zero grads, forward with labels, backward), bf16, batch 1: median of "
        f"{args.rounds} x {args.iters} iterations a variant ({3 * args.rounds} x {args.iters} "
        f"below sequence 1024) in alternating blocks, (fastest-slowest block median); ratio to "
        f"the first variant (lowest-highest per-round ratio); peak memory over one step; host "
        f"time until the call returns, training step / no-grad forward (median of "
        f"{args.host_iters}); rotations through mlarope in one step; the first step's loss.",
        "",
        "| model (family) | seq | variant | training step | ratio | verdict | peak memory "
        "| host: step / forward | mlarope rotations | loss | sync |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    bases = {(r["family"], r["seq"]): r for r in rows if r.get("verdict") == "baseline"}
    for r in rows:
        if "error" in r:
            lines.append(f"| {_name(r['family'])} | {r['seq']} | | FAILED: {r['error']} |"
                         " | | | | | | |")  # fmt: skip
        else:
            lines.append(step_row(r, bases.get((r["family"], r["seq"]))))
    profiled = [r for r in rows if r.get("categories")]
    if profiled:
        lines += [
            "",
            f"{where} time of one profiled step by category, ms (benchmarks/step_profile.py):",
            "",
            f"| model (family) | seq | variant | total | {' | '.join(step_profile.CATEGORIES)} |",
            "|---|---|---|---|" + "---|" * len(step_profile.CATEGORIES),
            *(category_row(r) for r in profiled),
        ]
    return "\n".join(lines)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def write(args, head: dict, models: list[dict], rows: list[dict]) -> str:
    """The report; also written to ``--out`` and ``--json`` when given."""
    text = report(head, models, rows, args)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({**head, "models": models, "rows": rows}, f, indent=1)
    return text


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", default="default",
                        help="'default' (apply_mlarope_to_all()'s), 'all' or a list")  # fmt: skip
    parser.add_argument("--seq", default="4096,128", help="sequence lengths, comma-separated")
    parser.add_argument("--variants", default="unpatched,patched",
                        help=f"comma list of {', '.join(n for n, _ in VARIANTS)}; the first "
                        "is the baseline")  # fmt: skip
    parser.add_argument("--iters", type=int, default=5, help="timed iterations per block")
    parser.add_argument("--rounds", type=int, default=3, help="alternating blocks per variant")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--host-iters", type=int, default=3)
    parser.add_argument("--no-profile", dest="profile", action="store_false")
    parser.add_argument("--top-kernels", type=int, default=25,
                        help="the largest kernels of each profiled step, in the JSON")  # fmt: skip
    parser.add_argument("--sync-check", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="small widths (a CPU smoke run)")
    parser.add_argument("--out", default=None, help="also write the markdown here")
    parser.add_argument("--json", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    known = dict(VARIANTS)
    chosen = args.variants.split(",")
    if unknown := [v for v in chosen if v not in known]:
        parser.error(f"--variants: unknown {unknown} (known: {list(known)})")
    variants = [(name, known[name]) for name in chosen]
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("transformers_models: no CUDA device", file=sys.stderr)
        return 2
    seqs = [int(s) for s in args.seq.split(",")]
    head = header(args, argv, device)
    models, rows = [], []
    for family in tl.families(args.families):
        t0 = time.perf_counter()
        try:
            model, description = build(family, device, args.tiny)
        except Exception as exc:  # a family that cannot be built is a failed row
            traceback.print_exc()
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            models.append({"family": family, "error": error})
            rows += [{"family": family, "seq": s, "error": error} for s in seqs]
            _free(device)
            continue
        models.append(description)
        print(model_row(description), flush=True)
        for seq in seqs:
            try:
                found = measure(family, model, seq, args, device, variants)
            except Exception as exc:
                traceback.print_exc()
                found = [{"family": family, "seq": seq, "error": f"{type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:160]}"}]  # fmt: skip
            rows += found
            for r in found:
                print(step_row(r, found[0]) if "error" not in r else r["error"], flush=True)
            write(args, head, models, rows)  # what is done so far, should a time limit cut in
        del model
        _free(device)
        print(f"transformers_models: {family} took {time.perf_counter() - t0:.0f} s",
              file=sys.stderr, flush=True)  # fmt: skip
    print(write(args, head, models, rows))
    failed = any("error" in r for r in rows) or any("error" in m for m in models)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
