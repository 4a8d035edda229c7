"""Shared fixtures (one tiny random Llama target per run, colocated engines on it), and how tests stay
fast and safe to run in parallel.

``scripts/test.sh`` runs the suite with pytest-xdist, ``-n 2 --dist loadfile``: each test file goes
whole to one of several pytest processes ("xdist workers"), the slowest files first (``SLOWEST_FILES``),
then in file order. So a new test must:

- Share processes within its file: a module-scoped ``cluster`` fixture (``local_cluster``) is built once
  per file. Add a test to a file whose cluster fits, or give it a service of its own on that cluster
  (``cluster.start_worker(..., service="mine")``); start a cluster of its own only when the test kills,
  reconfigures or exhausts it. Every cluster costs a broker and worker processes (model load; the
  workers fork from a zygote that has imported torch, ``_workers_fork_from_the_zygote``).
- Take the tiny target from ``tiny_target_dir`` (built once per run, shared by every xdist worker), never
  build another of the same shape: pass ``--target`` to the commands that would (``spec-serve bench``,
  ``examples/train_eagle3.py``). ``make_tiny_target`` is for tests of other shapes.
- Assume nothing global: session fixtures are per xdist worker; ports come from ``free_port()``; /dev/shm,
  processes and ports are shared with the other xdist workers (and other runs on the host), so assert on
  what the test's own processes created. Run-wide cleanup belongs in the controller
  (``pytest_sessionfinish`` below).
- Wait on events, not time: where a test waits on liveness, use ``cluster_util.FAST_ENV`` (0.2 s
  heartbeats) and ``wait_until``; never sleep a fixed time to let something happen.
- Keep CLI subprocesses light: a command that only parses flags or fails on a bad value imports no
  torch (``tests/system/test_cheap_processes.py``); use ``CliRunner`` in-process where the test needs no process.
  A command or script that loads a model runs through ``zygote.run``; one that starts its own workers (a
  ``local_cluster``), through ``zygote.run(..., nested=True)``, so that they fork too.
- ``@pytest.mark.slow`` is for long soaks only, which CI does not run (``--run-slow`` runs them); the short
  chaos soak stays in the main run.

``--durations`` in ``scripts/test.sh`` shows the slowest tests of every run: look there first when the
suite slows down.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from pathlib import Path

import pytest

# On a CPU the number of math threads is part of a forward's composition: MKL splits a GEMM of a few rows
# between threads differently, and the low bits follow (docs/equality.md). The workers a test starts run
# with OMP_NUM_THREADS (spec_serve.tools.launch: 1 unless set), so this process's colocated references do
# too. Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _own_port_range() -> None:
    """Each pytest process picks ports (``free_port``) from a range of its own below the OS's ephemeral ports:
    with many xdist processes on one host, a port one picked and had not bound yet was sometimes taken by
    another's socket (a broker's HTTP probe then read a ZeroMQ greeting). Only where those ranges fit below
    ``ip_local_port_range``; a range given in the environment stands, but not one this function set in the
    process an xdist process inherited its environment from (its controller's: the same for all of them)."""
    from spec_serve.transport.sockets import PORT_RANGE_ENV

    if os.environ.get(PORT_RANGE_ENV) and not os.environ.get(OWN_RANGE_ENV):
        return
    os.environ.pop(PORT_RANGE_ENV, None)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else PORT_BLOCKS - 1
    if worker and index >= PORT_BLOCKS - 1:  # more xdist processes than blocks: the OS picks
        return
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    lo = PORT_BASE + index * PORT_BLOCK
    if lo + PORT_BLOCK <= ephemeral_low:
        os.environ[PORT_RANGE_ENV], os.environ[OWN_RANGE_ENV] = f"{lo}-{lo + PORT_BLOCK - 1}", "1"


# Ranges of PORT_BLOCK ports from PORT_BASE: one per xdist process (gw0, gw1, ...), the last for a run without
# xdist (the vLLM stage's, beside the main run's).
PORT_BASE, PORT_BLOCK, PORT_BLOCKS = 12000, 1000, 20
OWN_RANGE_ENV = "SPEC_SERVE_TEST_OWN_PORT_RANGE"  # beside a range _own_port_range set
_own_port_range()

# Keep a small draft vocab so EAGLE-3 batches exercise index_select and the t2d mask.
TINY_DRAFT_VOCAB = 256


def run_tmp_dir(tmp_path_factory) -> Path:
    """A temporary directory every process of this run shares: the run's own, or under xdist the parent
    of the workers' (each worker's ``tmp_path_factory`` is private to it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(autouse=True)
def _spec_serve_logging_as_found():
    """A command run in-process (click's CliRunner) configures logging for the whole process (``logs.setup``:
    a stderr handler, no propagation, its level); undo that after each test. Otherwise a test's log capture
    depends on which files its xdist worker ran before (pytest hands a non-propagating logger its capture
    handlers directly, and a test that turns propagation back on sees every record twice)."""
    from spec_serve.telemetry import logs

    logger = logging.getLogger("spec_serve")
    propagate, level = logger.propagate, logger.level
    yield
    for handler in [h for h in logger.handlers if h.get_name() == logs.HANDLER_NAME]:
        logger.removeHandler(handler)
    logger.propagate = propagate
    logger.setLevel(level)


@pytest.fixture(scope="session", autouse=True)
def _workers_fork_from_the_zygote():
    """Workers (``Cluster.start_worker``, cluster_util's test workers) fork from an interpreter that has imported
    torch and transformers already: tests/zygote.py says why that saves half the suite's CPU and why the child
    is the same process a fresh interpreter would be. ``SPEC_SERVE_TEST_ZYGOTE=0`` starts each afresh."""
    import zygote
    from spec_serve.tools import launch

    launch.Cluster.start_worker_process = staticmethod(zygote.popen)
    yield
    launch.Cluster.start_worker_process = staticmethod(launch.python_process)
    zygote.close()


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    """Path of a tiny random ``LlamaForCausalLM`` (8 layers, H=128, V=512), built once per run: the first
    xdist worker to need it builds it under a lock, the others wait and share it. Read-only."""
    from spec_serve.tools.tiny import make_tiny_target

    root = run_tmp_dir(tmp_path_factory)
    path = root / "tiny-llama"
    with open(root / "tiny-llama.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not path.is_dir():
            partial = root / "tiny-llama.partial"
            shutil.rmtree(partial, ignore_errors=True)
            make_tiny_target(partial)
            partial.rename(path)  # whole or absent: a build that died is redone
    return path


@pytest.fixture(scope="session")
def tiny_vocab_mapping(tiny_target_dir):
    """A deterministic ``(selected_token_ids, selected_token_mask)`` for the tiny target."""
    from spec_serve.supervision.vocab import build_vocab_mapping
    from spec_serve.tools.tiny import sample_batch

    input_ids, _, loss_mask = sample_batch(tiny_target_dir, batch=8, seq=64, seed=0)
    return build_vocab_mapping(input_ids, loss_mask, 512, TINY_DRAFT_VOCAB, special_token_ids=(0, 1, 2, 3))


@pytest.fixture(scope="session")
def colocated_target(tiny_target_dir, tiny_vocab_mapping):
    """Factory: ``colocated_target(**HFTarget_kwargs)`` -> a fresh in-process ``HFTarget`` on the tiny
    target with ``tiny_vocab_mapping`` set (pass ``vocab_mapping=None`` to leave it unset)."""
    from spec_serve.engines.hf import HFTarget

    def make(vocab_mapping=tiny_vocab_mapping, **kwargs):
        engine = HFTarget(tiny_target_dir, **kwargs)
        if vocab_mapping is not None:
            engine.set_vocab_mapping(*vocab_mapping)
        return engine

    return make


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run tests marked slow (long load and soak runs); or set SPEC_SERVE_RUN_SLOW=1")


# The files that take longest on a 2-core box, longest first (each file's wall seconds on its xdist process in a
# 2-process run; BENCHMARKS.md, "The test suite's time", session 9). They run first, the rest after in file order:
# xdist hands each file whole to whichever process is free, so a slow file started last (xdist's own order, most
# tests first, put the few-test slow ones there) keeps one process busy while the other idles. Only the order
# changes; a file missing here just runs later.
SLOWEST_FILES = ("test_compile.py", "test_operability.py", "test_netns.py", "test_hostile.py", "test_examples.py",
                 "test_ordinary_use.py", "test_security.py", "test_load.py", "test_gpu_matrix.py", "test_cluster.py",
                 "test_lifecycle.py", "test_reply_memory.py", "test_samehost.py", "test_reliability.py",
                 "test_engine_sglang.py", "test_cheap_processes.py", "test_integrity.py", "test_nccl_binding.py",
                 "test_deploy.py", "test_bench_cli.py", "test_sizing_cluster.py")


def pytest_collection_modifyitems(config, items):
    first = {name: rank for rank, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: each file's own order kept
    if config.getoption("--run-slow") or os.environ.get("SPEC_SERVE_RUN_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow or SPEC_SERVE_RUN_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    """A worker a test SIGKILLs leaves its same-host plane segments for the next worker on the host to reap
    (docs/ARCHITECTURE.md); after the last test no worker follows, so reap them here: a test run leaves no
    /dev/shm file of a dead test worker behind. Under xdist, in the controller, once every xdist worker
    finished (each xdist worker's session finishes on its own, while others still run tests)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    from spec_serve.paths.plane import shm

    reaped = shm.reap()
    if reaped:
        print(f"\nreaped {len(reaped)} same-host plane segment(s) of test workers killed without a clean stop")
