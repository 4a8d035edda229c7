"""What the NCCL binding (transport/binding.py) uses of the client's I/O thread.

binding.py reads the answer to its BIND in the shapes it had before pending requests resolved to
one ``Received``: the broker's refusal as a ``Message``, a worker's acceptance as its header dict.
This port gives it those until it reads ``Received`` itself.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence

from spec_serve.client.io_thread import ClientIO
from spec_serve.client.received import Received
from spec_serve.protocol.commands import ClientCommand, Message


class BindingPort:
    """``ClientIO`` as ``ClientBinding`` calls it (its ``io``)."""

    def __init__(self, io: ClientIO):
        self._io = io
        self.data_endpoint = io.data_endpoint
        self.data_key = io.data_key
        self.local_host = io.local_host

    def call(self, fn: Callable[[], None]) -> None:
        self._io.call(fn)

    def send_control(self, frames: list) -> None:
        self._io.send_control(frames)

    def nccl_resolve(self, request_id: bytes, tensors: dict, header: dict) -> None:
        self._io.replies.nccl_resolve(request_id, tensors, header)

    def nccl_fallback(self, request_id: bytes, reason: str) -> None:
        self._io.replies.nccl_fallback(request_id, reason)

    def submit(self, command: ClientCommand, service: str, header: dict, payload: Sequence, timeout: float,
               max_retries: int | None = None) -> concurrent.futures.Future:
        """A future of a ``Message`` (the broker answered) or of the worker's header dict."""
        answer: concurrent.futures.Future = concurrent.futures.Future()

        def convert(reply: concurrent.futures.Future) -> None:
            if reply.exception() is not None:
                answer.set_exception(reply.exception())
            else:
                answer.set_result(_legacy(reply.result(), service))

        self._io.submit(command, service, header, payload, timeout, max_retries=max_retries).add_done_callback(convert)
        return answer


def _legacy(reply: Received, service: str) -> Message | dict:
    if reply.broker_command is None:
        return reply.header
    return Message(reply.broker_command.value, service, reply.request_id, reply.header, [])
