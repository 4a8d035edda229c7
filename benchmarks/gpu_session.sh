#!/usr/bin/env bash
# One device call on an H200 machine (the `device` tool), doing every GPU check in one go:
# the GPU tests (NCCL pair group and binding) and the Llama-3.1-8B-shaped benchmark.
# Expects the wheels spec-serve needs there (pyzmq, pytest, ...) in .whl/ (see BENCHMARKS.md).
# Writes logs and JSON to $OUT (or ./gpu-out).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L | tee "$OUT/machine.txt"
python3 -c "import torch, transformers, zmq; print('torch', torch.__version__, 'transformers', transformers.__version__, 'pyzmq', zmq.__version__, 'gpus', torch.cuda.device_count())" | tee -a "$OUT/machine.txt"
if [ "${SKIP_TESTS:-}" = "" ]; then
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -m gpu -s ${GPU_TESTS:-tests/worker/test_packing.py tests/worker/test_hf_spread.py tests/paths/test_reply_memory.py tests/client/test_compact_remote.py tests/paths/test_nccl_binding.py tests/paths/test_pairgroup.py} 2>&1 | tee "$OUT/gpu_tests.log"
fi
if [ "${SKIP_BENCH:-}" = "" ]; then
  timeout "${BENCH_TIMEOUT:-420}" python3 benchmarks/bench_e2e.py --gpu-8b --devices "${DEVICES:-cuda:0,cuda:1}" \
    --json "$OUT/bench.json" --log-dir /tmp/bench-logs ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
  tail -n 40 /tmp/bench-logs/*.log > "$OUT/worker_logs_tail.txt" 2>/dev/null
fi
