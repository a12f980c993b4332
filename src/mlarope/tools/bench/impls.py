"""The implementations compared, each a builder of the timed zero-argument callables: ``mlarope``
(the public API forwards, the op-level backward functions), ``reference`` (the PyTorch
reference, eager), ``compile`` (the same under ``torch.compile``) and ``megatron``
(Megatron-Core's fused MLA RoPE, when it imports)."""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch

import mlarope
from mlarope import ops, reference
from mlarope.positions import Positions, token_positions

from .cases import Inputs, Positional, Suite
from .model import OpSpec

IMPLS = ("mlarope", "reference", "compile", "megatron")


# Every builder returns a zero-argument callable (one call of the op on one input set), or
# raises Unsupported with the reason the implementation has no such call.
class Unsupported(Exception):
    pass


def _ref_q(q, cos, sin, cu, ids, *, layout: str, inplace: bool, transpose: bool):
    """The reference query op (forward, or its transpose for the backward), in place or not."""
    positions = Positions(layout, cu, ids, 0, 1)
    il_in, il_out = (False, True) if transpose else (True, False)
    if not inplace:
        return reference.rope_q(
            q, cos, sin, positions, interleaved_in=il_in, interleaved_out=il_out, inverse=False,
            transpose=transpose,
        )  # fmt: skip
    nope = q.shape[-1] - cos.shape[-1]
    dtype = reference.compute_dtype(q.dtype)
    pos, is_padding = token_positions(positions, q.shape[:-2], q.device)
    c, s, in_range = reference.gather_tables(cos, sin, pos, dtype)
    rotated = reference.rotate_pairs(
        q[..., nope:].to(dtype), c, s, is_padding, in_range, interleaved_in=il_in,
        interleaved_out=il_out, inverse=False, transpose=transpose,
    )  # fmt: skip
    q[..., nope:].copy_(rotated)
    return q


def _ref_kv(kv, k_pe, cos, sin, cu, ids, *, layout: str, k_dim: int, copy_v: bool):
    positions = Positions(layout, cu, ids, 0, 1)
    k, v = reference.rope_kv(
        kv, k_pe, cos, sin, positions, k_dim=k_dim, interleaved_in=True, interleaved_out=False
    )
    return k, (v.contiguous() if copy_v else v)


def _ref_kv_bwd(dk, dv, cos, sin, cu, ids, *, layout: str, k_dim: int):
    positions = Positions(layout, cu, ids, 0, 1)
    return reference.rope_kv_backward(
        dk, dv, cos, sin, positions, k_dim=k_dim, interleaved_in=True, interleaved_out=False
    )


