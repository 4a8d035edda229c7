#!/usr/bin/env bash
# Issue 26 (compiled decoder layers, docs/compile.md) on one H200 in one device call of at most 9 minutes:
#   1. bench_full    full-length rows, 3 alternating rounds: colocated eager and compiled, a compiled worker
#                    through the same-host plane (target: compiled worker >= 1.15x colocated eager)
#   2. bench_packed  log-normal rows, 3 rounds: colocated padded eager, a packing worker and a compiled
#                    packing worker through the plane (target: compiled packing worker >= 2.0x)
#   3. gpu_tests     tests/worker/test_compile.py -m gpu: a compiled worker bit-equal to the compiled colocated
#                    engine, bf16 within the tolerance and the derived flip bound (printed beside eager's own
#                    batch-composition noise)
#   4. compile_time  at the 8B shape, each a fresh process: cold (empty cache, every class compiled and saved),
#                    warm (a second process on that cache as a worker without --packing loads: the saved
#                    classes load whole, no packed class), warm_packing (the same as a packing worker),
#                    warm_unsaved (that with the saved classes deleted: Inductor's kernels alone) and artifacts
#                    (an empty cache loaded with the cold run's cache artifacts, the load counted); each split by
#                    phase (trace, backend, guards, load, other) and by batch class, plus the eager forward run
#                    before compiling (targets: <= 30 s cold, <= 5 s warm)
#   5. new_lengths   issue 40 item 4 (benchmarks/compile_new_lengths.py): a fresh --compile worker over 20 log-normal
#                    batches of lengths it has never seen against the colocated eager forward (compile time apart;
#                    target >= 1.15x), its recompiles after load (/metrics, log) and bit-equality with the colocated
#                    HFTarget(compile=True); a worker of a second target of the same config on that cache (classes
#                    loaded whole); a fresh eager worker beside. About 3-4 minutes alone:
#                      STEPS=new_lengths bash benchmarks/gpu_compile.sh
# Every compiled batch is verified within compiled.TOLERANCE of the eager forward, its flips within the bound
# derived for the batch (engines/flips.py), and counted bit-equal to the colocated compiled forward.
# Each step runs under its own time limit, cut to what is left of the 9 minutes; a step that fails or times
# out does not stop the others. Writes to $OUT (or ./gpu-out): summary.txt (read this first), status.txt,
# bench_full.json, bench_packed.json, compile_time.json, a log per step, worker logs. Expects the pyzmq
# wheel (and any other missing one) in .whl/.
#   STEPS="bench_full gpu_tests"   run only these steps (a second call can run what a first one left out);
#                                  STEPS=compile_time alone takes about 2.5 minutes
#   FULL_ONLY, PACKED_ONLY         the scenarios of the two benches (add samehost_1w to compare an eager worker)
#   NEW_LENGTHS_ARGS               compile_new_lengths.py's [--gpu-8b]
#   BENCH_ARGS                     the target and devices [--gpu-8b --devices cuda:0]; a dry run on CPU (the
#                                  tiny target; SPEC_SERVE_TEST_COMPILE_CLASSES=rows,row compiles 2 classes of 5):
#     spec-serve make-tiny-target ./tiny && BENCH_ARGS="--target ./tiny --seq 64 --steps 2" BUDGET=3000 \
#       CAP_SCALE=10 STEPS="bench_full compile_time" bash benchmarks/gpu_compile.sh
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# One Inductor cache for the run, empty at start (unless TORCHINDUCTOR_CACHE_DIR names one): the bench's
# compiled workers fill it, its colocated compiled engine and later workers load from it. compile_time
# uses fresh caches of its own.
if [ -z "${TORCHINDUCTOR_CACHE_DIR:-}" ]; then
  export TORCHINDUCTOR_CACHE_DIR=/tmp/spec-serve-gpu-compile-cache
  rm -rf "$TORCHINDUCTOR_CACHE_DIR"
fi
BUDGET=${BUDGET:-530}  # seconds for the whole call
CAP_SCALE=${CAP_SCALE:-1}  # multiplies each step's time limit (a CPU dry run needs about 10)
STEPS=${STEPS:-bench_full bench_packed gpu_tests compile_time}
: > "$OUT/status.txt"

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || echo "pip install of .whl/ failed" | tee -a "$OUT/status.txt"
export PYTHONPATH=/tmp/site:$PWD
source benchmarks/bytecode.sh > "$OUT/bytecode.txt"; cat "$OUT/bytecode.txt"  # compile times as a pip-installed torch has them
{ nvidia-smi -L; python3 -c "import torch, transformers, zmq, torch._inductor.config as c; print('torch', \
torch.__version__, 'transformers', transformers.__version__, 'pyzmq', zmq.__version__, 'inductor deterministic mode:', \
hasattr(c, 'deterministic'), 'nested_compile_region:', hasattr(torch.compiler, 'nested_compile_region'))"; git log -1 --format='commit %h %s' 2>/dev/null; } 2>&1 | tee "$OUT/machine.txt"

step() {  # step NAME CAP COMMAND...: run COMMAND under min(CAP, time left), log it, record its status
  local name=$1 cap=$(( $2 * CAP_SCALE )); shift 2
  case " $STEPS " in *" $name "*) ;; *) return ;; esac
  local left=$((BUDGET - SECONDS - 10))
  local limit=$(( cap < left ? cap : left ))
  if [ "$limit" -lt 30 ]; then echo "$name skipped: no time left" | tee -a "$OUT/status.txt"; return; fi
  echo "== [$(date +%T), ${SECONDS}s in] $name, at most ${limit}s" | tee -a "$OUT/status.txt"
  # SIGINT first: the bench and pytest then stop the brokers and workers they started; SIGKILL 20 s later.
  timeout -s INT -k 20 "$limit" "$@" 2>&1 | grep --line-buffered -v "^Loading weights" | tee "$OUT/$name.log"
  local status=${PIPESTATUS[0]}
  echo "$name: exit $status$([ "$status" = 124 ] && echo ' (timed out)') after ${SECONDS}s" | tee -a "$OUT/status.txt"
}

read -r -a TARGET_ARGS <<< "${BENCH_ARGS:---gpu-8b --devices cuda:0}"
BENCH=(python3 -m spec_serve.tools.bench "${TARGET_ARGS[@]}")
step bench_full 200 "${BENCH[@]}" --repeat 3 --lengths full --log-dir "$OUT/logs-full" --json "$OUT/bench_full.json" \
  --only "${FULL_ONLY:-colocated,colocated_compiled,samehost_1w_compiled}"
step bench_packed 150 "${BENCH[@]}" --repeat 3 --lengths lognormal --log-dir "$OUT/logs-packed" \
  --json "$OUT/bench_packed.json" --only "${PACKED_ONLY:-colocated,samehost_1w_packed,samehost_1w_packed_compiled}"
step gpu_tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu -s tests/worker/test_compile.py
step compile_time 210 "${BENCH[@]}" --only compile_cold --json "$OUT/compile_time.json"
read -r -a NEW_LENGTHS <<< "${NEW_LENGTHS_ARGS:---gpu-8b}"
step new_lengths 330 python3 benchmarks/compile_new_lengths.py "${NEW_LENGTHS[@]}" --log-dir "$OUT/logs-new-lengths" \
  --json "$OUT/new_lengths.json"

python3 benchmarks/compile_summary.py "$OUT" 2>&1 | tee "$OUT/summary.txt"
