#!/usr/bin/env bash
# Write .ci/constraints.txt, the versions scripts/test.sh installs, from the test venv as it is now.
# Run it after a green `SPEC_SERVE_LATEST_DEPS=1 bash scripts/test.sh` to move CI to the newest releases.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SPEC_SERVE_VENV:-.venv}
OUT=.ci/constraints.txt
{
  echo "# The versions CI last passed with: scripts/test.sh installs these (as constraints, -c)."
  echo "# SPEC_SERVE_LATEST_DEPS=1 bash scripts/test.sh tests the newest instead; scripts/pin_deps.sh rewrites this"
  echo "# file from the test venv. torch is pinned by scripts/test.sh itself (the build this host's pip serves)."
  # A local version label (+cpu) names one build; the version alone admits the build each host serves.
  "$VENV/bin/pip" freeze --exclude-editable --disable-pip-version-check | sed -E 's/^(torch==[^+]+)\+.*$/\1/'
} > "$OUT.new"
mv "$OUT.new" "$OUT"
echo "wrote $OUT ($(grep -vc '^#' "$OUT") packages)"
