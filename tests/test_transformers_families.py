"""Every patched MLA family of the installed transformers against transformers itself: a tiny
model of each, fp32 and bf16, forward and backward, on both backends, every rotation counted,
within the error model of ``tests/families_harness.py`` (bit for bit where it is exact); the
negative control shows that the bounds catch a wrong rotation.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib

import pytest
import torch

pytest.importorskip("transformers")

import mlarope
from mlarope.integrations import transformers as mt
from mlarope.integrations.transformers import _patch, _rotation
from tests import families_harness
from tests.families_harness import (
    C_BF16,
    G_BF16,
    PATCHED,
    REPORT,
    CallCounter,
    assert_bf16_close,
    assert_fp32_close,
    assert_identical,
    bf16_ratios,
    fp32_bounds,
    run,
    run_emulated,
    tiny_model,
    token_ids,
)
from tests.harness import fused_reference, kernels_fuse, reference_backend

# The harness's fixtures, found by pytest under these names: one intra-op thread for the tiny
# models, and every family unpatched after each test.
one_thread = families_harness.one_thread
unpatched_after = families_harness.unpatched_after


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", PATCHED)
def test_family_matches_transformers(family, dtype, device, monkeypatch):
    row = REPORT[family]
    fp32 = dtype == torch.float32
    cpu = torch.device(device).type == "cpu"
    model = tiny_model(row, dtype, device)
    model64 = copy.deepcopy(model).double()
    # fp32: per-row position offsets (tables [B, S, R]) and a sequence past the DSA indexers'
    # top-k; bf16: default positions (tables [1, S, R]), every key selected.
    seq = 12 if fp32 else 8
    ids = token_ids(seq, device)
    pos = torch.arange(seq, device=device)[None] + torch.tensor([[0], [37]], device=device)
    pos = pos if fp32 else None
    counter = CallCounter(monkeypatch, family)
    unpatched = counter.expected(lambda: run(model, ids, pos))
    assert counter.rotated > 0, "the tiny model called none of the family's rotary functions"
    # Bit for bit on the CPU (below), except DeepSeek-V2's complex product: one PyTorch kernel
    # whose rounding depends on the layout (a vectorised path may fuse the multiply-add), within
    # a few fp32 units of mlarope's. The kernels compute ``fma(a, c, -(b * s))``: PyTorch's
    # ``a * c - b * s`` bit for bit where the interpreter's fma rounds twice (Triton 3.6); a newer
    # interpreter rounds once, as the GPU does, and the kernels are then held bit for bit to the
    # reference backend computing that fused arithmetic (``tests.harness.fused_reference``).
    complex_product = any(m.complex_freqs for m in _patch.family(family).mappings.values())
    bitwise = {"reference": cpu and not complex_product, "kernels": cpu and not complex_product}
    # The fp64 run measures the model's own rounding noise: what the comparison is bounded by
    # where it is not bitwise (bf16, where mlarope's one rounding differs from transformers'
    # three; DeepSeek-V2's complex product).
    truth = None if fp32 and all(bitwise.values()) else run(model64, ids, pos)
    nearest = None if fp32 else run_emulated(monkeypatch, family, lambda: run(model, ids, pos))
    # The kernels' own arithmetic, fused products, computed by the reference backend on the
    # same device: the kernels' bits where the fma rounds once (the GPU, a newer interpreter).
    fused = None
    if not complex_product and kernels_fuse(device):
        with monkeypatch.context() as m:
            reference_backend(m, device)
            fused_reference(m)
            with mt.mlarope_patched(family, model=model):
                fused = run(model, ids, pos)

    # The reference backend runs CPU tensors with TRITON_INTERPRET off (read on every call); the
    # GPU lane compares its kernels with the fused reference above.
    for backend in ("kernels", "reference") if cpu else ("kernels",):
        with monkeypatch.context() as m:
            if backend == "reference":
                m.setenv("TRITON_INTERPRET", "0")
                assert not mlarope.ops.use_triton(ids.float())
            with mt.mlarope_patched(family, model=model):
                counter.mlarope = 0
                patched = run(model, ids, pos)
        assert counter.mlarope == counter.rotated, (
            f"{backend}: {counter.mlarope} of {counter.rotated} rotations went through mlarope"
        )
        what = f"{family} {backend} {dtype}"
        if not fp32:
            assert_bf16_close(patched, (unpatched, nearest), truth, what)
        # Where the kernels' fma rounds once, they are the reference computing their fused
        # products, bit for bit; the reference is transformers' function bit for bit (below, on
        # the CPU), and the fused emulation exact (tests/test_backends_agree.py).
        if backend == "kernels" and fused is not None:
            assert_identical(patched, fused, f"{what} vs the reference's fused arithmetic")
            continue
        if not bitwise[backend]:
            if fp32:
                assert_fp32_close(patched, unpatched, truth, what)
            continue
        # On the CPU the error model is exact, bit for bit: fp32 math in transformers' own order
        # (two products and a sum), then one rounding to the result dtype, to nearest (both
        # backends store the same bits). In fp32 that is transformers.
        want = unpatched if fp32 else nearest
        assert_identical(patched, want, f"{what} vs transformers' function in fp32")


# ---------------------------------------------------------------------------------------------
# the negative control: the bounds above catch a wrong rotation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_negative_control(dtype, device, monkeypatch):
    """A replacement that reads the pairs in the other layout (a plausible bug) fails the
    fp32 bound by orders of magnitude and the bf16 one clearly: the bounds can fail."""
    family = "deepseek_v3"
    fp32 = dtype == torch.float32
    model = tiny_model(REPORT[family], dtype, device)
    truth = run(copy.deepcopy(model).double(), token_ids(8, device))
    unpatched = run(model, token_ids(8, device))
    fam = _patch.family(family)
    module = importlib.import_module(fam.module)
    with monkeypatch.context() as m:
        for name, mapping in fam.mappings.items():
            wrong = dataclasses.replace(mapping, interleaved_in=not mapping.interleaved_in)
            m.setattr(module, name, _rotation.make_replacement(getattr(module, name), wrong, name))
        patched = run(model, token_ids(8, device))
    if fp32:
        bounds = fp32_bounds(unpatched, truth)
        err = float((patched["output"].double() - unpatched["output"].double()).abs().max())
        assert err > 1000 * bounds["output"]
    else:
        nearest = run_emulated(monkeypatch, family, lambda: run(model, token_ids(8, device)))
        ratios, g = bf16_ratios(patched, (unpatched, nearest), truth)
        assert max(ratios.values()) > 2 * C_BF16 and g > 5 * G_BF16, (max(ratios.values()), g)
