"""``python -m mlarope bench``: the GPU benchmark (docs/benchmarks.md).

One run on one GPU measures, for DeepSeek-V3 shapes (``H = 128, N = 128, R = 64, K = V = 128``,
bf16), every case x op x implementation:

- the ceiling: a device-to-device copy of a large bf16 tensor (bytes = read + write);
- ``mlarope``: the public API for the forwards, the op-level backward functions of
  :mod:`mlarope.ops` for the backwards (``rope_q`` / ``rope_q_`` with
  ``transpose=True``, the latter what ``inplace_backward=True`` runs;
  ``rope_kv_backward``), so only the kernel is timed;
- ``reference``: :mod:`mlarope.reference` in eager mode (its forward, and its hand-written
  transpose for the backward: the same functions the CPU backend runs);
- ``compile``: the same reference functions under ``torch.compile``;
- ``megatron``: Megatron-Core's fused MLA RoPE (``fused_apply_mla_rope_for_q/kv``), when
  ``megatron.core`` imports; its backward is its autograd function's ``backward``, called
  directly on the graph node of one forward.

Effective bandwidth is the bytes of :func:`.model.bytes_moved` (the useful bytes, the same for
every implementation) over the median time, and is reported against the copy measured in the
same run. Timing: ``triton.testing.do_bench`` (L2 flushed before every call; quantiles 0.2, 0.5,
0.8) where the data is many times the L2, CUDA-graph replay over rotated input sets (so each
call reads data that is not in the L2) for the decode sizes, and, for the decode forwards, the
eager host overhead: wall-clock per call of a loop of calls with one sync at the end.

``--cpu-smoke`` runs tiny shapes on the CPU (host timers) to check the harness end to end;
``--dry-run`` prints the plan and the bytes model without running anything.
"""

# One concept per module, in the order the data flows: model (the bytes model and the targets),
# cases (batch shapes and their inputs), timers, impls (the implementations compared), report
# (rows, verdicts, tables, JSON, plot, merge) and cli (the options and the run).
from .cli import add_arguments, main, run

__all__ = ["add_arguments", "main", "run"]
