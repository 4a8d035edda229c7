"""One hf target spread over several devices (``--device cuda:0,cuda:1``).

On CPU: device-list parsing, the balanced layer split, where each module lands (cpu + meta as two
distinguishable devices), and the full path ("cpu,cpu": the hooks that move activations between
devices run) bit-equal to the one-device forward, in-process and through a real worker. On two
GPUs (``-m gpu``): the same comparison with the layers really split over cuda:0 and cuda:1; every
module runs the same kernels on the same kind of GPU and only exact copies are added, so the
contract is asserted bit-equal (torch.equal), not within a tolerance.
"""

from __future__ import annotations

import pytest
import torch

from cluster_util import CLIENT_KW, FAST_ENV, assert_equal_batches
from spec_serve.engines.hf import HFTarget, layer_devices, parse_devices, spread_model
from spec_serve.supervision.contract import Kind
from spec_serve.tools.tiny import make_tiny_target, sample_batch

CPU, META = torch.device("cpu"), torch.device("meta")


def test_parse_devices():
    assert parse_devices("cuda:0,cuda:1") == [torch.device("cuda:0"), torch.device("cuda:1")]
    assert parse_devices(" cpu ") == [CPU] and parse_devices(CPU) == [CPU]
    assert parse_devices(["cuda:1", torch.device("cuda:0")]) == [torch.device("cuda:1"), torch.device("cuda:0")]
    with pytest.raises(ValueError, match="one type"):
        parse_devices("cpu,cuda:0")
    with pytest.raises(ValueError, match="no device"):
        parse_devices(" , ")


def test_layer_split_is_balanced_and_in_order():
    a, b, c = (torch.device(f"cuda:{i}") for i in range(3))
    assert layer_devices(8, [a, b, c]) == [a, a, a, b, b, b, c, c]
    assert layer_devices(2, [a, b]) == [a, b]
    with pytest.raises(ValueError, match="cannot be spread"):
        layer_devices(1, [a, b])


@pytest.mark.parametrize("tied", [False, True])
def test_modules_land_where_the_split_says(tmp_path, tied):
    from transformers import AutoModelForCausalLM

    path = make_tiny_target(tmp_path / "t", layers=5, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_pretrained(str(path))
    spread_model(model, [CPU, META])
    base = model.base_model
    assert base.embed_tokens.weight.device == CPU
    assert [layer.self_attn.q_proj.weight.device for layer in base.layers] == [CPU, CPU, CPU, META, META]
    assert base.norm.weight.device == META and model.get_output_embeddings().weight.device == META


@pytest.fixture(scope="module")
def spread_pair(tiny_target_dir, tiny_vocab_mapping):
    one = HFTarget(tiny_target_dir)
    spread = HFTarget(tiny_target_dir, device="cpu,cpu,cpu")
    for engine in (one, spread):
        engine.set_vocab_mapping(*tiny_vocab_mapping)
    return one, spread


@pytest.mark.parametrize("kind", [k.value for k in Kind])
def test_spread_over_cpus_is_bit_equal_to_one_device(spread_pair, tiny_target_dir, kind):
    one, spread = spread_pair
    assert len(spread.devices) == 3
    batch = sample_batch(tiny_target_dir, 3, 24, seed=5)
    assert_equal_batches(spread.generate_batch(*batch, kind=kind), one.generate_batch(*batch, kind=kind))
    assert torch.equal(spread.get_output_embeddings().weight, one.get_output_embeddings().weight)
    assert spread.target_info() == one.target_info()


def test_worker_serves_a_spread_target(tiny_target_dir, tiny_vocab_mapping, spread_pair):
    from spec_serve.client.api import RemoteTargetModel
    from spec_serve.tools.launch import local_cluster

    one, _ = spread_pair
    batch = sample_batch(tiny_target_dir, 2, 16, seed=9)
    with local_cluster(tiny_target_dir, workers=1, worker_args=["--device", "cpu,cpu"], env=FAST_ENV) as cluster:
        with RemoteTargetModel(cluster.frontend, timeout=60, **CLIENT_KW) as client:
            client.set_vocab_mapping(*tiny_vocab_mapping)
            assert_equal_batches(client.generate_batch(*batch), one.generate_batch(*batch))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_spread_over_two_gpus_is_bit_equal_to_one_gpu(tmp_path, tiny_vocab_mapping, dtype):
    # A deeper, wider tiny target than the default, so real GEMMs run on both GPUs.
    path = make_tiny_target(tmp_path / "t", layers=12, hidden=512, vocab=512)
    one = HFTarget(path, device="cuda:0", dtype=dtype)
    spread = HFTarget(path, device="cuda:0,cuda:1", dtype=dtype)
    assert {p.device for p in spread.model.base_model.layers.parameters()} == {torch.device("cuda:0"),
                                                                              torch.device("cuda:1")}
    for engine in (one, spread):
        engine.set_vocab_mapping(*tiny_vocab_mapping)
    for seed in range(3):
        batch = sample_batch(path, 4, 128, seed=seed)
        for kind in Kind:
            got, want = spread.generate_batch(*batch, kind=kind), one.generate_batch(*batch, kind=kind)
            assert {t.device for t in got.values()} == {torch.device("cuda:1")}
            assert_equal_batches(got, want)
