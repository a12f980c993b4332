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

S, B, H = 4, 2, 2  # sequence, batch, heads
N, R = 8, 32  # q: nope and rope channels
K, V = 4, 6  # kv: key-nope and value channels
P = 16  # table rows
T = 8  # thd tokens
BOTH = ("q", "kv")
Q_ONLY = ("q",)
KV_ONLY = ("kv",)


def width(op: str) -> int:
    return N + R if op == "q" else K + V


def act(op: str, tokens: tuple[int, ...], **kw) -> torch.Tensor:
    """The activation of ``op``: ``q: [tokens..., H, N + R]`` or ``kv: [tokens..., H, K + V]``."""
    return torch.randn(*tokens, H, width(op), **kw)


def call(op: str, *, tokens=(S, B), layout="sbhd", x=None, k_pe=None, cos=None, sin=None, **kw):
    """A valid call of ``op`` with ``tokens`` token dims, with the given arguments replaced."""
    x = act(op, tokens) if x is None else x
    cos = torch.randn(P, R) if cos is None else cos
    sin = torch.randn(P, R) if sin is None else sin
    if op == "q":
        return mlarope.apply_rope_q(x, cos, sin, layout=layout, **kw)
    k_pe = torch.randn(*tokens, 1, R) if k_pe is None else k_pe
    kw.setdefault("k_dim", K)
    return mlarope.apply_rope_kv(x, k_pe, cos, sin, layout=layout, **kw)


