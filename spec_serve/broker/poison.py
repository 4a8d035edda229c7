"""Poison requests: a request whose input crashes every worker it reaches.

The policy (``--max-request-deaths``, default 2). The broker cannot tell which request on a dead worker
killed it, so every request that was on it goes to another worker as a *suspect*, alone (dispatch.py), and
a suspect on ``max_request_deaths`` workers as they died fails with ``killed_workers``, never retried.
- 1: a poison request costs one worker, but any death (an OOM caused by another process, a lost host, a
  kill) fails every request that happened to be on that worker, at once.
- 2 (the default): a poison request costs two workers (at 8B, two reloads of minutes each), but a death
  with another cause costs the requests on it one extra forward; the second death, alone on its worker, is
  the suspect's own (unless a second unrelated death hits that worker while it runs).
- more: each further death costs another worker, for a request that already ran alone and killed one.
The error names the request's id, its op and kind, each input tensor's name, shape and dtype, its tokens,
and the workers lost (with host and pid), so the user can find the input.
"""

from __future__ import annotations

import collections
import json
import logging
import struct

from spec_serve.broker.context import BrokerContext
from spec_serve.broker.state import Request, WorkerState
from spec_serve.telemetry.logs import event

log = logging.getLogger("spec_serve.broker")

# Ids of requests failed for killing workers, refused if they come back (a retry that crossed the error).
MAX_KILLER_IDS = 1024
# A request's tensor header is read for its description only up to this size (real ones: a few hundred bytes).
MAX_DESCRIBED_HEADER = 16 << 10
# Tensors named in the description; a request carries three.
MAX_DESCRIBED_TENSORS = 8


class PoisonPolicy:
    """Counts worker deaths against requests and remembers the requests it failed."""

    def __init__(self, ctx: BrokerContext, max_request_deaths: int):
        if max_request_deaths < 1:
            raise ValueError("max_request_deaths must be >= 1")
        self.ctx = ctx
        self.max_request_deaths = max_request_deaths
        self.killers: collections.OrderedDict[bytes, str] = collections.OrderedDict()  # request id -> error

    def refusal(self, request_id: bytes) -> str | None:
        """The error a request failed with for killing workers, if it did (its retries get it again)."""
        return self.killers.get(request_id)

    def died_on(self, request: Request, worker: WorkerState) -> str | None:
        """Count ``worker``'s death against ``request``: None while it may go to another worker (a suspect
        from now on), else the error that fails it for good."""
        request.killed.append(worker.where)
        if len(request.killed) < self.max_request_deaths:
            return None
        error = (f"request {request.request_id.hex()} ({describe(request)}) was on {len(request.killed)} workers of "
                 f"{request.service!r} as they died ({'; '.join(request.killed)}); it is not sent to another, as its "
                 f"input may crash every worker it reaches (broker --max-request-deaths {self.max_request_deaths})")
        self.killers[request.request_id] = error
        while len(self.killers) > MAX_KILLER_IDS:
            self.killers.popitem(last=False)
        self.ctx.metrics.killer_requests.inc()
        event(log, logging.ERROR, "broker.request_killed_workers", request=request.request_id.hex(),
              service=request.service, input=describe(request), workers="; ".join(request.killed))
        return error


def describe(request: Request) -> str:
    """What ``request`` asked for, for a person looking for its input: op, kind, tokens, and each tensor's
    name, shape and dtype as its payload's header says (read without building a tensor)."""
    header = request.header
    what = [header.op or "generate"]
    if header.kind:
        what.append(header.kind)
    if header.which:
        what.append(header.which)
    if header.tokens is not None:
        what.append(f"{header.tokens} tokens")
    return ", ".join([" ".join(what), *_tensors(request.payload)])


def _tensors(payload: list) -> list[str]:
    """``name [shape] DTYPE`` for each tensor the payload's safetensors header lists; a note if unreadable."""
    if not payload:
        return ["no tensors"]
    try:
        view = memoryview(payload[0]).cast("B")
        (length,) = struct.unpack("<Q", view[:8])
        if length > MAX_DESCRIBED_HEADER:
            return [f"a tensor header of {length} bytes"]
        entries = json.loads(bytes(view[8:8 + length]))
        named = [(name, entry) for name, entry in entries.items() if name != "__metadata__"]
        return [f"{name[:64]} {list(entry['shape'])} {str(entry['dtype'])[:8]}"
                for name, entry in named[:MAX_DESCRIBED_TENSORS]]
    except (IndexError, TypeError, ValueError, KeyError, AttributeError, RecursionError, struct.error):
        return ["tensors unreadable"]
