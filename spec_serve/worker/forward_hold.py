"""Test-only: hold forwards at a gate the test opens, switched on by an environment variable, off otherwise.

``SPEC_SERVE_TEST_HOLD_FORWARD=PATH``: every generate forward, once begun (on the compute thread), waits
until the file PATH exists, so a test stops a worker while a forward provably runs and lets it end when it
chooses (tests/worker/test_lifecycle.py, ``cluster_util.Gate``). It logs ``worker.test_hold`` at WARNING first,
so a stray setting cannot pass unnoticed.
"""

from __future__ import annotations

import logging
import os
import time

from spec_serve.telemetry.logs import event

log = logging.getLogger("spec_serve.worker")

HOLD_FORWARD_ENV = "SPEC_SERVE_TEST_HOLD_FORWARD"
_POLL_S = 0.01


def hold_forward() -> None:
    """Under ``HOLD_FORWARD_ENV``: say so, then wait until its file exists (the forward runs on after)."""
    gate = os.environ.get(HOLD_FORWARD_ENV)
    if not gate:
        return
    event(log, logging.WARNING, "worker.test_hold", gate=gate,
          action=f"this forward waits until the file exists ({HOLD_FORWARD_ENV}, test-only)")
    while not os.path.exists(gate):
        time.sleep(_POLL_S)
