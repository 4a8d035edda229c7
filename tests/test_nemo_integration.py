"""spec_serve.integrations.nemo: NeMo AutoModel's remote-target interface over a real cluster.

A broker and two hf workers run as processes on loopback; the recipe side is a stand-in of
NeMo's (tests/fakes/nemo_standin.py) and, where nemo_automodel is installed, NeMo's own
``TrainEagle3Recipe`` methods. Every batch is compared with the colocated forward (torch.equal).
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from cluster_util import CLIENT_KW, FAST_ENV
from fakes import nemo_standin
from spec_serve.integrations.nemo import Eagle3Batch, SpecServeEagle3Target, batch_class, broker_url
from spec_serve.tools.launch import local_cluster
from spec_serve.tools.tiny import sample_batch

SUPERVISION = ("aux_hidden_states", "target_probs", "position_mask", "input_ids", "loss_mask")


@pytest.fixture(scope="module")
def cluster(tiny_target_dir):
    with local_cluster(tiny_target_dir, workers=2, env=FAST_ENV) as c:
        yield c


@pytest.fixture(scope="module")
def colocated(tiny_target_dir, tiny_vocab_mapping):
    from spec_serve.engines.hf import HFTarget

    engine = HFTarget(tiny_target_dir)
    engine.set_vocab_mapping(*tiny_vocab_mapping)
    return engine


def _batches(target_dir, n=4):
    return [dict(zip(("input_ids", "attention_mask", "loss_mask"), sample_batch(target_dir, 3, 20, seed=s)))
            for s in range(n)]


def _assert_matches_colocated(target_batch, batch, colocated):
    want = colocated.generate_batch(batch["input_ids"], batch["attention_mask"], batch["loss_mask"])
    for name in SUPERVISION:
        got = getattr(target_batch, name)
        assert got.dtype == want[name].dtype and torch.equal(got, want[name]), name
    assert torch.equal(target_batch.attention_mask, batch["attention_mask"])  # as sent, unshifted
    assert target_batch.logits is None


def test_standin_recipe_trains_on_colocated_equal_batches(cluster, tiny_target_dir, tiny_vocab_mapping, colocated):
    target = nemo_standin.build_backend(SpecServeEagle3Target, {"remote_urls": [cluster.frontend]}, "cpu")
    try:
        assert target.supports_async and target.num_remote_servers == 2
        target.set_vocab_mapping(*tiny_vocab_mapping)
        depth = nemo_standin.resolve_prefetch_depth(target, 4)
        assert depth == 2  # capped at the workers serving the service, as NeMo caps at its servers
        batches = _batches(tiny_target_dir)
        seen = 0
        for batch, target_batch in nemo_standin.prefetched_batches(target, batches, depth):
            assert batch is batches[seen]  # submission order
            if importlib.util.find_spec("nemo_automodel") is None:
                assert isinstance(target_batch, Eagle3Batch)
            inputs = nemo_standin.trainer_step(target_batch)
            assert set(inputs) == {"input_ids", "attention_mask", "loss_mask", "aux_hidden_states", "target_probs",
                                   "position_mask"}
            _assert_matches_colocated(target_batch, batch, colocated)
            seen += 1
        assert seen == len(batches)
    finally:
        target.close()


def test_model_info_and_embeddings_as_nemo_reads_them(cluster, colocated):
    target = SpecServeEagle3Target.from_urls([cluster.frontend], device="cpu", timeout=60)
    try:
        info = target.model_info()
        want = colocated.target_info()
        assert {k: info[k] for k in ("num_hidden_layers", "hidden_size", "vocab_size")} == \
            {"num_hidden_layers": want.num_hidden_layers, "hidden_size": want.hidden_size,
             "vocab_size": want.vocab_size}
        assert info["aux_layer_ids"] == list(want.aux_layer_ids) and info["fingerprint"] == want.fingerprint
        weight = target.get_input_embeddings().weight
        assert torch.equal(weight, colocated.get_input_embeddings().weight)
        assert target.get_input_embeddings() is target.get_input_embeddings()  # fetched once
    finally:
        target.close()


def test_packed_sequences_are_refused_with_the_fix(cluster, tiny_target_dir, tiny_vocab_mapping):
    target = SpecServeEagle3Target(cluster.frontend, device="cpu", **CLIENT_KW)
    try:
        target.set_vocab_mapping(*tiny_vocab_mapping)
        ids, attn, loss = sample_batch(tiny_target_dir, 1, 8, seed=0)
        with pytest.raises(NotImplementedError, match="packed_sequence_size: 0"):
            target.generate_batch(ids, attn, loss, seq_lens=torch.tensor([[4, 4]]))
    finally:
        target.close()


@pytest.mark.parametrize("urls, message", [
    (["http://server:8001"], "HTTP URL"),
    (["tcp://a:5555", "tcp://b:5555"], "one broker"),
    ([], "one broker"),
])
def test_nemo_style_urls_get_a_hint(urls, message):
    with pytest.raises(ValueError, match=message):
        broker_url(urls)
    assert broker_url(["tcp://a:5555", "tcp://a:5555"]) == "tcp://a:5555"


def test_batch_class_is_nemos_when_installed():
    if importlib.util.find_spec("nemo_automodel") is None:
        assert batch_class() is Eagle3Batch
    else:
        from nemo_automodel.components.speculative.eagle.target import Eagle3TargetBatch

        assert batch_class() is Eagle3TargetBatch


class _RecordingTrainer:
    """Takes the place of NeMo's trainer module: records what the recipe feeds it."""

    def __init__(self):
        self.calls = []

    def __call__(self, **inputs):
        self.calls.append(inputs)
        return SimpleNamespace(loss=torch.tensor(0.0))


def test_nemo_recipe_step_with_spec_serve_backend(cluster, tiny_target_dir, tiny_vocab_mapping, colocated):
    """NeMo's own TrainEagle3Recipe setup, prefetch loop and forward step, with the adapter patched in."""
    recipe_module = pytest.importorskip("nemo_automodel.recipes.llm.train_eagle3")
    from nemo_automodel.components.speculative.eagle.target import Eagle3TargetBatch

    from spec_serve.integrations.nemo import patch_recipe

    previous = patch_recipe()
    recipe = recipe_module.TrainEagle3Recipe.__new__(recipe_module.TrainEagle3Recipe)
    try:
        recipe.device = torch.device("cpu")
        recipe.dist_env = SimpleNamespace(is_main=True, world_size=1)
        recipe._setup_remote_target({"remote_urls": [cluster.frontend], "remote_timeout": 60})
        assert isinstance(recipe.target_wrapper, SpecServeEagle3Target)
        recipe.target_wrapper.set_vocab_mapping(*tiny_vocab_mapping)
        recipe.target_prefetch_depth = recipe._resolve_prefetch_depth({"target_prefetch_depth": 4})
        assert recipe.target_prefetch_depth == 2
        recipe.trainer_module = _RecordingTrainer()
        batches = _batches(tiny_target_dir)
        for i, (batch, target_batch) in enumerate(recipe._prefetched_batches(batches)):
            assert batch is batches[i] and isinstance(target_batch, Eagle3TargetBatch)
            recipe._forward_batch(batch, target_batch)
            fed = recipe.trainer_module.calls[-1]
            _assert_matches_colocated(SimpleNamespace(**fed, logits=None), batch, colocated)
        assert len(recipe.trainer_module.calls) == len(batches)
    finally:
        recipe_module.RemoteEagle3TargetModel = previous
        if getattr(recipe, "target_wrapper", None) is not None:
            recipe.target_wrapper.close()
