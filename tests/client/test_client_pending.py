"""``Requests`` (client/pending.py) without sockets: what is sent again, and what it costs a request's retries."""

from __future__ import annotations

import concurrent.futures

from spec_serve.client.errors import RemoteError
from spec_serve.client.pending import MAX_REREGISTRATIONS, Pending, Requests
from spec_serve.client.stats import ClientStats
from spec_serve.protocol.commands import ClientCommand, new_request_id
from spec_serve.protocol.messages import SupervisionRequest


def test_a_request_sent_behind_its_mappings_registration_costs_no_retry_even_with_retries_off():
    """The broker lacked the mapping a request names (it restarted, or forgot the client): the request goes again
    behind the registration without using a retry, MAX_REREGISTRATIONS times; after that (the registration
    itself keeps failing) it is an ordinary retry, and with retries off it fails."""
    sent: list[list] = []
    requests = Requests(sent.append, ClientStats(), max_retries=0, leave_binding=lambda *_: None)
    pending = Pending(new_request_id(), ClientCommand.REQUEST.value, "svc", SupervisionRequest(vocab="v"), [],
                      concurrent.futures.Future(), timeout=30.0)
    requests.add(pending, now=0.0)
    for n in range(MAX_REREGISTRATIONS):
        requests.behind_registration(pending, now=1.0 + n, reason="unknown vocab mapping")
        assert not pending.future.done() and pending.attempts == 1 and pending.sent_at == 0.0
    assert len(sent) == 1 + MAX_REREGISTRATIONS
    requests.behind_registration(pending, now=9.0, reason="unknown vocab mapping")
    assert isinstance(pending.future.exception(), RemoteError)
