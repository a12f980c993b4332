"""The latent op, :func:`rmsnorm_rope_latent`: MLA's compressed key/value projection
``[..., L + R]`` in, its RMSNorm'd latent ``[..., L]`` and rotated ``k_pe`` ``[..., R]`` out, in
one read, forward and backward (the norm weight's gradient included).

Data flow, as for the other ops (``api``): the public call -> its checks (here, over
``_checks``' validators) -> the positions (``positions.Positions``) and the op's record
(:class:`LatentCall`) -> the autograd function when a gradient, forward-mode AD or
``torch.compile`` is involved -> the backend: the Triton kernels (``kernels/latent.py``: CUDA
tensors, and CPU tensors under ``TRITON_INTERPRET=1``) or the PyTorch reference
(``reference.rmsnorm_rope_latent``: other CPU tensors, and float64). Compiled graphs call the
custom ops ``mlarope::rmsnorm_rope_latent`` and ``mlarope::rmsnorm_rope_latent_backward``,
whose schemas come from the record; eager calls run the backend directly.

Derivatives: the first-order backward is the backward kernel (one launch for ``d_ckv``, one
for the weight's gradient); a backward that must itself be differentiable
(``create_graph=True``, ``torch.func``) and forward-mode AD run the reference's backward and
tangent formulas in plain PyTorch with PyTorch's own sums
(``reference.rmsnorm_rope_latent_backward(..., exact=False)`` / ``_jvp``), which autograd
differentiates to any order (docs/semantics.md).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor
from torch._C import _functorch
from torch.autograd import forward_ad as _fwad

from . import _checks, ops, reference
from .autograd import _functions, _ready, needs_autograd
from .ops import compiling, has_memory, search_for_backward
from .positions import Positions

__all__ = ["LatentCall", "rmsnorm_rope_latent"]


# ----------------------------------------------------------------------------------- record
@dataclass(frozen=True, slots=True)
class LatentCall:
    """What the latent op needs besides ``ckv: [tokens..., L + R]`` and ``weight: [L]``: the
    tables ``cos, sin: [P, R]`` and the position source (``cu_seqlens``, ``position_ids``,
    ``searched``, ``layout``, ``cp_rank``, ``cp_size``: :class:`mlarope.positions.Positions`);
    RMSNorm's ``eps``; the pair layout of ``ckv[..., L:]`` (``interleaved_in``) and of ``k_pe``
    (``interleaved_out``)."""

    cos: Tensor
    sin: Tensor
    cu_seqlens: Tensor | None
    position_ids: Tensor | None
    searched: Tensor | None
    layout: str
    cp_rank: int
    cp_size: int
    eps: float
    interleaved_in: bool
    interleaved_out: bool

    def positions(self) -> Positions:
        return Positions(
            self.layout, self.cu_seqlens, self.position_ids, self.cp_rank, self.cp_size,
            self.searched,
        )  # fmt: skip


_N_FIELDS = len(dataclasses.fields(LatentCall))
_NO_TENSORS = (None,) * 5


def _args(call: LatentCall) -> tuple:
    """The record's fields in order (``LatentCall(*_args(call))`` is ``call``)."""
    return tuple(getattr(call, f.name) for f in dataclasses.fields(call))


def _tensors(call: LatentCall) -> tuple:
    return (call.cos, call.sin, call.cu_seqlens, call.position_ids, call.searched)


def _with_tensors(call: LatentCall, tensors: tuple) -> LatentCall:
    cos, sin, cu_seqlens, position_ids, searched = tensors
    return dataclasses.replace(
        call, cos=cos, sin=sin, cu_seqlens=cu_seqlens, position_ids=position_ids,
        searched=searched,
    )  # fmt: skip


_SCHEMA_TYPES = {
    "Tensor": "Tensor",
    "Tensor | None": "Tensor?",
    "str": "str",
    "int": "int",
    "float": "float",
    "bool": "bool",
}


def _schema(activations: str) -> str:
    fields = ", ".join(f"{_SCHEMA_TYPES[f.type]} {f.name}" for f in dataclasses.fields(LatentCall))
    return f"({activations}, {fields}) -> (Tensor, Tensor)"


