"""Frames: a reply's bytes as safetensors frames over the worker's ZeroMQ data socket. Every reply can
take this path, so it comes last in the order (``paths/registry.py``)."""

from __future__ import annotations

from typing import ClassVar

from spec_serve.paths.base import ClientSetup, ReplyPath, WorkerSetup
from spec_serve.paths.frames.client import FramesClient
from spec_serve.paths.frames.worker import FramesWorker


class FramesPath(ReplyPath):
    name: ClassVar[str] = "frames"

    @classmethod
    def worker(cls, setup: WorkerSetup) -> FramesWorker:
        return FramesWorker(setup.host_pool, setup.copy_stream, setup.faults)

    @classmethod
    def client(cls, setup: ClientSetup) -> FramesClient:
        return FramesClient()