class Builders:
    """Make the timed callables of each implementation."""

    def __init__(self, suite: Suite, compile_mode: str, megatron: Any | None) -> None:
        self.suite = suite
        self.compile_mode = compile_mode
        self.megatron = megatron
        self._compiled: dict[Any, Callable] = {}

    # ------------------------------------------------------------------ mlarope
    def mlarope(self, spec: OpSpec, inp: Inputs, pos: Positional) -> Callable[[], object]:
        d = self.suite.dims
        where = dict(layout=pos.layout, cu_seqlens=pos.cu_seqlens, position_ids=pos.position_ids)
        if spec.direction == "fwd":
            if spec.op == "q":
                return lambda: mlarope.apply_rope_q(
                    inp.x, pos.cos, pos.sin, inplace=spec.inplace, **where
                )
            return lambda: mlarope.apply_rope_kv(
                inp.x, inp.k_pe, pos.cos, pos.sin, k_dim=d.k_dim, copy_v=spec.copy_v, **where
            )
        # The op-level backward functions, as the autograd functions (mlarope.autograd) call
        # them: the tables are [P, R] fp32, and thd positions are the forward's cu_seqlens
        # search, run once here as the forward runs it (ops.search_for_backward).
        grad = inp.x if spec.op == "q" else inp.dk
        if spec.op == "q":
            # The forward kernel with transpose=True and the interleaving flags swapped. The
            # in-place row rotates the gradient in place: the backward of apply_rope_q(...,
            # inplace_backward=True). Without it, the backward is the out-of-place row's kernel
            # (a shared gradient must not be rotated in place; docs/semantics.md).
            call = ops.QueryCall(
                pos.cos, pos.sin, pos.cu_seqlens, pos.position_ids, None, pos.layout, 0, 1,
                False, True, False, True,
            )  # fmt: skip
            call = ops.search_for_backward(grad, call)
            if spec.inplace:
                return lambda: ops.rope_q_(inp.x, call)
            return lambda: ops.rope_q(inp.x, call)
        call = ops.KVCall(
            pos.cos, pos.sin, pos.cu_seqlens, pos.position_ids, None, pos.layout, 0, 1, d.k_dim,
            True, False, True, False,
        )  # fmt: skip
        call = ops.search_for_backward(grad, call)
        return lambda: ops.rope_kv_backward(inp.dk, inp.dv, call)

    # ------------------------------------------------------------------ reference / compile
    def _ref_fn(self, name: str, fn: Callable, compiled: bool, **static: Any) -> Callable:
        if not compiled:
            return lambda *a: fn(*a, **static)
        key = (name, tuple(sorted(static.items())))
        if key not in self._compiled:
            self._compiled[key] = torch.compile(
                functools.partial(fn, **static), mode=self.compile_mode
            )
        return self._compiled[key]

    def reference(
        self, spec: OpSpec, inp: Inputs, pos: Positional, *, compiled: bool = False
    ) -> Callable[[], object]:
        d = self.suite.dims
        where = (pos.cos, pos.sin, pos.cu_seqlens, pos.position_ids)
        if spec.op == "q":
            f = self._ref_fn(
                "q", _ref_q, compiled, layout=pos.layout, inplace=spec.inplace,
                transpose=spec.direction == "bwd",
            )  # fmt: skip
            return lambda: f(inp.x, *where)
        if spec.direction == "fwd":
            f = self._ref_fn(
                "kv", _ref_kv, compiled, layout=pos.layout, k_dim=d.k_dim, copy_v=spec.copy_v
            )
            k_pe = inp.k_pe.squeeze(-2)
            return lambda: f(inp.x, k_pe, *where)
        f = self._ref_fn("kv_bwd", _ref_kv_bwd, compiled, layout=pos.layout, k_dim=d.k_dim)
        return lambda: f(inp.dk, inp.dv, *where)

    def compile(self, spec: OpSpec, inp: Inputs, pos: Positional) -> Callable[[], object]:
        return self.reference(spec, inp, pos, compiled=True)

    # ------------------------------------------------------------------ megatron
    def megatron_impl(self, spec: OpSpec, inp: Inputs, pos: Positional) -> Callable[[], object]:
        mc = self.megatron
        if mc is None:
            raise Unsupported("megatron.core not importable")
        if retune_megatron(mc) == 0:
            warnings.warn(
                "megatron: no autotuner found to clear; its thd cases may all run the "
                "configuration tuned on the first",
                stacklevel=2,
            )
        d = self.suite.dims
        device = (inp.dk if inp.dk is not None else inp.x).device
        if device.type != "cuda":
            raise Unsupported("needs CUDA")
        cu = pos.cu_seqlens
        ids = pos.position_ids
        if spec.op == "q":
            if ids is not None:
                return self._megatron_q_position_ids(spec, inp, pos)
            if spec.direction == "fwd":
                fwd = mc.fused_apply_mla_rope_for_q
                args = (pos.cos_m, pos.sin_m, d.nope, d.rope, cu)
                if spec.inplace:
                    return lambda: fwd(inp.x, *args)
                # Megatron's query op is in place only; out of place is a clone first (what its
                # own fused_mla_rope_out_of_place does).
                return lambda: fwd(inp.x.clone(), *args)
            if not spec.inplace:
                raise Unsupported("its backward is the in-place one (see q in place bwd)")
            node = _forward_node(
                lambda t: mc.fused_apply_mla_rope_for_q(
                    t, pos.cos_m, pos.sin_m, d.nope, d.rope, cu
                ),
                inp.x,
            )
            return lambda: node.apply(inp.x)
        if ids is not None:
            raise Unsupported("no position_ids in fused_apply_mla_rope_for_kv")
        if spec.direction == "fwd":
            if not spec.copy_v:
                raise Unsupported("always writes v")
            fwd = mc.fused_apply_mla_rope_for_kv
            args = (pos.cos_m, pos.sin_m, d.rope, d.k_dim, d.v_dim, cu)
            return lambda: fwd(inp.x, inp.k_pe, *args)
        kv = torch.randn((*inp.dk.shape[:-1], d.k_dim + d.v_dim), dtype=inp.dk.dtype, device=device)
        k_pe = torch.randn((*inp.dk.shape[:-2], 1, d.rope), dtype=inp.dk.dtype, device=device)
        node = _forward_node(
            lambda a, b: mc.fused_apply_mla_rope_for_kv(
                a, b, pos.cos_m, pos.sin_m, d.rope, d.k_dim, d.v_dim, cu
            ),
            kv,
            k_pe,
        )
        return lambda: node.apply(inp.dk, inp.dv)

    def _megatron_q_position_ids(self, spec: OpSpec, inp: Inputs, pos: Positional):
        """Newer Megatron-Core has ``fused_mla_rope_inplace(..., position_ids=)`` (thd only)."""
        fn = getattr(self.megatron, "fused_mla_rope_inplace", None)
        if fn is None or "position_ids" not in inspect.signature(fn).parameters:
            raise Unsupported("no position_ids in this megatron-core")
        if spec.direction == "bwd":
            raise Unsupported("decode backward not benchmarked for megatron")
        d = self.suite.dims
        t = pos.position_ids.shape[0]
        cu = torch.tensor([0, t], dtype=torch.int32, device=pos.position_ids.device)
        kwargs = dict(cu_seqlens_q=cu, position_ids=pos.position_ids)
        args = (pos.cos_m, pos.sin_m, d.nope, d.rope)
        if spec.inplace:
            return lambda: fn(inp.x, *args, **kwargs)
        return lambda: fn(inp.x.clone(), *args, **kwargs)


