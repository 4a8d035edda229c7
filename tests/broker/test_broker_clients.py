"""``ClientTable`` (broker/clients.py) without sockets: what a client may make the broker hold (requests,
bytes, draft-vocab mappings) and the target it pins."""

from __future__ import annotations

import time

import torch

from broker_util import SERVICE, TARGET_INFO, handle, make_router, message, ready, typed
from spec_serve.broker.clients import MAX_REQUESTS_PER_CLIENT
from spec_serve.broker.parts import Parts
from spec_serve.broker.state import Request
from spec_serve.protocol import wire
from spec_serve.protocol.commands import (
    CLIENT_TAG,
    ClientCommand,
    ErrorCode,
    control,
    in_parts,
    new_request_id,
    parse_control,
)
from spec_serve.protocol.messages import SupervisionRequest


def request(payload: list | None = None, **header):
    header = {"reply_to": "tcp://127.0.0.1:9", "timeout": 30, **header}
    msg = message(CLIENT_TAG, ClientCommand.REQUEST, new_request_id(), header, payload=payload)
    return msg, SupervisionRequest.from_json(msg.header)


def mapping_payload(vocab_size: int = TARGET_INFO["vocab_size"]) -> list:
    ids = torch.arange(0, vocab_size, 2, dtype=torch.int64)
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[ids] = True
    return wire.encode({"selected_token_ids": ids, "selected_token_mask": mask})


def error_codes(router, client: bytes) -> list[str]:
    return [m.header["code"] for m in router.recorder.to_client(client)]


def test_a_client_may_hold_only_so_many_requests():
    router = make_router()
    now = time.monotonic()
    client = router.client_table.seen(b"client", now)
    client.requests.update(new_request_id() for _ in range(MAX_REQUESTS_PER_CLIENT))
    msg, header = request()
    assert router.client_table.admit(client, msg, header, now) is None
    assert error_codes(router, b"client") == [ErrorCode.UNAVAILABLE.value]


def test_bytes_over_the_message_limit_or_the_held_limit_are_refused():
    router = make_router(max_message_bytes=1000, max_held_bytes=1500)
    now = time.monotonic()
    client = router.client_table.seen(b"client", now)
    assert router.client_table.admit(client, *request([b"x" * 1001]), now) is None
    msg, header = request([b"x" * 900])
    assert router.client_table.admit(client, msg, header, now) == 900
    router.requests[msg.request_id] = Request(msg.request_id, b"client", SERVICE, header, msg.payload, now + 30, now,
                                              size=900)  # held by the broker now
    assert router.client_table.admit(client, *request([b"x" * 900]), now) is None
    assert error_codes(router, b"client") == [ErrorCode.BAD_REQUEST.value, ErrorCode.UNAVAILABLE.value]
    assert "--max-held-bytes" in router.recorder.to_client(b"client")[-1].header["error"]


def test_one_client_holds_at_most_its_share_and_bytes_arriving_in_parts_count():
    router = make_router(max_message_bytes=1000, max_held_bytes=10_000, client_held_share=0.25)
    table = router.client_table
    assert table.max_client_bytes == 2500
    now = time.monotonic()
    greedy = table.seen(b"greedy", now)
    for _ in range(2):
        msg, header = request([b"x" * 900])
        assert table.admit(greedy, msg, header, now) == 900
        router.requests[msg.request_id] = Request(msg.request_id, b"greedy", SERVICE, header, msg.payload, now + 30,
                                                  now, size=900)
        greedy.requests.add(msg.request_id)
    assert table.admit(greedy, *request([b"x" * 900]), now) is None  # 2700 > its share of 2500
    assert "--client-held-share" in router.recorder.to_client(b"greedy")[-1].header["error"]
    other = table.seen(b"other", now)
    assert table.admit(other, *request([b"x" * 900]), now) == 900  # the broker still has room for others
    # Bytes promised to a message still arriving in parts (broker/parts.py) count as held by their client.
    table.reserved = lambda identity: 1700 if identity in (b"other", None) else 0
    assert table.room(b"other", 900) is not None and table.room(b"other", 800) is None


def test_a_client_pinned_to_another_target_is_told_it_changed():
    router = make_router()
    now = time.monotonic()
    ready(router, b"worker-a", now)
    client = router.client_table.seen(b"client", now)
    assert router.client_table.admit(client, *request(fingerprint="f" * 32), now) == 0
    assert client.fingerprints == {SERVICE: "f" * 32} and router.client_table.pinned(SERVICE) == ["f" * 32]
    assert router.client_table.admit(client, *request(fingerprint="e" * 32), now) is None
    assert error_codes(router, b"client") == [ErrorCode.TARGET_CHANGED.value]


