"""mlarope.integrations.megatron: the one-call patch of Megatron-Core's MLA attention.

Two parts:

- The patch's mechanics (what is replaced and restored, reference counting under a lock, the
  self-check, the rounding switch), against a stand-in Megatron-Core package put into
  ``sys.modules`` for each test: the CPU lane has no Megatron-Core. The stand-in's unfused
  rotation (the self-check's reference) is written here from Megatron-Core's
  ``rope_utils._apply_rotary_pos_emb_bshd`` with MLA interleaving.
- Megatron-Core's own ``MLASelfAttention`` built from a ``MLATransformerConfig`` (DeepSeek-V3's
  head dims, scaled down), with the patch, against its unfused path (``apply_rope_fusion=False``),
  sbhd and thd. These need a Megatron-LM checkout named by ``MEGATRON_LM`` (the GPU lane's
  ``megatron_tests`` step sets it); without one they are skipped.

Megatron-Core's local (non-TransformerEngine) spec cannot build MLA: its ``DotProductAttention``
takes no ``k_channels`` / ``v_channels`` (and no packed sequences), and the GPU lane has no
TransformerEngine. So the layer is built from the local spec with the core attention replaced by
a plain PyTorch causal attention (``TorchCoreAttention``); everything that computes the queries
and keys, the tables and the RoPE calls is Megatron-Core's own code. The builder is
``benchmarks/megatron_layer.py``, shared with the layer benchmark
(``benchmarks/megatron_layers.py``, whose CPU smoke runs here too).
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import sys
import threading
import types

import pytest
import torch

from benchmarks import megatron_layer
from mlarope.compat import megatron as compat
from mlarope.integrations import megatron as integration

MLA = "megatron.core.transformer.multi_latent_attention"
ABSORBED = "megatron.core.transformer.experimental_attention_variant.absorbed_mla"
ROPE_UTILS = "megatron.core.models.common.embeddings.rope_utils"


@pytest.fixture(autouse=True)
def _nothing_applied_after():
    yield
    while integration._STATE.count:
        integration.revert_mlarope_megatron()


# ---------------------------------------------------------------------------------------------
# a stand-in Megatron-Core
# ---------------------------------------------------------------------------------------------


def megatron_unfused(t, freqs, rotary_interleaved=False, mla_rotary_interleaved=False, mscale=1.0,
                     inverse=False, mla_output_remove_interleaving=False):  # fmt: skip
    """Megatron-Core's unfused rotation with MLA interleaving: read pairs ``(t[2j], t[2j+1])``,
    de-interleave them into halves, ``t * cos + rotate_half(t) * sin``, halves out."""
    if mla_rotary_interleaved:
        t = torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)
    half = t.shape[-1] // 2
    cos, sin = mscale * freqs.cos(), mscale * freqs.sin()
    return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin


def _q_original(t, cos, sin, qk_head_dim, emb_dim, cu_seqlens_q=None, cp_rank=0, cp_size=1,
                rotary_interleaved=False):  # fmt: skip
    raise AssertionError("Megatron-Core's query function was called")


def _kv_original(kv, k_pos_emb, cos, sin, emb_dim, k_dim, v_dim, cu_seqlens_kv=None, cp_rank=0,
                 cp_size=1, rotary_interleaved=False):  # fmt: skip
    raise AssertionError("Megatron-Core's key/value function was called")


def _inplace_original(t, cos, sin, nope_dim, emb_dim, cu_seqlens_q=None, cp_rank=0, cp_size=1,
                      rotary_interleaved=False, inverse=False, remove_interleaving=False,
                      position_ids=None):  # fmt: skip
    raise AssertionError("Megatron-Core's in-place function was called")


def install_fake_megatron(monkeypatch, *, absorbed=True, unfused=megatron_unfused, **bound):
    """A stand-in Megatron-Core in ``sys.modules``: the MLA module binds the two legacy fused
    functions (or ``bound``), the absorbed variant the same (when ``absorbed``), and rope_utils
    the unfused rotation. Returns the MLA module and the absorbed one (or None)."""
    names = {"fused_apply_mla_rope_for_q": _q_original, "fused_apply_mla_rope_for_kv": _kv_original}
    names.update(bound)
    packages = [
        "megatron",
        "megatron.core",
        "megatron.core.transformer",
        "megatron.core.transformer.experimental_attention_variant",
        "megatron.core.models",
        "megatron.core.models.common",
        "megatron.core.models.common.embeddings",
    ]
    modules = {name: types.ModuleType(name) for name in packages}
    modules[MLA] = types.ModuleType(MLA)
    if absorbed:
        modules[ABSORBED] = types.ModuleType(ABSORBED)
    modules[ROPE_UTILS] = types.ModuleType(ROPE_UTILS)
    modules[ROPE_UTILS]._apply_rotary_pos_emb_bshd = unfused
    for name, module in modules.items():
        if name in (MLA, ABSORBED):
            for attr, value in names.items():
                setattr(module, attr, value)
        parent, _, child = name.rpartition(".")
        if parent in modules:
            setattr(modules[parent], child, module)
    if not absorbed:  # an older Megatron-Core without the variant: importing it fails
        monkeypatch.setitem(sys.modules, ABSORBED, None)
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return modules[MLA], modules.get(ABSORBED)


# ---------------------------------------------------------------------------------------------
# the patch's mechanics
# ---------------------------------------------------------------------------------------------


def test_apply_and_revert(monkeypatch):
    mla, absorbed = install_fake_megatron(monkeypatch, fused_mla_rope_inplace=_inplace_original)
    assert not integration.is_mlarope_applied_to_megatron()
    integration.apply_mlarope_to_megatron()
    assert integration.is_mlarope_applied_to_megatron()
    for module in (mla, absorbed):
        assert module.fused_apply_mla_rope_for_q is compat.fused_apply_mla_rope_for_q
        assert module.fused_mla_rope_inplace is compat.fused_mla_rope_inplace
        kv = module.fused_apply_mla_rope_for_kv
        assert kv.func is compat.fused_apply_mla_rope_for_kv
        assert kv.keywords == {"rounding": "megatron"}
        assert kv.__wrapped__ is compat.fused_apply_mla_rope_for_kv
        assert not hasattr(module, "fused_mla_rope_kv_split")  # not bound there: not added
    integration.revert_mlarope_megatron()
    assert not integration.is_mlarope_applied_to_megatron()
    for module in (mla, absorbed):
        assert module.fused_apply_mla_rope_for_q is _q_original
        assert module.fused_apply_mla_rope_for_kv is _kv_original
        assert module.fused_mla_rope_inplace is _inplace_original
    integration.revert_mlarope_megatron()  # nothing applied: a no-op
    assert mla.fused_apply_mla_rope_for_q is _q_original


def test_reference_counted(monkeypatch):
    mla, _ = install_fake_megatron(monkeypatch)
    integration.apply_mlarope_to_megatron()
    with integration.mlarope_patched():
        integration.apply_mlarope_to_megatron()
        integration.revert_mlarope_megatron()
        assert integration.is_mlarope_applied_to_megatron()
    assert integration.is_mlarope_applied_to_megatron()  # the first apply still holds it
    integration.revert_mlarope_megatron()
    assert mla.fused_apply_mla_rope_for_q is _q_original
    assert integration._STATE.count == 0 and not integration._STATE.active


def test_apply_and_revert_from_many_threads(monkeypatch):
    """Applies and reverts racing from several threads leave the count exact: once every
    thread has reverted what it applied, Megatron-Core's functions are back."""
    mla, _ = install_fake_megatron(monkeypatch)
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def work():
        try:
            start.wait()
            for _ in range(25):
                integration.apply_mlarope_to_megatron()
                assert mla.fused_apply_mla_rope_for_q is compat.fused_apply_mla_rope_for_q
                integration.revert_mlarope_megatron()
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert integration._STATE.count == 0
    assert mla.fused_apply_mla_rope_for_q is _q_original


