"""The test suite's worker starter (tests/zygote.py): a process it forks is what a fresh interpreter would run.

The same script runs both ways, and each must see the same argv, sys.path[0], working directory, environment
and standard streams, run its atexit handlers and end with the same status (a signal's as Popen reports it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

import zygote
from cluster_util import wait_until
from spec_serve.tools.launch import python_process

SCRIPT = """
import atexit, json, os, sys, threading, time
mode = sys.argv[1]
atexit.register(lambda: print("atexit ran", flush=True))
threading.Thread(target=lambda: (time.sleep(0.2), print("thread finished", flush=True))).start()
print(json.dumps({"argv": sys.argv[1:], "path0": sys.path[0], "cwd": os.getcwd(), "env": os.environ.get("ZYGOTE_PROBE"),
                  "sid": os.getsid(0) == os.getpid(), "torch_loaded": "torch" in sys.modules}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if mode == "hang":
    time.sleep(60)
sys.exit({"ok": 0, "fail": 3, "hang": 0}[mode])
"""


def _run(start, tmp_path, mode: str, name: str):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    log = tmp_path / f"{name}-{mode}.log"
    env = {**os.environ, "ZYGOTE_PROBE": name}
    with open(log, "ab") as out:
        proc = start([str(script), mode], env, out)
    if mode == "hang":  # killed once it has said everything
        wait_until(lambda: log.read_text().count("\n") >= 2, 60, what="the probe's output")
        proc.send_signal(signal.SIGKILL)
    status = proc.wait(timeout=60)
    lines = log.read_text().splitlines()
    report = json.loads(next(line for line in lines if line.startswith("{")))
    return status, report, sorted(line for line in lines if not line.startswith("{"))


@pytest.mark.parametrize("mode", ["ok", "fail", "hang"])
def test_a_forked_process_is_the_process_a_fresh_interpreter_runs(tmp_path, monkeypatch, mode):
    monkeypatch.setenv(zygote.ENABLE_ENV, "1")
    unsafe = zygote.unsafe()
    if unsafe is not None:
        pytest.skip(f"this host's workers start afresh: {unsafe}")
    forked = _run(zygote.popen, tmp_path, mode, "forked")
    fresh = _run(python_process, tmp_path, mode, "fresh")
    assert forked[0] == fresh[0] == {"ok": 0, "fail": 3, "hang": -signal.SIGKILL}[mode]
    assert {**forked[1], "env": None, "torch_loaded": None} == {**fresh[1], "env": None, "torch_loaded": None}
    assert (forked[1]["env"], fresh[1]["env"]) == ("forked", "fresh")
    assert forked[1]["torch_loaded"], "not forked from the zygote: this test proves nothing"
    if mode != "hang":  # (a killed one's last lines race its kill)
        assert forked[2] == fresh[2] == ["atexit ran", "thread finished", "to stderr"]


@pytest.mark.parametrize("mode", ["ok", "fail"])
def test_run_captures_what_subprocess_run_captures(tmp_path, monkeypatch, mode):
    """zygote.run: standard output and error apart, the status, as ``subprocess.run(capture_output=True)``."""
    monkeypatch.setenv(zygote.ENABLE_ENV, "1")
    if zygote.unsafe() is not None:
        pytest.skip(f"this host's workers start afresh: {zygote.unsafe()}")
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "ZYGOTE_PROBE": "run"}
    forked = zygote.run([str(script), mode], env, timeout=60)
    fresh = subprocess.run([sys.executable, str(script), mode], env=env, capture_output=True, text=True, timeout=60)
    assert forked.returncode == fresh.returncode == {"ok": 0, "fail": 3}[mode]
    assert forked.stderr == fresh.stderr == "to stderr\n"
    report = json.loads(forked.stdout.splitlines()[0])
    assert report["torch_loaded"], "not forked from the zygote: this test proves nothing"
    assert sorted(forked.stdout.splitlines()[1:]) == sorted(fresh.stdout.splitlines()[1:]) == ["atexit ran",
                                                                                              "thread finished"]


def test_a_zygote_that_dies_first_is_an_error_not_a_hang(tmp_path, monkeypatch):
    """Its children then belong to init, and their exit statuses are lost: waiting on one must say so."""
    monkeypatch.setenv(zygote.ENABLE_ENV, "1")
    if zygote.unsafe() is not None:
        pytest.skip(f"this host's workers start afresh: {zygote.unsafe()}")
    mine = zygote.Zygote()
    try:
        script = tmp_path / "probe.py"
        script.write_text(SCRIPT)
        with open(tmp_path / "log", "ab") as out:
            proc = mine.start([str(script), "hang"], {**os.environ}, out.name)
        mine._proc.kill()
        mine._proc.wait()
        proc.kill()
        with pytest.raises(RuntimeError, match=f"before process {proc.pid}: its status is lost"):
            wait_until(lambda: proc.poll() is not None, 30, what="the orphan's end")
    finally:
        mine.close()


NESTED = """
import json, os, sys
from spec_serve.tools import launch
probe, logs = sys.argv[1], sys.argv[2]
env = {**os.environ, "ZYGOTE_PROBE": "nested"}
with open(logs + "-fail.log", "ab") as out:
    failed = launch.Cluster.start_worker_process([probe, "fail"], env, out)
with open(logs + "-hang.log", "ab") as out:
    hanging = launch.Cluster.start_worker_process([probe, "hang"], env, out)
print(json.dumps({"kind": type(failed).__name__, "status": failed.wait(60), "hanging": hanging.pid}), flush=True)
"""


def test_a_nested_run_forks_the_workers_it_starts_and_ends_them_with_it(tmp_path, monkeypatch):
    """zygote.run(nested=True): the script's own ``launch.Cluster`` forks its workers too (torch already loaded,
    their statuses come back to the script), and a worker it leaves running is gone by the time the script's
    exit is reported (its zygote killed and reaped it, and the script reaped its zygote)."""
    monkeypatch.setenv(zygote.ENABLE_ENV, "1")
    if zygote.unsafe() is not None:
        pytest.skip(f"this host's workers start afresh: {zygote.unsafe()}")
    probe, script = tmp_path / "probe.py", tmp_path / "nested.py"
    probe.write_text(SCRIPT)
    script.write_text(NESTED)
    done = zygote.run([str(script), str(probe), str(tmp_path / "inner")], {**os.environ}, timeout=60, nested=True)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["kind"] == "ForkedProcess" and report["status"] == 3, report
    inner = json.loads((tmp_path / "inner-fail.log").read_text().splitlines()[0])
    assert inner["torch_loaded"] and inner["sid"] and inner["env"] == "nested", inner
    assert (tmp_path / "inner-hang.log").exists() and not zygote._running(report["hanging"])
