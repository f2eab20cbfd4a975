#!/usr/bin/env bash
# Every single-device benchmark on one GPU, in under 10 minutes. UNTESTED ON A GPU: no device
# was lent to the sessions that wrote it. A dry run on CPU checks the steps' arguments and
# writes NAME-dryrun results instead of overwriting the CPU ones:
#   JAX_PLATFORMS=cpu GPU_SH_ALLOW_CPU=1 BENCH_RESULTS_SUFFIX=dryrun benchmarks/gpu.sh
#
# Uses a Python whose jax already sees a GPU (PYTHON, default python3; the repository is put on
# PYTHONPATH, nothing is installed); failing that, a fresh venv with the cuda12 extra (needs
# the network). Then, each step under its own time limit so that one overrun cannot cost the
# others (seconds, ~9.5 min in all):
#
#   speed.py       140  time per optimizer step, k = 1..64, 10 rounds
#   memory.py      150  memory_analysis() at k = 1, 8, 64 and device peak_bytes_in_use (a fresh
#                       process per implementation and k)
#   families.py    170  the model families (MLP, CNN, transformer LM, bf16) at k = 1, 8, 64
#   dropout.py     110  per-example dropout masks under threefry2x32 and rbg, k = 8
#
# Not run: data_parallel.py and sharded.py need 8 devices (on CPU they ask XLA for 8 host
# devices); plan.py's budgets are sized for the CPU; loops.py (the loop study) is about XLA:CPU;
# compile_times.py and model_memory.py back CPU findings.
# Results land in benchmarks/results/NAME-gpu.{json,png} (_common.result_path adds the backend
# name off CPU), and in $OUT (a tar of them and the log) when set, for the device tool. Print
# them (the model families' models-gpu.json included) with `python benchmarks/report.py gpu`.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [ "$("$PY" -c 'import jax; print(jax.default_backend())' 2>/dev/null)" != gpu ] \
    && [ -z "${GPU_SH_ALLOW_CPU:-}" ]; then
  echo "no GPU jax in $PY: installing the cuda12 extra into /tmp/jaxaccum-gpu"
  python3 -m venv /tmp/jaxaccum-gpu && /tmp/jaxaccum-gpu/bin/pip install -q -e '.[cuda12]' \
    && PY=/tmp/jaxaccum-gpu/bin/python || { echo "cannot install jax[cuda12]"; exit 1; }
fi
"$PY" -c 'import jax; print(jax.__version__, jax.devices())' || exit 1
LOG=${OUT:-/tmp}/gpu-benchmarks.log
cd benchmarks
failed=()
step() {  # step SECONDS SCRIPT ARGS...: a failure or timeout is reported, the rest still run
  local seconds=$1; shift
  echo "=== $* (limit ${seconds}s)" | tee -a "$LOG"
  local start=$SECONDS
  timeout "$seconds" "$PY" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== $1: rc $rc in $((SECONDS - start))s" | tee -a "$LOG"
  [ "$rc" = 0 ] || failed+=("$1")
}
step 140 speed.py --rounds 10
step 150 memory.py --ks 1 8 64
step 170 families.py --ks 1 8 64 --rounds 3
step 110 dropout.py --rounds 3 --impls threefry2x32 rbg
SUFFIX=${BENCH_RESULTS_SUFFIX:-gpu}
"$PY" report.py "$SUFFIX" 2>&1 | tee -a "$LOG"
if [ -n "${OUT:-}" ]; then tar cf "$OUT/results-$SUFFIX.tar" results/*-"$SUFFIX".* 2>/dev/null; fi
echo "failed: ${failed[*]:-none}" | tee -a "$LOG"
[ ${#failed[@]} = 0 ]
