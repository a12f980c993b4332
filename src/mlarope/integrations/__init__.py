"""One-call patches that make other libraries' models rotate through mlarope.

Each submodule patches one library in place, in the manner of Liger-Kernel's
``apply_liger_kernel_to_*``, and can undo it:

- :mod:`mlarope.integrations.transformers`: every Multi-head Latent Attention family of the
  installed Hugging Face transformers, found from its code (``apply_mlarope(model or name)``,
  ``apply_mlarope_to_all``, their ``revert_*`` twins, the ``mlarope_patched`` context
  managers, ``family_report``; the DeepSeek-V3 / V2 entry points of before). See
  ``docs/transformers.md``.
- :mod:`mlarope.integrations.megatron`: Megatron-Core's Multi-Latent Attention
  (``apply_mlarope_to_megatron``, ``revert_mlarope_megatron``, ``mlarope_patched``). See
  ``docs/megatron.md``.

Submodules are imported on demand (``from mlarope.integrations import transformers``), so
importing :mod:`mlarope.integrations` imports no third-party library.
"""

__all__ = ["megatron", "transformers"]
