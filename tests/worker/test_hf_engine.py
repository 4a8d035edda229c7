"""HFTarget against a reference computed here from HF's own ``output_hidden_states`` forward.

The engine captures layers with hooks and computes logits itself; every contract tensor must be
bit-equal (``torch.equal``) to what the plain HF forward gives, shifted and selected by hand below.
"""

from __future__ import annotations

import pytest
import torch

from spec_serve.engines.hf import HFTarget
from spec_serve.supervision.contract import RESPONSE_TENSORS, Kind
from spec_serve.supervision.eagle3 import expand_compact, lm_head_slice
from spec_serve.tools.tiny import make_tiny_target, sample_batch

N, H, V = 8, 128, 512
# bf16 matmuls are slow on CPU: keep those batches tiny.
BATCH_SHAPE = {torch.float32: (4, 32), torch.bfloat16: (2, 16)}
CUSTOM_AUX = [0, 5, 7]  # includes the last layer, which means the post-norm state
CUSTOM_DSPARK = [-1, 0, 3, 7]  # includes the embedding output and the last layer


def reference(model, input_ids, attention_mask, loss_mask, aux_ids, dspark_ids, selected_ids, selected_mask):
    """The contract, written out directly on ``model(..., output_hidden_states=True)``."""
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    hs, logits = out.hidden_states, out.logits
    batch, seq = input_ids.shape

    def shifted(t):
        return torch.cat([t[:, 1:], torch.zeros_like(t[:, :1])], dim=1)

    next_logits = shifted(logits)
    probs = torch.softmax(next_logits.index_select(-1, selected_ids).float(), dim=-1)  # last: softmax of zeros
    position_mask = selected_mask[next_logits.argmax(-1)] & shifted(loss_mask).bool()
    position_mask[:, -1] = False
    return {
        Kind.EAGLE3: {
            "aux_hidden_states": torch.cat([hs[i + 1] for i in aux_ids], dim=-1),
            "target_probs": probs,
            "position_mask": position_mask.reshape(batch, seq, 1),
            "input_ids": shifted(input_ids),
            "loss_mask": shifted(loss_mask),
        },
        Kind.DSPARK: {
            "target_hidden_states": torch.cat([hs[i + 1] for i in dspark_ids], dim=-1),
            "target_last_hidden_states": hs[-1],
            "input_ids": input_ids,
            "loss_mask": loss_mask,
        },
    }


def check_contract(out, kind, batch, seq, model_dtype, vd, k):
    """Names, shapes and dtypes of one response, per the contract table."""
    assert tuple(out) == RESPONSE_TENSORS[kind]
    expected = {
        "aux_hidden_states": ((batch, seq, 3 * H), model_dtype),
        "target_probs": ((batch, seq, vd), torch.float32),
        "position_mask": ((batch, seq, 1), torch.bool),
        "last_hidden_states": ((batch, seq, H), model_dtype),
        "argmax_ids": ((batch, seq), torch.int32),
        "input_ids": ((batch, seq), torch.int64),
        "loss_mask": ((batch, seq), torch.int64),
        "target_hidden_states": ((batch, seq, k * H), model_dtype),
        "target_last_hidden_states": ((batch, seq, H), model_dtype),
    }
    for name, t in out.items():
        assert (tuple(t.shape), t.dtype) == expected[name], name
    if kind is not Kind.DSPARK:  # shifted: the last position carries nothing
        assert int(out["input_ids"][:, -1].abs().sum()) == 0 and int(out["loss_mask"][:, -1].abs().sum()) == 0


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def dtype(request):
    return request.param


@pytest.fixture(scope="module", params=["default_ids", "custom_ids"])
def engine(request, dtype, colocated_target):
    ids = {} if request.param == "default_ids" else {"aux_layer_ids": CUSTOM_AUX, "dspark_layer_ids": CUSTOM_DSPARK}
    return colocated_target(dtype=dtype, **ids)


@pytest.fixture(scope="module")
def batch(dtype, tiny_target_dir):
    b, s = BATCH_SHAPE[dtype]
    return sample_batch(tiny_target_dir, batch=b, seq=s, seed=7)


@pytest.fixture(scope="module")
def expected(engine, batch):
    return reference(engine.model, *batch, engine.aux_layer_ids, engine.dspark_layer_ids, *engine.vocab_mapping())


