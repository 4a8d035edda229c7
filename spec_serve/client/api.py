"""The training-side client: ``RemoteTargetModel`` has the colocated target's surface.

It prepares requests (sharding, the vocab mapping, the pinned target) and hands them to its I/O
thread (io_thread.py); the replies come back as one future per batch (assembly.py).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import threading
import time
import types
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from spec_serve.client import options
from spec_serve.client.assembly import assemble, shard_bounds
from spec_serve.client.compact import Expansion, SliceCache, expander_thread
from spec_serve.client.demand import DemandMeter, metered
from spec_serve.client.errors import BrokerUnreachable, IntegrityError, RemoteError, TargetChangedError
from spec_serve.client.integrity import DigestCheck
from spec_serve.client.io_thread import ClientIO
from spec_serve.client.path_port import PathPort
from spec_serve.client.restore import Restoration
from spec_serve.client.staging import Staging
from spec_serve.client.stats import ClientStats
from spec_serve.paths.base import ClientSetup
from spec_serve.paths.registry import ClientPaths, Offers
from spec_serve.protocol import digest, wire
from spec_serve.protocol.commands import ClientCommand, Op, ReplyFormat, WireDtype
from spec_serve.protocol.messages import SetVocab, StatusPage, StatusQuery, SupervisionRequest
from spec_serve.supervision.contract import (
    Expected,
    Kind,
    TargetInfo,
    model_dtype,
    reply_specs,
    validate_request,
    validate_vocab_mapping,
    weight_specs,
)
from spec_serve.telemetry.metrics import CLIENT_LM_HEAD_SLICE_BYTES, CLIENT_LM_HEAD_SLICES
from spec_serve.transport.sockets import Security

_NEEDS_MAPPING = "EAGLE-3 supervision needs a draft-vocab mapping: call set_vocab_mapping first"

# What a caller catches and reads is importable from here too (``from spec_serve.client.api import ...``).
__all__ = ["BrokerUnreachable", "ClientStats", "IntegrityError", "RemoteError", "RemoteTargetModel",
           "TargetChangedError"]

# STATUS pages gathered at most (each holds up to 32 KiB of entries: far more than any real cluster).
MAX_STATUS_PAGES = 10_000


class RemoteTargetModel:
    """A frozen target served by spec-serve workers, with the colocated ``HFTarget`` surface.

    >>> target = RemoteTargetModel("tcp://broker:5555", num_shards=2, prefetch_depth=2)
    >>> target.set_vocab_mapping(selected_token_ids, selected_token_mask)
    >>> batch = target.generate_batch(input_ids, attention_mask, loss_mask, kind="eagle3")
    """

    def __init__(
        self,
        broker_url: str | None = None,
        *,
        service: str | None = None,
        device: str | torch.device | None = None,
        timeout: float | None = None,
        max_retries: int | None = None,
        prefetch_depth: int | None = None,
        num_shards: int | None = None,
        security: Security | None = None,
        advertise_host: str | None = None,
        heartbeat_interval: float | None = None,
        liveness: int | None = None,
        max_message_bytes: int | None = None,
        compact: bool | str | None = None,
        wire_dtype: str | None = None,
        enable_nccl: bool | None = None,
        nccl_timeout: float | None = None,
        nccl_retry_s: float | None = None,
        same_host_plane: bool | None = None,
        verify: str | None = None,
        connect_timeout: float | None = None,
        insecure_network: bool | None = None,
        cache: str | None = None,
        cache_max_bytes: int | None = None,
        cache_dtype: str | None = None,
    ):
        """An argument left None comes from its ``SPEC_SERVE_*`` variable, else its default: the table
        in spec_serve/client/options.py (docs/client-options.md); a bad value fails with one line."""
        o = options.resolve({
            "broker_url": broker_url, "service": service, "device": device, "timeout": timeout,
            "max_retries": max_retries, "prefetch_depth": prefetch_depth, "num_shards": num_shards,
            "security": security, "advertise_host": advertise_host, "heartbeat_interval": heartbeat_interval,
            "liveness": liveness, "max_message_bytes": max_message_bytes, "compact": compact,
            "wire_dtype": wire_dtype, "enable_nccl": enable_nccl, "nccl_timeout": nccl_timeout,
            "nccl_retry_s": nccl_retry_s,
            "same_host_plane": same_host_plane, "verify": verify, "connect_timeout": connect_timeout,
            "insecure_network": insecure_network, "cache": cache, "cache_max_bytes": cache_max_bytes,
            "cache_dtype": cache_dtype})
        # End-to-end check of reply bytes (spec_serve/protocol/digest.py): "all" (default), "sampled", "off".
        self._sampler = digest.Sampler(o["verify"])
        self.service = o["service"]
        self.device = torch.device(o["device"])
        self.timeout = o["timeout"]
        self.num_shards = o["num_shards"]
        self.prefetch_depth = o["prefetch_depth"]
        # How replies' hidden states travel: "auto", the model dtype; "fp8" (opt-in), float8_e4m3 with a scale
        # per token, restored to the model dtype on our device (restore.py); a worker or path that cannot
        # send FP8 answers in the model dtype (stats.fp8_declined).
        self.wire_dtype = o["wire_dtype"]
        self._credits = threading.BoundedSemaphore(self.prefetch_depth)
        self._io = ClientIO(o["broker_url"], security=o["security"], advertise_host=o["advertise_host"],
                            max_retries=o["max_retries"], heartbeat_interval=o["heartbeat_interval"],
                            liveness=o["liveness"], max_message_bytes=o["max_message_bytes"], device=self.device,
                            connect_timeout=o["connect_timeout"])
        self._io.start()
        self.cache = None
        try:
            self._setup(o["compact"], o.values)
            # The supervision cache (docs/cache.md), in front of every path below: None without cache=DIR.
            self.cache = None if o["cache"] is None else self._open_cache(o)
        except BaseException:
            self._io.close()  # a constructor that raises leaks no thread or descriptor
            raise

    def _open_cache(self, o: options.ClientOptions) -> Any:
        from spec_serve.cache.front import CacheFront, Upstream  # imports the client's modules: here, not at the top

        upstream = Upstream(self.target_info, self._generate_uncached, self._expansion, self.device,
                            self.prefetch_depth, self._demand.waiting)
        return CacheFront.open(o["cache"], upstream, max_bytes=o["cache_max_bytes"], codec=o["cache_dtype"])

    def _setup(self, compact: bool | str, path_options: Mapping[str, Any]) -> None:
        self._vocab_digest: str | None = None
        # The largest request payload the broker and this service's workers accept (learnt from STATUS).
        self._max_request_bytes: int | None = None
        self._draft_vocab: int | None = None
        self._info: TargetInfo | None = None
        self._fingerprint: str | None = None  # of the target we set up with; every reply must match it
        self._closed = False
        # Compact EAGLE-3 (compact.py): workers ship the last hidden state and argmax, and target_probs and
        # position_mask are rebuilt here from the mapping's lm_head slice. True: every EAGLE-3 reply;
        # "auto": those whose path leaves the worker's host (the worker picks, reply by reply); False: none.
        self.compact = compact  # True, False or "auto" (client/options.py checked it)
        self._slices = SliceCache(self._fetch_lm_head_slice, self._count_slice)
        self._selected_mask: torch.Tensor | None = None
        # Expansion runs off the I/O thread (a [B*S,H]x[H,Vd] GEMM must not stall sockets).
        self._expander = expander_thread(self.device)
        # Frames bound for a GPU land through pinned slabs (staging.py); a CPU client keeps zero-copy views.
        self._staging = Staging(self.device) if self.device.type == "cuda" else None
        # Where replies come by (paths/registry.py, in its order; docs/reply-paths.md): each path reads its own
        # options (the table in options.py), and every failure of a path falls back to frames.
        self._paths = ClientPaths(ClientSetup(PathPort(self._io), self.service, self.device, path_options))
        self._io.use_paths(self._paths)
        # What this rank waits and computes (demand.py), reported with every heartbeat.
        self._demand = DemandMeter(self._io.stats, self.service)
        self._io.heartbeat_header = self._demand.report

    @property
    def stats(self) -> ClientStats:
        return self._io.stats

    @property
    def verify(self) -> str:
        """How replies are checked end to end: "all", "sampled" (1 request in ``digest.SAMPLE_EVERY``) or "off"."""
        return self._sampler.mode

    @property
    def bound_worker(self) -> str | None:
        """Id of the worker bound to this client (enable_nccl), or None while frames are used."""
        return self._paths.holds()

    def rebind(self) -> str | None:
        """Drop the binding (if any) and ask for a worker of our own now; returns its id or None."""
        try:
            return self._paths.hold_again(before=self.target_info)
        except NotImplementedError:
            raise RuntimeError("rebind() needs enable_nccl=True") from None

    # ---------------------------------------------------------- supervision

    def generate_batch(self, input_ids, attention_mask, loss_mask, kind: str = "eagle3") -> dict[str, torch.Tensor]:
        """Supervision for one ``[B, S]`` batch; the contract's tensors on ``device``."""
        return self.generate_batch_async(input_ids, attention_mask, loss_mask, kind).result()

    def generate_batch_async(self, input_ids, attention_mask, loss_mask,
                             kind: str = "eagle3") -> concurrent.futures.Future:
        """Submit a batch; blocks while ``prefetch_depth`` batches are already in flight. Each call starts a step
        of this rank's demand (``stats``: the time blocked here or in the future's ``result()`` is its wait)."""
        if self.cache is not None:  # the cache sends the rows it lacks through _generate_uncached
            self._demand.step()
            return metered(self.cache.generate(input_ids, attention_mask, loss_mask, kind), self._demand)
        return self._generate_uncached(input_ids, attention_mask, loss_mask, kind, caller=True)

    def _generate_uncached(self, input_ids, attention_mask, loss_mask, kind: str = "eagle3",
                           caller: bool = False) -> concurrent.futures.Future:
        """A batch asked of the workers. ``caller``: the trainer's own call, a step of its demand (not the
        cache's threads sending the rows it lacks: their waits are not the caller's)."""
        kind = Kind.parse(kind)
        info = self.target_info()
        validate_request(input_ids, attention_mask, loss_mask, info.vocab_size)
        wire_kind = Kind.EAGLE3_COMPACT if self.compact is True and kind is Kind.EAGLE3 else kind
        auto = self.compact == "auto" and kind is Kind.EAGLE3  # the worker picks the format, reply by reply
        if kind is Kind.EAGLE3 and self._vocab_digest is None:
            raise RuntimeError(_NEEDS_MAPPING)
        offers = self._paths.offer(Op.GENERATE.value)  # a path may take a worker of our own first
        if auto and not offers:
            # Frames only: the worker answers compact (paths/registry.py, reply_kind). The slice is fetched now,
            # ahead of the request, as compact=True does: fetched on the first reply instead, its request queues
            # behind the batches in flight and the pipeline drains once. Cached: a lookup from the second batch.
            self.lm_head_slice()
        if caller:
            self._demand.step()
        with self._demand.waiting() if caller else contextlib.nullcontext():  # all prefetch_depth batches in
            self._credits.acquire()  # flight: the caller waits for supervision
        try:
            bounds = shard_bounds(input_ids.shape[0], self.num_shards)
            # The digest check may replace a shard's request with its retry (integrity.py).
            requests: list[tuple[SupervisionRequest, Sequence]] = [
                self._shard_request(input_ids, attention_mask, loss_mask, lo, hi, wire_kind, offers, auto)
                for lo, hi in bounds]
            self._demand.requested(sum(header.tokens or 0 for header, _ in requests))
            expects = [self._expected(wire_kind, auto, info, hi - lo, input_ids.shape[1], loss_mask.dtype)
                       for lo, hi in bounds]
            shards = [self._submit(header, payload, expect) for (header, payload), expect in zip(requests, expects)]
        except BaseException:
            self._credits.release()
            raise
        expand = self._expansion() if auto or wire_kind is Kind.EAGLE3_COMPACT and kind is Kind.EAGLE3 else None
        restore = Restoration(model_dtype(info), self.device, self._expander) if self._fp8 else None
        result = assemble(shards, [hi - lo for lo, hi in bounds], self.device, self._io.recv_alloc,
                          self._digest_check(requests, expects), wire_kind.value, expand, self._staging, restore)
        result.add_done_callback(lambda _: self._credits.release())
        # The time a caller blocks in its result() is its step's wait.
        return metered(result, self._demand) if caller else result

    def _expected(self, wire_kind: Kind, auto: bool, info: TargetInfo, rows: int, seq: int,
                  loss_dtype: torch.dtype) -> Expected:
        """What a shard's reply may hold: ``wire_kind``'s tensors or, when the worker picks (auto), compact ones."""
        specs = reply_specs(wire_kind, info, rows, seq, loss_dtype, self._draft_vocab)
        return Expected(specs, reply_specs(Kind.EAGLE3_COMPACT, info, rows, seq, loss_dtype, None) if auto else None,
                        fp8_block=info.hidden_size if self._fp8 else None)

    @property
    def _fp8(self) -> bool:
        return self.wire_dtype == WireDtype.FP8.value

    def _expansion(self) -> Expansion:
        """How this batch's compact shards become EAGLE-3 tensors: the current mapping's slice and mask."""
        mapping, draft_vocab, mask = self._vocab_digest, self._draft_vocab, self._selected_mask
        if mapping is None or draft_vocab is None or mask is None:
            raise RuntimeError(_NEEDS_MAPPING)
        return Expansion(functools.partial(self._slices.get, mapping, draft_vocab), mask, self.device,
                         self._expander)

    def _shard_request(self, input_ids, attention_mask, loss_mask, lo: int, hi: int, wire_kind: Kind,
                       offers: Offers, auto: bool) -> tuple[SupervisionRequest, list]:
        """The prepared header and payload of the request for rows ``lo:hi`` of a batch."""
        # Copies, not views: the frames are sent later by the I/O thread, and again on a retry or
        # after a broker restart, while the caller may already refill its input tensors.
        payload = wire.encode({
            "input_ids": input_ids[lo:hi].to("cpu", copy=True),
            "attention_mask": attention_mask[lo:hi].to("cpu", copy=True),
            "loss_mask": loss_mask[lo:hi].to("cpu", copy=True),
        })
        self._check_request_size(payload, f"request for rows {lo}:{hi}")
        # ``offers``: what the first path that offers needs (and the worker it pins the request to).
        return self._request(Op.GENERATE, offers, kind=wire_kind.value,
                             format=ReplyFormat.AUTO.value if auto else None,
                             wire_dtype=self.wire_dtype if self._fp8 else None,
                             tokens=int(attention_mask[lo:hi].sum())), payload

    def lm_head_slice(self) -> torch.Tensor:
        """The draft-vocab rows ``[Vd, H]`` of the target's lm_head for the current mapping, on ``device``:
        fetched from a worker once per mapping digest, then cached (compact.py)."""
        mapping = self._vocab_digest
        if mapping is None:
            raise RuntimeError("call set_vocab_mapping first")
        assert self._draft_vocab is not None  # set with the mapping (set_vocab_mapping)
        return self._slices.get(mapping, self._draft_vocab)

    def _fetch_lm_head_slice(self, mapping: str, draft_vocab: int) -> torch.Tensor:
        reply = self._fetch(Op.LM_HEAD_SLICE, Expected(weight_specs(self.target_info(), draft_vocab)), vocab=mapping)
        return reply["weight"]

    def _count_slice(self, weight: torch.Tensor) -> None:
        nbytes = weight.numel() * weight.element_size()
        self.stats.lm_head_slices += 1
        self.stats.lm_head_slice_bytes += nbytes
        CLIENT_LM_HEAD_SLICES.labels(service=self.service).inc()
        CLIENT_LM_HEAD_SLICE_BYTES.labels(service=self.service).inc(nbytes)

    def _fetch(self, op: Op, expect: Expected, **fields: Any) -> dict[str, torch.Tensor]:
        """A request without payload (embeddings, lm_head slice): its tensors on ``device``, checked like a batch."""
        self.target_info()  # pins the target every reply must come from
        # With a worker of our own it answers these too, as frames: the pool may have none left.
        request = self._request(op, self._paths.offer(op.value), **fields)
        requests: list[tuple[SupervisionRequest, Sequence]] = [(request, [])]
        return assemble([self._submit(*requests[0], expect)], [0], self.device, None,
                        self._digest_check(requests, [expect]), staging=self._staging).result()

    def _check_request_size(self, payload: Sequence, what: str) -> None:
        """Refuse a payload over what the broker or this service's workers accept, before sending it
        (ZeroMQ would drop the connection on it, and nothing would answer)."""
        self.target_info()  # learns the limit
        size = sum(len(memoryview(f)) for f in payload)
        if self._max_request_bytes is not None and size > self._max_request_bytes:
            raise ValueError(f"{what} is {size} bytes, over the largest request of {self._max_request_bytes} "
                             f"bytes that service {self.service!r} takes (the broker's --max-request-tokens at 24 "
                             f"bytes a token, or --max-message-bytes, or its workers'): send fewer rows per request "
                             f"(num_shards) or raise the limit")

    def _request(self, op: Op, offers: Offers, *, vocab: str | None = None, timeout: float | None = None,
                 **fields: Any) -> SupervisionRequest:
        """A request of ``op`` with what every request carries: what its reply paths offer (and the worker
        they pin it to), where to reply, the vocab mapping, the target we set up with (``fingerprint``, once
        ``target_info`` ran), whether to digest the reply (``verify``), and the largest reply we take
        (``max_reply_bytes``: the worker refuses a bigger one instead of sending it, and computing it again
        on every retry)."""
        security = self._io.security
        if security is not None and security.worker_keys_dir is None:
            raise ValueError("with CURVE this client's data socket admits only workers' keys: give "
                             "Security(worker_keys_dir=...), the directory the broker admits workers from")
        return SupervisionRequest(
            op=op.value, timeout=self.timeout if timeout is None else timeout, pin=offers.pin, near=offers.near,
            offers=offers.offers,
            reply_to=self._io.data_endpoint, max_reply_bytes=self._io.max_message_bytes,
            fingerprint=self._fingerprint, vocab=vocab if vocab is not None else self._vocab_digest,
            data_key=self._io.data_key or None, verify=self._sampler.wants(), **fields)

    def _submit(self, request: SupervisionRequest, payload: Sequence,
                expect: Expected | None = None) -> concurrent.futures.Future:
        """Send a request; ``expect``: the tensors its reply must hold (``contract.reply_specs``)."""
        return self._io.submit(ClientCommand.REQUEST, self.service, request, payload, self.timeout, expect=expect)

    def _digest_check(self, requests: list[tuple[SupervisionRequest, Sequence]],
                      expects: list[Expected]) -> DigestCheck:
        """The check of one batch's landed shards against their workers' digests (integrity.py)."""
        return DigestCheck(requests, expects, self._submit, self._io.stats, self.service, self._paths)

    def set_vocab_mapping(self, selected_token_ids: torch.Tensor, selected_token_mask: torch.Tensor) -> None:
        """Register the draft vocab; every later EAGLE-3 request is served with exactly it."""
        ids = selected_token_ids.to("cpu", torch.int64).contiguous()
        mask = selected_token_mask.to("cpu", torch.bool).contiguous()
        validate_vocab_mapping(ids, mask, self.target_info().vocab_size)
        payload = [bytes(memoryview(f)) for f in wire.encode({"selected_token_ids": ids, "selected_token_mask": mask})]
        self._check_request_size(payload, "the vocab mapping")
        digest = self._io.register_vocab(self.service, payload, SetVocab(fingerprint=self._fingerprint),
                                         self.timeout).result()
        self._vocab_digest = digest
        self._draft_vocab = ids.numel()
        self._selected_mask = mask.to(self.device)
        if self.compact is True:  # every EAGLE-3 reply will need it; "auto" before its first compact one
            self.lm_head_slice()

    # ----------------------------------------------------------- target info

    def status(self, service: str | None = None) -> dict[str, Any]:
        """The broker's view: services, workers, queues (of one ``service``, or all). The broker answers in
        pages of bounded size; this gathers them all."""
        query = StatusQuery(service=service)
        pages = 0
        while True:
            page = self._io.submit(ClientCommand.STATUS, self.service, query, (), self.timeout).result().header
            if not isinstance(page, StatusPage):
                raise RemoteError(f"broker answered STATUS with {type(page).__name__}")
            if pages == 0:
                status = dict(page.to_json(), services={}, workers=[])
            status["services"].update(page.services)
            status["workers"].extend(page.workers)
            pages += 1
            cursor = page.next
            if cursor is None:
                status.pop("next", None)
                return status
            if cursor == query.after or pages > MAX_STATUS_PAGES:
                raise RemoteError(f"broker STATUS pages do not end (page {pages}, cursor {cursor!r})")
            query = StatusQuery(service=service, after=cursor)

    def _worker_infos(self, wait: bool = True) -> dict[str, dict]:
        """Target info of this service's workers, waiting for one to register: up to ``timeout`` for a
        service that has had workers (they may be restarting), up to the broker's unknown-service grace
        (SPEC_SERVE_UNKNOWN_SERVICE_GRACE) for one that never had any (a ValueError listing those that do)."""
        started = time.monotonic()
        while True:
            status = self.status(self.service)
            workers = [w for w in status["workers"] if w["service"] == self.service]
            advertised = [status.get("max_message_bytes")] + [w.get("max_message_bytes") for w in workers]
            limits = [n for n in advertised if isinstance(n, int) and n > 0]
            self._max_request_bytes = min(limits) if limits else None
            infos = {w["id"]: w["target_info"] for w in workers}
            if infos or not wait:
                return infos
            waited = time.monotonic() - started
            never_served = not (status["services"].get(self.service) or {}).get("ever_had_workers")
            grace = status.get("unknown_service_grace_s")
            if never_served and grace is not None and waited > grace:
                served = sorted(name for name, s in self.status()["services"].items() if s["workers"])
                raise ValueError(f"unknown service {self.service!r}: no worker has registered for it within "
                                 f"{grace:g}s (SPEC_SERVE_UNKNOWN_SERVICE_GRACE on the broker); services with "
                                 f"workers: {served}")
            if waited > self.timeout:
                raise TimeoutError(f"no worker registered for service {self.service!r} within {self.timeout:g}s")
            time.sleep(0.2)

    def target_info(self) -> TargetInfo:
        """What this service's workers serve (they must agree; engines may differ)."""
        if self._info is None:
            infos = self._worker_infos()
            first_id, first = next(iter(infos.items()))
            reference = TargetInfo.from_dict(first)
            for worker, info in infos.items():
                diff = reference.mismatches(info, ignore=("engine",))
                if diff:
                    raise ValueError(_mismatch_message(f"workers {first_id} and {worker} of service "
                                                       f"{self.service!r} disagree", diff, "first", "other"))
            if self._fingerprint not in (None, reference.fingerprint):
                raise TargetChangedError(f"service {self.service!r} now serves target fingerprint "
                                         f"{reference.fingerprint} (worker {first_id}), but this client set up with "
                                         f"{self._fingerprint}: start a new client to use the new target")
            self._fingerprint = reference.fingerprint
            self._info = reference
        return self._info

    def check_target_info(self, expected: TargetInfo | Mapping[str, Any]) -> None:
        """Raise ``ValueError`` naming the worker and fields that differ from ``expected``."""
        self._info = None
        self.target_info()  # workers agree with each other
        for worker, info in self._worker_infos().items():
            diff = TargetInfo.from_dict(info).mismatches(expected)
            if diff:
                raise ValueError(_mismatch_message(f"worker {worker} of service {self.service!r} serves a "
                                                   f"different target", diff, "worker", "expected"))

    def get_input_embeddings(self) -> types.SimpleNamespace:
        """The target's input embedding as ``.weight`` ``[V, H]`` on ``device``."""
        return self._embeddings("input")

    def get_output_embeddings(self) -> types.SimpleNamespace:
        """The target's lm_head as ``.weight`` ``[V, H]`` (tied models: the embedding)."""
        return self._embeddings("output")

    def _embeddings(self, which: str) -> types.SimpleNamespace:
        info = self.target_info()
        reply = self._fetch(Op.EMBEDDINGS, Expected(weight_specs(info, info.vocab_size)), which=which)
        return types.SimpleNamespace(weight=reply["weight"])

    # ------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Leave the broker; workers and other clients carry on."""
        if not self._closed:
            self._closed = True
            if self.cache is not None:
                self.cache.close()  # its batches under way finish and its rows are published first
            self._paths.close()  # what peers hold for us goes back (a binding's RELEASE) before the DISCONNECT
            self._io.close()
            self._expander.shutdown(wait=False)
            if self._staging is not None:
                self._staging.close()  # after the I/O thread stopped: a landing still running finishes first

    def __enter__(self) -> RemoteTargetModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _mismatch_message(title: str, diff: dict, ours: str, theirs: str) -> str:
    fields = "; ".join(f"{k}: {ours}={a!r} {theirs}={b!r}" for k, (a, b) in diff.items())
    return f"{title}: {fields}"
