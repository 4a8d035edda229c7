"""Worker processes forked from an interpreter that has already imported torch and transformers (tests only).

Why: a tiny-target hf worker costs about 5 CPU-seconds, of which about 4 are importing torch and transformers,
the same in every worker; the suite starts over a hundred, and on the 2-core CI box that was half of its CPU.
The zygote, one per pytest process, imports them once and forks a child per worker. The child is an ordinary
worker process: its own session, environment, working directory, argv and log file, running the CLI's
``__main__`` as ``python -m`` (or a script, as ``python path``) would, and exiting as the interpreter would
(threads joined, atexit handlers run). Its exit status comes back through the zygote, its parent.

What keeps a fork equal to a fresh interpreter: the zygote is single-threaded when it forks (no OpenMP pool,
no ZeroMQ context: it runs no tensor op and imports neither zmq nor spec_serve, so no spec_serve module has
read its environment yet); and a start whose environment differs from the zygote's where an import already
read it (``FROZEN_ENV``) starts a fresh interpreter instead, as does a start with another command. So does
every start under ``SPEC_SERVE_TEST_ZYGOTE=0``: run the suite that way to rule the zygote out.

A script that starts workers itself (the demo's ``local_cluster``, the bench's) is forked ``nested``: before it
becomes the requested process, the child forks a zygote of its own from its pristine self (``_nest``), and its
``launch.Cluster`` forks workers from that one, under the same rules.

Wire: JSON lines. To the zygote, on its stdin: ``{"argv", "env", "cwd", "out", "err", "nested"}`` (``err`` null:
standard error goes to ``out`` too); it answers on its stdout ``{"pid"}`` for each start (in order) and
``{"exited", "status"}`` for each child that ends (status as ``subprocess.Popen.returncode``: negative for a
signal). On stdin's end it SIGKILLs the children it still has, and reaps them.
Where an import starts a thread (a fork copies only the calling one), the zygote answers ``{"unsafe": why}``
instead of ``{"ready"}`` and ends, and every start of the run gets a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

ENABLE_ENV = "SPEC_SERVE_TEST_ZYGOTE"
# Read when torch and transformers are imported (OpenMP's pool size, Python's own start-up settings, where
# modules come from): a start that sets them otherwise than the zygote had them gets a fresh interpreter.
FROZEN_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "PYTHONWARNINGS",
              "PYTHONSAFEPATH", "PYTHONDEVMODE", "PYTHONMALLOC", "LD_PRELOAD", "LD_LIBRARY_PATH", "TRANSFORMERS_CACHE",
              "HF_HOME", "CUDA_VISIBLE_DEVICES", "ATEN_CPU_CAPABILITY", "TORCH_LOGS", "MKL_CBWR",
              "MKL_ENABLE_INSTRUCTIONS", "DNNL_MAX_CPU_ISA")
PRELOAD = ("torch", "transformers", "transformers.modeling_utils", "transformers.masking_utils",
           "transformers.models.llama.modeling_llama", "safetensors.torch", "numpy")


# --------------------------------------------------------------------------- the zygote process


def _become(request: dict[str, Any]) -> None:
    """In the forked child: the directory, environment and standard streams of the requested process."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    stdin = os.open(os.devnull, os.O_RDONLY)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
    out = os.open(request["out"] or os.devnull, flags, 0o644)
    err = os.open(request["err"], flags, 0o644) if request.get("err") else os.dup(out)
    os.dup2(stdin, 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in (stdin, out, err):
        os.close(fd)


def _run(argv: list[str], cwd: str) -> None:
    """``python ARGV``'s main module, as the interpreter runs it: ``-m MODULE ARGS`` or ``SCRIPT ARGS``."""
    import runpy

    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = cwd  # as `python -m` puts it
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = str(Path(argv[0]).resolve().parent)
        runpy.run_path(argv[0], run_name="__main__")


def _exit(code: Any) -> None:
    """End the child as the interpreter ends: threads joined, atexit handlers run, streams flushed."""
    import atexit

    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code or 0)


def _child(request: dict[str, Any]) -> None:
    """In the forked child: become the requested process and run it; never returns. A ``nested`` request's
    process forks the workers it starts itself too (``_nest``)."""
    import traceback

    code: Any = 0
    try:
        os.setsid()
        frozen = dict(os.environ)  # the zygote's, which its imports read
        nested = _nest() if request.get("nested") else None
        _become(request)
        if nested is not None:
            _adopt(Zygote(nested, frozen))
        _run(request["argv"], request["cwd"])
    except SystemExit as e:
        code = e.code
    except BaseException:
        traceback.print_exc()
        code = 1
    _exit(code)


