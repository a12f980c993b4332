"""One-call patches that make other libraries' models rotate through mlarope.

Each submodule patches one library in place, in the manner of Liger-Kernel's
``apply_liger_kernel_to_*``, and can undo it:

- :mod:`mlarope.integrations.transformers`: Hugging Face transformers' DeepSeek-V3 and
  DeepSeek-V2 attention (``apply_mlarope_to_deepseek_v3``, ``apply_mlarope_to_deepseek_v2``,
  their ``revert_*`` twins and the ``mlarope_patched`` context manager). See
  ``docs/transformers.md``.
- :mod:`mlarope.integrations.megatron`: Megatron-Core's Multi-Latent Attention
  (``apply_mlarope_to_megatron``, ``revert_mlarope_megatron``, ``mlarope_patched``). See
  ``docs/megatron.md``.

Submodules are imported on demand (``from mlarope.integrations import transformers``), so
importing :mod:`mlarope.integrations` imports no third-party library.
"""

__all__ = ["megatron", "transformers"]
