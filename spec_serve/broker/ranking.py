"""Routing as a ranking: which free worker takes a queued request, decided by ordered rules (as Ray Serve's
request router ranks candidate replicas), each a small function here and none knowing a reply path:

1. isolation: a *suspect* (it was on a worker as that died) goes only to an idle worker, and a worker that
   holds one takes nothing else: if that worker dies too, the death is the suspect's alone;
2. anti-affinity: never a worker that held the request past its deadline (``missed``); not the worker a
   retried request ``avoid``s (it produced a reply whose digest did not match) while another unbound worker
   of the service exists;
3. affinity: a request ``pin``ned to a worker goes to that worker alone (the router sends such a request
   straight there, never to the queue, so the queue holds none);
4. locality: a request ``near`` a host (its reply path pays only there) prefers a free
   worker of that host (the ``host_key`` its READY said); a worker of another host takes it only when none
   of its own is free, that is when waiting for one would queue it;
5. load: the least-loaded (in-flight over capacity), ties to the longest idle.

Rules 1-3 decide who may take the request (``eligible``), 4-5 the order among those (``best``). Only free
workers are candidates (``free``): a free slot, no binding, no suspect held.
"""

from __future__ import annotations

from spec_serve.broker.state import Request, RequestTable, WorkerState


def free(workers: list[WorkerState], requests: RequestTable) -> list[WorkerState]:
    """The workers that may take a queued request now: a free slot, unbound, no suspect held (rule 1)."""
    return [w for w in workers if w.free > 0 and w.bound_to is None and not holds_suspect(w, requests)]


def holds_suspect(worker: WorkerState, requests: RequestTable) -> bool:
    return any(requests[r].killed for r in worker.inflight if r in requests)


def isolated(request: Request, candidates: list[WorkerState]) -> list[WorkerState]:
    """Rule 1: a suspect only to an idle worker."""
    return [w for w in candidates if not w.inflight] if request.killed else candidates


def anti_affine(request: Request, candidates: list[WorkerState], pool: list[WorkerState]) -> list[WorkerState]:
    """Rule 2: never a worker that missed its deadline; the ``avoid``ed one only when ``pool`` (every worker of
    the service) has no other unbound worker."""
    candidates = [w for w in candidates if w.identity not in request.missed]
    avoid = request.header.avoid
    if avoid is None or not any(w.name != avoid and w.bound_to is None for w in pool):
        return candidates
    return [w for w in candidates if w.name != avoid]


def affine(request: Request, candidates: list[WorkerState]) -> list[WorkerState]:
    """Rule 3: a pinned request to its worker alone."""
    pin = request.header.pin
    return candidates if pin is None else [w for w in candidates if w.name == pin]


def eligible(request: Request, candidates: list[WorkerState], pool: list[WorkerState]) -> list[WorkerState]:
    """The candidates that may take ``request`` (rules 1-3); ``pool``: every worker of its service."""
    return affine(request, anti_affine(request, isolated(request, candidates), pool))


def rank_key(request: Request, worker: WorkerState) -> tuple[bool, float, float]:
    """Rules 4-5 as one sort key, lowest first: off the request's host, load, then how recently idle."""
    near = request.header.near
    elsewhere = near is not None and worker.host_key != near
    return elsewhere, len(worker.inflight) / worker.capacity, worker.idle_since


def best(request: Request, eligible_workers: list[WorkerState]) -> WorkerState:
    """The worker that takes ``request``: the first of the ranking (rules 4-5)."""
    return min(eligible_workers, key=lambda w: rank_key(request, w))
