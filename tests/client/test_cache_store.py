"""The supervision cache's parts without sockets: entries and their digest, the segment store (atomic
publish, a killed writer, two writers, eviction, corrupt entries, a full or read-only directory), row
spans and keys, and the fp8 codec's bound (docs/cache.md)."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from spec_serve.cache import admin, entry, rows
from spec_serve.cache.store import Store
from spec_serve.supervision.contract import Kind

KEY = bytes(range(16))


def _row(length: int = 5, hidden: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"aux_hidden_states": torch.randn(length, 3 * hidden, generator=gen).bfloat16(),
            "last_hidden_states": torch.randn(length, hidden, generator=gen).bfloat16(),
            "argmax_ids": torch.randint(0, 100, (length,), generator=gen, dtype=torch.int32)}


def _entry(key: bytes = KEY, seed: int = 0, length: int = 5) -> bytes:
    return entry.encode(key, "eagle3_compact", length, "native", _row(length, seed=seed))


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_an_entry_reads_back_bit_equal_and_any_damage_is_refused():
    data = _entry()
    got = entry.decode(data, KEY)
    assert (got.kind, got.tokens, got.codec) == ("eagle3_compact", 5, "native")
    for name, t in _row().items():
        assert torch.equal(got.tensors[name], t)
    for where in (10, 40, entry.ENTRY_HEAD.size + 20, len(data) - 3):  # key, digest, body header, tensor bytes
        flipped = bytearray(data)
        flipped[where] ^= 0x10
        with pytest.raises(entry.BadEntry):
            entry.decode(bytes(flipped), KEY)
    with pytest.raises(entry.BadEntry, match="torn"):
        entry.decode(data[:-7], KEY)
    with pytest.raises(entry.BadEntry, match="another key"):
        entry.decode(data, _key(99))


def test_entries_appear_to_other_processes_whole_once_published(tmp_path):
    writer = Store(tmp_path, seal_after_s=1e9)
    writer.put(KEY, _entry(), 5)
    assert writer.get(KEY) is not None  # its own rows, at once
    reader = Store(tmp_path)
    assert reader.get(KEY) is None and os.listdir(tmp_path / "segments") == []
    writer.publish()
    reader.refresh(force=True)
    assert torch.equal(reader.get(KEY).tensors["argmax_ids"], _row()["argmax_ids"])
    into = reader.get(KEY, alloc=lambda n: torch.empty(n, dtype=torch.uint8))  # as a GPU client reads (pinned)
    assert all(torch.equal(into.tensors[name], t) for name, t in _row().items())
    writer.close()
    reader.close()


def test_a_writer_killed_mid_write_leaves_no_entry(tmp_path):
    """A process SIGKILLed while appending rows (never published) leaves only a partial file nobody reads;
    ``cache prune`` removes it."""
    script = textwrap.dedent(f"""
        import sys, torch
        from spec_serve.cache import entry
        from spec_serve.cache.store import Store
        store = Store({str(tmp_path)!r}, seal_after_s=1e9)
        data = entry.encode(bytes(16), "dspark", 4096, "native",
                            {{"target_hidden_states": torch.zeros(4096, 512), "target_last_hidden_states":
                              torch.zeros(4096, 128)}})
        for i in range(100000):
            store.put(i.to_bytes(16, "little"), data, 4096)
            if i == 3:
                print("writing", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.stdout.readline().strip() == "writing"
    proc.kill()
    proc.wait()
    partials = list((tmp_path / "tmp").iterdir())
    assert len(partials) == 1 and partials[0].stat().st_size > 0
    reader = Store(tmp_path)
    assert len(reader) == 0 and reader.get(_key(0)) is None
    assert admin.verify(tmp_path) == {"checked": 0, "bad": []}
    assert admin.prune(tmp_path, None, partials_older_than=0)["removed_partials"] == [partials[0].name]
    reader.close()


def test_two_writers_of_one_row_are_harmless_and_readers_keep_the_first(tmp_path):
    first, second = Store(tmp_path), Store(tmp_path)
    first.put(KEY, _entry(seed=1), 5)
    second.put(KEY, _entry(seed=2), 5)  # the same key, captured again (another composition's low bits)
    first.publish()
    second.publish()
    assert len(os.listdir(tmp_path / "segments")) == 2
    for own, seed in ((first, 1), (second, 2)):  # each keeps the entry it wrote (and returned) first
        assert torch.equal(own.get(KEY).tensors["argmax_ids"], _row(seed=seed)["argmax_ids"])
    newcomer = Store(tmp_path)  # the earliest published
    assert torch.equal(newcomer.get(KEY).tensors["argmax_ids"], _row(seed=1)["argmax_ids"])
    assert admin.verify(tmp_path) == {"checked": 2, "bad": []}
    for s in (first, second, newcomer):
        s.close()


def test_max_bytes_evicts_whole_segments_oldest_first(tmp_path):
    one = len(_entry())
    store = Store(tmp_path, max_bytes=3 * one + 200, seal_after_s=0)  # each put publishes a segment of its own
    for i in range(6):
        store.put(_key(i), _entry(_key(i)), 5)
    names = sorted(os.listdir(tmp_path / "segments"))
    assert sum((tmp_path / "segments" / n).stat().st_size for n in names) <= 3 * one + 200
    assert [store.get(_key(i)) is not None for i in range(6)] == [False] * (6 - len(names)) + [True] * len(names)
    assert store.counts.evicted == 6 - len(names) >= 2
    store.close()


def test_a_corrupt_entry_is_never_returned_counted_and_logged_once(tmp_path, caplog):
    writer = Store(tmp_path)
    for i in range(3):
        writer.put(_key(i), _entry(_key(i)), 5)
    writer.close()
    segment = next((tmp_path / "segments").iterdir())
    data = bytearray(segment.read_bytes())
    for offset in (len(_entry()) - 5, 2 * len(_entry()) - 5):  # a byte of entries 0 and 1's tensors
        data[offset] ^= 0xFF
    segment.write_bytes(bytes(data))
    reader = Store(tmp_path)
    with caplog.at_level(logging.WARNING, logger="spec_serve.cache"):
        assert reader.get(_key(0)) is None and reader.get(_key(1)) is None
        assert reader.get(_key(2)) is not None
    assert reader.counts.corrupt == 2
    assert [r.message.split()[0] for r in caplog.records] == ["cache.corrupt_entry"]
    assert _key(0) not in reader  # forgotten: the row is fetched and stored again
    reader.put(_key(0), _entry(_key(0)), 5)
    assert reader.get(_key(0)) is not None
    assert len(admin.verify(tmp_path)["bad"]) == 2
    reader.close()


@contextlib.contextmanager
def _read_only(path: Path):
    """``path`` read-only: a read-only bind mount of itself as root (who writes through permissions), else
    permissions."""
    dirs = (path, *(path / n for n in ("segments", "tmp", "stats")))
    if os.geteuid() == 0:
        if subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True).returncode:
            pytest.skip("cannot bind-mount here")
        subprocess.run(["mount", "-o", "remount,ro,bind", str(path)], check=True)
    else:
        for d in dirs:
            d.chmod(0o555)
    try:
        yield
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(path)], check=True)
        else:
            for d in dirs:
                d.chmod(0o755)


