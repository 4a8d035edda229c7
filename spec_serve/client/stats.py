"""``ClientStats``: what a client counts, read by a run through ``RemoteTargetModel.stats``."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class ClientStats:
    """Counts a run can report: what was sent, retried, dropped as duplicate."""

    sent: int = 0
    completed: int = 0
    retried: int = 0
    duplicates: int = 0  # a second reply to a request already answered
    unknown: int = 0  # replies to request ids this client never sent (or answered too long ago to remember)
    contract_violations: int = 0  # replies whose tensors broke the contract (retried)
    broker_reconnects: int = 0
    batched: int = 0  # replies computed in a forward shared with other requests (worker batching)
    nccl_batches: int = 0  # replies whose tensors came over the bound worker's pair group (no payload frames)
    nccl_fallbacks: int = 0  # bound requests re-sent as frames through the shared pool after a failure
    plane_replies: int = 0  # replies whose bytes a same-host worker lent through the plane (samehost.py)
    plane_fallbacks: int = 0  # of those, replies that could not be read there and were asked for again as frames
    digest_checks: int = 0  # replies whose landed bytes were checked against the worker's digests (verify=)
    digest_mismatches: int = 0  # of those, replies that differed: never returned, retried once on another worker
    target_mismatches: int = 0  # replies (or broker refusals) from another target than we set up with: failed
    refused_messages: int = 0  # messages with more frames than their kind has: refused unread, their sender cut off
