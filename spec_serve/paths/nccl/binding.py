"""NCCL data plane: a client bound to a worker of its own (see docs/nccl.md).

Message sequence (control on ZeroMQ, tensor bytes on a private PairGroup):

1. client -> broker ``BIND`` {reply_to, data_key?, timeout, device_type}
2. broker: no unbound worker of the service -> ``BOUND`` {ok: false, error} at once (client falls
   back to frames). Else it marks the worker ``bound_to = client`` (no more pool dispatch to it)
   and sends the worker ``BIND`` {client, reply_to, data_key?, prefix, timeout, device_type}.
3. worker compute thread (after the jobs already queued): hosts a TCPStore on its broker-facing
   address and PUSHes the client a data message with the BIND request id and header
   {bind: {store_host, store_port, prefix, worker, timeout}}; then both sides ``PairGroup.create``
   (worker rank 0 on its compute thread, client rank 1 on its pair thread).
4. requests carry {pin: <worker id>, offers: {nccl: {host}}}; the broker routes them to that worker only.
   The worker replies with a data message {path: {nccl: {pair: prefix, specs: [...]}}, fingerprint,
   digests?} and no payload frames, then ``send_tensors``; the client's pair thread ``recv_tensors``
   onto its device, and the I/O thread checks fingerprint and digests (spec_serve/protocol/digest.py).
5. release: client ``RELEASE`` {prefix} (close, or a broken binding), client expiry, or worker
   death (the broker tells the client ``BOUND`` {ok: false, lost: worker, prefix}).

Each header is a typed message of spec_serve.protocol.messages (BindRequest, Bound, WorkerBind, BindGrant,
Reply, Release), listed in docs/protocol.md; the offer and descriptor are NCCL's own (messages.py).

Any failure falls back to frames through the shared pool: the request is re-sent without
its ``pin`` and NCCL offer, and the next generate call binds again.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from spec_serve.paths.base import ClientPort
from spec_serve.paths.nccl.messages import NcclDescriptor
from spec_serve.protocol.commands import CLIENT_TAG, ClientCommand, control
from spec_serve.protocol.messages import BindGrant, BindRequest, Bound, Release, Reply
from spec_serve.supervision.contract import ReplySpecs, reply_bytes, validate_reply
from spec_serve.telemetry.logs import event

if TYPE_CHECKING:
    from spec_serve.paths.nccl.pairgroup import PairGroup

log = logging.getLogger("spec_serve.client")

def encode_specs(tensors: dict[str, torch.Tensor]) -> list[list[Any]]:
    """JSON-able (name, shape, dtype) list of ``tensors`` for the metadata message."""
    return [[name, list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in tensors.items()]


def decode_specs(raw: Any) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The inverse of :func:`encode_specs`, checked (a peer's header is untrusted)."""
    if not isinstance(raw, list) or not raw:
        raise ValueError("nccl reply without tensor specs")
    specs = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 3):
            raise ValueError(f"bad tensor spec {item!r}")
        name, shape, dtype_name = item
        dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
        if not isinstance(name, str) or not isinstance(dtype, torch.dtype):
            raise ValueError(f"bad tensor spec {item!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"bad tensor shape in {item!r}")
        specs.append((name, tuple(shape), dtype))
    return specs


class _Bound:
    """One live binding: the worker, the group's prefix and the PairGroup (used on the pair thread)."""

    def __init__(self, worker: str, prefix: str, pair: PairGroup):
        self.worker = worker
        self.prefix = prefix
        self.pair = pair
        self.broken: str | None = None


class ClientBinding:
    """Client side of the NCCL data plane. ``ensure()`` runs on user threads, ``on_metadata``
    and ``lost`` on the I/O thread, receives on a dedicated pair thread."""

    def __init__(self, io: ClientPort, service: str, device: torch.device, timeout: float, retry_s: float):
        self.io = io  # the client's I/O thread, which owns this binding
        self.service = service
        self.device = device
        self.timeout = timeout
        self.retry_s = retry_s
        self._lock = threading.Lock()
        self._state: _Bound | None = None
        self._not_before = 0.0
        self._disabled: str | None = None
        self._closed = False
        self._pair_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="spec-serve-pair")
        try:
            import torch.distributed as dist

            if not dist.is_available():
                self._disabled = "torch.distributed is not available in this build"
        except ImportError as e:
            self._disabled = f"torch.distributed cannot be imported: {e}"
        if self._disabled:
            event(log, logging.WARNING, "client.nccl_unavailable", fallback="frames", reason=self._disabled)

    @property
    def worker(self) -> str | None:
        state = self._state
        return state.worker if state is not None and state.broken is None else None

    # ------------------------------------------------------------ user side

    def ensure(self) -> str | None:
        """The bound worker's id to route to, binding first if needed; None: use frames."""
        with self._lock:
            state = self._state
            if state is not None and state.broken is None:
                return state.worker
            self._state = None  # a broken binding was released when it broke
            if self._disabled or self._closed or time.monotonic() < self._not_before:
                return None
            return self._bind()

    def rebind(self) -> str | None:
        """Drop the current binding (if any) and bind again now, ignoring the retry back-off."""
        with self._lock:
            if self._state is not None:
                self._break(self._state, "rebind requested", warn=False)
            self._not_before = 0.0
        return self.ensure()

    def _bind(self) -> str | None:
        request = BindRequest(reply_to=self.io.data_endpoint, timeout=self.timeout, device_type=self.device.type,
                              data_key=self.io.data_key or None)
        try:
            grant = self.io.submit(ClientCommand.BIND, self.service, request, (), self.timeout,
                                   max_retries=0).result().header
        except Exception as e:
            self._give_up(f"bind request failed: {e}")
            return None
        if isinstance(grant, Bound):  # BOUND from the broker: a refusal (or the worker was lost meanwhile)
            self._give_up(f"broker refused: {grant.error}")
            return None
        if not isinstance(grant, BindGrant):
            self._give_up(f"bind request failed: answered with {type(grant).__name__}")
            return None
        prefix, worker = grant.bind.prefix, grant.bind.worker
        try:
            from spec_serve.paths.nccl.pairgroup import PairGroup

            pair = self._pair_thread.submit(
                PairGroup.create, grant.bind.store_host, grant.bind.store_port, 1, device=self.device,
                prefix=prefix, timeout=self.timeout, listen_host=self.io.local_host).result()
        except Exception as e:
            self._send_release(prefix)
            self._give_up(f"could not form the pair group with worker {worker}: {e}")
            return None
        self._state = _Bound(worker, prefix, pair)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        event(log, logging.INFO, "client.nccl_bound", worker=worker, backend=backend, device=self.device)
        return worker

    def _give_up(self, reason: str) -> None:
        self._not_before = time.monotonic() + self.retry_s
        event(log, logging.WARNING, "client.nccl_fallback", fallback="frames", retry_in_s=self.retry_s, reason=reason)

    # ------------------------------------------------------------- I/O side

    def on_metadata(self, request_id: bytes, reply: Reply, expect: ReplySpecs | None, max_bytes: int) -> bool:
        """A worker's nccl reply header: receive its tensors on the pair thread, once they are what
        ``expect`` says (a reply nobody waits for: at most ``max_bytes``). False when no live binding
        matches or the specs are wrong (the binding is dropped; the caller falls back to frames)."""
        state = self._state
        if state is None or state.broken is not None:
            return False
        try:
            descriptor = NcclDescriptor.from_json(reply.descriptor("nccl"))
        except ValueError:
            descriptor = None
        if descriptor is None or descriptor.pair != state.prefix:
            return False
        try:
            specs = decode_specs(descriptor.specs)
            got = {name: (dtype, shape) for name, shape, dtype in specs}
            if expect is not None:
                validate_reply(got, expect)
            elif reply_bytes(got) > max_bytes:
                raise ValueError(f"unrequested nccl reply of {reply_bytes(got)} bytes")
        except ValueError as e:
            self.mark_broken(str(e), state.prefix)
            return False
        self._pair_thread.submit(self._receive, state, request_id, specs, reply)
        return True

    def _receive(self, state: _Bound, request_id: bytes, specs: list[tuple[str, tuple[int, ...], torch.dtype]],
                 reply: Reply) -> None:
        tensors: dict[str, torch.Tensor] | None = None
        if state.broken is not None:
            error = state.broken
        else:
            try:
                tensors, error = state.pair.recv_tensors(specs), ""
            except Exception as e:  # PairGroupError: the group aborted itself; no partial tensors escape
                error = f"receive failed: {e}"
                self.mark_broken(error, state.prefix)
        try:
            if tensors is not None:
                received = tensors
                self.io.call(lambda: self.io.resolve(request_id, reply, received, "nccl"))
            else:
                self.io.call(lambda: self.io.fallback(request_id, "nccl", error))
        except RuntimeError:
            pass  # client closed

    def lost(self, prefix: str | None, reason: str) -> None:
        """The broker says the bound worker is gone."""
        self.mark_broken(reason, prefix)

    def mark_broken(self, reason: str, prefix: str | None = None) -> None:
        """Any thread: stop using the binding, give the worker back, and let the next call rebind."""
        state = self._state
        if state is None or state.broken is not None or (prefix is not None and prefix != state.prefix):
            return
        self._break(state, reason, warn=True)

    def _break(self, state: _Bound, reason: str, warn: bool) -> None:
        state.broken = reason
        self._not_before = 0.0
        if warn:
            event(log, logging.WARNING, "client.nccl_broken", worker=state.worker, fallback="frames", reason=reason)
        self._send_release(state.prefix)
        try:
            self._pair_thread.submit(state.pair.abort)  # on the pair thread: PairGroup is not thread-safe
        except RuntimeError:
            pass

    def _send_release(self, prefix: str) -> None:
        frames = control(CLIENT_TAG, ClientCommand.RELEASE.value, self.service, b"", Release(prefix))
        try:
            self.io.call(lambda: self.io.send_control(frames))
        except RuntimeError:
            pass  # closed: DISCONNECT releases it anyway

    def close(self) -> None:
        """Release the binding (before the client's DISCONNECT) and stop the pair thread."""
        with self._lock:
            self._closed = True
            state, self._state = self._state, None
            if state is not None and state.broken is None:
                self._break(state, "client closed", warn=False)
        self._pair_thread.shutdown(wait=False, cancel_futures=False)
