"""Every scenario by name: the services it needs and the function that measures it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from spec_serve.tools.bench.colocated import run_colocated
from spec_serve.tools.bench.compile_time import run_compile_time
from spec_serve.tools.bench.remote import run_remote, run_small
from spec_serve.tools.bench.transport import _fresh, run_broker_null, run_direct, run_push, run_worker_pool

if TYPE_CHECKING:
    from spec_serve.tools.bench.context import Context


# name -> (services it needs, function).
SCENARIOS: dict[str, tuple[set, Callable[[Context], dict]]] = {
    "colocated": (set(), lambda c: run_colocated(c, compact=False)),
    "colocated_compact": (set(), lambda c: run_colocated(c, compact=True)),
    "colocated_packed": (set(), lambda c: run_colocated(c, compact=False, packed=True)),
    "remote_1w_packed": ({"packed"}, lambda c: run_remote(c, "packed", False, 1, "remote_1w_packed", packed=True)),
    "remote_1w_compact_packed": ({"packed"}, lambda c: run_remote(c, "packed", True, 1, "remote_1w_compact_packed",
                                                                  packed=True)),
    # The packing worker through the same-host plane, the client on the worker's GPU or its own.
    "samehost_1w_packed": ({"packed"}, lambda c: run_remote(c, "packed", False, 1, "samehost_1w_packed",
                                                            packed=True, plane=True)),
    "samehost_1w_compact_packed": ({"packed"}, lambda c: run_remote(c, "packed", True, 1,
                                                                    "samehost_1w_compact_packed", packed=True,
                                                                    plane=True)),
    "samehost_1w_packed_own_gpu": ({"packed"}, lambda c: run_remote(c, "packed", False, 1,
                                                                    "samehost_1w_packed_own_gpu", packed=True,
                                                                    plane=True, own_device=True)),
    "remote_1w_compact_packed_own_gpu": ({"packed"}, lambda c: run_remote(c, "packed", True, 1,
                                                                          "remote_1w_compact_packed_own_gpu",
                                                                          packed=True, own_device=True)),
    "colocated_dspark": (set(), lambda c: run_colocated(c, compact=False, dspark=True)),
    # Compiled decoder layers (docs/compile.md): colocated, and workers started with --compile.
    "colocated_compiled": (set(), lambda c: run_colocated(c, compact=False, compiled=True)),
    "colocated_packed_compiled": (set(), lambda c: run_colocated(c, compact=False, packed=True, compiled=True)),
    "samehost_1w_compiled": ({"compiled"}, lambda c: run_remote(c, "compiled", False, 1, "samehost_1w_compiled",
                                                                plane=True, compiled=True)),
    "samehost_1w_packed_compiled": ({"compiled_packed"},
                                    lambda c: run_remote(c, "compiled_packed", False, 1, "samehost_1w_packed_compiled",
                                                         packed=True, plane=True, compiled=True)),
    "compile_cold": (set(), run_compile_time),
    # Replies as frames (the same-host plane off), as a client on another host gets them.
    "remote_1w": ({"w1"}, lambda c: run_remote(c, "w1", False, 1, "remote_1w")),
    "remote_1w_compact": ({"w1"}, lambda c: run_remote(c, "w1", True, 1, "remote_1w_compact")),
    # The client's defaults (compact="auto") with the plane off, as a client on another host has them: the
    # worker answers compact, the client expands on its device.
    "remote_1w_auto": ({"w1"}, lambda c: run_remote(c, "w1", "auto", 1, "remote_1w_auto")),
    "remote_1w_dspark": ({"w1"}, lambda c: run_remote(c, "w1", False, 1, "remote_1w_dspark", dspark=True)),
    # The same worker, the client (and its H2D copies, compact expansion) on the last device, as a
    # trainer on a GPU of its own would be; on one device identical to the above.
    "remote_1w_own_gpu": ({"w1"}, lambda c: run_remote(c, "w1", False, 1, "remote_1w_own_gpu", own_device=True)),
    "remote_1w_compact_own_gpu": ({"w1"}, lambda c: run_remote(c, "w1", True, 1, "remote_1w_compact_own_gpu",
                                                               own_device=True)),
    "remote_2w": ({"w2"}, lambda c: run_remote(c, "w2", False, 2, "remote_2w")),
    "remote_2w_compact": ({"w2"}, lambda c: run_remote(c, "w2", True, 2, "remote_2w_compact")),
    # The same-host plane (CUDA IPC between GPUs, shared memory otherwise).
    "samehost_1w": ({"w1"}, lambda c: run_remote(c, "w1", False, 1, "samehost_1w", plane=True)),
    "samehost_1w_compact": ({"w1"}, lambda c: run_remote(c, "w1", True, 1, "samehost_1w_compact", plane=True)),
    "samehost_1w_dspark": ({"w1"}, lambda c: run_remote(c, "w1", False, 1, "samehost_1w_dspark", plane=True,
                                                        dspark=True)),
    "samehost_1w_own_gpu": ({"w1"}, lambda c: run_remote(c, "w1", False, 1, "samehost_1w_own_gpu", own_device=True,
                                                         plane=True)),
    "samehost_2w": ({"w2"}, lambda c: run_remote(c, "w2", False, 2, "samehost_2w", plane=True)),
    "samehost_2w_compact": ({"w2"}, lambda c: run_remote(c, "w2", True, 2, "samehost_2w_compact", plane=True)),
    # Bound worker on the first device, client on the last, tensors over a private NCCL pair group
    # (gloo on CPU). Needs two devices on a GPU host.
    "remote_nccl": ({"nccl"}, lambda c: run_remote(c, "nccl", False, 1, "remote_nccl", nccl=True)),
    "remote_nccl_compact": ({"nccl"}, lambda c: run_remote(c, "nccl", True, 1, "remote_nccl_compact", nccl=True)),
    "small_unbatched": ({"w1"}, lambda c: run_small(c, "w1", "small_unbatched")),
    "small_batched": ({"batch"}, lambda c: run_small(c, "batch", "small_batched")),
    "broker_null": ({"null"}, run_broker_null),
    "broker_null_compact": ({"null"}, lambda c: run_broker_null(c, compact=True)),
    "samehost_null": ({"null"}, lambda c: run_broker_null(c, plane=True)),
    "direct_null": (set(), run_direct),
    "zmq_raw": (set(), lambda c: run_push(c, "raw")),
    "frames": (set(), lambda c: run_push(c, "wire")),
    # The same over ipc:// (unix sockets).
    "zmq_raw_ipc": (set(), lambda c: run_push(c, "raw", "ipc")),
    "frames_ipc": (set(), lambda c: run_push(c, "wire", "ipc")),
    # Before/after of the receive-buffer recycling (hostpool.RecyclingAllocator) on the same bytes.
    "frames_fresh": (set(), lambda c: dict(_fresh(c), scenario="frames_fresh")),
    "worker_pool": (set(), run_worker_pool),
}
