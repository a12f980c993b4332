"""The harness of the DeepSeek-V3 / V2 integration tests
(``tests/test_integration_transformers_*.py``, ``tests/test_transformers_attention.py``):
transformers' functions as the patch finds them, their inputs, tiny models, and the tolerances
the tests compare with.

Oracles are transformers itself: the functions the patch replaces, called on the same inputs,
and tiny randomly initialised models run with and without the patch (plus an fp64 copy of the
same model, which measures how much fp32 rounding moves each output). Tolerances:

- one rotation (function level): ``y = a*c - b*s`` (or ``b*c + a*s``) evaluated in the result
  dtype by transformers (two products and an add: within ``3u * (|a*c| + |b*s|)`` of the exact
  value, ``u`` the dtype's unit roundoff) and in fp32 with one final rounding by mlarope (within
  the same bound), so the two differ by at most ``6u * (|a||c| + |b||s|)``, element by element.
  The gradient is the transpose rotation of the upstream gradient: the same bound with ``g``.
- a whole model: see :func:`assert_within_rounding_noise`.

On the CPU lane the kernels run in Triton's interpreter; fp64 tensors always take mlarope's
PyTorch reference path. Models are tiny (batch 2, seq 8, 2 layers) to keep the tests fast.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3

import mlarope
from mlarope.integrations import transformers as mt
from tests.errmodel import join_pairs, split_pairs

try:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_v2
except ImportError:  # older transformers: DeepSeek-V2 arrived after DeepSeek-V3
    hf_v2 = None

try:
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM
except ImportError:  # older transformers: no DeepSeek-V3.2
    DeepseekV32ForCausalLM = None

needs_v32 = pytest.mark.skipif(
    DeepseekV32ForCausalLM is None, reason="the installed transformers has no DeepSeek-V3.2 model"
)
needs_v2 = pytest.mark.skipif(
    hf_v2 is None, reason="the installed transformers has no DeepSeek-V2 model"
)

V3_NAMES = ("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave")
V3_ORIGINAL = {name: getattr(hf_v3, name) for name in V3_NAMES}
V2_ORIGINAL = {"apply_rotary_emb": hf_v2.apply_rotary_emb} if hf_v2 is not None else {}

# DeepSeek-V3's YaRN shape, scaled down. mscale != mscale_all_dim makes the attention factor
# that transformers folds into cos/sin differ from 1 (about 1.065), so it is exercised too.
YARN = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
    "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
    "mscale": 1.0, "mscale_all_dim": 0.5,
}  # fmt: skip
BATCH, SEQ = 2, 8
U32 = 2.0**-24
U64 = 2.0**-53
UNIT_ROUNDOFF = {torch.float32: U32, torch.bfloat16: 2.0**-8, torch.float64: U64}


@pytest.fixture(autouse=True)
def unpatched():
    """Every test starts and ends with transformers' own functions in place."""
    mt.revert_mlarope_deepseek_v3()
    mt.revert_mlarope_deepseek_v2()
    yield
    mt.revert_mlarope_deepseek_v3()
    mt.revert_mlarope_deepseek_v2()
    for name, fn in V3_ORIGINAL.items():
        assert getattr(hf_v3, name) is fn
    for name, fn in V2_ORIGINAL.items():
        assert getattr(hf_v2, name) is fn


@pytest.fixture
def rope_calls(monkeypatch):
    """The shapes of the tensors that reach mlarope (so a silent fallback to transformers is
    visible): ``apply_rope_q`` rotates one, ``apply_rope_qk`` two."""
    calls = []
    for name, tensors in (("apply_rope_q", 1), ("apply_rope_qk", 2)):
        real = getattr(mlarope, name)

        def counting(*args, _real=real, _tensors=tensors, **kwargs):
            calls.extend(tuple(t.shape) for t in args[:_tensors])
            return _real(*args, **kwargs)

        monkeypatch.setattr(mlarope, name, counting)
    return calls


