"""The examples run: ``examples/train_eagle3.py --demo`` trains a draft end to end and its loss goes down."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

import zygote

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.timeout(600)
def test_train_eagle3_demo_loss_goes_down(tiny_target_dir):
    # The demo starts a broker and 2 workers on the tiny target (the session's, not one more build), and
    # torchruns 2 gloo ranks (DDP over the draft) that share the workers. Few steps: the whole run is
    # mostly process start-up.
    # Forked nested from the test zygote: the script and the workers it starts skip importing torch again.
    proc = zygote.run([str(EXAMPLES / "train_eagle3.py"), "--demo", "--target", str(tiny_target_dir), "--steps", "20",
                       "--log-every", "5"], {**os.environ, "OMP_NUM_THREADS": "1"}, timeout=540, nested=True)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert re.search(r"^step +0 +loss ", proc.stdout, re.M), output[-4000:]
    found = re.search(r"initial loss ([0-9.]+) +final loss ([0-9.]+)", proc.stdout)
    assert found, output[-4000:]
    initial, final = map(float, found.groups())
    assert final < initial, output[-4000:]
    assert "requests completed" in proc.stdout and "Traceback" not in output, output[-4000:]
