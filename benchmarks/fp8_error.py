"""The error FP8 on the wire adds (``wire_dtype="fp8"``; stated in docs/equality.md), per reply tensor, on
real-length batches of a target's own hidden states.

For each hidden state a reply carries as FP8 (``contract.FP8_TENSORS``: compact EAGLE-3's aux_hidden_states;
DSpark's target_hidden_states, target_last_hidden_states), and for compact's last_hidden_states (which travels in
the model dtype: the figures say why), put through the worker's quantizing and the client's restoring
(``fp8.quantize_reply``/``fp8.restore_reply``), over the batch's real tokens:

  rel_norm       ||x' - x|| / ||x|| of the tensor (and of each captured layer: ``layers``)
  max_rel        the largest |x' - x| / |x| over elements with |x| >= 2**-6 x their block's scale (normals)
  within_bound   the largest |x' - x| over e4m3's bound for that element (|x| (2**-4 + 2**-8) + 2**-10 x
                 scale): at most 1 everywhere, or the codec is wrong

and what a compact client would compute from a restored final state (``target_probs_from_restored_last``: the
probabilities' relative norm error and largest absolute error, and the share of positions whose most likely
draft token changes): why compact's final state is not sent FP8, so that target_probs come exact.

  python benchmarks/fp8_error.py --gpu-8b --json $OUT/fp8-error.json   # Llama-3.1-8B's shape, random bf16, cuda
  python benchmarks/fp8_error.py --cpu-8b --tokens 256 --json e.json   # the 8B shape on CPU, a layer at a time
  python benchmarks/fp8_error.py --target DIR --device cuda            # your checkpoint (trained states differ)

``--gpu-8b`` builds the target ``spec-serve bench --gpu-8b`` builds (write_random_init_target of
LLAMA_8B_CONFIG, aux layers 1,15,28), 4 rows of log-normal lengths up to 2048. ``--cpu-8b`` runs the same
shape's decoder layers one at a time with fresh random weights of the same init (normal, std 0.02; norms
at 1), so it reproduces the statistics of the GPU run's hidden states, not its values, in 2 GB of memory.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from spec_serve.supervision import fp8
from spec_serve.supervision.contract import FP8_TENSORS, default_dspark_layer_ids
from spec_serve.supervision.eagle3 import expand_compact, lm_head_slice
from spec_serve.tools.bench import LLAMA_8B_AUX_LAYERS, LLAMA_8B_CONFIG, padded_batch, row_lengths
from spec_serve.tools.null_engine import DRAFT_VOCAB, null_mapping


def tensor_error(x: torch.Tensor, real: torch.Tensor, hidden: int) -> dict[str, Any]:
    """The figures of one hidden state ``x`` ``[B, S, L*hidden]`` over its real tokens (``real``: [B, S] bool)."""
    q, scale = fp8.quantize_blocks(x, hidden)
    back = fp8.dequantize_blocks(q, scale, x.dtype)
    x64, err = x[real].double(), (back[real].double() - x[real].double())
    blocks, err_blocks = x64.unflatten(-1, (-1, hidden)), err.unflatten(-1, (-1, hidden))
    block_scale = scale[real].double().unsqueeze(-1).expand_as(blocks)
    normal = blocks.abs() >= 2**-6 * block_scale
    bound = blocks.abs() * (2**-4 + 2**-8) + block_scale * 2**-10
    layers = [float(err_blocks[:, i].norm() / blocks[:, i].norm()) for i in range(blocks.shape[1])]
    return {"rel_norm": float(err.norm() / x64.norm()), "layers": layers,
            "max_rel": float((err_blocks.abs() / blocks.abs())[normal].max()),
            "within_bound": float((err_blocks.abs() / bound).max()),
            "subnormal_share": float(1 - normal.double().mean())}


def probs_error(last: torch.Tensor, weight: torch.Tensor, mask: torch.Tensor, real: torch.Tensor,
                hidden: int) -> dict[str, Any]:
    """target_probs a compact client computes from the restored final state, against the exact one's."""
    def probs(state: torch.Tensor) -> torch.Tensor:
        compact = {"aux_hidden_states": state, "last_hidden_states": state,
                   "argmax_ids": torch.zeros(state.shape[:2], dtype=torch.int32, device=state.device),
                   "input_ids": torch.zeros(state.shape[:2], dtype=torch.int64, device=state.device),
                   "loss_mask": real.long()}
        return expand_compact(compact, weight, mask)["target_probs"][real].double()

    q, scale = fp8.quantize_blocks(last, hidden)
    exact, restored = probs(last), probs(fp8.dequantize_blocks(q, scale, last.dtype))
    return {"rel_norm": float((restored - exact).norm() / exact.norm()),
            "max_abs": float((restored - exact).abs().max()),
            "top1_changed": float((restored.argmax(-1) != exact.argmax(-1)).double().mean())}


