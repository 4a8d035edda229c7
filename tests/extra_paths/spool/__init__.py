"""Spool, a reply path for tests only: a same-host reply written as one safetensors file into a directory
the client names in its offer; the client reads it and deletes it. It shows what adding a path takes:
this folder (both halves), one line in the registry's order (tests put it first by monkeypatching
``paths.registry.PATHS``), and tests (tests/paths/test_paths.py)."""

from __future__ import annotations

from typing import ClassVar

from extra_paths.spool.client import SpoolClient
from extra_paths.spool.worker import SpoolWorker
from spec_serve.paths.base import ClientSetup, ReplyPath, WorkerSetup


class SpoolPath(ReplyPath):
    name: ClassVar[str] = "spool"

    @classmethod
    def worker(cls, setup: WorkerSetup) -> SpoolWorker:
        return SpoolWorker()

    @classmethod
    def client(cls, setup: ClientSetup) -> SpoolClient:
        return SpoolClient()
