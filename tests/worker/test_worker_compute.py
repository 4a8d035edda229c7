"""``ComputeLoop`` (worker/compute.py) without sockets or threads: the loop runs on the test's thread
(``_run`` returns at the end mark), over a recording executor and paths and a wake-up socket that only counts.

Covered: jobs in order with control jobs in between, the end mark reached only after every job queued
before it (with packing too), a dead engine stops the loop, ``take_queued`` during a drain, and the
packing groups (same kind and vocab, within the token budget, never across a control job).
"""

from __future__ import annotations

import collections
import types

import torch
import zmq

from spec_serve.protocol import wire
from spec_serve.protocol.commands import ErrorCode, Op, Status, new_request_id
from spec_serve.protocol.messages import BindGrant, Reply, SupervisionRequest
from spec_serve.worker.compute import ComputeLoop
from spec_serve.worker.jobs import Job, Result, error_result

REPLY_TO = "tcp://127.0.0.1:9"


class WakeSocket:
    """The compute thread's end of the inproc wake-up pair: counts its sends."""

    def __init__(self) -> None:
        self.sent = 0
        self.connected: str | None = None
        self.closed = False

    def connect(self, endpoint: str) -> None:
        self.connected = endpoint

    def send(self, data: bytes) -> None:
        self.sent += 1

    def close(self, linger: int | None = None) -> None:
        self.closed = True


class WakeContext:
    def __init__(self) -> None:
        self.sockets: list[WakeSocket] = []

    def socket(self, kind: int) -> WakeSocket:
        assert kind == zmq.PAIR
        self.sockets.append(WakeSocket())
        return self.sockets[-1]


class RecordingExecutor:
    """Serves each job with an OK result and records what ran, in order: ``("serve", id)``, ``("group", ids)``.
    A job whose header names ``die`` kills the engine (as ``Executor._dead_result`` records it)."""

    def __init__(self) -> None:
        self.engine_error: str | None = None
        self.ran: list[tuple[str, object]] = []

    def serve(self, job: Job) -> Result:
        self.ran.append(("serve", job.request_id))
        return self._result(job)

    def serve_group(self, jobs: list[Job]) -> list[Result]:
        self.ran.append(("group", [job.request_id for job in jobs]))
        return [self._result(job) for job in jobs]

    def _result(self, job: Job) -> Result:
        if job.header.get("die"):
            self.engine_error = "CUDA error: an illegal memory access"
            return error_result(job, "w", ErrorCode.ENGINE_DEAD, self.engine_error)
        return Result.answer(job, Status.OK, Reply(worker="w"))

    # what the batcher asks (_pack_key): a request offering "alone" takes a path that packs nothing
    def route(self, job: Job) -> types.SimpleNamespace:
        return types.SimpleNamespace(kind=job.request.supervision_kind, packs=job.request.offer("alone") is None)

    def request_tensors(self, job: Job) -> dict[str, torch.Tensor]:
        return wire.decode(job.payload)


class RecordingPaths:
    """Answers each control job at once (as the NCCL path does a bind) and records it."""

    def __init__(self, ran: list) -> None:
        self.ran = ran

    def control(self, control: str, message: object, post) -> None:
        self.ran.append((control, None))
        post(Status.OK, BindGrant(worker="w"))


def make_loop(packing: bool = False, max_batch_tokens: int = 0) -> tuple[ComputeLoop, RecordingExecutor, WakeContext]:
    executor, ctx = RecordingExecutor(), WakeContext()
    loop = ComputeLoop(ctx, "inproc://wake", executor, RecordingPaths(executor.ran),  # type: ignore[arg-type]
                       packing=packing, max_batch_tokens=max_batch_tokens, threads=None)
    return loop, executor, ctx


def payload(lengths: list[int], seq: int = 8, left_padded: bool = False) -> list:
    """A request of one row per length, right-padded to ``seq`` (or left-padded: not packable)."""
    mask = torch.zeros(len(lengths), seq, dtype=torch.int64)
    for row, n in enumerate(lengths):
        if left_padded:
            mask[row, seq - n:] = 1
        else:
            mask[row, :n] = 1
    return wire.encode({"input_ids": torch.arange(len(lengths) * seq).view(len(lengths), seq),
                        "attention_mask": mask, "loss_mask": mask.clone()})


def request(lengths: list[int] = [4], vocab: str | None = "v1", **header) -> Job:  # noqa: B006 (never mutated)
    left_padded = header.pop("left_padded", False)
    return Job(new_request_id(), {"reply_to": REPLY_TO, "vocab": vocab, **header},
               payload(lengths, left_padded=left_padded), 0.0)


def control(name: str = "bind") -> Job:
    return Job(new_request_id(), {}, [], 0.0, control=name, message=SupervisionRequest(reply_to=REPLY_TO))


def run(loop: ComputeLoop, *jobs: Job) -> list[Result]:
    """Queue ``jobs`` and the end mark, run the loop to its end here, and return what it posted."""
    for job in jobs:
        loop.submit(job)
    loop.finish()
    loop._run()
    return loop.results()


# ------------------------------------------------------------------ the loop


