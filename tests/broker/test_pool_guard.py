"""What a peer's word cannot keep at the broker (issue 24, items 3 and 4), with real processes.

A broker and one real hf worker. Peers that misbehave are real clients that send BIND by hand (as a
hostile client would: they never form the pair group) and raw ZeroMQ peers speaking the protocol frame by
frame. Checked: a binding nobody uses ends after SPEC_SERVE_BIND_IDLE; a client cannot bind the last
unbound worker while another client uses the pool; a stray READY under a junk service name neither makes
the broker unready nor lingers once its peer is gone; a service a client named goes with the client.
"""

from __future__ import annotations

import time
import uuid

import pytest
import zmq

from cluster_util import CLIENT_KW, FAST_ENV, Reference, assert_equal_batches, wait_until, workers
from spec_serve.client.api import RemoteTargetModel
from spec_serve.protocol.commands import CLIENT_TAG, WORKER_TAG, ClientCommand, WorkerCommand, control, new_request_id
from spec_serve.protocol.messages import BindRequest
from spec_serve.tools.launch import local_cluster

BIND_IDLE_S = 3
ENV = {**FAST_ENV, "SPEC_SERVE_BIND_IDLE": str(BIND_IDLE_S)}
# The pair-group timeout the hand-made BINDs ask: the worker waits this long for a client that never joins.
PAIR_TIMEOUT_S = 2


@pytest.fixture(scope="module")
def cluster(tiny_target_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("pool-guard-logs")
    with local_cluster(tiny_target_dir, workers=1, env=ENV, log_dir=log_dir) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_target_dir, tiny_vocab_mapping):
    return Reference(tiny_target_dir, tiny_vocab_mapping)


def bound(cluster) -> list[str]:
    return [w["id"] for w in workers(cluster) if w["state"] == "bound"]


def broker_log(cluster) -> str:
    return (cluster.log_dir / "broker.log").read_text(errors="replace")


def served(client: RemoteTargetModel, reference: Reference, seed: int) -> None:
    """A DSpark batch through the pool, bit-equal to the colocated forward."""
    assert_equal_batches(client.generate_batch(*reference.batch(seed), kind="dspark"),
                         reference.expected(seed, kind="dspark"))


def hand_made_bind(client: RemoteTargetModel) -> object:
    """BIND as a hostile client sends it: granted or refused, it never forms the pair group."""
    header = BindRequest(reply_to=client._io.data_endpoint, timeout=PAIR_TIMEOUT_S, device_type="cpu")
    return client._io.submit(ClientCommand.BIND, "default", header, (), 30, max_retries=0).result(30).header


def test_a_binding_nobody_uses_ends_after_bind_idle(cluster, reference):
    """A client binds the only worker and never uses it: the broker gives the worker back after
    SPEC_SERVE_BIND_IDLE (the old broker kept it bound while the client lived), and pool requests are served."""
    wait_until(lambda: not bound(cluster), 30, what="no bound worker")
    with RemoteTargetModel(cluster.frontend, timeout=30, **CLIENT_KW) as hostile:
        grant = hand_made_bind(hostile)
        assert type(grant).__name__ == "BindGrant", grant  # the worker granted it
        start = time.monotonic()
        assert bound(cluster)
        wait_until(lambda: not bound(cluster), 30, what="the idle binding ended")
        ended_after = time.monotonic() - start
        assert f"reason='idle for {BIND_IDLE_S}s'" in broker_log(cluster)
        with RemoteTargetModel(cluster.frontend, timeout=30, **CLIENT_KW) as user:
            served(user, reference, 1)
    print(f"\nan unused binding ended after {ended_after:.1f}s (SPEC_SERVE_BIND_IDLE={BIND_IDLE_S})")


def test_a_client_cannot_bind_the_last_worker_another_client_uses(cluster, reference):
    """A client of the service without a binding keeps the pool: another client's BIND of the last unbound
    worker is refused at once, and the first client's requests are served (the old broker bound it, and they
    timed out)."""
    wait_until(lambda: not bound(cluster), 30, what="no bound worker")
    with RemoteTargetModel(cluster.frontend, timeout=20, max_retries=0, **CLIENT_KW) as user, \
            RemoteTargetModel(cluster.frontend, timeout=30, **CLIENT_KW) as hostile:
        served(user, reference, 2)
        refusal = hand_made_bind(hostile)
        assert type(refusal).__name__ == "Bound" and refusal.ok is False, refusal
        assert "stays in the pool: 1 other client(s) without a binding use it" in refusal.error
        assert not bound(cluster)
        served(user, reference, 3)
    print(f"\nrefused: {refusal.error}")


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