def retune_megatron(module: Any) -> int:
    """Clear the autotuner caches of Megatron-Core's fused MLA RoPE kernels (the module's
    ``triton.autotune`` objects), so that the case about to be timed runs the configuration
    tuned for its own shape: Megatron at its best. Its autotune key is the head and channel
    counts and the arguments' dtypes, not the number of sequences, so in one process every thd
    batch runs the configuration tuned on the first (docs/benchmarks.md). Returns how many
    caches it cleared."""
    from triton.runtime.autotuner import Autotuner

    cleared = 0
    for obj in vars(module).values():
        if isinstance(obj, Autotuner):
            obj.cache.clear()
            cleared += 1
    return cleared


def _forward_node(fwd: Callable[..., Any], *inputs: torch.Tensor):
    """Run ``fwd`` once with autograd on copies of ``inputs``; return its custom autograd node,
    whose ``apply(*grads)`` calls the function's ``backward`` directly (no autograd engine)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    with torch.enable_grad():
        out = fwd(*(leaf * 1 for leaf in leaves))
    first = out[0] if isinstance(out, tuple | list) else out
    todo, seen = [first.grad_fn], set()
    while todo:
        node = todo.pop(0)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if hasattr(node, "_forward_cls"):
            node._bench_keep = (leaves, out)  # keep the saved tensors' graph alive
            return node
        todo.extend(n for n, _ in node.next_functions)
    raise Unsupported("could not find the autograd node of the forward")


def import_megatron() -> tuple[Any | None, str]:
    """Megatron-Core's fused MLA RoPE module and its version, or ``(None, reason)``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mod = importlib.import_module("megatron.core.fusions.fused_mla_yarn_rope_apply")
    except Exception as exc:  # any import failure means "not available"; say why
        return None, f"not importable ({type(exc).__name__}: {exc})"
    version = "unknown"
    with contextlib.suppress(Exception):
        from importlib.metadata import version as dist_version

        version = dist_version("megatron-core")
    return mod, version


def raise_compile_limits() -> None:
    """The compile baseline compiles one function per op for several shapes and position
    sources; keep dynamo from falling back to eager after its default 8 recompiles."""
    with contextlib.suppress(Exception):
        cfg = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, max(getattr(cfg, name), 256))
        for name in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, max(getattr(cfg, name), 4096))