def test_jobs_run_in_order_and_a_control_job_between_them():
    loop, executor, ctx = make_loop()
    a, bind, b = request(), control("bind"), request()
    results = run(loop, a, bind, b)
    assert executor.ran == [("serve", a.request_id), ("bind", None), ("serve", b.request_id)]
    assert [r.job for r in results] == [a, bind, b]
    assert isinstance(results[1].reply, BindGrant)  # the control job's answer goes to its reply_to
    [wake] = ctx.sockets
    assert (wake.connected, wake.sent, wake.closed) == ("inproc://wake", 3, True)  # one wake-up per post
    assert loop.drained and not loop.forwarding


def test_with_packing_every_job_queued_before_the_end_mark_is_served():
    """``finish``: the loop ends once it reaches the end mark, after the jobs queued before it (a drain
    relies on it: what the compute thread took is served, what it did not is handed back)."""
    loop, executor, _ = make_loop(packing=True, max_batch_tokens=64)
    a, b, other_vocab = request(), request(), request(vocab="v2")
    results = run(loop, a, b, other_vocab)
    assert executor.ran == [("group", [a.request_id, b.request_id]), ("group", [other_vocab.request_id])]
    assert [r.job for r in results] == [a, b, other_vocab]


def test_after_a_group_a_control_job_and_the_rest_run_in_order():
    loop, executor, _ = make_loop(packing=True, max_batch_tokens=64)
    a, bind, b = request(), control("release"), request()
    results = run(loop, a, bind, b)
    assert executor.ran == [("group", [a.request_id]), ("release", None), ("group", [b.request_id])]
    assert [r.job for r in results] == [a, bind, b]


def test_a_dead_engine_stops_the_loop_after_answering_the_job_that_found_it():
    loop, executor, _ = make_loop()
    a, dying, later = request(), request(die=True), request()
    for job in (a, dying, later):
        loop.submit(job)
    loop._run()  # no end mark: it ends because the engine died
    assert executor.ran == [("serve", a.request_id), ("serve", dying.request_id)]
    assert [r.job for r in loop.results()] == [a, dying]
    assert loop.queued == 1  # the later job stays queued: the worker leaves the pool, the broker re-sends it


def test_take_queued_hands_back_requests_and_keeps_control_jobs_and_the_end_mark_in_order():
    loop, executor, _ = make_loop()
    a, bind, b, release = request(), control("bind"), request(), control("release")
    for job in (a, bind, b, release):
        loop.submit(job)
    loop.finish()
    assert loop.take_queued() == [a, b]
    loop._run()
    assert executor.ran == [("bind", None), ("release", None)]  # then the end mark
    assert loop.queued == 0


def test_on_forward_is_called_once_per_forward():
    loop, _, _ = make_loop(packing=True, max_batch_tokens=64)
    seconds: list[float] = []
    loop.on_forward = seconds.append
    run(loop, request(), request(), control(), request())
    assert len(seconds) == 2 and all(s >= 0 for s in seconds)  # [a, b] packed; bind; [c]


def test_after_post_runs_once_each_after_its_result_is_posted():
    loop, executor, ctx = make_loop()
    order: list[str] = []
    job = request()

    def serve(j: Job) -> Result:
        result = Result.answer(j, Status.OK, Reply(worker="w"))
        result.out.after_post = lambda: order.append(f"after_post, posted {len(loop._results.queue)}")
        return result

    executor.serve = serve  # type: ignore[method-assign]
    run(loop, job)
    assert order == ["after_post, posted 1"]  # the header is posted before the tensors follow


# --------------------------------------------------------------- batching


def group_of(loop: ComputeLoop, *jobs: Job) -> tuple[list[Job], list[Job]]:
    backlog = collections.deque(jobs)
    group = loop.take_group(backlog)
    return group, list(backlog)


def test_a_group_takes_same_kind_and_vocab_within_the_budget_in_order():
    loop, _, _ = make_loop(packing=True, max_batch_tokens=10)
    a, b_vocab, c, d_kind, e, f = (request([4]), request([4], vocab="v2"), request([3]), request([1], kind="dspark"),
                                   request([4]), request([1]))
    group, rest = group_of(loop, a, b_vocab, c, d_kind, e, f)
    assert group == [a, c, f] and rest == [b_vocab, d_kind, e]  # e would make 11 tokens; f still fits


def test_tokens_are_real_tokens_not_padding():
    loop, _, _ = make_loop(packing=True, max_batch_tokens=8)
    a, b = request([3, 1]), request([2, 2])  # each [2, 8]: 16 padded positions, 4 real tokens
    assert group_of(loop, a, b) == ([a, b], [])


def test_the_scan_stops_at_a_control_job():
    loop, _, _ = make_loop(packing=True, max_batch_tokens=64)
    a, bind, b = request(), control(), request()
    assert group_of(loop, a, bind, b) == ([a], [bind, b])


def test_jobs_that_cannot_pack_run_alone():
    loop, _, _ = make_loop(packing=True, max_batch_tokens=10)
    over_budget = request([8, 4])
    left_padded = request([2], left_padded=True)
    embeddings = request(op=Op.EMBEDDINGS.value, which="input")
    refused = request(format="no-such-format")
    garbage = Job(new_request_id(), {"reply_to": REPLY_TO, "vocab": "v1"}, [b"not safetensors"], 0.0)
    unpacked_path = request([1], offers={"alone": {}})  # its route's path takes no packed outputs
    assert refused.refused is not None
    for alone in (over_budget, left_padded, embeddings, refused, garbage, unpacked_path):
        partner = request([1])
        assert group_of(loop, alone, partner) == ([alone], [partner]), alone.header
        assert group_of(loop, partner, alone) == ([partner], [alone]), alone.header