def _nest() -> NestedZygote:
    """In a forked child, before it becomes the requested process: fork a zygote of its own (a copy of this
    pristine, single-threaded one, in the child's session) for the workers the process starts itself (a script's
    ``local_cluster``). It serves over two pipes and ends with the child: its requests' pipe closes."""
    requests_r, requests_w = os.pipe()
    answers_r, answers_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(requests_w)
            os.close(answers_r)
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1):  # never the zygote's pipes to pytest
                os.dup2(null, fd)
            os.close(null)
            _say({"ready": os.getpid()}, answers_w)
            _serve_requests(requests_r, answers_w)
        except BaseException:
            import traceback

            traceback.print_exc()  # to the zygote's standard error: pytest's
            code = 1
        os._exit(code)
    os.close(requests_r)
    os.close(answers_w)
    return NestedZygote(pid, os.fdopen(requests_w, "wb"), os.fdopen(answers_r, "rb"))


def _adopt(nested: Zygote) -> None:
    """This process's workers (``launch.Cluster.start_worker_process``) fork from ``nested``, which is closed when
    the process exits (its remaining children killed, itself reaped)."""
    import atexit

    from spec_serve.tools import launch

    global _zygote
    _zygote = nested
    launch.Cluster.start_worker_process = staticmethod(popen)
    atexit.register(close)


def _say(message: dict[str, Any], fd: int = 1) -> None:
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def _reap(children: set[int], answers: int) -> None:
    """Report every child that has ended."""
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        children.discard(pid)
        _say({"exited": pid, "status": os.waitstatus_to_exitcode(status)}, answers)


def _serve() -> None:
    """The zygote: import PRELOAD, then fork a child per request line until stdin ends."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
        threads = os.listdir("/proc/self/task")
        if len(threads) > 1:  # a fork copies only this thread: a pool's state would lie to the child
            names = sorted({Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in threads})
            _say({"unsafe": f"importing {name} started {len(threads) - 1} thread(s) ({', '.join(names)})"})
            return
    _say({"ready": os.getpid()})
    _serve_requests(0, 1)


def _serve_requests(requests: int, answers: int) -> None:
    """Fork a child per request line read from ``requests`` until it ends, answering on ``answers``."""
    children: set[int] = set()
    buffered = b""
    while True:
        _reap(children, answers)
        if not select.select([requests], [], [], 0.05)[0]:
            continue
        chunk = os.read(requests, 1 << 16)
        if not chunk:  # the pytest process (or a nested zygote's process) is gone or done
            for pid in children:
                os.kill(pid, signal.SIGKILL)
            for pid in children:  # reaped before the zygote ends: gone once whoever closed its requests waited on it
                os.waitpid(pid, 0)
            return
        *lines, buffered = (buffered + chunk).split(b"\n")
        for line in lines:
            pid = os.fork()
            if pid == 0:
                for fd in {requests, answers} - {0, 1}:  # a nested zygote's pipes: not its children's
                    os.close(fd)
                _child(json.loads(line))
            children.add(pid)
            _say({"pid": pid}, answers)


# --------------------------------------------------------------------------- the pytest side


def _wait(poll: Callable[[], int | None], pause: Callable[[], None], args: Any, timeout: float | None) -> int:
    """``Popen.wait`` over ``poll``: its status once it has one, ``pause`` between polls, TimeoutExpired after
    ``timeout`` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while (status := poll()) is None:
        if deadline is not None and time.monotonic() >= deadline:
            raise subprocess.TimeoutExpired(args, timeout)  # type: ignore[arg-type]
        pause()
    return status


