"""Where one training step's time goes, by category, from ``torch.profiler``.

On CUDA the time is the GPU's: every device event of the step (kernels, memcpy, memset), its
duration, classified. On the CPU (the smoke run) it is the host's: every profiled op's self CPU
time, classified by op name, so the categories sum to the profiled total either way.

A device event is classified by its kernel name where the name says it (GEMM, attention,
mlarope's RoPE kernels, fused norm kernels), else by the scope it was launched in, else by name
again (copies and cat, other elementwise), else "other". Scopes are what names cannot say:

- ``rope``: transformers' rotary functions of the model's family (wrapped while profiled: the
  patched or unpatched function alike) and every module whose class name has ``Rotary`` (the
  cos / sin tables);
- ``norm``: every module whose class name ends in ``RMSNorm`` or ``LayerNorm``: transformers'
  RMSNorm is several elementwise kernels (a cast, ``pow``, ``mean``, ``rsqrt``, two ``mul``),
  none named after the norm.

A scope is a ``record_function`` range around the forward; the backward's kernels belong to the
scope of the forward op that made their autograd node (the profiler's ``sequence_nr``: the node
of number N is made by the last forward op recorded with N). A kernel launched by a backward
node made outside the scopes (the residual adds, the attention's own ``cat``) stays in its name's
category. What this cannot attribute: work fused across a scope's boundary (none in eager
transformers) and the nodes of a custom autograd function whose forward records no op (its
kernels then fall to their names: mlarope's own are named, so they count as RoPE either way).
"""

from __future__ import annotations

import contextlib
import importlib
import re
from collections.abc import Iterator

import torch

CATEGORIES = ("GEMM", "attention", "RoPE", "norms", "copies & cat", "other elementwise", "other")
SCOPE = "mlarope_bench::"  # the prefix of the profiler ranges this module opens
_EVALUATE = "autograd::engine::evaluate_function: "

# Kernel names (CUDA), tried in kernel_category's order.
_GEMM = re.compile(r"gemm|cutlass|cublas|xmma|nvjet|gemv|grouped_mm|matmul", re.I)
_ATTENTION = re.compile(r"flash|fmha|attention|sdpa", re.I)
_NORM = re.compile(r"rms_?norm|layer_?norm", re.I)
# Every cat kernel's name has "Copy" (CatArrayBatchedCopy); casts are copy kernels too.
_COPY = re.compile(r"copy|index|gather|scatter|fill|memcpy|memset|take|put_|repeat", re.I)
_NOT_COPY = re.compile(r"topk|sort|radix|reduce_kernel|softmax|histogram", re.I)  # gatherTopK
_ELEMENTWISE = re.compile(r"elementwise|triton_poi", re.I)
# Op names (CPU): aten's, without the "aten::" prefix.
_CPU = {
    "GEMM": re.compile(r"^(mm|addmm|bmm|baddbmm|matmul|_grouped_mm|linear|addmv|mv|dot|einsum)$"),
    "attention": re.compile(r"attention|^_?flash|^_efficient"),
    "norms": re.compile(r"rms_norm|layer_norm"),
    "copies & cat": re.compile(
        r"^(cat|copy_|_to_copy|clone|contiguous|index\w*|gather|scatter\w*|fill_|zero_|zeros|"
        r"ones|full|new_\w+|empty\w*|stack|repeat\w*|take\w*|put_|masked_\w+|where|"
        r"embedding\w*|narrow_copy|expand_copy|_unsafe_view|to)$"
    ),
    "other elementwise": re.compile(
        r"^(add|add_|sub|sub_|mul|mul_|div|div_|neg|pow|rsqrt|sqrt|exp|log|sigmoid|silu|gelu|"
        r"tanh|relu|clamp\w*|abs|reciprocal|lerp\w*|sin|cos|maximum|minimum|"
        r"(sigmoid|silu|tanh|gelu|threshold)_backward)$"
    ),
}


def mlarope_kernel_names() -> frozenset[str]:
    """The names of mlarope's Triton kernels (what the profiler calls their launches)."""
    import triton

    names = set()
    for module in ("q", "kv", "lookup", "serving", "output_quant"):
        found = importlib.import_module(f"mlarope.kernels.{module}")
        for value in vars(found).values():
            jit = isinstance(value, triton.runtime.JITFunction)
            if jit and value.__name__.endswith("_kernel"):
                names.add(value.__name__)
    return frozenset(names)


def kernel_category(name: str, scope: str | None, rope_kernels: frozenset[str]) -> str:
    """The category of a device event ``name`` launched in ``scope`` (``"rope"``, ``"norm"``
    or None)."""
    if _ATTENTION.search(name):  # before GEMM: fmha_cutlassF_...
        return "attention"
    if _GEMM.search(name):
        return "GEMM"
    if name in rope_kernels or any(k in name for k in rope_kernels):
        return "RoPE"
    if scope is not None:
        return {"rope": "RoPE", "norm": "norms"}[scope]
    if _NORM.search(name):
        return "norms"
    if _COPY.search(name) and not _NOT_COPY.search(name):
        return "copies & cat"
    if _ELEMENTWISE.search(name):
        return "other elementwise"
    return "other"


