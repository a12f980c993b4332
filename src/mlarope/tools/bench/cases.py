"""The benchmark's cases (batch shapes: sbhd, thd with 1 to 4,096 sequences, decode) and the
inputs of one (case, op): activations or gradients, the position source and the tables."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mlarope import YarnConfig

from .model import MlaDims, OpSpec


@dataclass(frozen=True)
class Case:
    """A batch shape: sbhd ``[S, B]``, thd ``[T]`` with ``n_seqs`` equal sequences
    (``cu_seqlens``), or a decode batch ``[T]`` (thd with random ``position_ids``)."""

    key: str
    label: str
    layout: str
    token_shape: tuple[int, ...]
    n_seqs: int | None = None
    decode: bool = False

    @property
    def tokens(self) -> int:
        return math.prod(self.token_shape)


@dataclass(frozen=True)
class Suite:
    dims: MlaDims
    cases: tuple[Case, ...]
    max_positions: int
    scaling_pair: tuple[str, str]  # thd case keys: few and many sequences
    dtype: torch.dtype = torch.bfloat16


def full_suite() -> Suite:
    tokens = 16384
    cases = [Case("sbhd", "sbhd 4096x4", "sbhd", (4096, 4))]
    for n in (1, 4, 64, 1024, 4096):
        cases.append(Case(f"thd{n}", f"thd 16k / {n} seq", "thd", (tokens,), n_seqs=n))
    for t in (1, 8, 64, 256):
        cases.append(Case(f"decode{t}", f"decode {t}", "thd", (t,), decode=True))
    return Suite(MlaDims.deepseek_v3(), tuple(cases), 32768, ("thd4", "thd4096"))


def smoke_suite() -> Suite:
    cases = [Case("sbhd", "sbhd 8x2", "sbhd", (8, 2))]
    for n in (1, 2, 8):
        cases.append(Case(f"thd{n}", f"thd 32 / {n} seq", "thd", (32,), n_seqs=n))
    for t in (1, 4):
        cases.append(Case(f"decode{t}", f"decode {t}", "thd", (t,), decode=True))
    dims = MlaDims(heads=4, nope=16, rope=32, k_dim=16, v_dim=8)
    return Suite(dims, tuple(cases), 64, ("thd2", "thd8"))


def select_cases(suite: Suite, spec: str | None) -> tuple[Case, ...]:
    """``spec``: a comma list of case keys or groups: ``all``, ``train`` (sbhd and thd*),
    ``decode``."""
    if not spec or spec == "all":
        return suite.cases
    keys = {c.key for c in suite.cases}
    chosen: list[Case] = []
    for word in (w.strip() for w in spec.split(",") if w.strip()):
        if word == "train":
            group = [c for c in suite.cases if not c.decode]
        elif word == "decode":
            group = [c for c in suite.cases if c.decode]
        elif word in keys:
            group = [c for c in suite.cases if c.key == word]
        else:
            raise ValueError(
                f"--cases: unknown case {word!r}; expected all, train, decode or one of "
                f"{sorted(keys)}"
            )
        chosen.extend(c for c in group if c not in chosen)
    return tuple(c for c in suite.cases if c in chosen)


@dataclass
class Inputs:
    """One input set of a (case, op): activations and gradients as the op needs them."""

    x: torch.Tensor  # q [tokens..., H, N + R] | kv [tokens..., H, K + V] | grad of q
    k_pe: torch.Tensor | None = None  # [tokens..., 1, R] (kv fwd)
    dk: torch.Tensor | None = None  # [tokens..., H, K + R] (kv bwd)
    dv: torch.Tensor | None = None  # [tokens..., H, V] (kv bwd)


@dataclass
class Positional:
    """Position source and tables of a case, shared by every input set."""

    layout: str
    cu_seqlens: torch.Tensor | None
    position_ids: torch.Tensor | None
    cos: torch.Tensor  # [P, R] fp32 (mlarope, reference)
    sin: torch.Tensor
    cos_m: torch.Tensor  # [P, 1, 1, R] activation dtype, contiguous (Megatron)
    sin_m: torch.Tensor


def make_positional(suite: Suite, case: Case, device: torch.device, gen: torch.Generator):
    cos, sin = YarnConfig.deepseek_v3(dim=suite.dims.rope).cos_sin(suite.max_positions, device)
    cu = ids = None
    if case.decode:
        ids = torch.randint(0, suite.max_positions, case.token_shape, generator=gen)
        ids = ids.to(device)
    elif case.layout == "thd":
        n, t = case.n_seqs or 1, case.tokens
        cu = torch.arange(0, n + 1, dtype=torch.int32) * (t // n)
        cu = cu.to(device)
    shape = (cos.shape[0], 1, 1, cos.shape[1])
    cos_m = cos.to(suite.dtype).reshape(shape).contiguous()
    sin_m = sin.to(suite.dtype).reshape(shape).contiguous()
    return Positional(case.layout, cu, ids, cos, sin, cos_m, sin_m)


def make_inputs(suite: Suite, case: Case, spec: OpSpec, device: torch.device, sets: int):
    d, ts, dt = suite.dims, case.token_shape, suite.dtype

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn((*ts, *shape), dtype=dt, device=device)

    out = []
    for _ in range(sets):
        if spec.op == "q":
            out.append(Inputs(randn(d.heads, d.nope + d.rope)))
        elif spec.direction == "fwd":
            out.append(Inputs(randn(d.heads, d.k_dim + d.v_dim), k_pe=randn(1, d.rope)))
        else:
            kv = torch.empty(0, device=device)
            out.append(Inputs(kv, dk=randn(d.heads, d.k_dim + d.rope), dv=randn(d.heads, d.v_dim)))
    return out


def rotation_sets(footprint_bytes: int, l2_bytes: int, max_sets: int) -> int:
    """Input sets to rotate through so that one pass reads at least 3x the L2 (each call then
    finds its inputs evicted), capped at ``max_sets``."""
    if footprint_bytes <= 0:
        return 1
    return max(1, min(max_sets, math.ceil(3 * l2_bytes / footprint_bytes)))