def test_rounding_switch(monkeypatch):
    mla, _ = install_fake_megatron(monkeypatch)
    integration.apply_mlarope_to_megatron(rounding="exact")
    assert mla.fused_apply_mla_rope_for_kv.keywords == {"rounding": "exact"}
    with pytest.raises(ValueError, match=r"already applied .* rounding='exact'"):
        integration.apply_mlarope_to_megatron()
    assert integration._STATE.count == 1
    integration.revert_mlarope_megatron()
    with pytest.raises(ValueError, match="rounding must be one of"):
        integration.apply_mlarope_to_megatron(rounding="bf16")
    with pytest.raises(TypeError, match="rounding must be a str"):
        integration.apply_mlarope_to_megatron(rounding=None)
    assert mla.fused_apply_mla_rope_for_kv is _kv_original


def test_names_bound_to_none_are_replaced_and_restored(monkeypatch):
    """Megatron binds None when its fused module failed to import (no Triton): the patch makes
    the fused path work, and the revert puts None back."""
    mla, _ = install_fake_megatron(
        monkeypatch, fused_apply_mla_rope_for_q=None, fused_apply_mla_rope_for_kv=None
    )
    integration.apply_mlarope_to_megatron()
    assert mla.fused_apply_mla_rope_for_q is compat.fused_apply_mla_rope_for_q
    integration.revert_mlarope_megatron()
    assert mla.fused_apply_mla_rope_for_q is None and mla.fused_apply_mla_rope_for_kv is None


