"""The commands a user runs (``mlarope COMMAND``, ``python -m mlarope COMMAND``), beside the
library: nothing in the library imports this package.

- :mod:`.cli`: the command line, ``info``, and the dispatch to the commands below;
- :mod:`.demo`: a DeepSeek-V3-shaped MLA attention step through mlarope, checked;
- :mod:`.stress`: randomized trials of the kernels against the fp64 reference, with the racy
  negative control of :mod:`.racy_control` and the error model of :mod:`.errmodel`;
- :mod:`.bench`: the GPU benchmark (a package: bytes model, cases, timers, implementations,
  report, the command);
- :mod:`._console`: their output, rich on a terminal and plain text elsewhere.

The launch-configuration sweep and the compiled-code report are developer tooling for the GPU
lane and live outside the package, in the repository's ``benchmarks/``.
"""