def test_truncated_segments_and_foreign_entries_are_never_returned(tmp_path, caplog):
    writer = Store(tmp_path)
    writer.put(_key(1), _entry(_key(2)), 5)  # the entry of another key, filed under key 1: a foreign entry
    writer.put(_key(3), _entry(_key(3)), 5)
    writer.close()
    other = Store(tmp_path)
    other.put(_key(4), _entry(_key(4)), 5)
    other.close()
    first, second = sorted((tmp_path / "segments").iterdir())
    second.write_bytes(second.read_bytes()[:-10])  # truncated: its trailer is gone
    with caplog.at_level(logging.WARNING, logger="spec_serve.cache"):
        reader = Store(tmp_path)
        assert reader.get(_key(1)) is None and reader.get(_key(4)) is None
        assert reader.get(_key(3)) is not None
    assert reader.counts.corrupt == 2  # the foreign entry, the truncated segment
    assert [r.message.split()[0] for r in caplog.records] == ["cache.corrupt_segment"]  # once, of either
    bad = admin.verify(tmp_path)["bad"]
    assert len(bad) == 2 and "another key" in bad[0] and "bad trailer" in bad[1]
    reader.close()


def test_capture_batches_longest_rows_first_within_the_token_budget():
    from spec_serve.cache.capture import Progress, plan_batches

    lengths = [5, 40, 12, 40, 7, 100]
    batches = plan_batches(lengths, batch_tokens=80, max_rows=3)
    assert batches == [[5], [1, 3], [2, 4, 0]]  # 100 alone (over the budget), 2 x 40, 3 x 12
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    import io

    progress = Progress(1000, stream=io.StringIO(), every=0)
    progress.add(250)
    assert "250/1,000 tokens (25.0%)" in progress.stream.getvalue() and "tokens/s  ETA " in progress.line()


def test_a_read_only_directory_reads_on_and_warns_once(tmp_path, caplog):
    writer = Store(tmp_path)
    writer.put(KEY, _entry(), 5)
    writer.close()
    with _read_only(tmp_path), caplog.at_level(logging.WARNING, logger="spec_serve.cache"):
        reader = Store(tmp_path)
        reader.put(_key(1), _entry(_key(1)), 5)
        assert not reader.writable and reader.get(KEY) is not None  # a cache filled elsewhere, still read
        reader.close({"hits": 1})
    assert [r.message.split()[0] for r in caplog.records] == ["cache.write_disabled"]