def hf_tables(batch_rows, rope_dim, device, dtype=torch.float32):
    """transformers' form: ``cos = scale * cos(cat(f, f))``, ``[Bc, S, R]``; and the per-pair
    halves ``[Bc, S, R / 2]`` (fp64) for the error bound."""
    angles = 40.0 * torch.rand(batch_rows, SEQ, rope_dim // 2, dtype=torch.float64)
    scale = 1.0648
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = (scale * emb.cos()).to(dtype), (scale * emb.sin()).to(dtype)
    return cos.to(device), sin.to(device), angles, scale


def pair_magnitude(x, c, s, interleaved_in, interleaved_out):
    """``|x_a||c| + |x_b||s|`` and ``|x_b||c| + |x_a||s|`` per pair, in the output layout (fp64).

    ``x: [..., R]``; ``c, s: [..., R / 2]`` broadcastable to ``x``'s pairs."""
    a, b = split_pairs(x.detach().double().abs(), interleaved_in)
    c, s = c.abs(), s.abs()
    return join_pairs(a * c + b * s, b * c + a * s, interleaved_out)


def assert_rotation_close(ours, theirs, bound, what):
    assert ours.shape == theirs.shape, what
    assert ours.dtype == theirs.dtype, what
    err = (ours.double() - theirs.double()).abs()
    excess = err - bound
    if bool((excess > 0).any()):
        i = tuple(int(j) for j in (excess == excess.max()).nonzero()[0])
        raise AssertionError(
            f"{what}: {int((excess > 0).sum())} of {err.numel()} elements outside the bound; "
            f"worst at {list(i)}: mlarope {ours[i].item()!r}, transformers {theirs[i].item()!r}, "
            f"error {err[i].item():.3e} > bound {bound[i].item():.3e}"
        )


def rope_inputs(device, heads_dim, layout, heads=3):
    """q, k as transformers makes them: ``q`` a slice of the fused projection (a transposed view
    when ``heads_dim == 1``), ``k`` the positional slice of the compressed kv, ``[B, 1, S, R]``
    (``[B, S, 1, R]``). ``layout="copy_last"`` gives both a non-contiguous last dim instead."""
    nope, rope, latent = 16, 32, 24
    if layout == "copy_last":
        q_leaf = torch.randn(BATCH, SEQ, heads, 2 * rope, device=device, requires_grad=True)
        k_leaf = torch.randn(BATCH, SEQ, 1, 2 * rope, device=device, requires_grad=True)
        q, k = q_leaf[..., ::2], k_leaf[..., ::2]
    else:
        q_leaf = torch.randn(BATCH, SEQ, heads, nope + rope, device=device, requires_grad=True)
        k_leaf = torch.randn(BATCH, SEQ, latent + rope, device=device, requires_grad=True)
        q, k = q_leaf[..., nope:], k_leaf[..., latent:].unsqueeze(2)
    if heads_dim == 1:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    return q_leaf, k_leaf, q, k


def leaf_view(full, what, layout, heads_dim):
    """The part of a leaf gradient that the rope input ``q``/``k`` occupies, as ``x``'s shape."""
    nope, latent = 16, 24
    if layout == "copy_last":
        view = full[..., ::2]
    elif what == "q":
        view = full[..., nope:]
    else:
        view = full[..., latent:].unsqueeze(2)
    return view.transpose(1, 2) if heads_dim == 1 else view


def unequal_halves(batch_rows, rope_dim, device):
    """Tables whose halves differ (independent angles and magnitudes), which transformers' rotary
    embedding never makes but its functions can be handed: ``[Bc, S, R]``."""
    angles = 6.3 * torch.rand(batch_rows, SEQ, rope_dim, dtype=torch.float64)
    scale = 1.0 + 0.5 * torch.rand(batch_rows, SEQ, rope_dim, dtype=torch.float64)
    cos, sin = (scale * angles.cos()).float(), (scale * angles.sin()).float()
    return cos.to(device), sin.to(device)


def v3_model(device, *, rope_interleave, heads=3, q_lora_rank=32, rope_dim=32):
    config = DeepseekV3Config(
        vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=heads,
        q_lora_rank=q_lora_rank, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=rope_dim,
        v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, max_position_embeddings=256, rope_parameters=dict(YARN),
        rope_interleave=rope_interleave, attn_implementation="eager",
        experts_implementation="eager",  # grouped_mm has no fp64 kernel
    )  # fmt: skip
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(config).to(device)


def v2_model(device):
    config = DeepseekV2Config(
        vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=32, v_head_dim=16,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        max_position_embeddings=256, rope_parameters=dict(YARN), attn_implementation="eager",
        experts_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    return DeepseekV2ForCausalLM(config).to(device)


def v32_model(device, *, index_topk=4):
    """A tiny DeepSeek-V3.2 (MLA with a DSA indexer); ``index_topk < SEQ``, so the indexer's
    sparse mask changes the attention."""
    config = DeepseekV32Config(
        vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=32, v_head_dim=16,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, max_position_embeddings=256, rope_parameters=dict(YARN),
        index_topk=index_topk, index_head_dim=32, index_n_heads=2, attn_implementation="eager",
        experts_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    return DeepseekV32ForCausalLM(config).to(device)


def run_model(model, ids, position_ids):
    """Logits and the gradient of the LM loss w.r.t. every parameter, by name."""
    out = model(input_ids=ids, position_ids=position_ids, labels=ids)
    names, params = zip(*model.named_parameters(), strict=True)
    grads = torch.autograd.grad(out.loss, params, allow_unused=True)
    result = {"logits": out.logits.detach()}
    result.update({n: g for n, g in zip(names, grads, strict=True) if g is not None})
    return result


def noise_bounds(orig32, truth64, unit=U32):
    """Per tensor: ``2 * max|orig32 - truth64| * (unit / 2**-24) + unit * max|truth64|``.

    ``orig32`` and the patched run are two fp32 evaluations of the same network that differ
    only in how the rope step is rounded (same tables, same formula; mlarope rounds once where
    transformers may round three times, or fuses a multiply-add). Each is therefore within the
    network's own fp32 rounding error of the exact value; ``max|orig32 - truth64|`` measures
    that error on this very input (the rope step's rounding and every other one: projections,
    norms, softmax, routing weights, the loss), so two such evaluations differ by at most
    about twice as much. ``unit`` rescales that measured fp32 noise to another dtype's unit
    roundoff (2**-53 for fp64 runs); ``unit * max|truth|`` is a floor of one rounding at the
    tensor's scale, for a tensor that ``orig32`` happens to get exact. A wrong rotation (pair
    layout, sign, position) moves the outputs by O(1) relative, orders of magnitude above this:
    ``test_v3_model_matches_transformers`` checks that the bound does catch one. (The one way a
    rounding difference could move a model by more is a near-tie in the MoE router's top-k;
    the models and inputs here are seeded, so such a tie would fail every run, not sometimes.)
    """
    bounds = {}
    for name, truth in truth64.items():
        noise = float((orig32[name].double() - truth).abs().max())
        bounds[name] = 2 * noise * (unit / U32) + unit * float(truth.abs().max())
    return bounds


def assert_within_rounding_noise(got, want, bounds, what):
    assert got.keys() == want.keys(), what
    for name, bound in bounds.items():
        err = float((got[name].double() - want[name].double()).abs().max())
        assert err <= bound, (
            f"{what}: {name} differs by {err:.3e} > rounding-noise bound {bound:.3e}"
        )
