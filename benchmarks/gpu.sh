#!/usr/bin/env bash
# Both benchmarks on a GPU, in under 8 minutes: for a session that has an accelerator.
# Installs the cuda12 extra into a fresh venv, then runs speed (fewer rounds on the big model)
# and memory (device peak_bytes_in_use per step in a fresh process each). Results land in
# benchmarks/results/*-gpu.{json,png} (and in $OUT when set, for the device tool);
# `python benchmarks/report.py gpu` prints them as tables.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv /tmp/jaxaccum-gpu
. /tmp/jaxaccum-gpu/bin/activate
pip install -q -e '.[cuda12]'
python -c "import jax; print(jax.devices())"
cd benchmarks
timeout 240 python speed.py --rounds 10
timeout 200 python memory.py
python report.py gpu
if [ -n "${OUT:-}" ]; then cp results/*-gpu.* "$OUT"/; fi
