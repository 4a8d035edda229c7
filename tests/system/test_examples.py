"""The examples run: ``examples/train_eagle3.py --demo`` trains a draft end to end and its loss goes down, the
same with a supervision cache as without."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

import zygote

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.timeout(600)
def test_train_eagle3_demo_loss_goes_down_and_a_cache_changes_no_loss(tiny_target_dir, tmp_path):
    # The demo starts a broker and 2 workers on the tiny target (the session's, not one more build), and
    # torchruns 2 gloo ranks (DDP over the draft) that share the workers. Few steps: the whole run is
    # mostly process start-up. Two epochs over the same batches, twice: with a supervision cache (epoch 2
    # reads every row from it) and without (compact replies, the form the cache stores): the loss at
    # every step is the same float (docs/cache.md).
    # Forked nested from the test zygote: the script and the workers it starts skip importing torch again.
    runs = {}
    for name, flags in (("cache", ["--cache", str(tmp_path / "cache")]), ("live", ["--compact"])):
        proc = zygote.run([str(EXAMPLES / "train_eagle3.py"), "--demo", "--target", str(tiny_target_dir), "--steps",
                           "10", "--epochs", "2", "--log-every", "5", "--history", str(tmp_path / f"{name}.json"),
                           *flags], {**os.environ, "OMP_NUM_THREADS": "1"}, timeout=270, nested=True)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, output[-4000:]
        assert re.search(r"^step +0 +loss ", proc.stdout, re.M), output[-4000:]
        found = re.search(r"initial loss ([0-9.]+) +final loss ([0-9.]+)", proc.stdout)
        assert found, output[-4000:]
        initial, final = map(float, found.groups())
        assert final < initial, output[-4000:]
        assert "requests completed" in proc.stdout and "Traceback" not in output, output[-4000:]
        runs[name] = (json.loads((tmp_path / f"{name}.json").read_text()), proc.stdout)
    assert "rank 0 cache: 40 rows hit, 40 missed, 10 of 20 batches sent no request" in runs["cache"][1]
    assert len(runs["cache"][0]) == 20 and runs["cache"][0] == runs["live"][0]
