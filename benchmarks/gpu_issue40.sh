#!/usr/bin/env bash
# Issue 40's figures in one device call on one GPU (H100 or H200): the 8B shape, the same-host plane off
# against on, full EAGLE-3 with the defaults, compact=True, DSpark, each against its colocated forward, in
# alternating rounds, every timed batch verified bit for bit. LENGTHS=lognormal (default) or full.
#   bash benchmarks/gpu_issue40.sh                          # lognormal, prefetch 4 (the default), 3 rounds x 100 batches: ~8 min on an H100
#   LENGTHS=full STEPS=30 bash benchmarks/gpu_issue40.sh    # full rows beside them: ~4 min
# Expects the wheels spec-serve needs there (pyzmq, click, prometheus-client) in .whl/ (see BENCHMARKS.md).
# Writes $OUT/issue40-$LENGTHS.json, the table ($OUT/issue40-$LENGTHS.log) and the worker's slab lines.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
LENGTHS=${LENGTHS:-lognormal}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L
timeout "${BENCH_TIMEOUT:-560}" python3 benchmarks/bench_e2e.py --gpu-8b --devices cuda:0 \
  --only colocated,colocated_dspark,remote_1w_compact,remote_1w_auto,remote_1w_dspark,samehost_1w \
  --lengths "$LENGTHS" --prefetch "${PREFETCH:-4}" --steps "${STEPS:-100}" --repeat "${REPEAT:-3}" \
  --json "$OUT/issue40-$LENGTHS.json" --log-dir /tmp/issue40-logs 2>&1 | tail -n 30 | tee "$OUT/issue40-$LENGTHS.log"
grep -h "host_slab_made\|Traceback\|Error" /tmp/issue40-logs/*.log > "$OUT/issue40-$LENGTHS-worker.txt" 2>/dev/null
