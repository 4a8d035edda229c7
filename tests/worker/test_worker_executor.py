"""``Executor`` (worker/executor.py) without sockets or a model: a stand-in engine of tiny CPU tensor ops, the
real ``WorkerPaths`` over frames and ``Lend`` (a test path whose replies borrow a counted loan).

Covered: a reply's tensors, tokens, fingerprint and digests (``verify``); the vocab mapping selected once;
every failure an error reply of the right code with a one-line message (refused header, bad tensors, a
path that cannot carry it, an engine error that keeps the worker serving, an engine death that stops it);
a reply over the client's limit refused and its loan dropped once; packed groups split per job, a failing
group served job by job, a death in a group failing every job.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import ClassVar

import pytest
import torch

from fakes.loan import CountingLoan
from spec_serve.engines import EngineDead
from spec_serve.paths.base import ClientSide, Delivery, Outgoing, PathUnavailable, ReplyPath, WorkerSetup, WorkerSide
from spec_serve.paths.faults import Faults
from spec_serve.paths.frames import FramesPath
from spec_serve.paths.registry import WorkerPaths
from spec_serve.protocol import digest, wire
from spec_serve.protocol.commands import ErrorCode, Op, Status, new_request_id
from spec_serve.protocol.messages import ErrorReply, Reply, SupervisionRequest
from spec_serve.supervision.target_info import TargetInfo
from spec_serve.worker.executor import Executor
from spec_serve.worker.jobs import Job, Result
from spec_serve.worker.vocab_store import VocabStore

FINGERPRINT = "f" * 32
VOCAB = "d" * 16
POISON = 666  # an input id the stand-in engine refuses (ValueError), as a bad row would be


class StandInEngine:
    """Outputs are simple functions of the inputs: ``doubled`` (input ids x 2) and ``kept`` (the loss mask)."""

    def __init__(self) -> None:
        self.weight = torch.arange(12, dtype=torch.float32).view(4, 3)
        self.mappings: list[torch.Tensor] = []
        self.packed_calls: list[int] = []
        self.fail: BaseException | None = None  # raised by the next forward

    def target_info(self) -> TargetInfo:
        return TargetInfo(2, 3, 4, (0,), (1,), "stand-in", "float32", "fake", FINGERPRINT)

    def set_vocab_mapping(self, ids: torch.Tensor, mask: torch.Tensor) -> None:
        self.mappings.append(ids)

    def generate_batch(self, input_ids, attention_mask, loss_mask, kind="eagle3") -> dict[str, torch.Tensor]:
        if self.fail is not None:
            raise self.fail
        if bool((input_ids == POISON).any()):
            raise ValueError(f"input id {POISON} is out of range")
        return {"doubled": input_ids * 2, "kept": loss_mask.clone()}

    def generate_packed(self, requests, kind="eagle3") -> list[dict[str, torch.Tensor]]:
        self.packed_calls.append(len(requests))
        return [self.generate_batch(*r, kind=kind) for r in requests]

    def get_input_embeddings(self):
        return self

    def get_output_embeddings(self):
        return self

    def close(self) -> None:
        pass


class LendSide(WorkerSide):
    """Takes the replies of requests that offer ``lend``; each reply borrows a ``CountingLoan``. An offer of
    ``"closed"`` insists on the path while it cannot carry the reply."""

    name: ClassVar[str] = "lend"

    def __init__(self) -> None:
        self.loans: list[CountingLoan] = []

    def takes(self, request: SupervisionRequest) -> bool:
        offer = (request.offers or {}).get(self.name)
        if offer == "closed":
            raise PathUnavailable("lend is closed on this worker: ask again without it")
        return offer is not None

    def deliver(self, items: Sequence[Delivery]) -> list[Outgoing | None]:
        out: list[Outgoing | None] = []
        for item in items:
            self.loans.append(CountingLoan())
            out.append(Outgoing(item.reply, wire.encode(item.tensors), self.name, loan=self.loans[-1]))
        return out


class LendPath(ReplyPath):
    name: ClassVar[str] = "lend"
    side = LendSide()

    @classmethod
    def worker(cls, setup: WorkerSetup) -> WorkerSide:
        return cls.side

    @classmethod
    def client(cls, setup) -> ClientSide | None:
        return None


@pytest.fixture
def engine():
    return StandInEngine()


@pytest.fixture
def lend():
    LendPath.side = LendSide()
    return LendPath.side


def make_executor(engine: StandInEngine, packing: bool = False) -> Executor:
    setup = WorkerSetup("w", torch.device("cpu"), "tcp://127.0.0.1:1", None, None, Faults(), None, None, 2, 1.0)
    vocab = VocabStore("w", capacity=1, max_message_bytes=1 << 20)
    vocab.put(VOCAB, (torch.tensor([0, 2]), torch.tensor([True, False, True, False])))
    return Executor(engine, "w", packing=packing, vocab=vocab, paths=WorkerPaths(setup, [LendPath, FramesPath]),
                    max_message_bytes=1 << 20)


def job(ids: list[list[int]] | None = None, tensors: dict | None = None, **header) -> Job:
    input_ids = torch.tensor(ids if ids is not None else [[5, 6, 7, 0]])
    mask = (input_ids != 0).long()
    payload = wire.encode(tensors if tensors is not None else
                          {"input_ids": input_ids, "attention_mask": mask, "loss_mask": mask.clone()})
    fields = {"reply_to": "tcp://127.0.0.1:9", "vocab": VOCAB, **header}  # a None value: the field left out
    return Job(new_request_id(), {k: v for k, v in fields.items() if v is not None}, payload, 0.0)


def decoded(result: Result) -> dict[str, torch.Tensor]:
    return wire.decode(result.frames)


def error_of(result: Result) -> tuple[str, str]:
    assert result.status is Status.ERROR and isinstance(result.reply, ErrorReply), result.reply
    assert "\n" not in result.reply.error, result.reply.error  # one line
    return result.reply.code, result.reply.error


# --------------------------------------------------------------- one job


def test_a_generate_reply_holds_the_engine_outputs_its_tokens_and_the_fingerprint(engine):
    executor = make_executor(engine)
    a = job([[5, 6, 7, 0], [8, 9, 0, 0]])
    result = executor.serve(a)
    assert result.status is Status.OK and result.out.via == "frames" and result.tokens == 5 and result.out.loan is None
    out = decoded(result)
    assert torch.equal(out["doubled"], torch.tensor([[10, 12, 14, 0], [16, 18, 0, 0]]))
    reply = result.reply
    assert isinstance(reply, Reply) and reply.worker == "w" and reply.fingerprint == FINGERPRINT
    assert reply.digests is None and reply.batched is None and reply.compute_s is not None


def test_verify_digests_each_output_before_it_leaves(engine):
    executor = make_executor(engine)
    result = executor.serve(job(verify=True))
    assert isinstance(result.reply, Reply)
    assert result.reply.digests == digest.digests([decoded(result)])[0] and set(result.reply.digests) == {"doubled",
                                                                                                       "kept"}
    assert executor.digests == 2


def test_the_vocab_mapping_is_selected_once_for_requests_that_name_it(engine):
    executor = make_executor(engine)
    for _ in range(2):
        assert executor.serve(job()).status is Status.OK
    assert len(engine.mappings) == 1 and torch.equal(engine.mappings[0], torch.tensor([0, 2]))


@pytest.mark.parametrize("header,code,message", [
    ({"vocab": None}, ErrorCode.BAD_REQUEST, "EAGLE-3 needs a draft-vocab mapping: call set_vocab_mapping"),
    ({"vocab": "e" * 16}, ErrorCode.INTERNAL, f"worker w lacks vocab mapping {'e' * 16}"),  # the client retries
    ({"format": "no-such-format"}, ErrorCode.BAD_REQUEST, "REQUEST header 'format' must be one of"),
    ({"kind": "no-such-kind"}, ErrorCode.BAD_REQUEST, "unknown kind 'no-such-kind'"),
    ({"op": "no-such-op"}, ErrorCode.BAD_REQUEST, "unknown op 'no-such-op'"),
    ({"op": Op.EMBEDDINGS.value, "which": "middle"}, ErrorCode.BAD_REQUEST,
     "embeddings 'which' must be input or output, got 'middle'"),
    ({"offers": {"lend": "closed"}}, ErrorCode.UNAVAILABLE, "lend is closed on this worker: ask again without it"),
])
def test_a_request_the_worker_cannot_serve_gets_one_error_line(engine, lend, header, code, message):
    executor = make_executor(engine)
    result = executor.serve(job(**header))
    assert error_of(result)[0] == code.value and message in error_of(result)[1]
    assert executor.engine_error is None


def test_request_tensors_must_be_exactly_the_three(engine):
    executor = make_executor(engine)
    result = executor.serve(job(tensors={"input_ids": torch.ones(1, 2, dtype=torch.long)}))
    assert error_of(result) == (ErrorCode.BAD_REQUEST.value, "request must hold exactly ['input_ids', "
                                "'attention_mask', 'loss_mask'], got ['input_ids']")
    garbage = Job(new_request_id(), {"reply_to": "tcp://127.0.0.1:9"}, [b"not safetensors"], 0.0)
    assert error_of(executor.serve(garbage))[0] == ErrorCode.BAD_REQUEST.value


def test_an_engine_error_is_internal_and_the_worker_serves_on(engine, caplog):
    executor = make_executor(engine)
    engine.fail = RuntimeError("boom")
    with caplog.at_level(logging.ERROR, logger="spec_serve.worker"):
        assert error_of(executor.serve(job())) == (ErrorCode.INTERNAL.value, "RuntimeError: boom")
    assert "worker.engine_failed" in caplog.text and executor.engine_error is None
    engine.fail = None
    assert executor.serve(job()).status is Status.OK


@pytest.mark.parametrize("death", [EngineDead("engine process exited with status -9"),
                                   RuntimeError("CUDA error: an illegal memory access was encountered\nmore"),
                                   torch.OutOfMemoryError("out of memory")])
def test_an_engine_death_answers_engine_dead_and_is_kept_once(engine, death):
    executor = make_executor(engine)
    engine.fail = death
    code, message = error_of(executor.serve(job()))
    assert code == ErrorCode.ENGINE_DEAD.value and message == executor.engine_error
    assert str(death).splitlines()[0] in message
    engine.fail = EngineDead("a second death")
    assert error_of(executor.serve(job()))[1] == message  # the first cause stays


def test_a_reply_over_the_clients_limit_is_refused_and_its_loan_dropped_once(engine, lend):
    executor = make_executor(engine)
    fits = executor.serve(job(offers={"lend": {}}, max_reply_bytes=1 << 16))
    assert fits.status is Status.OK and fits.out.via == "lend" and fits.out.loan is lend.loans[0]
    result = executor.serve(job(offers={"lend": {}}, max_reply_bytes=100))
    code, message = error_of(result)
    size = sum(len(memoryview(f)) for f in fits.frames)
    assert code == ErrorCode.BAD_REQUEST.value
    assert message == (f"reply of {size} bytes exceeds the client's max_message_bytes of 100: raise the client's "
                       f"max_message_bytes or send fewer rows per request (num_shards)")
    assert [loan.calls for loan in lend.loans] == [[], ["dropped"]]  # the sent one is the Outbox's to release


def test_the_route_is_chosen_once_per_job(engine, lend):
    executor = make_executor(engine)
    a = job(offers={"lend": {}})
    route = executor.route(a)
    assert route.side is lend and executor.route(a) is route
    assert executor.serve(a).out.via == "lend" and a.route is route


def test_embeddings_and_lm_head_slice(engine):
    executor = make_executor(engine)
    weights = decoded(executor.serve(job(op=Op.EMBEDDINGS.value, which="output")))["weight"]
    assert torch.equal(weights, engine.weight)
    sliced = executor.serve(job(op=Op.LM_HEAD_SLICE.value))
    assert torch.equal(decoded(sliced)["weight"], engine.weight[[0, 2]]) and sliced.tokens == 0


# ------------------------------------------------------------ a packed group


def test_a_group_runs_one_packed_forward_and_splits_per_job(engine, lend):
    executor = make_executor(engine, packing=True)
    a, b = job([[1, 2, 3, 0]]), job([[4, 5, 0, 0]], offers={"lend": {}})
    results = executor.serve_group([a, b])
    assert engine.packed_calls == [2] and executor.batches == 1
    assert [(r.job, r.status, r.out.via, r.tokens) for r in results] == [(a, Status.OK, "frames", 3),
                                                                       (b, Status.OK, "lend", 2)]
    assert torch.equal(decoded(results[1])["doubled"], torch.tensor([[8, 10, 0, 0]]))
    assert all(isinstance(r.reply, Reply) and r.reply.batched == 2 for r in results)


def test_a_group_that_fails_is_served_job_by_job(engine):
    executor = make_executor(engine, packing=True)
    a, poison, c = job([[1, 2, 0, 0]]), job([[POISON, 1, 0, 0]]), job([[3, 0, 0, 0]])
    results = executor.serve_group([a, poison, c])
    assert [r.status for r in results] == [Status.OK, Status.ERROR, Status.OK]
    assert error_of(results[1]) == (ErrorCode.BAD_REQUEST.value, f"input id {POISON} is out of range")
    assert executor.batches == 0 and engine.packed_calls == [3, 1, 1, 1]
    assert isinstance(results[0].reply, Reply) and results[0].reply.batched is None


def test_an_engine_death_in_a_group_fails_every_job_of_it(engine):
    executor = make_executor(engine, packing=True)
    engine.fail = EngineDead("engine process exited")
    results = executor.serve_group([job(), job()])
    assert [error_of(r)[0] for r in results] == [ErrorCode.ENGINE_DEAD.value] * 2
    assert executor.engine_error is not None and engine.packed_calls == [2]


def test_in_a_group_only_the_reply_over_its_limit_is_refused(engine, lend):
    executor = make_executor(engine, packing=True)
    small, big = job(offers={"lend": {}}), job(offers={"lend": {}}, max_reply_bytes=10)
    results = executor.serve_group([small, big])
    assert [r.status for r in results] == [Status.OK, Status.ERROR] and executor.batches == 1
    assert [loan.calls for loan in lend.loans] == [[], ["dropped"]]


# ------------------------------------------------------ wire_dtype="fp8"


class HiddenStateEngine(StandInEngine):
    """Also answers a hidden state, ``aux_hidden_states`` ``[B, S, 3]`` (the stand-in's hidden size), of the
    input ids; an input id ``NAN`` makes it hold a NaN there, as a broken target would."""

    NAN = 13

    def generate_batch(self, input_ids, attention_mask, loss_mask, kind="eagle3") -> dict[str, torch.Tensor]:
        out = super().generate_batch(input_ids, attention_mask, loss_mask, kind)
        states = input_ids.unsqueeze(-1).float() * torch.tensor([1.0, -0.5, 0.25])
        states[input_ids == self.NAN] = float("nan")
        return {"aux_hidden_states": states, **out}


def test_fp8_quantizes_the_hidden_states_only_and_digests_the_bytes_sent():
    executor = make_executor(HiddenStateEngine())
    result = executor.serve(job([[5, 6, 7, 0]], wire_dtype="fp8", verify=True))
    out = decoded(result)
    assert isinstance(result.reply, Reply) and result.reply.wire_dtype == "fp8"
    assert list(out) == ["aux_hidden_states", "aux_hidden_states_scale", "doubled", "kept"]
    assert out["aux_hidden_states"].dtype == torch.float8_e4m3fn and out["aux_hidden_states_scale"].shape == (1, 4, 1)
    assert torch.equal(out["doubled"], torch.tensor([[10, 12, 14, 0]]))  # everything else as computed
    assert result.reply.digests == digest.digests([out])[0]  # of the FP8 bytes and scales, as sent


def test_fp8_is_declined_where_the_path_or_the_states_cannot_carry_it(lend, caplog):
    """A path that does not send FP8, and a hidden state holding NaN: the model dtype, the reason logged once."""
    executor = make_executor(HiddenStateEngine())
    lend.sends_fp8 = False
    with caplog.at_level(logging.WARNING, logger="spec_serve.worker"):
        results = [executor.serve(job(wire_dtype="fp8", offers={"lend": {}})) for _ in range(2)]
        results.append(executor.serve(job([[HiddenStateEngine.NAN, 1, 0, 0]], wire_dtype="fp8")))
    for result in results:
        assert isinstance(result.reply, Reply) and result.reply.wire_dtype is None
        assert decoded(result)["aux_hidden_states"].dtype == torch.float32
    assert decoded(results[2])["aux_hidden_states"][0, 0].isnan().all()  # sent as it is, not hidden
    assert caplog.text.count("the lend reply path sends the model dtype") == 1
    assert caplog.text.count("fp8 cannot quantize a tensor holding NaN or infinity") == 1


def test_fp8_in_a_packed_group_is_per_job():
    executor = make_executor(HiddenStateEngine(), packing=True)
    results = executor.serve_group([job([[1, 2, 0, 0]], wire_dtype="fp8"), job([[3, 0, 0, 0]])])
    assert executor.batches == 1 and [r.reply.wire_dtype for r in results] == ["fp8", None]
    assert [decoded(r)["aux_hidden_states"].dtype for r in results] == [torch.float8_e4m3fn, torch.float32]