class ForkedProcess:
    """What tests use of ``subprocess.Popen`` for a process the zygote forked."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]):
        self._zygote, self.pid, self.args = zygote, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.status(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return _wait(self.poll, lambda: self._zygote.wait_exit(0.05), self.args, timeout)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not yet reaped by the zygote, so the pid is still this process's
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class NestedZygote:
    """What ``Zygote`` uses of ``subprocess.Popen`` for the zygote a nested child forked (``_nest``): its parent."""

    def __init__(self, pid: int, stdin: IO[bytes], stdout: IO[bytes]):
        self.pid, self.stdin, self.stdout = pid, stdin, stdout
        self.returncode: int | None = None
        # Its reader thread and close() may both wait for it: one reaps, the other then reads returncode (two
        # waitpid calls raced, and the loser's ChildProcessError was a traceback at the demo's exit).
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return _wait(self.poll, lambda: time.sleep(0.01), f"nested zygote {self.pid}", timeout)

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


class Zygote:
    """A zygote: this pytest process's, started on first use, or one a nested child forked (``NestedZygote``)."""

    def __init__(self, proc: subprocess.Popen | NestedZygote | None = None, env: dict[str, str] | None = None):
        """``proc``, whose imports read ``env``; by default a new zygote process with this process's environment."""
        if proc is None:
            env = {"OMP_NUM_THREADS": "1", **os.environ}  # as Cluster starts workers
            proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        assert env is not None
        self.env, self._proc = env, proc
        self._lock, self._exited = threading.Lock(), threading.Condition()
        self._statuses: dict[int, int] = {}
        self._pids: list[int] = []
        first = json.loads(self._readline())
        self.unsafe: str | None = first.get("unsafe")  # why this host's workers start afresh, or None
        if self.unsafe is not None:
            print(f"tests/zygote.py: workers start as fresh interpreters here: {self.unsafe}", file=sys.stderr)
            return
        self._reader = threading.Thread(target=self._read, daemon=True, name="zygote-reader")
        self._reader.start()

    def _readline(self) -> bytes:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the test zygote ended (status {self._proc.wait()})")
        return line

    def _read(self) -> None:
        while True:
            try:
                message = json.loads(self._readline())
            except RuntimeError:
                return
            with self._exited:
                if "pid" in message:
                    self._pids.append(message["pid"])
                else:
                    self._statuses[message["exited"]] = message["status"]
                self._exited.notify_all()

    def eligible(self, env: dict[str, str]) -> bool:
        return self.unsafe is None and all(env.get(k) == self.env.get(k) for k in FROZEN_ENV) \
            and self._proc.poll() is None

    def start(self, argv: list[str], env: dict[str, str], out: str | None, err: str | None = None,
              nested: bool = False) -> ForkedProcess:
        """Fork ``python ARGV``; ``nested``: the workers it starts itself fork from a zygote of its own."""
        request = json.dumps({"argv": argv, "env": env, "cwd": os.getcwd(), "out": out, "err": err,
                              "nested": nested}) + "\n"
        with self._lock:  # one start at a time: answers come in request order
            assert self._proc.stdin is not None
            self._proc.stdin.write(request.encode())
            self._proc.stdin.flush()
            with self._exited:
                self._exited.wait_for(lambda: self._pids or self._proc.poll() is not None, timeout=30)
                if not self._pids:
                    raise RuntimeError("the test zygote did not start the process")
                pid = self._pids.pop(0)
        return ForkedProcess(self, pid, [sys.executable, *argv])

    def status(self, pid: int) -> int | None:
        """The exit status of ``pid`` once the zygote has reaped it; None while it runs. A zygote that died first
        (its children then belong to init) leaves the status lost: that is an error, not a wait forever."""
        with self._exited:
            if pid in self._statuses:
                return self._statuses[pid]
        if self._proc.poll() is not None and not _running(pid):
            raise RuntimeError(f"the test zygote ended ({self._proc.returncode}) before process {pid}: "
                               "its status is lost")
        return None

    def wait_exit(self, timeout: float) -> None:
        with self._exited:
            self._exited.wait(timeout)

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


_zygote: Zygote | None = None
_starting = threading.Lock()  # tests start processes from several threads at once: one zygote for them all


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1") != "0"


def _started() -> Zygote:
    global _zygote
    with _starting:
        if _zygote is None:
            _zygote = Zygote()
        return _zygote


def _forking(env: dict[str, str]) -> Zygote | None:
    """The zygote, where it may fork a process with ``env`` (module docstring); None: start a fresh interpreter."""
    if not enabled():
        return None
    zygote = _started()
    return zygote if zygote.eligible(env) else None


def unsafe() -> str | None:
    """Why this host's zygote cannot fork workers (starting it if need be), or None."""
    return _started().unsafe


def popen(argv: list[str], env: dict[str, str], out: IO[bytes] | int) -> subprocess.Popen | ForkedProcess:
    """``launch.python_process(argv, env, out)``, forked from the zygote where that is the same process (module
    docstring) and the zygote could start (``Zygote.unsafe``); ``out`` a file opened for append, or DEVNULL."""
    from spec_serve.tools.launch import python_process

    path = None if out == subprocess.DEVNULL else getattr(out, "name", None)
    zygote = _forking(env) if path is None or isinstance(path, str) else None
    if zygote is not None:
        return zygote.start(argv, env, path)
    return python_process(argv, env, out)


def run(argv: list[str], env: dict[str, str], timeout: float, nested: bool = False) -> subprocess.CompletedProcess:
    """``subprocess.run([python, *ARGV], env=env, capture_output=True, text=True, timeout=timeout)``, forked from
    the zygote where ``popen`` would fork it: for CLI commands that load a model (a fork costs a fraction of a
    fresh interpreter's imports), never for one whose test is about what a fresh interpreter imports.
    ``nested``: a command that starts workers itself (``launch.Cluster``) forks them from a zygote of its own."""
    zygote = _forking(env)
    if zygote is None:
        return subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    with tempfile.TemporaryDirectory(prefix="zygote-run-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        proc = zygote.start(argv, env, str(out), str(err), nested)
        try:
            proc.wait(timeout)
        finally:
            proc.kill()
        return subprocess.CompletedProcess(proc.args, proc.returncode, out.read_text(), err.read_text())


def close() -> None:
    global _zygote
    if _zygote is not None:
        _zygote.close()
        _zygote = None


if __name__ == "__main__":
    _serve()
