"""Which implementation Megatron-LM's test file gets, chosen before it is imported.

``install("mlarope")`` puts :mod:`mlarope.compat.megatron` in ``sys.modules`` under the name
of Megatron-Core's fused module (``megatron.core.fusions.fused_mla_yarn_rope_apply``), so the
test file's ``from megatron.core.fusions.fused_mla_yarn_rope_apply import ...`` binds mlarope's
functions; ``install("megatron")`` leaves Megatron-Core's own module. The test file itself is
not modified.
"""

from __future__ import annotations

import importlib
import sys

FUSED_MODULE = "megatron.core.fusions.fused_mla_yarn_rope_apply"
IMPLS = ("megatron", "mlarope")


def install(impl: str):
    """Bind ``FUSED_MODULE`` to ``impl``'s module and return that module."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "megatron":
        return importlib.import_module(FUSED_MODULE)
    from mlarope.compat import megatron as ours

    parent = importlib.import_module(FUSED_MODULE.rpartition(".")[0])
    sys.modules[FUSED_MODULE] = ours
    setattr(parent, FUSED_MODULE.rpartition(".")[2], ours)
    return ours