def test_absorbed_variant_is_optional(monkeypatch):
    mla, absorbed = install_fake_megatron(monkeypatch, absorbed=False)
    assert absorbed is None
    integration.apply_mlarope_to_megatron()
    assert mla.fused_apply_mla_rope_for_q is compat.fused_apply_mla_rope_for_q
    assert {m for m, _ in integration._STATE.active} == {MLA}


def test_without_megatron_core(monkeypatch):
    monkeypatch.setitem(sys.modules, MLA, None)
    with pytest.raises(ImportError, match="Megatron-Core"):
        integration.apply_mlarope_to_megatron()
    assert integration._STATE.count == 0


def test_self_check_refuses_other_semantics(monkeypatch):
    """A Megatron-Core whose unfused rotation differs (here: pairs not de-interleaved) is
    refused, and nothing is patched."""

    def halves_in(t, freqs, mla_rotary_interleaved=False, mscale=1.0, **kwargs):
        return megatron_unfused(t, freqs, mscale=mscale)

    mla, _ = install_fake_megatron(monkeypatch, unfused=halves_in)
    with pytest.raises(RuntimeError, match="disagrees with Megatron-Core's unfused"):
        integration.apply_mlarope_to_megatron()
    assert mla.fused_apply_mla_rope_for_q is _q_original
    assert integration._STATE.count == 0 and not integration._STATE.active


def test_released_megatron_core_names_the_mla_flag_multi_latent_attention(monkeypatch):
    """megatron-core 0.16 (the release on PyPI) calls the MLA interleaving flag of
    ``_apply_rotary_pos_emb_bshd`` ``multi_latent_attention``; Megatron-LM's main branch renamed
    it ``mla_rotary_interleaved``. The self-check passes whichever the installed one takes (it
    refused every released megatron-core with a TypeError)."""

    def released(t, freqs, rotary_interleaved=False, multi_latent_attention=False, mscale=1.0):
        return megatron_unfused(t, freqs, rotary_interleaved, multi_latent_attention, mscale)

    mla, _ = install_fake_megatron(monkeypatch, unfused=released)
    with integration.mlarope_patched():
        assert mla.fused_apply_mla_rope_for_q is compat.fused_apply_mla_rope_for_q
    assert mla.fused_apply_mla_rope_for_q is _q_original


def test_self_check_passes_the_current_flag_name_through_a_keyword_wrapper(monkeypatch):
    @functools.wraps(megatron_unfused, assigned=())  # no __wrapped__: (*args, **kwargs)
    def wrapper(*args, **kwargs):
        return megatron_unfused(*args, **kwargs)

    mla, _ = install_fake_megatron(monkeypatch, unfused=wrapper)
    with integration.mlarope_patched():
        assert mla.fused_apply_mla_rope_for_q is compat.fused_apply_mla_rope_for_q


def test_self_check_refuses_an_unfused_rotation_without_the_mla_flag(monkeypatch):
    def no_flag(t, freqs, rotary_interleaved=False, mscale=1.0):
        return megatron_unfused(t, freqs, rotary_interleaved, mscale=mscale)

    mla, _ = install_fake_megatron(monkeypatch, unfused=no_flag)
    with pytest.raises(RuntimeError, match="takes neither mla_rotary_interleaved nor multi_lat"):
        integration.apply_mlarope_to_megatron()
    assert mla.fused_apply_mla_rope_for_q is _q_original
    assert integration._STATE.count == 0


