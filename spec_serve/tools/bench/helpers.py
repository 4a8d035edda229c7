"""Helper processes a run starts (``python -m spec_serve.tools.bench _null_worker ...``): a null worker, a plain
ROUTER and a PUSH sender."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch


def _null_worker(args: list[str]) -> None:
    from spec_serve.tools.null_engine import run_worker

    run_worker(args[0], args[1], capacity=int(args[2]) if len(args) > 2 else 2)  # [broker, service, capacity]


def _direct_server(args: list[str]) -> None:
    """A ROUTER that answers each [reqid, ...] with data-message frames of the null tensors."""
    import zmq

    from spec_serve.protocol import wire
    from spec_serve.protocol.commands import Status, data_message
    from spec_serve.tools.null_engine import null_tensors
    from spec_serve.transport.sockets import make_socket

    endpoint_file, batch, seq = args[0], int(args[1]), int(args[2])
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.ROUTER, bind="tcp://127.0.0.1:*")
    Path(endpoint_file).write_text(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    tensors = null_tensors(batch, seq)
    while True:
        frames = sock.recv_multipart(copy=False)
        if len(frames) == 2 and frames[1].bytes == b"stop":
            return
        # Encoded per reply, as the worker does (zero-copy views, a small header).
        sock.send_multipart([frames[0], *data_message(Status.OK, frames[1].bytes, {}, wire.encode(tensors))],
                            copy=False)


def _push_sender(args: list[str]) -> None:
    """PUSH ``count`` messages of the null tensors' bytes: raw frames of wire.MAX_FRAME_BYTES, or wire.encode frames."""
    import zmq

    from spec_serve.protocol import wire
    from spec_serve.tools.null_engine import null_tensors
    from spec_serve.transport.sockets import make_socket

    endpoint, mode, count, batch, seq = args[0], args[1], *map(int, args[2:5])
    tensors = null_tensors(batch, seq)
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.PUSH, connect=endpoint, hwm=4)
    if mode == "raw":
        blob = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors.values()])
        view = blob.numpy().data
        raw = [view[i : i + wire.MAX_FRAME_BYTES] for i in range(0, len(view), wire.MAX_FRAME_BYTES)]
    for _ in range(count):
        frames = raw if mode == "raw" else wire.encode(tensors)
        sock.send_multipart(frames, copy=False)
    sock.send(b"")  # end marker
    time.sleep(0.5)
    sock.close(linger=2000)


def _spawn_helper(kind: str, *args: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "spec_serve.tools.bench", kind, *map(str, args)],
                            env=os.environ.copy(), start_new_session=True)
