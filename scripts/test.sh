#!/usr/bin/env bash
# Set up the test environment from scratch (idempotent), lint and type-check, and run the whole test suite.
# This is the README's test command, and exactly what CI runs (.ci/run).
#   SPEC_SERVE_SKIP_VLLM=1  skip the real vLLM-on-CPU engine tests (they build their own venv)
#   extra arguments go to the main pytest run, e.g. `bash scripts/test.sh -k wire`
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${SPEC_SERVE_VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# torch is pinned to the CPU build that this workplace's pip serves from local disk.
"$VENV/bin/pip" install -q --disable-pip-version-check torch==2.13.0
"$VENV/bin/pip" install -q --disable-pip-version-check -e '.[dev]'

# ip netns for the multi-host test (root only; the test skips with a reason otherwise).
if [ "$(id -u)" = 0 ] && ! command -v ip >/dev/null 2>&1; then
  (apt-get install -y -qq iproute2 >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq iproute2)) \
    >/dev/null 2>&1 || echo "note: iproute2 not installed; the netns test will skip"
fi

# Guard rails (configured in pyproject.toml): lint, then type-check, before any test runs.
"$VENV/bin/ruff" check .
"$VENV/bin/mypy"

"$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"

if [ -z "${SPEC_SERVE_SKIP_VLLM:-}" ] && [ -f .ci/setup_vllm_venv.sh ]; then
  bash .ci/setup_vllm_venv.sh
  VLLM_VENV=${SPEC_SERVE_VLLM_VENV:-.venv-vllm}
  VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} "$VLLM_VENV/bin/python" -m pytest -q -p no:cacheprovider -m vllm tests/test_engine_vllm.py
fi
