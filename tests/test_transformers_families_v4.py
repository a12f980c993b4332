"""DeepSeek-V4 through the patch: ``generate`` through its caches, the tables it prepares
once per forward and keeps (released with their sources, made anew for new data, never kept
from inference mode), its inverse call and what falls back to transformers.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util

import pytest
import torch

pytest.importorskip("transformers")

import transformers
from transformers.models.auto import modeling_auto

import mlarope
from mlarope.integrations import transformers as mt
from mlarope.integrations.transformers import _patch, _rotation
from tests import families_harness
from tests.families_harness import (
    BASE,
    OVERRIDES,
    REPORT,
    U32,
    CallCounter,
    assert_bf16_close,
    assert_identical,
    tiny_model,
    token_ids,
)
from tests.harness import fused_reference, interpreter_fma_rounds_once, reference_backend

# The harness's fixtures, found by pytest under these names: one intra-op thread for the tiny
# models, and every family unpatched after each test.
one_thread = families_harness.one_thread
unpatched_after = families_harness.unpatched_after

V4 = "deepseek_v4"
# By the installed code, not the report: a release with deepseek_v4 must have it in the report.
needs_v4 = pytest.mark.skipif(
    importlib.util.find_spec(f"transformers.models.{V4}") is None,
    reason="no deepseek_v4 in this transformers",
)


@pytest.fixture
def rope_tensors(monkeypatch):
    """The shapes of the tensors that reach mlarope (a silent fallback to transformers is
    visible): ``apply_rope_q`` rotates one, ``apply_rope_qk`` two."""
    shapes = []
    for name, tensors in (("apply_rope_q", 1), ("apply_rope_qk", 2)):
        real = getattr(mlarope, name)

        def counting(*args, _real=real, _tensors=tensors, **kwargs):
            shapes.extend(tuple(t.shape) for t in args[:_tensors])
            return _real(*args, **kwargs)

        monkeypatch.setattr(mlarope, name, counting)
    return shapes


@needs_v4
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_deepseek_v4_generate(dtype, device, monkeypatch):
    """``generate`` with V4's caches (the sliding window, each compressor's buffer and entries,
    windows closing during decode, so the compressors and indexer rotate there too) along a
    forced continuation, so every run decodes the same tokens: each step's logits of the
    patched model, on both backends, are the unpatched model's bit for bit on the CPU (V4 rotates
    in fp32 and rounds once, as mlarope does) where the kernels' fma rounds twice; where it
    rounds once (the GPU, a newer interpreter), the fused reference's bit for bit, and in bf16
    within the bound of the module docstring against an fp64 run; every rotation of every step
    goes through mlarope."""
    model = tiny_model(REPORT[V4], dtype, device).eval()
    prompt, new = token_ids(5, device), 7
    forced = torch.randint(3, 128, (2, new), generator=torch.Generator().manual_seed(3))

    def allowed(batch_id, input_ids):
        return [int(forced[batch_id, input_ids.shape[-1] - prompt.shape[-1]])]

    def steps(m):
        with torch.no_grad():
            out = m.generate(
                prompt, max_new_tokens=new, do_sample=False, prefix_allowed_tokens_fn=allowed,
                output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
        assert torch.equal(out.sequences[:, prompt.shape[-1] :].cpu(), forced)
        return {f"step {i}": logits for i, logits in enumerate(out.logits)}

    counter = CallCounter(monkeypatch, V4)
    unpatched = counter.expected(lambda: steps(model))
    truth = steps(copy.deepcopy(model).double()) if dtype == torch.bfloat16 else None
    cpu = torch.device(device).type == "cpu"
    for backend in ("kernels", "reference") if cpu else ("kernels",):
        with monkeypatch.context() as m:
            if backend == "reference":
                m.setenv("TRITON_INTERPRET", "0")
            with mt.mlarope_patched(V4):
                counter.mlarope = 0
                patched = steps(model)
        assert counter.mlarope == counter.rotated > 0, (backend, counter.mlarope)
        what = f"deepseek_v4 generate {backend} {dtype}"
        if cpu and (backend == "reference" or not interpreter_fma_rounds_once()):
            assert_identical(patched, unpatched, what)
            continue
        # The kernels' fma rounds once (the GPU, a newer interpreter): within the bf16 bound of
        # transformers, and bit for bit the reference backend computing their fused products.
        if dtype == torch.bfloat16:
            assert_bf16_close(patched, (unpatched,), truth, what)
        with monkeypatch.context() as m:
            reference_backend(m, device)
            fused_reference(m)
            with mt.mlarope_patched(V4):
                assert_identical(patched, steps(model), f"{what} vs the fused arithmetic")


@needs_v4
def test_deepseek_v4_model_tables_are_prepared_once_per_forward(device, monkeypatch):
    """The tables the model hands its layers ("main", "compress") are made ready for mlarope
    (``cat(cos, cos)``) once per forward, though the compressors, the indexer and the inverse
    call (a fresh ``-sin``) rotate by tables of their own between the layers (with one entry
    kept, "compress" was made again in every compressed layer after the first)."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

    model = tiny_model(REPORT[V4], torch.float32, device).eval()
    handed = {}

    def hand(module, args, kwargs):
        cos, sin = kwargs["position_embeddings"][module.rope_layer_type]
        handed[module.rope_layer_type] = (cos, sin)

    for layer in model.modules():
        if isinstance(layer, v4.DeepseekV4Attention):
            layer.register_forward_pre_hook(hand, with_kwargs=True)
    made = []
    real = _rotation._make_tables

    def making(sources, rows, kind):
        made.append(tuple(map(id, sources)))
        return real(sources, rows, kind)

    monkeypatch.setattr(_rotation, "_make_tables", making)
    with mt.mlarope_patched(V4), torch.no_grad():
        model(input_ids=token_ids(12, device))
    assert set(handed) == {"main", "compress"}
    for name, (cos, sin) in handed.items():
        assert made.count((id(cos), id(sin))) == 1, (name, made)
    assert len(made) > len(handed)  # the tables of the compressors, indexer and inverse calls


