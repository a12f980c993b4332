"""Which path a call takes, from the state of torch and the process: the backend a tensor runs
on, compile tracing, autograd, in-place writes autograd forbids, ``MLAROPE_VALIDATE``.

Predicates only (no checks that raise, no launches): every layer of the host path asks them,
so they sit below all of it (a leaf: it imports nothing of the package).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor
from torch._C import _functorch
from torch.autograd import forward_ad as _fwad


def use_triton(t: Tensor) -> bool:
    """Triton kernels for CUDA tensors, and for CPU tensors under ``TRITON_INTERPRET=1``."""
    if t.dtype == torch.float64:
        return False
    if t.is_cuda:
        return True
    return t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1"


def device_key(t: torch.Tensor):
    """Triton launches on the current device, not the tensor's: a plan is per current device.
    On the CPU the backend follows TRITON_INTERPRET (:func:`use_triton`), read on every call."""
    if t.is_cuda:
        return torch._C._cuda_getDevice()
    return ("cpu", os.environ.get("TRITON_INTERPRET"))


def compiling() -> bool:
    return torch.compiler.is_compiling()


def needs_autograd(*tensors: Tensor) -> bool:
    """Whether an application to ``tensors`` must go through the autograd functions: grad mode
    is on and one of them requires grad, forward-mode AD is on, or one of them is a
    ``torch.func`` gradient wrapper (which only the autograd functions unwrap for the kernels).
    """
    if _fwad._current_level >= 0:
        return True
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return True
    return _functorch.maybe_current_level() is not None and any(
        _functorch.is_gradtrackingtensor(t) for t in tensors
    )


def autograd_refuses_in_place(t: Tensor) -> bool:
    """Whether autograd forbids writing ``t`` in place: a leaf that requires grad, or a view of
    one (``leaf[..., :]``, ``leaf.view(...)``; by ``_base``, which Dynamo traces where it cannot
    trace ``_is_view()``)."""
    if not (t.requires_grad and torch.is_grad_enabled()):
        return False
    if t.is_leaf:
        return True
    base = t._base
    return base is not None and base.is_leaf


# os.environ's own bytes mapping (CPython on POSIX): os.environ.get costs about 1.2 us when the
# variable is unset (a KeyError inside), a tenth of a decode call's budget; this is a dict
# lookup. os.environ updates it on every change, so monkeypatched values are seen.
_ENVIRON_BYTES = getattr(os.environ, "_data", None)
_VALIDATE_KEY = b"MLAROPE_VALIDATE"


def env_validation() -> bool:
    """Whether ``MLAROPE_VALIDATE`` is set to something other than ``""`` or ``"0"``."""
    if isinstance(_ENVIRON_BYTES, dict) and os.name == "posix":
        value = _ENVIRON_BYTES.get(_VALIDATE_KEY)
        return value is not None and value not in (b"", b"0")
    return os.environ.get("MLAROPE_VALIDATE", "0") not in ("", "0")
