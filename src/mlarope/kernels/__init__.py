"""Triton kernels and their launchers: ``q`` (query op), ``kv`` (key/value op), ``_lookup``
(the in-kernel position lookup and rotation shared by both). Imported lazily by ``ops``.

Importing this package checks the installed Triton first (``_triton_compat``): an older release
than the kernels support raises an ImportError that names the supported versions."""

from . import _triton_compat  # noqa: F401 (first: the version check)