# ----------------------------------------------------------------------------------- checks
def check_latent_call(
    ckv: object,
    weight: object,
    cos: object,
    sin: object,
    kv_lora_rank: object,
    eps: object,
    layout: object,
    cu_seqlens: object,
    position_ids: object,
    cp_rank: object,
    cp_size: object,
    interleaved: object,
    interleaved_out: object,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Positions, float]:
    """All host-side checks of a latent-op call -> ``(ckv, weight, cos [P, R], sin [P, R],
    positions, eps)``."""
    layout = _checks.check_layout(layout)
    ckv = _checks.check_float_tensor("ckv", ckv)
    want = _checks.token_dims(layout) + 1
    if ckv.dim() != want:
        shape = (
            "[T, L + R]"
            if layout == "thd"
            else f"[{layout[0].upper()}, {layout[1].upper()}, L + R]"
        )
        raise ValueError(
            f"ckv must be {want}-D {shape} for layout={layout!r}, got shape {tuple(ckv.shape)}"
        )
    _checks.check_last_dim_contiguous("ckv", ckv)
    n_latent = _checks.check_int("kv_lora_rank", kv_lora_rank, minimum=1)
    weight = _checks.check_float_tensor("weight", weight)
    if weight.dim() != 1 or weight.shape[0] != n_latent:
        raise ValueError(
            f"weight must be [kv_lora_rank] = [{n_latent}] (the latent RMSNorm's weight), got "
            f"shape {tuple(weight.shape)}"
        )
    if weight.device != ckv.device:
        raise ValueError(f"weight must be on ckv's device {ckv.device}, got {weight.device}")
    if weight.dtype == torch.float64 and ckv.dtype != torch.float64:
        raise TypeError(
            f"weight must be float32, float16 or bfloat16 for a {ckv.dtype} ckv (float64 only "
            f"with a float64 ckv), got dtype {weight.dtype}"
        )
    _checks.check_last_dim_contiguous("weight", weight)
    cos2d, sin2d = _checks.check_tables(cos, sin, ckv.device)
    _checks.check_tables_constant(cos, sin)
    rope_dim = cos2d.shape[-1]
    if ckv.shape[-1] != n_latent + rope_dim:
        raise ValueError(
            f"ckv.shape[-1] must be kv_lora_rank + R = {n_latent} + {rope_dim} = "
            f"{n_latent + rope_dim} (R = cos.shape[-1]), got {ckv.shape[-1]} (ckv shape "
            f"{tuple(ckv.shape)})"
        )
    eps = check_eps(eps)
    _checks.check_bool("interleaved", interleaved)
    _checks.check_bool("interleaved_out", interleaved_out)
    positions = _checks.check_positions(
        ckv, cos2d.shape[0], layout=layout, cu_seqlens=cu_seqlens, position_ids=position_ids,
        cp_rank=cp_rank, cp_size=cp_size,
    )  # fmt: skip
    return ckv, weight, cos2d, sin2d, positions, eps


def check_eps(eps: object) -> float:
    """RMSNorm's ``eps``: a finite number > 0 (a Python int or float)."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {eps!r} ({type(eps).__name__})")
    eps = float(eps)
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a finite number > 0, got {eps!r}")
    return eps


# --------------------------------------------------------------------------------- backends
def _check_not_batched(*tensors: Tensor) -> None:
    """The kernels read memory; batched tensors (``torch.func.vmap``, batched gradients) have
    none (the reference backend runs them as PyTorch ops do)."""
    if any(_functorch.is_batchedtensor(t) or not has_memory(t) for t in tensors):
        raise NotImplementedError(
            "mlarope.rmsnorm_rope_latent's Triton kernels cannot run on batched tensors (under "
            "torch.func.vmap, jacrev, jacfwd or hessian, or for gradients batched by "
            "torch.autograd.grad(..., is_grads_batched=True)): call it once per sample, or use "
            "the PyTorch reference backend (mlarope.reference)"
        )


def _same_table_strides(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The kernels index both tables with one row stride."""
    if cos.stride() != sin.stride():
        return cos.contiguous(), sin.contiguous()
    return cos, sin


