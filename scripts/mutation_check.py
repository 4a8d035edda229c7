"""Deliberate bugs, and the tests named for each claim: every test must go red under its bug (issue 22).

Not part of CI (each run starts clusters; the whole check takes 15-30 minutes on 2 cores). For each
mutation: copy the checkout's tracked files (as they are in the working tree) to a scratch directory,
apply the one-line bug there, run its tests from that copy, and expect them to fail. The checkout itself
is never touched. A mutation whose text is no longer in the file is reported as such (the code moved:
update the mutation).

    .venv/bin/python scripts/mutation_check.py                 # all
    .venv/bin/python scripts/mutation_check.py sharding digest_4k
    .venv/bin/python scripts/mutation_check.py --list
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    claim: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTATIONS = (
    Mutation("sharding", "a batch is split into num_shards requests",
             "spec_serve/client/assembly.py",
             "    return [(int(c[0]), int(c[-1]) + 1) for c in torch.arange(rows).tensor_split(min(num_shards, rows))]",
             "    return [(0, rows)]  # MUTATION: num_shards ignored",
             ("tests/system/test_cluster.py::test_three_ranks_sharded_and_prefetched_equal_colocated",
              "tests/system/test_cluster.py::test_short_rows_sharded_meet_the_contract",
              "tests/client/test_compact_remote.py::test_compact_remote_equals_colocated",
              "tests/supervision/test_verify.py::test_shard_bounds_split_rows_into_near_equal_parts",
              "tests/supervision/test_verify.py::test_references_compute_each_shard_alone",
              "tests/system/test_ordinary_use.py::test_any_number_of_vocab_mappings_over_time")),
    Mutation("redispatch", "the broker re-dispatches a dead worker's in-flight requests",
             "spec_serve/broker/dispatch.py",
             "        elif request.client in self.clients.clients:\n"
             "            self.services.push(request, front=True)\n            self.ctx.metrics.redispatched.inc()\n",
             "        elif request.client in self.clients.clients:\n"
             "            del self.requests[request.request_id]  # MUTATION: dropped silently\n",
             ("tests/system/test_reliability.py::test_worker_death_redispatches",
              "tests/system/test_load.py::test_chaos_soak_short")),
    Mutation("digest_frames", "the client checks the digest of replies that arrive as frames",
             "spec_serve/client/integrity.py",
             "        self.stats.digest_checks += 1\n",
             "        self.stats.digest_checks += 1\n"
             "        if answer.plane is None and not answer.nccl:\n"
             "            return None  # MUTATION: frames counted, never compared\n",
             ("tests/client/test_integrity.py::test_corrupted_replies_are_retried_on_the_other_worker_and_never_returned"
              "[frames]",
              "tests/client/test_integrity.py::test_a_second_mismatch_fails_the_batch_with_a_clear_error[frames]")),
    Mutation("digest_4k", "the digest covers every byte of every tensor",
             "spec_serve/protocol/digest.py",
             "    data = data.view(torch.uint8)\n",
             "    data = data.view(torch.uint8)[:4096]  # MUTATION: first 4 KiB only\n",
             ("tests/client/test_integrity.py::test_corrupted_replies_are_retried_on_the_other_worker_and_never_returned",
              "tests/client/test_integrity.py::test_corrupted_nccl_reply_is_caught_and_resent_as_frames")),
    Mutation("packing_positions", "packed rows' position_ids restart at 0 for every row",
             "spec_serve/engines/packing.py",
             "            positions.extend(torch.arange(n) for n in lengths)",
             "            positions.append(torch.arange(sum(lengths)))  # MUTATION: positions run on across rows",
             ("tests/worker/test_packing.py::test_positions_restart_at_zero_for_every_row",)),
    Mutation("unknown_service_error", "the broker answers a request no worker took before its deadline",
             "spec_serve/broker/services.py",
             "                    self.ctx.send_error(client_id, request_id, ErrorCode.TIMEOUT,\n"
             "                                        f\"no worker of {service.name!r} took the request before its "
             "deadline\")",
             "                    pass  # MUTATION: the deadline passes in silence",
             ("tests/system/test_cluster.py::test_unknown_service_is_a_clear_error",)),
)


def scratch_copy(dest: Path) -> None:
    """The checkout's tracked files, as they are in the working tree."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def run(mutation: Mutation, python: str, timeout: float) -> tuple[str, float]:
    """("RED: ...", s) if every named test fails under the mutation (as it must), "GREEN: ..." naming those
    that passed, or why it did not run."""
    with tempfile.TemporaryDirectory(prefix=f"mutation-{mutation.name}-") as tmp:
        root = Path(tmp)
        scratch_copy(root)
        target = root / mutation.path
        text = target.read_text()
        if text.count(mutation.old) != 1:
            return f"NOT APPLIED: the text to mutate is not (once) in {mutation.path}", 0.0
        target.write_text(text.replace(mutation.old, mutation.new))
        # The copy comes first on sys.path, for pytest and for the workers it starts (python -m in its cwd).
        env = {**os.environ, "PYTHONPATH": str(root), "COLUMNS": "400"}  # pytest's summary lines whole
        start = time.monotonic()
        try:
            proc = subprocess.run([python, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *mutation.tests],
                                  cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return "NOT DECIDED: timed out", time.monotonic() - start
        seconds = time.monotonic() - start
        lines = proc.stdout.splitlines()
        passed = [line.split()[1] for line in lines if line.startswith("PASSED ")]
        failed = [line.split()[1] + ": " + line.split(" - ", 1)[-1][:200]
                  for line in lines if line.startswith(("FAILED tests/", "ERROR tests/"))]
        if passed or not failed:
            return "GREEN: not caught by " + ", ".join(passed or ["any test"]), seconds
        return "RED:\n    " + "\n    ".join(failed), seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", help="mutations to run (default: all)")
    p.add_argument("--list", action="store_true", help="list the mutations and their tests")
    p.add_argument("--python", default=sys.executable, help="the interpreter with the test dependencies")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per mutation")
    args = p.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.names or m.name in args.names]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.claim}\n  {m.path}\n  " + "\n  ".join(m.tests))
        return 0
    caught = 0
    for m in chosen:
        verdict, seconds = run(m, args.python, args.timeout)
        caught += verdict.startswith("RED")
        print(f"{m.name} ({m.claim}): {verdict} [{seconds:.0f}s]", flush=True)
    print(f"{caught} of {len(chosen)} mutations caught")
    return 0 if caught == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
