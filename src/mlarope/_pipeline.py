"""The path of a call no launch plan replays: the checks, then the op.

``_plans`` runs these for a first call (recording its launches) and for every call that cannot
have a plan; each returns ``(result, outputs, replay)``: what the public call returns, the new
tensors a plan would allocate (``()`` in place; the plan fills them in the same launch slots),
and for a call through autograd what its :class:`~mlarope._launch_plans.GradPlan` replays
besides its launches (``None`` otherwise).
"""

from __future__ import annotations

import torch

from . import _checks
from ._launch_plans import Replay
from ._modes import compiling, needs_autograd
from ._records import with_tensors
from .autograd import rope_kv_differentiable, rope_q_differentiable
from .ops import rope_kv, rope_q, rope_q_

_NO_TENSORS = (None,) * 5  # a record's tensors (_records.call_tensors), for a GradPlan


def query(
    q, cos, sin, layout, cu_seqlens, position_ids, cp_rank, cp_size, interleaved,
    interleaved_out, inverse, inplace, inplace_backward, validate,
) -> tuple:  # fmt: skip
    """``apply_rope_q``'s arguments -> ``(q' or q itself in place, outputs, replay)``."""
    q, call = _checks.check_query_call(
        q, cos, sin, layout, cu_seqlens, position_ids, cp_rank, cp_size, interleaved,
        interleaved_out, inverse, inplace, inplace_backward, validate,
    )  # fmt: skip
    if compiling() or needs_autograd(q):
        out = rope_q_differentiable(q, call, inplace, inplace_backward)
        replay = Replay("q", with_tensors(call, _NO_TENSORS), inplace, inplace_backward,
                        call.cu_seqlens is not None)  # fmt: skip
        return out, (() if inplace else (out,)), replay
    if inplace:
        rope_q_(q, call)
        torch.autograd.graph.increment_version(q)
        return q, (), None
    out = rope_q(q, call)
    return out, (out,), None


def key_value(
    kv, k_pe, cos, sin, k_dim, layout, cu_seqlens, position_ids, cp_rank, cp_size, interleaved,
    interleaved_out, copy_v, validate, megatron_rounding=False,
) -> tuple:  # fmt: skip
    """``apply_rope_kv``'s arguments -> ``((k, v), outputs, replay)`` (``megatron_rounding``:
    ``mlarope.compat.megatron``'s differentiable call)."""
    kv, k_pe, call = _checks.check_key_value_call(
        kv, k_pe, cos, sin, k_dim, layout, cu_seqlens, position_ids, cp_rank, cp_size,
        interleaved, interleaved_out, copy_v, validate, megatron_rounding,
    )  # fmt: skip
    replay = None
    if compiling() or needs_autograd(kv, k_pe):
        k, v = rope_kv_differentiable(kv, k_pe, call)
        replay = Replay("kv", with_tensors(call, _NO_TENSORS), searched=call.cu_seqlens is not None)
    else:
        k, v = rope_kv(kv, k_pe, call)
        v = v if copy_v else kv[..., call.k_dim :]
    return (k, v), ((k, v) if copy_v else (k,)), replay


def pair(
    q, k, cos, sin, layout, cu_seqlens, position_ids, cp_rank, cp_size, interleaved,
    interleaved_out, inverse, validate,
) -> tuple:  # fmt: skip
    """``apply_rope_qk``'s arguments -> ``((q', k'), outputs, replay)``."""
    q, k, call = _checks.check_pair_call(
        q, k, cos, sin, layout, cu_seqlens, position_ids, cp_rank, cp_size, interleaved,
        interleaved_out, inverse, validate,
    )  # fmt: skip
    if compiling() or needs_autograd(q) or needs_autograd(k):
        result = (
            rope_q_differentiable(q, call, False, False),
            rope_q_differentiable(k, call, False, False),
        )
        return result, result, Replay("qk", with_tensors(call, _NO_TENSORS))
    result = (rope_q(q, call), rope_q(k, call))
    return result, result, None
