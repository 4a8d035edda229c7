"""The client's side of spool: a private directory offered with GENERATE requests, a reply's file read and
checked (wire.parse), and deleted once the reply was copied out or is not used."""

from __future__ import annotations

import concurrent.futures
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from spec_serve.paths.base import Arrival, ClientSide, LentReply, Offer
from spec_serve.protocol import wire
from spec_serve.protocol.commands import Op
from spec_serve.protocol.messages import Reply
from spec_serve.transport.sockets import local_host_key


class SpoolReply(dict[str, Any], LentReply):
    """A reply's spans over its file's bytes (read into memory); the file goes once settled or released."""

    def __init__(self, spans: Mapping[str, Any], path: Path):
        super().__init__(spans)
        self.path = path

    def settle(self) -> concurrent.futures.Future[Any] | None:
        self.release()
        return None

    def release(self) -> None:
        self.path.unlink(missing_ok=True)


class SpoolClient(ClientSide):
    name: ClassVar[str] = "spool"

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="spec-serve-spool-"))

    def offer(self, op: str) -> Offer | None:
        if op != Op.GENERATE.value:
            return None
        host = local_host_key()
        return Offer({"host": host, "dir": str(self.dir)}, near=host)

    def _file(self, reply: Reply) -> Path:
        name = str(reply.descriptor(self.name)["file"])
        if "/" in name or not name.endswith(".safetensors"):
            raise ValueError(f"spool reply names {name!r}, not a file of its directory")
        return self.dir / name

    def accept(self, arrival: Arrival) -> Mapping[str, Any]:
        path = self._file(arrival.reply)
        spans, _ = wire.parse([path.read_bytes()], max_bytes=arrival.max_bytes)
        return SpoolReply(spans, path)

    def discard(self, reply: Reply) -> None:
        self._file(reply).unlink(missing_ok=True)

    def lent_bytes(self, reply: Reply) -> int:
        nbytes = (reply.descriptor(self.name) or {}).get("nbytes")
        return nbytes if type(nbytes) is int and nbytes > 0 else 0

    def stop(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
