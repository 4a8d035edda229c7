"""The FP8 codec shared by the wire's ``wire_dtype="fp8"`` and the cache's FP8 storage."""

import importlib.util
from pathlib import Path

import pytest
import torch

from spec_serve.client.restore import restore_shards
from spec_serve.supervision import contract, fp8
from spec_serve.tools.null_engine import INFO

REPO = Path(__file__).resolve().parents[2]


def test_round_trip_is_within_e4m3s_rounding_per_element():
    x = torch.randn(3, 17, 64, dtype=torch.float32) * torch.logspace(-3, 3, 17).view(1, 17, 1)
    q, scale = fp8.quantize(x)
    assert q.dtype == fp8.FP8_DTYPE and scale.shape == (3, 17, 1) and scale.dtype == torch.float32
    back = fp8.dequantize(q, scale, torch.float32)
    # 3 mantissa bits: |err| <= 2**-4 |x| for normals, plus half a subnormal step (2**-10 x scale).
    bound = x.abs() * 2**-4 + scale * 2**-10
    assert bool(((back - x).abs() <= bound).all())
    assert fp8.relative_error(x) < 2**-4


def test_values_on_the_grid_and_zero_rows_come_back_exactly():
    x = torch.tensor([[0.0, 0.0, 0.0], [448.0, -2.0, 0.5]]).to(torch.bfloat16)
    back = fp8.dequantize(*fp8.quantize(x), torch.bfloat16)
    assert back.dtype == torch.bfloat16 and torch.equal(back, x)


def test_the_scale_is_per_token_so_a_swapped_scale_is_seen():
    x = torch.stack([torch.randn(32), 1000 * torch.randn(32)])
    q, scale = fp8.quantize(x)
    swapped = fp8.dequantize(q, scale.flip(0), torch.float32)
    assert (swapped - x).norm() / x.norm() > 0.5
    assert (fp8.dequantize(q, scale, torch.float32) - x).norm() / x.norm() < 2**-4


@pytest.mark.parametrize("bad", [torch.tensor([[1.0, float("nan")]]), torch.tensor([[float("inf"), 1.0]]),
                                 torch.ones(2, 2, dtype=torch.int64), torch.tensor(1.0)])
def test_what_no_scale_represents_is_refused(bad):
    with pytest.raises(ValueError, match="fp8"):
        fp8.quantize(bad)


def test_dequantize_checks_its_inputs():
    q, scale = fp8.quantize(torch.randn(2, 4))
    with pytest.raises(ValueError, match="scale"):
        fp8.dequantize(q, scale.view(2), torch.float32)
    with pytest.raises(ValueError, match="float8"):
        fp8.dequantize(q.float(), scale, torch.float32)


# ---------------------------------------------------------------- replies on the wire (wire_dtype="fp8")

def _layers(tokens: int = 5, hidden: int = 16) -> torch.Tensor:
    """Three captured layers side by side, of magnitudes 1e-2, 1 and 1e3 (real layers differ as much)."""
    return torch.cat([torch.randn(2, tokens, hidden) * m for m in (1e-2, 1.0, 1e3)], dim=-1).to(torch.bfloat16)


def test_each_captured_layer_of_a_token_gets_its_own_scale():
    x = _layers()
    q, scale = fp8.quantize_blocks(x, 16)
    assert q.shape == x.shape and q.dtype == fp8.FP8_DTYPE and scale.shape == (2, 5, 3)
    back = fp8.dequantize_blocks(q, scale, torch.bfloat16)
    for layer in range(3):  # the small layer is as exact as the large one: no scale shared across layers
        part = slice(16 * layer, 16 * (layer + 1))
        assert fp8.relative_error(x[..., part]) < 2**-4
        err = (back[..., part].double() - x[..., part].double()).norm() / x[..., part].double().norm()
        assert err < 2**-4, (layer, err)
    with pytest.raises(ValueError, match="blocks"):
        fp8.quantize_blocks(x, 10)
    with pytest.raises(ValueError, match="blocks"):
        fp8.dequantize_blocks(q, torch.ones(2, 5, 5), torch.bfloat16)  # 48 elements are not 5 blocks


