"""What the NCCL binding (paths/nccl/binding.py) uses of the client's I/O thread: the answer to its
BIND is a ``Received`` whose typed header is the broker's refusal (``Bound``) or the worker's grant
(``BindGrant``)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any

from spec_serve.client.io_thread import ClientIO
from spec_serve.protocol.commands import ClientCommand
from spec_serve.protocol.messages import BindRequest, Reply


class BindingPort:
    """``ClientIO`` as ``ClientBinding`` calls it (its ``io``)."""

    def __init__(self, io: ClientIO):
        self._io = io
        self.data_endpoint = io.data_endpoint
        self.data_key = io.data_key
        self.local_host = io.local_host

    def call(self, fn: Callable[[], None]) -> None:
        self._io.call(fn)

    def send_control(self, frames: list[Any]) -> None:
        self._io.send_control(frames)

    def nccl_resolve(self, request_id: bytes, tensors: dict[str, Any], reply: Reply) -> None:
        self._io.replies.nccl_resolve(request_id, tensors, reply)

    def nccl_fallback(self, request_id: bytes, reason: str) -> None:
        self._io.replies.nccl_fallback(request_id, reason)

    def submit(self, command: ClientCommand, service: str, header: BindRequest, payload: Sequence[Any], timeout: float,
               max_retries: int | None = None) -> concurrent.futures.Future[Any]:
        """A future of the ``Received`` answer."""
        return self._io.submit(command, service, header, payload, timeout, max_retries=max_retries)
