"""CUDA IPC for the same-host plane: a worker's device buffer, opened by a client process of the same host.

The worker shares a buffer's storage once, with torch's CUDA IPC handles (``_share_cuda_``, what
``torch.multiprocessing`` pickles), and sends the handle as plain JSON fields; the client opens it
with ``_new_shared_cuda``, as ``rebuild_cuda_tensor`` does, and keeps it open for later replies in
the same buffer. Nothing is pickled.

Lifetimes are the plane's, not torch's: torch counts one consumer per share and keeps a freed
buffer alive ("limbo") until that consumer's count is returned, which a killed client never does.
So the worker returns its count at once (``_release_ipc_counter_cuda``), and the plane's leases and
generation words decide when the buffer may be written again.

Sharing leaves two files in /dev/shm (torch 2.11 on CUDA): torch's ref counters
(``torch_<pid>_<n>_<n>``, unlinked by torch at a normal exit) and the CUDA driver's file for the
share's interprocess event (``cuda.shm.<dev>.<pid in hex>.<n>``, left behind even at a normal exit).
``share`` names both as *companions*: the worker records them in its control block, unlinks the
driver's at stop, and a reaper removes both if the worker was killed (shm.reap).

Devices are named by UUID: a worker's ``cuda:0`` need not be the client's ``cuda:0``.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
from typing import Any

import torch

_HANDLE_KEYS = {"gpu": str, "handle": str, "size": int, "offset": int, "ref": str, "ref_offset": int,
                "event": str, "event_sync": bool}


class CudaIpcError(RuntimeError):
    """A CUDA IPC handle that cannot be opened here."""


def gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def visible_gpus() -> dict[str, int]:
    """UUID -> local device index of every GPU this process sees."""
    if not torch.cuda.is_available():
        return {}
    return {gpu_uuid(torch.device("cuda", i)): i for i in range(torch.cuda.device_count())}


def share(buffer: torch.Tensor) -> tuple[dict[str, Any], list[str]]:
    """JSON fields naming ``buffer``'s storage for another process, and the companion files the share
    made in /dev/shm (paths like "/torch_1_2_0", module doc)."""
    storage = buffer.untyped_storage()
    _, handle, size, offset, ref, ref_offset, event, event_sync = storage._share_cuda_()
    torch.UntypedStorage._release_ipc_counter_cuda(ref, ref_offset)  # lifetimes are the plane's (module doc)
    fields = {"gpu": gpu_uuid(buffer.device), "handle": _b64(handle), "size": int(size), "offset": int(offset),
              "ref": _b64(ref), "ref_offset": int(ref_offset), "event": _b64(event), "event_sync": bool(event_sync)}
    return fields, [ref.decode(), *driver_files(os.getpid())]


def driver_files(pid: int) -> list[str]:
    """The CUDA driver's interprocess-event files of process ``pid`` in /dev/shm."""
    pattern = re.compile(rf"cuda\.shm\.\d{{1,4}}\.{pid:x}\.\d{{1,9}}")
    try:
        return [f"/{n}" for n in sorted(os.listdir("/dev/shm")) if pattern.fullmatch(n)]
    except OSError:
        return []


def open_shared(fields: Any, gpus: dict[str, int]) -> torch.Tensor:
    """The shared buffer as a uint8 tensor on the local index of its GPU; ``CudaIpcError`` if not possible."""
    if not isinstance(fields, dict) or fields.keys() != _HANDLE_KEYS.keys() or \
            not all(type(fields[k]) is t for k, t in _HANDLE_KEYS.items()):
        raise CudaIpcError(f"CUDA IPC handle must hold exactly {sorted(_HANDLE_KEYS)} with the right types")
    index = gpus.get(fields["gpu"])
    if index is None:
        raise CudaIpcError(f"GPU {fields['gpu'][:40]} is not visible to this process")
    if fields["size"] <= 0 or fields["offset"] < 0 or fields["ref_offset"] < 0:
        raise CudaIpcError("CUDA IPC handle with a negative offset or empty storage")
    torch.cuda.init()  # opening a handle in a process without a CUDA context crashes it
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            index, _unb64(fields["handle"]), fields["size"], fields["offset"], _unb64(fields["ref"]),
            fields["ref_offset"], _unb64(fields["event"]), fields["event_sync"])
    except (RuntimeError, ValueError) as e:
        raise CudaIpcError(f"cannot open the CUDA IPC handle on cuda:{index}: {e}") from None
    return torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index)).set_(storage)


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _unb64(text: str) -> bytes:
    try:
        return base64.b64decode(text.encode(), validate=True)
    except (binascii.Error, ValueError):
        raise CudaIpcError("CUDA IPC handle field is not base64") from None
