#!/usr/bin/env bash
# The test command (CPU lane): ruff lint + format check, then pytest with the Triton kernels
# running on the CPU under Triton's interpreter. Extra arguments go to pytest.
source "$(dirname "$0")/_env.sh"
ruff check .
ruff format --check .
export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
python -m pytest -q "$@"