def latent_forward(ckv: Tensor, weight: Tensor, call: LatentCall) -> tuple[Tensor, Tensor]:
    """``ckv: [tokens..., L + R]``, ``weight: [L]`` -> new contiguous ``latent: [tokens..., L]``
    (``promote(weight.dtype, ckv.dtype)``) and ``k_pe: [tokens..., R]`` (``ckv.dtype``)."""
    if not ops.use_triton(ckv):  # looked up on ops: one backend choice for every op
        return reference.rmsnorm_rope_latent(
            ckv, weight, call.cos, call.sin, call.positions(), eps=call.eps,
            interleaved_in=call.interleaved_in, interleaved_out=call.interleaved_out,
        )  # fmt: skip
    _check_not_batched(ckv, weight)
    from .kernels.latent import latent_launch

    tokens = ckv.shape[:-1]
    latent = torch.empty(
        (*tokens, weight.shape[0]), dtype=reference.latent_dtype(ckv.dtype, weight.dtype),
        device=ckv.device,
    )  # fmt: skip
    k_pe = torch.empty((*tokens, call.cos.shape[-1]), dtype=ckv.dtype, device=ckv.device)
    cos, sin = _same_table_strides(call.cos, call.sin)
    latent_launch(
        ckv, weight, latent, k_pe, cos, sin, call.positions(), eps=call.eps,
        interleaved_in=call.interleaved_in, interleaved_out=call.interleaved_out,
    )  # fmt: skip
    return latent, k_pe


def latent_backward(
    g_latent: Tensor, g_pe: Tensor, ckv: Tensor, weight: Tensor, weight_grad: bool,
    call: LatentCall,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``g_latent: [tokens..., L]``, ``g_pe: [tokens..., R]`` -> ``d_ckv: [tokens..., L + R]``
    (contiguous, ``ckv.dtype``) and ``d_weight: [L]`` (``weight.dtype``), or an empty tensor in
    its place unless ``weight_grad``."""
    if not ops.use_triton(ckv):  # looked up on ops: one backend choice for every op
        d_ckv, d_weight = reference.rmsnorm_rope_latent_backward(
            g_latent, g_pe, ckv, weight, call.cos, call.sin, call.positions(), eps=call.eps,
            interleaved_in=call.interleaved_in, interleaved_out=call.interleaved_out,
            weight_grad=weight_grad,
        )  # fmt: skip
        return d_ckv, (d_weight if weight_grad else weight.new_empty(0))
    _check_not_batched(g_latent, g_pe, ckv, weight)
    from .kernels.latent import latent_backward_launch

    d_ckv = torch.empty(ckv.shape, dtype=ckv.dtype, device=ckv.device)
    d_weight = torch.empty_like(weight, memory_format=torch.contiguous_format)
    cos, sin = _same_table_strides(call.cos, call.sin)
    latent_backward_launch(
        g_latent, g_pe, ckv, weight, d_ckv, d_weight if weight_grad else None, cos, sin,
        call.positions(), eps=call.eps, interleaved_in=call.interleaved_in,
        interleaved_out=call.interleaved_out,
    )  # fmt: skip
    return d_ckv, (d_weight if weight_grad else weight.new_empty(0))


# ------------------------------------------------------------------------------- custom ops
latent_op = torch.library.custom_op(
    "mlarope::rmsnorm_rope_latent",
    lambda ckv, weight, *args: latent_forward(ckv, weight, LatentCall(*args)),
    mutates_args=(),
    schema=_schema("Tensor ckv, Tensor weight"),
)
latent_backward_op = torch.library.custom_op(
    "mlarope::rmsnorm_rope_latent_backward",
    lambda g_latent, g_pe, ckv, weight, weight_grad, *args: latent_backward(
        g_latent, g_pe, ckv, weight, weight_grad, LatentCall(*args)
    ),
    mutates_args=(),
    schema=_schema("Tensor g_latent, Tensor g_pe, Tensor ckv, Tensor weight, bool weight_grad"),
)


@latent_op.register_fake
def _latent_fake(ckv, weight, *args):
    call = LatentCall(*args)
    tokens = ckv.shape[:-1]
    latent = ckv.new_empty(
        (*tokens, weight.shape[0]), dtype=reference.latent_dtype(ckv.dtype, weight.dtype)
    )
    return latent, ckv.new_empty((*tokens, call.cos.shape[-1]))


@latent_backward_op.register_fake
def _latent_backward_fake(g_latent, g_pe, ckv, weight, weight_grad, *args):
    d_weight = weight.new_empty(weight.shape) if weight_grad else weight.new_empty(0)
    return ckv.new_empty(ckv.shape), d_weight


def run_forward(ckv: Tensor, weight: Tensor, call: LatentCall) -> tuple[Tensor, Tensor]:
    """Eager: the backend; compiled: the custom op."""
    if compiling():
        return latent_op(ckv, weight, *_args(call))
    return latent_forward(ckv, weight, call)


def run_backward(
    g_latent: Tensor, g_pe: Tensor, ckv: Tensor, weight: Tensor, weight_grad: bool,
    call: LatentCall,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    if compiling():
        return latent_backward_op(g_latent, g_pe, ckv, weight, weight_grad, *_args(call))
    return latent_backward(g_latent, g_pe, ckv, weight, weight_grad, call)


# --------------------------------------------------------------------------------- autograd
def _forward(ckv, weight, *args):
    return run_forward(ckv, weight, LatentCall(*args))


def _setup_context(ctx, inputs, output):
    """Save ``ckv``, ``weight`` and the record's tensors (the tables and positions, as plain
    tensors: inside a ``torch.func`` transform they may be its wrappers, which outlive it)."""
    ckv, weight = inputs[0], inputs[1]
    call = LatentCall(*inputs[2:])
    tensors = _tensors(call)
    if not compiling() and _functorch.maybe_current_level() is not None:
        plain = []
        for t in tensors:
            while t is not None and _functorch.is_functorch_wrapped_tensor(t):
                t = _functorch.get_unwrapped(t)
            plain.append(t)
        tensors = tuple(plain)
    ctx.save_for_backward(ckv, weight, *tensors)
    if _fwad._current_level >= 0:
        ctx.save_for_forward(ckv, weight, *tensors)
    ctx.call = _with_tensors(call, _NO_TENSORS)


def _saved(ctx) -> tuple[Tensor, Tensor, LatentCall]:
    ckv, weight, *tensors = ctx.saved_tensors
    return ckv, weight, _with_tensors(ctx.call, tuple(tensors))


_NO_GRADS = (None,) * _N_FIELDS


def _backward(ctx, g_latent, g_pe):
    ckv, weight, call = _saved(ctx)
    weight_grad = ctx.needs_input_grad[1]
    if not compiling() and torch.is_grad_enabled():
        # A backward with a graph (create_graph=True, torch.func): the reference's formulas
        # with PyTorch's own sums, which autograd differentiates (the same values as the
        # kernels' backward up to the sums' and fused multiply-adds' last bits).
        d_ckv, d_weight = reference.rmsnorm_rope_latent_backward(
            g_latent, g_pe, ckv, weight, call.cos, call.sin, call.positions(), eps=call.eps,
            interleaved_in=call.interleaved_in, interleaved_out=call.interleaved_out,
            weight_grad=weight_grad, exact=False,
        )  # fmt: skip
        return d_ckv, d_weight, *_NO_GRADS
    d_ckv, d_weight = run_backward(
        _ready(g_latent), _ready(g_pe), _ready(ckv), _ready(weight), weight_grad, call
    )
    return d_ckv, (d_weight if weight_grad else None), *_NO_GRADS


def _jvp(ctx, t_ckv, t_weight, *_):
    ckv, weight, call = _saved(ctx)
    if t_ckv is None:
        t_ckv = torch.zeros_like(ckv)
    if t_weight is None:
        t_weight = torch.zeros_like(weight)
    return reference.rmsnorm_rope_latent_jvp(
        t_ckv, t_weight, ckv, weight, call.cos, call.sin, call.positions(), eps=call.eps,
        interleaved_in=call.interleaved_in, interleaved_out=call.interleaved_out,
    )  # fmt: skip


_LATENT = _functions(
    "RmsnormRopeLatentFunction",
    """The latent op. Inputs: ``ckv``, ``weight``, the :class:`LatentCall` fields. Backward: the
    backward kernel (``d_ckv`` in one buffer and ``d_weight``), or the reference's formulas in
    plain PyTorch when the backward itself needs a graph; ``jvp``: the reference's tangents.""",
    _forward,
    _setup_context,
    _backward,
    _jvp,
)


