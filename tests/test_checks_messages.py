"""The error contract (docs/design.md): bad input to the public API raises ``ValueError`` or
``TypeError`` whose message names the argument and the value.

Every case below changes one thing in a call that is otherwise valid (``test_valid_baseline``
proves the baseline passes), and asserts the exception type and substrings naming the argument
and the offending value. Host-side checks need no device, so the tensors live on the CPU; a
"different device" is the meta device. The device-data checks run with ``validate=True``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

import mlarope
from tests.checks_harness import (
    B,
    H,
    K,
    P,
    R,
    S,
    T,
    V,
    act,
    call,
    inference_tensor,
    strided_last,
    thd,
    width,
)

BOTH = ("q", "kv")
Q_ONLY = ("q",)
KV_ONLY = ("kv",)


@dataclass
class Case:
    id: str
    ops: tuple[str, ...]
    args: Callable[[str], dict]
    exc: type[Exception]
    # substrings of the message; "{x}" is the activation's name (q or kv), "{w}" its width
    expect: list[str] = field(default_factory=list)


def case(id: str, args: Callable[[str], dict], exc: type[Exception], *expect: str, ops=BOTH):
    return Case(id, ops, args, exc, list(expect))


META = torch.device("meta")

CASES = [
    # --- layout ------------------------------------------------------------------------------
    case("layout-unknown", lambda op: {"layout": "sbdh"}, ValueError, "layout", "'sbdh'"),
    case("layout-not-str", lambda op: {"layout": 3}, TypeError, "layout", "3 (int)"),
    # --- the activation ----------------------------------------------------------------------
    case(
        "ndim-sbhd",
        lambda op: {"x": act(op, (S,))},
        ValueError,
        "{x} must be 4-D",
        f"({S}, {H}, {{w}})",
    ),
    case(
        "ndim-bshd",
        lambda op: {"layout": "bshd", "x": act(op, (B, S, 1))},
        ValueError,
        "{x} must be 4-D",
        f"({B}, {S}, 1, {H}, {{w}})",
    ),
    case(
        "ndim-thd",
        lambda op: thd(x=act(op, (S, B))),
        ValueError,
        "{x} must be 3-D",
        f"({S}, {B}, {H}, {{w}})",
    ),
    case("q-not-tensor", lambda op: {"x": [1.0, 2.0]}, TypeError, "q", "[1.0, 2.0]", ops=Q_ONLY),
    case("kv-not-tensor", lambda op: {"x": (3, 4)}, TypeError, "kv", "(3, 4)", ops=KV_ONLY),
    case(
        "int-activation",
        lambda op: {"x": torch.ones(S, B, H, width(op), dtype=torch.int32)},
        TypeError,
        "{x}",
        "torch.int32",
    ),
    case(
        "activation-last-dim-strided",
        lambda op: {"x": strided_last((S, B, H, width(op)))},
        ValueError,
        "{x}",
        "stride(-1)",
        ", 2)",
    ),
    case(
        "q-narrower-than-R",
        lambda op: {"x": torch.randn(S, B, H, R // 2)},
        ValueError,
        f"q.shape[-1] = {R // 2}",
        f"R = {R}",
        ops=Q_ONLY,
    ),
    # --- tables ------------------------------------------------------------------------------
    case(
        "R-odd",
        lambda op: {"cos": torch.randn(P, 33), "sin": torch.randn(P, 33)},
        ValueError,
        "cos.shape[-1]",
        "33",
    ),
    case(
        "R-not-supported",
        lambda op: {"cos": torch.randn(P, 48), "sin": torch.randn(P, 48)},
        ValueError,
        "cos.shape[-1]",
        "48",
        "(32, 64, 128)",
    ),
    case(
        "cos-sin-shape",
        lambda op: {"sin": torch.randn(P - 1, R)},
        ValueError,
        "cos",
        "sin",
        f"({P}, {R})",
        f"({P - 1}, {R})",
    ),
    case(
        "cos-sin-dtype",
        lambda op: {"sin": torch.randn(P, R, dtype=torch.float16)},
        TypeError,
        "cos",
        "sin",
        "torch.float32",
        "torch.float16",
    ),
    case(
        "cos-last-dim-strided",
        lambda op: {"cos": strided_last((P, R))},
        ValueError,
        "cos",
        "stride(-1)",
        f"({2 * R}, 2)",
    ),
    case("cos-not-tensor", lambda op: {"cos": 1.5}, TypeError, "cos", "1.5 (float)"),
    case(
        "cos-int",
        lambda op: {
            "cos": torch.ones(P, R, dtype=torch.int64),
            "sin": torch.ones(P, R, dtype=torch.int64),
        },
        TypeError,
        "cos",
        "torch.int64",
    ),
    case(
        "cos-1d",
        lambda op: {"cos": torch.randn(R), "sin": torch.randn(R)},
        ValueError,
        "cos",
        f"({R},)",
    ),
    case(
        "cos-2-rows-wide",
        lambda op: {"cos": torch.randn(P, 2, R), "sin": torch.randn(P, 2, R)},
        ValueError,
        "cos",
        f"({P}, 2, {R})",
    ),
    case(
        "cos-no-rows",
        lambda op: {"cos": torch.randn(0, R), "sin": torch.randn(0, R)},
        ValueError,
        "cos",
        f"(0, {R})",
    ),
    case(
        "cos-other-device",
        lambda op: {"cos": torch.empty(P, R, device=META), "sin": torch.empty(P, R, device=META)},
        ValueError,
        "cos",
        "meta",
        "cpu",
    ),
    case(
        "table-too-short",
        lambda op: {"tokens": (P + 1, B)},
        ValueError,
        f"{P} positions",
        "cos.shape[0]",
        f"needs {P + 1}",
    ),
    case(
        "table-too-short-cp",
        lambda op: {"tokens": (10, B), "cp_size": 2},
        ValueError,
        f"{P} positions",
        "cos.shape[0]",
        "needs 20",
        "cp_size 2",
    ),
    case(
        "table-too-short-thd",
        lambda op: thd(tokens=(P + 3,)),
        ValueError,
        "cos.shape[0]",
        f"needs {P + 3}",
    ),
    # --- cu_seqlens --------------------------------------------------------------------------
    case(
        "cu_seqlens-with-sbhd",
        lambda op: {"cu_seqlens": torch.tensor([0, S])},
        ValueError,
        "cu_seqlens",
        "layout='sbhd'",
    ),
    case(
        "cu_seqlens-float",
        lambda op: thd(cu_seqlens=torch.tensor([0.0, 4.0])),
        TypeError,
        "cu_seqlens",
        "torch.float32",
    ),
    case(
        "cu_seqlens-2d",
        lambda op: thd(cu_seqlens=torch.tensor([[0, 2, 4]])),
        ValueError,
        "cu_seqlens",
        "(1, 3)",
    ),
    case(
        "cu_seqlens-0d", lambda op: thd(cu_seqlens=torch.tensor(0)), ValueError, "cu_seqlens", "()"
    ),
    case(
        "cu_seqlens-other-device",
        lambda op: thd(cu_seqlens=torch.empty(3, dtype=torch.int32, device=META)),
        ValueError,
        "cu_seqlens",
        "meta",
        "cpu",
    ),
    case(
        "cu_seqlens-list",
        lambda op: thd(cu_seqlens=[0, 4, 8]),
        TypeError,
        "cu_seqlens",
        "[0, 4, 8]",
    ),
    case(
        "cu_seqlens-and-position_ids",
        lambda op: thd(cu_seqlens=torch.tensor([0, T]), position_ids=torch.arange(T)),
        ValueError,
        "cu_seqlens",
        "position_ids",
    ),
    # --- position_ids ------------------------------------------------------------------------
    case(
        "position_ids-shape",
        lambda op: {"position_ids": torch.arange(3)},
        ValueError,
        "position_ids",
        "(3,)",
        f"({S}, {B})",
    ),
    case(
        "position_ids-float",
        lambda op: {"position_ids": torch.zeros(S, B)},
        TypeError,
        "position_ids",
        "torch.float32",
    ),
    case(
        "position_ids-other-device",
        lambda op: {"position_ids": torch.empty(S, B, dtype=torch.int64, device=META)},
        ValueError,
        "position_ids",
        "meta",
        "cpu",
    ),
    case(
        "position_ids-with-cp",
        lambda op: {"position_ids": torch.zeros(S, B, dtype=torch.int64), "cp_size": 2},
        ValueError,
        "position_ids",
        "cp_size=2",
    ),
    # --- context parallel --------------------------------------------------------------------
    case(
        "cp_rank-ge-cp_size",
        lambda op: {"cp_size": 2, "cp_rank": 2},
        ValueError,
        "cp_rank",
        "cp_size=2",
        "got 2",
    ),
    case("cp_rank-negative", lambda op: {"cp_rank": -1}, ValueError, "cp_rank", "-1"),
    case("cp_size-0", lambda op: {"cp_size": 0}, ValueError, "cp_size", "got 0"),
    case("cp_rank-float", lambda op: {"cp_rank": 1.0}, TypeError, "cp_rank", "1.0"),
    case("cp_rank-bool", lambda op: {"cp_rank": True}, TypeError, "cp_rank", "True"),
    case("cp_size-str", lambda op: {"cp_size": "2"}, TypeError, "cp_size", "'2'"),
    # Integers beyond 64 bits raised a bare OverflowError.
    case(
        "cp_size-2**64",
        lambda op: {"cp_size": 2**64},
        ValueError,
        "cp_size must be in [1, 1048576]",
        str(2**64),
    ),
    case(
        "cp_size-2**64-thd",
        lambda op: thd(cu_seqlens=torch.tensor([0, 4, 8]), cp_size=2**64),
        ValueError,
        "cp_size must be in [1, 1048576]",
    ),
    case(
        "cp_size-2**20+1",
        lambda op: thd(cu_seqlens=torch.tensor([0, 4, 8]), cp_size=2**20 + 1),
        ValueError,
        "cp_size",
        str(2**20 + 1),
    ),
    case(
        "cp_rank-2**64",
        lambda op: {"cp_size": 2, "cp_rank": 2**64},
        ValueError,
        "cp_rank",
        str(2**64),
    ),
    # --- not dense ---------------------------------------------------------------------------
    case(
        "activation-sparse",
        lambda op: {"x": act(op, (S, B)).to_sparse()},
        TypeError,
        "{x} is a sparse_coo tensor",
        "dense (strided) tensors only",
    ),
    case(
        "cos-sparse",
        lambda op: {"cos": torch.randn(P, R).to_sparse()},
        TypeError,
        "cos is a sparse_coo tensor",
    ),
    case(
        "k_pe-sparse",
        lambda op: {"k_pe": torch.randn(S, B, 1, R).to_sparse()},
        TypeError,
        "k_pe is a sparse_coo tensor",
        ops=KV_ONLY,
    ),
    case(
        "cu_seqlens-sparse",
        lambda op: thd(cu_seqlens=torch.tensor([0, 4, 8]).to_sparse()),
        TypeError,
        "cu_seqlens is a sparse_coo tensor",
    ),
    case(
        "position_ids-sparse",
        lambda op: thd(position_ids=torch.arange(T).to_sparse()),
        TypeError,
        "position_ids is a sparse_coo tensor",
    ),
    # --- the tables are constants (a table that requires grad got no gradient, or an error
    # from deep inside autograd) ----------------------------------------------------------------
    case(
        "cos-requires-grad",
        lambda op: {"cos": torch.randn(P, R, requires_grad=True)},
        ValueError,
        "cos requires grad",
        "cos.detach()",
    ),
    case(
        "sin-requires-grad-activation-too",
        lambda op: {
            "sin": torch.randn(P, R, requires_grad=True),
            "x": act(op, (S, B), requires_grad=True),
        },
        ValueError,
        "sin requires grad",
        "sin.detach()",
    ),
    # --- in place on an inference tensor outside inference mode (was written silently) --------
    case(
        "q-inference-tensor-inplace",
        lambda op: {"x": inference_tensor(act(op, (S, B))), "inplace": True},
        ValueError,
        "q is an inference tensor",
        "inplace=False",
        ops=Q_ONLY,
    ),
    case(
        "cp-odd-local-length",
        lambda op: {"tokens": (5, B), "cp_size": 2},
        ValueError,
        "cp_size=2",
        "got 5",
    ),
    case(
        "cp-odd-local-length-bshd",
        lambda op: {"tokens": (B, 3), "layout": "bshd", "cp_size": 2},
        ValueError,
        "cp_size=2",
        "got 3",
    ),
    # --- flags -------------------------------------------------------------------------------
    case("interleaved-int", lambda op: {"interleaved": 1}, TypeError, "interleaved", "1"),
    case(
        "interleaved_out-none",
        lambda op: {"interleaved_out": None},
        TypeError,
        "interleaved_out",
        "None",
    ),
    case("inverse-str", lambda op: {"inverse": "no"}, TypeError, "inverse", "'no'", ops=Q_ONLY),
    case("inplace-str", lambda op: {"inplace": "yes"}, TypeError, "inplace", "'yes'", ops=Q_ONLY),
    case(
        "inplace_backward-none",
        lambda op: {"inplace_backward": None},
        TypeError,
        "inplace_backward",
        "None",
        ops=Q_ONLY,
    ),
    case("copy_v-int", lambda op: {"copy_v": 0}, TypeError, "copy_v", "0 (int)", ops=KV_ONLY),
    case("validate-int", lambda op: {"validate": 1}, TypeError, "validate", "1 (int)"),
    # --- kv and k_pe -------------------------------------------------------------------------
    case(
        "k_dim-ge-width",
        lambda op: {"k_dim": K + V},
        ValueError,
        "k_dim",
        f"k_dim={K + V}",
        f"kv.shape[-1] = {K + V}",
        ops=KV_ONLY,
    ),
    case("k_dim-0", lambda op: {"k_dim": 0}, ValueError, "k_dim", "got 0", ops=KV_ONLY),
    case("k_dim-float", lambda op: {"k_dim": 4.0}, TypeError, "k_dim", "4.0", ops=KV_ONLY),
    case("k_dim-none", lambda op: {"k_dim": None}, TypeError, "k_dim", "None", ops=KV_ONLY),
    case(
        "k_pe-dtype",
        lambda op: {"k_pe": torch.randn(S, B, 1, R, dtype=torch.float16)},
        TypeError,
        "k_pe",
        "torch.float16",
        "torch.float32",
        ops=KV_ONLY,
    ),
    case(
        "k_pe-token-dims",
        lambda op: {"k_pe": torch.randn(S - 1, B, 1, R)},
        ValueError,
        "k_pe",
        f"({S - 1}, {B}, ",
        f"({S}, {B})",
        ops=KV_ONLY,
    ),
    case(
        "k_pe-two-heads",
        lambda op: {"k_pe": torch.randn(S, B, 2, R)},
        ValueError,
        "k_pe",
        f"({S}, {B}, 2, {R})",
        ops=KV_ONLY,
    ),
    case(
        "k_pe-width",
        lambda op: {"k_pe": torch.randn(S, B, 1, 2 * R)},
        ValueError,
        "k_pe.shape[-1]",
        f"{2 * R}",
        f"R = cos.shape[-1] = {R}",
        ops=KV_ONLY,
    ),
    case(
        "k_pe-last-dim-strided",
        lambda op: {"k_pe": strided_last((S, B, 1, R))},
        ValueError,
        "k_pe",
        "stride(-1)",
        "2)",
        ops=KV_ONLY,
    ),
    case(
        "k_pe-other-device",
        lambda op: {"k_pe": torch.empty(S, B, 1, R, device=META)},
        ValueError,
        "k_pe",
        "meta",
        "cpu",
        ops=KV_ONLY,
    ),
    case("k_pe-not-tensor", lambda op: {"k_pe": "k_pe"}, TypeError, "k_pe", "'k_pe'", ops=KV_ONLY),
    # --- device data, with validate=True -----------------------------------------------------
    case(
        "cu_seqlens-decreasing",
        lambda op: thd(cu_seqlens=torch.tensor([0, 5, 3, 8]), validate=True),
        ValueError,
        "cu_seqlens[2] = 3",
        "cu_seqlens[1] = 5",
    ),
    case(
        "cu_seqlens-not-from-0",
        lambda op: thd(cu_seqlens=torch.tensor([1, 4, 8]), validate=True),
        ValueError,
        "cu_seqlens[0]",
        "got 1",
    ),
    case(
        "cu_seqlens-length-not-multiple-of-2cp",
        lambda op: thd(cu_seqlens=torch.tensor([0, 4, 10]), cp_size=2, validate=True),
        ValueError,
        "cu_seqlens",
        "cp_size=2",
        "length 6",
    ),
    case(
        "cu_seqlens-beyond-tokens",
        lambda op: thd(cu_seqlens=torch.tensor([0, 4, T + 2]), validate=True),
        ValueError,
        f"cu_seqlens[-1] = {T + 2}",
        f"{T} tokens",
    ),
    case(
        "cu_seqlens-beyond-tokens-cp",
        lambda op: thd(cu_seqlens=torch.tensor([0, 4, 2 * T + 4]), cp_size=2, validate=True),
        ValueError,
        f"cu_seqlens[-1] = {2 * T + 4}",
        f"local {T + 2}",
        f"{T} tokens",
    ),
    case(
        "cu_seqlens-sequence-longer-than-table",
        lambda op: thd(tokens=(P + 4,), cu_seqlens=torch.tensor([0, 2, P + 4]), validate=True),
        ValueError,
        "cu_seqlens",
        f"length {P + 2}",
        f"{P}",
    ),
    case(
        "position_ids-too-large",
        lambda op: {
            "position_ids": torch.tensor([[0, 1], [2, P], [3, 3], [0, 0]]),
            "validate": True,
        },
        ValueError,
        "position_ids",
        f"= {P}",
        f"[0, {P})",
    ),
    case(
        "position_ids-negative",
        lambda op: thd(position_ids=torch.tensor([0, 1, 2, -3, 4, 5, 6, 7]), validate=True),
        ValueError,
        "position_ids[3]",
        "= -3",
    ),
]

PARAMS = [
    pytest.param(case, op, id=f"{op}-{case.id}")
    for case in CASES
    for op in ("q", "kv")
    if op in case.ops
]


def test_enough_distinct_cases():
    assert len({c.id for c in CASES}) == len(CASES) >= 25


@pytest.mark.parametrize("op", ["q", "kv"])
@pytest.mark.parametrize(
    "args",
    [{}, thd(), thd(cu_seqlens=torch.tensor([0, 4, 8]), cp_size=2, cp_rank=1, validate=True)],
    ids=["sbhd", "thd", "thd-cp-validate"],
)
def test_valid_baseline(op, args):
    """The call every case starts from is valid, so each case fails for its own reason."""
    out = call(op, **args)
    assert (out if op == "q" else out[0]).shape[:-2] == tuple(args.get("tokens", (S, B)))


@pytest.mark.parametrize(("case", "op"), PARAMS)
def test_bad_input_is_named(case: Case, op: str, monkeypatch):
    monkeypatch.delenv("MLAROPE_VALIDATE", raising=False)
    with pytest.raises(case.exc) as info:
        call(op, **case.args(op))
    message = str(info.value)
    assert type(info.value) is case.exc, f"{type(info.value).__name__}: {message}"
    for want in case.expect:
        want = want.replace("{x}", op).replace("{w}", str(width(op)))
        assert want in message, f"{want!r} not in {message!r}"


@pytest.mark.parametrize("op", ["q", "kv"])
def test_validation_from_environment(op, monkeypatch):
    """``MLAROPE_VALIDATE=1`` turns the device-data checks on; ``0`` or unset leaves them off."""
    bad = thd(cu_seqlens=torch.tensor([0, 5, 3, 8]))
    monkeypatch.setenv("MLAROPE_VALIDATE", "1")
    with pytest.raises(ValueError, match=r"cu_seqlens\[2\] = 3"):
        call(op, **bad)
    monkeypatch.setenv("MLAROPE_VALIDATE", "0")
    call(op, **bad)  # unchecked: no sync, no error (the kernels stay in bounds)


@pytest.mark.parametrize("op", ["q", "kv"])
def test_a_thd_tensor_without_layout_is_told_the_default(op):
    """sbhd is the default layout: a ``[T, H, D]`` tensor passed without ``layout`` is told so,
    and which layouts take the other shapes."""
    x, k_pe = act(op, (T,)), torch.randn(T, 1, R)
    cos, sin = torch.randn(P, R), torch.randn(P, R)
    with pytest.raises(ValueError) as info:
        if op == "q":
            mlarope.apply_rope_q(x, cos, sin)
        else:
            mlarope.apply_rope_kv(x, k_pe, cos, sin, k_dim=K)
    message = str(info.value)
    assert f"{op} must be 4-D [S, B, H, D] for layout='sbhd'" in message
    assert "the default layout" in message
    assert "layout='thd'" in message and "[T, H, D]" in message
    assert "layout='bshd'" in message and f"got shape ({T}, {H}, {width(op)})" in message


@pytest.mark.parametrize("backend", ["kernels", "reference"])
@pytest.mark.parametrize("source", ["position_ids", "cu_seqlens"])
def test_negated_position_views_are_refused(source, backend, device, monkeypatch):
    """A lazily negated index tensor (``torch._neg_view``) holds the un-negated values in
    memory: the kernels read them, the reference the negated ones, and ``validate=True`` checked
    the latter (found by review: the two backends rotated by different positions)."""
    if backend == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    cos, sin = mlarope.YarnConfig(dim=64).cos_sin(16, device=device)
    q = torch.randn(6, 2, 70, device=device)
    if source == "position_ids":
        kw = {"position_ids": torch._neg_view(-torch.arange(6, device=device))}
    else:
        kw = {"cu_seqlens": torch._neg_view(torch.tensor([0, -2, -6], device=device))}
    for validate in (False, True):
        with pytest.raises(ValueError, match=f"{source} is a negated view"):
            mlarope.apply_rope_q(q, cos, sin, layout="thd", validate=validate, **kw)
        with pytest.raises(ValueError, match=f"{source} is a negated view"):
            mlarope.apply_rope_kv(q, q[:, 0, :64], cos, sin, k_dim=6, layout="thd", **kw)
