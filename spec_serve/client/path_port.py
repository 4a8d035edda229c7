"""``PathPort``: what the reply paths' client sides (spec_serve/paths) use of the client's I/O thread."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any

import torch

from spec_serve.client.io_thread import ClientIO
from spec_serve.protocol.commands import ClientCommand
from spec_serve.protocol.messages import Reply, WireMessage


class PathPort:
    """``ClientIO`` as the paths call it (``paths.base.ClientPort``)."""

    def __init__(self, io: ClientIO):
        self._io = io
        self.data_endpoint: str = io.data_endpoint
        self.data_key: str | None = io.data_key
        self.local_host: str = io.local_host

    def call(self, fn: Callable[[], None]) -> None:
        self._io.call(fn)

    def send_control(self, frames: list[Any]) -> None:
        self._io.send_control(frames)

    def submit(self, command: ClientCommand, service: str, header: WireMessage, payload: Sequence[Any],
               timeout: float, max_retries: int | None = None) -> concurrent.futures.Future[Any]:
        return self._io.submit(command, service, header, payload, timeout, max_retries=max_retries)

    def resolve(self, request_id: bytes, reply: Reply, tensors: dict[str, torch.Tensor], path: str) -> None:
        self._io.replies.resolve_followed(request_id, reply, tensors, path)

    def fallback(self, request_id: bytes, path: str, reason: str) -> None:
        self._io.replies.fallback(request_id, path, reason)
