#!/usr/bin/env bash
# Fetches into .whl/maxtext (git-ignored; carried with .whl to the GPU machine) the wheels that bench_peers.py's
# MaxText worker installs into a site directory of its own (peers_maxtext_worker.py): MaxText 0.2.5 without its
# 'cuda12' extra (CUDA 12 jax plugin, transformer-engine: not usable under the image's CUDA 13 jax), plus the
# import closure of its Mixtral layer that the GPU image lacks. Each was found needed by removing it and importing
# the layer on a CPU (2026-12-07); tensorboardx (tokamax's benchmarks only) is left out. cp312 manylinux x86_64,
# as the GPU image runs. Kept apart from .whl/*.whl because typing-extensions, jinja2, markupsafe and packaging
# would otherwise shadow the image's copies in every worker (torch's inductor renders jinja2 templates).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
"${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl/maxtext \
  maxtext==0.2.5 aqtp==0.9.0 qwix==0.1.8 tokamax==0.0.17 einshape==1.0 jaxtyping==0.3.11 wadler-lindig==0.1.8 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 \
  immutabledict==4.3.1 tqdm==4.70.1 omegaconf==2.4.0 jinja2==3.1.6 markupsafe==3.0.3 packaging==26.0 drjax==0.2.1
echo "MaxText wheels in .whl/maxtext: $(ls .whl/maxtext | wc -l) files, $(du -sh .whl/maxtext | cut -f1)"
