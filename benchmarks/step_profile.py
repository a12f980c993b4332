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
_CPU_DEVICE, _CUDA_DEVICE = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

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
            # KernelInterface: a JITFunction, or the interpreter's InterpretedFunction.
            kernel = isinstance(value, triton.runtime.KernelInterface)
            name = getattr(value, "__name__", "") or getattr(
                getattr(value, "fn", None), "__name__", ""
            )
            if kernel and name.endswith("_kernel"):
                names.add(name)
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
            cpu = e.device_type == _CPU_DEVICE
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


UNLINKED = "(device time no op launched)"


def device_kernels(events) -> list[tuple[str, float, object]]:
    """``(name, ms, the CPU event that launched it or None)`` for every device event (kernel,
    memcpy, memset) of ``events``, the scope ranges' own device-side spans left out.

    Through each device event's ``linked_correlation_id`` (the launching op's id) where the
    profiler keeps it; else (older torch) through the kernels each op lists, with what no op
    lists as one ``UNLINKED`` entry, so that the sum is the device time either way."""
    device = [
        e
        for e in events
        if e.device_type == _CUDA_DEVICE
        and not getattr(e, "is_user_annotation", False)
        and not e.name.startswith(SCOPE)
    ]
    if all(hasattr(e, "linked_correlation_id") for e in device):
        # Ops have no linked id; the CUDA runtime's own CPU events do, and their ids are
        # another counter's, so only the ops name launchers.
        ops = {
            e.id: e for e in events if e.device_type == _CPU_DEVICE and not e.linked_correlation_id
        }
        return [
            (e.name, e.time_range.elapsed_us() / 1e3, ops.get(e.linked_correlation_id))
            for e in device
        ]
    found = [
        (k.name, k.duration / 1e3, e)
        for e in events
        if e.device_type == _CPU_DEVICE
        for k in e.kernels
        if not k.name.startswith(SCOPE)
    ]
    rest = sum(e.time_range.elapsed_us() for e in device) / 1e3 - sum(ms for _, ms, _ in found)
    return found + ([(UNLINKED, rest, None)] if rest > 1e-6 else [])


def categorize(prof, device: torch.device, rope_kernels: frozenset[str], top: int = 0) -> dict:
    """Milliseconds per category (``CATEGORIES``) of a finished ``torch.profiler.profile`` of
    one step; ``"total"`` is their sum; ``"top"``: the ``top`` largest kernels (ops on the
    CPU) with their category and scope, ``[name, category, scope, ms, count]``."""
    events = list(prof.events())
    scopes_of = _Scopes(events)
    out = dict.fromkeys(CATEGORIES, 0.0)
    named: dict[tuple, list] = {}

    def add(name: str, category: str, scope: str | None, ms: float) -> None:
        out[category] += ms
        entry = named.setdefault((name, category, scope), [0.0, 0])
        entry[0] += ms
        entry[1] += 1

    if device.type == "cuda":
        for name, ms, launcher in device_kernels(events):
            scope = scopes_of.of(launcher)
            add(name, kernel_category(name, scope, rope_kernels), scope, ms)
    else:
        for e in events:
            if e.device_type == _CPU_DEVICE:
                scope = scopes_of.of(e)
                add(e.name, op_category(e.name, scope), scope, e.self_cpu_time_total / 1e3)
    out["total"] = sum(out[c] for c in CATEGORIES)
    largest = sorted(named.items(), key=lambda item: -item[1][0])[:top]
    out["top"] = [[n[:160], c, s, round(ms, 4), k] for (n, c, s), (ms, k) in largest]
    return out


def profile_step(step, device, model, rotary_module, rotary_names, top: int = 0) -> dict:
    """Run ``step()`` once under the profiler with the scopes open; its categories (ms) and
    ``top`` largest kernels (``categorize``)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    with scopes(model, rotary_module, rotary_names), profile(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return categorize(prof, device, mlarope_kernel_names(), top)
