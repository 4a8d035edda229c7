"""The benchmark's configuration: the Llama-3.1-8B shape the GPU runs build, ``BenchConfig`` and its defaults per
mode (``make_config``), and reply bytes per token."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from spec_serve.client.options import PREFETCH_DEPTH
from spec_serve.tools.bench.batches import _jsonl_lengths

# Llama-3.1-8B's shape (the GPU benchmark builds it with random bf16 weights on the device).
LLAMA_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}


LLAMA_8B_AUX_LAYERS = "1,15,28"


@dataclasses.dataclass
class BenchConfig:
    target: str | None = None  # model dir; None: the tiny target (or the 8B shape with gpu_8b)
    gpu_8b: bool = False
    devices: tuple[str, ...] = ("cpu",)  # worker devices; the first is also the colocated/client device
    dtype: str | None = None
    batch: int = 4
    seq: int = 256
    steps: int = 8
    warmup: int = 2
    prefetch: int = PREFETCH_DEPTH
    draft_vocab: int = 256
    small_ranks: int = 4
    small_requests: int = 12  # per rank
    small_seq: int = 64
    max_batch_tokens: int = 4096
    transport_messages: int = 8
    transport_seq: int = 256  # transport scenarios send 1 x this many tokens of 8B-shaped EAGLE-3 replies
    only: tuple[str, ...] = ()
    log_dir: str | None = None
    repeat: int = 1  # rounds over the scenarios, alternating their order; figures are per-round medians
    lengths: str = "lognormal"  # row lengths: "lognormal", "full" or a JSONL file (see the module doc)


def bytes_per_token(hidden: int, draft_vocab: int, dtype_bytes: int = 2, mask_bytes: int = 8) -> dict[str, int]:
    """Reply bytes a token: full EAGLE-3 (aux, probs f32, mask, ids, loss) and compact (aux, last, argmax, ids,
    loss)."""
    common = 3 * hidden * dtype_bytes + 8 + mask_bytes  # aux + input_ids int64 + loss_mask as sent
    return {"eagle3": common + draft_vocab * 4 + 1, "eagle3_compact": common + hidden * dtype_bytes + 4}


def make_config(target, gpu_8b, devices, dtype, batch, seq, steps, warmup, prefetch, draft_vocab, small_ranks,
                small_requests, small_seq, max_batch_tokens, transport_messages, only, log_dir,
                transport_seq=None, repeat=1, lengths="lognormal") -> BenchConfig:
    """Defaults per mode: the tiny target on CPU, or the 8B shape on the GPUs (4 x 2048, Vd 32000)."""
    if gpu_8b:
        n = torch.cuda.device_count()
        devices = devices or ",".join(f"cuda:{i}" for i in range(min(max(n, 1), 2)))
        dtype = dtype or "bfloat16"
        batch, seq, steps = batch or 4, seq or 2048, steps or 10
        draft_vocab, small_seq = draft_vocab or 32000, small_seq or 512
        max_batch_tokens = max_batch_tokens or 8192
        transport_seq = transport_seq or 1024
    else:
        devices = devices or "cpu"
        batch, seq, steps = batch or 4, seq or 256, steps or 8
        draft_vocab, small_seq = draft_vocab or 256, small_seq or 64
        max_batch_tokens = max_batch_tokens or 4096
        transport_seq = transport_seq or 256
    prefetch = PREFETCH_DEPTH if prefetch is None else prefetch
    if lengths not in ("full", "lognormal"):
        _jsonl_lengths(Path(lengths))  # a bad file fails here, before any model is built
    return BenchConfig(target=target, gpu_8b=gpu_8b, devices=tuple(d.strip() for d in devices.split(",") if d.strip()),
                       dtype=dtype, batch=batch, seq=seq, steps=steps, warmup=warmup, prefetch=prefetch,
                       draft_vocab=draft_vocab, small_ranks=small_ranks, small_requests=small_requests,
                       small_seq=small_seq, max_batch_tokens=max_batch_tokens,
                       transport_messages=transport_messages, transport_seq=transport_seq,
                       only=tuple(s.strip() for s in only.split(",") if s.strip()), log_dir=log_dir,
                       repeat=repeat, lengths=lengths)
