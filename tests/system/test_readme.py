"""The README's trainer snippet runs as written, in a fresh interpreter, against a real tiny cluster."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

from cluster_util import FAST_ENV
from spec_serve.tools.launch import local_cluster

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_client_snippet() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    (snippet,) = [b for b in blocks if "RemoteTargetModel(" in b]
    return snippet


def test_readme_client_snippet_runs_as_written(tiny_target_dir):
    snippet = readme_client_snippet()
    ast.parse(snippet)
    with local_cluster(tiny_target_dir, workers=2, env=FAST_ENV) as cluster:
        env = {**os.environ, "SPEC_SERVE_CLIENT_BROKER": cluster.frontend}
        done = subprocess.run([sys.executable, "-c", snippet], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # The tiny target: H=128, a 256-token draft vocab; the batch is 2 x 64.
    assert ("{'aux_hidden_states': (2, 64, 384), 'target_probs': (2, 64, 256), 'position_mask': (2, 64, 1), "
            "'input_ids': (2, 64), 'loss_mask': (2, 64)}") in done.stdout