def test_self_check_refuses_other_signatures(monkeypatch):
    """Megatron's callers pass the arguments positionally: another order is refused."""

    def reordered(t, cos, sin, emb_dim, qk_head_dim, cu_seqlens_q=None, cp_rank=0, cp_size=1,
                  rotary_interleaved=False):  # fmt: skip
        raise AssertionError

    mla, _ = install_fake_megatron(monkeypatch, fused_apply_mla_rope_for_q=reordered)
    with pytest.raises(RuntimeError, match=r"takes .*emb_dim, qk_head_dim"):
        integration.apply_mlarope_to_megatron()
    assert mla.fused_apply_mla_rope_for_kv is _kv_original
    assert integration._STATE.count == 0


def test_revert_leaves_a_later_replacement(monkeypatch):
    mla, _ = install_fake_megatron(monkeypatch)
    integration.apply_mlarope_to_megatron()

    def someone_elses(*args):
        raise AssertionError

    mla.fused_apply_mla_rope_for_q = someone_elses
    assert not integration.is_mlarope_applied_to_megatron()
    with pytest.warns(RuntimeWarning, match="replaced by something else"):
        integration.revert_mlarope_megatron()
    assert mla.fused_apply_mla_rope_for_q is someone_elses
    assert mla.fused_apply_mla_rope_for_kv is _kv_original


