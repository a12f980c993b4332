"""The attention-level path (``apply_mlarope_attention``): a DeepSeek-structured MLA
attention's glue around RoPE fused, against transformers itself.

Oracles and tolerances as in ``tests/deepseek_harness.py`` (its tiny DeepSeek-V3 models and
its rounding-noise bound: a fused run and transformers' are two fp32 evaluations of the same
network, each within the network's own measured fp32 error of the float64 model, so they differ
by at most about twice that; a wrong layout or a missing norm is O(1)). The copies are counted
at PyTorch's dispatcher (``TorchDispatchMode``): the concatenations and copies transformers'
attention makes around RoPE, which the fused path must not make; what mlarope's own ops do
inside is their kernels (on the GPU the profile of ``benchmarks/transformers_models.py`` counts
copy kernels).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("transformers")

from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3

import mlarope
from mlarope.integrations import transformers as mt
from tests.deepseek_harness import (
    BATCH,
    SEQ,
    needs_v2,
    needs_v32,
    noise_bounds,
    run_model,
    v2_model,
    v3_model,
    v32_model,
)  # fmt: skip


@pytest.fixture(autouse=True)
def _revert():
    yield
    for model in list(mt._ATTENTION_HOLDS):
        mt.revert_mlarope_attention(model)
    mt.revert_mlarope_all()


@pytest.fixture
def op_calls(monkeypatch):
    """How often each mlarope op of the fused path runs."""
    calls = {"apply_rope_q": 0, "rmsnorm_rope_latent": 0, "apply_rope_kv": 0}
    for name in calls:
        real = getattr(mlarope, name)

        def counting(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(mlarope, name, counting)
    return calls


def _fused_against_transformers(device, model, op_calls):
    """Fuse ``model`` and a float64 copy and check both against transformers: the logits and
    every parameter's gradient within the rounding-noise bound (``noise_bounds``: the fp32
    model's own measured error, doubled). The float64 model fused runs mlarope's PyTorch
    reference; transformers' RMSNorm computes in fp32 even there (its forward casts), the latent
    op in the input's precision, so the float64 models differ by the norm's fp32 rounding: the
    fp32 bound. Returns the outcome report and the op calls of the fused fp32 run."""
    model64 = copy.deepcopy(model).double()
    ids = torch.randint(0, 64, (BATCH, SEQ), device=device)
    orig32, orig64 = run_model(model, ids, None), run_model(model64, ids, None)
    bounds = noise_bounds(orig32, orig64)
    report = mt.apply_mlarope_attention(model)
    for name in op_calls:
        op_calls[name] = 0  # the probe's calls
    fused = run_model(model, ids, None)
    calls = dict(op_calls)
    assert fused.keys() == orig32.keys()
    for name, bound in bounds.items():
        err = float((fused[name].double() - orig32[name].double()).abs().max())
        assert err <= bound, f"{name}: {err:.3e} > {bound:.3e}"
    mt.apply_mlarope_attention(model64)
    fused64 = run_model(model64, ids, None)
    for name, bound in bounds.items():
        err = float((fused64[name] - orig64[name]).abs().max())
        assert err <= bound, f"float64 {name}: {err:.3e} > {bound:.3e}"
    return report, calls


@pytest.mark.parametrize(
    "rope_interleave, heads, q_lora_rank", [(True, 3, 32), (False, 4, None)],
    ids=["interleave-q_lora", "half_split-q_proj"],
)  # fmt: skip
def test_fused_model_matches_transformers(device, op_calls, rope_interleave, heads, q_lora_rank):
    model = v3_model(device, rope_interleave=rope_interleave, heads=heads, q_lora_rank=q_lora_rank)
    report, calls = _fused_against_transformers(device, model, op_calls)
    assert report == {"DeepseekV3Attention": "fused"}
    assert calls == {"apply_rope_q": 2, "rmsnorm_rope_latent": 2, "apply_rope_kv": 2}
    mt.revert_mlarope_attention(model)
    assert all("forward" not in m.__dict__ for m in model.modules())


class _CopyCounter(TorchDispatchMode):
    """Counts concatenations and copies whose result has one of ``sizes`` elements."""

    OPS = ("aten.cat", "aten.copy_", "aten.clone", "aten._to_copy")

    def __init__(self, sizes):
        super().__init__()
        self.sizes, self.seen = set(sizes), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        if (
            name.startswith(self.OPS)
            and isinstance(out, torch.Tensor)
            and out.numel() in self.sizes
        ):
            self.seen.append(name)
        return out


class _LayoutKeepingAttention(torch.autograd.Function):
    """A stand-in for the attention kernel with the layout contract of the GPU's flash and
    memory-efficient attention: its gradients are allocated like its inputs (``empty_like``),
    whatever their strides, so the copies counted are the glue's, not the attention backend's
    (on the CPU, SDPA's math path returns gradients in its own layout). It computes
    ``sum(q * k, -1) * v``: a function of every element of q, k and v."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return (q * k).sum(-1, keepdim=True) * v

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        through_v = (grad * v).sum(-1, keepdim=True)
        dq = torch.mul(k, through_v, out=torch.empty_like(q))
        dk = torch.mul(q, through_v, out=torch.empty_like(k))
        dv = torch.mul(grad, (q * k).sum(-1, keepdim=True), out=torch.empty_like(v))
        return dq, dk, dv


def _layout_keeping_attention(module, query, key, value, attention_mask, **kwargs):
    return _LayoutKeepingAttention.apply(query, key, value).transpose(1, 2), None


def _one_layer_copies(device, fuse, make_model=None):
    from transformers import AttentionInterface

    AttentionInterface.register("mlarope_test_layout_keeping", _layout_keeping_attention)
    if make_model is None:
        model = v3_model(device, rope_interleave=True, heads=4, q_lora_rank=32)
    else:
        model = make_model(device)
    model.config._attn_implementation = "mlarope_test_layout_keeping"
    if fuse:
        assert all(
            "fused" in v and "not fused" not in v
            for v in mt.apply_mlarope_attention(model).values()
        )
    layer = model.model.layers[0].self_attn
    config = model.config
    x = torch.randn(BATCH, SEQ, config.hidden_size, device=device, requires_grad=True)
    positions = torch.arange(SEQ, device=device)[None]
    embeddings = model.model.rotary_emb(x, positions)
    heads, head = config.num_attention_heads, config.qk_nope_head_dim + config.qk_rope_head_dim
    q_or_k = BATCH * SEQ * heads * head
    above = torch.ones(SEQ, SEQ, dtype=torch.bool, device=device).triu(1)
    causal = torch.zeros(BATCH, 1, SEQ, SEQ, device=device).masked_fill(above, float("-inf"))
    with _CopyCounter({q_or_k}) as counter:
        # by keyword, as transformers' decoder layers call it (the families order them apart)
        out = layer(hidden_states=x, position_embeddings=embeddings, attention_mask=causal)[0]
        out.sum().backward()
    return counter.seen


def test_the_fused_layer_makes_no_q_or_k_sized_copy(device):
    """transformers' DeepSeek-V3 attention concatenates the query and assembles the key in a
    new tensor, and its backward assembles the query's gradient: the probe sees those (5 with
    transformers 5.25); the fused layer makes none, forward or backward."""
    unfused = _one_layer_copies(device, fuse=False)
    assert unfused.count("aten.cat") >= 2, unfused  # the probe sees transformers' copies
    assert _one_layer_copies(device, fuse=True) == []


@needs_v2
def test_a_fused_v2_model_matches_transformers(device, op_calls):
    """DeepSeek-V2 hands its attention complex ``freqs_cis`` (not ``(cos, sin)``) and orders its
    forward's parameters otherwise: the probe finds the form its forward takes, the fused
    layer rotates interleaved in and out as V2's complex product does, and the model's
    logits and every gradient are transformers' within the rounding-noise bound (fp32; the
    float64 model through the reference); no q- or k-sized copy is made."""
    model = v2_model(device)
    report, calls = _fused_against_transformers(device, model, op_calls)
    assert report == {"DeepseekV2Attention": "fused"}
    assert calls == {"apply_rope_q": 2, "rmsnorm_rope_latent": 2, "apply_rope_kv": 2}
    mt.revert_mlarope_attention(model)

    unfused = _one_layer_copies(device, fuse=False, make_model=v2_model)
    assert unfused.count("aten.cat") >= 1, unfused
    assert _one_layer_copies(device, fuse=True, make_model=v2_model) == []


@needs_v2
def test_a_fused_v2_layer_takes_positional_arguments_in_its_own_order(device, op_calls):
    """V2's forward is ``(hidden_states, attention_mask, cache, position_embeddings)``, V3's
    ``(hidden_states, position_embeddings, attention_mask, ...)``: a positional call reaches
    the fused path by V2's order, and the result is the layer's own within rounding; a call
    that does not bind goes to the layer's own forward, which raises as it would."""
    model = v2_model(device).eval()
    layer = model.model.layers[0].self_attn
    x = torch.randn(1, 5, model.config.hidden_size, device=device)
    freqs = model.model.rotary_emb(x, torch.arange(5, device=device)[None])
    with torch.no_grad():
        want = layer(x, None, None, freqs)[0]
        mt.apply_mlarope_attention(model)
        before = op_calls["apply_rope_q"]
        got = layer(x, None, None, freqs)[0]
    assert op_calls["apply_rope_q"] == before + 1
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)
    with pytest.raises(TypeError, match="multiple values"):
        layer(x, None, hidden_states=x, position_embeddings=freqs)


