"""The worker's parts without sockets (in the style of tests/test_broker_*.py): ``Executor`` (one job on the
tiny target's real HF engine, through the real frames path), ``Outbox`` (a reply whose endpoint no socket
takes), ``BrokerSession`` (the broker's commands, and registration through the broker link) and
``ComputeLoop``'s grouping (a path that takes no packed outputs keeps its request alone)."""

from __future__ import annotations

import collections
import logging
import time

import pytest
import torch
import zmq

from spec_serve.paths.base import WorkerSetup
from spec_serve.paths.faults import Faults
from spec_serve.paths.registry import WorkerPaths
from spec_serve.protocol import wire
from spec_serve.protocol.commands import (
    WORKER_TAG,
    DoneStatus,
    ErrorCode,
    Status,
    WorkerCommand,
    control,
    parse_control,
)
from spec_serve.protocol.messages import Disconnect, Done, Refused
from spec_serve.supervision.target_info import TargetInfo
from spec_serve.tools.tiny import sample_batch
from spec_serve.worker.executor import Executor
from spec_serve.worker.jobs import Job
from spec_serve.worker.replies import Outbox
from spec_serve.worker.session import BrokerSession, WorkerRefused
from spec_serve.worker.vocab_store import VocabStore

REPLY_TO = "tcp://127.0.0.1:1"


def _job(target_dir, seed: int = 0, **header) -> Job:
    ids, attn, loss = sample_batch(target_dir, 2, 8, seed=seed)
    payload = wire.encode({"input_ids": ids, "attention_mask": attn, "loss_mask": loss})
    return Job(bytes([seed]) * 16, {"op": "generate", "kind": "dspark", "reply_to": REPLY_TO, **header}, payload,
               time.monotonic())


def _paths(paths=("spec_serve.paths.frames:FramesPath",)) -> WorkerPaths:
    setup = WorkerSetup("w0", torch.device("cpu"), "tcp://127.0.0.1:1", None, None, Faults(), None, None, 2, None)
    return WorkerPaths(setup, paths)


@pytest.fixture(scope="module")
def executor(colocated_target):
    engine = colocated_target()
    return Executor(engine, "w0", packing=False, vocab=VocabStore("w0", 1, 1 << 30), paths=_paths(),
                    max_message_bytes=1 << 30)


def test_the_executor_answers_a_job_bit_equal_to_the_engine(executor, tiny_target_dir):
    job = _job(tiny_target_dir, seed=3)
    result = executor.serve(job)
    assert result.status is Status.OK and result.out.via == "frames" and result.tokens > 0
    ids, attn, loss = sample_batch(tiny_target_dir, 2, 8, seed=3)
    want = executor.engine.generate_batch(ids, attn, loss, kind="dspark")
    got = wire.decode(result.frames)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    result.drop()


def test_the_executor_refuses_a_reply_over_the_clients_limit_once_and_bad_input_as_bad_request(executor,
                                                                                                tiny_target_dir):
    small = executor.serve(_job(tiny_target_dir, max_reply_bytes=64))
    assert small.status is Status.ERROR and small.reply.code == ErrorCode.BAD_REQUEST.value
    assert "exceeds the client's max_message_bytes of 64" in small.reply.error
    junk = Job(bytes(16), {"op": "generate", "kind": "dspark", "reply_to": REPLY_TO}, [b"not safetensors"],
               time.monotonic())
    bad = executor.serve(junk)
    assert bad.status is Status.ERROR and bad.reply.code == ErrorCode.BAD_REQUEST.value


class _NoSockets:
    """DataSockets whose every endpoint is refused (what a reply_to no socket takes meets)."""

    def get(self, endpoint: str, server_key: str | None, now: float):
        raise zmq.ZMQError(zmq.EINVAL, "Invalid argument")


