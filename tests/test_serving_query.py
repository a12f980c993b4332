"""``rope_decode_query``: the kernels (and, in the CPU lane, the reference backend) against the
float64 truth: the nope channels exact (a copy, or torch's e4m3 conversion of ``q_nope /
q_scale``), the rope channels within one rounding or one e4m3 step, NaN where the position is
outside the table, a caller's buffer written in place (its padding untouched) and the inputs
unchanged."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

# Imported before a test sets TRITON_INTERPRET=0 for the PyTorch backend: Triton decides at a
# kernel's import whether it runs interpreted.
import mlarope.kernels.q
import mlarope.kernels.serving  # noqa: F401
from mlarope import serving
from mlarope.serving import reference as ref
from tests.serving_support import assert_within, rope_arith, rope_truth, stored_tolerance, tables

ROWS = 40
Q_SCALE = 0.03125 * 1.3


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype = torch.bfloat16
    fp8: bool = False
    scale: str = "value"
    tokens: int = 5
    heads: int = 3
    latent: int = 48
    rope: int = 64
    interleaved: bool = True
    interleaved_out: bool = True
    head_major: bool = False  # q_nope [H, T, L] transposed to [T, H, L] (a bmm's output)
    out: str = "new"  # "new" | "buffer": a slice of a padded buffer
    index_dtype: torch.dtype = torch.int64


CASES = [
    Case(),
    Case(dtype=torch.float16, interleaved_out=False, out="buffer"),
    Case(dtype=torch.float32, rope=32, interleaved=False, heads=5, index_dtype=torch.int32),
    Case(head_major=True, tokens=3, heads=17),
    Case(fp8=True),
    Case(fp8=True, scale="tensor", out="buffer", head_major=True, interleaved=False),
    Case(fp8=True, dtype=torch.float32, interleaved_out=False, latent=128),
]


def _case_id(case: Case) -> str:
    default = Case()
    parts = []
    for name in Case.__dataclass_fields__:
        value = getattr(case, name)
        if value != getattr(default, name):
            value = str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value
            parts.append(f"{name}={value}")
    return ",".join(parts) or "default"


def _inputs(case: Case, device):
    gen = torch.Generator().manual_seed(5)
    t, h, n, r = case.tokens, case.heads, case.latent, case.rope
    if case.head_major:
        q_nope = torch.randn(h, t, n, generator=gen).to(case.dtype).to(device).transpose(0, 1)
    else:
        q_nope = torch.randn(t, h, n, generator=gen).to(case.dtype).to(device)
    q_nope = q_nope * 4  # e4m3 codes across binades
    q_pe = torch.randn(t, h, r, generator=gen).to(case.dtype).to(device)
    positions = torch.tensor([3, ROWS + 1, 0, ROWS - 1, 17][:t], dtype=case.index_dtype)
    return q_nope, q_pe, positions.to(device)


def _call(case: Case, device, backend: str):
    q_nope, q_pe, positions = _inputs(case, device)
    cos, sin = tables(case.rope, ROWS, device)
    out_dtype = torch.float8_e4m3fn if case.fp8 else case.dtype
    scale = None
    if case.fp8:
        scale = Q_SCALE
        if case.scale == "tensor":
            scale = torch.tensor([Q_SCALE], device=device)
    padded = None
    out = None
    if case.out == "buffer":
        width = case.latent + case.rope
        padded = torch.full((case.tokens, case.heads, width + 8), 7.0, device=device)
        padded = padded.to(out_dtype)
        out = padded[..., :width]
    inputs = (q_nope.clone(), q_pe.clone())
    previous = os.environ.get("TRITON_INTERPRET")
    if backend == "reference":
        os.environ["TRITON_INTERPRET"] = "0"
    try:
        result = serving.rope_decode_query(
            q_nope, q_pe, cos, sin, positions, out=out,
            out_dtype=None if out is not None else out_dtype, q_scale=scale,
            interleaved=case.interleaved, interleaved_out=case.interleaved_out,
        )  # fmt: skip
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous
    assert torch.equal(q_nope, inputs[0]) and torch.equal(q_pe, inputs[1]), "inputs changed"
    if out is not None:
        assert result is out
        assert torch.equal(padded[..., -8:].float(), torch.full_like(padded[..., -8:].float(), 7))
    assert result.dtype == out_dtype
    assert result.shape == (*q_nope.shape[:2], case.latent + case.rope)
    return result, (q_nope, q_pe, positions, cos, sin)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_decode_query_against_truth(device, case):
    backends = ["kernel"] if device.type == "cuda" else ["kernel", "reference"]
    results = {b: _call(case, device, b) for b in backends}
    q_nope, q_pe, positions, cos, sin = results["kernel"][1]
    n = case.latent
    flags = dict(interleaved_in=case.interleaved, interleaved_out=case.interleaved_out)
    truth = rope_truth(q_pe, cos, sin, positions, **flags)
    arith = rope_arith(q_pe, cos, sin, positions, **flags)
    dtype = torch.float8_e4m3fn if case.fp8 else case.dtype
    tol = stored_tolerance(truth, arith, dtype, Q_SCALE)
    for backend, (result, _) in results.items():
        out = result.cpu()
        if case.fp8:
            codes = out.view(torch.uint8)
            want = (q_nope.cpu().float() / torch.tensor(Q_SCALE, dtype=torch.float32)).clamp(
                -448, 448
            )
            assert torch.equal(codes[..., :n], want.to(torch.float8_e4m3fn).view(torch.uint8))
            rope = ref.e4m3_decode(codes[..., n:]).double() * float(
                torch.tensor(Q_SCALE, dtype=torch.float32)
            )
        else:
            assert torch.equal(out[..., :n], q_nope.cpu()), f"{backend}: nope copy"
            rope = out[..., n:]
        assert_within(rope, truth, tol, f"{backend}: rope channels")
    assert truth.isnan().any()
    if "reference" in results:  # the same bits but in the rope channels (fused multiply-adds)
        a, b = (r[0].cpu()[..., :n] for r in results.values())
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
