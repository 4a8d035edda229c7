"""Full EAGLE-3 over frames against compact="auto", across an emulated link (issue 25): two network
namespaces joined by a veth pair whose two ends `tc` limits to a rate (10 and 25 Gbit/s by default).

The broker and a null worker (spec_serve/tools/null_engine.py: ready replies of the Llama-3.1-8B shape,
149 KiB a token full, 32 KiB compact) run in one namespace, the client in the other, so the client is on
"another host" (its host key differs: no same-host plane). Per rate and round, in alternating order:

  full   compact=False: full EAGLE-3 replies as frames
  auto   what compact="auto", the client's default, receives from a worker of another host: the worker
         answers compact (checked once per run with a real default client, below); timed from the first
         request to the last reply landed on the client, as frames (kind eagle3_compact), not expanded

and tokens/s of each, their ratio per round (median and every round), every reply checked against what the
null engine answers (verified=N/N). Expanding compact replies is the client's one draft-vocab matmul a token
on its device: on a GPU that is a fraction of a millisecond a batch (the GPU figure, remote_1w_auto of
`spec-serve bench`, includes it); on this CPU it is far slower than the link, so it is measured apart and
reported (cpu_expand_tokens_per_s), not mixed into the transport figure.

Once per run, untimed: a client with the defaults asks for EAGLE-3 across the link; the worker must answer
compact (stats.compact_replies), the client must fetch the lm_head slice once (stats.lm_head_slices) and
return the expanded batch bit-equal to the null compact reply expanded here.

Needs root, iproute2 (`ip netns`) and `tc`; exits 2 naming what is missing otherwise. Creates only its own
namespaces (10.232.0.0/24) and removes them, with every process it started in them.

  python benchmarks/bench_netns.py --json netns.json               # 10 and 25 Gbit/s, 3 rounds
  python benchmarks/bench_netns.py --rates 10 --rounds 1 --messages 2 --seq 16   # what the test suite runs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SUBNET = "10.232.0"
WORKER_ADDR, CLIENT_ADDR = f"{SUBNET}.1", f"{SUBNET}.2"
KINDS = {"full": "eagle3", "auto": "eagle3_compact"}  # what each measures on the wire (see the docstring)


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
    """``_timed FRONTEND KIND MESSAGES SEQ PREFETCH`` or ``_auto FRONTEND``, run inside the client namespace."""
    import torch

    from spec_serve.tools.bench import make_batch, transport_run

    if argv[0] == "_timed":
        frontend, kind, messages, seq, prefetch = argv[1], argv[2], int(argv[3]), int(argv[4]), int(argv[5])
        print(json.dumps(transport_run(frontend, kind, messages, seq, prefetch, warmup=1)), flush=True)
        return
    from spec_serve.client.api import RemoteTargetModel
    from spec_serve.supervision.eagle3 import expand_compact
    from spec_serve.tools.null_engine import HIDDEN, VOCAB, null_mapping, null_tensors

    with RemoteTargetModel(argv[1], service="null", timeout=600) as client:  # the defaults: compact="auto"
        client.set_vocab_mapping(*null_mapping())
        got = client.generate_batch(*make_batch(1, 8, VOCAB, 1), kind="eagle3")
        stats = client.stats
    ids, mask = null_mapping()
    want = expand_compact(null_tensors(1, 8, "eagle3_compact"), torch.zeros(len(ids), HIDDEN, dtype=torch.bfloat16),
                          mask)
    equal = got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    print(json.dumps({"compact_replies": stats.compact_replies, "lm_head_slices": stats.lm_head_slices,
                      "plane_replies": stats.plane_replies, "equal": equal}), flush=True)


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


def _start_cluster(link: Link) -> str:
    frontend, backend = f"tcp://{WORKER_ADDR}:5555", f"tcp://{WORKER_ADDR}:5556"
    # No CURVE between the namespaces: protected mode needs the explicit flag.
    link.spawn(link.worker_ns, ["-m", "spec_serve.tools.cli", "broker", "--frontend", "tcp://*:5555", "--backend",
                                "tcp://*:5556", "--http-port", "0", "--insecure-network"], stdout=subprocess.DEVNULL,
               stderr=subprocess.DEVNULL)
    link.spawn(link.worker_ns, ["-m", "spec_serve.tools.bench", "_null_worker", backend, "null"],
               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return frontend


def run(rates: list[float], rounds: int, messages: int, seq: int, prefetch: int) -> dict:
    report: dict = {"when": time.strftime("%Y-%m-%d %H:%M:%S %z"), "cpus": os.cpu_count(),
                    "config": {"rates_gbit": rates, "rounds": rounds, "messages": messages, "seq": seq,
                               "prefetch": prefetch}, "rates": {}}
    with Link() as link:
        frontend = _start_cluster(link)
        report["auto_check"] = _client(link, "_auto", frontend)
        for gbit in rates:
            link.limit(gbit)
            figures: dict[str, list[dict]] = {"full": [], "auto": []}
            for r in range(rounds):
                for name in (("full", "auto") if r % 2 == 0 else ("auto", "full")):
                    got = _client(link, "_timed", frontend, KINDS[name], str(messages), str(seq), str(prefetch))
                    got["tokens_per_s"] = got["tokens"] / got["seconds"]
                    got["gbit_per_s"] = got["bytes"] * 8 / got["seconds"] / 1e9
                    figures[name].append(got)
                    print(f"[netns] {gbit:g} Gbit/s round {r + 1}: {name} {got['tokens_per_s']:,.0f} tokens/s "
                          f"({got['gbit_per_s']:.2f} Gbit/s) verified={got['verified']}", file=sys.stderr, flush=True)
            ratios = [a["tokens_per_s"] / f["tokens_per_s"] for a, f in zip(figures["auto"], figures["full"])]
            report["rates"][f"{gbit:g}"] = {**figures, "auto_over_full": round(statistics.median(ratios), 3),
                                            "rounds": [round(x, 3) for x in ratios]}
    report["cpu_expand_tokens_per_s"] = round(cpu_expand_rate(), 1)
    return report


def _ok(report: dict) -> bool:
    """Every reply verified and the auto check passed."""
    check = report["auto_check"]
    verified = all(f["verified"].split("/")[0] == f["verified"].split("/")[1]
                   for rate in report["rates"].values() for name in ("full", "auto") for f in rate[name])
    return verified and check["equal"] and check["compact_replies"] == 1 and check["lm_head_slices"] == 1


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("_timed", "_auto"):
        _client_main(argv)
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="10,25", help="link rates in Gbit/s, comma-separated [10,25]")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--messages", type=int, default=8, help="timed replies per figure")
    p.add_argument("--seq", type=int, default=256, help="tokens per reply (1 x SEQ) [256]")
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--json", default=None, help="write the report here")
    a = p.parse_args(argv)
    reason = unavailable()
    if reason:
        print(f"bench_netns: {reason}", file=sys.stderr)
        return 2
    report = run([float(r) for r in a.rates.split(",")], a.rounds, a.messages, a.seq, a.prefetch)
    report["ok"] = _ok(report)
    for gbit, rate in report["rates"].items():
        full, auto = (statistics.median(f["tokens_per_s"] for f in rate[n]) for n in ("full", "auto"))
        print(f"{gbit:>4} Gbit/s  full {full:>10,.0f} tokens/s  auto {auto:>10,.0f} tokens/s  "
              f"auto/full {rate['auto_over_full']} {rate['rounds']}")
    print(f"auto check: {report['auto_check']}; CPU expansion {report['cpu_expand_tokens_per_s']:,} tokens/s; "
          f"{'OK' if report['ok'] else 'NOT OK'}")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
