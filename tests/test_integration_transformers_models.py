"""Tiny DeepSeek-V3 / V2 models with and without the patch: logits and every gradient within
the model's own rounding noise (``tests/deepseek_harness.py``), in fp32 and fp64, with a KV
cache while decoding, and under inference mode.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

pytest.importorskip("transformers")

from transformers import DynamicCache

from mlarope.integrations import transformers as mt
from tests import deepseek_harness
from tests.deepseek_harness import (
    BATCH,
    SEQ,
    U64,
    assert_within_rounding_noise,
    needs_v2,
    noise_bounds,
    run_model,
    v2_model,
    v3_model,
)

# The harness's fixtures, found by pytest under these names: transformers' own functions in
# place around every test, and the tensors that reach mlarope.
unpatched = deepseek_harness.unpatched
rope_calls = deepseek_harness.rope_calls


def _positions(kind, device):
    if kind == "default":
        return None  # transformers' arange: cos/sin are [1, S, R]
    offsets = torch.tensor([[3], [40]], device=device)  # one row per sequence: [B, S, R]
    return torch.arange(SEQ, device=device)[None] + offsets


@pytest.mark.parametrize(
    "rope_interleave, heads, q_lora_rank, positions",
    [(True, 3, 32, "default"), (False, 4, None, "offsets")],
    ids=["interleave-default_positions", "half_split-offset_positions"],
)  # fmt: skip
def test_v3_model_matches_transformers(device, rope_calls, rope_interleave, heads, q_lora_rank,
                                       positions):  # fmt: skip
    model = v3_model(device, rope_interleave=rope_interleave, heads=heads, q_lora_rank=q_lora_rank)
    model64 = copy.deepcopy(model).double()
    ids = torch.randint(0, 64, (BATCH, SEQ), device=device)
    pos = _positions(positions, device)

    orig32, orig64 = run_model(model, ids, pos), run_model(model64, ids, pos)
    bounds32 = noise_bounds(orig32, orig64)
    # negative control: the other pair layout (transformers' own function) breaks the bound
    model.config.rope_interleave = not rope_interleave
    with torch.no_grad():
        wrong = model(input_ids=ids, position_ids=pos).logits
    model.config.rope_interleave = rope_interleave
    assert float((wrong - orig32["logits"]).abs().max()) > 100 * bounds32["logits"]

    with mt.mlarope_patched("deepseek_v3", model=model):
        rope_calls.clear()  # the self-check's calls
        patched32, patched64 = run_model(model, ids, pos), run_model(model64, ids, pos)
    # two runs x two layers x (q_pe, k_pe): every rotation went through mlarope
    assert len(rope_calls) == 2 * 2 * 2, "the model did not rotate through mlarope"
    assert_within_rounding_noise(patched32, orig32, bounds32, "fp32")
    # fp64: the same argument at fp64's unit roundoff (transformers rotates V3 in fp64)
    assert_within_rounding_noise(patched64, orig64, noise_bounds(orig32, orig64, U64), "fp64")


def test_v3_model_kv_cache_decode(device, rope_calls):
    """Prefill then decode one token at a time (cos/sin of one position, offset by the cache)."""
    model = v3_model(device, rope_interleave=True).eval()
    model64 = copy.deepcopy(model).double()
    ids = torch.randint(0, 64, (BATCH, SEQ), device=device)

    # the cache argument is `cache` in recent transformers, `past_key_values` before
    params = inspect.signature(model.forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"

    @torch.no_grad()
    def decode(m):
        cache = DynamicCache(config=m.config)
        logits = [m(input_ids=ids[:, :5], use_cache=True, **{cache_arg: cache}).logits]
        for t in range(5, SEQ):
            step = ids[:, t : t + 1]
            logits.append(m(input_ids=step, use_cache=True, **{cache_arg: cache}).logits)
        return {"logits": torch.cat(logits, dim=1)}

    orig32, orig64 = decode(model), decode(model64)
    with mt.mlarope_patched("deepseek_v3"):
        rope_calls.clear()  # the self-check's calls
        patched32 = decode(model)
    assert len(rope_calls) == 2 * 2 * (1 + SEQ - 5)
    assert_within_rounding_noise(patched32, orig32, noise_bounds(orig32, orig64), "decode")


@needs_v2
def test_v2_model_matches_transformers(device, rope_calls):
    model = v2_model(device)
    model64 = copy.deepcopy(model).double()
    ids = torch.randint(0, 64, (BATCH, SEQ), device=device)
    pos = _positions("offsets", device)
    orig32, orig64 = run_model(model, ids, pos), run_model(model64, ids, pos)
    bounds32 = noise_bounds(orig32, orig64)
    with mt.mlarope_patched("deepseek_v2", model=model):
        rope_calls.clear()  # the self-check's calls
        patched32, patched64 = run_model(model, ids, pos), run_model(model64, ids, pos)
    assert len(rope_calls) == 2 * 2 * 2
    assert_within_rounding_noise(patched32, orig32, bounds32, "fp32")
    # transformers' V2 rotates in fp32 even in an fp64 model (xq.float()), mlarope in fp64: the
    # difference is fp32 rope rounding, inside the fp32 bound.
    assert_within_rounding_noise(patched64, orig64, bounds32, "fp64")


def test_patched_model_runs_under_inference_mode(device):
    """Inference tensors have no version counter: the tables kept per cos/sin object are not
    kept for them (found by review: the patched model raised under torch.inference_mode)."""
    model = v3_model(device, rope_interleave=True).eval()
    ids = torch.randint(3, 60, (1, 6), device=device)
    with torch.no_grad():
        want = model(ids).logits
    with mt.mlarope_patched("deepseek_v3"), torch.inference_mode():
        got = model(ids).logits
        again = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got, again)
