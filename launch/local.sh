#!/bin/bash
# Single host: ONE process drives every local GPU (no jax.distributed, no NVSHMEM needed).
#   CONFIG=configs/tiny_cpu.py launch/local.sh --steps 300
# DRY_RUN=1 prints the command instead of running it.
set -euo pipefail

: "${CONFIG:?set CONFIG to a config file, e.g. CONFIG=configs/tiny_cpu.py}"
repo_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "${repo_dir}/launch/env.sh"

python_bin="${PYTHON:-${repo_dir}/.venv/bin/python}"
[[ -x "${python_bin}" ]] || python_bin=python
cmd=("${python_bin}" -m megascale_jax.train --config "${CONFIG}" "$@")

if [[ "${DRY_RUN:-0}" == "1" ]]; then
  printf '%q ' "${cmd[@]}"
  printf '\n'
  exit 0
fi
cd "${repo_dir}"
exec "${cmd[@]}"
