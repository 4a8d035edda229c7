#!/usr/bin/env bash
# The GPU equality matrix (benchmarks/gpu_matrix.py) in one device call on an H200 machine: every remote
# data path at the Llama-3.1-8B shape, every batch torch.equal to the colocated forward. Expects the
# pyzmq wheel in .whl/ (see BENCHMARKS.md). Writes gpu_matrix.json, the log and worker logs to $OUT.
#   RUN_GPU_TESTS=1  also run the `-m gpu` tests afterwards (about 2 more minutes)
#   MATRIX_ARGS      extra arguments, e.g. "--batches 3" or "--only compact"
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L | tee "$OUT/machine.txt"
timeout "${MATRIX_TIMEOUT:-470}" python3 benchmarks/gpu_matrix.py --json "$OUT/gpu_matrix.json" ${MATRIX_ARGS:-} \
  2>&1 | grep -v "^Loading weights" | tee "$OUT/gpu_matrix.log"
status=${PIPESTATUS[0]}
if [ -n "${RUN_GPU_TESTS:-}" ]; then
  # The files with gpu tests (the GPU machine lacks some CPU-only test dependencies, e.g. hypothesis).
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu -s --durations=15 \
    ${GPU_TESTS:-tests/worker/test_packing.py tests/worker/test_hf_spread.py tests/paths/test_reply_memory.py tests/client/test_compact_remote.py tests/paths/test_nccl_binding.py tests/paths/test_pairgroup.py} \
    2>&1 | tee "$OUT/gpu_tests.log"
fi
exit "$status"
