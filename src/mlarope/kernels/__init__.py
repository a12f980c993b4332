"""Triton kernels and their launchers, imported lazily by ``ops``:

- ``q``: the query op (forward and backward, in place and out of place);
- ``kv``: the key/value op (forward, and the backward with the ``k_pe`` head sum);
- ``lookup``: where each token's position comes from (and the ``cu_seqlens`` search kernel);
- ``rotation``: table rows and the pair rotation in fp32, shared by both ops;
- ``_tiles``: the grid of token x head tiles; ``_launch``: the direct launch path;
  ``_triton_compat``: what differs between the supported Triton releases.

Importing this package checks the installed Triton first (``_triton_compat``): an older release
than the kernels support raises an ImportError that names the supported versions."""

from . import _triton_compat  # noqa: F401 (first: the version check)
