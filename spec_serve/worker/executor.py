"""Jobs to results on the engine, on the compute thread: run a request (alone, or several in one packed
forward), put its hidden states in the dtype they travel in (``wire_dtype``), take the reply's integrity
fields, and hand the outputs to the reply path that carries them (paths/registry.py). Every failure becomes
an error reply."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, cast

import torch

from spec_serve.engines import engine_dead, packing
from spec_serve.engines.base import PackingEngine, TargetEngine
from spec_serve.paths.base import Delivery, PathUnavailable
from spec_serve.paths.registry import Route, WorkerPaths
from spec_serve.protocol import digest, wire
from spec_serve.protocol.commands import ErrorCode, Op, Status
from spec_serve.protocol.messages import Reply
from spec_serve.supervision import fp8
from spec_serve.supervision.contract import FP8_TENSORS, REQUEST_TENSORS, Kind
from spec_serve.telemetry.logs import event, one_line
from spec_serve.worker.forward_hold import hold_forward
from spec_serve.worker.jobs import Job, RequestError, Result, error_result
from spec_serve.worker.vocab_store import VocabStore

log = logging.getLogger("spec_serve.worker")


class Executor:
    def __init__(self, engine: TargetEngine, name: str, *, packing: bool, vocab: VocabStore, paths: WorkerPaths,
                 max_message_bytes: int):
        self.engine = engine
        self.name = name
        # Packing (docs/packing.md): each generate request runs without its padding. Off: every request
        # runs padded, bit-equal to the colocated forward.
        self.packing = packing
        self.vocab = vocab
        self.max_message_bytes = max_message_bytes
        self.paths = paths  # where replies go: the first path of the order (paths/registry.py) that takes each
        # Set (once) when the engine died: the worker answers what found it so, then leaves the pool.
        self.engine_error: str | None = None
        self.batches = 0  # packed forwards run for several requests
        self.digests = 0  # reply tensors digested (verify)
        self._fp8_declined: set[str] = set()  # why wire_dtype="fp8" replies went in the model dtype (logged once each)

    # ------------------------------------------------------------ one job

    def serve(self, job: Job) -> Result:
        """Run one job on the engine; every failure becomes an error reply."""
        start = time.perf_counter()
        try:
            if job.refused is not None:
                raise RequestError(ErrorCode.BAD_REQUEST, job.refused)
            return self._serve(job, start)
        except RequestError as e:
            code, message = e.code, str(e)
        except (ValueError, wire.WireError) as e:
            code, message = ErrorCode.BAD_REQUEST, str(e)
        except Exception as e:
            if engine_dead(e):
                return self._dead_result(job, e)
            log.exception("worker.engine_failed worker=%s", self.name)  # the engine failed: report, keep serving
            code, message = ErrorCode.INTERNAL, f"{type(e).__name__}: {e}"
        event(log, logging.INFO, "worker.request_failed", code=code.value, error=message)
        return error_result(job, self.name, code, message)

    def _serve(self, job: Job, start: float) -> Result:
        route = self.route(job)
        tensors, tokens = self._execute(job, route)
        tensors, wire_dtype = self._on_wire(job, route, tensors)
        reply = Reply(worker=self.name, compute_s=round(time.perf_counter() - start, 6), kind=route.reply_kind,
                      wire_dtype=wire_dtype, **self._integrity([job], [tensors])[0])
        outgoing = self.paths.deliver([route], [Delivery(job.request_id, job.request, tensors, reply)])[0]
        return self._within_client_limit(Result(job, Status.OK, outgoing, tokens))

    def route(self, job: Job) -> Route:
        """The reply path of ``job`` and the kind it computes (chosen before the forward, once: cached on the
        job); ``unavailable`` if the path the request insists on cannot carry it."""
        if job.route is None:
            try:
                job.route = self.paths.route(job.request)
            except PathUnavailable as e:
                raise RequestError(ErrorCode.UNAVAILABLE, str(e)) from None
        return job.route

    def _execute(self, job: Job, route: Route) -> tuple[dict[str, torch.Tensor], int]:
        op = job.request.operation
        if op == Op.GENERATE.value:
            return self._generate(job, Kind.parse(cast(str, route.kind)))
        if op == Op.EMBEDDINGS.value:
            which = job.request.which
            if which == "input":
                weight = self.engine.get_input_embeddings().weight
            elif which == "output":
                weight = self.engine.get_output_embeddings().weight
            else:
                raise RequestError(ErrorCode.BAD_REQUEST, f"embeddings 'which' must be input or output, got {which!r}")
            return {"weight": weight.detach().to("cpu").contiguous()}, 0
        if op == Op.LM_HEAD_SLICE.value:
            ids, _ = self.vocab.get(job.request.vocab)
            weight = self.engine.get_output_embeddings().weight.detach()
            return {"weight": weight.index_select(0, ids.to(weight.device)).to("cpu")}, 0
        raise RequestError(ErrorCode.BAD_REQUEST, f"unknown op {op!r}")

    def _generate(self, job: Job, kind: Kind) -> tuple[dict[str, torch.Tensor], int]:
        tensors = self.request_tensors(job)
        self.vocab.select(self.engine, kind, job.request.vocab)
        input_ids, attention_mask, loss_mask = (tensors[n] for n in REQUEST_TENSORS)
        hold_forward()
        if self.packing and packing.row_lengths(attention_mask, loss_mask) is not None:
            out = self._packing_engine().generate_packed([(input_ids, attention_mask, loss_mask)], kind=kind.value)[0]
        else:  # not packing, or a request packing cannot take (left padding, loss on padding): padded
            out = self.engine.generate_batch(input_ids, attention_mask, loss_mask, kind=kind.value)
        tokens = int(tensors["attention_mask"].sum())
        return out, tokens

    def _on_wire(self, job: Job, route: Route, tensors: dict[str, torch.Tensor]
                 ) -> tuple[dict[str, torch.Tensor], str | None]:
        """The reply's tensors as they travel, and its ``wire_dtype``: the hidden states in FP8 (each with its
        scales, supervision/fp8.py) when the request asks it and its path carries it, else as computed (the
        client counts those). Argmax and probabilities were computed from the unquantized states."""
        wanted = job.request.wire_dtype
        if wanted is None or not job.request.is_generate:
            return tensors, None
        if not route.side.sends_fp8:
            self._decline(f"the {route.side.name} reply path sends the model dtype")
            return tensors, None
        try:
            return fp8.quantize_reply(tensors, FP8_TENSORS, self.engine.target_info().hidden_size), wanted
        except ValueError as e:  # a hidden state holding NaN or infinity: sent as it is, not hidden by a scale
            self._decline(str(e))
            return tensors, None

    def _decline(self, reason: str) -> None:
        if reason not in self._fp8_declined:
            self._fp8_declined.add(reason)
            event(log, logging.WARNING, "worker.fp8_declined", worker=self.name, reason=reason,
                  sent="model dtype (logged once per reason)")

    def _packing_engine(self) -> PackingEngine:
        # cast: packing is on only for an engine the worker's _check_packing accepted (it has generate_packed)
        return cast(PackingEngine, self.engine)

    def request_tensors(self, job: Job) -> dict[str, torch.Tensor]:
        """The request's tensors, decoded once (cached on the job)."""
        if job.tensors is not None:
            return job.tensors
        tensors = wire.decode(job.payload, max_bytes=self.max_message_bytes)
        missing = [n for n in REQUEST_TENSORS if n not in tensors]
        if missing or len(tensors) != len(REQUEST_TENSORS):
            raise RequestError(ErrorCode.BAD_REQUEST,
                               f"request must hold exactly {list(REQUEST_TENSORS)}, got {sorted(tensors)}")
        job.tensors = tensors
        return tensors

    # ------------------------------------------------------ a packed group

    def serve_group(self, jobs: list[Job]) -> list[Result]:
        """Serve jobs with one packed forward and split the result per job; one job: ``serve``."""
        if len(jobs) == 1:
            return [self.serve(jobs[0])]
        start = time.perf_counter()
        try:
            routes = [self.route(job) for job in jobs]
            kind = Kind.parse(cast(str, routes[0].kind))  # the same for all: ComputeLoop groups by it
            parts = [self.request_tensors(job) for job in jobs]
            self.vocab.select(self.engine, kind, jobs[0].request.vocab)
            requests = [(p["input_ids"], p["attention_mask"], p["loss_mask"]) for p in parts]  # REQUEST_TENSORS
            hold_forward()
            outs = self._packing_engine().generate_packed(requests, kind=kind.value)
            on_wire = [self._on_wire(job, route, out) for job, route, out in zip(jobs, routes, outs)]
            elapsed = round(time.perf_counter() - start, 6)
            results = self._split_replies(jobs, routes, parts, on_wire,
                                          Reply(worker=self.name, compute_s=elapsed, batched=len(jobs),
                                                kind=routes[0].reply_kind))
            self.batches += 1
            return [self._within_client_limit(result) for result in results]
        except Exception as e:  # e.g. one bad row: serve each alone, so each gets its own answer
            if engine_dead(e):  # any of these rows may be what killed it
                return [self._dead_result(job, e) for job in jobs]
            event(log, logging.INFO, "worker.batch_failed", jobs=len(jobs), error=e)
            return [self.serve(job) for job in jobs]

    def _split_replies(self, jobs: list[Job], routes: list[Route], parts: list[dict],
                       on_wire: list[tuple[dict, str | None]], base: Reply) -> list[Result]:
        """One reply per job of a packed forward (``on_wire``: its tensors as they travel, and their
        ``wire_dtype``), each through its path (frames: one host slab for all of them, released once per
        reply; a path that lends memory: a slot each)."""
        outs = [tensors for tensors, _ in on_wire]
        wire_dtypes = [wire_dtype for _, wire_dtype in on_wire]
        integrity = self._integrity(jobs, outs)
        outgoing = self.paths.deliver(routes,
                                      [Delivery(job.request_id, job.request, out,
                                                dataclasses.replace(base, wire_dtype=wire_dtype, **checks))
                                       for job, out, wire_dtype, checks in zip(jobs, outs, wire_dtypes, integrity)])
        return [Result(job, Status.OK, reply, int(part["attention_mask"].sum()))
                for job, part, reply in zip(jobs, parts, outgoing)]

    # ------------------------------------------------------------ replies

    def _integrity(self, jobs: list[Job], outputs: list[dict[str, torch.Tensor]]) -> list[dict[str, Any]]:
        """Per job, the reply fields its client checks (``Reply`` keywords): the fingerprint of the target that computed
        it and, when the request asked (``verify``), a digest of each output tensor, taken here on our
        device before any copy (spec_serve/protocol/digest.py); one host transfer for all of them."""
        fingerprint = self.engine.target_info().fingerprint
        wanted = [i for i, job in enumerate(jobs) if job.request.verify]
        fields: list[dict[str, Any]] = [{"fingerprint": fingerprint} for _ in jobs]
        for i, sums in zip(wanted, digest.digests([outputs[i] for i in wanted])):
            fields[i]["digests"] = sums
            self.digests += len(sums)
        return fields

    def _within_client_limit(self, result: Result) -> Result:
        """``result``, or a bad_request error if its payload exceeds the ``max_reply_bytes`` the client
        named: refused here, once, rather than sent for the client to drop (and ask for again)."""
        limit = result.job.request.max_reply_bytes
        size = result.nbytes
        if limit is None or size <= limit:
            return result
        result.drop()
        message = (f"reply of {size} bytes exceeds the client's max_message_bytes of {limit}: raise the "
                   f"client's max_message_bytes or send fewer rows per request (num_shards)")
        event(log, logging.INFO, "worker.request_failed", code=ErrorCode.BAD_REQUEST.value, error=message)
        return error_result(result.job, self.name, ErrorCode.BAD_REQUEST, message)

    def _dead_result(self, job: Job, exc: BaseException) -> Result:
        """The engine died running ``job``: answer ``engine_dead`` and stop serving (the worker then leaves)."""
        if self.engine_error is None:
            self.engine_error = one_line(exc)
            log.error("worker.engine_dead worker=%s error=%s", self.name, self.engine_error,
                      exc_info=log.isEnabledFor(logging.DEBUG))
        return error_result(job, self.name, ErrorCode.ENGINE_DEAD, self.engine_error)
