"""Compact EAGLE-3 through a real broker and worker: fewer bytes, the same tensors.

The worker ships aux + final hidden state + argmax (kind "eagle3_compact"); the client rebuilds
target_probs and position_mask from a draft-vocab lm_head slice it fetched once. Its result must
equal, bit for bit, ``expand_compact`` of the colocated HFTarget's compact output on the client's
device (the same function on the same inputs), and its position_mask must equal the full EAGLE-3
one exactly (the argmax is the target's own).
"""

from __future__ import annotations

import pytest
import torch

from spec_serve.client.api import RemoteTargetModel
from spec_serve.supervision.eagle3 import expand_compact, lm_head_slice
from spec_serve.tools.launch import local_cluster
from spec_serve.tools.tiny import sample_batch


def _nbytes(batch):
    return sum(t.numel() * t.element_size() for t in batch.values())


@pytest.fixture(scope="module")
def cluster(tiny_target_dir):
    with local_cluster(tiny_target_dir, workers=1) as c:
        yield c


def test_compact_remote_equals_colocated(cluster, tiny_target_dir, tiny_vocab_mapping, colocated_target):
    engine = colocated_target()
    ids_map, mask_map = tiny_vocab_mapping
    colocated_slice = lm_head_slice(engine.get_output_embeddings().weight, ids_map)
    with RemoteTargetModel(cluster.frontend, compact=True, num_shards=2, prefetch_depth=2, timeout=60) as remote, \
            RemoteTargetModel(cluster.frontend, timeout=60) as full_remote:
        remote.set_vocab_mapping(ids_map, mask_map)
        full_remote.set_vocab_mapping(ids_map, mask_map)
        assert torch.equal(remote.lm_head_slice(), colocated_slice)
        futures = []
        for seed in range(3):
            batch = sample_batch(tiny_target_dir, 4, 48, seed=seed)
            futures.append((batch, remote.generate_batch_async(*batch, kind="eagle3")))
        for batch, future in futures:
            got = future.result()
            want = expand_compact(engine.generate_batch(*batch, kind="eagle3_compact"), colocated_slice, mask_map)
            assert got.keys() == want.keys()
            for name in want:
                assert torch.equal(got[name], want[name]), name
            # Same contract as the anchor's full EAGLE-3 batch: exact mask and ids, probs to rounding.
            full = full_remote.generate_batch(*batch, kind="eagle3")
            assert torch.equal(got["position_mask"], full["position_mask"])
            assert torch.equal(got["aux_hidden_states"], full["aux_hidden_states"])
            torch.testing.assert_close(got["target_probs"], full["target_probs"], rtol=1e-4, atol=1e-6)
            # No next token at S-1: remote full, remote compact and colocated all give NeMo's softmax of zeros.
            uniform = torch.softmax(torch.zeros(len(ids_map)), dim=-1).expand(batch[0].shape[0], -1)
            colocated = engine.generate_batch(*batch, kind="eagle3")
            for probs in (got["target_probs"], full["target_probs"], colocated["target_probs"]):
                assert torch.equal(probs[:, -1], uniform)
        # Asking for the compact kind explicitly returns the raw compact tensors.
        batch = sample_batch(tiny_target_dir, 2, 32, seed=9)
        raw = remote.generate_batch(*batch, kind="eagle3_compact")
        want_raw = engine.generate_batch(*batch, kind="eagle3_compact")
        assert all(torch.equal(raw[k], want_raw[k]) for k in want_raw)
        wire_full = _nbytes(full_remote.generate_batch(*batch, kind="eagle3"))
        assert _nbytes(raw) < wire_full


def test_compact_needs_a_mapping(cluster, tiny_target_dir):
    with RemoteTargetModel(cluster.frontend, compact=True, timeout=30) as remote:
        batch = sample_batch(tiny_target_dir, 1, 8, seed=0)
        with pytest.raises(RuntimeError, match="set_vocab_mapping"):
            remote.generate_batch(*batch, kind="eagle3")
