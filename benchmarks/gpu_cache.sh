#!/usr/bin/env bash
# One device call on one H100 (or H200) for the supervision cache (issue 37, docs/cache.md): its GPU test
# (a cuda:0 client reading and writing through pinned memory) and benchmarks/bench_cache.py at the
# Llama-3.1-8B shape (epoch 1 live+filling and epoch 2 all hits against the colocated forward).
# Expects the wheels spec-serve needs (pyzmq, click, prometheus-client, pytest) in .whl/, as gpu_session.sh.
# Writes logs and JSON to $OUT (or ./gpu-out).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L | tee "$OUT/machine.txt"
df -h /tmp | tee -a "$OUT/machine.txt"
timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider -m gpu -s tests/system/test_cache.py 2>&1 \
  | tee "$OUT/gpu_cache_tests.log"
timeout "${BENCH_TIMEOUT:-360}" python3 benchmarks/bench_cache.py --gpu-8b --device cuda:0 --prefetch 4 \
  --cache-dir "${CACHE_DIR:-/tmp}" --json "$OUT/cache_bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/cache_bench.log"
