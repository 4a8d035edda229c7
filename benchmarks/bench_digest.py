"""What the end-to-end reply digest (spec_serve/protocol/digest.py) costs, at the Llama-3.1-8B shape.

A full EAGLE-3 reply of 4 x 2048 tokens (aux 4x2048x12288 bf16, target_probs 4x2048x32000 f32,
position_mask, input_ids, loss_mask: 1.25 GB) is digested once on the worker's device and once on
the client's.

GPU (an H200; builds the 8B-shaped target with random bf16 weights, nothing downloaded):
    PYTHONPATH=$PWD python benchmarks/bench_digest.py --device cuda:0 --json digest-h200.json
  times one forward, the digests of its reply (queued, then one host transfer, as the worker does),
  and N forwards back to back with and without digests (the worker's loop), and prints the ratios.

CPU (no forward at this shape; synthetic reply tensors):
    PYTHONPATH=$PWD python benchmarks/bench_digest.py --device cpu --json digest-cpu.json
  times the digests against the reply's transfer over ZeroMQ tcp loopback (encode, send, receive,
  copy into the client's buffers: the frames path).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spec_serve.protocol import digest  # noqa: E402

B, S, H, VD = 4, 2048, 4096, 32000


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeat: int) -> list[float]:
    """Seconds of each of ``repeat`` calls, synchronized before and after."""
    out = []
    for _ in range(repeat):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - start)
    return out


def synthetic_reply(device: torch.device) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(0)
    return {
        "aux_hidden_states": torch.randn(B, S, 3 * H, generator=gen, device=device).to(torch.bfloat16),
        "target_probs": torch.rand(B, S, VD, generator=gen, device=device),
        "position_mask": torch.rand(B, S, 1, generator=gen, device=device) > 0.5,
        "input_ids": torch.randint(0, 128256, (B, S), generator=gen, device=device),
        "loss_mask": torch.ones(B, S, dtype=torch.int64, device=device),
    }


def transfer_seconds(reply: dict[str, torch.Tensor], repeat: int) -> list[float]:
    """Encode, send over tcp loopback, parse and copy into reused buffers, one reply at a time."""
    import zmq

    from spec_serve.protocol import wire

    ctx = zmq.Context.instance()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    buffers: dict[str, torch.Tensor] = {}
    out = []
    try:
        for _ in range(repeat + 1):
            start = time.perf_counter()
            sender = threading.Thread(target=lambda: push.send_multipart(wire.encode(reply), copy=False))
            sender.start()
            spans, _ = wire.parse(pull.recv_multipart(copy=False))
            for name, span in spans.items():
                buf = buffers.setdefault(name, torch.empty(span.nbytes, dtype=torch.uint8))
                span.copy_into(buf)
            sender.join()
            out.append(time.perf_counter() - start)
    finally:
        push.close(0)
        pull.close(0)
    return out[1:]


def gpu_forward(device: torch.device, tmp: str):
    from spec_serve.engines.hf import HFTarget
    from spec_serve.supervision.vocab import build_vocab_mapping
    from spec_serve.tools.bench import LLAMA_8B_AUX_LAYERS, LLAMA_8B_CONFIG, make_batch
    from spec_serve.tools.random_target import write_random_init_target

    target = write_random_init_target(Path(tmp) / "llama-8b-shape", LLAMA_8B_CONFIG)
    engine = HFTarget(target, device=device, dtype="bfloat16",
                      aux_layer_ids=[int(i) for i in LLAMA_8B_AUX_LAYERS.split(",")])
    ids, attn, loss = make_batch(B, S, LLAMA_8B_CONFIG["vocab_size"], seed=0)
    engine.set_vocab_mapping(*build_vocab_mapping(ids, loss, LLAMA_8B_CONFIG["vocab_size"], VD))
    return lambda: engine.generate_batch(ids, attn, loss, kind="eagle3")


def loop_seconds(forward, device: torch.device, n: int, with_digest: bool) -> float:
    """Seconds a forward of ``n`` back to back, as the worker's compute thread runs them."""
    _sync(device)
    start = time.perf_counter()
    for _ in range(n):
        out = forward()
        if with_digest:
            digest.digests([out])
    _sync(device)
    return (time.perf_counter() - start) / n


def run(args) -> dict:
    device = torch.device(args.device)
    result = {"device": str(device), "shape": {"batch": B, "seq": S, "hidden": H, "draft_vocab": VD},
              "host": platform.node(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
        with tempfile.TemporaryDirectory() as tmp:
            forward = gpu_forward(device, tmp)
            reply = forward()
            timed(forward, device, 1)  # warm-up
            result["forward_s"] = statistics.median(timed(forward, device, args.repeat))
            result["reply_digest_s"] = statistics.median(timed(lambda: digest.digests([reply]), device, args.repeat))
            plain = [loop_seconds(forward, device, args.loop, False) for _ in range(args.rounds)]
            checked = [loop_seconds(forward, device, args.loop, True) for _ in range(args.rounds)]
        result["loop_forward_s"], result["loop_forward_digest_s"] = statistics.median(plain), statistics.median(checked)
        result["digest_over_forward"] = result["reply_digest_s"] / result["forward_s"]
        result["both_sides_over_forward"] = 2 * result["digest_over_forward"]  # worker + a client on a GPU
        result["worker_loop_overhead"] = result["loop_forward_digest_s"] / result["loop_forward_s"] - 1
    else:
        reply = synthetic_reply(device)
        aux = {"aux_hidden_states": reply["aux_hidden_states"]}
        result["aux_digest_s"] = statistics.median(timed(lambda: digest.digests([aux]), device, args.repeat))
        result["reply_digest_s"] = statistics.median(timed(lambda: digest.digests([reply]), device, args.repeat))
        result["transfer_s"] = statistics.median(transfer_seconds(reply, args.repeat))
        result["both_sides_over_transfer"] = 2 * result["reply_digest_s"] / result["transfer_s"]
    result["reply_bytes"] = sum(t.numel() * t.element_size() for t in reply.values())
    result["reply_digest_gb_s"] = result["reply_bytes"] / result["reply_digest_s"] / 1e9
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeat", type=int, default=5, help="timed calls per figure (median)")
    p.add_argument("--loop", type=int, default=8, help="GPU: forwards per back-to-back loop")
    p.add_argument("--rounds", type=int, default=3, help="GPU: loops with and without digests (median)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    result = run(args)
    for key, value in result.items():
        print(f"{key:>26}: {value:.4f}" if isinstance(value, float) else f"{key:>26}: {value}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
