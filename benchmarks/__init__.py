"""Developer tooling of the GPU lane: not part of the installed package.

Each file is a script, run from the repository root with the package importable (installed, or
``src`` on ``PYTHONPATH``, as ``scripts/gpu_lane.sh`` does)::

    PYTHONPATH=src python benchmarks/sweep.py --help

- ``sweep.py``: the kernels' launch configurations on the GPU, beside the access patterns' own
  ceilings (how the launch heuristics were chosen; docs/perf_log.md);
- ``kernel_report.py``: what the compiler makes of the kernels for sm_90a, without a GPU;
- ``serving_kernel_report.py``: the same for the serving kernels (``mlarope.serving``);
- ``host_profile.py``: where the host time of one eager decode call goes;
- ``host_variance.py``: how the benchmark's decode host times spread, and why;
- ``q_inplace_layouts.py``: the in-place query kernel by pair layout, direction and tile;
- ``transformers_layers.py``: one real-size transformers MLA attention layer per family,
  unpatched and through mlarope;
- ``transformers_models.py``: a whole two-layer transformers model per family, its training
  step unpatched and patched, with ``step_profile.py``, where a profiled step's time goes;
- ``megatron_layers.py``: one DeepSeek-V3-size Megatron-Core ``MLASelfAttention``, Megatron's
  fused RoPE, mlarope's patch and unfused, built by ``megatron_layer.py`` (the builder the
  Megatron-Core layer test imports).

The benchmark users run, ``python -m mlarope bench``, is in the package
(``mlarope.tools.bench``). The tests import these scripts as ``benchmarks.sweep`` and so on
(pytest puts the repository root on ``sys.path``).
"""
