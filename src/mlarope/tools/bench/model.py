"""The bytes model and the targets: what one call of each op must move through device memory,
and what mlarope must reach (docs/benchmarks.md, "Bytes model" and "Targets")."""

from __future__ import annotations

import math
from dataclasses import dataclass

HOST_TARGET_US = 20.0
SCALING_TARGET = 1.1


@dataclass(frozen=True)
class MlaDims:
    """Per-head widths of an MLA layer: ``H`` heads, ``N`` nope + ``R`` rope query channels,
    ``K`` key-nope and ``V`` value channels; ``elem_bytes`` of the activation dtype."""

    heads: int = 128
    nope: int = 128
    rope: int = 64
    k_dim: int = 128
    v_dim: int = 128
    elem_bytes: int = 2

    @classmethod
    def deepseek_v3(cls) -> MlaDims:
        return cls()


@dataclass(frozen=True)
class OpSpec:
    """One timed operation: the query op (in place or not) or the key/value op, one direction."""

    key: str
    op: str  # "q" | "kv"
    direction: str  # "fwd" | "bwd"
    label: str
    inplace: bool = False
    copy_v: bool = True
    target: float = 0.90  # fraction of the copy bandwidth mlarope must reach (train shapes)


OPS: tuple[OpSpec, ...] = (
    OpSpec("q_inplace_fwd", "q", "fwd", "q in place fwd", inplace=True),
    # With inplace_backward=True, as Megatron-Core's (and the reference's) in-place backward;
    # the default backward of the in-place op is the out-of-place row's kernel.
    OpSpec("q_inplace_bwd", "q", "bwd", "q in place bwd (grad in place)", inplace=True),
    OpSpec("q_fwd", "q", "fwd", "q out of place fwd"),
    OpSpec("q_bwd", "q", "bwd", "q out of place bwd"),
    OpSpec("kv_fwd", "kv", "fwd", "kv fwd (copy_v)", target=0.92),
    OpSpec("kv_fwd_no_copy_v", "kv", "fwd", "kv fwd (no copy_v)", copy_v=False, target=0.92),
    OpSpec("kv_bwd", "kv", "bwd", "kv bwd", target=0.92),
)
OPS_BY_KEY = {spec.key: spec for spec in OPS}


def bytes_moved(
    op: str,
    direction: str,
    *,
    tokens: int,
    dims: MlaDims,
    inplace: bool = False,
    copy_v: bool = True,
) -> int:
    """Fewest bytes one call must move through device memory (docs/benchmarks.md, "Bytes model").

    Each input element read once, each output element written once; the cos/sin rows and the
    positions (a few hundred bytes per token, mostly served from the L2) are not counted. With
    ``e = dims.elem_bytes`` and ``T = tokens``:

    - query op, in place (``op="q"``, ``inplace=True``), forward or backward: read and write the
      rope tail, ``T * H * 2 * R * e``;
    - query op, out of place, forward or backward: read all of ``q`` (or the gradient) and write
      all of the output, ``T * H * 2 * (N + R) * e``;
    - key/value forward, ``copy_v=True``: read ``kv`` (``K + V``) and write ``k`` (``K + R``) and
      ``v`` (``V``) per head, and read ``k_pe`` (``R``) per token:
      ``T * H * ((K + V) + (K + R + V)) * e + T * R * e``;
    - key/value forward, ``copy_v=False``: ``v`` is a view of ``kv``, so only ``kv[..., :K]`` is
      read and ``k`` written: ``T * H * (K + (K + R)) * e + T * R * e``;
    - key/value backward (the mirror; the same kernel whatever ``copy_v`` was, since ``dv``
      arrives either way): read ``dk`` (``K + R``) and ``dv`` (``V``), write ``dkv``
      (``K + V``) per head, write ``dk_pe`` (``R``) per token:
      ``T * H * ((K + R + V) + (K + V)) * e + T * R * e``.

    Effective bandwidth is this over the measured time, for every implementation alike.
    """
    if direction not in ("fwd", "bwd"):
        raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    h, n, r, k, v, e = dims.heads, dims.nope, dims.rope, dims.k_dim, dims.v_dim, dims.elem_bytes
    if op == "q":
        per_head = 2 * r if inplace else 2 * (n + r)
        return tokens * h * per_head * e
    if op == "kv":
        # without copy_v the forward reads only kv[..., :K] and writes no v
        no_v = direction == "fwd" and not copy_v
        per_head = k + (k + r) if no_v else (k + v) + (k + r + v)
        return tokens * h * per_head * e + tokens * r * e
    raise ValueError(f"op must be 'q' or 'kv', got {op!r}")


def spec_bytes(spec: OpSpec, tokens: int, dims: MlaDims) -> int:
    return bytes_moved(
        spec.op, spec.direction, tokens=tokens, dims=dims, inplace=spec.inplace,
        copy_v=spec.copy_v,
    )  # fmt: skip


def target_status(value: float | None, target: float, *, higher_is_better: bool = True) -> str:
    """``PASS``/``MISS`` of one measurement against its target (``n/a`` when not measured)."""
    if value is None or math.isnan(value):
        return "n/a"
    ok = value >= target if higher_is_better else value <= target
    return "PASS" if ok else "MISS"
