"""The reply digest (spec_serve/protocol/digest.py) and the client's check hook in ``assembly.assemble``.

tests/client/test_integrity.py runs the whole path with real processes; these pin down the digest itself
(against a plain numpy reference, on odd sizes and unaligned views), what it cannot catch, the
verify modes, and that a retried shard lands on its own rows.
"""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
import torch

from spec_serve.client.assembly import assemble
from spec_serve.client.received import Received
from spec_serve.protocol import digest, wire


def reference_digest(t: torch.Tensor) -> int:
    """Sum of the little-endian uint32 words of ``t``'s bytes (zero-padded), modulo 2**32."""
    raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    raw += b"\0" * (-len(raw) % 4)
    return int(np.frombuffer(raw, dtype="<u4").astype(np.uint64).sum() % (1 << 32))


CASES = {
    "bf16": torch.randn(3, 5, 7).to(torch.bfloat16),
    "f32": torch.randn(4, 33),
    "bool_odd": torch.rand(5, 7) > 0.5,
    "bool_unaligned_rows": (torch.rand(6, 5) > 0.5)[1:4],
    "uint8_unaligned": torch.arange(11, dtype=torch.uint8)[1:],
    "int64_big": torch.randint(-(2**62), 2**62, (9, 3)),
    "non_contiguous": torch.randn(6, 8).t(),
    "empty": torch.empty(0, 4),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_digest_matches_the_word_sum(name):
    t = CASES[name]
    assert digest.digests([{"t": t}]) == [{"t": reference_digest(t)}]


def test_digest_wraps_modulo_2_32():
    words = torch.tensor([2**31 - 1, 2**31 - 1, 3], dtype=torch.int32)
    assert digest.digests([{"w": words}])[0]["w"] == (2 * (2**31 - 1) + 3) % 2**32


def test_one_flipped_bit_or_another_buffer_changes_it():
    t = torch.randn(4, 64, 96).to(torch.bfloat16)
    before = digest.digests([{"t": t}])[0]["t"]
    flipped = t.clone()
    flipped.view(-1).view(torch.uint8)[12345] ^= 0x10
    assert digest.digests([{"t": flipped}])[0]["t"] != before
    assert digest.digests([{"t": torch.randn(4, 64, 96).to(torch.bfloat16)}])[0]["t"] != before


def test_what_it_cannot_catch_words_in_another_order():
    """Documented limit: a permutation of whole words (here two rows swapped) keeps the sum."""
    t = torch.randn(4, 8)
    assert digest.digests([{"t": t}]) == digest.digests([{"t": t[[1, 0, 2, 3]]}])


def test_mismatches_names_tensors_that_differ_or_are_missing():
    landed = {"a": torch.ones(3), "b": torch.zeros(2)}
    sums = digest.digests([landed])[0]
    assert digest.mismatches(sums, landed) == []
    assert digest.mismatches({**sums, "a": sums["a"] + 1}, landed) == ["a"]
    assert digest.mismatches({"a": sums["a"]}, landed) == ["b"]
    assert digest.mismatches(None, landed) == ["a", "b"]  # a reply without digests is never accepted


def test_verify_modes_and_sampling(monkeypatch):
    monkeypatch.delenv(digest.VERIFY_ENV, raising=False)
    assert digest.parse_verify(None) == "all"
    monkeypatch.setenv(digest.VERIFY_ENV, "off")
    assert digest.parse_verify(None) == "off" and digest.parse_verify("sampled") == "sampled"
    with pytest.raises(ValueError, match="all, sampled, off"):
        digest.parse_verify("most")
    sampler = digest.Sampler("sampled")
    assert [i for i in range(3 * digest.SAMPLE_EVERY) if sampler.wants()] == [0, 8, 16]
    assert all(digest.Sampler("all").wants() for _ in range(5))
    assert not any(digest.Sampler("off").wants() for _ in range(5))


def _reply(tensors: dict[str, torch.Tensor]) -> Received:
    return Received(b"", {}, wire.parse(wire.encode(tensors))[0])


def test_a_retried_shard_lands_on_its_own_rows():
    """check() returns a retry future for shard 1's first reply; the batch waits for it and holds its rows."""
    good = [{"x": torch.full((2, 3), float(k))} for k in range(2)]
    bad = {"x": torch.full((2, 3), -1.0)}
    first = [concurrent.futures.Future() for _ in good]
    retry: concurrent.futures.Future = concurrent.futures.Future()
    seen = []

    def check(k, reply, landed):
        seen.append((k, landed["x"].clone()))
        if k == 1 and len(seen) <= 2:
            return retry
        return None

    out = assemble(first, [2, 2], torch.device("cpu"), None, check)
    first[1].set_result(_reply(bad))
    first[0].set_result(_reply(good[0]))
    assert not out.done()
    retry.set_result(_reply(good[1]))
    got = out.result(timeout=5)["x"]
    assert torch.equal(got, torch.cat([good[0]["x"], good[1]["x"]]))
    assert [k for k, _ in seen] == [1, 0, 1] and torch.equal(seen[0][1], bad["x"])


def test_a_check_that_raises_fails_the_batch():
    future: concurrent.futures.Future = concurrent.futures.Future()

    def check(k, reply, landed):
        raise RuntimeError("second mismatch")

    out = assemble([future], [1], torch.device("cpu"), None, check)
    future.set_result(_reply({"x": torch.ones(1, 2)}))
    with pytest.raises(RuntimeError, match="second mismatch"):
        out.result(timeout=5)
