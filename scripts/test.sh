#!/usr/bin/env bash
# The test command (CPU lane): ruff lint + format check, then pytest with the Triton kernels
# running on the CPU under Triton's interpreter. Extra arguments go to pytest.
#   bash scripts/test.sh                       the pinned lane: scripts/pinned-constraints.txt
#   MLAROPE_LANE=newest bash scripts/test.sh   the newest triton, numpy, transformers and kernels
#                                              next to torch 2.13.0
# (scripts/_env.sh makes each lane's environment on first use.)
source "$(dirname "$0")/_env.sh"
python - <<'PY'
import importlib.metadata as md
import os
import platform


def version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


names = ("torch", "triton", "numpy", "transformers", "kernels")
print(f"lane {os.environ['MLAROPE_LANE']}: python {platform.python_version()}, "
      + ", ".join(f"{n} {version(n)}" for n in names))
PY
ruff check .
ruff format --check .
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
python -m pytest -q "$@"