def test_a_full_disk_turns_writing_off_with_one_warning(tmp_path, caplog, monkeypatch):
    """Simulated ENOSPC here (tests/system/test_cache.py fills a real small tmpfs through a client)."""
    store = Store(tmp_path, seal_after_s=1e9)
    store.put(_key(0), _entry(_key(0)), 5)
    real_write = os.writev

    def full(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "writev", full)
    with caplog.at_level(logging.WARNING, logger="spec_serve.cache"):
        for i in range(1, 5):
            store.put(_key(i), _entry(_key(i)), 5)  # never raises
    monkeypatch.setattr(os, "writev", real_write)
    assert not store.writable and len(store) == 0  # the partial file's rows went with it
    assert [r.message.split()[0] for r in caplog.records] == ["cache.write_disabled"]
    assert list((tmp_path / "tmp").iterdir()) == []
    store.close()


def test_row_spans_and_keys():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 1, 1, 1], [1, 0, 1, 0], [0, 0, 0, 0]])
    assert rows.row_spans(mask) == [3, 4, None, None, None]  # left padding, holes, empty: not cached
    info = _info()
    prefix = rows.key_prefix(info, Kind.EAGLE3_COMPACT, "native")
    ids = torch.tensor([5, 6, 7])
    assert rows.row_key(prefix, ids) == rows.row_key(prefix, ids.int())  # the ids, not their dtype
    others = [rows.key_prefix(info, Kind.DSPARK, "native"), rows.key_prefix(info, Kind.EAGLE3_COMPACT, "fp8"),
              rows.key_prefix(_info(fingerprint="other"), Kind.EAGLE3_COMPACT, "native"),
              rows.key_prefix(_info(aux_layer_ids=(1, 2, 4)), Kind.EAGLE3_COMPACT, "native")]
    keys = {rows.row_key(p, ids) for p in [prefix, *others]} | {rows.row_key(prefix, ids[:2])}
    assert len(keys) == 6


def _info(**kw):
    from spec_serve.supervision.target_info import TargetInfo

    fields = dict(num_hidden_layers=8, hidden_size=8, vocab_size=100, aux_layer_ids=(1, 3, 4),
                  dspark_layer_ids=(1, 3, 5), model_name="m", dtype="bfloat16", engine="hf", fingerprint="f")
    return TargetInfo(**{**fields, **kw})


def test_fp8_storage_is_within_the_codecs_bound_per_token_and_layer():
    row = _row(length=6, hidden=8)
    row["aux_hidden_states"][:, :8] *= 100  # one layer far larger than the others: scales are per layer
    stored = rows.encode_row(row, "fp8", hidden=8)
    assert stored["aux_hidden_states.fp8_scale"].shape == (6, 3)
    kept = entry.decode(entry.encode(KEY, "eagle3_compact", 6, "fp8", stored), KEY).tensors  # through an entry
    back = rows.decode_row(kept, torch.bfloat16, hidden=8)
    # the argmax, and the final state target_probs are computed from, as they were
    assert torch.equal(back["argmax_ids"], row["argmax_ids"])
    assert torch.equal(back["last_hidden_states"], row["last_hidden_states"])
    want = row["aux_hidden_states"].float().view(6, -1, 8)
    got = back["aux_hidden_states"].float().view(6, -1, 8)
    # e4m3 rounds to 3 mantissa bits: at most 2**-4 of a value, plus the bf16 rounding of the result
    bound = want.abs() * (2**-4 + 2**-8) + want.abs().amax(-1, keepdim=True) * 2**-9
    assert bool(((got - want).abs() <= bound).all())
    nbytes = sum(t.numel() * t.element_size() for t in stored.values())
    # aux: one byte an element and a float32 scale per token and layer (3 layers of H); the final state in
    # bf16; the argmax as it was
    assert nbytes == 6 * 3 * 8 + 3 * 6 * 4 + 6 * 8 * 2 + 4 * 6


def test_normalize_zeroes_past_each_span():
    batch = {name: torch.ones(2, 4, *t.shape[1:], dtype=t.dtype) for name, t in _row().items()}
    rows.normalize_rows(batch, [2, None])
    assert batch["aux_hidden_states"][0, 2:].abs().sum() == 0 and batch["aux_hidden_states"][0, :2].all()
    assert batch["argmax_ids"][0].tolist() == [1, 0, 0, 0]  # the last real position's next token is padding
    assert batch["argmax_ids"][1].tolist() == [1, 1, 1, 1]  # not cacheable: as it came


def test_cache_stats_counts_bytes_per_token(tmp_path):
    store = Store(tmp_path)
    for i in range(3):
        store.put(_key(i), _entry(_key(i), length=5), 5)
    store.close({"hits": 3, "misses": 1})
    figures = admin.stats(tmp_path)
    assert figures["entries"] == figures["rows"] == 3 and figures["segments"] == 1
    kinds = figures["kinds"]["eagle3_compact/native"]
    assert kinds["tokens"] == 15 and kinds["bytes_per_token"] == pytest.approx(len(_entry()) / 5)
    assert figures["clients"]["hit_rate"] == 0.75
    with pytest.raises(ValueError, match="not a spec-serve cache directory"):
        admin.stats(Path(tmp_path) / "segments")
