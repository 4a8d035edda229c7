"""The supervision cache through a real broker and workers (docs/cache.md, docs/equality.md "Cached rows"):
cached rows bit-equal to the rows as first captured, all-hit batches that send nothing, partial hits that
send only the missing rows and meet the composition tolerance against a fresh forward, several ranks on
one directory, a killed writer, a corrupted entry, a full disk, and ``spec-serve capture`` / ``cache``."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import textwrap

import pytest
import torch
from click.testing import CliRunner

import zygote
from cluster_util import wait_until
from spec_serve.cache.rows import decode_row, encode_row, normalize_rows, row_spans
from spec_serve.client.api import RemoteTargetModel
from spec_serve.supervision.eagle3 import expand_compact, lm_head_slice
from spec_serve.supervision.vocab import mask_from_selected
from spec_serve.tools.cli import main
from spec_serve.tools.launch import local_cluster
from spec_serve.tools.tiny import sample_batch
from spec_serve.tools.verify import colocated_reference, reference_logits, tolerance_for


@pytest.fixture(scope="module")
def cluster(tiny_target_dir):
    with local_cluster(tiny_target_dir, workers=2) as c:
        yield c


def _client(cluster, cache, mapping=None, **kw):
    client = RemoteTargetModel(cluster.frontend, cache=str(cache), timeout=60, **kw)
    if mapping is not None:
        client.set_vocab_mapping(*mapping)
    return client


def _recording(client) -> list[int]:
    """Rows of every request the cache sends from now on."""
    sent: list[int] = []
    send = client.cache.up.send

    def record(input_ids, *args):
        sent.append(input_ids.shape[0])
        return send(input_ids, *args)

    client.cache.up = dataclasses.replace(client.cache.up, send=record)
    return sent


def _normalized(engine, batch, kind: str = "eagle3_compact") -> dict:
    """The colocated forward of ``batch`` (its own composition), zero past each row's span."""
    want = {name: t.clone() for name, t in colocated_reference(engine, batch, kind).items()}
    normalize_rows(want, row_spans(batch[1]))
    return want


def test_cached_rows_are_bit_equal_and_all_hits_send_nothing(cluster, tmp_path, tiny_target_dir, tiny_vocab_mapping,
                                                            colocated_target):
    engine = colocated_target()
    batch = sample_batch(tiny_target_dir, 4, 32, seed=1)
    weight = lm_head_slice(engine.get_output_embeddings().weight, tiny_vocab_mapping[0])
    with _client(cluster, tmp_path, tiny_vocab_mapping, num_shards=2) as client:
        sent = _recording(client)
        first = client.generate_batch(*batch)  # every row missing: captured
        raw = client.generate_batch(*batch, kind="eagle3_compact")
        dspark = client.generate_batch(*batch, kind="dspark")
        assert sent == [4, 4]  # EAGLE-3 and its compact form share their rows; DSpark has its own
        again = client.generate_batch(*batch)
        assert sent == [4, 4], "a batch whose rows all hit sends no request"
        assert client.cache.stats.batches_all_hits == 2
        # The rank's demand (docs/sizing.md): a step per call, tokens asked only for the rows missing.
        assert client.stats.steps == 4 and client.stats.requested_tokens == 2 * int(batch[1].sum())
    for name in first:  # as first captured, bit for bit
        assert torch.equal(again[name], first[name]), name
    # The captured rows are the colocated forward of the same composition, zero past each row's span (as
    # packed replies), and EAGLE-3 is their expansion with the current mapping, as compact replies are.
    want = _normalized(engine, batch)
    for name in want:
        assert torch.equal(raw[name], want[name]), name
    expanded = expand_compact(want, weight, tiny_vocab_mapping[1])
    for name in expanded:
        assert torch.equal(first[name], expanded[name]), name
    dspark_want = _normalized(engine, batch, "dspark")
    for name in dspark_want:
        assert torch.equal(dspark[name], dspark_want[name]), name
    other_ids = torch.arange(100, 228)  # another draft vocab: the mapping is not in the key
    other = (other_ids, mask_from_selected(other_ids, 512))
    with _client(cluster, tmp_path, tiny_vocab_mapping) as reader:  # another client (process view) on the DIR
        sent = _recording(reader)
        later = reader.generate_batch(*batch)
        reader.set_vocab_mapping(*other)
        remapped = reader.generate_batch(*batch)
        assert sent == []
    for name in first:
        assert torch.equal(later[name], first[name]), name
    other_weight = lm_head_slice(engine.get_output_embeddings().weight, other_ids)
    for name, t in expand_compact(want, other_weight, other[1]).items():  # expanded with the new mapping
        assert torch.equal(remapped[name], t), name


