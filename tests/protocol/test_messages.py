"""Typed message headers (spec_serve/protocol/messages.py): each round-trips to the exact header the
code sends (same JSON bytes), a bad header fails naming the message and the key, and docs/protocol.md
lists exactly the dataclasses' fields."""

from __future__ import annotations

import dataclasses
import pathlib
import re
from typing import Any

import pytest

from spec_serve.paths.nccl.messages import NcclDescriptor, NcclOffer
from spec_serve.protocol import messages as m
from spec_serve.protocol.commands import CLIENT_TAG, ClientCommand, ProtocolError, control, encode_header

# The reply paths' own typed fields (offers[name], path[name]), documented in the same table format.
PATH_FIELDS: tuple[type[m.WireMessage], ...] = (NcclOffer, NcclDescriptor)
DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
PLANE_OFFER = {"host": "k", "pid": 12, "start": 34, "gpus": ["GPU-1"]}
PLANE_SLOT = {"kind": "shm", "ctl": "spsv-1-2.ctl", "slot": 0, "gen": 3, "nbytes": 64, "segment": "spsv-1-2-0"}
SUMMARY = {"broker": "b" * 32, "uptime_s": 1.5, "unknown_service_grace_s": 10.0, "clients": 1, "inflight": 0,
           "queued": 0, "service_count": 1, "worker_count": 1, "max_message_bytes": 1 << 30}

# Headers as each sender builds them today (same keys, values and order).
SENT: list[tuple[type[m.WireMessage], dict[str, Any]]] = [
    (m.SupervisionRequest, {"op": "generate", "kind": "eagle3", "timeout": 120.0, "tokens": 12,
                            "reply_to": "tcp://10.0.0.1:4000", "max_reply_bytes": 1 << 30, "fingerprint": "f" * 16,
                            "vocab": "ab" * 16, "data_key": "k" * 40, "verify": True}),
    (m.SupervisionRequest, {"op": "generate", "kind": "dspark", "timeout": 30, "tokens": 0,
                            "offers": {"plane": PLANE_OFFER}, "reply_to": "ipc:///tmp/x", "max_reply_bytes": 10}),
    (m.SupervisionRequest, {"op": "generate", "kind": "eagle3_compact", "timeout": 5, "tokens": 3, "pin": "w1",
                            "offers": {"nccl": {"host": "boot-1:net-2"}}, "reply_to": "tcp://h:1", "max_reply_bytes": 1,
                            "vocab": "v", "client": "c0ffee"}),
    (m.SupervisionRequest, {"op": "embeddings", "which": "input", "timeout": 5, "reply_to": "tcp://h:1",
                            "max_reply_bytes": 1, "fingerprint": "f", "avoid": "w2"}),
    (m.BrokerHeartbeat, {"broker": "b" * 32}),
    (m.BrokerHeartbeat, {"broker": "b" * 32, "stopping": True}),
    (m.ClientHeartbeat, {"steps": 12, "wait_s": 3.25, "compute_s": 9}),
    (m.ClientHeartbeat, {}),  # an older client's, and one that has not asked yet
    (m.SetVocab, {"fingerprint": "f", "release": ["d1", "d2"]}),
    (m.SetVocab, {}),
    (m.VocabOk, {"digest": "ab" * 16}),
    (m.BrokerError, {"code": "bad_request", "error": "no", "unknown_vocab": True}),
    (m.BrokerError, {"code": "unavailable", "error": "gone", "unpinned": True}),
    (m.StatusQuery, {}),
    (m.StatusQuery, {"service": "s", "after": [1, "s", "00ff"]}),
    (m.StatusPage, dict(SUMMARY, services={"s": {"workers": 1}}, workers=[{"id": "w"}], next=[0, "s"])),
    (m.StatusPage, dict(SUMMARY, services={}, workers=[], next=None)),
    (m.BindRequest, {"reply_to": "tcp://h:1", "timeout": 30.0, "device_type": "cuda", "data_key": "k"}),
    (m.Bound, {"ok": False, "code": "unavailable", "error": "all bound"}),
    (m.Bound, {"ok": False, "lost": "w1", "prefix": "p", "error": "bound worker w1 lost: gone"}),
    (m.Release, {"prefix": "p"}),
    (m.Release, {"prefix": None}),
    (m.Ready, {"target_info": {"model_name": "t"}, "capacity": 2, "pid": 7, "host": "h", "max_message_bytes": 9}),
    (m.Refused, {"code": "wrong_port", "error": "this is the client port"}),
    (m.WorkerSetVocab, {"digest": "d", "evict": ["a"]}),
    (m.WorkerBind, {"client": "c0", "reply_to": "tcp://h:1", "prefix": "p", "timeout": 30.0, "device_type": None}),
    (m.WorkerBind, {"client": "c0", "reply_to": "tcp://h:1", "prefix": "p", "timeout": 3, "device_type": "cpu",
                    "data_key": "k"}),
    (m.Done, {"status": "ok", "tokens": 4, "bytes": 100, "via": "frames"}),
    (m.Done, {"status": "undeliverable", "tokens": 0, "bytes": 0, "via": "shm", "error": "takes nothing"}),
    (m.Done, {"status": "undeliverable", "error": "bad endpoint: x"}),
    (m.Leave, {"reason": "CUDA error"}),
    (m.Leave, {"reason": "SIGTERM", "drain": True}),
    (m.Done, {"status": "returned"}),
    (m.Disconnect, {}),
    (m.Disconnect, {"stopping": True}),
    (m.Reply, {"worker": "w", "compute_s": 0.25, "fingerprint": "f", "digests": {"hidden": 3}}),
    (m.Reply, {"worker": "fake", "fingerprint": "f"}),  # what the tests' fake workers send
    (m.Reply, {"worker": "w", "compute_s": 0.25, "batched": 3, "path": {"plane": PLANE_SLOT},
               "fingerprint": "f"}),
    (m.Reply, {"worker": "w", "compute_s": 0.1,
               "path": {"nccl": {"pair": "p", "specs": [["x", [1, 2], "float32"]]}}, "fingerprint": "f"}),
    (m.BindGrant, {"worker": "w", "bind": {"store_host": "10.0.0.2", "store_port": 29500, "prefix": "p",
                                           "worker": "w", "timeout": 30.0}}),
    (m.ErrorReply, {"worker": "w", "code": "internal", "error": "RuntimeError: boom"}),
]