def test_patched_functions_are_the_compat_ones(monkeypatch, device):
    """Called as multi_latent_attention.py calls them (positionally), the patched functions give
    what mlarope.compat.megatron gives, the key/value one with the chosen rounding."""
    mla, _ = install_fake_megatron(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    seq, batch, heads, k_dim, v_dim, rope = 4, 2, 3, 8, 6, 32
    cos = torch.rand(seq, 1, 1, rope, generator=gen).to(torch.bfloat16).to(device)
    sin = torch.rand(seq, 1, 1, rope, generator=gen).to(torch.bfloat16).to(device)
    kv0 = torch.randn(seq, batch, heads, k_dim + v_dim, generator=gen).to(torch.bfloat16)
    pe0 = torch.randn(seq, batch, 1, rope, generator=gen).to(torch.bfloat16)
    gk = (torch.randn(seq, batch, heads, k_dim + rope, generator=gen) * 64).round() / 64
    grads = {}
    for rounding in ("megatron", "exact"):
        with integration.mlarope_patched(rounding=rounding):
            for name, fn in (("patched", mla.fused_apply_mla_rope_for_kv),
                             ("compat", compat.fused_apply_mla_rope_for_kv)):  # fmt: skip
                kv = kv0.to(device).clone().requires_grad_()
                pe = pe0.to(device).clone().requires_grad_()
                if name == "patched":
                    key, _ = fn(kv, pe, cos, sin, rope, k_dim, v_dim, None, 0, 1)
                else:
                    key, _ = fn(kv, pe, cos, sin, rope, k_dim, v_dim, rounding=rounding)
                key.backward(gk.to(torch.bfloat16).to(device))
                grads[rounding, name] = pe.grad
    assert torch.equal(grads["megatron", "patched"], grads["megatron", "compat"])
    assert torch.equal(grads["exact", "patched"], grads["exact", "compat"])
    assert not torch.equal(grads["megatron", "patched"], grads["exact", "patched"])


# ---------------------------------------------------------------------------------------------
# Megatron-Core's MLA layer (needs a Megatron-LM checkout: MEGATRON_LM)
# ---------------------------------------------------------------------------------------------

U32 = 2.0**-24


def ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp at magnitude ``|x|`` (fp64)."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(2.0**-126))) - 7)


@pytest.fixture(scope="module")
def megatron_core():
    """Megatron-Core from the checkout ``MEGATRON_LM`` names, with a one-process
    model-parallel state (NCCL with a GPU, gloo without)."""
    path = os.environ.get("MEGATRON_LM")
    if not path:
        pytest.skip("needs a Megatron-LM checkout: MEGATRON_LM=path (gpu_lane.sh megatron_tests)")
    with megatron_layer.megatron_core(path):
        yield


WIDTHS = megatron_layer.SMALL
HIDDEN, HEADS, Q_LORA, KV_LORA = WIDTHS.hidden, WIDTHS.heads, WIDTHS.q_lora, WIDTHS.kv_lora
NOPE, ROPE, V_DIM = WIDTHS.nope, WIDTHS.rope, WIDTHS.v  # DeepSeek-V3's per-head dims
SEQ, BATCH, CU = 128, 2, [0, 37, 64, 128]


def build_mla(fusion: bool, dtype: torch.dtype, device):
    return megatron_layer.build_mla(fusion, dtype, device, WIDTHS)


def packed_params(layout: str, device):
    return None if layout == "sbhd" else megatron_layer.packed_seq_params(CU, device)


def positions(layout: str) -> torch.Tensor:
    """Table row of every token row (rows flattened as the layer flattens them)."""
    if layout == "sbhd":
        return torch.arange(SEQ).repeat_interleave(BATCH)
    return torch.cat([torch.arange(b - a) for a, b in itertools.pairwise(CU)])


@pytest.fixture
def layer_device(device, monkeypatch):
    """Megatron's YaRN module moves its frequencies to ``torch.cuda.current_device()``; on the
    CPU that is pointed at the CPU. The bitwise checks need round-to-nearest bf16, which
    Triton's interpreter does not do (it truncates): there, use the PyTorch backend
    (TRITON_INTERPRET=0)."""
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") == "1":
            pytest.skip("Triton's interpreter truncates fp32 -> bf16; run with --device cuda")
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    return device


class Recorder:
    """Forward hooks on the layer's projections: their inputs and outputs, and the gradients
    that reach those outputs (the tensors either side of the RoPE calls)."""

    def __init__(self, layer):
        self.saved: dict[str, torch.Tensor] = {}
        for name in ("linear_q_up_proj", "linear_kv_up_proj", "linear_kv_down_proj"):
            getattr(layer, name).register_forward_hook(self._hook(name))

    def _hook(self, name):
        def hook(module, inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            self.saved[f"{name}.in"] = inputs[0].detach().clone()
            self.saved[f"{name}.out"] = out.detach().clone()
            if out.requires_grad:
                out.register_hook(lambda g: self.saved.__setitem__(f"{name}.grad", g.clone()))

        return hook


def rotation_bounds(x_rope, cos, sin, pos, transpose: bool):
    """fp64 truth of the MLA rotation of ``x_rope: [M, H, R]`` (forward: interleaved pairs in,
    halves out; ``transpose``: halves in, pairs out) with table rows ``pos``, and two per-element
    bounds: mlarope's (one rounding of the fp32 result: 1 bf16 ulp, for the interpreter's
    truncation too, plus the fp32 arithmetic) and bf16 arithmetic's (two rounded products and a
    rounded sum, as Megatron's unfused path and kernel compute)."""
    x = x_rope.double()
    half = x.shape[-1] // 2
    c = cos.double().reshape(-1, 2 * half)[pos][:, None, :]
    s = sin.double().reshape(-1, 2 * half)[pos][:, None, :]
    c1, c2, s1, s2 = c[..., :half], c[..., half:], s[..., :half], s[..., half:]
    if transpose:
        a, b = x[..., :half], x[..., half:]
        p = (a * c1, b * s2, b * c2, -a * s1)
    else:
        a, b = x[..., 0::2], x[..., 1::2]
        p = (a * c1, -b * s1, b * c2, a * s2)
    out_a, out_b = p[0] + p[1], p[2] + p[3]
    arith_a = p[0].abs() + p[1].abs()
    arith_b = p[2].abs() + p[3].abs()
    bf16_a = ulp_bf16(p[0]) + ulp_bf16(p[1])
    bf16_b = ulp_bf16(p[2]) + ulp_bf16(p[3])
    if transpose:

        def join(u, v):
            return torch.stack((u, v), -1).flatten(-2)

    else:

        def join(u, v):
            return torch.cat((u, v), -1)

    truth, arith, bf16 = join(out_a, out_b), join(arith_a, arith_b), join(bf16_a, bf16_b)
    ours = ulp_bf16(truth.abs() + 4 * U32 * arith) + 4 * U32 * arith
    theirs = bf16 + ulp_bf16(truth.abs() + bf16)
    return truth, ours, theirs


def assert_bounded(got, truth, bound, what):
    err = (got.double() - truth).abs()
    bad = err > bound
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {err.numel()} elements beyond the bound; worst excess "
        f"{float((err - bound).max()):.3g}"
    )


def assert_bitwise(got, want, what):
    """``got`` equals ``want`` bit for bit; else say where and by how much they differ."""
    if torch.equal(got, want):
        return
    diff = (got.double() - want.double()).abs()
    where = diff.nonzero()
    raise AssertionError(
        f"{what}: {where.shape[0]} of {diff.numel()} elements differ, max {float(diff.max()):.3g} "
        f"(largest |value| {float(want.double().abs().max()):.3g}); first at "
        f"{where[0].tolist()}: {float(got[tuple(where[0])])} != {float(want[tuple(where[0])])}"
    )


@pytest.mark.parametrize("layout", ["sbhd", "thd"])
def test_mla_layer_rope_boundary_matches_unfused(layout, megatron_core, layer_device):
    """``get_query_key_value_tensors`` (the code that calls the fused functions), patched, against
    Megatron's unfused path on the same weights and input, element by element at the RoPE:

    - forward: nope channels and values bit for bit; the rope channels of the query and key
      within one rounding of the fp64 truth (mlarope), Megatron's within bf16 arithmetic's bound;
    - backward, with the same upstream gradients (multiples of 2^-6, so the head sums are exact
      in any order): the gradient reaching ``linear_kv_down_proj`` (k_pos_emb's, Megatron's
      rounding) and the key/value-side parameter gradients bit for bit; the query's gradient
      within the same bounds as the forward; ``linear_q_up_proj``'s weight gradient within the
      query gradient's difference carried through the GEMM plus its own rounding.
    """
    device = layer_device
    dtype = torch.bfloat16
    thd = layout == "thd"
    psp = packed_params(layout, device)
    x0 = torch.randn(SEQ, 1 if thd else BATCH, HIDDEN, generator=torch.Generator().manual_seed(1))
    runs = {}
    with integration.mlarope_patched():
        for fusion in (False, True):
            layer = build_mla(fusion, dtype, device)
            rec = Recorder(layer)
            x = x0.to(dtype).to(device).clone().requires_grad_()
            query, key, value, *_ = layer.get_query_key_value_tensors(x, packed_seq_params=psp)
            gen = torch.Generator().manual_seed(2)
            grads = [((torch.randn(t.shape, generator=gen) * 64).round().clamp(-255, 255) / 64)
                     .to(dtype).to(device) for t in (query, key, value)]  # fmt: skip
            torch.autograd.backward((query, key, value), grads)
            params = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
            runs[fusion] = dict(q=query.detach(), k=key.detach(), v=value.detach(), g=grads,
                                rec=rec.saved, params=params, x_grad=x.grad)  # fmt: skip
        cos, sin = layer.rotary_pos_emb.get_cached_cos_sin(SEQ, dtype=dtype, packed_seq=thd)
    unfused, fused = runs[False], runs[True]
    for name in ("linear_q_up_proj.in", "linear_q_up_proj.out", "linear_kv_down_proj.out"):
        assert torch.equal(unfused["rec"][name], fused["rec"][name]), name  # same inputs
    pos = positions(layout).to(device)
    m = pos.numel()

    # forward
    assert torch.equal(unfused["v"], fused["v"])
    for t in ("q", "k"):
        assert torch.equal(unfused[t][..., :NOPE], fused[t][..., :NOPE]), t
    q_pre = fused["rec"]["linear_q_up_proj.out"].reshape(m, HEADS, NOPE + ROPE)[..., NOPE:]
    k_pe = fused["rec"]["linear_kv_down_proj.out"][..., KV_LORA:].reshape(m, 1, ROPE)
    for t, x_rope in (("q", q_pre), ("k", k_pe)):
        truth, ours, theirs = rotation_bounds(x_rope, cos, sin, pos, transpose=False)
        heads = fused[t].reshape(m, HEADS, -1).shape[1]
        truth, ours, theirs = (z.expand(m, heads, ROPE) for z in (truth, ours, theirs))
        assert_bounded(fused[t].reshape(m, heads, -1)[..., NOPE:], truth, ours, f"{t} mlarope")
        assert_bounded(unfused[t].reshape(m, heads, -1)[..., NOPE:], truth, theirs, f"{t} unfused")

    # backward
    down_a = unfused["rec"]["linear_kv_down_proj.grad"]
    down_b = fused["rec"]["linear_kv_down_proj.grad"]
    assert_bitwise(down_b[..., KV_LORA:], down_a[..., KV_LORA:], "k_pos_emb gradient")
    assert_bitwise(down_b[..., :KV_LORA], down_a[..., :KV_LORA], "compressed kv gradient")
    for name in ("linear_kv_down_proj.weight", "linear_kv_up_proj.weight", "kv_layernorm.weight"):
        assert_bitwise(fused["params"][name], unfused["params"][name], name)
    gq = fused["g"][0].reshape(m, HEADS, NOPE + ROPE)
    dq = {f: runs[f]["rec"]["linear_q_up_proj.grad"].reshape(m, HEADS, -1) for f in runs}
    assert torch.equal(dq[True][..., :NOPE], gq[..., :NOPE])
    assert torch.equal(dq[False][..., :NOPE], gq[..., :NOPE])
    truth, ours, theirs = rotation_bounds(gq[..., NOPE:], cos, sin, pos, transpose=True)
    assert_bounded(dq[True][..., NOPE:], truth, ours, "query gradient, mlarope")
    assert_bounded(dq[False][..., NOPE:], truth, theirs, "query gradient, unfused")

    # linear_q_up_proj.weight's gradient: dQ^T X, one fp32-accumulated GEMM rounded to bf16
    xq = fused["rec"]["linear_q_up_proj.in"].reshape(m, -1).double()
    d_a = dq[False].reshape(m, -1).double()
    d_b = dq[True].reshape(m, -1).double()
    w_a = unfused["params"]["linear_q_up_proj.weight"].double()
    w_b = fused["params"]["linear_q_up_proj.weight"].double()
    carried = (d_b - d_a).abs().T @ xq.abs()
    accumulation = 2 * m * U32 * ((d_a.abs() + d_b.abs()).T @ xq.abs())
    bound = carried + accumulation + ulp_bf16(w_a) + ulp_bf16(w_b)
    assert_bounded(w_b, w_a, bound, "linear_q_up_proj.weight gradient")


@pytest.mark.parametrize("layout", ["sbhd", "thd"])
def test_mla_layer_forward_backward_matches_unfused(layout, megatron_core, layer_device):
    """The whole layer (attention and output projection included), patched against unfused, on
    the same weights, input and upstream gradient, both measured against the same layer run in
    fp32 (the same bf16-valued weights and input, the unfused path): for the output, the
    input's gradient and every parameter's gradient, the patched layer's distance from the fp32
    run (Frobenius norm) is at most 1.25 times the unfused layer's.

    Why this bound: the patch changes only the RoPE, where it is one rounding from exact and the
    unfused path three (checked element by element in
    test_mla_layer_rope_boundary_matches_unfused). Downstream, every bf16 operation rounds
    values that now differ slightly, so the two runs' rounding errors decorrelate: each is the
    layer's bf16 noise, of the same size (the ratio measured 0.97-1.04 over 4 seeds, both
    layouts, every tensor, on the CPU), while a wrong rotation (layout, sign, table row) puts
    the patched run O(1) away. The two runs' difference itself is of the noise's size, not
    smaller, so it is not compared directly."""
    device = layer_device
    thd = layout == "thd"
    psp = packed_params(layout, device)
    shape = (SEQ, 1 if thd else BATCH, HIDDEN)
    x0 = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    g0 = torch.randn(shape, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    results = {}
    weights = None
    with integration.mlarope_patched():
        for name, fusion, dtype in (("unfused", False, torch.bfloat16),
                                    ("mlarope", True, torch.bfloat16),
                                    ("fp32", False, torch.float32)):  # fmt: skip
            layer = build_mla(fusion, dtype, device)
            if weights is None:
                weights = {k: v.clone() for k, v in layer.state_dict().items() if v is not None}
            layer.load_state_dict({k: v.to(dtype) for k, v in weights.items()}, strict=False)
            for k, v in layer.state_dict().items():
                assert v is None or torch.equal(v.double(), weights[k].double()), k
            x = x0.to(dtype).to(device).clone().requires_grad_()
            out, _ = layer(x, attention_mask=None, packed_seq_params=psp)
            out.backward(g0.to(dtype).to(device))
            tensors = {"output": out.detach(), "input gradient": x.grad}
            tensors.update({n: p.grad for n, p in layer.named_parameters() if p.grad is not None})
            results[name] = {k: v.double() for k, v in tensors.items()}
    assert set(results["mlarope"]) == set(results["unfused"])
    for what in results["unfused"]:
        a, b, exact = (results[n][what] for n in ("unfused", "mlarope", "fp32"))
        ours, theirs = float((b - exact).norm()), float((a - exact).norm())
        assert math.isfinite(ours) and ours <= 1.25 * theirs, (
            f"{what}: |mlarope - fp32| = {ours:.4g} > 1.25 |unfused - fp32| = {1.25 * theirs:.4g}"
        )