def op_category(name: str, scope: str | None) -> str:
    """The category of a CPU op ``name`` (``aten::mm``, a scope, an autograd node) in
    ``scope``."""
    op = name.removeprefix("aten::")
    for category in ("GEMM", "attention"):
        if _CPU[category].search(op):
            return category
    if scope is not None:
        return {"rope": "RoPE", "norm": "norms"}[scope]
    for category in ("norms", "copies & cat", "other elementwise"):
        if name.startswith("aten::") and _CPU[category].search(op):
            return category
    return "other"


@contextlib.contextmanager
def scopes(model: torch.nn.Module, rotary_module=None, rotary_names=()) -> Iterator[None]:
    """Open a profiler range ``mlarope_bench::rope`` / ``::norm`` around the forward of each
    rotary-embedding and norm module of ``model``, and around each call of the functions
    ``rotary_names`` of ``rotary_module`` (whatever they are now: patched or not)."""
    handles, saved = [], {}

    def ranged(label: str):
        def pre(module, _args):
            module._mlarope_bench_range = torch.autograd.profiler.record_function(SCOPE + label)
            module._mlarope_bench_range.__enter__()

        def post(module, _args, _out):
            module._mlarope_bench_range.__exit__(None, None, None)
            del module._mlarope_bench_range

        return pre, post

    for module in model.modules():
        kind = type(module).__name__
        label = "norm" if kind.endswith(("RMSNorm", "LayerNorm")) else None
        label = "rope" if "Rotary" in kind else label
        if label is not None:
            pre, post = ranged(label)
            handles += [module.register_forward_pre_hook(pre),
                        module.register_forward_hook(post)]  # fmt: skip

    def wrap(function):
        def rotary(*args, **kwargs):
            with torch.autograd.profiler.record_function(SCOPE + "rope"):
                return function(*args, **kwargs)

        return rotary

    if rotary_module is not None:
        saved = {n: getattr(rotary_module, n) for n in rotary_names}
        for name, function in saved.items():
            setattr(rotary_module, name, wrap(function))
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(rotary_module, name, function)
        for handle in handles:
            handle.remove()


def _ancestor_scope(event) -> str | None:
    while event is not None:
        if event.name.startswith(SCOPE):
            return event.name[len(SCOPE) :]
        event = event.cpu_parent
    return None


class _Scopes:
    """The scope of any CPU event: its own range, else its autograd node's forward op's."""

    def __init__(self, events):
        creators = {}  # sequence_nr -> the last forward op recorded with it
        for e in events:
            cpu = e.device_type == torch.autograd.DeviceType.CPU
            if cpu and e.sequence_nr >= 0 and self._backward(e) is None:
                best = creators.get(e.sequence_nr)
                if best is None or e.time_range.start >= best.time_range.start:
                    creators[e.sequence_nr] = e
        self.node_scope = {n: _ancestor_scope(e) for n, e in creators.items()}

    @staticmethod
    def _backward(event):
        while event is not None:
            if event.name.startswith(_EVALUATE):
                return event
            event = event.cpu_parent
        return None

    def of(self, event) -> str | None:
        if event is None:
            return None
        scope = _ancestor_scope(event)
        if scope is not None:
            return scope
        node = self._backward(event)
        return None if node is None else self.node_scope.get(node.sequence_nr)


def categorize(prof, device: torch.device, rope_kernels: frozenset[str]) -> dict[str, float]:
    """Milliseconds per category (``CATEGORIES``) of a finished ``torch.profiler.profile`` of
    one step; ``"total"`` is their sum."""
    events = list(prof.events())
    scopes_of = _Scopes(events)
    out = dict.fromkeys(CATEGORIES, 0.0)
    if device.type == "cuda":
        by_id = {e.id: e for e in events if e.device_type == torch.autograd.DeviceType.CPU}
        for e in events:
            if e.device_type != torch.autograd.DeviceType.CUDA or e.is_user_annotation:
                continue
            if e.name.startswith(SCOPE):  # the ranges' own device-side copies
                continue
            launcher = by_id.get(getattr(e, "linked_correlation_id", 0))
            category = kernel_category(e.name, scopes_of.of(launcher), rope_kernels)
            out[category] += e.time_range.elapsed_us() / 1e3
    else:
        for e in events:
            if e.device_type != torch.autograd.DeviceType.CPU:
                continue
            out[op_category(e.name, scopes_of.of(e))] += e.self_cpu_time_total / 1e3
    out["total"] = sum(out[c] for c in CATEGORIES)
    return out


def profile_step(step, device: torch.device, model, rotary_module, rotary_names) -> dict:
    """Run ``step()`` once under the profiler with the scopes open; its categories (ms)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    with scopes(model, rotary_module, rotary_names), profile(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return categorize(prof, device, mlarope_kernel_names())
