#!/usr/bin/env bash
# The tests that compare results computed in different batch compositions (docs/equality.md), once per
# MKL_CBWR setting: MKL takes other code paths under each, and a composition batch-invariant under one
# may be batch-variant under another. Every run must pass; the summary shows, per setting, how many of
# test_contract's compositions this machine computed batch-variant.
#   bash benchmarks/composition_suite.sh                      # MKL_CBWR unset, COMPATIBLE, AVX2, AVX512
#   bash benchmarks/composition_suite.sh unset AVX2           # chosen settings ("unset": not set)
# PYTHON (default .venv/bin/python) runs pytest; extra pytest arguments go in PYTEST_ARGS.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
SETTINGS=("$@")
[ ${#SETTINGS[@]} -gt 0 ] || SETTINGS=(unset COMPATIBLE AVX2 AVX512)
TESTS=(
  tests/supervision/test_contract.py
  tests/system/test_cluster.py
  tests/client/test_compact_remote.py
  tests/supervision/test_verify.py
  tests/system/test_gpu_matrix.py
  tests/worker/test_engine_sglang.py::test_fake_sglang_matches_hf
  tests/system/test_ordinary_use.py::test_any_number_of_vocab_mappings_over_time
  tests/paths/test_samehost.py::test_replies_come_through_the_plane
  tests/paths/test_paths.py::test_spool_end_to_end_from_one_registry_line
  tests/client/test_integrity.py::test_corrupted_replies_are_retried_on_the_other_worker_and_never_returned
  tests/paths/test_nccl_binding.py
  tests/paths/test_reply_memory.py
  tests/worker/test_packing.py
  tests/worker/test_compile.py
)
LOG_DIR=${LOG_DIR:-$(mktemp -d -t composition-suite-XXXX)}
mkdir -p "$LOG_DIR"
status=0
summary=()
for setting in "${SETTINGS[@]}"; do
  log="$LOG_DIR/mkl_cbwr-$setting.log"
  if [ "$setting" = unset ]; then runner=(env -u MKL_CBWR); else runner=(env "MKL_CBWR=$setting"); fi
  start=$(date +%s)
  "${runner[@]}" "$PY" -m pytest -q -s -p no:cacheprovider ${PYTEST_ARGS:-} "${TESTS[@]}" >"$log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || status=1
  result=$(grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed)" "$log" | tail -1 | tr -d '=')
  variant=$(grep -E "compositions batch-variant" "$log" | sed -E 's/: ([0-9]+ of [0-9]+).*/: \1/' | tr '\n' ' ')
  summary+=("MKL_CBWR=$setting: rc=$rc, ${result:-no result} ($(( $(date +%s) - start ))s); variant: $variant")
  echo "${summary[-1]}"
done
echo "--- $(uname -m), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores," \
     "$("$PY" -c 'import torch; print("torch", torch.__version__)'), $(date -u +%Y-%m-%d); logs in $LOG_DIR"
printf '%s\n' "${summary[@]}"
exit $status
