"""DeepSeek-V4's inverse RoPE on the attention output, the training path: ``apply_rope_q(o,
cos, sin, layout="thd", position_ids=..., interleaved=True, interleaved_out=True,
inverse=True)`` on ``o: [T, H, 512]`` (``[nope 448 | rope 64]``, interleaved pairs) is V4's
``apply_rotary_emb(o[..., -64:], freqs_cis, inverse=True)``: the trailing 64 channels rotated by
the conjugate angle, the 448 nope channels copied, in one launch, with a backward.

Against float64: DeepSeek's complex form (``view_as_complex`` pairs times ``conj(e^{i theta})``),
transformers' ``deepseek_v4`` ``apply_rotary_pos_emb(x, cos, -sin)`` where it imports, and for
the gradient the float64 autograd of the same; tolerances from the error model (one rounding
of the output dtype plus the fp32 arithmetic bound); nope channels and their gradient exact.
On the kernels (the interpreter in the CPU lane, CUDA in the GPU lane) and the PyTorch backend.
"""

from __future__ import annotations

import pytest
import torch

import mlarope
from tests.errmodel import assert_close_elementwise, rope_tolerance

T, H, NOPE, R, ROWS = 7, 3, 448, 64, 48


@pytest.fixture(params=["kernels", "pytorch"])
def backend(request, monkeypatch, device):
    """The lane's kernels, or the PyTorch backend (CPU tensors without TRITON_INTERPRET)."""
    if request.param == "pytorch":
        if device.type == "cuda":
            pytest.skip("the PyTorch backend runs CPU tensors")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    return request.param


def _tables(device):
    """V4's main rope set's shape: 64 channels, one angle per pair (both halves equal)."""
    cfg = mlarope.YarnConfig(dim=R, base=10000.0)
    return cfg.cos_sin(ROWS, device=device)


