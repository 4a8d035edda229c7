"""What crosses a host boundary, over an emulated link (issues 25 and 40): two network namespaces joined by a
veth pair whose two ends `tc` limits to a rate (10 and 25 Gbit/s by default).

The broker and a null worker (spec_serve/tools/null_engine.py: ready replies of the Llama-3.1-8B shape,
149 KiB a token full, 32 KiB compact, 20 KiB compact with wire_dtype="fp8", whose final state stays bf16) run in
one namespace, the client in the other, so the client is on "another host" (its host key differs: no same-host
plane). Per rate and
round, in alternating order, the modes of ``--modes``:

  full      compact=False: full EAGLE-3 replies as frames
  auto      what compact="auto", the client's default, receives from a worker of another host: the worker
            answers compact (checked once per run with a real default client, below); landed on the client
            as frames (kind eagle3_compact), not expanded
  auto_fp8  the same with wire_dtype="fp8": the hidden states as float8_e4m3 with their float32 scales,
            landed and not restored

Batches are ``--rows`` rows of each of ``--lengths``, both by default and side by side in every round
(``lognormal``: each row's length drawn as ``spec-serve bench --lengths lognormal`` draws it, each batch padded
to its longest row, so reply sizes change from batch to batch as a trainer's do; ``full``: every row ``--seq``
tokens). Each figure is the steady state a training run sees, as `spec-serve bench` times it: from the first
reply landed to the last, counting the batches after the first (the pipeline's fill, one reply's whole way back
while nothing flows yet, is ``fill_s`` in the JSON; BENCHMARKS.md says what it weighed in short windows). Per
figure: useful and
padded tokens/s, the payload's Gbit/s, and ``of_link``: that payload rate over the link's rate (bytes per
padded token x padded tokens/s, against the link's own bound) and ``of_raw_tcp``: over what one plain TCP
stream carried across the same link just before (``raw_tcp_gbit_per_s``: a machine whose cores cannot fill
a fast link bounds both); ratios per round of auto_fp8 and auto against auto and full (median and every
round); every reply checked against what the null engine answers (verified=N/N).

What the link figures leave out, measured apart on this CPU: expanding compact replies (the client's one
draft-vocab matmul a token; cpu_expand_tokens_per_s) and restoring FP8 ones (cpu_restore_tokens_per_s).
Both are kernels on a GPU client's device. A CPU's quantizing would bound the worker likewise, so the null
worker quantizes each of its ready replies once (``null_engine.quantize_once``): a GPU worker quantizes at
memory bandwidth.

Once per run, untimed: a client with the defaults asks for EAGLE-3 across the link; the worker must answer
compact (stats.compact_replies), the client must fetch the lm_head slice once (stats.lm_head_slices) and
return the expanded batch bit-equal to the null compact reply expanded here; and a client with
wire_dtype="fp8" gets an FP8 reply (stats.fp8_replies) restored and expanded bit-equal to the reference.

Needs root, iproute2 (`ip netns`) and `tc`; exits 2 naming what is missing otherwise. Creates only its own
namespaces (10.232.0.0/24) and removes them, with every process it started in them.

  python benchmarks/bench_netns.py --json netns.json   # 10 and 25 Gbit/s, 3 rounds of 60 x 4 rows, lognormal and full
  python benchmarks/bench_netns.py --rates 10 --rounds 1 --messages 2 --seq 16 --rows 1   # what the test runs
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from spec_serve.client.options import PREFETCH_DEPTH  # noqa: E402

SUBNET = "10.232.0"
WORKER_ADDR, CLIENT_ADDR = f"{SUBNET}.1", f"{SUBNET}.2"
# Each mode: the kind it asks for and its wire_dtype (what it measures on the wire: see the docstring).
MODES = {"full": ("eagle3", None), "auto": ("eagle3_compact", None), "auto_fp8": ("eagle3_compact", "fp8")}


def unavailable(tools: tuple[str, ...] = ("ip", "tc")) -> str | None:
    """Why network namespaces (and ``tools``, both of iproute2) cannot be used here (None: they can)."""
    if os.geteuid() != 0:
        return f"needs root for {' and '.join(tools)}"
    for tool in tools:
        if shutil.which(tool) is None:
            return f"needs {tool} (iproute2: apt-get install iproute2)"
    probe = f"ssnp{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(*args: str) -> None:
    subprocess.run(list(args), check=True, capture_output=True, text=True)


class Link:
    """Two namespaces, worker side and client side, joined by one veth pair."""

    def __init__(self) -> None:
        tag = f"ssn{os.getpid() % 100000}"
        self.worker_ns, self.client_ns = f"{tag}w", f"{tag}c"
        self.created: list[str] = []
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Link:
        try:
            for ns in (self.worker_ns, self.client_ns):
                _run("ip", "netns", "add", ns)
                self.created.append(ns)
                _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "link", "add", "vw", "netns", self.worker_ns, "type", "veth", "peer", "name", "vc", "netns",
                 self.client_ns)
            for ns, dev, addr in ((self.worker_ns, "vw", WORKER_ADDR), (self.client_ns, "vc", CLIENT_ADDR)):
                _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _run("ip", "-n", ns, "link", "set", dev, "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def limit(self, gbit: float) -> None:
        """Both directions of the link at ``gbit`` Gbit/s (a token bucket of 10 ms at that rate)."""
        burst = max(int(gbit * 1e9 / 8 * 0.01), 1 << 20)
        for ns, dev in ((self.worker_ns, "vw"), (self.client_ns, "vc")):
            _run("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{gbit}gbit",
                 "burst", str(burst), "latency", "100ms")

    def spawn(self, ns: str, args: list[str], **kw) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "OMP_NUM_THREADS": "1", "SPEC_SERVE_UNKNOWN_SERVICE_GRACE": "300"}
        proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, *args], env=env, **kw)
        self.procs.append(proc)
        return proc

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        for ns in reversed(self.created):
            for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
                try:
                    os.kill(int(pid), 9)  # started by us inside our namespace
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _client(link: Link, *args: str, timeout: float = 900) -> dict:
    """One client process on the client side; its last stdout line is its JSON report."""
    proc = link.spawn(link.client_ns, [__file__, *args], stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"client {args[0]} exited with {proc.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def _client_main(argv: list[str]) -> None:
    """``_timed FRONTEND MODE MESSAGES SEQ ROWS LENGTHS PREFETCH DEVICE`` or ``_auto FRONTEND``, run inside the
    client namespace."""
    if argv[0] == "_raw":
        print(json.dumps({"gbit_per_s": raw_receive(int(argv[1]))}), flush=True)
        return
    if argv[0] == "_timed":
        frontend, mode, lengths, device = argv[1], argv[2], argv[6], argv[8]
        messages, seq, rows, prefetch = (int(a) for a in (argv[3], argv[4], argv[5], argv[7]))
        print(json.dumps(timed_run(frontend, mode, messages, seq, rows, lengths, prefetch, device)), flush=True)
        return
    print(json.dumps({**_default_client(argv[1], None), "fp8": _default_client(argv[1], "fp8")}), flush=True)


RAW_PORT, RAW_BYTES, RAW_CHUNK = 7000, 2 << 30, 64 << 20


def raw_receive(nbytes: int) -> float:
    """On the client side: accept one TCP connection on ``RAW_PORT`` and read ``nbytes`` into one reused
    buffer; the Gbit/s from its first byte to its last."""
    import socket

    with socket.create_server((CLIENT_ADDR, RAW_PORT)) as server:
        print("listening", flush=True)
        conn, _ = server.accept()
        with conn:
            view = memoryview(bytearray(RAW_CHUNK))
            got = conn.recv_into(view)
            start = time.perf_counter()
            while got < nbytes:
                n = conn.recv_into(view[: min(RAW_CHUNK, nbytes - got)])
                if not n:
                    raise RuntimeError(f"raw sender closed after {got} of {nbytes} bytes")
                got += n
            return nbytes * 8 / (time.perf_counter() - start) / 1e9


def raw_ceiling(link: Link) -> float:
    """Gbit/s one plain TCP stream carries over the link as limited now, worker side to client side: what
    this machine moves at all (its cores bound it below a fast link's rate), measured beside the figures."""
    receiver = link.spawn(link.client_ns, [__file__, "_raw", str(RAW_BYTES)], stdout=subprocess.PIPE, text=True)
    assert receiver.stdout is not None and receiver.stdout.readline().strip() == "listening"
    send = (f"import socket; c = socket.create_connection(({CLIENT_ADDR!r}, {RAW_PORT})); b = bytes({RAW_CHUNK})\n"
            f"for _ in range({RAW_BYTES // RAW_CHUNK}): c.sendall(b)\nc.close()")
    sender = link.spawn(link.worker_ns, ["-c", send])
    out, _ = receiver.communicate(timeout=300)
    sender.wait(60)
    return round(json.loads(out.strip().splitlines()[-1])["gbit_per_s"], 2)


def _null_reply(shape: tuple[int, int], kind: str, wire_dtype: str | None):
    """What the null worker sends for a ``[rows, seq]`` batch: its ready tensors, the hidden states in FP8 (by
    the real quantize_reply) if asked."""
    from spec_serve.supervision import fp8
    from spec_serve.supervision.contract import FP8_TENSORS
    from spec_serve.tools.null_engine import HIDDEN, null_tensors

    tensors = null_tensors(*shape, kind)
    return fp8.quantize_reply(tensors, FP8_TENSORS, HIDDEN) if wire_dtype else tensors


def timed_run(frontend: str, mode: str, messages: int, seq: int, rows: int, lengths: str, prefetch: int,
              device: str = "cpu") -> dict:
    """``messages`` batches of ``rows`` rows (``lengths``) to the null worker after one untimed batch, as a
    trainer asks for them: ``prefetch`` in flight, each reply taken (the oldest first) once that many are,
    checked against the null reply and dropped. Timed from the first reply landed on ``device`` to the last,
    over the batches after the first (compact replies not expanded; FP8 ones restored on a GPU, landed as sent
    on a CPU: the docstring says why). Holding every reply to check it after the clock made each land in fresh
    memory, whose first touch a trainer's client does not pay: it lands in memory the batches it dropped held
    (recv_alloc, the caching allocator)."""
    import collections

    import torch

    from spec_serve.client import restore
    from spec_serve.client.api import RemoteTargetModel
    from spec_serve.supervision.fp8 import restore_reply
    from spec_serve.tools.bench import padded_batch, row_lengths
    from spec_serve.tools.null_engine import VOCAB, null_mapping
    from spec_serve.tools.verify import mismatch

    kind, wire_dtype = MODES[mode]
    restored = wire_dtype is not None and torch.device(device).type == "cuda"
    if wire_dtype is not None and not restored:  # the restore is a kernel on a GPU client, measured apart here
        restore.restore_shards = lambda parts, forms, rows, dtype: {k: t for (k, _), t in parts.items()}
    batches = [padded_batch(n, VOCAB, i) for i, n in enumerate(row_lengths(lengths, messages + 1, rows, seq))]
    timed = batches[1:]
    # The reply to the longest batch, quantized as quantize_reply does; every tensor is [rows, seq, ...] of one
    # value, so a shorter batch's reply is its [:, :seq] slice.
    sent = _null_reply((rows, max(b[0].shape[1] for b in timed)), kind, wire_dtype)
    want = restore_reply(sent, torch.bfloat16) if restored else sent
    want = {name: t.to(device) for name, t in want.items()}
    passed = 0
    pending: collections.deque = collections.deque()
    landed: list[tuple[float, int]] = []  # (seconds from the start, batch) as each reply was complete on the client

    def take_oldest() -> None:
        nonlocal passed
        batch, future = pending.popleft()
        width = batch[0].shape[1]
        passed += mismatch(future.result(), {name: t[:, :width] for name, t in want.items()}, bits=True) is None

    with RemoteTargetModel(frontend, service="null", device=device, prefetch_depth=prefetch, timeout=600,
                           compact=False, wire_dtype=wire_dtype) as client:
        client.set_vocab_mapping(*null_mapping())
        client.generate_batch(*batches[0], kind=kind)
        start = time.perf_counter()
        for i, batch in enumerate(timed):
            if len(pending) == prefetch:
                take_oldest()
            future = client.generate_batch_async(*batch, kind=kind)
            future.add_done_callback(functools.partial(_land, landed, start, i))
            pending.append((batch, future))
        while pending:
            take_oldest()
        end = time.perf_counter() - start  # each check's torch.equal has synchronized its device
        stats = client.stats
    per_token = sum(t[0, 0].numel() * t.element_size() for t in sent.values())  # bytes a padded token sent
    return {**_steady(timed, landed, end, per_token, stats), "verified": f"{passed}/{len(timed)}",
            "torch_threads": torch.get_num_threads()}


def _land(landed: list[tuple[float, int]], start: float, batch: int, _future: object) -> None:
    """A reply is complete on the client: when, from ``start``, and which batch."""
    landed.append((time.perf_counter() - start, batch))


def _steady(timed: list, landed: list[tuple[float, int]], end: float, per_token: int, stats) -> dict:
    """The figure from the first reply landed to ``end``, over the batches after it: the pipeline's fill (one
    reply's whole way back while nothing flows yet) is ``fill_s``, apart, as a training run pays it once."""
    fill, first = min(landed)
    steady = [batch for i, batch in enumerate(timed) if i != first]
    return {**_figure(steady, per_token, end - fill, stats), "fill_s": round(fill, 4), "window_s": round(end, 4),
            "landed_s": [round(t, 4) for t, _ in sorted(landed)]}


def _figure(timed: list, per_token: int, seconds: float, stats) -> dict:
    """What a timed run of the batches ``timed`` took and moved, and what its client counted."""
    per_batch = [b[1].numel() for b in timed]
    return {"tokens": sum(int(b[1].sum()) for b in timed), "padded_tokens": sum(per_batch),
            "bytes": per_token * sum(per_batch), "seconds": seconds, "batch_padded_tokens": per_batch,
            "fp8_replies": stats.fp8_replies, "fp8_declined": stats.fp8_declined, "retried": stats.retried,
            "link_resends": stats.link_resends, "duplicates": stats.duplicates}


def _default_client(frontend: str, wire_dtype: str | None) -> dict:
    """A client with the defaults (compact="auto"), and ``wire_dtype``, asks for EAGLE-3 once: what it counts,
    and whether its expanded batch equals the null reply (as sent, restored) expanded here."""
    import torch

    from spec_serve.client.api import RemoteTargetModel
    from spec_serve.supervision.eagle3 import expand_compact
    from spec_serve.supervision.fp8 import restore_reply
    from spec_serve.tools.bench import make_batch
    from spec_serve.tools.null_engine import HIDDEN, VOCAB, null_mapping

    batch = make_batch(1, 8, VOCAB, 1)
    with RemoteTargetModel(frontend, service="null", timeout=600, wire_dtype=wire_dtype) as client:
        client.set_vocab_mapping(*null_mapping())
        got = client.generate_batch(*batch, kind="eagle3")
        stats = client.stats
    ids, mask = null_mapping()
    sent = restore_reply(_null_reply(tuple(batch[0].shape), "eagle3_compact", wire_dtype), torch.bfloat16)
    want = expand_compact(sent, torch.zeros(len(ids), HIDDEN, dtype=torch.bfloat16), mask)
    equal = got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    return {"compact_replies": stats.compact_replies, "lm_head_slices": stats.lm_head_slices,
            "plane_replies": stats.plane_replies, "fp8_replies": stats.fp8_replies, "equal": equal}


def cpu_expand_rate(tokens: int = 8) -> float:
    """Tokens/s of expanding compact replies of the 8B shape on this CPU (what the link figure leaves out)."""
    import torch

    from spec_serve.supervision.eagle3 import expand_compact
    from spec_serve.tools.null_engine import DRAFT_VOCAB, HIDDEN, null_mapping, null_tensors

    batch, weight, mask = null_tensors(1, tokens, "eagle3_compact"), torch.ones(DRAFT_VOCAB, HIDDEN,
                                                                              dtype=torch.bfloat16), null_mapping()[1]
    expand_compact(batch, weight, mask)  # warm-up
    start = time.perf_counter()
    expand_compact(batch, weight, mask)
    return tokens / (time.perf_counter() - start)


def cpu_restore_rate(tokens: int = 2048) -> float:
    """Tokens/s of restoring compact FP8 replies of the 8B shape to bf16 on this CPU (left out likewise)."""
    import torch

    from spec_serve.supervision.fp8 import restore_reply

    sent = _null_reply((1, tokens), "eagle3_compact", "fp8")
    restore_reply(sent, torch.bfloat16)  # warm-up
    start = time.perf_counter()
    restore_reply(sent, torch.bfloat16)
    return tokens / (time.perf_counter() - start)


def _start_cluster(link: Link, capacity: int) -> str:
    frontend, backend = f"tcp://{WORKER_ADDR}:5555", f"tcp://{WORKER_ADDR}:5556"
    # No CURVE between the namespaces: protected mode needs the explicit flag.
    link.spawn(link.worker_ns, ["-m", "spec_serve.tools.cli", "broker", "--frontend", "tcp://*:5555", "--backend",
                                "tcp://*:5556", "--http-port", "0", "--insecure-network"], stdout=subprocess.DEVNULL,
               stderr=subprocess.DEVNULL)
    link.spawn(link.worker_ns, ["-m", "spec_serve.tools.bench", "_null_worker", backend, "null", str(capacity)],
               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return frontend


def run(rates: list[float], modes: list[str], rounds: int, messages: int, seq: int, rows: int, lengths: list[str],
        prefetch: int, device: str, worker_capacity: int = 2) -> dict:
    config = {"rates_gbit": rates, "modes": modes, "rounds": rounds, "messages": messages, "seq": seq, "rows": rows,
              "lengths": lengths, "prefetch": prefetch, "client_device": device, "worker_capacity": worker_capacity}
    report: dict = {"when": time.strftime("%Y-%m-%d %H:%M:%S %z"), "cpus": os.cpu_count(), "load": os.getloadavg(),
                    "config": config, "rates": {}}
    with Link() as link:
        frontend = _start_cluster(link, worker_capacity)
        report["auto_check"] = _client(link, "_auto", frontend)
        for gbit in rates:
            link.limit(gbit)
            report["rates"][f"{gbit:g}"] = _measure_rate(link, frontend, gbit, config)
    report["cpu_expand_tokens_per_s"] = round(cpu_expand_rate(), 1)
    report["cpu_restore_tokens_per_s"] = round(cpu_restore_rate(), 1)
    return report


def _measure_rate(link: Link, frontend: str, gbit: float, config: dict) -> dict:
    """One rate: the plain TCP ceiling, then per round each of the config's lengths, its modes in alternating
    order; per lengths, each mode's figures and their ratios."""
    ceiling = raw_ceiling(link)
    print(f"[netns] {gbit:g} Gbit/s: one plain TCP stream carries {ceiling:.2f} Gbit/s here", file=sys.stderr,
          flush=True)
    modes = config["modes"]
    figures: dict[str, dict[str, list[dict]]] = {shape: {mode: [] for mode in modes} for shape in config["lengths"]}
    for r in range(config["rounds"]):
        for shape in config["lengths"]:
            for mode in (modes if r % 2 == 0 else modes[::-1]):
                got = _client(link, "_timed", frontend, mode, str(config["messages"]), str(config["seq"]),
                              str(config["rows"]), shape, str(config["prefetch"]), config["client_device"])
                figures[shape][mode].append(_rated(got, gbit, ceiling))
                print(f"[netns] {gbit:g} Gbit/s {shape} round {r + 1}: {mode} {got['tokens_per_s']:,.0f} tokens/s "
                      f"({got['gbit_per_s']:.2f} Gbit/s, {got['of_link']:.0%} of the link) "
                      f"verified={got['verified']} retried={got['retried']}", file=sys.stderr, flush=True)
    return {"raw_tcp_gbit_per_s": ceiling, "lengths": {shape: {**f, **_ratios(f)} for shape, f in figures.items()}}


def _rated(got: dict, gbit: float, ceiling: float) -> dict:
    """A figure with its rates: useful and padded tokens/s, the payload's Gbit/s, and its share of the link's
    rate and of what one plain TCP stream carried over it (``ceiling``)."""
    seconds = got["seconds"]
    got["tokens_per_s"] = got["tokens"] / seconds
    got["padded_tokens_per_s"] = got["padded_tokens"] / seconds
    got["bytes_per_padded_token"] = got["bytes"] / got["padded_tokens"]
    got["gbit_per_s"] = got["bytes"] * 8 / seconds / 1e9
    got["of_link"] = round(got["gbit_per_s"] / gbit, 4)  # bytes per token x tokens/s over the link's bound
    got["of_raw_tcp"] = round(got["gbit_per_s"] / ceiling, 4)
    return got


def _ratios(figures: dict[str, list[dict]]) -> dict:
    """Per round, tokens/s of auto over full and of auto_fp8 over auto (where both ran): median and rounds."""
    out = {}
    for over, under in (("auto", "full"), ("auto_fp8", "auto")):
        if over in figures and under in figures:
            ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(figures[over], figures[under])]
            out[f"{over}_over_{under}"] = {"median": round(statistics.median(ratios), 3),
                                           "rounds": [round(x, 3) for x in ratios]}
    return out


def _summary(figures: dict, modes: list[str], ceiling: float) -> str:
    """One line: each mode's median tokens/s, share of the link and of plain TCP, then the ratios."""
    shown = [f"{mode} {statistics.median(f['tokens_per_s'] for f in figures[mode]):>9,.0f} tokens/s "
             f"({statistics.median(f['of_link'] for f in figures[mode]):.0%} of the link, "
             f"{statistics.median(f['of_raw_tcp'] for f in figures[mode]):.0%} of plain TCP's {ceiling:.2f} Gbit/s)"
             for mode in modes]
    ratios = [f"{name} {r['median']} {r['rounds']}" for name, r in figures.items() if name.endswith(("_full", "_auto"))]
    return "  ".join(shown + ratios)


def _ok(report: dict) -> bool:
    """Every reply verified, and the default clients' checks passed."""
    check = report["auto_check"]
    config = report["config"]
    figures = [(mode, f) for rate in report["rates"].values() for shape in config["lengths"]
               for mode in config["modes"] for f in rate["lengths"][shape][mode]]
    verified = all(f["verified"].split("/")[0] == f["verified"].split("/")[1] for _, f in figures)
    fp8_sent = all(f["fp8_replies"] == config["messages"] + 1 for mode, f in figures if mode == "auto_fp8")
    return (verified and fp8_sent and check["equal"] and check["compact_replies"] == 1
            and check["lm_head_slices"] == 1 and check["fp8"]["equal"] and check["fp8"]["fp8_replies"] == 1)


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("_timed", "_auto", "_raw"):
        _client_main(argv)
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="10,25", help="link rates in Gbit/s, comma-separated [10,25]")
    p.add_argument("--modes", default="auto,auto_fp8", help=f"of {', '.join(MODES)}, comma-separated [auto,auto_fp8]")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--messages", type=int, default=60, help="batches a figure after one untimed (at least 2) [60]")
    p.add_argument("--seq", type=int, default=2048, help="longest row [2048]")
    p.add_argument("--rows", type=int, default=4, help="rows a batch [4]")
    p.add_argument("--lengths", default="lognormal,full",
                   help="row lengths, each measured in every round: lognormal, full or both [lognormal,full]")
    p.add_argument("--prefetch", type=int, default=PREFETCH_DEPTH, help=f"batches in flight [{PREFETCH_DEPTH}]")
    p.add_argument("--client-device", default="cpu",
                   help="where the client lands replies [cpu]; on cuda:N FP8 ones are restored there, as in training")
    p.add_argument("--worker-capacity", type=int, default=2, help="requests the null worker takes at once [2]")
    p.add_argument("--json", default=None, help="write the report here")
    a = p.parse_args(argv)
    modes = a.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        p.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    if a.messages < 2:
        p.error(f"--messages {a.messages}: give 2 or more (a figure is timed from its first reply to its last)")
    lengths = a.lengths.split(",")
    if not set(lengths) <= {"lognormal", "full"}:
        p.error(f"--lengths: {a.lengths!r}; give lognormal, full or lognormal,full")
    reason = unavailable()
    if reason:
        print(f"bench_netns: {reason}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stopped: the namespaces and processes go too
    report = run([float(r) for r in a.rates.split(",")], modes, a.rounds, a.messages, a.seq, a.rows, lengths,
                 a.prefetch, a.client_device, a.worker_capacity)
    report["ok"] = _ok(report)
    for gbit, rate in report["rates"].items():
        for shape, figures in rate["lengths"].items():
            print(f"{gbit:>4} Gbit/s {shape:>9}  " + _summary(figures, modes, rate["raw_tcp_gbit_per_s"]))
    print(f"default clients: {report['auto_check']}; CPU expansion {report['cpu_expand_tokens_per_s']:,} tokens/s, "
          f"CPU FP8 restore {report['cpu_restore_tokens_per_s']:,} tokens/s; {'OK' if report['ok'] else 'NOT OK'}")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
