"""The SGLang engine against a FAKE SGLang (tests/fakes/fake_sglang.py), plus engine-import hygiene.

The fake runs the checkpoint's HF model behind SGLang's capture conventions, so these tests check
what spec-serve adds: the layer-id mapping (contract id i -> SGLang's i+1, -1 and N-1 handled here),
per-row requests for right-padded batches, and the contract's shapes, dtypes and values against
HFTarget: hidden states bit-equal to its forward of each row alone (SGLang's composition), everything
within the derived tolerance of its padded batch. The real-SGLang test runs only where sglang imports
and CUDA is present.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from spec_serve.engines import EngineUnavailable, load_engine
from spec_serve.supervision.contract import RESPONSE_TENSORS, Kind
from spec_serve.tools.tiny import sample_batch
from spec_serve.tools.verify import reference_logits, tolerance_for


@pytest.fixture
def fake_sglang():
    from fakes import fake_sglang

    fake_sglang.install()
    yield sys.modules["sglang"]
    fake_sglang.uninstall()


# Includes -1 (embedding) and N-1 (post-norm) and is strictly increasing, so every rule is used.
DSPARK_IDS = [-1, 1, 4, 7]
AUX_IDS = [5, 0, 7]  # not sorted: SGLang returns layers in layer order, the contract in list order


def _engines(tiny_target_dir, tiny_vocab_mapping, **kw):
    from spec_serve.engines.hf import HFTarget

    sg = load_engine("sglang", str(tiny_target_dir), device="cpu", dtype="float32", **kw)
    hf = HFTarget(tiny_target_dir, device="cpu", dtype="float32", **kw)
    for e in (sg, hf):
        e.set_vocab_mapping(*tiny_vocab_mapping)
    return sg, hf


def _real_positions(attention_mask: torch.Tensor, name: str) -> torch.Tensor:
    """Where a tensor of the contract holds a value of a real token: its own (hidden states) or, for what
    targets the next token, the next one; plus S-1 of target_probs (the softmax of zeros in every engine)."""
    valid = attention_mask.bool()
    if name not in ("target_probs", "position_mask", "argmax_ids"):
        return valid
    where = torch.zeros_like(valid)
    where[:, :-1] = valid[:, 1:]
    if name == "target_probs":
        where[:, -1] = True
    return where


def _at_real(batch: dict[str, torch.Tensor], attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The batch with zeros (False) wherever ``_real_positions`` does not hold."""
    return {name: t * _real_positions(attention_mask, name).view(*t.shape[:2], *[1] * (t.dim() - 2))
            for name, t in batch.items()}


@pytest.mark.parametrize("kind", [k.value for k in Kind])
@pytest.mark.parametrize("layer_ids", ["default", "edges"])
def test_fake_sglang_matches_hf(fake_sglang, tiny_target_dir, tiny_vocab_mapping, kind, layer_ids):
    """SGLang runs each row as a request of its own, unpadded: each row's hidden states are bit-equal to
    HFTarget's forward of that row alone at its real length (the same composition), zero past its end;
    everything lies within the derived tolerance of HFTarget's padded batch (docs/equality.md)."""
    kw = {} if layer_ids == "default" else {"aux_layer_ids": AUX_IDS, "dspark_layer_ids": DSPARK_IDS}
    sg, hf = _engines(tiny_target_dir, tiny_vocab_mapping, **kw)
    # What reached SGLang: contract ids, which SGLang shifts by one; never the embedding or N-1.
    n = sg.head.num_layers
    wanted = sorted((set(sg.head.aux_layer_ids) | set(sg.head.dspark_layer_ids)) - {-1, n - 1})
    assert sg.runner.model.layers_to_capture == [i + 1 for i in wanted]

    batch = sample_batch(tiny_target_dir, batch=4, seq=24, seed=3)
    attention_mask = batch[1]
    assert attention_mask.sum(1).min() < 24  # the batch is padded
    got = sg.generate_batch(*batch, kind)
    assert tuple(got) == RESPONSE_TENSORS[Kind(kind)]
    padded = hf.generate_batch(*batch, kind)
    # The decoder runs each row alone: its hidden states are bit-equal to HF's forward of the row alone. The
    # lm_head runs once over every row's tokens packed (another composition): what comes from the logits is
    # held to the tolerance below.
    for row, length in enumerate(attention_mask.sum(1).tolist()):
        alone = hf.generate_batch(*(t[row : row + 1, :length] for t in batch), kind)
        for name, t in got.items():
            where = _real_positions(attention_mask[row : row + 1], name)[0, :length]
            assert t.dtype == alone[name].dtype, name
            if name not in ("input_ids", "target_probs", "position_mask", "argmax_ids"):  # input_ids: shifted
                assert torch.equal(t[row, :length][where], alone[name][0][where]), (name, row)
    for name, t in got.items():
        assert t.shape == padded[name].shape, name
        where = _real_positions(attention_mask, name)
        if name == "target_probs":  # no next token at S-1: the softmax of zeros, NeMo's 1/Vd, in every engine
            assert torch.equal(t[:, -1], torch.softmax(torch.zeros(t.shape[-1]), -1).expand_as(t[:, -1]))
        if t.is_floating_point():
            assert not t[~where].any(), f"{name} is not zero past each row's end"
        if name in ("input_ids", "loss_mask"):
            assert torch.equal(t, padded[name]), name
    # The padded batch at real positions (elsewhere it holds what the padded forward computed there).
    logits = None if kind == "dspark" else reference_logits(hf, batch)
    assert tolerance_for(hf).violations(_at_real(got, attention_mask), _at_real(padded, attention_mask), logits) == []
    # One request per row, and every KV slot handed back.
    assert sg.runner.forward_calls == 1
    assert sg.runner.token_to_kv_pool_allocator.used == 0