def test_kept_tables_are_released_with_their_sources():
    """Tables kept for reuse hold no memory past the tensors they were made from (a model's
    forward): they are dropped when those are freed (one entry used to be held until the next
    call, whatever its size)."""
    import weakref

    prepared = _rotation._Prepared()
    cos, sin = torch.randn(2, 1, 8, 16).unbind(0)
    for _ in range(2):  # made, then reused: kept
        tables = prepared.get((cos, sin), 8, "half_width")
    assert tables[0].shape == (8, 32)
    alive = weakref.ref(tables[0])
    del tables
    assert alive() is not None  # kept while its sources live
    del cos, sin
    assert alive() is None


def test_kept_tables_follow_new_data_and_stay_out_of_inference_mode():
    """Kept tables are made anew for a source given new data through ``.data`` (same object,
    same version counter: another address or dtype), and tables made under inference mode are
    not kept (they are inference tensors: a later call with autograd could not save them).
    Both found by review; each failed before."""
    prepared = _rotation._Prepared()
    cos, sin = torch.randn(2, 1, 8, 16).unbind(0)
    for _ in range(2):
        first = prepared.get((cos, sin), 8, "half_width")
    cos.data = cos.data.double()
    again = prepared.get((cos, sin), 8, "half_width")
    assert again[0].dtype == torch.float64 and again[0] is not first[0]
    cos.data = torch.ones(1, 8, 16)  # another address, same dtype
    assert torch.equal(prepared.get((cos, sin), 8, "half_width")[0], torch.ones(8, 32))

    cos, sin = torch.randn(2, 1, 8, 16).unbind(0)
    with torch.inference_mode():
        for _ in range(2):
            _rotation._tables((cos, sin), 8, "half_width")
    tables = _rotation._tables((cos, sin), 8, "half_width")
    assert not tables[0].is_inference()


@needs_v4
def test_deepseek_v4_inverse_call_and_fallbacks(device, rope_tensors):
    """The output's inverse rotation ``f(o, cos, -sin)`` is mlarope's ``inverse=True`` rotation
    by ``(cos, sin)``, bit for bit (negating a table is exact); calls mlarope cannot take go to
    transformers' function unchanged: a rope width of 48, tables that require grad, a head
    narrower than its rotation."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

    original = v4.apply_rotary_pos_emb
    gen = torch.Generator().manual_seed(5)
    o = torch.randn(2, 3, 5, 16 + 64, generator=gen).to(device)
    angles = torch.rand(1, 5, 32, generator=gen, dtype=torch.float64).to(device) * 6
    cos, sin = angles.cos().float(), angles.sin().float()
    with mt.mlarope_patched(V4):
        got = v4.apply_rotary_pos_emb(o, cos, -sin)
        assert rope_tensors == [tuple(o.transpose(1, 2).shape)]
        ob = o.transpose(1, 2)
        inverse = mlarope.apply_rope_q(
            ob, torch.cat((cos[0], cos[0]), -1), torch.cat((sin[0], sin[0]), -1), layout="bshd",
            interleaved=True, interleaved_out=True, inverse=True,
        ).transpose(1, 2)  # fmt: skip
        assert torch.equal(got, inverse)
        rope_tensors.clear()
        wide = torch.randn(2, 3, 5, 16 + 48, generator=gen).to(device)
        narrow = torch.randn(2, 3, 5, 40, generator=gen).to(device)
        grad_cos = cos.clone().requires_grad_()
        for x, c in ((wide, cos[..., :24]), (narrow, cos), (o, grad_cos)):
            s = sin[..., : c.shape[-1]]
            if x is narrow:
                with pytest.raises(RuntimeError):  # transformers' own error
                    v4.apply_rotary_pos_emb(x, c, s)
                continue
            assert torch.equal(v4.apply_rotary_pos_emb(x, c, s), original(x, c, s))
        assert rope_tensors == []
    want = original(o, cos, -sin)  # fp32: within two fp32 units of the largest value
    assert float((got - want).abs().max()) <= 2 * U32 * float(want.abs().max())


@needs_v4
def test_deepseek_v4_rope_width_is_checked(device):
    """A model whose rope width mlarope does not rotate is refused up front (DeepSeek-V4's
    attention keeps no qk_rope_head_dim of its own: its config's is read)."""
    config_class = getattr(transformers, _patch.discovery().config_classes[V4])
    config = config_class(**{**BASE, **OVERRIDES[V4], "qk_rope_head_dim": 48, "head_dim": 64})
    model_class = getattr(transformers, modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[V4])
    with torch.device("meta"):
        model = model_class(config)
    with pytest.raises(ValueError, match="qk_rope_head_dim is 48"):
        mt.apply_mlarope(model)
    assert not mt.is_mlarope_applied(V4)


def test_kept_tables_of_sources_without_memory_are_made_each_call():
    """Sources without memory (batched tensors under ``torch.func.vmap``) have no address to
    key kept tables on: their tables are made for the call (``data_ptr`` raised there)."""
    prepared = _rotation._Prepared()
    cos, sin = torch.randn(2, 3, 1, 8, 16).unbind(0)

    def tables(c, s):
        return prepared.get((c, s), 8, "half_width")[0]

    got = torch.func.vmap(tables)(cos, sin)
    want = torch.stack([tables(c, s) for c, s in zip(cos, sin, strict=True)])
    assert torch.equal(got, want)
