"""The supported Triton releases (``kernels._triton_compat``) and the kernels under every
supported interpreter.

The interpreter tests make this interpreter as strict as the strictest supported pairing, so
the CPU lane catches on any Triton and numpy what only one pairing would show:

- Triton 3.9's masked loads and stores reject a mask whose data is not boolean ("mask has
  unsupported dtype"); earlier interpreters accept it silently.
- Triton 3.6 turns a ``range`` bound into a Python int with ``int(array)`` on a 1-element
  array, an error with numpy 2.4 and a DeprecationWarning before it (made an error here).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import mlarope
from mlarope import reference
from mlarope.kernels import _triton_compat


@pytest.mark.parametrize(
    ("version", "parsed"),
    [("3.6.0", (3, 6)), ("3.9.0", (3, 9)), ("3.7.1+git1a2b3c", (3, 7)), ("3.10.0rc1", (3, 10))],
)
def test_triton_version_tuple(version, parsed):
    assert _triton_compat.triton_version_tuple(version) == parsed


def test_unreadable_triton_version_raises():
    with pytest.raises(ValueError, match="'main'"):
        _triton_compat.triton_version_tuple("main")


@pytest.mark.parametrize("version", ["3.6.0", "3.7.1", "3.8.0", "3.9.0", "3.10.0"])
def test_supported_triton_versions_pass(version):
    _triton_compat.check_triton_version(version)


@pytest.mark.parametrize("version", ["3.5.1", "3.2.0", "2.3.1"])
def test_older_triton_raises_naming_the_versions(version):
    with pytest.raises(ImportError) as info:
        _triton_compat.check_triton_version(version)
    message = str(info.value)
    assert f"triton {version}" in message
    assert "triton >= 3.6" in message and "3.9" in message


@pytest.fixture
def strict_interpreter(monkeypatch):
    """Triton's interpreter with 3.9's boolean-mask check on every masked load and store, and
    numpy's array-to-int conversion of 1-element arrays an error."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    real_load, real_store = builder.create_masked_load, builder.create_masked_store
    masks: list[np.dtype] = []

    # (the arguments after the mask differ from release to release)
    def load(self, ptrs, mask, *rest):
        masks.append(mask.data.dtype)
        if mask.data.dtype != np.bool_:
            raise ValueError(f"mask has unsupported dtype {mask.data.dtype}")
        return real_load(self, ptrs, mask, *rest)

    def store(self, ptrs, value, mask, *rest):
        masks.append(mask.data.dtype)
        if mask.data.dtype != np.bool_:
            raise ValueError(f"mask has unsupported dtype {mask.data.dtype}")
        return real_store(self, ptrs, value, mask, *rest)

    monkeypatch.setattr(builder, "create_masked_load", load)
    monkeypatch.setattr(builder, "create_masked_store", store)
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "error", message="Conversion of an array with ndim > 0", category=DeprecationWarning
        )
        yield masks


def _tables(rows: int = 40, rope: int = 32):
    theta = torch.rand(rows, rope, dtype=torch.float64) * 6.3
    return theta.cos().float(), theta.sin().float()


def _cu(*bounds: int) -> torch.Tensor:
    return torch.tensor(bounds, dtype=torch.int32)


CALLS = {  # (q's shape [tokens..., H, N + R], the call's position arguments)
    "q sbhd": ((3, 3, 2, 48), dict(layout="sbhd")),
    "q thd cu_seqlens": ((9, 2, 48), dict(layout="thd", cu_seqlens=_cu(0, 3, 3, 9))),
    "q thd no sequences": ((9, 2, 48), dict(layout="thd", cu_seqlens=_cu(0))),
    "q bshd ids": ((1, 3, 2, 48), dict(layout="bshd", position_ids=torch.tensor([[5, 1, 0]]))),
}  # fmt: skip


@pytest.mark.cpu
@pytest.mark.parametrize("case", list(CALLS))
@pytest.mark.parametrize("inplace", [False, True])
def test_query_kernels_run_under_a_strict_interpreter(case, inplace, strict_interpreter):
    shape, kwargs = CALLS[case]
    q = torch.randn(shape)
    cos, sin = _tables()
    expected = reference.apply_rope_q(q, cos, sin, **kwargs)
    got = mlarope.apply_rope_q(q.clone(), cos, sin, inplace=inplace, **kwargs)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert strict_interpreter, "no masked load or store was checked"


@pytest.mark.cpu
@pytest.mark.parametrize("case", ["sbhd", "thd"])
def test_key_value_kernels_run_under_a_strict_interpreter(case, strict_interpreter):
    """Forward and backward (the backward's copy loop and head sum)."""
    kwargs = {"layout": case}
    if case == "thd":
        kwargs["cu_seqlens"] = torch.tensor([0, 4, 9], dtype=torch.int32)
    tokens = (9,) if case == "thd" else (3, 3)
    kv = torch.randn(*tokens, 2, 16 + 24, requires_grad=True)
    k_pe = torch.randn(*tokens, 1, 32, requires_grad=True)
    cos, sin = _tables()
    k, v = mlarope.apply_rope_kv(kv, k_pe, cos, sin, k_dim=16, **kwargs)
    (k.sum() + v.sum()).backward()
    k_ref, v_ref = reference.apply_rope_kv(kv.detach(), k_pe.detach(), cos, sin, k_dim=16, **kwargs)
    torch.testing.assert_close(k, k_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(v, v_ref, rtol=0, atol=0)
    assert kv.grad is not None and k_pe.grad is not None
    assert strict_interpreter


@pytest.mark.cpu
def test_racy_control_runs_under_a_strict_interpreter(strict_interpreter):
    """The stress harness's negative control also runs on the CPU lane (its loops have run-time
    bounds: the linear scan over the sequences)."""
    from mlarope.tools.racy_control import racy_rope_inplace

    cos, sin = _tables()
    x = torch.randn(7, 2, 32).to(torch.bfloat16)
    racy_rope_inplace(x, cos, sin, torch.tensor([0, 2, 7], dtype=torch.int32), block_h=1)
    assert strict_interpreter