@needs_v32
def test_a_dsa_layer_has_its_key_and_value_fused(device, op_calls):
    """DeepSeek-V3.2's attention runs a DSA indexer whose top-k mask the fused forward does not
    compute, and a probe of five tokens cannot see it (its top-k keeps every token): such a
    layer is never fused whole (a submodule with parameters the fused forward would not run).
    Its ``expand_kv`` is: the key and value come from the key/value op, and with the indexer's
    mask in force (``index_topk < SEQ``) the model's logits and every gradient are
    transformers' within the rounding-noise bound (fp32 and float64); its forward and backward
    assemble no key (the query's glue stays)."""
    model = v32_model(device)
    report, calls = _fused_against_transformers(device, model, op_calls)
    assert report == {
        "DeepseekV32Attention": (
            "key and value fused; the whole forward not: the fused forward would not run indexer"
        )
    }
    assert calls["apply_rope_kv"] == 2 and calls["rmsnorm_rope_latent"] == 0, calls
    mt.revert_mlarope_attention(model)
    assert all("expand_kv" not in m.__dict__ for m in model.modules())

    unfused = _one_layer_copies(device, fuse=False, make_model=v32_model)
    fused_copies = _one_layer_copies(device, fuse=True, make_model=v32_model)
    # The key's assembly (two copy_) is gone; the query's glue stays (its concatenation, the
    # split's backward, the gradient's layout copy): the whole forward is not fused.
    assert unfused.count("aten.copy_") == 2, unfused
    assert fused_copies == [c for c in unfused if c != "aten.copy_"], (fused_copies, unfused)


