# Sourced by the other scripts: make (once) and enter the project's virtual environment.
# CPU machines take torch 2.13.0's CPU build (a looser pin would pull a multi-GB CUDA build).
# numpy < 2.4: Triton 3.6's interpreter converts 1-element arrays to ints, which numpy 2.4 rejects.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MLAROPE_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import mlarope, pytest, ruff" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "torch==2.13.0" "triton==3.6.0" "numpy<2.4"
  "$VENV/bin/python" -m pip install -q -e "$ROOT[dev,bench]"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