@pytest.mark.parametrize("cls,header", SENT, ids=[f"{c.__name__}-{i}" for i, (c, _) in enumerate(SENT)])
def test_round_trip_gives_the_same_header_bytes(cls: type[m.WireMessage], header: dict[str, Any]) -> None:
    message = cls.from_json(header)
    assert message.to_json() == header
    assert encode_header(message) == encode_header(header)  # key order too: the wire bytes are unchanged


def test_every_message_has_a_round_trip_case() -> None:
    assert {cls for cls, _ in SENT} | {m.Rendezvous} == set(m.MESSAGES)


def test_framing_takes_a_typed_header() -> None:
    typed = control(CLIENT_TAG, ClientCommand.RELEASE.value, "s", b"", m.Release("p"))
    assert typed == control(CLIENT_TAG, ClientCommand.RELEASE.value, "s", b"", {"prefix": "p"})


def test_absent_keys_read_as_their_defaults() -> None:
    request = m.SupervisionRequest.from_json({"reply_to": "tcp://h:1"})
    assert (request.timeout, request.op, request.pin, request.offers, request.vocab) == (120, None, None, None, None)
    assert m.Done.from_json({}).status == "ok" and m.Ready.from_json({"target_info": {}}).capacity == 1
    assert m.Ready.from_json({"target_info": {}, "max_message_bytes": -5}).max_message_bytes is None


def test_without_offer_drops_that_offer_and_the_pin_only() -> None:
    request = m.SupervisionRequest.from_json(SENT[2][1])
    assert request.offer("nccl") == {"host": "boot-1:net-2"} and request.offer("plane") is None
    assert request.without_offer("nccl", unpin=True).to_json() == {
        k: v for k, v in SENT[2][1].items() if k not in ("pin", "offers")}
    assert request.without_offer("plane").to_json() == SENT[2][1]


def test_a_reply_names_one_path() -> None:
    reply = m.Reply.from_json(SENT[-4][1])
    assert reply.descriptor("plane") == PLANE_SLOT and reply.descriptor("nccl") is None
    with pytest.raises(ProtocolError, match="'path'"):
        m.Reply.from_json({"worker": "w", "path": {"plane": {}, "nccl": {}}})