@pytest.mark.parametrize("kind", [Kind.EAGLE3, Kind.DSPARK])
def test_bit_equal_to_hf_reference(engine, batch, expected, dtype, kind):
    input_ids, attention_mask, loss_mask = batch
    assert attention_mask.sum(1).unique().numel() > 1, "rows of different lengths"
    out = engine.generate_batch(input_ids, attention_mask, loss_mask, kind=kind.value)
    k = len(engine.dspark_layer_ids)
    check_contract(out, kind, *input_ids.shape, dtype, len(engine.vocab_mapping()[0]), k)
    for name, ref in expected[kind].items():
        assert torch.equal(out[name], ref), name
    if kind is Kind.EAGLE3:
        assert bool(out["position_mask"].any()), "the batch should exercise position_mask"


def test_default_layer_ids(colocated_target):
    engine = colocated_target(vocab_mapping=None)
    assert engine.aux_layer_ids == [1, N // 2 - 1, N - 4]
    assert engine.dspark_layer_ids == [1, 2, 4, 6, 7]


def test_compact_expands_to_eagle3(engine, batch, dtype):
    selected_ids, selected_mask = engine.vocab_mapping()
    eagle3 = engine.generate_batch(*batch, kind="eagle3")
    compact = engine.generate_batch(*batch, kind="eagle3_compact")
    check_contract(compact, Kind.EAGLE3_COMPACT, *batch[0].shape, dtype, len(selected_ids), 0)
    head = lm_head_slice(engine.get_output_embeddings().weight, selected_ids)
    expanded = expand_compact(compact, head, selected_mask)
    check_contract(expanded, Kind.EAGLE3, *batch[0].shape, dtype, len(selected_ids), 0)
    for name in ("aux_hidden_states", "position_mask", "input_ids", "loss_mask"):
        assert torch.equal(expanded[name], eagle3[name]), name
    # The [Vd,H] GEMM may round differently from the engine's [V,H] one: up to about one ulp of a
    # logit, i.e. ~1e-7 relative in fp32 and 2^-8 in bf16, times a probability (<= 1).
    bound = 1e-6 if dtype == torch.float32 else 1e-2
    assert float((expanded["target_probs"] - eagle3["target_probs"]).abs().max()) <= bound
    assert torch.equal(expand_compact(compact, head, selected_mask)["target_probs"], expanded["target_probs"])


def test_last_position_is_the_softmax_of_zeros(engine, batch):
    """No next token at S-1: NeMo AutoModel's server returns the softmax of a zero row there, uniform
    1/Vd, not zeros. The engine and the compact expansion give exactly the float32 softmax of zeros."""
    selected_ids, selected_mask = engine.vocab_mapping()
    uniform = torch.softmax(torch.zeros(len(selected_ids)), dim=-1)
    assert float(uniform[0]) == pytest.approx(1 / len(selected_ids), rel=1e-7)
    head = lm_head_slice(engine.get_output_embeddings().weight, selected_ids)
    expanded = expand_compact(engine.generate_batch(*batch, kind="eagle3_compact"), head, selected_mask)
    for out in (engine.generate_batch(*batch, kind="eagle3"), expanded):
        assert torch.equal(out["target_probs"][:, -1], uniform.expand(batch[0].shape[0], -1))
        assert not out["position_mask"][:, -1].any()


def test_compact_and_dspark_need_no_vocab_mapping(colocated_target, tiny_target_dir):
    engine = colocated_target(vocab_mapping=None)
    batch = sample_batch(tiny_target_dir, batch=2, seq=8, seed=1)
    assert engine.vocab_mapping() is None
    with pytest.raises(RuntimeError, match="set_vocab_mapping"):
        engine.generate_batch(*batch, kind="eagle3")
    engine.generate_batch(*batch, kind="eagle3_compact")
    engine.generate_batch(*batch, kind="dspark")


def test_request_dtypes(colocated_target, tiny_target_dir):
    """int32 / bool requests work: input_ids come back int64, loss_mask in the dtype it was sent."""
    engine = colocated_target()
    input_ids, attention_mask, loss_mask = sample_batch(tiny_target_dir, batch=2, seq=8, seed=1)
    ref = engine.generate_batch(input_ids, attention_mask, loss_mask)
    out = engine.generate_batch(input_ids.int(), attention_mask.bool(), loss_mask.bool())
    assert out["input_ids"].dtype == torch.int64 and out["loss_mask"].dtype == torch.bool
    assert torch.equal(out["target_probs"], ref["target_probs"])
    assert torch.equal(out["position_mask"], ref["position_mask"])
    assert torch.equal(out["loss_mask"], ref["loss_mask"].bool())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"aux_layer_ids": [1, 2, 8]}, "out of range"),
        ({"aux_layer_ids": [-1, 2, 3]}, "out of range"),
        ({"aux_layer_ids": [1, 1, 3]}, "distinct"),
        ({"aux_layer_ids": [1, 2]}, "exactly 3"),
        ({"aux_layer_ids": [1, 2, 3, 4]}, "exactly 3"),
        ({"dspark_layer_ids": [1, 3, 2]}, "strictly increasing"),
        ({"dspark_layer_ids": [2, 2]}, "strictly increasing"),
        ({"dspark_layer_ids": [-2, 3]}, "out of range"),
        ({"dspark_layer_ids": [0, 8]}, "out of range"),
        ({"dspark_layer_ids": []}, "at least one"),
    ],
)
def test_bad_layer_ids(tiny_target_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        HFTarget(tiny_target_dir, **kwargs)


def test_bad_requests(colocated_target, tiny_target_dir):
    engine = colocated_target()
    input_ids, attention_mask, loss_mask = sample_batch(tiny_target_dir, batch=2, seq=8, seed=1)
    too_big = input_ids.clone()
    too_big[1, 3] = V
    negative = input_ids.clone()
    negative[0, 0] = -1
    bad = [
        ((too_big, attention_mask, loss_mask), "token ids"),
        ((negative, attention_mask, loss_mask), "token ids"),
        ((input_ids, attention_mask[:, :-1], loss_mask), "shape"),
        ((input_ids, attention_mask, loss_mask[:1]), "shape"),
        ((input_ids[0], attention_mask[0], loss_mask[0]), r"\[batch, seq\]"),
        ((input_ids.float(), attention_mask, loss_mask), "integer"),
    ]
    for kind in ("eagle3", "dspark", "eagle3_compact"):
        for args, match in bad:
            with pytest.raises(ValueError, match=match):
                engine.generate_batch(*args, kind=kind)
    with pytest.raises(ValueError, match="unknown kind"):
        engine.generate_batch(input_ids, attention_mask, loss_mask, kind="medusa")


def test_vocab_mapping_validation(colocated_target, tiny_vocab_mapping):
    engine = colocated_target(vocab_mapping=None)
    ids, mask = tiny_vocab_mapping
    other_mask = mask.clone()
    other_mask[ids[0]] = False
    other_mask[(~mask).nonzero()[0]] = True
    bad = [
        (torch.cat([ids[:-1], ids[:1]]), mask, "distinct"),
        (ids.float(), mask, "int64"),
        (ids.int(), mask, "int64"),
        (ids.reshape(2, -1), mask, "1-D"),
        (ids[:0], mask, "non-empty"),
        (torch.cat([ids[:-1], torch.tensor([V])]), mask, "lie in"),
        (ids, mask[:-1], "entries"),
        (ids, mask.long(), "bool"),
        (ids[:-1], mask, "exactly"),
        (ids, other_mask, "exactly"),
    ]
    for bad_ids, bad_mask, match in bad:
        with pytest.raises(ValueError, match=match):
            engine.set_vocab_mapping(bad_ids, bad_mask)
        assert engine.vocab_mapping() is None
    engine.set_vocab_mapping(ids, mask)
    got_ids, got_mask = engine.vocab_mapping()
    assert torch.equal(got_ids, ids) and torch.equal(got_mask, mask)


def test_target_info_and_fingerprint(colocated_target, tiny_target_dir, tmp_path):
    engine = colocated_target(aux_layer_ids=CUSTOM_AUX, dspark_layer_ids=CUSTOM_DSPARK)
    info = engine.target_info()
    assert (info.num_hidden_layers, info.hidden_size, info.vocab_size) == (N, H, V)
    assert info.aux_layer_ids == tuple(CUSTOM_AUX) and info.dspark_layer_ids == tuple(CUSTOM_DSPARK)
    assert (info.model_name, info.dtype, info.engine) == ("tiny-llama", "float32", "hf")
    assert len(info.fingerprint) == 32 and int(info.fingerprint, 16) >= 0
    bf16 = colocated_target(dtype="bfloat16", model_name="renamed").target_info()
    assert (bf16.model_name, bf16.dtype, bf16.fingerprint) == ("renamed", "bfloat16", info.fingerprint)
    # Same weights elsewhere: same fingerprint; another seed: a different one.
    assert HFTarget(make_tiny_target(tmp_path / "copy")).target_info().fingerprint == info.fingerprint
    assert HFTarget(make_tiny_target(tmp_path / "seed1", seed=1)).target_info().fingerprint != info.fingerprint


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_embeddings(tmp_path, tied):
    engine = HFTarget(make_tiny_target(tmp_path / "t", tie_word_embeddings=tied))
    embed, head = engine.get_input_embeddings().weight, engine.get_output_embeddings().weight
    assert embed.shape == head.shape == (V, H)
    assert (head.data_ptr() == embed.data_ptr()) == tied
    assert not embed.requires_grad and not head.requires_grad