def report(states: dict[str, torch.Tensor], real: torch.Tensor, hidden: int, weight: torch.Tensor,
           mask: torch.Tensor) -> dict[str, Any]:
    out: dict[str, Any] = {name: tensor_error(t, real, hidden) for name, t in states.items()
                           if name in (*FP8_TENSORS, "last_hidden_states")}
    out["target_probs_from_restored_last"] = probs_error(states["last_hidden_states"], weight, mask, real, hidden)
    return out


def within_bounds(result: dict[str, Any]) -> bool:
    """Every hidden state's elements within e4m3's bound, and every figure a number."""
    figures = [v for v in result.values() if isinstance(v, dict)]
    return (all(v["within_bound"] <= 1 for v in figures if "within_bound" in v)
            and not any(math.isnan(v["rel_norm"]) for v in figures))


def lognormal_batch(vocab: int, rows: int = 4, seq: int = 2048, seed: int = 0):
    return padded_batch(row_lengths("lognormal", seed + 1, rows, seq)[seed], vocab, seed)


def engine_states(engine, batch) -> dict[str, torch.Tensor]:
    """A target's compact EAGLE-3 and DSpark hidden states for ``batch``."""
    compact = engine.generate_batch(*batch, kind="eagle3_compact")
    dspark = engine.generate_batch(*batch, kind="dspark")
    return {**{k: compact[k] for k in ("aux_hidden_states", "last_hidden_states")},
            **{k: dspark[k] for k in ("target_hidden_states", "target_last_hidden_states")}}


def run_engine(target: str, device: str, aux: list[int] | None, rows: int, seq: int) -> dict[str, Any]:
    from spec_serve.engines.hf import HFTarget

    engine = HFTarget(target, device=device, dtype="bfloat16", aux_layer_ids=aux)
    info = engine.target_info()
    batch = tuple(t.to(device) for t in lognormal_batch(info.vocab_size, rows, seq))
    states = engine_states(engine, batch)
    draft = min(DRAFT_VOCAB, info.vocab_size)
    ids, mask = torch.arange(draft, device=device), torch.zeros(info.vocab_size, dtype=torch.bool, device=device)
    mask[ids] = True
    weight = lm_head_slice(engine.get_output_embeddings().weight, ids)
    real = batch[1].bool()
    return {"target": info.model_name, "tokens": int(real.sum()), "padded": real.numel(),
            **report(states, real, info.hidden_size, weight, mask)}


