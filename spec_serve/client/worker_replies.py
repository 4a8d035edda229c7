"""Workers' data messages to the requests they answer, whichever reply path carried them (spec_serve/paths:
frames, memory a worker lent, or a header whose tensors follow on another channel).
I/O thread unless noted."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping

from spec_serve.client.errors import RemoteError, TargetChangedError
from spec_serve.client.pending import RETRY_BACKOFF_S, Pending, Requests
from spec_serve.client.received import Received, ReceivedTensor
from spec_serve.client.stats import ClientStats
from spec_serve.paths.base import Arrival, ClientSide, release
from spec_serve.paths.registry import ClientPaths
from spec_serve.protocol.commands import ClientCommand, ErrorCode, Status, new_request_id, parse_data
from spec_serve.protocol.messages import BindGrant, ErrorReply, Reply
from spec_serve.supervision.contract import Kind, validate_reply
from spec_serve.telemetry.logs import event
from spec_serve.telemetry.metrics import CLIENT_INTEGRITY_FAILURES

log = logging.getLogger("spec_serve.client")


class WorkerReplies:
    """Resolves, retries or fails pending requests from the data messages workers push to us.

    ``call`` runs a function on the I/O thread from any thread; ``send_new`` sends a new request (there).
    """

    def __init__(self, requests: Requests, stats: ClientStats, max_message_bytes: int,
                 call: Callable[[Callable[[], None]], None], send_new: Callable[[Pending], None]):
        self.requests = requests
        self.stats = stats
        self.max_message_bytes = max_message_bytes
        self.paths: ClientPaths  # the client's reply paths (set by ClientIO.use_paths before any request)
        self._call = call
        self._send_new = send_new

    def on_data(self, frames: list) -> None:
        status, request_id, header, payload = parse_data(frames)
        pending = self.requests.table.get(request_id)
        if status is Status.ERROR:
            failure = ErrorReply.from_json(header)
            if pending is None:
                self.requests.count_stray(request_id)
            else:
                self._on_error(pending, failure)
        elif pending is not None and pending.command == ClientCommand.BIND.value:
            self.requests.resolve(pending, Received(request_id, BindGrant.from_json(header)))
        else:
            self._on_reply(request_id, pending, Reply.from_json(header), header, payload)

    def _on_reply(self, request_id: bytes, pending: Pending | None, reply: Reply, header: dict,
                  payload: list) -> None:
        path = self.paths.carrying(reply)
        if path.tensors_follow:  # received even for a request already answered, or the worker's send stalls
            expect = (pending.expect.for_reply(reply.kind, reply.wire_dtype)
                      if pending is not None and pending.expect else None)
            path.accept(Arrival(request_id, reply, header, payload, expect, self.requests.table.largest,
                                self._no_asking_again))
            return
        if pending is None or not self.same_target(pending, reply):
            if pending is None:
                self.requests.count_stray(request_id)
            path.discard(reply)  # answered already, or not ours to use: what it lends goes back unread
            return
        self._on_tensors(pending, path, reply, header, payload)

    def _on_error(self, pending: Pending, failure: ErrorReply) -> None:
        code, error = failure.code, f"worker {failure.worker}: {failure.error}"
        if code == ErrorCode.BAD_REQUEST.value:
            self.requests.fail(pending, ValueError(error))
        elif code == ErrorCode.ENGINE_DEAD.value:  # not retried: this request may be what killed it
            self.requests.fail(pending, RemoteError(f"{error} (its engine died serving this request; the worker "
                                                    f"left the pool)"))
        else:
            self.requests.retry(pending, time.monotonic(), error, delay=RETRY_BACKOFF_S, exhausted=RemoteError)

    def _on_tensors(self, pending: Pending, path: ClientSide, reply: Reply, header: dict, payload: list) -> None:
        """``header``: the data message's as received (a path may read more of it than ``reply`` holds)."""
        size = sum(len(memoryview(f)) for f in payload) + path.lent_bytes(reply)
        if size > self.max_message_bytes:  # an honest worker refuses this itself (max_reply_bytes)
            path.discard(reply)
            self.requests.fail(pending, ValueError(
                f"reply of {size} bytes from worker {reply.worker} exceeds this client's "
                f"max_message_bytes of {self.max_message_bytes}"))
            return
        # Checked by the path; the bytes stay where they arrived until copied to the caller's tensors (assembly).
        tensors = path.accept(self._arrival(pending, path, reply, header, payload))
        if tensors is None or not self._meets_contract(pending, reply, tensors):
            return
        self._count(pending, path.name, reply)
        self.requests.resolve(pending, Received(pending.request_id, reply, tensors))

    def _count(self, pending: Pending, path: str, reply: Reply) -> None:
        self.stats.replies[path] += 1
        if reply.batched is not None and reply.batched > 1:
            self.stats.batched += 1
        request = pending.request
        if (reply.kind or (request.supervision_kind if request is not None else None)) == Kind.EAGLE3_COMPACT.value:
            self.stats.compact_replies += 1
        if request is not None and request.wire_dtype is not None and request.is_generate:
            if reply.wire_dtype == request.wire_dtype:
                self.stats.fp8_replies += 1
            else:
                self._count_declined(reply)

    def _count_declined(self, reply: Reply) -> None:
        """A reply to a wire_dtype="fp8" request that came in the model dtype: counted, the first one logged."""
        if not self.stats.fp8_declined:
            event(log, logging.WARNING, "client.fp8_declined", worker=reply.worker,
                  sent="model dtype (counted in stats.fp8_declined; the worker logs why)")
        self.stats.fp8_declined += 1

    def _arrival(self, pending: Pending, path: ClientSide, reply: Reply, header: dict, payload: list) -> Arrival:
        expect = pending.expect.for_reply(reply.kind, reply.wire_dtype) if pending.expect is not None else None
        return Arrival(pending.request_id, reply, header, payload, expect, self.max_message_bytes,
                       lambda reason: self._ask_again(pending, path, reason))

    def _meets_contract(self, pending: Pending, reply: Reply, tensors: Mapping[str, ReceivedTensor]) -> bool:
        """Whether the reply holds what the request expects (of the kind the reply names), checked before
        anything is allocated for it; if not, it is dropped and the request retried."""
        if pending.expect is None:
            return True
        worker = reply.worker
        try:
            validate_reply({name: (span.dtype, span.shape) for name, span in tensors.items()},
                           pending.expect.for_reply(reply.kind, reply.wire_dtype))
        except ValueError as e:
            release(tensors)
            self.stats.contract_violations += 1
            event(log, logging.WARNING, "client.bad_reply", worker=worker, error=e)
            self.requests.retry(pending, time.monotonic(), f"worker {worker}: {e}",
                                delay=RETRY_BACKOFF_S)
            return False
        return True

    # ------------------------------------------------------------- target

    def same_target(self, pending: Pending, reply: Reply) -> bool:
        """True if the reply comes from the target the request was pinned to (its ``fingerprint``);
        else the request fails and the reply is dropped."""
        expected = pending.request.fingerprint if pending.request is not None else None
        got = reply.fingerprint
        if expected is None or got == expected:
            return True
        self.target_changed(pending, f"worker {reply.worker} of service {pending.service!r} serves target "
                            f"fingerprint {got}, but this client set up with {expected}: its reply was discarded; "
                            f"start a new client to use the new target", worker=reply.worker)
        return False

    def target_changed(self, pending: Pending, message: str, worker) -> None:
        self.stats.target_mismatches += 1
        CLIENT_INTEGRITY_FAILURES.labels(service=pending.service, check="fingerprint").inc()
        event(log, logging.ERROR, "client.target_changed", request=pending.short_id, worker=worker, error=message)
        self.requests.fail(pending, TargetChangedError(message))

    # ------------------------------------------------------ any reply path

    def _ask_again(self, pending: Pending, path: ClientSide, reason: str) -> concurrent.futures.Future:
        """Any thread: the request once more without ``path`` under a new id (its reply was answered, but its
        bytes turned out unusable); the future of its answer."""
        request = pending.request
        header = path.without(request) if request is not None else pending.header
        again = dataclasses.replace(pending, request_id=new_request_id(), future=concurrent.futures.Future(),
                                    header=header, attempts=0, sent_at=0.0, resend_at=None)

        def send_again() -> None:
            self._count_path_fallback(again, path.name, reason)
            self._send_new(again)

        self._call(send_again)
        return again.future

    def fallback(self, request_id: bytes, path: str, reason: str) -> None:
        """The request again without the path named ``path`` (no attempt used); nothing if it no longer
        uses that path (sent again without it already)."""
        pending = self.requests.table.get(request_id)
        request = pending.request if pending is not None else None
        side = self.paths.named(path)
        if pending is None or request is None or side is None or side.without(request) == request:
            return
        pending.header = side.without(request)
        self._count_path_fallback(pending, path, reason)
        self.requests.send_uncounted(pending, time.monotonic(), restart_clock=True)

    def leave_pinned(self, request_id: bytes, reason: str) -> None:
        """A request pinned to one worker by its path (a worker we hold) failed there (timeout, error):
        that path is dropped for now and the request goes to the shared pool."""
        pending = self.requests.table.get(request_id)
        request = pending.request if pending is not None else None
        side = next((s for s in self.paths.sides if request is not None and s.pins(request)), None)
        if side is not None:
            side.broken(reason)
            self.fallback(request_id, side.name, reason)

    @staticmethod
    def _no_asking_again(reason: str) -> concurrent.futures.Future:
        raise RuntimeError(f"a reply whose tensors followed cannot be asked for again here: {reason}")

    def resolve_followed(self, request_id: bytes, reply: Reply, tensors: dict, path: str) -> None:
        """Tensors that followed a reply's header on another channel (``ClientSide.tensors_follow``) arrived."""
        pending = self.requests.table.get(request_id)
        if pending is None or pending.future.done():
            self.requests.table.remove(request_id)
            self.requests.count_stray(request_id)
            return
        if not self.same_target(pending, reply):
            return
        self._count(pending, path, reply)
        self.requests.resolve(pending, Received(request_id, reply, tensors))

    def _count_path_fallback(self, pending: Pending, path: str, reason: str) -> None:
        self.stats.fallbacks[path] += 1
        event(log, logging.INFO, "client.path_fallback", path=path, request=pending.short_id, reason=reason)