def latent_differentiable(ckv: Tensor, weight: Tensor, call: LatentCall) -> tuple[Tensor, Tensor]:
    """The op on checked arguments where autograd, forward AD or ``torch.compile`` is involved;
    compiled without a gradient, the custom op itself."""
    if compiling():
        if not (torch.is_grad_enabled() and (ckv.requires_grad or weight.requires_grad)):
            return latent_op(ckv, weight, *_args(call))
        return _LATENT.compiled.apply(ckv, weight, *_args(call))
    call = search_for_backward(ckv, call)
    return _LATENT.pick().apply(ckv, weight, *_args(call))


# ---------------------------------------------------------------------------------- the call
def rmsnorm_rope_latent(
    ckv: Tensor,
    weight: Tensor,
    cos: Tensor,
    sin: Tensor,
    *,
    kv_lora_rank: int,
    eps: float,
    layout: str = "sbhd",
    cu_seqlens: Tensor | None = None,
    position_ids: Tensor | None = None,
    cp_rank: int = 0,
    cp_size: int = 1,
    interleaved: bool = True,
    interleaved_out: bool = False,
    validate: bool = False,
) -> tuple[Tensor, Tensor]:
    """RMSNorm the latent and rotate ``k_pe``, both read from MLA's compressed key/value
    projection (``kv_a_proj_with_mqa``'s output) once: the latent op.

    Computes what transformers' DeepSeek-V3 attention computes from ``compressed_kv`` (its
    ``kv_a_layernorm``, a ``DeepseekV3RMSNorm``, on ``ckv[..., :L]``, and its rotary function on
    ``ckv[..., L:]``), at that module's rounding points: ``h = x / sqrt(mean(x * x) + eps)``
    in fp32 (float64 for a float64 ``ckv``; transformers computes ``x * rsqrt(...)``, in fp32
    even then: the two agree within about an fp32 ulp before the rounding) rounded once to
    ``ckv.dtype``, then ``weight * h`` in PyTorch's type promotion (bf16 weight
    and input: a bf16 latent; an fp32 weight: an fp32 latent); ``k_pe`` rotated in fp32 with the
    fp32 tables and rounded once, as :func:`mlarope.apply_rope_q` rotates. Its sums are exact
    up to a quantum far below fp32's (docs/semantics.md), so the results are bitwise identical
    across runs, launch configurations and backends.

    Args:
        ckv: ``[S, B, L + R]`` (sbhd), ``[B, S, L + R]`` (bshd) or ``[T, L + R]`` (thd); last
            dim contiguous, any strides elsewhere (a slice of a wider tensor is read in place).
        weight: ``[L]``, the RMSNorm weight (fp32, bf16 or fp16; float64 with a float64 ``ckv``).
        cos, sin: ``[P, R]`` tables (singleton dims such as ``[P, 1, 1, R]`` accepted), fp32
            preferred; ``R`` in (32, 64, 128). transformers' per-token tables ``[Bc, S, R]`` are
            ``cos.reshape(Bc * S, R)`` with ``layout="bshd"`` and
            ``position_ids = arange(Bc * S).view(Bc, S)`` (or the sequence index when
            ``Bc == 1``).
        kv_lora_rank: ``L``, the latent width (``weight.shape[0]``; ``ckv.shape[-1] == L + R``).
        eps: RMSNorm's epsilon (transformers' ``config.rms_norm_eps``), a finite float > 0.
        layout, cu_seqlens, position_ids, cp_rank, cp_size, validate: as in
            :func:`mlarope.apply_rope_q` (the position of each token of ``ckv``).
        interleaved: ``ckv[..., L:]`` holds interleaved pairs ``(x[2j], x[2j+1])`` (True,
            DeepSeek's ``rope_interleave``) or halves ``(x[j], x[half+j])``.
        interleaved_out: write ``k_pe`` interleaved (True) or half-split (False, default, as
            transformers' rotary functions do).

    Differentiable in ``ckv`` and ``weight``: backward (the backward kernel writes ``d_ckv``
    ``[..., L + R]`` in one buffer; ``d_weight`` is an exact sum over tokens, rounded once
    to ``weight.dtype``), double backward and forward-mode AD (through the reference's formulas
    in PyTorch), ``torch.func`` (not ``vmap`` on the kernels) and
    ``torch.compile(fullgraph=True)``. The tables are constants, as for the other ops.

    Returns:
        ``latent: [..., L]`` (``promote(weight.dtype, ckv.dtype)``) and ``k_pe: [..., R]``
        (``ckv.dtype``), new contiguous tensors with ``ckv``'s token dims.
    """
    ckv, weight, cos2d, sin2d, positions, eps = check_latent_call(
        ckv, weight, cos, sin, kv_lora_rank, eps, layout, cu_seqlens, position_ids, cp_rank,
        cp_size, interleaved, interleaved_out,
    )  # fmt: skip
    if _checks.validation_requested(validate):
        n_tokens = math.prod(ckv.shape[:-1])
        _checks.check_positions_on_device(positions, n_tokens, cos2d.shape[0])
    call = LatentCall(
        cos2d, sin2d, positions.cu_seqlens, positions.position_ids, None, positions.layout,
        positions.cp_rank, positions.cp_size, eps, interleaved, interleaved_out,
    )  # fmt: skip
    if compiling() or needs_autograd(ckv, weight):
        return latent_differentiable(ckv, weight, call)
    return latent_forward(ckv, weight, call)