def test_a_mapping_is_stored_once_and_dropped_with_its_last_client():
    router = make_router()
    now = time.monotonic()
    ready(router, b"worker-a", now)
    digests = []
    for identity in (b"client-a", b"client-b"):
        client = router.client_table.seen(identity, now)
        handle(router.client_table.register_mapping, client, now, CLIENT_TAG, ClientCommand.SET_VOCAB,
               new_request_id(), {}, payload=mapping_payload())
        [ok] = router.recorder.to_client(identity, ClientCommand.VOCAB_OK)
        digests.append(ok.header["digest"])
    assert digests[0] == digests[1] and list(router.services[SERVICE].mappings) == digests[:1]
    router.delete_client(b"client-a")
    router.client_table.trim_mappings()
    assert list(router.services[SERVICE].mappings) == digests[:1]  # client-b still holds it
    router.delete_client(b"client-b")
    router.client_table.trim_mappings()
    assert not router.services[SERVICE].mappings and router.vocab.held_bytes == 0


def test_a_bad_mapping_is_refused():
    router = make_router()
    now = time.monotonic()
    ready(router, b"worker-a", now)
    client = router.client_table.seen(b"client", now)
    handle(router.client_table.register_mapping, client, now, CLIENT_TAG, ClientCommand.SET_VOCAB, new_request_id(),
           {}, payload=mapping_payload(vocab_size=64))
    assert error_codes(router, b"client") == [ErrorCode.BAD_REQUEST.value]
    assert not router.services[SERVICE].mappings


def test_a_client_forgotten_for_silence_is_told_and_one_that_said_goodbye_is_not():
    """Past its liveness window a client is forgotten (its mappings with it) and told so: DISCONNECT, so a
    client that was only late registers its mappings again before its next request. A client that sent
    DISCONNECT itself hears nothing back."""
    router = make_router()
    now = time.monotonic()
    ready(router, b"worker", now)
    for client in (b"late-client", b"leaving-client"):
        router.client_seen(client, now)
    handle(router.disconnect, router.client_seen(b"leaving-client", now), now, CLIENT_TAG, ClientCommand.DISCONNECT)
    router.recorder.take()
    later = now + router.expiry_window + 0.1
    router.worker_seen(b"worker", later)
    router.purge(later)
    assert b"late-client" not in router.clients
    assert [m.header for m in router.recorder.to_client(b"late-client", ClientCommand.DISCONNECT)] == [{}]
    assert router.recorder.to_client(b"leaving-client", ClientCommand.DISCONNECT) == []


def test_a_request_sent_again_after_its_link_dropped_is_held_once_and_whole():
    """A client whose connection ended mid-request sends every pending request again with the same id. The
    broker sees what of the old attempt still came (its first two parts, its last, never the third, lost
    with the connection), then the new attempt: the new first part replaces the unfinished old one, so the
    request is joined from the new parts only, whole, and held once; sent yet again (another drop), it is
    still held once and its worker does not get it a second time."""
    router = make_router(max_message_bytes=8 << 20)
    parts = Parts(router.max_message_bytes, router.client_table.room, router.ctx.send_error)
    now = time.monotonic()
    ready(router, b"worker", now)
    request_id = new_request_id()
    header = {"reply_to": "tcp://127.0.0.1:9", "timeout": 30}
    payload = [bytes(range(256)) * 4096]  # 1 MiB in four parts, each part's bytes different from the others'
    sent = [parse_control(frames, CLIENT_TAG, ClientCommand)
            for frames in in_parts(control(CLIENT_TAG, ClientCommand.REQUEST.value, SERVICE, request_id, header,
                                           payload))]
    assert len(sent) == 4

    def deliver(messages):
        client = router.client_seen(b"client", now)
        for msg in messages:
            whole = parts.take(b"client", msg, now)
            if whole is not None:
                router.enqueue(client, whole, typed(CLIENT_TAG, whole), now)

    deliver([sent[0], sent[1], sent[3]])  # the old attempt: the third part was lost with the connection
    assert request_id not in router.requests
    deliver(sent)  # the new attempt
    held = router.requests[request_id]
    assert held.size == 1 << 20 and b"".join(bytes(f) for f in held.payload) == payload[0]
    assert router.recorder.requests_to(b"worker") == [request_id]
    router.recorder.take()
    deliver(sent)  # sent again once more: a duplicate of a request the broker holds
    assert list(router.requests) == [request_id] and router.recorder.requests_to(b"worker") == []
    assert router.metrics.duplicate_requests._value.get() == 1
    assert parts.reserved == 0  # nothing of the old attempt is still reserved
