#!/usr/bin/env bash
# The CPU test suite on the GPU machine's CPU (issue 22 item 2: the contract must hold on another CPU).
# That machine has 16 cores, Python 3.12, torch 2.11 and transformers 5.17 with the test tools installed,
# but not spec-serve itself and not pyzmq: the package runs from this checkout (PYTHONPATH; the tests
# start brokers and workers as `python -m spec_serve.tools.cli`, which needs no entry point), pyzmq from
# the wheel carried in .whl/. The GPUs are hidden (CUDA_VISIBLE_DEVICES=): `-m gpu` tests skip, workers
# and colocated references run on the CPU.
#
#   bash benchmarks/cpu_suite_on_gpu_host.sh                     # the whole CPU suite
#   PART=1/3 bash benchmarks/cpu_suite_on_gpu_host.sh            # the first third of the test files
#   bash benchmarks/cpu_suite_on_gpu_host.sh tests/supervision/test_contract.py tests/system/test_cluster.py
#   COMPOSITION=1 bash benchmarks/cpu_suite_on_gpu_host.sh       # the cross-composition tests under each
#                                                                # MKL_CBWR setting (composition_suite.sh)
#   COMPOSITION=1 bash benchmarks/cpu_suite_on_gpu_host.sh unset COMPATIBLE   # chosen settings only
# XDIST=N runs N pytest workers (pytest-xdist). Writes $OUT/cpu_suite_on_gpu_host.log (and .xml).
# Success: pytest's last line has no "failed" and no "error"; COMPOSITION=1: every MKL_CBWR line rc=0.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.}
mkdir -p "$OUT"
SITE=${SPEC_SERVE_SITE:-/tmp/site}
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Every wheel carried in .whl/ (pyzmq, and any module the check below names as missing), not only pyzmq.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || { echo "pip install of .whl/*.whl into $SITE failed"; exit 2; }
fi
export CUDA_VISIBLE_DEVICES=
source benchmarks/bytecode.sh  # no process compiles torch from source (that host's venv has no .pyc)
missing=$(python3 -c 'import importlib.util as u; print(" ".join(m for m in ("torch", "transformers", "zmq",
  "safetensors", "click", "prometheus_client", "tokenizers", "yaml", "numpy", "huggingface_hub", "pytest",
  "hypothesis", "pytest_timeout") if u.find_spec(m) is None))')
[ -z "$missing" ] || { echo "missing Python modules: $missing (carry their wheels in .whl/)"; exit 2; }
python3 -c 'import platform, torch, transformers, zmq
print(f"python {platform.python_version()}, torch {torch.__version__} (MKL {torch.backends.mkl.is_available()}, "
      f"{torch.backends.cpu.get_cpu_capability()}), transformers {transformers.__version__}, pyzmq {zmq.__version__}")'
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores; $(date -u '+%Y-%m-%d %H:%M UTC')"
echo "the OS's own (ephemeral) ports: $(cat /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null)"

if [ -n "${COMPOSITION:-}" ]; then
  PYTHON=python3 LOG_DIR="$OUT/composition-logs" bash benchmarks/composition_suite.sh "$@" | tee "$OUT/composition_suite.log"
  exit "${PIPESTATUS[0]}"
fi

tests=("$@")
if [ ${#tests[@]} -eq 0 ]; then
  mapfile -t tests < <(ls tests/test_*.py)
  if [ -n "${PART:-}" ]; then  # every N-th file from the K-th: parts of similar cost
    k=${PART%/*}; n=${PART#*/}
    mapfile -t tests < <(printf '%s\n' "${tests[@]}" | awk -v k="$k" -v n="$n" '(NR - k) % n == 0')
  fi
fi
xdist=()
[ -n "${XDIST:-}" ] && xdist=(-n "$XDIST")
python3 -m pytest -q -p no:cacheprovider --durations=25 --junitxml="$OUT/cpu_suite_on_gpu_host.xml" "${xdist[@]}" \
  "${tests[@]}" 2>&1 | tee "$OUT/cpu_suite_on_gpu_host.log"
exit "${PIPESTATUS[0]}"
