"""One real-size transformers MLA attention layer per family, unpatched and through mlarope.

For every patched family of the installed transformers (``--families all``, the default; or a
list), the attention layer at the family's default config (the released model's widths: no
download, random weights), bf16 on one device, batch 1, sdpa attention where the family has it
(else eager), causal, at each ``--seq``:

- the layer's inputs are the ones its model hands it: the model is built from the config with
  only as many layers as reach its first MLA layer with a rotary embedding, its MLPs and experts
  shrunk (they never run) and a small vocabulary, and a forward pre-hook on that attention layer
  takes the arguments the model passes (hidden states, position embeddings, masks, position ids:
  whatever the family passes) and stops the forward there;
- forward, and a training step (forward + backward of every parameter and the input), timed with
  CUDA events (warm-up, then alternating blocks of unpatched and patched iterations, median per
  side), in one process;
- checked: every rotation of the unpatched step reaches mlarope in the patched one, and each
  tensor (output, input gradient, every parameter gradient) of the patched bf16 step is as close
  to the same layer in fp32 (the same bf16-valued weights and input, unpatched) as the unpatched
  bf16 step is, by Frobenius norm: ``|patched - fp32| <= 1.25 max(|unpatched - fp32|,
  |rounded once - fp32|)``, where "rounded once" is transformers' own rotary function computed
  in fp32 and rounded once (mlarope's error model, with transformers' code). Each run is the
  layer's bf16 noise, of the same size (mlarope rounds the rotation once, transformers three
  times); a wrong rotation puts the patched run O(1) away.

Targets (never slower): the training step through mlarope at <= 0.98x unpatched at sequence 4096
and <= 1.00x at 128. Prints a markdown table (and writes it to ``--out``); exit status 1 when a
check fails or a family cannot be built.

    PYTHONPATH=src python -m benchmarks.transformers_layers [--families all|a,b]
        [--seq 4096,128] [--iters 10] [--rounds 3] [--out FILE]
    PYTHONPATH=src python -m benchmarks.transformers_layers --device cpu --tiny  # CPU smoke
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
import traceback

import torch

import mlarope
from mlarope.integrations import transformers as mt
from mlarope.integrations.transformers import _patch

MODEL_NAMES = {
    "deepseek_v2": "DeepSeek-V2",
    "deepseek_v3": "DeepSeek-V3",
    "deepseek_v32": "DeepSeek-V3.2",
    "glm4_moe_lite": "GLM-4.7-Flash",
    "longcat_flash": "LongCat-Flash",
    "minicpm3": "MiniCPM3-4B",
}
RATIO = 1.25
TARGETS = {4096: 0.98, 128: 1.00}  # training step, mlarope / unpatched, by sequence length
# Config fields that only size the MLPs and experts (they never run: the forward stops at the
# attention layer), and the small widths --tiny gives the attention.
SMALL_MLP = dict(
    intermediate_size=32, moe_intermediate_size=32, ffn_hidden_size=32,
    expert_ffn_hidden_size=32, n_routed_experts=4, num_local_experts=4, num_experts=4,
    num_experts_per_tok=2, moe_topk=2, n_group=1, num_group=1, topk_group=1, n_shared_experts=1,
    zero_expert_num=0,
)  # fmt: skip
TINY = dict(
    hidden_size=256, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64,
    kv_lora_rank=32, index_n_heads=2, swa_num_attention_heads=4, swa_num_key_value_heads=4,
    swa_q_lora_rank=64, swa_kv_lora_rank=32, linear_num_heads=4,
)  # fmt: skip


class _Stop(Exception):
    """Raised by the pre-hook once it holds the attention layer's arguments."""


