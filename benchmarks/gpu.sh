#!/usr/bin/env bash
# Both benchmarks on a GPU, in under 8 minutes: for a session that has an accelerator.
# Installs the cuda12 extra into a fresh venv, then runs speed (fewer rounds on the big model)
# and memory (device peak_bytes_in_use per step in a fresh process each). Results land in
# benchmarks/results/ (and in $OUT when set, for the device tool).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv /tmp/jaxaccum-gpu
. /tmp/jaxaccum-gpu/bin/activate
pip install -q -e '.[cuda12]'
python -c "import jax; print(jax.devices())"
cd benchmarks
timeout 240 python speed.py --rounds 10
timeout 200 python memory.py
if [ -n "${OUT:-}" ]; then cp results/*.json results/*.png "$OUT"/; fi
