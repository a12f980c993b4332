"""No path a model runs synchronizes with the device (GPU lane).

Each call runs under ``torch.cuda.set_sync_debug_mode("error")``, which raises at any operation
that waits for the device (a device-to-host copy, ``.item()``, a blocking allocation): the core
ops eager, with and without gradients, forward and backward, through the pipeline (a first call)
and through launch plans (repeated calls); the transformers patch on a model's training step; the
Megatron-Core compat functions; the serving ops with ``validate=False``. The kernels are compiled
before the mode is set (compiling is a one-time cost, not a path a step takes). A control shows
the mode sees a sync (``.item()``).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import mlarope
from mlarope._launch_cache import clear_launch_cache

pytestmark = pytest.mark.gpu
T, H, N, R, V = 16, 8, 32, 64, 32


@contextlib.contextmanager
def no_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def each_path(fn) -> None:
    """``fn`` once to compile, then under the error mode: through the pipeline (plans
    cleared) and twice more (the second records plans, the third replays them)."""
    fn()
    clear_launch_cache()
    with no_sync():
        for _ in range(3):
            fn()


def test_the_mode_sees_a_sync():
    x = torch.ones(1, device="cuda")
    with pytest.raises(RuntimeError, match="synchroniz"), no_sync():
        x.sum().item()


def _tables():
    return mlarope.YarnConfig.deepseek_v3().cos_sin(256, device="cuda")


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("source", ["sbhd", "thd-cu", "thd-ids", "bshd-ids"])
def test_core_ops(grad, source):
    cos, sin = _tables()
    dev, bf16 = "cuda", torch.bfloat16
    if source == "sbhd":
        tokens, kw = (T // 2, 2), dict(layout="sbhd")
    elif source == "thd-cu":
        cu = torch.tensor([0, 5, 5, T], dtype=torch.int32, device=dev)
        tokens, kw = (T,), dict(layout="thd", cu_seqlens=cu)
    elif source == "thd-ids":
        tokens, kw = (T,), dict(layout="thd", position_ids=torch.arange(T, device=dev) * 3)
    else:
        tokens, kw = (2, T // 2), dict(layout="bshd", position_ids=torch.arange(T // 2, device=dev))
    q0 = torch.randn(*tokens, H, N + R, device=dev, dtype=bf16)
    k0 = torch.randn(*tokens, 1, R, device=dev, dtype=bf16)
    kv0 = torch.randn(*tokens, H, N + V, device=dev, dtype=bf16)

    def calls():
        q = q0.clone().requires_grad_(grad)
        k, kv, k_pe = (t.clone().requires_grad_(grad) for t in (k0, kv0, k0))
        outs = [mlarope.apply_rope_q(q, cos, sin, **kw)]
        target = q * 1 if grad else q.clone()
        outs.append(mlarope.apply_rope_q(target, cos, sin, inplace=True, **kw))
        outs += mlarope.apply_rope_qk(q, k, cos, sin, **kw)
        outs += mlarope.apply_rope_kv(kv, k_pe, cos, sin, k_dim=N, **kw)
        outs += mlarope.apply_rope_kv(kv, k_pe, cos, sin, k_dim=N, copy_v=False, **kw)
        if grad:
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    each_path(calls)


def test_megatron_compat():
    from mlarope.compat import megatron as compat

    cos, sin = (t.view(-1, 1, 1, R) for t in _tables())
    cu = torch.tensor([0, 6, T], dtype=torch.int32, device="cuda")
    q0 = torch.randn(T, H, N + R, device="cuda", dtype=torch.bfloat16)
    kv0 = torch.randn(T, H, N + V, device="cuda", dtype=torch.bfloat16)
    k0 = torch.randn(T, 1, R, device="cuda", dtype=torch.bfloat16)

    def calls():
        for cu_seqlens in (None, cu):
            shape = (T, 1) if cu_seqlens is None else (T,)
            q = q0.view(*shape, H, N + R).clone().requires_grad_(True)
            out = compat.fused_apply_mla_rope_for_q(q * 1, cos, sin, N, R, cu_seqlens)
            kv = kv0.view(*shape, H, N + V).clone().requires_grad_(True)
            k_pe = k0.view(*shape, 1, R).clone().requires_grad_(True)
            k, v = compat.fused_apply_mla_rope_for_kv(kv, k_pe, cos, sin, R, N, V, cu_seqlens)
            torch.autograd.backward((out, k, v), (torch.ones_like(out), torch.ones_like(k),
                                                  torch.ones_like(v)))  # fmt: skip

    each_path(calls)


@pytest.mark.parametrize("family", ["deepseek_v3", "minicpm3", "glm4_moe_lite", "deepseek_v2"])
def test_transformers_attention_training_step(family):
    """The patched attention layer's training step, with the arguments its model passes it
    (``benchmarks/transformers_layers.py``'s layer, small widths), the unpatched one
    (transformers' own layer syncs nowhere either) and the layer with its glue fused
    (``apply_mlarope_attention``)."""
    pytest.importorskip("transformers")
    from benchmarks.transformers_layers import build, step
    from mlarope.integrations import transformers as mt

    config, attention, _, _, kwargs, _ = build(family, torch.device("cuda"), 16, tiny=True)
    x0 = torch.randn(1, 16, config.get_text_config().hidden_size, device="cuda")
    x0, g = x0.to(torch.bfloat16), torch.randn_like(x0).to(torch.bfloat16)

    def training_step():
        attention.zero_grad(set_to_none=True)
        step(attention, kwargs, x0.clone().requires_grad_(True), g, backward=True)

    each_path(training_step)
    with mt.mlarope_patched(family):
        each_path(training_step)
    if family == "deepseek_v2":
        return  # not DeepSeek-V3's structure: the attention-level path leaves it alone
    # The attention-level path (its latent op, in-place query, key/value op), fused on the layer.
    assert set(mt.apply_mlarope_attention(attention).values()) == {"fused"}
    try:
        each_path(training_step)
    finally:
        mt.revert_mlarope_attention(attention)


def test_serving_ops():
    from mlarope import serving

    cos, sin = _tables()
    dev, bf16, fp8 = "cuda", torch.bfloat16, torch.float8_e4m3fn
    L, pages, page = 512, 4, 16
    kv_c = torch.randn(T, L, device=dev, dtype=bf16)
    k_pe = torch.randn(T, R, device=dev, dtype=bf16)
    positions = torch.arange(T, device=dev)
    slots = torch.randperm(pages * page, device=dev)[:T]
    slots[3] = -1
    q_nope = torch.randn(T, H, L, device=dev, dtype=bf16)
    q_pe = torch.randn(T, H, R, device=dev, dtype=bf16)
    scale = torch.tensor([0.05], device=dev)
    caches = {
        "concat": torch.zeros(pages, page, L + R, device=dev, dtype=bf16),
        "concat-fp8": torch.zeros(pages, page, L + R, device=dev, dtype=fp8),
        "split": (
            torch.zeros(pages, page, L, device=dev, dtype=bf16),
            torch.zeros(pages, page, R, device=dev, dtype=bf16),
        ),
        "fp8_656": torch.zeros(pages, page, 656, device=dev, dtype=torch.uint8),
    }

    def calls():
        for name, cache in caches.items():
            fmt = name.split("-")[0]
            kw = dict(kv_scale=scale) if name == "concat-fp8" else {}
            serving.rope_append_kv_cache(kv_c, k_pe, cos, sin, positions, cache, slots,
                                         cache_format=fmt, **kw)  # fmt: skip
        serving.rope_decode_query(q_nope, q_pe, cos, sin, positions)
        serving.rope_decode_query(q_nope, q_pe, cos, sin, positions, out_dtype=fp8, q_scale=scale)

    each_path(calls)
