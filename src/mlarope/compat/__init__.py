"""Drop-in replacements for other libraries' MLA RoPE entry points.

Each submodule mirrors one library's function names, signatures and semantics on top of
mlarope's public API (:func:`mlarope.apply_rope_q`, :func:`mlarope.apply_rope_kv`), so that
switching is an import change:

- :mod:`mlarope.compat.megatron`: Megatron-Core's ``fused_mla_yarn_rope_apply`` functions
  (``fused_apply_mla_rope_for_q``, ``fused_apply_mla_rope_for_kv``, ``fused_mla_rope_inplace``,
  ``fused_mla_rope_out_of_place``, ``fused_mla_rope_kv_split``). See ``docs/megatron.md``.

Submodules are imported on demand (``from mlarope.compat import megatron``), so importing
:mod:`mlarope.compat` costs nothing.
"""

__all__ = ["megatron"]