@needs_v32
def test_a_dsa_layer_is_not_fused_whole_even_where_the_probe_agrees(device):
    """A probe of five tokens need not see the indexer's mask: a DeepSeek-V3.2 layer rotating
    interleaved with ``index_topk = 6`` passes the whole forward's probe (its top-k keeps all
    five tokens), and fused whole its logits at 12 tokens were 0.21 off (found by review, with
    the structure rule removed). The rule (a parameterised submodule the fused forward would
    not run) refuses before the probe; the key and value alone are fused, and the model is
    transformers' where the indexer masks."""
    from mlarope.integrations.transformers import _attention

    model = v32_model(device, index_topk=6)
    model.config.rope_interleave = True
    layer = model.model.layers[0].self_attn
    assert _attention._probe_whole(layer, layer.forward) == ("cos_sin",)  # the blind spot
    ids = torch.randint(3, 60, (1, 12), device=device)
    want = model(ids).logits
    (verdict,) = mt.apply_mlarope_attention(model).values()
    assert verdict == (
        "key and value fused; the whole forward not: the fused forward would not run indexer"
    ), verdict
    got = model(ids).logits
    assert float((got - want).detach().norm() / want.detach().norm()) < 1e-5


@needs_v32
def test_the_key_value_path_under_autocast(device):
    """Under ``torch.autocast`` ``kv_b_proj`` gives bf16 while ``k_rot``, rotated by fp32
    tables, is fp32: the key takes the key's dtype, as transformers' ``copy_`` into it casts
    (found by review: the key/value op refused the mixed dtypes); ``expand_kv`` itself, with
    each mixed pair, gives transformers' dtypes and values exactly."""
    from mlarope.integrations.transformers import _attention

    model = v32_model(device)
    ids = torch.randint(3, 60, (2, 8), device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        want = model(ids).logits
        assert mt.apply_mlarope_attention(model)["DeepseekV32Attention"].startswith("key and")
        got = model(ids).logits
    assert float((got - want).float().detach().norm() / want.float().detach().norm()) < 2.0**-6
    layer = model.model.layers[0].self_attn
    pairs = [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)]
    for kv_dtype, rot_dtype in pairs:
        layer.to(kv_dtype)
        kv_nope = torch.randn(2, 1, 7, 32, dtype=kv_dtype, device=device)
        k_rot = torch.randn(2, 1, 7, 32, dtype=rot_dtype, device=device)
        theirs = type(layer).expand_kv(layer, kv_nope, k_rot)
        ours = _attention.fused_expand_kv(layer, layer.expand_kv, kv_nope, k_rot)
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@needs_v32
def test_a_layer_with_an_expand_kv_of_its_own_keeps_it(device):
    """A wrapper set on one layer's ``expand_kv`` is neither replaced nor removed by revert, in
    either order of fusing a clean model and the wrapped one (found by review: the refusal was
    cached with the class's verdict, so the order decided), and the report says which layers
    of the class ended how."""
    clean = v32_model(device)
    wrapped = v32_model(device)
    layer = wrapped.model.layers[0].self_attn
    inner = layer.expand_kv

    def scaled(kv_nope, k_rot):
        k, v = inner(kv_nope, k_rot)
        return k, 1.5 * v

    layer.expand_kv = scaled
    for first, second in ((clean, wrapped), (wrapped, clean)):
        mt.apply_mlarope_attention(first)
        mt.apply_mlarope_attention(second)
        assert layer.expand_kv is scaled
        assert "expand_kv" in clean.model.layers[0].self_attn.__dict__  # fused
        (report,) = mt.apply_mlarope_attention(wrapped).values()
        assert report.startswith("1 layer: not fused:") and "an expand_kv of its own" in report
        assert "| 1 layer: key and value fused" in report, report
        mt.revert_mlarope_attention(first)
        mt.revert_mlarope_attention(second)
        assert layer.expand_kv is scaled


