#!/usr/bin/env bash
# Set up the test environment from scratch (idempotent), lint and type-check, and run the whole test suite.
# This is the README's test command, and exactly what CI runs (.ci/run).
#   SPEC_SERVE_LATEST_DEPS=1   test against the newest releases pyproject.toml allows, instead of the versions
#                              CI last passed with (.ci/constraints.txt; refresh it with scripts/pin_deps.sh)
#   SPEC_SERVE_TEST_WORKERS=N  pytest processes for the main run (pytest-xdist) [2]; 0: one process
#   SPEC_SERVE_SKIP_VLLM=1     skip the real vLLM-on-CPU engine tests (they build their own venv)
#   extra arguments go to the main pytest run, e.g. `bash scripts/test.sh -k wire`
#
# Two stages run side by side from the start: the vLLM stage (scripts/vllm_stage.sh: build .venv-vllm, then the
# vLLM tests) in the background at a low CPU priority (nice 10, its scheduling group's too:
# scripts/low_priority.sh says why), and the main stage (.venv, lint, types, the main pytest run) in the
# foreground, which it barely slows: the vLLM stage takes the CPU the main stage leaves idle, and all of it
# once the main stage is done. Its output follows the main one's.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${SPEC_SERVE_VENV:-.venv}
WORKERS=${SPEC_SERVE_TEST_WORKERS:-2}
START=$SECONDS
VLLM_PID=

# Byte code is written by the first import of each module (uv installs none, like pip --no-compile),
# not for every file at install time: the processes of a run import a fraction of what pip would compile (the
# vLLM venv alone has 21,510 .py files, about 100 CPU-s to compile). Where PYTHONDONTWRITEBYTECODE is set (this
# workplace's shells, many container images), every process would then compile what it imports from source
# again, so the test command unsets it for its own processes.
unset PYTHONDONTWRITEBYTECODE

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi

# The vLLM stage starts now, beside this stage's own installs (they leave the second core idle). Both install
# this checkout editable, and two builds at once would share its egg-info: the stage waits for $EDITABLE_DONE.
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/spec-serve-test.XXXXXX")
EDITABLE_DONE=$SCRATCH/editable-installed
trap 'rm -rf "$SCRATCH"' EXIT
if [ -z "${SPEC_SERVE_SKIP_VLLM:-}" ] && [ -f .ci/setup_vllm_venv.sh ]; then
  VLLM_LOG=$SCRATCH/vllm-stage.log
  SPEC_SERVE_VLLM_EDITABLE_AFTER=$EDITABLE_DONE \
    bash scripts/low_priority.sh bash scripts/vllm_stage.sh >"$VLLM_LOG" 2>&1 </dev/null &
  VLLM_PID=$!
  # A failed or interrupted main stage takes the vLLM stage (its own process group) down with it.
  trap '[ -n "$VLLM_PID" ] && kill -- -"$VLLM_PID" 2>/dev/null; rm -rf "$SCRATCH"' EXIT
fi

# uv installs (the same resolution as pip, about a fifth of its time), with the package sources pip is configured
# with here (scripts/uv_pip.py says why). Like `pip --no-compile`, it writes no byte code.
[ -x "$VENV/bin/uv" ] || "$VENV/bin/pip" install -q --disable-pip-version-check --no-compile -c .ci/constraints.txt uv
if [ -n "${SPEC_SERVE_LATEST_DEPS:-}" ]; then
  DEPS=(--upgrade)
else
  DEPS=(-c .ci/constraints.txt)
fi
# torch is pinned to the CPU build that this workplace's pip serves from local disk.
"$VENV/bin/python" scripts/uv_pip.py install -q "${DEPS[@]}" torch==2.13.0 -e '.[dev]'
touch "$EDITABLE_DONE"

# ip netns for the multi-host test (root only; the test skips with a reason otherwise).
if [ "$(id -u)" = 0 ] && ! command -v ip >/dev/null 2>&1; then
  (apt-get install -y -qq iproute2 >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq iproute2)) \
    >/dev/null 2>&1 || echo "note: iproute2 not installed; the netns test will skip"
fi

# Guard rails (configured in pyproject.toml): lint, then type-check, before any test runs.
"$VENV/bin/ruff" check .
"$VENV/bin/mypy"

# Each test file goes whole to one of $WORKERS processes, so a module's cluster is started once
# (tests/conftest.py says what that asks of a test), in collection order: the slowest files first
# (tests/conftest.py, SLOWEST_FILES), not xdist's own order (most tests first). The slowest tests are
# listed at the end.
PARALLEL=()
if [ "$WORKERS" != 0 ]; then
  PARALLEL=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder)
fi
"$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=25 "${PARALLEL[@]}" "$@"
echo "main stage done at $((SECONDS - START)) s"

if [ -n "$VLLM_PID" ]; then
  echo "waiting for the vLLM stage (scripts/vllm_stage.sh) ..."
  status=0
  wait "$VLLM_PID" || status=$?
  VLLM_PID=
  cat "$VLLM_LOG"
  echo "vLLM stage done at $((SECONDS - START)) s"
  exit "$status"
fi