def _inference(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` made under ``torch.inference_mode()`` (an inference tensor)."""
    with torch.inference_mode():
        return t.clone()


def thd(**kw) -> dict:
    return {"tokens": (T,), "layout": "thd", **kw}


def strided_last(shape: tuple[int, ...]) -> torch.Tensor:
    """A view of ``shape`` whose last dim has stride 2."""
    return torch.randn(*shape[:-1], 2 * shape[-1])[..., ::2]


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
        lambda op: {"x": _inference(act(op, (S, B))), "inplace": True},
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


def test_inplace_on_a_broadcast_q_is_rejected():
    """Elements that share memory cannot be rotated in place (two programs would both rotate
    them): a ValueError naming q, never a silently wrong result."""
    cos, sin = torch.randn(64, 32), torch.randn(64, 32)
    q = torch.randn(1, 8, 2, 16 + 32).expand(4, 8, 2, 48)
    with pytest.raises(ValueError, match=r"q has elements that share memory.*\(4, 8, 2, 48\)"):
        mlarope.apply_rope_q(q, cos, sin, layout="bshd", inplace=True)
    out = mlarope.apply_rope_q(q, cos, sin, layout="bshd")  # out of place is fine
    assert out.shape == q.shape


@pytest.mark.parametrize("backend", ["kernels", "reference"])
def test_inplace_on_overlapping_rows_is_rejected(backend, device, monkeypatch):
    """Rows that overlap without a stride-0 dim (an ``as_strided`` view): a ValueError naming
    q on every backend (both accepted it and wrote different values, up to 4.1 apart)."""
    if backend == "reference":
        if torch.device(device).type != "cpu":
            pytest.skip("the reference backend runs CPU tensors")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    cos, sin = torch.randn(16, 32, device=device), torch.randn(16, 32, device=device)
    memory = torch.randn(400, device=device)
    q = memory.as_strided((6, 1, 32), (16, 32, 1))
    with pytest.raises(ValueError, match=r"q has elements that share memory.*overlapping rows"):
        mlarope.apply_rope_q(q, cos, sin, layout="thd", inplace=True)
    # rows of a fused projection, apart: accepted
    wide = torch.randn(6, 2, 3 * 48, device=device)[..., 48 : 2 * 48]
    positions = torch.arange(6, device=device)
    mlarope.apply_rope_q(wide, cos, sin, layout="thd", position_ids=positions, inplace=True)


@pytest.mark.parametrize("shared", ["cos", "sin", "position_ids"])
def test_inplace_on_memory_the_call_reads_is_rejected(shared, device):
    """q overlapping a table or the positions: the programs would read values others already
    rotated (a silently wrong result, and a race on a GPU). A ValueError naming both, also when
    the same metadata was recorded as a launch plan from a call without the overlap."""
    T, R = 16, 32
    ids = torch.arange(T - 1, -1, -1, device=device)

    def call(q, cos, sin, position_ids):
        return mlarope.apply_rope_q(
            q, cos, sin, layout="thd", position_ids=position_ids, inplace=True
        )

    def tensors(overlap: bool):
        # Every tensor a view of a [T, 2, R] block, so that both calls have one metadata.
        memory = torch.randn(T, 2, R, device=device)
        blocks = {name: torch.randn(T, 2, R, device=device) for name in ("cos", "sin", "ids")}
        if overlap:
            blocks[{"position_ids": "ids"}.get(shared, shared)] = memory
        q = memory[:, :1]  # [T, 1, R]
        position_ids = blocks["ids"].view(torch.int64)[:, 0, 0]  # the first 8 bytes of a row
        position_ids.copy_(ids)
        return q, blocks["cos"][:, 0], blocks["sin"][:, 0], position_ids

    call(*tensors(False))
    call(*tensors(False))  # recorded: a launch plan for this metadata
    with pytest.raises(ValueError, match=f"q shares memory with {shared}"):
        call(*tensors(True))


def test_compiled_inplace_on_memory_the_call_reads_is_rejected():
    """Under torch.compile(fullgraph=True) without grad (the in-place op itself runs in the
    graph): the overlap is refused when the graph runs, since tracing sees no addresses."""
    T, R = 16, 32
    memory = torch.randn(T, 2, R)
    q, cos, sin = memory[:, :1], memory[:, 0], torch.randn(T, R)

    @torch.compile(backend="eager", fullgraph=True)
    def rope(q, cos, sin):
        return mlarope.apply_rope_q(q, cos, sin, layout="thd", inplace=True)

    with torch.no_grad(), pytest.raises(ValueError, match="q shares memory with cos"):
        rope(q, cos, sin)


def test_compiled_position_ids_of_a_dynamic_token_dim():
    """Under torch.compile, once the token count is dynamic, position_ids of that count still
    broadcast to it (a static 1 and a SymInt: ``s in (1, t)`` was False there and raised)."""
    R = 32
    cos, sin = torch.randn(64, R), torch.randn(64, R)

    @torch.compile(backend="eager", fullgraph=True)
    def rope(q, ids=None):
        return mlarope.apply_rope_q(q, cos, sin, layout="thd", position_ids=ids)

    rope(torch.randn(8, 1, R))
    rope(torch.randn(12, 1, R))  # the token dim becomes dynamic
    q, ids = torch.randn(8, 1, R), torch.arange(8)
    assert torch.equal(
        rope(q, ids), mlarope.apply_rope_q(q, cos, sin, layout="thd", position_ids=ids)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["kernels", "reference"])
def test_kv_backward_with_zero_heads(dtype, device):
    """With no heads ``k_pe`` reaches no output: its gradient is zero in every row, an
    out-of-range position included, on every backend. (Before: NaN on the reference.)"""
    device = device if dtype == torch.float32 else torch.device("cpu")
    cos, sin = torch.randn(64, 32, device=device), torch.randn(64, 32, device=device)
    kv = torch.randn(4, 2, 0, 16, dtype=dtype, device=device, requires_grad=True)
    k_pe = torch.randn(4, 2, 1, 32, dtype=dtype, device=device, requires_grad=True)
    k, v = mlarope.apply_rope_kv(kv, k_pe, cos, sin, k_dim=8)
    (k.sum() + v.sum()).backward()
    assert torch.equal(k_pe.grad, torch.zeros_like(k_pe))
    ids = torch.tensor([[0, 1], [64, 2], [3, -1], [5, 6]], device=device)  # two out of range
    k_pe.grad = None
    k, v = mlarope.apply_rope_kv(kv, k_pe, cos, sin, k_dim=8, position_ids=ids)
    (k.sum() + v.sum()).backward()
    assert torch.equal(k_pe.grad, torch.zeros_like(k_pe))


def test_inplace_on_an_inference_tensor():
    """Outside inference mode an inference tensor cannot be rotated in place (PyTorch's rule):
    a ``ValueError`` before anything is written. Inside inference mode it is rotated."""
    cos, sin = torch.randn(P, R), torch.randn(P, R)
    q = _inference(torch.randn(S, B, H, N + R))
    before = q.clone()
    with pytest.raises(ValueError, match="q is an inference tensor"):
        mlarope.apply_rope_q(q, cos, sin, inplace=True)
    assert torch.equal(q, before), "nothing was written"
    with torch.inference_mode():
        out = mlarope.apply_rope_q(q, cos, sin, inplace=True)
    assert out is q and torch.equal(q, mlarope.apply_rope_q(before, cos, sin))


@pytest.mark.parametrize("table", ["cos", "sin"])
@pytest.mark.parametrize("op", ["q", "kv"])
def test_tables_that_require_grad_work_without_grad_mode(op, table):
    """Under ``torch.no_grad()`` no gradient is asked for, so a table that requires grad is
    fine: the same result as its detached value. The reference module's own API follows the
    contract too."""
    tables = {"cos": torch.randn(P, R), "sin": torch.randn(P, R)}
    want = call(op, x=torch.ones(S, B, H, width(op)), k_pe=torch.ones(S, B, 1, R), **tables)
    tables[table].requires_grad_(True)
    with torch.no_grad():
        got = call(op, x=torch.ones(S, B, H, width(op)), k_pe=torch.ones(S, B, 1, R), **tables)
    for a, b in zip(got if op == "kv" else (got,), want if op == "kv" else (want,), strict=True):
        assert torch.equal(a, b)
    from mlarope import reference

    with pytest.raises(ValueError, match=f"{table} requires grad"):
        reference.apply_rope_q(torch.randn(S, B, H, N + R), tables["cos"], tables["sin"])


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


@pytest.mark.parametrize("backend", ["kernels", "reference"])
@pytest.mark.parametrize("source", ["position_ids", "cu_seqlens"])
def test_validation_in_a_fullgraph_compile(source, backend, device, monkeypatch):
    """``validate=True`` (or ``MLAROPE_VALIDATE=1``) inside ``torch.compile(fullgraph=True)``:
    the device-data checks are an op of the graph, which raises the eager error when the graph
    runs (a traced branch on device data failed the trace, found by review)."""
    if backend == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch._dynamo.reset()
    cos, sin = mlarope.YarnConfig(dim=64).cos_sin(16, device=device)
    q = torch.randn(6, 2, 70, device=device)
    good = {
        "position_ids": torch.arange(6, device=device),
        "cu_seqlens": torch.tensor([0, 2, 6], dtype=torch.int32, device=device),
    }[source]
    bad = {
        "position_ids": torch.tensor([0, 1, 2, 99, 4, 5], device=device),
        "cu_seqlens": torch.tensor([0, 4, 2], dtype=torch.int32, device=device),
    }[source]

    def rotate(q, index):
        return mlarope.apply_rope_q(q, cos, sin, layout="thd", validate=True, **{source: index})

    compiled = torch.compile(rotate, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(q, good), rotate(q, good))
    with pytest.raises(ValueError) as eager:
        rotate(q, bad)
    with pytest.raises(ValueError) as in_graph:
        compiled(q, bad)
    assert str(in_graph.value) == str(eager.value)


@pytest.mark.cpu  # switches between the interpreter's kernels and the reference on CPU tensors
@pytest.mark.parametrize("inplace_backward", [False, True])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_in_place_bumps_the_version_alike_on_every_backend(
    requires_grad, inplace_backward, monkeypatch
):
    """An in-place rotation is one write on every backend: the reference backend bumped ``q``'s
    version counter once more than the kernels (its copy, then the call's own bump; found by
    review: autograd's "is at version" messages differed by backend)."""
    from mlarope._launch_cache import clear_launch_cache

    cos, sin = mlarope.YarnConfig(dim=64).cos_sin(8)
    bumps = {}
    for backend in ("kernels", "reference"):
        monkeypatch.setenv("TRITON_INTERPRET", "1" if backend == "kernels" else "0")
        clear_launch_cache()
        q = torch.randn(4, 2, 70, requires_grad=requires_grad).clone()
        g = torch.randn(4, 2, 70)
        before = q._version
        out = mlarope.apply_rope_q(q, cos, sin, layout="thd", inplace=True,
                                   inplace_backward=inplace_backward)  # fmt: skip
        bumps[backend] = [q._version - before]
        if requires_grad:
            before = g._version
            out.backward(g)
            bumps[backend].append(g._version - before)
    assert bumps["kernels"] == bumps["reference"], bumps
    if not requires_grad:
        assert bumps["kernels"] == [1]


@pytest.mark.parametrize("backend", ["kernels", "reference"])
@pytest.mark.parametrize("view", [False, True])
def test_in_place_on_a_leaf_that_requires_grad_writes_nothing(view, backend, monkeypatch):
    """autograd forbids writing a leaf that requires grad (or a view of one) in place: the call
    raises before anything is written, as PyTorch's in-place ops do (the kernels wrote, then
    mark_dirty raised; found by review), also when repeated (no plan is recorded)."""
    if backend == "reference":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    cos, sin = mlarope.YarnConfig(dim=64).cos_sin(8)
    leaf = torch.randn(4, 2, 70, requires_grad=True)
    before = leaf.detach().clone()
    q = leaf[:, :1] if view else leaf
    # A launch plan recorded by calls on a non-leaf of the same metadata (its guard does not
    # tell a leaf): the leaf is refused before the plan is looked up.
    activation = torch.randn(4, 2, 70, requires_grad=True) * 1
    for _ in range(2):
        mlarope.apply_rope_q(activation[:, :1] if view else activation, cos, sin, layout="thd",
                             inplace=True)  # fmt: skip
    for _ in range(2):
        with pytest.raises(RuntimeError, match="q is a leaf Variable that requires grad"):
            mlarope.apply_rope_q(q, cos, sin, layout="thd", inplace=True)
        assert torch.equal(leaf.detach(), before)
    with torch.no_grad():  # outside autograd it is an ordinary tensor
        mlarope.apply_rope_q(q, cos, sin, layout="thd", inplace=True)
    assert not torch.equal(leaf.detach(), before)
