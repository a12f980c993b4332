"""An on-disk copy of the family report, so ``mlarope info`` need not import transformers' models.

Building the report imports every MLA modeling module (which pulls in much of torch) and probes
each rotary function: a few seconds. The report depends only on the installed files, so it is
stored as JSON under ``$MLAROPE_CACHE_DIR`` (default ``$XDG_CACHE_HOME/mlarope`` or
``~/.cache/mlarope``) with a key that changes whenever any of them could: the versions of
Python, torch, transformers and kernels (``?`` when absent), and the path, size and modification
time of every modeling and configuration file of transformers (and of its auto mappings and
integrations) and of this package. A missing,
unreadable or stale copy is rebuilt; a cache directory that cannot be written is skipped. Only
``family_report(cache=True)`` reads it (``mlarope info``); patching always probes the functions
it replaces.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import pathlib
import sys

_FORMAT = 1


def cache_dir() -> pathlib.Path:
    explicit = os.environ.get("MLAROPE_CACHE_DIR")
    if explicit:
        return pathlib.Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "mlarope"


def installed_version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def key(transformers_root: pathlib.Path) -> str:
    digest = hashlib.sha256()
    digest.update(
        repr(
            (
                _FORMAT,
                sys.version,
                installed_version("torch"),
                installed_version("transformers"),
                # With kernels installed, transformers 5.25 makes some rotary functions
                # nn.Modules: the report depends on whether it is there, and which release.
                installed_version("kernels"),
            )
        ).encode()
    )
    files = [
        *transformers_root.glob("models/*/modeling_*.py"),
        *transformers_root.glob("models/*/configuration_*.py"),
        *transformers_root.glob("models/auto/*.py"),
        *transformers_root.glob("integrations/*.py"),
        # every module of mlarope: the probe runs the library's own ops and reference
        *pathlib.Path(__file__).parents[2].rglob("*.py"),
    ]
    for path in sorted(files):
        try:
            stat = path.stat()
        except OSError:
            continue
        digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _path(transformers_version: str) -> pathlib.Path:
    safe = "".join(c if c.isalnum() or c in ".-_" else "_" for c in transformers_version)
    return cache_dir() / f"transformers-families-{safe}.json"


def load(transformers_version: str, cache_key: str) -> list[dict] | None:
    try:
        data = json.loads(_path(transformers_version).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != cache_key:
        return None
    rows = data.get("rows")
    return rows if isinstance(rows, list) else None


def store(transformers_version: str, cache_key: str, rows: list[dict]) -> None:
    path = _path(transformers_version)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": cache_key, "rows": rows}), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass
