"""pytest plugin of ``scripts/megatron_tests.py``: ``MLAROPE_MEGATRON_IMPL`` (``megatron`` or
``mlarope``) picks the fused MLA RoPE module Megatron-LM's test file imports (``mlarope_swap``).
Loaded as the scratch folder's root conftest, before the test file is collected."""

from __future__ import annotations

import os

import mlarope_swap

mlarope_swap.install(os.environ.get("MLAROPE_MEGATRON_IMPL", "megatron"))
