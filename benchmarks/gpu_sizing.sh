#!/usr/bin/env bash
# Supply and demand on one GPU (benchmarks/bench_sizing.py, issue 38) in one device call: the Llama-3.1-8B shape,
# one worker, 1 to 3 ranks with an emulated trainer step; the trainers' wait share and the broker's advice as
# the ranks grow, every reply torch.equal to the colocated forward. Expects the wheels in .whl/ (see
# BENCHMARKS.md). Writes sizing.json, the log and the worker's log tail to $OUT. About 3 minutes on an H100.
#   SIZING_ARGS  extra arguments, e.g. "--compute-factor 1.5" or "--max-ranks 4"
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L | tee "$OUT/machine.txt"
timeout "${SIZING_TIMEOUT:-330}" python3 benchmarks/bench_sizing.py --gpu-8b --device cuda:0 --json "$OUT/sizing.json" \
  --log-dir /tmp/sizing-logs ${SIZING_ARGS:-} 2>&1 | grep -v "^Loading weights" | tee "$OUT/sizing.log"
status=${PIPESTATUS[0]}
tail -n 40 /tmp/sizing-logs/*.log > "$OUT/worker_logs_tail.txt" 2>/dev/null
exit "$status"
