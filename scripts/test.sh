#!/usr/bin/env bash
# Set up the test environment from scratch (idempotent), lint and type-check, and run the whole test suite.
# This is the README's test command, and exactly what CI runs (.ci/run).
#   SPEC_SERVE_LATEST_DEPS=1   test against the newest releases pyproject.toml allows, instead of the versions
#                              CI last passed with (.ci/constraints.txt; refresh it with scripts/pin_deps.sh)
#   SPEC_SERVE_TEST_WORKERS=N  pytest processes for the main run (pytest-xdist) [2]; 0: one process
#   SPEC_SERVE_SKIP_VLLM=1     skip the real vLLM-on-CPU engine tests (they build their own venv)
#   extra arguments go to the main pytest run, e.g. `bash scripts/test.sh -k wire`
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${SPEC_SERVE_VENV:-.venv}
WORKERS=${SPEC_SERVE_TEST_WORKERS:-2}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/pip" install -q --disable-pip-version-check)
if [ -n "${SPEC_SERVE_LATEST_DEPS:-}" ]; then
  DEPS=(--upgrade --upgrade-strategy eager)
else
  DEPS=(-c .ci/constraints.txt)
fi
# torch is pinned to the CPU build that this workplace's pip serves from local disk.
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" "${DEPS[@]}" -e '.[dev]'

# ip netns for the multi-host test (root only; the test skips with a reason otherwise).
if [ "$(id -u)" = 0 ] && ! command -v ip >/dev/null 2>&1; then
  (apt-get install -y -qq iproute2 >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq iproute2)) \
    >/dev/null 2>&1 || echo "note: iproute2 not installed; the netns test will skip"
fi

# Guard rails (configured in pyproject.toml): lint, then type-check, before any test runs.
"$VENV/bin/ruff" check .
"$VENV/bin/mypy"

# Each test file goes whole to one of $WORKERS processes, so a module's cluster is started once
# (tests/conftest.py says what that asks of a test). The slowest tests are listed at the end.
PARALLEL=()
if [ "$WORKERS" != 0 ]; then
  PARALLEL=(-n "$WORKERS" --dist loadfile)
fi
"$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=25 "${PARALLEL[@]}" "$@"

if [ -z "${SPEC_SERVE_SKIP_VLLM:-}" ] && [ -f .ci/setup_vllm_venv.sh ]; then
  bash .ci/setup_vllm_venv.sh
  VLLM_VENV=${SPEC_SERVE_VLLM_VENV:-.venv-vllm}
  VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} "$VLLM_VENV/bin/python" -m pytest -q -p no:cacheprovider \
    --durations=10 -m vllm tests/test_engine_vllm.py
fi
