"""The latent op's error contract: every bad argument and table named in the message;
``validate=True`` finds positions outside the table.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

import mlarope
from tests.harness import random_tables


def _good(device):
    ckv = torch.randn(2, 3, 32 + 64, device=device)
    weight = torch.ones(32, device=device)
    cos, sin = random_tables(8, 64, torch.float32, device)
    return ckv, weight, cos, sin, dict(kv_lora_rank=32, eps=1e-6, layout="bshd")


BAD = [
    ("ckv", lambda c, w: ([1.0], w), {}, TypeError, "ckv must be a torch.Tensor"),
    ("ckv int", lambda c, w: (c.long(), w), {}, TypeError, "ckv must be float32"),
    ("ckv dims", lambda c, w: (c[0], w), {}, ValueError, "ckv must be 3-D [B, S, L + R]"),
    ("ckv stride", lambda c, w: (c.transpose(1, 2).contiguous().transpose(1, 2)[:, :, :],
                                 w), {}, ValueError, "ckv must have a contiguous last dim"),
    ("width", lambda c, w: (c[..., 1:], w), {}, ValueError,
     "ckv.shape[-1] must be kv_lora_rank + R = 32 + 64 = 96"),
    ("weight shape", lambda c, w: (c, w[1:]), {}, ValueError,
     "weight must be [kv_lora_rank] = [32]"),
    ("weight 2-D", lambda c, w: (c, w[None]), {}, ValueError, "weight must be [kv_lora_rank]"),
    ("weight dtype", lambda c, w: (c.bfloat16(), w.double()), {}, TypeError,
     "weight must be float32, float16 or bfloat16 for a torch.bfloat16 ckv"),
    ("weight int", lambda c, w: (c, w.int()), {}, TypeError, "weight must be float32"),
    ("weight stride", lambda c, w: (c, torch.ones(64, device=c.device)[::2]), {}, ValueError,
     "weight must have a contiguous last dim"),
    ("weight device", lambda c, w: (c, w.to("meta")), {}, ValueError,
     "weight must be on ckv's device"),
    ("rank bool", lambda c, w: (c, w), {"kv_lora_rank": True}, TypeError,
     "kv_lora_rank must be an int"),
    ("rank 0", lambda c, w: (c, w), {"kv_lora_rank": 0}, ValueError, "kv_lora_rank must be >= 1"),
    ("rank", lambda c, w: (c, w), {"kv_lora_rank": 31}, ValueError,
     "weight must be [kv_lora_rank] = [31]"),
    ("eps 0", lambda c, w: (c, w), {"eps": 0.0}, ValueError, "eps must be a finite number > 0"),
    ("eps < 0", lambda c, w: (c, w), {"eps": -1e-6}, ValueError, "got -1e-06"),
    ("eps nan", lambda c, w: (c, w), {"eps": math.nan}, ValueError, "got nan"),
    ("eps inf", lambda c, w: (c, w), {"eps": math.inf}, ValueError, "got inf"),
    ("eps str", lambda c, w: (c, w), {"eps": "1e-6"}, TypeError, "eps must be a float"),
    ("eps bool", lambda c, w: (c, w), {"eps": True}, TypeError, "eps must be a float"),
    ("eps tensor", lambda c, w: (c, w), {"eps": torch.tensor(1e-6)}, TypeError,
     "eps must be a float"),
    ("layout", lambda c, w: (c, w), {"layout": "bhsd"}, ValueError, "layout must be one of"),
    ("interleaved", lambda c, w: (c, w), {"interleaved": 1}, TypeError,
     "interleaved must be a bool"),
    ("interleaved_out", lambda c, w: (c, w), {"interleaved_out": None}, TypeError,
     "interleaved_out must be a bool"),
    ("cu_seqlens", lambda c, w: (c, w), {"cu_seqlens": torch.tensor([0, 3])}, ValueError,
     "cu_seqlens is only valid with layout='thd'"),
    ("position_ids", lambda c, w: (c, w), {"position_ids": torch.zeros(3, 2, dtype=torch.long)},
     ValueError, "position_ids must match the token dims (2, 3)"),
    ("validate", lambda c, w: (c, w), {"validate": "yes"}, TypeError, "validate must be a bool"),
]  # fmt: skip


@pytest.mark.parametrize("what, inputs, kwargs, error, message", BAD, ids=[b[0] for b in BAD])
def test_bad_arguments_are_named(what, inputs, kwargs, error, message, device):
    ckv, weight, cos, sin, good = _good(device)
    ckv, weight = inputs(ckv, weight)
    for name in ("cu_seqlens", "position_ids"):
        if name in kwargs:
            kwargs = {**kwargs, name: kwargs[name].to(device)}
    with pytest.raises(error, match=re.escape(message)):
        mlarope.rmsnorm_rope_latent(ckv, weight, cos, sin, **{**good, **kwargs})


def test_bad_tables_are_named(device):
    ckv, weight, cos, sin, good = _good(device)
    odd = random_tables(8, 48, torch.float32, device)
    with pytest.raises(ValueError, match=re.escape("rope dim R = cos.shape[-1] must be one of")):
        mlarope.rmsnorm_rope_latent(ckv[..., :80], weight, *odd, **good)
    with pytest.raises(ValueError, match="cos requires grad"):
        mlarope.rmsnorm_rope_latent(ckv, weight, cos.requires_grad_(True), sin, **good)
    with pytest.raises(ValueError, match="the table has 8 positions"):
        mlarope.rmsnorm_rope_latent(
            torch.randn(1, 9, 96, device=device), weight, cos.detach(), sin, **good
        )


def test_validate_finds_positions_outside_the_table(device):
    ckv, weight, cos, sin, good = _good(device)
    ids = torch.tensor([[0, 1, 8], [0, 1, 2]], device=device)
    with pytest.raises(ValueError, match=re.escape("position_ids[0, 2] = 8 is outside the table")):
        mlarope.rmsnorm_rope_latent(ckv, weight, cos, sin, position_ids=ids, validate=True,
                                    **good)  # fmt: skip
    latent, k_pe = mlarope.rmsnorm_rope_latent(ckv, weight, cos, sin, position_ids=ids, **good)
    assert k_pe[0, 2].isnan().all() and not k_pe[0, :2].isnan().any()
    assert not latent.isnan().any()
