#!/usr/bin/env bash
# The vLLM stage of scripts/test.sh: build (or refresh) the vLLM venv, then run the real vLLM-on-CPU engine
# tests with it. scripts/test.sh runs it beside the main stage; alone it needs no other step.
#   SPEC_SERVE_VLLM_VENV   where the venv lives [.venv-vllm]
# Beside the main stage at a low priority it may wait minutes for CPU: vLLM's engine start-up limit and the
# tests' hang guard (pyproject's 300 s) are raised to match; they catch hangs, not slowness.
set -euo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
unset PYTHONDONTWRITEBYTECODE  # the venv has no byte code until first imports write it (scripts/test.sh)
bash .ci/setup_vllm_venv.sh
echo "vLLM venv ready after $((SECONDS - START)) s"
VLLM_VENV=${SPEC_SERVE_VLLM_VENV:-.venv-vllm}
VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} VLLM_ENGINE_READY_TIMEOUT_S=${VLLM_ENGINE_READY_TIMEOUT_S:-1800} \
  "$VLLM_VENV/bin/python" -m pytest -q -p no:cacheprovider --timeout 1800 --durations=10 -m vllm \
  tests/worker/test_engine_vllm.py
echo "vLLM tests done after $((SECONDS - START)) s"
