"""What a peer's word cannot keep at the broker (issue 24, item 3), with real processes.

A broker and one real hf worker. Peers that misbehave are raw ZeroMQ peers speaking the protocol frame by
frame. Checked: a stray READY under a junk service name neither makes the broker unready nor lingers once
its peer is gone; a service a client named goes with the client.
"""

from __future__ import annotations

import time
import uuid

import pytest
import zmq

from cluster_util import FAST_ENV, wait_until, workers
from spec_serve.protocol.commands import CLIENT_TAG, WORKER_TAG, ClientCommand, WorkerCommand, control, new_request_id
from spec_serve.tools.launch import local_cluster

ENV = dict(FAST_ENV)


@pytest.fixture(scope="module")
def cluster(tiny_target_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("pool-guard-logs")
    with local_cluster(tiny_target_dir, workers=1, env=ENV, log_dir=log_dir) as c:
        yield c


def _status_code(cluster, path: str) -> int:
    return cluster.get(path)[0]


def test_a_stray_ready_neither_unreadies_the_broker_nor_lingers(cluster):
    """A raw peer registers under a junk service name and goes silent. Nobody uses that service: /ready and
    /health stay 200 throughout, and the service is gone with its worker (the old broker answered /health 503
    for the idle grace, about 60 s)."""
    wait_until(lambda: _status_code(cluster, "/ready") == 200, 30, what="ready")
    junk = f"junk-{uuid.uuid4().hex[:8]}"
    _, info = cluster.get("/model_info?service=default")
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(cluster.backend)
    peer.send_multipart(control(WORKER_TAG, WorkerCommand.READY.value, junk, header={"target_info": info,
                                                                                   "capacity": 1}))
    wait_until(lambda: workers(cluster, junk), 30, what="the stray worker registered")
    assert _status_code(cluster, f"/ready?service={junk}") == 200
    peer.close()  # silent from now on: the broker expires it after its liveness window
    codes, deadline = [], time.monotonic() + 30
    while workers(cluster, junk):
        assert time.monotonic() < deadline, "the silent stray worker was never expired"
        codes.append((_status_code(cluster, "/ready"), _status_code(cluster, "/health")))
        time.sleep(0.05)
    services = cluster.get("/workers")[1]["services"]
    codes.append((_status_code(cluster, "/ready"), _status_code(cluster, "/health")))
    print(f"\nstray READY under {junk!r}: {len(codes)} probes while it expired, all {set(codes)}; "
          f"services after: {sorted(services)}")
    assert junk not in services
    assert set(codes) == {(200, 200)}
    assert _status_code(cluster, f"/ready?service={junk}") == 503


def test_a_service_a_client_named_goes_with_the_client(cluster):
    """A raw client queues requests for a name no worker serves, then goes silent: once the broker forgets the
    client, its requests and the service go at once (the old broker kept the name for its idle grace)."""
    junk = f"typo-{uuid.uuid4().hex[:8]}"
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(cluster.frontend)
    for _ in range(3):
        peer.send_multipart(control(CLIENT_TAG, ClientCommand.REQUEST.value, junk, new_request_id(),
                                    {"reply_to": "tcp://127.0.0.1:9", "timeout": 600}))

    def queued() -> bool:
        peer.send_multipart(control(CLIENT_TAG, ClientCommand.HEARTBEAT.value))  # alive until we close it
        return cluster.get("/workers")[1]["services"].get(junk, {}).get("queue_depth") == 3

    wait_until(queued, 30, what="three requests queued")
    peer.close()
    start = time.monotonic()
    wait_until(lambda: junk not in cluster.get("/workers")[1]["services"], 20, what="the service forgotten")
    print(f"\nservice {junk!r} forgotten {time.monotonic() - start:.1f}s after its only client went silent")
