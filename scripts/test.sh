#!/usr/bin/env bash
# The test command (CPU lane): ruff lint + format check, then pytest with the Triton kernels
# running on the CPU under Triton's interpreter. Extra arguments go to pytest.
#   bash scripts/test.sh                       the pinned lane: torch 2.13.0, triton 3.6.0
#   MLAROPE_LANE=newest bash scripts/test.sh   the newest triton and numpy next to torch 2.13.0
# (scripts/_env.sh makes each lane's environment on first use.)
source "$(dirname "$0")/_env.sh"
python -c "
import os, platform, numpy, torch, triton
print(f'lane {os.environ[\"MLAROPE_LANE\"]}: python {platform.python_version()}, '
      f'torch {torch.__version__}, triton {triton.__version__}, numpy {numpy.__version__}')
"
ruff check .
ruff format --check .
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
python -m pytest -q "$@"
