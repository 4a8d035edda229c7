"""The compute thread: take jobs in order, group what may share a packed forward, run them on the
executor, and hand the results to the I/O thread (a queue plus an inproc wake-up). A reply path's control
job (an NCCL bind or release) runs in order with the jobs around it.

Batching (docs/packing.md): queued generate requests of the same kind and vocab share one packed forward
of at most ``max_batch_tokens`` real tokens (0: each request alone).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable

import zmq

from spec_serve.engines import packing
from spec_serve.paths.registry import WorkerPaths
from spec_serve.protocol import wire
from spec_serve.worker.executor import Executor
from spec_serve.worker.jobs import Job, RequestError, Result
from spec_serve.worker.threads import ThreadShare


class ComputeLoop:
    def __init__(self, ctx: zmq.Context, wake_endpoint: str, executor: Executor, paths: WorkerPaths, *,
                 packing: bool, max_batch_tokens: int, threads: ThreadShare | None):
        self.ctx = ctx
        self.wake_endpoint = wake_endpoint  # the I/O thread binds it before start()
        self.executor = executor
        self.paths = paths
        self.packing = packing
        self.max_batch_tokens = max_batch_tokens
        self.threads = threads  # math threads: this worker's share of the host's cores, kept between forwards
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._results: queue.Queue[Result] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="spec-serve-compute", daemon=True)
        self.forwarding = False  # a job is on the engine (or its NCCL send runs); written by the thread only
        self.on_forward: Callable[[float], None] | None = None  # called with each forward's seconds

    # ------------------------------------------------- the I/O thread's side

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def finish(self) -> None:
        """The loop ends once it reaches this (after the jobs queued before it)."""
        self._jobs.put(None)

    def take_queued(self) -> list[Job]:
        """Take back the requests queued and not started (a draining worker hands them back); binds,
        releases and the end mark stay queued, in order."""
        taken: list[Job] = []
        kept: list[Job | None] = []
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is None or job.control is not None:
                kept.append(job)
            else:
                taken.append(job)
        for other in kept:
            self._jobs.put(other)
        return taken

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the thread to end (after ``finish``); True if it has (or never ran)."""
        if self._thread.ident is not None:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def running(self) -> bool:
        """The thread is alive: inside a forward, or waiting for its next job."""
        return self._thread.is_alive()

    @property
    def queued(self) -> int:
        """Jobs waiting for the thread (not counting the one it runs)."""
        return self._jobs.qsize()

    def results(self) -> list[Result]:
        """The results posted so far, in order."""
        taken = []
        while True:
            try:
                taken.append(self._results.get_nowait())
            except queue.Empty:
                return taken

    @property
    def drained(self) -> bool:
        """True once the thread has ended and every result it posted was taken."""
        return not self._thread.is_alive() and self._results.empty()

    # ---------------------------------------------------- the compute thread

    def _run(self) -> None:
        wake = self.ctx.socket(zmq.PAIR)
        wake.connect(self.wake_endpoint)

        def post(*results: Result) -> None:
            for result in results:
                self._results.put(result)
            wake.send(b"")

        try:
            backlog: collections.deque[Job] = collections.deque()
            ending = False  # the end mark was taken from the queue: the loop ends once the backlog is served
            while self.executor.engine_error is None:
                if not backlog:
                    job = None if ending else self._jobs.get()
                    if job is None:
                        return
                    backlog.append(job)
                if self.threads is not None:
                    self.threads.rebalance()
                if backlog[0].control is not None:  # e.g. NCCL bind/release, in order with the jobs before it
                    self._control(backlog.popleft(), post)
                    continue
                if self._packs and not ending:
                    ending = not self._take_queued(backlog)
                self._post(self._forward(backlog), post)
                self.forwarding = False
        finally:
            self.forwarding = False
            wake.close(0)

    @property
    def _packs(self) -> bool:
        """Queued requests may share a packed forward."""
        return self.packing and self.max_batch_tokens > 0

    def _forward(self, backlog: collections.deque[Job]) -> list[Result]:
        """Serve the oldest job (with those of the backlog that share its packed forward)."""
        self.forwarding, started = True, time.perf_counter()
        if self._packs:
            results = self.executor.serve_group(self.take_group(backlog))
        else:
            results = [self.executor.serve(backlog.popleft())]
        if self.on_forward is not None:
            self.on_forward(time.perf_counter() - started)
        return results

    @staticmethod
    def _post(results: list[Result], post: Callable[..., None]) -> None:
        """Hand ``results`` to the I/O thread, then run what follows each posted reply (NCCL: its tensors)."""
        post(*results)
        for result in results:
            if result.after_post is not None:
                result.after_post()

    def _control(self, job: Job, post: Callable[..., None]) -> None:
        """A reply path's control job; what it answers goes to the job's reply_to."""
        assert job.control is not None and job.message is not None  # a control job comes with its message
        self.paths.control(job.control, job.message, lambda status, header: post(Result(job, status, header, [])))

    def _take_queued(self, backlog: collections.deque[Job]) -> bool:
        """Move every job queued now into ``backlog`` (it may share the packed forward); False once the end
        mark was taken (the jobs before it are in ``backlog``: the loop serves them, then ends)."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return True
            if job is None:
                return False
            backlog.append(job)

    # -------------------------------------------------------------- batching

    def take_group(self, backlog: collections.deque[Job]) -> list[Job]:
        """Pop the oldest job and every later one that can share its packed forward within the token
        budget (order kept). The scan stops at a bind/release, which must run in order."""
        first = backlog.popleft()
        head = self._pack_key(first)
        if head is None or head[1] >= self.max_batch_tokens:
            return [first]
        key, tokens = head
        group, rest = [first], collections.deque[Job]()
        while backlog and backlog[0].control is None:
            job = backlog.popleft()
            other = self._pack_key(job)
            if other is not None and other[0] == key and tokens + other[1] <= self.max_batch_tokens:
                group.append(job)
                tokens += other[1]
            else:
                rest.append(job)
        backlog.extendleft(reversed(rest))
        return group

    def _pack_key(self, job: Job) -> tuple[tuple[str | None, str | None], int] | None:
        """What must match for two jobs to share a packed forward, and the job's real tokens; None if the
        job runs alone (not a plain generate request, bound to a pair group, or not packable)."""
        if job.control is not None or job.refused is not None or not job.request.is_generate or job.request.nccl:
            return None
        try:
            kind = self.executor.route(job).kind  # the kind its path's format asks for (compact="auto")
            tensors = self.executor.request_tensors(job)
            ids = tensors["input_ids"]
            if ids.dim() != 2 or any(t.shape != ids.shape for t in tensors.values()):
                return None
            lengths = packing.row_lengths(tensors["attention_mask"], tensors["loss_mask"])
        except (RequestError, wire.WireError, ValueError):
            return None  # served alone, which reports the error
        if lengths is None:
            return None
        return (kind, job.request.vocab), sum(lengths)
