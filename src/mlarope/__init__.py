"""mlarope: fused, race-free, deterministic rotary position embedding for Multi-head Latent
Attention (DeepSeek-V2/V3 and their kin), in PyTorch and Triton.

Public API (docs/design.md, README.md):

- :class:`YarnConfig`: RoPE / YaRN tables, exact to fp32 rounding;
- :class:`RopeConfig`: the tables of every rope type transformers knows (``from_hf(config)``);
- :func:`apply_rope_q`: rotate the rope tail of queries ``[..., H, N + R]``;
- :func:`apply_rope_qk`: rotate two tensors of the same tokens (a rotary function's ``q, k``);
- :func:`apply_rope_kv`: split ``kv`` and attach the rotated shared ``k_pe`` to every head;
- :func:`rmsnorm_rope_latent`: RMSNorm the latent and rotate ``k_pe`` from ``[..., L + R]``;
- :mod:`mlarope.reference`: the same semantics in plain PyTorch.
"""

from __future__ import annotations

from . import reference
from ._checks import ROPE_DIMS as SUPPORTED_ROPE_DIMS
from .api import apply_rope_kv, apply_rope_q, apply_rope_qk
from .latent import rmsnorm_rope_latent
from .rope import RopeConfig
from .yarn import YarnConfig

__all__ = [
    "SUPPORTED_ROPE_DIMS",
    "RopeConfig",
    "YarnConfig",
    "__version__",
    "apply_rope_kv",
    "apply_rope_q",
    "apply_rope_qk",
    "reference",
    "rmsnorm_rope_latent",
]
__version__ = "0.1.0"