@pytest.mark.parametrize(
    "make_model",
    [pytest.param(v2_model, marks=needs_v2), pytest.param(v32_model, marks=needs_v32)],
    ids=["v2", "v32-key_value"],
)
def test_decoding_with_a_kv_cache_v2_and_key_value_only(device, op_calls, make_model):
    """Greedy decoding with a KV cache gives transformers' tokens for the fused V2 layer and for
    a key/value-only DSA layer, the key/value op running at every step."""
    model = make_model(device).eval()
    ids = torch.randint(3, 60, (1, 5), device=device)
    greedy = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    want = model.generate(ids, **greedy)
    mt.apply_mlarope_attention(model)
    op_calls["apply_rope_kv"] = 0  # the probe's calls
    assert torch.equal(model.generate(ids, **greedy), want)
    assert op_calls["apply_rope_kv"] == 8  # 4 forwards x 2 layers


def test_a_class_that_computes_otherwise_keeps_its_forward(device):
    """Found by what it computes: an attention of the same structure whose forward scales its
    output keeps its forward, with the reason (its ``expand_kv`` is fused: the probe of that
    alone agrees), and the model computes what it did."""

    class Scaled(hf_v3.DeepseekV3Attention):
        def forward(self, *args, **kwargs):
            out, weights = super().forward(*args, **kwargs)
            return 1.5 * out, weights

    model = v3_model(device, rope_interleave=True)
    for layer in model.model.layers:
        layer.self_attn.__class__ = Scaled
    ids = torch.randint(0, 64, (BATCH, SEQ), device=device)
    want = model(ids).logits
    (verdict,) = mt.apply_mlarope_attention(model).values()
    # The whole forward is not fused; its expand_kv, which the subclass keeps, is.
    assert verdict.startswith(
        "key and value fused; the whole forward not: the fused forward differs"
    ), verdict
    assert all("forward" not in m.__dict__ for m in model.modules())
    torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-6)