def test_fake_sglang_target_info_and_embeddings(fake_sglang, tiny_target_dir, tiny_vocab_mapping):
    sg, hf = _engines(tiny_target_dir, tiny_vocab_mapping)
    info, ref = sg.target_info(), hf.target_info()
    assert info.engine == "sglang"
    assert info.mismatches(ref, ignore=("engine",)) == {}
    assert torch.equal(sg.get_input_embeddings().weight, hf.get_input_embeddings().weight)
    assert torch.equal(sg.get_output_embeddings().weight, hf.get_output_embeddings().weight)


def test_fake_sglang_tied_embeddings(fake_sglang, tmp_path):
    from spec_serve.tools.tiny import make_tiny_target

    target = make_tiny_target(tmp_path / "tied", tie_word_embeddings=True)
    sg = load_engine("sglang", str(target), device="cpu", dtype="float32")
    assert sg.get_output_embeddings() is sg.get_input_embeddings()
    assert sg.get_output_embeddings().weight.shape == (512, 128)


def test_fake_sglang_gets_the_server_args_and_refuses_more_than_one_rank(fake_sglang, tiny_target_dir):
    sg = load_engine("sglang", str(tiny_target_dir), device="cpu", dtype="float32", context_length=256,
                     mem_fraction_static=0.7, tp_size=1)
    assert (sg.server_args.context_length, sg.server_args.mem_fraction_static) == (256, 0.7)
    for key in ("tp_size", "pp_size"):
        with pytest.raises(ValueError, match=f"{key} must be 1"):
            load_engine("sglang", str(tiny_target_dir), device="cpu", **{key: 2})
    with pytest.raises(ValueError, match="use --target"):
        load_engine("sglang", str(tiny_target_dir), device="cpu", model_path="/elsewhere")


def test_sglang_rejects_left_padding(fake_sglang, tiny_target_dir, tiny_vocab_mapping):
    sg, _ = _engines(tiny_target_dir, tiny_vocab_mapping)
    input_ids = torch.ones(2, 8, dtype=torch.int64)
    left_padded = torch.tensor([[1] * 8, [0, 0, 0] + [1] * 5])
    with pytest.raises(ValueError, match="right-padded"):
        sg.generate_batch(input_ids, left_padded, left_padded, "dspark")


def test_import_never_pulls_engines():
    code = textwrap.dedent(
        """
        import sys, spec_serve, spec_serve.engines, spec_serve.engines.hf
        assert "vllm" not in sys.modules and "sglang" not in sys.modules, sorted(
            m for m in sys.modules if m.split(".")[0] in ("vllm", "sglang"))
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_hf_engine_load_does_not_import_vllm_or_sglang(tiny_target_dir):
    code = textwrap.dedent(
        f"""
        import sys
        from spec_serve.engines import load_engine
        load_engine("hf", {str(tiny_target_dir)!r}, device="cpu")
        assert "vllm" not in sys.modules and "sglang" not in sys.modules
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_uninstalled_engine_raises_with_instructions(engine, tiny_target_dir):
    import importlib.util

    if importlib.util.find_spec(engine) is not None:
        pytest.skip(f"{engine} is installed here")
    # From this checkout, vllm's advice is its setup script (tests/worker/test_engine_options.py checks both forms).
    with pytest.raises(EngineUnavailable, match=r"pip install|setup_vllm_venv\.sh"):
        load_engine(engine, str(tiny_target_dir))


def _real_sglang_available() -> bool:
    try:
        import sglang  # noqa: F401
    except Exception:
        return False
    return not getattr(sys.modules["sglang"], "IS_FAKE", False) and torch.cuda.is_available()


@pytest.mark.sglang_real
@pytest.mark.skipif(not _real_sglang_available(), reason="needs a real sglang install and a CUDA GPU")
@pytest.mark.parametrize("kind", [k.value for k in Kind])
def test_real_sglang_matches_hf(tiny_target_dir, tiny_vocab_mapping, kind):
    from spec_serve.engines.hf import HFTarget

    sg = load_engine("sglang", str(tiny_target_dir), device="cuda", dtype="bfloat16", mem_fraction_static=0.3)
    hf = HFTarget(tiny_target_dir, device="cuda", dtype="bfloat16")
    for e in (sg, hf):
        e.set_vocab_mapping(*tiny_vocab_mapping)
    input_ids, attention_mask, loss_mask = sample_batch(tiny_target_dir, batch=4, seq=64, seed=3)
    got = sg.generate_batch(input_ids, attention_mask, loss_mask, kind)
    ref = hf.generate_batch(input_ids, attention_mask, loss_mask, kind)
    valid = attention_mask.bool().cuda()
    for name in got:
        a, b = got[name], ref[name]
        assert a.shape == b.shape and a.dtype == b.dtype, name
        if a.is_floating_point() and name != "target_probs":
            cos = torch.nn.functional.cosine_similarity(a[valid].float(), b[valid].float(), dim=-1)
            assert cos.min() >= 0.999, name