@pytest.mark.parametrize("path", ["plane", "frames, 2 shards"])
def test_partial_hits_send_only_the_missing_rows_within_the_composition_tolerance(
        cluster, tmp_path, tiny_target_dir, tiny_vocab_mapping, colocated_target, path):
    engine = colocated_target()
    old = sample_batch(tiny_target_dir, 4, 32, seed=2)
    new = sample_batch(tiny_target_dir, 4, 32, seed=3)
    mixed = tuple(torch.cat([o[:2], n[:2]]) for o, n in zip(old, new))  # two cached rows, two new ones
    options = {} if path == "plane" else {"same_host_plane": False, "num_shards": 2}
    with _client(cluster, tmp_path, **options) as client:
        captured = client.generate_batch(*old, kind="eagle3_compact")
        sent = _recording(client)
        got = client.generate_batch(*mixed, kind="eagle3_compact")
        assert sent == [2], "only the missing rows are asked for"
    for name in ("aux_hidden_states", "last_hidden_states", "argmax_ids"):  # hit rows: as first captured
        assert torch.equal(got[name][:2], captured[name][:2]), name
    # Against a fresh forward of the mixed composition: within the tolerance docs/equality.md derives.
    fresh = _normalized(engine, mixed)
    assert tolerance_for(engine).violations(got, fresh, reference_logits(engine, mixed)) == []


def test_fp8_storage_reads_back_the_dequantized_capture(cluster, tmp_path, tiny_target_dir):
    batch = sample_batch(tiny_target_dir, 3, 24, seed=5)
    with _client(cluster, tmp_path, cache_dtype="fp8") as client:
        captured = client.generate_batch(*batch, kind="dspark")  # as the workers sent it
        client.cache.flush()
        sent = _recording(client)
        again = client.generate_batch(*batch, kind="dspark")
        assert sent == []
    hidden = again["target_last_hidden_states"].shape[-1]
    for name in ("target_hidden_states", "target_last_hidden_states"):
        rows = encode_row({name: captured[name]}, "fp8", hidden)
        assert rows[name].dtype == torch.uint8  # one byte an element on disk
        assert torch.equal(again[name], decode_row(rows, captured[name].dtype, hidden)[name]), name
    assert torch.equal(again["input_ids"], captured["input_ids"])