def _inverse_truth(o: torch.Tensor, cos, sin, positions) -> torch.Tensor:
    """DeepSeek's reference in float64: pairs as complex numbers times the conjugate."""
    x = o.double().cpu()
    pos = positions.cpu()
    theta = torch.atan2(sin.double().cpu()[pos, : R // 2], cos.double().cpu()[pos, : R // 2])
    radius = torch.hypot(sin.double().cpu()[pos, : R // 2], cos.double().cpu()[pos, : R // 2])
    freqs = torch.polar(radius, theta)[:, None, :]  # [T, 1, R/2]
    rope = torch.view_as_complex(x[..., NOPE:].unflatten(-1, (-1, 2)).contiguous())
    rotated = torch.view_as_real(rope * freqs.conj()).flatten(-2)
    return torch.cat((x[..., :NOPE], rotated), dim=-1)


def _call(o, cos, sin, positions):
    return mlarope.apply_rope_q(
        o, cos, sin, layout="thd", position_ids=positions, interleaved=True,
        interleaved_out=True, inverse=True,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_inverse_rope_on_the_output_against_fp64(device, backend, dtype):
    gen = torch.Generator().manual_seed(3)
    o = torch.randn(T, H, NOPE + R, generator=gen).to(dtype).to(device)
    cos, sin = _tables(device)
    positions = torch.randint(0, ROWS, (T,), generator=gen).to(device)
    got = _call(o, cos, sin, positions)
    truth = _inverse_truth(o, cos, sin, positions)
    assert torch.equal(got[..., :NOPE], o[..., :NOPE]), "the nope channels are copied"
    tol = rope_tolerance(
        o[..., NOPE:].cpu().double(), cos.cpu(), sin.cpu(), _ids(positions), truth[..., NOPE:],
        dtype, interleaved_in=True, interleaved_out=True,
    )  # fmt: skip
    assert_close_elementwise(got[..., NOPE:].cpu(), truth[..., NOPE:], tol, f"{dtype} output")


def _ids(positions):
    from mlarope.positions import Positions

    return Positions("thd", None, positions.cpu(), 0, 1)


def test_inverse_undoes_the_rotation_v4_applies_to_v(device):
    """K = V in DeepSeek-V4, so the output's rope slice carries the keys' rotation: the inverse
    at the query's position of a value rotated at that position gives it back (fp64 model of
    the two roundings: within two fp32 arithmetic bounds, in fp32)."""
    gen = torch.Generator().manual_seed(4)
    v = torch.randn(T, H, NOPE + R, generator=gen).to(device)
    cos, sin = _tables(device)
    positions = torch.randint(0, ROWS, (T,), generator=gen).to(device)
    forward = mlarope.apply_rope_q(
        v, cos, sin, layout="thd", position_ids=positions, interleaved=True, interleaved_out=True
    )
    back = _call(forward, cos, sin, positions)
    assert torch.allclose(back, v, rtol=0, atol=1e-5)


def test_matches_transformers_deepseek_v4(device):
    """transformers' ``deepseek_v4.apply_rotary_pos_emb(x, cos, -sin)`` (its half-width tables,
    fp32 math), what its attention applies to the output before ``o_a_proj``."""
    v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    gen = torch.Generator().manual_seed(5)
    o = torch.randn(T, H, NOPE + R, generator=gen).to(torch.bfloat16).to(device)
    cos, sin = _tables(device)
    positions = torch.randint(0, ROWS, (T,), generator=gen).to(device)
    half_cos = cos[positions, : R // 2].double().cpu()[None]  # [B = 1, S = T, R/2]
    half_sin = sin[positions, : R // 2].double().cpu()[None]
    x = o.double().cpu().transpose(0, 1)[None]  # [B, H, S, D]
    theirs = v4.apply_rotary_pos_emb(x, half_cos, -half_sin)[0].transpose(0, 1)
    got = _call(o, cos, sin, positions).cpu()
    tol = rope_tolerance(
        o[..., NOPE:].cpu().double(), cos.cpu(), sin.cpu(), _ids(positions),
        theirs[..., NOPE:], torch.bfloat16, interleaved_in=True, interleaved_out=True,
    )  # fmt: skip
    assert_close_elementwise(got[..., NOPE:], theirs[..., NOPE:], tol, "against transformers")
    assert torch.equal(got[..., :NOPE], o[..., :NOPE].cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_against_fp64_autograd(device, backend, dtype):
    """The gradient of the inverse rotation (the forward rotation of the incoming gradient on the
    rope slice, the nope gradient passed through) against float64 autograd of DeepSeek's form."""
    gen = torch.Generator().manual_seed(6)
    o0 = torch.randn(T, H, NOPE + R, generator=gen).to(dtype)
    grad = torch.randn(T, H, NOPE + R, generator=gen).to(dtype)
    cos, sin = _tables(device)
    positions = torch.randint(0, ROWS, (T,), generator=gen).to(device)
    o = o0.clone().to(device).requires_grad_(True)
    (_call(o, cos, sin, positions) * grad.to(device)).sum().backward()
    o64 = o0.double().requires_grad_(True)
    (_inverse_truth(o64, cos, sin, positions) * grad.double()).sum().backward()
    truth = o64.grad
    got = o.grad.cpu()
    assert torch.equal(got[..., :NOPE], grad[..., :NOPE]), "the nope gradient passes through"
    tol = rope_tolerance(
        grad[..., NOPE:].double(), cos.cpu(), sin.cpu(), _ids(positions), truth[..., NOPE:],
        dtype, interleaved_in=True, interleaved_out=True,
    )  # fmt: skip
    assert_close_elementwise(got[..., NOPE:], truth[..., NOPE:], tol, f"{dtype} gradient")


def test_one_launch_forward(device):
    """Rope and nope channels in one launch (the query op's full-head path)."""
    if device.type != "cuda":
        from mlarope.kernels._launch import recording

        o = torch.randn(T, H, NOPE + R, dtype=torch.bfloat16)
        cos, sin = _tables("cpu")
        with recording() as launches:
            mlarope.apply_rope_q(
                o, cos, sin, layout="thd", position_ids=torch.arange(T), interleaved=True,
                interleaved_out=True, inverse=True, validate=True,
            )  # fmt: skip
        assert len(launches) == 1