def test_decoding_with_a_kv_cache_runs_the_fused_path(device, op_calls):
    """Generation with a KV cache: the fused layer keeps the latent and the rotated k_pe in the
    cache, as transformers' does, and makes its key and value from every cached token; greedy
    decoding gives the same tokens, every step through mlarope's ops."""
    model = v3_model(device, rope_interleave=True).eval()
    ids = torch.randint(3, 60, (1, 5), device=device)
    greedy = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    want = model.generate(ids, **greedy)
    mt.apply_mlarope_attention(model)
    for name in op_calls:
        op_calls[name] = 0  # the probe's calls
    assert torch.equal(model.generate(ids, **greedy), want)
    # 4 forwards (the prompt, then 3 decode steps) x 2 layers
    assert op_calls == {"apply_rope_q": 8, "rmsnorm_rope_latent": 8, "apply_rope_kv": 8}


def test_a_layer_with_a_forward_of_its_own_is_not_fused(device):
    """A layer whose forward somebody wrapped (an instance attribute) is left as it is: the
    class's verdict does not say what the wrapper computes (found by review: it was fused,
    and the wrapper's scaling lost)."""
    model = v3_model(device, rope_interleave=True)
    layer = model.model.layers[1].self_attn
    inner = layer.forward

    def scaled(*args, **kwargs):
        out, weights = inner(*args, **kwargs)
        return 1.5 * out, weights

    layer.forward = scaled
    mt.apply_mlarope_attention(model)
    assert "_mlarope_unfused_forward" in model.model.layers[0].self_attn.__dict__
    assert layer.forward is scaled
    mt.revert_mlarope_attention(model)
    assert layer.forward is scaled


def test_the_probe_runs_in_eval_mode_and_leaves_the_rng(device):
    """A training model with attention dropout is fused (the probe runs without dropout), is
    left in training mode, and the global random stream is where it was."""
    model = v3_model(device, rope_interleave=True).train()
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    state = torch.random.get_rng_state()
    assert mt.apply_mlarope_attention(model) == {"DeepseekV3Attention": "fused"}
    assert model.training and torch.equal(torch.random.get_rng_state(), state)


def test_a_fused_model_trains_after_an_inference_mode_forward(device):
    """The identity tables are never inference tensors (found by review: made first under
    torch.inference_mode, a later training step could not save them)."""
    from mlarope.integrations.transformers import _attention

    model = v3_model(device, rope_interleave=True)
    mt.apply_mlarope_attention(model)
    _attention._IDENTITY.clear()
    ids = torch.randint(3, 60, (1, 6), device=device)
    with torch.inference_mode():
        model(ids)
    model(ids, labels=ids).loss.backward()