def test_a_corrupted_entry_is_refetched_counted_and_logged_once(cluster, tmp_path, tiny_target_dir, caplog,
                                                                 colocated_target):
    batch = sample_batch(tiny_target_dir, 3, 24, seed=4)
    with _client(cluster, tmp_path) as client:
        captured = client.generate_batch(*batch, kind="dspark")
    segment = next((tmp_path / "segments").iterdir())
    data = bytearray(segment.read_bytes())
    data[len(data) // 3] ^= 0x40  # a byte inside some entry's tensors
    segment.write_bytes(bytes(data))
    result = CliRunner().invoke(main, ["cache", "verify", str(tmp_path)])
    assert result.exit_code == 1 and "1 bad" in result.output, result.output
    with caplog.at_level(logging.WARNING, logger="spec_serve.cache"), _client(cluster, tmp_path) as client:
        sent = _recording(client)
        got = client.generate_batch(*batch, kind="dspark")
        assert sent == [1] and client.cache.store.counts.corrupt == 1
    assert [r.message.split()[0] for r in caplog.records] == ["cache.corrupt_entry"]
    # The row fetched again (alone, another composition) is within the tolerance; the rest as captured.
    assert tolerance_for(colocated_target()).violations(got, captured) == []
    assert CliRunner().invoke(main, ["cache", "verify", str(tmp_path)]).exit_code == 1  # the bad entry stays listed


@contextlib.contextmanager
def _small_tmpfs(path, size: str):
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs (tests/client/test_cache_store.py simulates ENOSPC)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_disk_degrades_to_no_cache_with_one_warning(cluster, tmp_path, tiny_target_dir, tiny_vocab_mapping,
                                                           caplog):
    with _small_tmpfs(tmp_path / "small", "256k") as small, \
            caplog.at_level(logging.WARNING, logger="spec_serve.cache"), \
            _client(cluster, small, tiny_vocab_mapping, prefetch_depth=2) as client:
        futures = [client.generate_batch_async(*sample_batch(tiny_target_dir, 4, 48, seed=s)) for s in range(6)]
        results = [f.result() for f in futures]  # training goes on
        client.cache.flush()
        assert not client.cache.store.writable
        assert all(r["target_probs"].shape == (4, 48, len(tiny_vocab_mapping[0])) for r in results)
    assert [r.message.split()[0] for r in caplog.records] == ["cache.write_disabled"]


WRITER = textwrap.dedent("""
    import sys, threading
    from spec_serve.client.api import RemoteTargetModel
    from spec_serve.tools.tiny import sample_batch
    broker, target, cache, seeds, kill = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5] == "1"
    client = RemoteTargetModel(broker, cache=cache, timeout=60, prefetch_depth=2)
    for seed in map(int, seeds.split(",")):
        client.generate_batch(*sample_batch(target, 3, 24, seed=seed), kind="dspark")
    if kill:
        client.cache.store.put(bytes(16), b"x" * 100000, 1)  # and more rows under way, never published
        print("written", flush=True)
        threading.Event().wait()  # until SIGKILL
    client.close()
    print("done", flush=True)
""")


def _rank(script, args, log):
    """A training rank: a process forked from the test zygote (it imported torch already)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "ab") as out:
        return zygote.popen([str(script), *args], env, out)


def test_several_ranks_share_one_directory_and_a_killed_writer_leaves_nothing(cluster, tmp_path, tiny_target_dir):
    script = tmp_path / "rank.py"
    script.write_text(WRITER)
    cache = tmp_path / "cache"
    common = [cluster.frontend, str(tiny_target_dir), str(cache)]
    ranks = [_rank(script, [*common, seeds, "0"], tmp_path / f"rank{n}.log")
             for n, seeds in enumerate(("10,11,12", "11,12,13"))]  # rows 11 and 12 written by both ranks at once
    victim = _rank(script, [*common, "20", "1"], tmp_path / "victim.log")
    for n, proc in enumerate(ranks):
        assert proc.wait(timeout=240) == 0, (tmp_path / f"rank{n}.log").read_text()[-2000:]
    wait_until(lambda: "written" in (tmp_path / "victim.log").read_text(), 240, what="the victim's rows")
    victim.kill()  # rows of seed 20 were never published
    victim.wait()
    with _client(cluster, cache) as client:
        sent = _recording(client)
        for seed in (10, 11, 12, 13):
            client.generate_batch(*sample_batch(tiny_target_dir, 3, 24, seed=seed), kind="dspark")
        assert sent == []
        client.generate_batch(*sample_batch(tiny_target_dir, 3, 24, seed=20), kind="dspark")
        assert sent == [3], "the killed writer's rows are nowhere"
    assert CliRunner().invoke(main, ["cache", "verify", str(cache)]).exit_code == 0
    assert len(list((cache / "tmp").glob("*.partial"))) == 1
    result = CliRunner().invoke(main, ["cache", "prune", str(cache), "--partials-older-than", "0"])
    assert "removed 1 partial files" in result.output, result.output


def test_capture_fills_the_cache_resumes_and_training_then_hits(cluster, tmp_path, tiny_target_dir,
                                                               tiny_vocab_mapping):
    batches = [sample_batch(tiny_target_dir, 4, 40, seed=s) for s in (30, 31)]
    data = tmp_path / "data.jsonl"
    with open(data, "w") as f:
        for ids, mask, _ in batches:
            for row, m in zip(ids, mask):
                f.write(json.dumps({"input_ids": row[m.bool()].tolist()}) + "\n")
    cache = tmp_path / "cache"
    with RemoteTargetModel(cluster.frontend) as probe:
        before = {w["id"]: w["completed"] for w in probe.status()["workers"]}
    args = ["capture", "--data", str(data), "--cache", str(cache), "--broker", cluster.frontend, "--batch-tokens", "64"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert (summary["captured"], summary["skipped"], summary["workers"]) == (8, 0, 2)
    assert summary["batches"] > 2  # several requests, spread over the workers
    with RemoteTargetModel(cluster.frontend) as probe:
        after = {w["id"]: w["completed"] for w in probe.status()["workers"]}
    assert all(after[w] > before[w] for w in before), (before, after)
    again = json.loads(CliRunner().invoke(main, args).output.strip().splitlines()[-1])
    assert (again["captured"], again["skipped"]) == (0, 8)  # resumed: nothing left to do
    with _client(cluster, cache, tiny_vocab_mapping) as client:
        sent = _recording(client)
        for batch in batches:
            client.generate_batch(*batch)
        assert sent == [] and client.cache.stats.hits == 8
    stats = json.loads(CliRunner().invoke(main, ["cache", "stats", str(cache), "--json"]).output)
    assert stats["rows"] == 8 and stats["clients"]["hits"] == 8
    assert stats["kinds"]["eagle3_compact/native"]["bytes_per_token"] > 0
    assert CliRunner().invoke(main, ["cache", "verify", str(cache)]).exit_code == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_client_reads_cached_rows_through_pinned_memory(cluster, tmp_path, tiny_target_dir, tiny_vocab_mapping):
    """A client on cuda:0 (the workers on the CPU): hits land through pinned buffers, new rows leave through
    pinned copies; epoch 2 equals epoch 1 bit for bit, and the stored rows equal a CPU client's."""
    batches = [sample_batch(tiny_target_dir, 4, 48, seed=s) for s in (40, 41)]
    results = {}
    for epoch in (1, 2):
        with _client(cluster, tmp_path, tiny_vocab_mapping, device="cuda:0", prefetch_depth=2) as client:
            futures = [client.generate_batch_async(*b, kind=kind) for b in batches for kind in ("eagle3", "dspark")]
            results[epoch] = [f.result() for f in futures]
            assert client.cache.stats.batches_all_hits == (4 if epoch == 2 else 0)
    for first, second in zip(results[1], results[2]):
        for name in first:
            assert first[name].device.type == "cuda" and torch.equal(first[name], second[name]), name
    with _client(cluster, tmp_path) as cpu:
        for got, batch in zip(results[2][1::2], batches):
            want = cpu.generate_batch(*batch, kind="dspark")
            assert all(torch.equal(got[name].cpu(), want[name]) for name in want)