def _config(
    family: str,
    layers: int,
    tiny: bool,
    *,
    mlp: dict | None = None,
    small_vocab: bool = True,
    sources=None,
):
    """The family's default config with ``layers`` layers, small MLPs (and widths if tiny).

    ``mlp``: the fields that size the MLPs and experts, set where the config has them (default
    ``SMALL_MLP``: here they never run); ``small_vocab``: a 256-token vocabulary (the layer
    benchmark never reaches the head); ``sources(name)``: for the per-layer list or map
    ``name``, the default layers whose entries the ``layers`` kept layers take (default: the
    first ``layers``)."""
    config_class, default, text = default_config(family)
    n_layers = text.num_hidden_layers
    fields = text.to_dict()
    over = {"num_hidden_layers": layers, "use_cache": False}
    if "num_layers" in fields and n_layers == 2 * fields["num_layers"]:  # longcat_flash
        over = {"num_layers": max(layers // 2, 1), "use_cache": False}
    for name, value in {**(SMALL_MLP if mlp is None else mlp), **(TINY if tiny else {})}.items():
        if fields.get(name) is not None or _attribute(text, name) is not None:
            over[name] = value
    if tiny and _attribute(text, "linear_head_dim") is not None:  # linear attention's width
        over["head_dim"] = TINY["hidden_size"] // TINY["num_attention_heads"]
    if "vocab_size" in fields and small_vocab:
        specials = [fields.get(n) for n in ("pad_token_id", "bos_token_id", "eos_token_id")]
        ids = [i for s in specials for i in (s if isinstance(s, list) else [s]) if i is not None]
        over["vocab_size"] = max([256, *(i + 1 for i in ids)])
    for name, value in fields.items():  # per-layer lists and maps, cut to the layers kept
        kept = list(range(layers)) if sources is None else list(sources(name))
        if isinstance(value, list) and len(value) == n_layers:
            over[name] = [value[i] for i in kept]
        elif isinstance(value, dict) and name == "per_layer_config":
            over[name] = {
                (key if int(key) == new else str(new).zfill(len(key))): value[key]
                for new, old in enumerate(kept)
                for key in value
                if int(key) == old
            }
    if text is default:
        return config_class(**over)
    return config_class(text_config=over)


def default_config(family: str) -> tuple:
    """``(config class, its default config, the default text config)`` of the family's model
    type (the text config is the default config itself unless the model is composite)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[_build_model_type(family)]
    default = config_class()
    return config_class, default, default.get_text_config()


def _attribute(config, name: str):
    """``config.name`` (through its attribute map), or None (per-layer attributes too)."""
    try:
        return getattr(config, name, None)
    except Exception:  # transformers' per-layer attributes refuse a global read
        return None


def _build_model_type(family: str) -> str:
    row = {r.name: r for r in mt.family_report()}[family]
    configs = _patch.discovery().config_classes
    if row.runs_on is not None:
        return row.name
    return next(t for t in row.model_types if t in configs)


def _model(config, device: torch.device, *, auto=None):
    """``(model, attention implementation)``: ``auto.from_config(text config)`` (default
    ``AutoModel``: the base model) on ``device``, with sdpa attention where the family has it."""
    from transformers import AutoModel

    text = config.get_text_config()
    for implementation in ("sdpa", "eager"):
        text._attn_implementation = implementation
        try:
            with torch.device(device):
                return (auto or AutoModel).from_config(text), implementation
        except ValueError as exc:  # "does not support an attention implementation ..."
            if "does not support" not in str(exc):
                raise
    raise RuntimeError("no attention implementation")


def build(family: str, device: torch.device, seq: int, tiny: bool):
    """``(config, attention, kwargs32, kwargs16, implementation)``: the family's first MLA
    attention layer with a rotary embedding, in fp32 (``kwargs32``: the arguments its model
    passes it for an fp32 input) and then in bf16 (``kwargs16``)."""
    row = {r.name: r for r in mt.family_report()}[family]
    module = importlib.import_module(row.module)
    classes = tuple(c for c in (getattr(module, n, None) for n in row.attention) if c)
    model = found = None
    for layers in (1, 2, 4, 8, 16):
        config = _config(family, layers, tiny)
        model, implementation = _model(config, device)
        found = [
            m for m in model.modules()
            if isinstance(m, classes) and getattr(m, "qk_rope_head_dim", 1)
        ]  # fmt: skip
        if found:
            break
    if not found:
        raise RuntimeError(f"no {row.attention} layer with a rotary embedding in 16 layers")
    attention = found[0]
    torch.manual_seed(0)
    text = config.get_text_config()
    with torch.no_grad():
        for p in attention.parameters():
            if p.dim() > 1:
                p.normal_(0.0, getattr(text, "initializer_range", 0.02))
            else:
                p.normal_(1.0, 0.02)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, seq, text.hidden_size, generator=gen).to(device)

    def capture(model, dtype):
        model.to(dtype)
        got = {}

        def hook(_module, args, kwargs):
            # Detached (a tensor that required grad becomes a leaf that does): the model's
            # graph up to here is freed with the aborted forward.
            got.update({name: _detached(value) for name, value in kwargs.items()})
            if args:
                got["hidden_states"] = args[0]  # replaced by each step's input
            raise _Stop

        handle = attention.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            model.train()(inputs_embeds=x.to(dtype))
        except _Stop:
            pass
        finally:
            handle.remove()
        return got

    kwargs32 = capture(model, torch.float32)
    kwargs16 = capture(model, torch.bfloat16)
    exact = copy.deepcopy(attention).float()  # the same bf16-valued weights, in fp32
    return config, attention, exact, kwargs32, kwargs16, implementation


def _detached(value):
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.requires_grad)
    if isinstance(value, tuple):
        return tuple(_detached(v) for v in value)
    return value


def _fresh(kwargs: dict, x: torch.Tensor) -> dict:
    """The captured arguments with ``x`` as the hidden states; tensors that required grad in
    the model (mistral_large4's tables, from a trainable rope parameter) as new leaves that
    require grad, so each step differentiates them as the model would."""
    out = {}
    for name, value in kwargs.items():
        if name == "hidden_states":
            value = x
        elif isinstance(value, torch.Tensor) and value.requires_grad:
            value = value.detach().requires_grad_(True)
        elif isinstance(value, tuple) and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in value
        ):
            value = tuple(
                t.detach().requires_grad_(True) if isinstance(t, torch.Tensor) else t for t in value
            )
        out[name] = value
    return out


def step(attention, kwargs, x, grad, *, backward: bool) -> dict[str, torch.Tensor]:
    out = attention(**_fresh(kwargs, x))
    out = out[0] if isinstance(out, tuple) else out
    if not backward:
        return {"output": out}
    out.backward(grad)
    result = {"output": out.detach(), "input gradient": x.grad}
    result.update({n: p.grad for n, p in attention.named_parameters() if p.grad is not None})
    return result


@contextlib.contextmanager
def emulated(family: str):
    """transformers' own rotary functions computed in fp32 and rounded once to their result
    dtype: mlarope's rounding with transformers' code, a second sample of the layer's bf16
    noise next to the unpatched run."""
    fam = _patch.family(family)
    module = importlib.import_module(fam.module)
    saved = {name: getattr(module, name) for name in fam.mappings}

    def wrap(original, mapping):
        def up(t):
            if not isinstance(t, torch.Tensor):
                return t
            return t.to(torch.complex64) if t.is_complex() else t.float()

        def one_tensor(x, cos, *args, **kwargs):
            dtype = x.dtype
            if mapping.result_dtype != "input":
                dtype = torch.promote_types(x.dtype, cos.dtype)
            return original(up(x), up(cos), *map(up, args), **kwargs).to(dtype)

        if getattr(mapping, "one_tensor", False):
            return one_tensor

        def fn(q, k, *args, **kwargs):
            table = args[0]
            q_out, k_out = original(up(q), up(k), *map(up, args), **kwargs)

            def dtype(t):
                if mapping.result_dtype == "input" or table.is_complex():
                    return t.dtype
                return torch.promote_types(t.dtype, table.dtype)

            return q_out.to(dtype(q)), None if k_out is None else k_out.to(dtype(k))

        return fn

    for name, mapping in fam.mappings.items():
        setattr(module, name, wrap(saved[name], mapping))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


class _Count:
    """Tensors the family's rotary functions rotate (unpatched; ``trainable``: with tables
    that require grad, which mlarope leaves to transformers) and tensors reaching mlarope."""

    def __init__(self, family: str):
        fam = _patch.family(family)
        self.module = importlib.import_module(fam.module)
        self.names = list(fam.mappings)
        self.one_tensor = {n: getattr(m, "one_tensor", False) for n, m in fam.mappings.items()}
        self.rotated = self.trainable = self.reached = 0

    @contextlib.contextmanager
    def unpatched(self):
        saved = {n: getattr(self.module, n) for n in self.names}

        def wrap(original, one_tensor):
            def fn(*all_args, **kwargs):
                _, k, *args = (all_args[0], None, *all_args[1:]) if one_tensor else all_args
                n = 1 if k is None else 2
                tables = [t for t in args[:2] if isinstance(t, torch.Tensor)]
                if torch.is_grad_enabled() and any(t.requires_grad for t in tables):
                    self.trainable += n
                else:
                    self.rotated += n
                return original(*all_args, **kwargs)

            return fn

        for n, fn in saved.items():
            setattr(self.module, n, wrap(fn, self.one_tensor[n]))
        try:
            yield
        finally:
            for n, fn in saved.items():
                setattr(self.module, n, fn)

    @contextlib.contextmanager
    def mlarope(self):
        saved = {n: getattr(mlarope, n) for n in ("apply_rope_q", "apply_rope_qk")}

        def wrap(original, tensors):
            def fn(*args, **kwargs):
                self.reached += tensors
                return original(*args, **kwargs)

            return fn

        for name, tensors in (("apply_rope_q", 1), ("apply_rope_qk", 2)):
            setattr(mlarope, name, wrap(saved[name], tensors))
        try:
            yield
        finally:
            for n, fn in saved.items():
                setattr(mlarope, n, fn)


def rotary_calls(family: str, run) -> list[tuple]:
    """The arguments of every call of the family's rotary functions in one run of ``run``
    (unpatched): ``(function name, args, kwargs)``, tensors detached."""
    fam = _patch.family(family)
    module = importlib.import_module(fam.module)
    saved = {n: getattr(module, n) for n in fam.mappings}
    calls = []

    def spy(name, original):
        def fn(*args, **kwargs):
            calls.append((name, tuple(_detached(a) for a in args), kwargs))
            return original(*args, **kwargs)

        return fn

    for name, fn in saved.items():
        setattr(module, name, spy(name, fn))
    try:
        run()
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)
    return calls


def rotary_ms(family: str, calls: list[tuple], device: torch.device, reps: int) -> tuple:
    """``(transformers, mlarope)``: milliseconds of the layer's rotary calls alone, forward and
    backward (``q`` and ``k`` as leaves that require grad, gradients of ones)."""
    fam = _patch.family(family)
    module = importlib.import_module(fam.module)
    originals = {n: getattr(module, n) for n in fam.mappings}
    with mt.mlarope_patched(family):
        replacements = {n: getattr(module, n) for n in fam.mappings}

    def run(functions):
        outs = []
        for name, args, kwargs in calls:
            if getattr(fam.mappings[name], "one_tensor", False):
                x, *rest = args
                outs.append(functions[name](x.detach().requires_grad_(True), *rest, **kwargs))
                continue
            q, k, *rest = args
            q = q.detach().requires_grad_(True)
            k = None if k is None else k.detach().requires_grad_(True)
            outs += [o for o in functions[name](q, k, *rest, **kwargs) if o is not None]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    result = []
    for functions in (originals, replacements):
        for _ in range(3):
            run(functions)
        result.append(statistics.median(timed(lambda f=functions: run(f), device)
                                        for _ in range(reps)))  # fmt: skip
    return tuple(result)


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


def measure(family: str, seq: int, args, device: torch.device) -> dict:
    config, attention, exact_layer, kwargs32, kwargs16, implementation = build(
        family, device, seq, args.tiny
    )
    text = config.get_text_config()
    gen = torch.Generator().manual_seed(1)
    x0 = torch.randn(1, seq, text.hidden_size, generator=gen).to(device, torch.bfloat16)
    g0 = torch.randn(1, seq, text.hidden_size, generator=gen).to(device, torch.bfloat16)

    def run(backward: bool):
        x = x0.clone().requires_grad_(backward)
        attention.zero_grad(set_to_none=True)
        if backward:
            return step(attention, kwargs16, x, g0, backward=True)
        with torch.no_grad():
            return step(attention, kwargs16, x, g0, backward=False)

    x = x0.float().clone().requires_grad_(True)
    exact = {
        k: v.double()
        for k, v in step(exact_layer, kwargs32, x, g0.float(), backward=True).items()
    }  # fmt: skip
    del exact_layer, x
    count = _Count(family)
    with count.unpatched():
        unpatched = {k: v.double() for k, v in run(True).items()}
    with emulated(family):
        rounded_once = {k: v.double() for k, v in run(True).items()}
    with mt.mlarope_patched(family), count.mlarope():
        patched = {k: v.double() for k, v in run(True).items()}
    ratios = {}
    for name, want in exact.items():
        theirs = max(float((s[name] - want).norm()) for s in (unpatched, rounded_once))
        ours = float((patched[name] - want).norm())
        ratios[name] = ours / theirs if theirs > 0 else (0.0 if ours == 0 else float("inf"))
    worst = max(ratios, key=ratios.get)
    ok = ratios[worst] <= RATIO and count.reached == count.rotated > 0
    del unpatched, patched, exact, rounded_once
    rotary = rotary_ms(family, rotary_calls(family, lambda: run(True)), device, 20)
    rounds = args.rounds if seq >= 1024 else 3 * args.rounds  # short steps: noisier, cheaper

    times: dict[str, list[float]] = {"fwd": [], "fwd_patched": [], "step": [], "step_patched": []}
    for backward, key in ((False, "fwd"), (True, "step")):
        for _ in range(args.warmup):
            run(backward)
            with mt.mlarope_patched(family):
                run(backward)
        for _ in range(rounds):
            times[key] += [timed(lambda b=backward: run(b), device) for _ in range(args.iters)]
            with mt.mlarope_patched(family):
                times[f"{key}_patched"] += [
                    timed(lambda b=backward: run(b), device) for _ in range(args.iters)
                ]
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "family": family,
        "seq": seq,
        "widths": _widths(text, attention),
        "attention": implementation,
        "ratio": ratios[worst],
        "worst": worst,
        "rotated": count.rotated,
        "trainable": count.trainable,
        "reached": count.reached,
        "ok": ok,
        "rotary": rotary,
        "rounds": rounds,
        **med,
    }


def _widths(text, attention) -> str:
    """``"hidden, heads, nope/rope/v"`` of the layer (or of its config where the layer keeps
    none: DeepSeek-V4's attention holds a full ``head_dim`` with its rope tail)."""

    def width(name: str):
        value = getattr(attention, name, None)
        return _attribute(text, name) if value is None else value

    heads = getattr(attention, "num_heads", None) or _attribute(text, "num_attention_heads")
    rope = width("qk_rope_head_dim")
    nope, v = width("qk_nope_head_dim"), width("v_head_dim")
    if nope is None and _attribute(text, "head_dim") and rope:
        nope, v = _attribute(text, "head_dim") - rope, _attribute(text, "head_dim")
    return f"{text.hidden_size}, {heads}, {nope}/{rope}/{v}"


def families(spec: str) -> list[str]:
    """``"all"``: every patched family; ``"default"``: those ``apply_mlarope_to_all()`` patches
    with its defaults (the patched ones not off by default); or a comma list of patched ones."""
    report = mt.family_report()
    patched = [r.name for r in report if r.status == "patched"]
    if spec == "all":
        return patched
    if spec == "default":
        return [r.name for r in report if r.status == "patched" and not r.off_by_default]
    chosen = spec.split(",")
    unknown = [f for f in chosen if f not in patched]
    if unknown:
        raise SystemExit(f"--families: not patched families: {unknown} (patched: {patched})")
    return chosen


def row_text(r: dict) -> str:
    name = MODEL_NAMES.get(r["family"], r["family"])
    if "error" in r:
        return f"| {name} ({r['family']}) | {r['seq']} | | | | | | | | FAILED: {r['error']} |"
    step_ratio = r["step_patched"] / r["step"]
    target = TARGETS.get(r["seq"])
    verdict = "" if target is None else (" PASS" if step_ratio <= target else " MISS")
    trainable = (
        f" ({r['trainable']} with trainable tables: transformers')" if r["trainable"] else ""
    )
    rot_tf, rot_ml = r["rotary"]
    rotary = (
        f"{rot_tf * 1e3:.0f} -> {rot_ml * 1e3:.0f} us: at most "
        f"{(rot_tf - rot_ml) / r['step']:.1%} of the step"
    )
    check = (
        f"{'ok' if r['ok'] else 'FAILED'}: {r['reached']}/{r['rotated']} rotations through "
        f"mlarope{trainable}, max |mlarope - fp32| / |transformers - fp32| = {r['ratio']:.3f} "
        f"({r['worst']})"
    )
    return (
        f"| {name} ({r['family']}) | {r['seq']} | {r['widths']} ({r['attention']}) "
        f"| {r['fwd']:.2f} ms | {r['fwd_patched']:.2f} ms ({r['fwd_patched'] / r['fwd']:.3f}x) "
        f"| {r['step']:.2f} ms | {r['step_patched']:.2f} ms ({step_ratio:.3f}x) "
        f"| {'<= ' + format(target, '.2f') + 'x' if target else '-'}{verdict} | {rotary} "
        f"| {check} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", default="all", help="'all' or a comma-separated list")
    parser.add_argument("--seq", default="4096,128", help="sequence lengths, comma-separated")
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

    rows = []
    for family in families(args.families):
        for seq in (int(s) for s in args.seq.split(",")):
            try:
                rows.append(measure(family, seq, args, device))
            except Exception as exc:  # a family that cannot be built is a failed row
                traceback.print_exc()
                rows.append({"family": family, "seq": seq, "error": f"{type(exc).__name__}: "
                             f"{str(exc).splitlines()[0][:160]}", "ok": False})  # fmt: skip
            print(row_text(rows[-1]), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    what = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    lines = [
        f"{what}; torch {torch.__version__}, transformers {transformers.__version__}, "
        f"mlarope {mlarope.__version__}; bf16, batch 1, the family's attention (sdpa, else eager), "
        f"causal; median of {args.rounds} x {args.iters} iterations per side ({3 * args.rounds} x "
        f"{args.iters} below sequence 1024), alternating blocks. Rotary: the layer's rotary "
        f"calls alone, forward and backward (median of 20), transformers -> mlarope, and what "
        f"that difference is of the unpatched step: the most the patch can save on the GPU",
        "",
        "| model (family) | seq | hidden, heads, nope/rope/v (attention) | forward unpatched "
        "| forward mlarope | training step unpatched | training step mlarope | target | rotary "
        "| check |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(row_text(r) for r in rows),
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
