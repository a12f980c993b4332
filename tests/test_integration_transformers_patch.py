"""Applying and reverting the DeepSeek-V3 / V2 patch: idempotent, restored by the context
manager, a later foreign patch left in place, the self-check of the functions it finds,
reference-counted blocks across threads, and the model argument checked.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")

from mlarope.integrations import transformers as mt
from tests import deepseek_harness
from tests.deepseek_harness import (
    BATCH,
    V2_ORIGINAL,
    V3_NAMES,
    V3_ORIGINAL,
    hf_v2,
    hf_v3,
    needs_v2,
    rope_inputs,
    unequal_halves,
    v3_model,
)

# The harness's fixtures, found by pytest under these names: transformers' own functions in
# place around every test, and the tensors that reach mlarope.
unpatched = deepseek_harness.unpatched
rope_calls = deepseek_harness.rope_calls


def test_apply_and_revert_are_idempotent():
    assert not mt.is_mlarope_applied("deepseek_v3")
    mt.revert_mlarope_deepseek_v3()  # nothing patched: a no-op
    assert all(getattr(hf_v3, n) is f for n, f in V3_ORIGINAL.items())

    mt.apply_mlarope_to_deepseek_v3()
    first = {n: getattr(hf_v3, n) for n in V3_NAMES}
    assert all(first[n] is not V3_ORIGINAL[n] for n in V3_NAMES)
    assert all(first[n].__wrapped__ is V3_ORIGINAL[n] for n in V3_NAMES)
    assert first["apply_rotary_pos_emb"].__name__ == "apply_rotary_pos_emb"
    mt.apply_mlarope_to_deepseek_v3()
    assert all(getattr(hf_v3, n) is first[n] for n in V3_NAMES)
    assert mt.is_mlarope_applied("deepseek_v3")

    mt.revert_mlarope_deepseek_v3()
    assert all(getattr(hf_v3, n) is V3_ORIGINAL[n] for n in V3_NAMES)
    assert not mt.is_mlarope_applied("deepseek_v3")
    mt.revert_mlarope_deepseek_v3()
    assert all(getattr(hf_v3, n) is V3_ORIGINAL[n] for n in V3_NAMES)


def test_context_manager_restores_what_was_there():
    with mt.mlarope_patched():
        assert mt.is_mlarope_applied("deepseek_v3")
    assert all(getattr(hf_v3, n) is V3_ORIGINAL[n] for n in V3_NAMES)

    with pytest.raises(KeyError), mt.mlarope_patched("deepseek_v3"):
        raise KeyError("inside the block")
    assert all(getattr(hf_v3, n) is V3_ORIGINAL[n] for n in V3_NAMES)

    mt.apply_mlarope_to_deepseek_v3()
    patched = {n: getattr(hf_v3, n) for n in V3_NAMES}
    with mt.mlarope_patched("deepseek_v3"):
        pass
    assert all(getattr(hf_v3, n) is patched[n] for n in V3_NAMES)  # still applied


def test_revert_leaves_a_later_foreign_patch():
    mt.apply_mlarope_to_deepseek_v3()

    def foreign(*args, **kwargs):
        return V3_ORIGINAL["apply_rotary_pos_emb"](*args, **kwargs)

    hf_v3.apply_rotary_pos_emb = foreign  # someone patches on top of mlarope
    try:
        with pytest.warns(RuntimeWarning, match="replaced by something else"):
            mt.revert_mlarope_deepseek_v3()
        assert hf_v3.apply_rotary_pos_emb is foreign
        interleave = "apply_rotary_pos_emb_interleave"
        assert getattr(hf_v3, interleave) is V3_ORIGINAL[interleave]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mt.revert_mlarope_deepseek_v3()  # nothing of ours left: a silent no-op
    finally:
        hf_v3.apply_rotary_pos_emb = V3_ORIGINAL["apply_rotary_pos_emb"]


def test_self_check_refuses_changed_semantics(device, monkeypatch, rope_calls):
    """A transformers whose function changed is probed again: one that is now another exact
    rotation (interleaved output, handling unsqueeze_dim) is patched as what it now is; one that
    is no rotation mlarope has (the opposite angle), or one that cannot run on the probe, is
    refused and nothing is patched."""

    def interleaved_out(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        args = (q, k, cos, sin, position_ids, unsqueeze_dim)
        q_embed, k_embed = V3_ORIGINAL["apply_rotary_pos_emb_interleave"](*args)
        half = q.shape[-1] // 2
        relayout = lambda x: torch.stack((x[..., :half], x[..., half:]), -1).flatten(-2)
        return relayout(q_embed), relayout(k_embed)

    monkeypatch.setattr(hf_v3, "apply_rotary_pos_emb_interleave", interleaved_out)
    mt.apply_mlarope_to_deepseek_v3()
    _, _, q, k = rope_inputs(device, 1, "fused")
    q, k = q.detach(), k.detach()
    cos, sin = unequal_halves(BATCH, q.shape[-1], device)
    rope_calls.clear()
    ours = hf_v3.apply_rotary_pos_emb_interleave(q, k, cos, sin)
    assert len(rope_calls) == 2
    for o, t in zip(ours, interleaved_out(q, k, cos, sin), strict=True):
        torch.testing.assert_close(o, t, rtol=1e-5, atol=1e-5)  # O(1) values, fp32 roundings
    mt.revert_mlarope_deepseek_v3()

    def opposite_angle(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        return V3_ORIGINAL["apply_rotary_pos_emb"](q, k, cos, -sin, unsqueeze_dim=unsqueeze_dim)

    monkeypatch.setattr(hf_v3, "apply_rotary_pos_emb_interleave", opposite_angle)
    with pytest.raises(
        RuntimeError, match="apply_rotary_pos_emb_interleave: no exact mlarope mapping"
    ):
        mt.apply_mlarope_to_deepseek_v3()
    assert hf_v3.apply_rotary_pos_emb is V3_ORIGINAL["apply_rotary_pos_emb"]  # nothing patched
    assert hf_v3.apply_rotary_pos_emb_interleave is opposite_angle
    assert not mt.is_mlarope_applied("deepseek_v3")

    def cuda_only(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        raise RuntimeError("this kernel needs a CUDA tensor")

    monkeypatch.setattr(hf_v3, "apply_rotary_pos_emb_interleave", cuda_only)
    with pytest.raises(RuntimeError, match="it raised on the probe input"):
        mt.apply_mlarope_to_deepseek_v3()
    assert hf_v3.apply_rotary_pos_emb is V3_ORIGINAL["apply_rotary_pos_emb"]


def _interleave_reading(half_of_tables):
    """An ``apply_rotary_pos_emb_interleave`` that reads ``half_of_tables`` of cos/sin: "both"
    (de-interleave, then transformers' rotate_half formula, as releases before 5.24 did) or
    "second" (a wrong half)."""

    def rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        half = cos.shape[-1] // 2
        if half_of_tables == "second":
            cos = torch.cat((cos[..., half:], cos[..., half:]), dim=-1)
            sin = torch.cat((sin[..., half:], sin[..., half:]), dim=-1)
        deinterleave = lambda x: torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        original = V3_ORIGINAL["apply_rotary_pos_emb"]
        return original(deinterleave(q), deinterleave(k), cos, sin, unsqueeze_dim)

    return rope


def test_self_check_probes_with_unequal_halves(device, monkeypatch, rope_calls):
    """The self-check's tables have unequal halves, so it tells which half the installed
    interleave function reads: one that reads the second half is refused (before, with equal
    halves, it passed), one that reads both halves (transformers before 5.24) gets a
    replacement that reads both halves too, equal to it on any tables."""
    monkeypatch.setattr(hf_v3, "apply_rotary_pos_emb_interleave", _interleave_reading("second"))
    with pytest.raises(RuntimeError, match="no exact mlarope mapping"):
        mt.apply_mlarope_to_deepseek_v3()
    assert not mt.is_mlarope_applied("deepseek_v3")

    older = _interleave_reading("both")
    monkeypatch.setattr(hf_v3, "apply_rotary_pos_emb_interleave", older)
    mt.apply_mlarope_to_deepseek_v3()
    _, _, q, k = rope_inputs(device, 1, "fused")
    q, k = q.detach(), k.detach()
    cos, sin = unequal_halves(BATCH, q.shape[-1], device)
    rope_calls.clear()
    ours = hf_v3.apply_rotary_pos_emb_interleave(q, k, cos, sin)
    theirs = older(q, k, cos, sin)
    assert len(rope_calls) == 2
    for o, t in zip(ours, theirs, strict=True):
        torch.testing.assert_close(o, t, rtol=1e-5, atol=1e-5)  # O(1) values, fp32 roundings
    mt.revert_mlarope_deepseek_v3()
    assert hf_v3.apply_rotary_pos_emb_interleave is older


def test_patched_block_is_reference_counted_across_threads():
    """Thread A enters, thread B enters, A exits: B is still patched until it exits. (Before,
    A's exit restored transformers' functions under B.)"""
    import threading

    a_in, b_in, a_out, b_checked = (threading.Event() for _ in range(4))
    seen = {}

    def thread_a():
        with mt.mlarope_patched("deepseek_v3"):
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def thread_b():
        a_in.wait(10)
        with mt.mlarope_patched("deepseek_v3"):
            b_in.set()
            a_out.wait(10)
            seen["after A exited"] = mt.is_mlarope_applied("deepseek_v3")
        b_checked.set()

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert b_checked.is_set(), "the threads did not finish"
    assert seen["after A exited"], "A's exit unpatched B's block"
    assert all(getattr(hf_v3, n) is f for n, f in V3_ORIGINAL.items()), "the last exit restores"


def test_patch_holders_many_threads():
    """Many threads entering and leaving blocks at once, with apply/revert interleaved: inside a
    block the patch is always in place; after everyone is done, only apply's hold remains."""
    import threading

    errors = []
    start = threading.Barrier(8)

    def worker(i):
        start.wait(10)
        for j in range(20):
            with mt.mlarope_patched("deepseek_v3"):
                if not mt.is_mlarope_applied("deepseek_v3"):
                    errors.append((i, j))
            if i == 0 and j == 10:
                mt.apply_mlarope_to_deepseek_v3()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, f"unpatched inside a block: {errors[:5]}"
    assert mt.is_mlarope_applied("deepseek_v3"), "apply's hold outlives the blocks"
    mt.revert_mlarope_deepseek_v3()
    assert all(getattr(hf_v3, n) is f for n, f in V3_ORIGINAL.items())


def test_revert_inside_a_block_waits_for_the_block():
    """``revert_mlarope_*`` releases apply's hold; a block still open keeps the patch until it
    exits."""
    mt.apply_mlarope_to_deepseek_v3()
    with mt.mlarope_patched("deepseek_v3"):
        mt.revert_mlarope_deepseek_v3()
        assert mt.is_mlarope_applied("deepseek_v3")
    assert not mt.is_mlarope_applied("deepseek_v3")
    assert all(getattr(hf_v3, n) is f for n, f in V3_ORIGINAL.items())


def test_model_argument_is_checked(device):
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        mt.apply_mlarope_to_deepseek_v3(model="deepseek")
    with pytest.raises(ValueError, match="has no DeepseekV3Attention layer"):
        mt.apply_mlarope_to_deepseek_v3(model=torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="qk_rope_head_dim is 16"):
        mt.apply_mlarope_to_deepseek_v3(model=v3_model(device, rope_interleave=True, rope_dim=16))
    assert not mt.is_mlarope_applied("deepseek_v3")  # a refused call patches nothing
    with pytest.raises(ValueError, match="model_type must name an MLA family"):
        mt.mlarope_patched("llama").__enter__()
    mt.apply_mlarope_to_deepseek_v3(model=v3_model(device, rope_interleave=False))
    assert mt.is_mlarope_applied("deepseek_v3")


@needs_v2
def test_v2_apply_and_revert(device):
    with pytest.raises(ValueError, match="has no DeepseekV2Attention layer"):
        mt.apply_mlarope_to_deepseek_v2(model=v3_model(device, rope_interleave=True))
    mt.apply_mlarope_to_deepseek_v2()
    mt.apply_mlarope_to_deepseek_v2()
    assert mt.is_mlarope_applied("deepseek_v2")
    assert not mt.is_mlarope_applied("deepseek_v3")
    mt.revert_mlarope_deepseek_v2()
    mt.revert_mlarope_deepseek_v2()
    assert hf_v2.apply_rotary_emb is V2_ORIGINAL["apply_rotary_emb"]
