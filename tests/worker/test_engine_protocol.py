"""Every engine, and RemoteTargetModel, has the surface of ``spec_serve.engines.base.TargetEngine``.

Class level: each engine class (HFTarget, VLLMTarget without vllm installed, SGLangTarget) and
RemoteTargetModel is a structural subclass of the Protocol, and every Protocol method has the
Protocol's parameters (names, kinds, defaults), so a caller written against the Protocol calls any
of them alike. Instance level: a real HFTarget, an SGLangTarget over the FAKE SGLang
(tests/fakes/fake_sglang.py) and a RemoteTargetModel pass ``isinstance``; and one batch of every
kind through a real broker and worker is bit-equal (``torch.equal``) to the colocated HFTarget's.
"""

from __future__ import annotations

import inspect
import sys

import pytest
import torch

from cluster_util import assert_equal_batches
from spec_serve.client import RemoteTargetModel
from spec_serve.engines import load_engine
from spec_serve.engines.base import PackingEngine, TargetEngine
from spec_serve.engines.hf import HFTarget
from spec_serve.engines.sglang import SGLangTarget
from spec_serve.engines.vllm import VLLMTarget
from spec_serve.supervision.contract import Kind
from spec_serve.tools.launch import local_cluster
from spec_serve.tools.tiny import sample_batch

ENGINE_CLASSES = [HFTarget, VLLMTarget, SGLangTarget]


def _methods(protocol: type) -> list[str]:
    """The public methods ``protocol`` itself declares (not those it inherits)."""
    return [name for name, value in vars(protocol).items() if not name.startswith("_") and inspect.isfunction(value)]


def _parameters(fn) -> list[tuple[str, inspect._ParameterKind, object]]:
    """What a caller sees of a method: each parameter's name, kind and default (annotations aside)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def _signature_drift(cls: type, protocol: type) -> dict[str, tuple]:
    """``{method: (cls's parameters, protocol's)}`` for each of ``protocol``'s methods ``cls`` spells otherwise."""
    drift = {}
    for name in _methods(protocol):
        ours, theirs = _parameters(getattr(cls, name)), _parameters(getattr(protocol, name))
        if ours != theirs:
            drift[name] = (ours, theirs)
    return drift


def test_the_protocols_name_what_the_worker_calls():
    assert set(_methods(TargetEngine)) == {"target_info", "set_vocab_mapping", "generate_batch",
                                           "get_input_embeddings", "get_output_embeddings", "close"}
    assert set(_methods(PackingEngine)) == {"generate_packed", "packing_unsupported"}


@pytest.mark.parametrize("cls", ENGINE_CLASSES + [RemoteTargetModel], ids=lambda c: c.__name__)
def test_every_engine_class_conforms(cls):
    assert issubclass(cls, TargetEngine)
    assert _signature_drift(cls, TargetEngine) == {}


def test_only_hf_packs_and_its_packing_conforms():
    """The worker serves --packing only from an engine with generate_packed (worker._check_packing)."""
    assert issubclass(HFTarget, PackingEngine)
    assert _signature_drift(HFTarget, PackingEngine) == {}
    for cls in (VLLMTarget, SGLangTarget, RemoteTargetModel):
        assert not issubclass(cls, PackingEngine), cls.__name__


def test_drift_is_caught():
    """The checks above fail for an engine whose surface drifted: a missing method, a changed default."""

    class Drifted(HFTarget):
        def generate_batch(self, input_ids, attention_mask, loss_mask, kind="dspark"):
            return {}

    class Missing:
        target_info = set_vocab_mapping = generate_batch = HFTarget.generate_batch
        get_input_embeddings = get_output_embeddings = HFTarget.get_input_embeddings

    assert set(_signature_drift(Drifted, TargetEngine)) == {"generate_batch"}
    assert not issubclass(Missing, TargetEngine)  # no close()


@pytest.fixture
def fake_sglang():
    from fakes import fake_sglang

    fake_sglang.install()
    yield sys.modules["sglang"]
    fake_sglang.uninstall()


def test_engine_instances_conform(fake_sglang, tiny_target_dir, colocated_target):
    hf = colocated_target()
    sg = load_engine("sglang", str(tiny_target_dir), device="cpu", dtype="float32")
    assert isinstance(hf, PackingEngine) and isinstance(hf, TargetEngine)
    assert isinstance(sg, TargetEngine) and not isinstance(sg, PackingEngine)
    assert hf.target_info().mismatches(sg.target_info(), ignore=("engine",)) == {}
    for engine in (hf, sg):
        engine.close()


@pytest.fixture(scope="module")
def cluster(tiny_target_dir):
    with local_cluster(tiny_target_dir, workers=1) as c:
        yield c


def test_remote_and_colocated_answer_alike_through_the_protocol(cluster, tiny_target_dir, tiny_vocab_mapping,
                                                                 colocated_target):
    """The same calls on a TargetEngine, colocated or remote, give bit-equal batches of every kind."""
    engines: list[TargetEngine] = [colocated_target(vocab_mapping=None),
                                   RemoteTargetModel(cluster.frontend, timeout=60)]
    try:
        for engine in engines:
            assert isinstance(engine, TargetEngine)
            engine.set_vocab_mapping(*tiny_vocab_mapping)
        colocated, remote = engines
        assert remote.target_info().mismatches(colocated.target_info()) == {}
        for name in ("get_input_embeddings", "get_output_embeddings"):
            assert torch.equal(getattr(remote, name)().weight, getattr(colocated, name)().weight), name
        batch = sample_batch(tiny_target_dir, 3, 40, seed=7)
        for kind in Kind:
            want = colocated.generate_batch(*batch, kind=kind.value)
            got = remote.generate_batch(*batch, kind=kind.value)
            assert tuple(got) == tuple(want), kind  # RESPONSE_TENSORS order, whichever engine answered
            assert_equal_batches(got, want)
    finally:
        for engine in engines:
            engine.close()
