"""mlarope.serving: rotate straight into a paged MLA KV cache, and build the decode query.

At every decode step an MLA serving engine rotates ``k_pe``, writes the latent entry into a
paged cache (often FP8) and builds the absorbed query ``[q_nope @ W_UK | rotate(q_pe)]``.
Here each is one launch, with fp32 math, the exact tables and one rounding (or one
quantization) per stored element, for the common cache formats:

- ``"concat"``: vLLM's MLA cache ``[num_blocks, block_size, L + R]``, 16-bit or FP8 e4m3 with a
  per-tensor scale;
- ``"split"``: FlashInfer's paged pair ``(ckv [pages, page_size, L], kpe [pages, page_size, R])``;
- ``"fp8_656"``: FlashMLA's 656-byte FP8 record (512 e4m3 values in four 128-wide tiles, four
  fp32 tile scales, 64 bf16 rope values);
- ``"fp8_584"``: FlashMLA's DeepSeek-V4 cache (per token 448 e4m3 values in seven 64-wide tiles
  and 64 bf16 rope values in a block's data rows, seven UE8M0 tile scales in its scale rows).

- :func:`rope_append_kv_cache`: rotate ``k_pe`` and write each token into ``slot_mapping[t]``;
- :func:`rope_decode_query`: ``[T, H, L + R]`` in the input dtype or FP8 e4m3;
- :func:`rope_inverse_quant_output`: DeepSeek-V4's attention output ``[T, H, D]``, its rope
  slice inverse-rotated and every head quantized to FP8 e4m3 with a UE8M0 scale per 128
  channels, for the FP8 grouped output projection;
- :func:`read_kv_cache`: read entries back, dequantized (tests, debugging, a reference
  attention);
- :mod:`mlarope.serving.reference`: the same in plain PyTorch.

Scales are dequant scales (``value = stored * scale``). The ops are ``torch.compile`` custom
ops that declare what they write, and CUDA-graph capturable. See docs/serving.md.

Layers: ``formats -> checks -> reference -> ops, _plans -> api -> __init__``. Each module imports
from its own layer or the layers before it, never after, and no import circle
(tests/test_serving_layers.py reads this line):

- ``formats``: the data: cache formats, their byte layouts (and the views of them), dtypes;
- ``checks``: every host-side check, one module per op over ``checks.common``, and the checked
  calls the custom ops take;
- ``reference``: the PyTorch spec, the CPU backend and the cache reader;
- ``ops``: the custom ops and the backend dispatch; ``_plans``: the eager launch plans;
- ``api``: the public calls (plan, checks, custom op); ``__init__``: re-exports.
"""

from __future__ import annotations

from . import reference
from .api import rope_append_kv_cache, rope_decode_query, rope_inverse_quant_output
from .formats import CACHE_FORMATS
from .reference import read_kv_cache

__all__ = [
    "CACHE_FORMATS",
    "read_kv_cache",
    "reference",
    "rope_append_kv_cache",
    "rope_decode_query",
    "rope_inverse_quant_output",
]
