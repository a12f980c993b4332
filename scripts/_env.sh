# Sourced by the other scripts: make (once) and enter the virtual environment of a test lane.
#
#   MLAROPE_LANE=pinned (default)  .venv         torch 2.13.0 (CPU build), triton 3.6.0 (the GPU
#                                                lane's), numpy as pip pairs with them
#   MLAROPE_LANE=newest            .venv-newest  torch 2.13.0 (CPU build), then the newest triton
#                                                and numpy pip resolves next to it, at creation
#   MLAROPE_VENV=DIR               another directory for the lane's environment
#
# torch is installed first and exactly: CPU machines then take its CPU build, where a looser
# requirement pulls a multi-GB CUDA build. A lane's environment is made when missing or made
# for another lane; delete .venv-newest to resolve the newest versions again.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LANE="${MLAROPE_LANE:-pinned}"
case "$LANE" in
  pinned) VENV="${MLAROPE_VENV:-$ROOT/.venv}"; LANE_PINS=("triton==3.6.0") ;;
  newest) VENV="${MLAROPE_VENV:-$ROOT/.venv-newest}"; LANE_PINS=() ;;
  *) echo "MLAROPE_LANE must be 'pinned' or 'newest', not '$LANE'" >&2; exit 2 ;;
esac
TORCH_PIN="torch==2.13.0"
STAMP="$VENV/mlarope-lane.txt"
WANT="$LANE $TORCH_PIN ${LANE_PINS[*]:-}"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ] \
    || ! "$VENV/bin/python" -c "import mlarope, pytest, ruff" 2>/dev/null; then
  echo "scripts/_env.sh: making the $LANE lane's environment in $VENV" >&2
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "$TORCH_PIN"
  # pinned: triton 3.6.0 and the newest numpy; newest: the newest of both (--upgrade also
  # moves an environment made by the other lane).
  "$VENV/bin/python" -m pip install -q --upgrade "$TORCH_PIN" "${LANE_PINS[@]:-triton}" numpy
  "$VENV/bin/python" -m pip install -q -e "$ROOT[dev,bench]"
  echo "$WANT" >"$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export MLAROPE_LANE="$LANE"
cd "$ROOT"
