"""The end-to-end check of reply bytes: each shard as landed on the client's device against the
digests its worker computed (spec_serve/protocol/digest.py), with one retry on another worker."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence

import torch

from spec_serve.client.errors import IntegrityError
from spec_serve.client.received import Received
from spec_serve.client.stats import ClientStats
from spec_serve.paths.registry import ClientPaths
from spec_serve.protocol import digest
from spec_serve.protocol.messages import Reply, SupervisionRequest
from spec_serve.supervision.contract import Expected
from spec_serve.telemetry.logs import event
from spec_serve.telemetry.metrics import CLIENT_INTEGRITY_FAILURES

log = logging.getLogger("spec_serve.client")

# Sends a prepared request again: (header, payload, what its reply must hold) -> its future.
Resubmit = Callable[[SupervisionRequest, Sequence, Expected], concurrent.futures.Future]


class DigestCheck:
    """``check(k, reply, landed)`` for ``assembly.assemble`` over the shards ``requests`` of one batch.

    None accepts request ``k``'s landed tensors; a mismatch with the worker's digests returns the
    future of one retry on another worker (the worker is named in ``avoid``; a request bound to our own
    worker goes back to the pool), and a second mismatch raises ``IntegrityError``. Runs on the I/O thread.
    """

    def __init__(self, requests: list[tuple[SupervisionRequest, Sequence]], expects: list[Expected],
                 resubmit: Resubmit,
                 stats: ClientStats, service: str, paths: ClientPaths):
        self.requests = requests
        self.expects = expects
        self.resubmit = resubmit
        self.stats = stats
        self.service = service
        self.paths = paths
        self.retried: dict[int, str] = {}  # request index -> the worker whose reply mismatched first

    def __call__(self, k: int, reply: Received, landed: Mapping[str, torch.Tensor]) -> concurrent.futures.Future | None:
        header, _ = self.requests[k]
        if not header.verify:
            return None
        answer = reply.header
        assert isinstance(answer, Reply), type(answer)  # a worker's reply resolves a supervision request
        self.stats.digest_checks += 1
        bad = digest.mismatches(answer.digests, landed)
        if not bad:
            return None
        worker = answer.worker
        self._count_mismatch(k, reply, worker, bad)
        if k in self.retried:
            raise IntegrityError(f"reply to request {reply.request_id.hex()[:12]} differs from its worker's "
                                 f"digest in {', '.join(bad)} on the retry too (first from worker {self.retried[k]}, "
                                 f"then from worker {worker}): the bytes change between the worker's device "
                                 f"and ours; see the ERROR lines client.digest_mismatch")
        self.retried[k] = worker
        return self._retry_elsewhere(k, worker)

    def _count_mismatch(self, k: int, reply: Received, worker: str, bad: list[str]) -> None:
        self.stats.digest_mismatches += 1
        CLIENT_INTEGRITY_FAILURES.labels(service=self.service, check="digest").inc()
        event(log, logging.ERROR, "client.digest_mismatch", request=reply.request_id.hex()[:12], worker=worker,
              tensors=",".join(bad), retry=k not in self.retried)

    def _retry_elsewhere(self, k: int, worker: str) -> concurrent.futures.Future:
        header, payload = self.requests[k]
        # A path that pins the request to this worker (one we hold) lets go of it: the pool serves it.
        retry = dataclasses.replace(self.paths.elsewhere(header, f"digest mismatch in a reply from worker {worker}"),
                                    avoid=worker)
        self.requests[k] = (retry, payload)
        return self.resubmit(retry, payload, self.expects[k])