BAD: list[tuple[type[m.WireMessage], dict[str, Any], str]] = [
    (m.SupervisionRequest, {"timeout": 5}, "reply_to"),
    (m.SupervisionRequest, {"reply_to": "garbage"}, "reply_to"),
    (m.SupervisionRequest, {"reply_to": "tcp://*:5"}, "reply_to"),
    (m.SupervisionRequest, {"reply_to": "tcp://h:1", "timeout": "soon"}, "'timeout'"),
    (m.SupervisionRequest, {"reply_to": "tcp://h:1", "timeout": True}, "'timeout'"),
    (m.SupervisionRequest, {"reply_to": "tcp://h:1", "timeout": 1e9}, "'timeout'"),
    (m.SupervisionRequest, {"reply_to": "tcp://h:1", "vocab": [1]}, "'vocab'"),
    (m.SupervisionRequest, {"reply_to": "tcp://h:1", "vocab": None}, "'vocab'"),
    (m.SupervisionRequest, {"reply_to": "tcp://h:1", "avoid": 3}, "'avoid'"),
    (m.SupervisionRequest, {"reply_to": "tcp://h:1", "fingerprint": "f" * 129}, "'fingerprint'"),
    (m.SupervisionRequest, {"reply_to": "tcp://h:1", "pin": 3}, "'pin'"),
    (m.SupervisionRequest, {"reply_to": "tcp://h:1", "offers": [1]}, "'offers'"),
    (m.ClientHeartbeat, {"wait_s": -1.0}, "'wait_s'"),
    (m.ClientHeartbeat, {"compute_s": float("nan")}, "'compute_s'"),
    (m.ClientHeartbeat, {"wait_s": float("inf")}, "'wait_s'"),
    (m.ClientHeartbeat, {"steps": -3}, "'steps'"),
    (m.ClientHeartbeat, {"wait_s": "long"}, "'wait_s'"),
    (m.SetVocab, {"release": "d1"}, "'release'"),
    (m.SetVocab, {"release": ["d"] * 300}, "'release'"),
    (m.StatusQuery, {"service": 5}, "'service'"),
    (m.StatusQuery, {"after": [2, "x"]}, "'after'"),
    (m.StatusPage, dict(SUMMARY, services={"s": 1}, workers=[], next=None), "'services'"),
    (m.StatusPage, dict(SUMMARY, clients=-1, services={}, workers=[], next=None), "'clients'"),
    (m.BindRequest, {"reply_to": "tcp://h:1", "device_type": 3}, "device_type"),
    (m.BindRequest, {}, "reply_to"),
    (m.Ready, {"target_info": {}, "capacity": 0}, "capacity"),
    (m.Ready, {"capacity": 1}, "target_info"),
    (m.VocabOk, {}, "'digest'"),
    (m.WorkerBind, {"client": "c", "reply_to": "tcp://h:1"}, "prefix"),
    (m.Done, {"tokens": "many"}, "'tokens'"),
    (m.Done, {"status": "finished"}, "'status'"),
    (m.Reply, {"worker": "w", "compute_s": "fast"}, "'compute_s'"),
    (m.Reply, {"worker": "w", "compute_s": 1, "digests": {"x": "y"}}, "'digests'"),
    (m.BindGrant, {"worker": "w", "bind": {"store_host": "h", "store_port": "1", "prefix": "p", "worker": "w",
                                           "timeout": 1}}, "'store_port'"),
    (m.ErrorReply, {"worker": "w", "error": "x"}, "'code'"),
]


@pytest.mark.parametrize("cls,header,key", BAD, ids=[f"{c.__name__}-{k}-{i}" for i, (c, _, k) in enumerate(BAD)])
def test_bad_header_is_refused_naming_message_and_key(cls: type[m.WireMessage], header: dict[str, Any],
                                                      key: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        cls.from_json(header)
    assert isinstance(caught.value, ValueError)
    assert key in str(caught.value) and cls.COMMAND.split()[0] in str(caught.value)


def _documented() -> dict[str, list[tuple[str, str, str]]]:
    """``{message: [(key, type, sent), ...]}`` from the table of docs/protocol.md."""
    rows: dict[str, list[tuple[str, str, str]]] = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and re.fullmatch(r"`\w+`", cells[0]):
            rows.setdefault(cells[0].strip("`"), []).append((cells[3].strip("`"), cells[4], cells[5]))
    return rows


def _declared(cls: type[m.WireMessage]) -> list[tuple[str, str, str]]:
    out = []
    for field in dataclasses.fields(cls):
        kind = str(field.type).replace("Json", "object").replace(" | None", "?")
        optional = field.default is None or field.default is False
        sent = "always" if field.metadata.get("always") or not optional else "when set"
        out.append((m.json_key(field), kind, sent))
    return out


def test_docs_list_every_message_and_field() -> None:
    documented = _documented()
    typed = (*m.MESSAGES, *PATH_FIELDS)
    assert list(documented) == [cls.__name__ for cls in typed]
    for cls in typed:
        assert documented[cls.__name__] == _declared(cls), cls.__name__


def test_no_shared_message_names_a_path() -> None:
    """The paths' fields travel under ``offers``/``path``: no key of a shared message names a path."""
    keys = {m.json_key(f) for cls in m.MESSAGES for f in dataclasses.fields(cls)}
    assert not keys & {"nccl", "plane", "bound", "pair", "specs", "spool"}