def test_each_fused_model_holds_the_patch(device):
    """Two fused models: reverting one leaves the other's rotary functions patched (found by
    review: the first revert unpatched the family for the whole process)."""
    first = v3_model(device, rope_interleave=True)
    second = v3_model(device, rope_interleave=True)
    mt.apply_mlarope_attention(first)
    mt.apply_mlarope_attention(second)
    mt.revert_mlarope_attention(first)
    assert mt.is_mlarope_applied("deepseek_v3")
    mt.revert_mlarope_attention(second)
    assert not mt.is_mlarope_applied("deepseek_v3")
    # a fused model that is freed releases its hold
    mt.apply_mlarope_attention(first)
    del first
    import gc

    gc.collect()
    assert not mt.is_mlarope_applied("deepseek_v3")


def test_a_model_without_mla_attention_is_left_alone():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert mt.apply_mlarope_attention(model) == {}
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        mt.apply_mlarope_attention("deepseek_v3")


def test_a_bf16_model_is_fused(device):
    """The probe hands the layer tables in its own dtype, as transformers' rotary embedding
    does (with fp32 tables a bf16 layer's own forward promoted its query to fp32, and the probe
    refused every bf16 model: found on the H200)."""
    model = v3_model(device, rope_interleave=True).to(torch.bfloat16)
    model.config._attn_implementation = "sdpa"
    assert mt.apply_mlarope_attention(model) == {"DeepseekV3Attention": "fused"}


def test_a_fused_layer_compiles_whole(device, op_calls):
    """``torch.compile(fullgraph=True)`` of a fused attention layer (the whole model does not
    compile whole: transformers' MoE loops over the experts it hits): one graph, the values and
    gradients of the eager fused layer bit for bit."""
    from benchmarks.transformers_layers import _fresh, build

    config, attention, _, _, kwargs, _ = build("deepseek_v3", device, 16, tiny=True)
    attention = attention.float()
    kwargs = {k: tuple(t.float() for t in v) if isinstance(v, tuple) else v
              for k, v in kwargs.items()}  # fmt: skip
    assert mt.apply_mlarope_attention(attention) == {"DeepseekV3Attention": "fused"}
    x = torch.randn(1, 16, config.get_text_config().hidden_size, device=device)
    g = torch.randn(1, 16, config.get_text_config().hidden_size, device=device)
    results = []
    for layer in (attention, torch.compile(attention, fullgraph=True, backend="aot_eager")):
        for p in attention.parameters():
            p.grad = None
        xx = x.clone().requires_grad_(True)
        before = dict(op_calls)
        out = layer(**_fresh(kwargs, xx))[0]
        assert op_calls["rmsnorm_rope_latent"] > before["rmsnorm_rope_latent"], "fused path"
        out.backward(g)
        grads = [xx.grad] + [p.grad for p in attention.parameters() if p.grad is not None]
        results.append((out.detach(), grads))
    (eager, eager_grads), (compiled, compiled_grads) = results
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    assert len(compiled_grads) == len(eager_grads)
    for a, b in zip(compiled_grads, eager_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_layer_whose_forward_needs_position_ids_is_left_alone(device):
    """Mistral4 scales its query by position past ``original_max_position_embeddings``: a probe
    at positions 0-4 would pass a whole fused forward without the scale, so the probe passes no
    ``position_ids`` and a forward that needs them keeps its own (docs/transformers.md)."""
    from benchmarks.transformers_layers import build

    try:
        _, attention, *_ = build("mistral4", device, 8, tiny=True)
    except (KeyError, ImportError, ValueError) as exc:  # a transformers without Mistral4
        pytest.skip(f"no Mistral4 model here: {exc}")
    (verdict,) = mt.apply_mlarope_attention(attention).values()
    assert verdict.startswith("not fused:") and "position_ids" in verdict, verdict
    assert all("forward" not in m.__dict__ and "expand_kv" not in m.__dict__
               for m in attention.modules())  # fmt: skip
