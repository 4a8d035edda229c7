"""``ClientStats``: what a client counts, read by a run through ``RemoteTargetModel.stats``."""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass
class ClientStats:
    """Counts a run can report: what was sent, retried, dropped as duplicate; replies and fallbacks by path."""

    sent: int = 0
    completed: int = 0
    retried: int = 0
    duplicates: int = 0  # a second reply to a request already answered
    unknown: int = 0  # replies to request ids this client never sent (or answered too long ago to remember)
    contract_violations: int = 0  # replies whose tensors broke the contract (retried)
    broker_reconnects: int = 0
    link_resends: int = 0  # times the broker connection ended and every pending request went again (uncounted)
    batched: int = 0  # replies computed in a forward shared with other requests (worker batching)
    digest_checks: int = 0  # replies whose landed bytes were checked against the worker's digests (verify=)
    digest_mismatches: int = 0  # of those, replies that differed: never returned, retried once on another worker
    target_mismatches: int = 0  # replies (or broker refusals) from another target than we set up with: failed
    refused_messages: int = 0  # messages with more frames than their kind has: refused unread, their sender cut off
    compact_replies: int = 0  # EAGLE-3 replies that came compact (expanded here: compact=True, or "auto")
    lm_head_slices: int = 0  # draft-vocab lm_head slices fetched for that (once per vocab mapping)
    lm_head_slice_bytes: int = 0
    fp8_replies: int = 0  # replies whose hidden states came as FP8 (wire_dtype="fp8"), restored here
    fp8_declined: int = 0  # replies to wire_dtype="fp8" requests that came in the model dtype (a worker or path
    # that cannot send FP8: the NCCL pair group, an older worker, a hidden state holding NaN or infinity)
    # The rank's demand (demand.py): batches asked for (generate_batch calls), their real tokens, seconds the
    # caller was blocked waiting for supervision, and seconds between its requests otherwise (its own compute).
    steps: int = 0
    requested_tokens: int = 0
    wait_s: float = 0.0
    compute_s: float = 0.0
    # Replies delivered, by the path that carried them (paths/registry.py: frames, plane, nccl, ...).
    replies: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    # Requests asked for again without a path that could not deliver them, by that path.
    fallbacks: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)

    @property
    def wait_fraction(self) -> float | None:
        """Share of the step time spent waiting for supervision (None before a full step)."""
        step = self.wait_s + self.compute_s
        return self.wait_s / step if step > 0 else None

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens asked for per second of step time (waiting and computing)."""
        step = self.wait_s + self.compute_s
        return self.requested_tokens / step if step > 0 else None

    @property
    def nccl_batches(self) -> int:
        """Replies whose tensors came over the bound worker's pair group (no payload frames)."""
        return self.replies["nccl"]

    @property
    def nccl_fallbacks(self) -> int:
        """Bound requests re-sent as frames through the shared pool after a failure."""
        return self.fallbacks["nccl"]

    @property
    def plane_replies(self) -> int:
        """Replies whose bytes a same-host worker lent through the plane (paths/plane)."""
        return self.replies["plane"]

    @property
    def plane_fallbacks(self) -> int:
        """Replies that could not be read through the plane and were asked for again as frames."""
        return self.fallbacks["plane"]
