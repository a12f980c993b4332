"""The direct launch path (``kernels/_launch.py``).

CPU lane: the cache key against Triton's own specialization (equal keys must mean equal Triton
specializations, or a cached kernel would run on arguments it was not compiled for).
GPU lane: the direct path gives the same bits as Triton's path, compiles anew for a misaligned
tensor, and steps aside when a launch hook is set.
"""

from __future__ import annotations

import threading

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction, create_function_from_signature

import mlarope
from mlarope import reference
from mlarope.kernels._launch import DirectLauncher, _make_key_function, recording
from mlarope.kernels.q import rope_q_launch
from mlarope.positions import Positions


def _probe(x_ptr, y_ptr, n, m, BLOCK: tl.constexpr):
    pass


# Built as a JITFunction even in the CPU lane (where triton.jit would give the interpreter):
# only its parameter list is used here.
_PROBE = JITFunction(_probe, do_not_specialize=["m"])

INTS = [0, 1, 2, 15, 16, 17, 32, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**63 - 1, 2**63]


def _tensors():
    base = {dt: torch.empty(64, dtype=dt) for dt in (torch.bfloat16, torch.float32, torch.int64)}
    views = []
    for t in base.values():
        views += [t, t[1:], t[8:], t[16 // t.element_size() :]]
    return views


def test_key_is_at_least_as_fine_as_triton_specialization():
    """For many argument tuples: equal keys -> equal Triton specializations (the binder's)."""
    key = _make_key_function(_PROBE)
    binder = create_function_from_signature(_PROBE.signature, _PROBE.params, BaseBackend)
    seen: dict[tuple, list] = {}
    tensors = _tensors()
    combos = [(x, y, n, m) for x in tensors[:6] for y in tensors[-4:] for n in INTS for m in INTS]
    for x, y, n, m in combos:
        k = key(BaseBackend, 0, 4, x, y, n, m, 64)
        _, spec, _ = binder(x, y, n, m, 64)
        assert seen.setdefault(k, spec) == spec, (k, spec)
    # ... and the key tells apart what Triton tells apart (alignment, dtype, int classes).
    specs = {tuple(map(tuple, v)) for v in seen.values()}
    assert len(seen) >= len(specs) > 1
    aligned, misaligned = tensors[0], tensors[1]
    assert key(BaseBackend, 0, 4, aligned, aligned, 3, 3, 64) != key(
        BaseBackend, 0, 4, misaligned, aligned, 3, 3, 64
    )
    assert key(BaseBackend, 0, 4, aligned, aligned, 3, 2**31 - 1, 64) != key(
        BaseBackend, 0, 4, aligned, aligned, 3, 2**31, 64
    )


def test_launcher_counts_arguments():
    launcher = DirectLauncher(_PROBE)
    with pytest.raises(TypeError, match="takes 5 arguments, got 4"):
        launcher((1,), 4, torch.empty(1), torch.empty(1), 1, 1)


# ------------------------------------------------------------------------------- GPU lane
@pytest.mark.gpu
def test_direct_launch_same_bits_as_triton_path(device):
    """The first call of a shape goes through Triton, the next ones launch directly; with a
    launch hook set every call goes through Triton. All give the same bits."""
    q = torch.randn(8, 128, 192, device=device, dtype=torch.bfloat16)
    kv = torch.randn(8, 128, 256, device=device, dtype=torch.bfloat16)
    k_pe = torch.randn(8, 64, device=device, dtype=torch.bfloat16)
    cos, sin = mlarope.YarnConfig.deepseek_v3().cos_sin(4096, device=device)
    ids = torch.randint(0, 4096, (8,), device=device)
    kw = dict(layout="thd", position_ids=ids)

    def run():
        k, v = mlarope.apply_rope_kv(kv, k_pe, cos, sin, k_dim=128, **kw)
        return mlarope.apply_rope_q(q, cos, sin, **kw), k, v

    first, second, third = run(), run(), run()
    hooked = []
    hook = lambda metadata: hooked.append(metadata)
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        through_triton = run()
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    torch.cuda.synchronize()
    assert len(hooked) == 2, "with a launch hook set, the launches must go through Triton"
    for outs in (second, third, through_triton):
        for a, b in zip(first, outs, strict=True):
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_direct_launch_misaligned_views(device):
    """A view whose pointer is not 16-byte aligned needs a kernel compiled without the
    alignment assumption: its key differs, so it never reuses the aligned kernel."""
    cos, sin = mlarope.YarnConfig.deepseek_v3().cos_sin(4096, device=device)
    buf = torch.randn(8 * 16 * 192 + 8, device=device, dtype=torch.bfloat16)
    ids = torch.randint(0, 4096, (8,), device=device)
    for offset in (0, 1, 0, 1, 8, 0):
        q = buf[offset : offset + 8 * 16 * 192].view(8, 16, 192)
        assert (q.data_ptr() % 16 == 0) == (offset % 8 == 0)
        out = mlarope.apply_rope_q(q, cos, sin, layout="thd", position_ids=ids)
        truth = reference.apply_rope_q(
            q.double(), cos.double(), sin.double(), layout="thd", position_ids=ids
        )
        # One rounding of the fp64 truth to bf16 (the error model, docs/design.md): within half
        # an ulp, plus fp32 arithmetic, which the bound 2**-8 relative covers with room.
        torch.testing.assert_close(out.double(), truth, rtol=2**-8, atol=1e-6)


def test_recording_is_per_thread(device):
    """A launch made by another thread is never recorded as this thread's (a plan built from
    it would launch the other call's kernel)."""
    cos, sin = mlarope.YarnConfig(dim=32).cos_sin(16, device=device)
    q = torch.randn(4, 1, 2, 48, device=device)
    with recording() as mine:
        worker = threading.Thread(target=lambda: mlarope.apply_rope_q(q, cos, sin, inverse=True))
        worker.start()
        worker.join()
        assert mine == []
        rope_q_launch(
            q, q, cos, sin, Positions("sbhd", None, None, 0, 1), interleaved_in=True,
            interleaved_out=False, inverse=False, transpose=False,
        )  # fmt: skip
    assert len(mine) == 1
