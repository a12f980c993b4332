"""Triton kernels and their launchers: ``q`` (query op), ``kv`` (key/value op), ``_lookup``
(the in-kernel position lookup and rotation shared by both). Imported lazily by ``ops``."""