def cpu_8b_states(tokens: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], int]:
    """The 8B shape's hidden states for one row of ``tokens`` random tokens, a decoder layer at a time, each
    with fresh random bf16 weights (normal, std ``initializer_range``; RMSNorm weights 1)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

    config = LlamaConfig(**{k: v for k, v in LLAMA_8B_CONFIG.items() if k != "architectures"})
    config._attn_implementation = "sdpa"
    std, layers = config.initializer_range, config.num_hidden_layers
    torch.manual_seed(seed)
    hidden = torch.randn(1, tokens, config.hidden_size).mul_(std).to(torch.bfloat16)  # embedding rows
    positions = torch.arange(tokens)[None]
    rope = LlamaRotaryEmbedding(config)(hidden, positions)
    aux = [int(i) for i in LLAMA_8B_AUX_LAYERS.split(",")]
    dspark = default_dspark_layer_ids(layers)
    captured: dict[int, torch.Tensor] = {}
    default = torch.get_default_dtype()
    for i in range(layers):
        started = time.perf_counter()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("meta"):
                layer = LlamaDecoderLayer(config, i)
            layer = layer.to_empty(device="cpu")
        finally:
            torch.set_default_dtype(default)
        for name, p in layer.named_parameters():
            with torch.no_grad():
                p.fill_(1.0) if name.endswith("layernorm.weight") else p.normal_(0.0, std)
        with torch.no_grad():
            hidden = layer(hidden, attention_mask=None, position_embeddings=rope, position_ids=positions)
        if i in aux or i in dspark:
            captured[i] = hidden
        del layer
        print(f"[fp8_error] layer {i + 1}/{layers} {time.perf_counter() - started:.1f}s", file=sys.stderr, flush=True)
    norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps).to(torch.bfloat16)
    with torch.no_grad():
        last = norm(hidden)
    captured[layers - 1] = last  # layer id N-1 is the final-norm output (assemble.per_token)
    states = {"aux_hidden_states": torch.cat([captured[i] for i in aux], -1), "last_hidden_states": last,
              "target_hidden_states": torch.cat([captured[i] for i in dspark], -1), "target_last_hidden_states": last}
    return states, config.hidden_size


def run_cpu_8b(tokens: int) -> dict[str, Any]:
    states, hidden = cpu_8b_states(tokens)
    torch.manual_seed(1)
    weight = torch.randn(DRAFT_VOCAB, hidden).mul_(LLAMA_8B_CONFIG["initializer_range"]).to(torch.bfloat16)
    real = torch.ones(1, tokens, dtype=torch.bool)
    return {"target": "llama-3.1-8b-shape, random bf16, a layer at a time on CPU", "tokens": tokens,
            **report(states, real, hidden, weight, null_mapping()[1])}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--gpu-8b", action="store_true", help="Llama-3.1-8B's shape, random bf16 weights, on cuda")
    which.add_argument("--cpu-8b", action="store_true", help="the 8B shape on CPU, a decoder layer at a time")
    which.add_argument("--target", default=None, help="a target directory (4 rows of log-normal lengths)")
    p.add_argument("--device", default="cuda", help="--target: where it runs [cuda]")
    p.add_argument("--seq", type=int, default=2048, help="--target: the longest row [2048]")
    p.add_argument("--tokens", type=int, default=256, help="--cpu-8b: tokens of its one row [256]")
    p.add_argument("--json", default=None, help="write the report here")
    a = p.parse_args(argv)
    started = time.perf_counter()
    if a.cpu_8b:
        result = run_cpu_8b(a.tokens)
    elif a.target:
        result = run_engine(a.target, a.device, None, 4, a.seq)
    else:
        from spec_serve.tools.random_target import write_random_init_target

        with tempfile.TemporaryDirectory() as tmp:
            target = write_random_init_target(Path(tmp) / "llama-8b-shape", LLAMA_8B_CONFIG)
            result = run_engine(str(target), "cuda", [int(i) for i in LLAMA_8B_AUX_LAYERS.split(",")], 4, 2048)
    result["seconds"] = round(time.perf_counter() - started, 1)
    result["ok"] = within_bounds(result)
    for name, v in result.items():
        if isinstance(v, dict):
            shown = {k: ([round(x, 5) for x in f] if isinstance(f, list) else round(f, 5)) for k, f in v.items()}
            print(f"{name:>32}: {shown}")
    print(f"{'OK' if result['ok'] else 'NOT OK'} ({result['seconds']} s)")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
