"""``python -m mlarope.tools.bench.serving``: the serving ops on one GPU, in one run, side by side.

DeepSeek-V3 shapes (``L = 512``, ``R = 64``, ``H = 128`` query heads, bf16 activations, fp32
YaRN tables of 32,768 positions, pages of 64 tokens) for a prefill batch (16,384 tokens) and
decode batches (1, 8, 64, 256 tokens); DeepSeek-V4's for its FP8 cache (``fp8_584``: ``L =
448``) and its attention output (``[T, 128, 512]``, V4-Pro's heads, 16 groups of 8: the inverse
RoPE with FP8 quantization for the grouped output projection). For each cache format, the
decode query and the output op:

- the bytes model (:func:`bytes_moved`) and the time: ``do_bench`` with the L2 flushed for the
  prefill batch, CUDA-graph replay over rotated input sets for decode batches (the method of
  ``mlarope.tools.bench``);
- % of the device-to-device copy bandwidth measured at the start of the run (1 GiB), and the
  time of a copy of the same bytes (what a plain copy reaches at that size);
- decode: the host time of an eager call (median of loops of ``--host-calls`` calls), with a
  one-element torch op's host time measured right after it;
- the unfused sequence it replaces: mlarope's rotation (``apply_rope_q``), ``torch.cat``, the
  FP8 quantization and ``index_copy_`` into the cache (the output op: the inverse rotation,
  then DeepSeek's ``act_quant`` recipe in torch: block amax, UE8M0 scale, division, clamp,
  conversion); its time and host time, the speed-up, and a check that both wrote the same
  values (within one rounding or one e4m3 step);
- FlashInfer's ``rope_quantize_fp8_append_paged_kv_cache`` (the split FP8 cache),
  ``mla_rope_quantize_fp8`` (the FP8 query) and ``append_paged_mla_kv_cache`` (the split bf16
  cache; a plain append without rotation, handed the rotated values) on the same inputs, when
  ``flashinfer`` imports (it is not a dependency).

Targets (judged on the GPU): prefill >= 90 % of the copy; decode host time <= 15 us.
``--sweep`` also times other launch configurations and the integer FP8 encoder on the prefill
batch, and the decode query's launch configurations at each decode batch. Writes
``OUT/serving.json`` and ``OUT/serving.md`` with ``--out OUT``.
What the compiler makes of the serving kernels (no GPU) is
``python benchmarks/serving_kernel_report.py``.

The package: ``model`` (cases, bytes model), ``inputs``, ``calls`` (ours, the unfused
sequence, the comparison), ``flashinfer``, ``launch_configs`` (the ``--sweep``), ``report``,
``run`` (the command and the timing of a row).
"""

from __future__ import annotations

from .calls import compare, ours, unfused
from .inputs import Inputs, make_inputs
from .model import CASES, OPS, OPS_BY_KEY, SMOKE_CASES, Dims, OpSpec, bytes_moved, table_bytes
from .run import add_arguments, main, run

__all__ = [
    "CASES",
    "OPS",
    "OPS_BY_KEY",
    "SMOKE_CASES",
    "Dims",
    "Inputs",
    "OpSpec",
    "add_arguments",
    "bytes_moved",
    "compare",
    "main",
    "make_inputs",
    "ours",
    "run",
    "table_bytes",
    "unfused",
]