def test_a_reply_quantizes_its_hidden_states_and_restores_them():
    """A compact reply: its aux hidden states go FP8; its final state, from which the client computes
    target_probs, and its argmax ids, computed by the worker, travel as they are."""
    reply = {"aux_hidden_states": _layers(), "last_hidden_states": torch.randn(2, 5, 16).bfloat16(),
             "argmax_ids": torch.arange(10, dtype=torch.int32).view(2, 5)}
    sent = fp8.quantize_reply(reply, contract.FP8_TENSORS, 16)
    assert list(sent) == ["aux_hidden_states", "aux_hidden_states_scale", "last_hidden_states", "argmax_ids"]
    assert sent["argmax_ids"] is reply["argmax_ids"] and sent["last_hidden_states"] is reply["last_hidden_states"]
    back = fp8.restore_reply(sent, torch.bfloat16)
    assert list(back) == list(reply) and back["argmax_ids"] is reply["argmax_ids"]
    assert back["last_hidden_states"] is reply["last_hidden_states"]
    name = "aux_hidden_states"
    assert back[name].dtype == torch.bfloat16 and not torch.equal(back[name], reply[name])
    assert torch.equal(back[name], fp8.dequantize_blocks(sent[name], sent[name + "_scale"], torch.bfloat16))


def test_fp8_specs_halve_the_input_hidden_state_bytes_at_the_8b_shape():
    info = INFO  # the null engine's: Llama-3.1-8B's shape
    for kind in (contract.Kind.EAGLE3_COMPACT, contract.Kind.DSPARK, contract.Kind.EAGLE3):
        specs = contract.reply_specs(kind, info, 2, 64, torch.int64, 32000)
        wire = contract.fp8_specs(specs, info.hidden_size)
        hidden = [n for n in specs if n in contract.FP8_TENSORS]
        before = contract.reply_bytes({n: specs[n] for n in hidden})
        after = contract.reply_bytes({n: w for n, w in wire.items() if n not in specs or n in hidden})
        assert after / before < 0.5 + 4 / info.hidden_size, kind  # 1 byte an element, plus a float32 per block
        assert {n: wire[n] for n in specs if n not in hidden} == {n: specs[n] for n in specs if n not in hidden}
        if kind == contract.Kind.EAGLE3_COMPACT:  # its final state in bf16: 20,512 of 32,788 bytes a token
            assert wire["last_hidden_states"] == specs["last_hidden_states"]
            assert contract.reply_bytes(wire) / contract.reply_bytes(specs) < 0.63
    expected = contract.Expected(specs, fp8_block=info.hidden_size)
    assert expected.for_reply(None, "fp8") == wire and expected.for_reply(None) == specs
    assert contract.Expected(specs).for_reply(None, "fp8") == {}  # FP8 nobody asked for breaks the contract


def test_a_batch_restores_fp8_shards_and_keeps_model_dtype_ones():
    """Shard 0 came FP8, shard 1 from a worker that cannot send it: each row as its shard sent it."""
    x = torch.randn(4, 3, 32).bfloat16()
    sent = fp8.quantize_reply({"aux_hidden_states": x[:2], "input_ids": torch.zeros(2, 3)},
                              contract.FP8_TENSORS, 16)
    fp8_part = {n: torch.cat([t, torch.zeros_like(t)]) for n, t in sent.items()}  # rows 2:4 not landed here
    plain_part = {"aux_hidden_states": x.clone(), "input_ids": torch.ones(4, 3)}
    forms = [("eagle3_compact", "fp8"), ("eagle3_compact", None)]
    out = restore_shards({forms[0]: fp8_part, forms[1]: plain_part}, forms, [(0, 2), (2, 2)], torch.bfloat16)
    got = out["eagle3_compact"]
    assert sorted(got) == ["aux_hidden_states", "input_ids"]
    assert torch.equal(got["aux_hidden_states"][:2], fp8.restore_reply(sent, torch.bfloat16)["aux_hidden_states"])
    assert torch.equal(got["aux_hidden_states"][2:], x[2:]) and torch.equal(got["input_ids"][2:], torch.ones(2, 3))


def test_the_stated_error_holds_on_a_real_forward(tiny_target_dir):
    """benchmarks/fp8_error.py on the tiny target: every element within e4m3's bound, per-tensor error near
    e4m3's rounding (docs/equality.md states the 8B shape's), and none of it from a scale shared by layers."""
    spec = importlib.util.spec_from_file_location("fp8_error", REPO / "benchmarks" / "fp8_error.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.run_engine(str(tiny_target_dir), "cpu", None, 4, 64)
    assert bench.within_bounds(result)
    for name in (*contract.FP8_TENSORS, "last_hidden_states"):
        assert 2**-6 < result[name]["rel_norm"] < 2**-4 / 3**0.5 and max(result[name]["layers"]) < 2**-4 / 3**0.5
