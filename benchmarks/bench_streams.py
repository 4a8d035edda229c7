"""How many bytes a second ZeroMQ carries between two processes of one host, by streams and transport.

One reply stream (one connection, one libzmq I/O thread a side) is what a worker->client reply uses
today. This measures K parallel connections (each context with K I/O threads) over tcp loopback and
ipc, with the receiver either dropping each message (raw) or copying it into a reused buffer as a
decoder would (copy), to tell what splitting a reply over several streams could gain.

    python benchmarks/bench_streams.py --json streams.json            # K in 1,2,4; tcp and ipc
    python benchmarks/bench_streams.py --streams 1,2 --mib 256 --transports ipc
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import zmq

FRAME = 16 << 20  # the codec's frame size (spec_serve.protocol.wire.MAX_FRAME_BYTES)


def _send(endpoint: str, streams: int, messages: int, mib: int) -> None:
    ctx = zmq.Context(io_threads=streams)
    socks = []
    for _ in range(streams):
        s = ctx.socket(zmq.PUSH)
        s.sndhwm, s.linger = 2, 5000
        s.connect(endpoint)
        socks.append(s)
    blob = np.ones(mib << 20, dtype=np.uint8)
    frames = [memoryview(blob)[i : i + FRAME] for i in range(0, blob.nbytes, FRAME)]
    part = len(frames) // streams or 1
    time.sleep(0.5)  # let every connection come up
    for _ in range(messages):
        # One message split over the streams, as a reply split into K parts would be.
        for k, s in enumerate(socks):
            chunk = frames[k * part : (k + 1) * part if k < streams - 1 else None]
            if chunk:
                s.send_multipart(chunk, copy=False)
    for s in socks:
        s.send(b"")
    time.sleep(1)
    ctx.destroy(linger=5000)


def measure(transport: str, streams: int, copy: bool, messages: int, mib: int, tmp: str) -> float:
    """GB/s of message data received, after one warm-up message."""
    ctx = zmq.Context(io_threads=streams)
    pull = ctx.socket(zmq.PULL)
    pull.rcvhwm = 4
    if transport == "tcp":
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        endpoint = f"tcp://127.0.0.1:{port}"
    else:
        endpoint = f"ipc://{tmp}/streams-{streams}-{int(copy)}.sock"
        pull.bind(endpoint)
    proc = subprocess.Popen([sys.executable, __file__, "_send", endpoint, str(streams), str(messages + 1), str(mib)])
    dest = np.empty(mib << 20, dtype=np.uint8)
    try:
        ends, received, start, per_message = 0, 0, None, mib << 20
        while ends < streams:
            frames = pull.recv_multipart(copy=False)
            if len(frames) == 1 and len(frames[0]) == 0:
                ends += 1
                continue
            for f in frames:
                n = len(f)
                if copy:
                    pos = received % per_message
                    np.copyto(dest[pos : pos + n], np.frombuffer(f.buffer, dtype=np.uint8))
                received += n
            if start is None and received >= per_message:
                start, counted = time.perf_counter(), received
        seconds = time.perf_counter() - start
        return (received - counted) / seconds / 1e9
    finally:
        proc.wait(60)
        ctx.destroy(linger=0)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_send":
        _send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", default="1,2,4")
    p.add_argument("--transports", default="tcp,ipc")
    p.add_argument("--mib", type=int, default=128, help="message size (split over the streams)")
    p.add_argument("--messages", type=int, default=12)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="spec-serve-streams-") as tmp:
        for transport in a.transports.split(","):
            for streams in map(int, a.streams.split(",")):
                for copy in (False, True):
                    gbps = measure(transport, streams, copy, a.messages, a.mib, tmp)
                    rows.append({"transport": transport, "streams": streams, "receiver": "copy" if copy else "raw",
                                 "gb_per_s": round(gbps, 3)})
                    print(f"{transport:<4} streams={streams} {rows[-1]['receiver']:<4} {gbps:7.3f} GB/s", flush=True)
    base = {(r["transport"], r["receiver"]): r["gb_per_s"] for r in rows if r["streams"] == 1}
    for r in rows:
        r["vs_one_stream"] = round(r["gb_per_s"] / base[(r["transport"], r["receiver"])], 2)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"when": time.strftime("%Y-%m-%d %H:%M:%S %z"), "cpus": os.cpu_count(), "mib": a.mib,
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
