"""mlarope.compat.megatron's signatures (Megatron-Core's positional parameters, extras
keyword-only) and argument checks (each bad argument named, under the Megatron function's
name).
"""

from __future__ import annotations

import inspect

import pytest
import torch

from mlarope.compat import megatron as mm
from tests.compat_megatron_harness import CU, B, H, K, N, P, R, S, V, make_tables, randn

_Q_NEW = [
    ("t", inspect.Parameter.empty), ("cos", inspect.Parameter.empty),
    ("sin", inspect.Parameter.empty), ("nope_dim", inspect.Parameter.empty),
    ("emb_dim", inspect.Parameter.empty), ("cu_seqlens_q", None), ("cp_rank", 0),
    ("cp_size", 1), ("rotary_interleaved", False), ("inverse", False),
    ("remove_interleaving", False), ("position_ids", None),
]  # fmt: skip
_KV = [
    ("kv", inspect.Parameter.empty), ("k_pos_emb", inspect.Parameter.empty),
    ("cos", inspect.Parameter.empty), ("sin", inspect.Parameter.empty),
    ("emb_dim", inspect.Parameter.empty), ("k_dim", inspect.Parameter.empty),
    ("v_dim", inspect.Parameter.empty), ("cu_seqlens_kv", None), ("cp_rank", 0),
    ("cp_size", 1), ("rotary_interleaved", False),
]  # fmt: skip
SIGNATURES = {
    "fused_apply_mla_rope_for_q": [*_Q_NEW[:3], ("qk_head_dim", inspect.Parameter.empty),
                                   *_Q_NEW[4:9]],
    "fused_mla_rope_inplace": _Q_NEW,
    "fused_mla_rope_out_of_place": _Q_NEW,
    "fused_apply_mla_rope_for_kv": _KV,
    "fused_mla_rope_kv_split": [*_KV, ("remove_interleaving", False)],
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signature_matches_megatron(name):
    params = list(inspect.signature(getattr(mm, name)).parameters.values())
    positional = [(p.name, p.default) for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == SIGNATURES[name]
    extra = [p for p in params if p.kind is not p.POSITIONAL_OR_KEYWORD]
    assert all(p.kind is p.KEYWORD_ONLY for p in extra)  # extras never shift positions
    assert name in mm.__all__


def _q_args(**over):
    cos, sin = make_tables(torch.float32)
    args = dict(t=torch.zeros(S, B, H, N + R), cos=cos, sin=sin, nope_dim=N, emb_dim=R)
    args.update(over)
    return args


THD_Q = torch.zeros(CU[-1], H, N + R)
CU_T = torch.tensor(CU, dtype=torch.int32)

Q_BAD = [
    (dict(rotary_interleaved=True), ValueError, "rotary_interleaved"),
    (dict(emb_dim=R - 2), ValueError, "emb_dim"),
    (dict(emb_dim=0), ValueError, "emb_dim"),
    (dict(nope_dim=5), ValueError, "nope_dim"),
    (dict(nope_dim=True), TypeError, "nope_dim"),
    (dict(nope_dim=4.0), TypeError, "nope_dim"),
    (dict(t=torch.zeros(S, H, N + R)), ValueError, "t must be"),
    (dict(t=THD_Q), ValueError, "cu_seqlens_q is None"),
    (dict(t=torch.zeros(S, B, H, N + R), cu_seqlens_q=CU_T), ValueError, "thd"),
    (dict(t="q"), TypeError, "t must be a torch.Tensor"),
    (dict(cos=None), TypeError, "cos"),
    (dict(sin=torch.zeros(P, 1, 1, R + 2)), ValueError, "sin"),
    (dict(cp_size=0), ValueError, "cp_size"),
    (dict(cp_rank=2, cp_size=2), ValueError, "cp_rank"),
    (dict(cp_rank=-1), ValueError, "cp_rank"),
    (dict(inverse=1), TypeError, "inverse"),
    (dict(remove_interleaving=None), TypeError, "remove_interleaving"),
    (dict(t=THD_Q, cu_seqlens_q=CU_T.float()), ValueError, "cu_seqlens_q"),
    (dict(t=THD_Q, cu_seqlens_q=CU_T.view(2, 2)), ValueError, "cu_seqlens_q"),
    (dict(position_ids=torch.zeros(S, dtype=torch.int64)), ValueError, "position_ids"),
    (dict(t=THD_Q, cu_seqlens_q=CU_T, position_ids=torch.zeros(3, dtype=torch.int64)),
     ValueError, "position_ids"),
    (dict(t=THD_Q, cu_seqlens_q=CU_T, position_ids=torch.zeros(CU[-1])), ValueError,
     "position_ids"),
]  # fmt: skip


@pytest.mark.parametrize("over, exc, match", Q_BAD, ids=lambda v: None)
@pytest.mark.parametrize("name", ["fused_mla_rope_inplace", "fused_mla_rope_out_of_place"])
def test_q_bad_arguments(name, over, exc, match):
    with pytest.raises(exc, match=match):
        getattr(mm, name)(**_q_args(**over))


def test_legacy_q_names_qk_head_dim():
    cos, sin = make_tables(torch.float32)
    with pytest.raises(ValueError, match="qk_head_dim"):
        mm.fused_apply_mla_rope_for_q(torch.zeros(S, B, H, N + R), cos, sin, N + 1, R)


def test_mlarope_errors_name_the_megatron_function():
    """A table too short for the sequence is caught by mlarope and reported under our name."""
    cos, sin = make_tables(torch.float32)
    with pytest.raises(ValueError, match="fused_apply_mla_rope_for_q"):
        mm.fused_apply_mla_rope_for_q(torch.zeros(P + 1, B, H, N + R), cos, sin, N, R)


def _kv_args(**over):
    cos, sin = make_tables(torch.float32)
    args = dict(
        kv=torch.zeros(S, B, H, K + V), k_pos_emb=torch.zeros(S, B, 1, R), cos=cos, sin=sin,
        emb_dim=R, k_dim=K, v_dim=V,
    )  # fmt: skip
    args.update(over)
    return args


KV_BAD = [
    (dict(rotary_interleaved=True), ValueError, "rotary_interleaved"),
    (dict(v_dim=V + 1), ValueError, "k_dim \\+ v_dim"),
    (dict(k_dim=0), ValueError, "k_dim"),
    (dict(emb_dim=R + 2), ValueError, "emb_dim"),
    (dict(k_pos_emb=torch.zeros(S, B, 1, R + 2)), ValueError, "k_pos_emb"),
    (dict(k_pos_emb=torch.zeros(S, B + 1, 1, R)), ValueError, "k_pos_emb"),
    (dict(k_pos_emb=torch.zeros(S, B, 1, R, dtype=torch.bfloat16)), TypeError, "k_pos_emb"),
    (dict(kv=torch.zeros(S, H, K + V)), ValueError, "kv must be"),
    (dict(cu_seqlens_kv=CU_T), ValueError, "kv must be"),
    (dict(cp_rank=1), ValueError, "cp_rank"),
    (dict(remove_interleaving=0), TypeError, "remove_interleaving"),
    (dict(rounding="fast"), ValueError, "rounding"),
    (dict(rounding=None), TypeError, "rounding"),
    (dict(kv=None), TypeError, "kv"),
]  # fmt: skip


@pytest.mark.parametrize("over, exc, match", KV_BAD, ids=lambda v: None)
def test_kv_bad_arguments(over, exc, match):
    with pytest.raises(exc, match=match):
        mm.fused_mla_rope_kv_split(**_kv_args(**over))


def test_k_pos_emb_without_head_axis_is_accepted():
    """``[S, B, R]`` works like ``[S, B, 1, R]`` (Megatron views it flat too)."""
    cos, sin = make_tables(torch.float32)
    kv = randn(S, B, H, K + V, dtype=torch.float32, seed=16)
    kpe = randn(S, B, 1, R, dtype=torch.float32, seed=17)
    k1, v1 = mm.fused_apply_mla_rope_for_kv(kv, kpe, cos, sin, R, K, V)
    k2, v2 = mm.fused_apply_mla_rope_for_kv(kv, kpe.view(S, B, R), cos, sin, R, K, V)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)
