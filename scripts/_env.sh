# Sourced by the other scripts: make (once) and enter the virtual environment of a test lane.
#
#   MLAROPE_LANE=pinned (default)  .venv         exactly scripts/pinned-constraints.txt: torch
#                                                2.13.0 (CPU build), triton 3.6.0 (the GPU
#                                                lane's), transformers, kernels and every other
#                                                package at the versions of the last green run
#   MLAROPE_LANE=newest            .venv-newest  torch 2.13.0 (CPU build), then the newest
#                                                triton, numpy, transformers and kernels pip
#                                                resolves next to it, at creation
#   MLAROPE_VENV=DIR               another directory for the lane's environment
#
# torch is installed first and exactly: CPU machines then take its CPU build, where a looser
# requirement pulls a multi-GB CUDA build. A lane's environment is made when missing, made for
# another lane or (pinned) for other pins; delete .venv-newest to resolve the newest versions
# again. Making one takes a minute or two: pip prints each package as it goes.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LANE="${MLAROPE_LANE:-pinned}"
PINS="$ROOT/scripts/pinned-constraints.txt"
case "$LANE" in
  pinned) VENV="${MLAROPE_VENV:-$ROOT/.venv}"; CONSTRAINTS=(-c "$PINS")
          PINS_HASH="$(sha256sum "$PINS" | cut -c1-16)" ;;
  newest) VENV="${MLAROPE_VENV:-$ROOT/.venv-newest}"; CONSTRAINTS=(); PINS_HASH="-" ;;
  *) echo "MLAROPE_LANE must be 'pinned' or 'newest', not '$LANE'" >&2; exit 2 ;;
esac
TORCH_PIN="torch==2.13.0"
STAMP="$VENV/mlarope-lane.txt"
WANT="$LANE $TORCH_PIN pins $PINS_HASH"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ] \
    || ! "$VENV/bin/python" -c "import mlarope, pytest, ruff" 2>/dev/null; then
  say() { echo "scripts/_env.sh ($LANE lane): $*" >&2; }
  # pip's progress lines as they come; its whole output when it fails, and its exit status.
  pip_install() {
    local log rc
    log=$(mktemp)
    { "$VENV/bin/python" -m pip install --progress-bar off "${CONSTRAINTS[@]}" "$@" 2>&1
      echo "$?" >"$log.rc"; } | tee "$log" \
      | { grep --line-buffered -E "^(Collecting|  Downloading|Installing|Successfully|ERROR)" \
          || true; } >&2
    rc=$(cat "$log.rc")
    [ "$rc" = 0 ] || { say "pip install $* failed ($rc):"; cat "$log" >&2; }
    rm -f "$log" "$log.rc"
    return "$rc"
  }
  say "making the environment in $VENV (a minute or two)"
  if [ -e "$VENV" ] && [ ! -e "$STAMP" ] && [ -n "$(ls -A "$VENV" 2>/dev/null)" ]; then
    # Not one of ours (no stamp): never delete a directory somebody named (MLAROPE_VENV).
    say "$VENV exists and was not made by this script: remove it or name another directory"
    exit 1
  fi
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  say "[1/4] pip"
  pip_install --upgrade pip
  say "[2/4] $TORCH_PIN, the CPU build (about 200 MB)"
  pip_install "$TORCH_PIN"
  say "[3/4] mlarope with its test and benchmark extras (.[dev,bench])"
  pip_install -e "$ROOT[dev,bench]"
  if [ "$LANE" = newest ]; then
    say "[4/4] the newest triton, numpy, transformers and kernels"
    pip_install --upgrade "$TORCH_PIN" triton numpy transformers kernels
  else
    say "[4/4] (pinned: nothing newer)"
  fi
  "$VENV/bin/python" -c "import mlarope, pytest, ruff" || { say "the environment is incomplete"; exit 1; }
  echo "$WANT" >"$STAMP"
  say "ready"
fi
export PATH="$VENV/bin:$PATH"
export MLAROPE_LANE="$LANE"
cd "$ROOT"