def test_the_outbox_answers_undeliverable_at_once_and_gives_back_what_the_reply_borrowed(executor, tiny_target_dir):
    done: list[tuple[bytes, Done]] = []
    outbox = Outbox(_NoSockets(), lambda request_id, header: done.append((request_id, header)))  # type: ignore[arg-type]
    result = executor.serve(_job(tiny_target_dir, seed=4))
    dropped = []
    result.out.loan = type("Loan", (), {"left": lambda self: None, "dropped": lambda self: dropped.append(1)})()
    outbox.add(result, time.monotonic())
    assert [(rid, d.status) for rid, d in done] == [(result.job.request_id, DoneStatus.UNDELIVERABLE)]
    assert "bad endpoint" in str(done[0][1].error) and dropped == [1] and outbox.empty


class _Recording:
    """The session's DEALER, as far as these tests need it: what it was given to send."""

    def __init__(self):
        self.sent: list[list] = []

    def send_multipart(self, frames, *args, **kwargs) -> None:
        self.sent.append(frames)


def _session(handlers=None) -> BrokerSession:
    info = TargetInfo(num_hidden_layers=2, hidden_size=8, vocab_size=32, aux_layer_ids=[0, 1], dspark_layer_ids=[1],
                      model_name="tiny", dtype="float32", engine="fake", fingerprint="f" * 32)
    session = BrokerSession(zmq.Context.instance(), b"w" * 16, "w0", "tcp://127.0.0.1:1", "svc", security=None,
                            info=info, capacity=1, max_message_bytes=1 << 20, heartbeat_interval=1.0, liveness=3,
                            handlers=handlers or {}, before_ready=lambda: True)
    session.sock = _Recording()  # type: ignore[assignment]
    return session


def _message(command: WorkerCommand, header=None):
    return parse_control(control(WORKER_TAG, command.value, "svc", b"", header), WORKER_TAG, WorkerCommand)


def test_the_session_registers_serves_and_hears_the_broker_stop(caplog):
    caplog.set_level(logging.INFO, logger="spec_serve.worker")
    served = []
    session = _session({WorkerCommand.REQUEST: served.append})
    session._send_ready()
    [ready] = session.sock.sent
    assert parse_control(ready, WORKER_TAG, WorkerCommand).header["host_key"]  # locality: where this worker runs
    assert not session.registered
    assert session._dispatch(_message(WorkerCommand.REQUEST)) is False and len(served) == 1
    session._on_registered()
    assert session.registered and any("worker.ready" in r.getMessage() for r in caplog.records)
    assert session._dispatch(_message(WorkerCommand.DISCONNECT, Disconnect(stopping=True))) is True  # READY again
    assert not session.registered and session.link.lost_since is not None
    session._on_registered()
    assert [r.getMessage().split()[0] for r in caplog.records].count("worker.broker_regained") == 1


def test_a_refusal_ends_the_session():
    with pytest.raises(WorkerRefused, match="another target"):
        _session()._dispatch(_message(WorkerCommand.REFUSED, Refused(error="served by another target")))


def test_a_route_that_takes_no_packed_outputs_runs_alone(colocated_target, tiny_target_dir):
    """Packing asks the route, not the request: a reply path with ``packs = False`` (NCCL's) keeps its job out
    of packed groups; the others of the backlog still pack together."""
    from spec_serve.paths.frames import FramesPath
    from spec_serve.paths.frames.worker import FramesWorker
    from spec_serve.worker.server import Worker

    class Alone(FramesWorker):
        name = "alone"
        packs = False

        def takes(self, request) -> bool:
            return request.offer("alone") is not None

    class AlonePath(FramesPath):
        name = "alone"

        @classmethod
        def worker(cls, setup):
            return Alone(setup.host_pool, setup.copy_stream, setup.faults)

    worker = Worker(colocated_target(), "tcp://127.0.0.1:1", packing=True, max_batch_tokens=4096)
    worker.executor.paths = worker.compute.paths = _paths((AlonePath, "spec_serve.paths.frames:FramesPath"))
    backlog = collections.deque([_job(tiny_target_dir, 1), _job(tiny_target_dir, 2, offers={"alone": {}}),
                                 _job(tiny_target_dir, 3)])
    first = worker.compute.take_group(backlog)
    assert [j.request_id[0] for j in first] == [1, 3] and [j.request_id[0] for j in backlog] == [2]
    assert worker.compute.take_group(backlog)[0].route.side.name == "alone"
