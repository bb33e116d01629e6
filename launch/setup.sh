#!/usr/bin/env bash
# Sets up .venv with Python 3.12 (jax 0.11 needs it) and installs megascale-jax in editable mode.
#   bash launch/setup.sh            # the package (CPU jax)
#   bash launch/setup.sh test       # + test tools, and MaxText's wheels for the peers benchmark's CPU test
#   bash launch/setup.sh test,bench # + plotting
#   bash launch/setup.sh gpu        # + CUDA 13 jaxlib plugin and jax-triton, on a GPU machine
# A Python 3.12 is looked for in $PYTHON, on PATH (python3.12, python3), under pyenv and /usr(/local)/bin.
# Re-running is cheap: nothing is reinstalled unless setup.cfg or the extras changed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
extras="${1:-}"

is_py312() { [ -n "$1" ] && "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; }

find_python() {
  local candidates=("${PYTHON:-}" python3.12 python3)
  if command -v pyenv >/dev/null 2>&1; then
    candidates+=("$(pyenv root)"/versions/3.12*/bin/python3.12)
  fi
  candidates+=("$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12)
  for c in "${candidates[@]}"; do
    if is_py312 "$c"; then command -v "$c" || echo "$c"; return 0; fi
  done
  return 1
}

if ! is_py312 .venv/bin/python; then
  if ! py=$(find_python); then
    echo "setup: no Python 3.12 found (jax 0.11 requires Python 3.12)." >&2
    echo "  Install one, e.g. 'pyenv install 3.12' or 'apt-get install python3.12 python3.12-venv'," >&2
    echo "  or point PYTHON=/path/to/python3.12 at it, then re-run: bash launch/setup.sh $extras" >&2
    exit 1
  fi
  echo "setup: creating .venv with $py ($("$py" --version))"
  rm -rf .venv
  "$py" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi

stamp=".venv/.megascale-installed-$(cat setup.cfg pyproject.toml | sha256sum | cut -c1-16)-${extras//,/_}"
if [ ! -f "$stamp" ]; then
  spec="."
  [ -n "$extras" ] && spec=".[$extras]"
  echo "setup: installing megascale-jax $spec into .venv"
  .venv/bin/python -m pip install -q -e "$spec"
  rm -f .venv/.megascale-installed-*
  touch "$stamp"
fi

# The peers benchmark's MaxText worker test installs these into a directory of its own (never into .venv).
if [[ ",$extras," == *",test,"* ]]; then
  PYTHON=.venv/bin/python bash benchmarks/get_maxtext_wheels.sh 2>/dev/null \
    || echo "setup: MaxText's wheels not fetched; tests/test_bench_peers.py's MaxText test will be skipped" >&2
fi
