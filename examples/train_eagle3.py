"""A minimal multi-rank EAGLE-3 draft training loop on spec-serve supervision.

Every rank shares the same workers through ``RemoteTargetModel``; the draft is wrapped in DDP.

    # against a running broker (see examples/gpu_cluster.md), on CPU with gloo:
    torchrun --standalone --nproc-per-node 2 examples/train_eagle3.py --broker tcp://127.0.0.1:5555 --target DIR
    # a CURVE broker on another host: the client lines `spec-serve keygen keys` printed, as flags
    torchrun ... examples/train_eagle3.py --broker tcp://BROKER:5555 --target DIR --curve-secret-key \
        keys/client.key_secret --curve-server-key keys/broker.key --curve-worker-keys-dir keys/workers
    # everything on this machine: tiny target, broker + 2 workers, then the torchrun above
    python examples/train_eagle3.py --demo
    # two epochs over the same data, the second read from a supervision cache (docs/cache.md)
    python examples/train_eagle3.py --demo --epochs 2 --cache /tmp/eagle3-cache
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch.nn.parallel import DistributedDataParallel as DDP

from spec_serve.client import RemoteTargetModel, Security
from spec_serve.engines.checkpoint import fingerprint
from spec_serve.supervision.vocab import build_vocab_mapping, mask_from_selected
from spec_serve.tools.tiny import sample_batch


class Eagle3Draft(nn.Module):
    """EAGLE-3-style head: fc(3H -> H) on the target's aux states, joined with the token embedding,
    one causal transformer block, and an lm_head over the draft vocab."""

    def __init__(self, embed_weight: torch.Tensor, lm_head_rows: torch.Tensor, heads: int = 4):
        super().__init__()
        hidden = embed_weight.shape[1]
        self.embed = nn.Embedding.from_pretrained(embed_weight.clone(), freeze=True)  # EAGLE-3 keeps it frozen
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout=0.0, batch_first=True,
                                                norm_first=True)
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, lm_head_rows.shape[0], bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head_rows)  # the target's lm_head rows of the draft vocab

    def forward(self, aux_hidden_states: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        # Position t: the target's features of token t plus the embedding of token t+1 (input_ids come
        # back shifted) predict the target's distribution of token t+2, i.e. target_probs[t].
        x = self.proj(torch.cat([self.embed(input_ids), self.fc(aux_hidden_states)], dim=-1))
        causal = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=x.dtype)
        return self.lm_head(self.norm(self.block(x, src_mask=causal, is_causal=True)))


def soft_cross_entropy(logits, target_probs, position_mask):
    """Mean over masked positions of -sum_v p_target(v) log p_draft(v), and (no grad) the target's own
    entropy there (the loss floor: loss - entropy is the KL to the target) and the top-1 agreement."""
    mask = position_mask.squeeze(-1).float()
    denom = mask.sum().clamp_min(1)
    loss = (-(target_probs * F.log_softmax(logits.float(), dim=-1)).sum(-1) * mask).sum() / denom
    with torch.no_grad():
        entropy = (-(target_probs * target_probs.clamp_min(1e-30).log()).sum(-1) * mask).sum() / denom
        agree = ((logits.argmax(-1) == target_probs.argmax(-1)).float() * mask).sum() / denom
    return loss, entropy, agree


def train(args) -> int:  # noqa: PLR0915
    # An example training loop, meant to be read top to bottom as a user would write it.
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    config = json.loads((Path(args.target) / "config.json").read_text())
    vocab = config["vocab_size"]

    # A CURVE broker on another host (`spec-serve keygen keys` prints these three paths): this rank's secret,
    # the broker's public key, and the workers' public keys (replies are admitted from them only).
    security = Security(args.curve_secret_key, server_key_file=args.curve_server_key,
                        worker_keys_dir=args.curve_worker_keys_dir) if args.curve_secret_key else None
    # cache=DIR: rows captured once are read back every later epoch (None: every batch asks the workers).
    target = RemoteTargetModel(args.broker, prefetch_depth=2, timeout=60, security=security, cache=args.cache,
                               compact=True if args.compact else None)
    # Fail at setup, naming the worker, if the workers serve another model than the one we tokenize for.
    target.check_target_info({"vocab_size": vocab, "hidden_size": config["hidden_size"],
                              "num_hidden_layers": config["num_hidden_layers"],
                              "fingerprint": fingerprint(args.target)})

    # Draft vocab: rank 0 counts token frequencies on sample batches and broadcasts the chosen ids.
    selected = torch.zeros(args.draft_vocab, dtype=torch.int64)
    if rank == 0:
        ids, _, loss_mask = sample_batch(args.target, 64, args.seq, seed=12345)
        specials = [config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None]
        selected, _ = build_vocab_mapping(ids, loss_mask, vocab, args.draft_vocab, special_token_ids=specials)
    dist.broadcast(selected, src=0)
    target.set_vocab_mapping(selected, mask_from_selected(selected, vocab))

    embed = target.get_input_embeddings().weight.float()
    lm_head_rows = target.get_output_embeddings().weight.float()[selected]
    model = DDP(Eagle3Draft(embed, lm_head_rows))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)

    tokenizer = Tokenizer.from_file(str(Path(args.target) / "tokenizer.json"))

    def submit(step):  # each rank reads its own data: seeds depend on the rank; every epoch the same batches
        seed = 1_000_000 * (rank + 1) + step % args.steps
        ids, attn, loss_mask = sample_batch(tokenizer, args.batch, args.seq, seed=seed)
        return target.generate_batch_async(ids, attn, loss_mask, kind="eagle3")

    # prefetch_depth=2: while step s trains, the workers compute the supervision of steps s+1 and s+2.
    start = time.perf_counter()
    total = args.steps * args.epochs
    inflight = [submit(s) for s in range(min(2, total))]
    history = []
    for step in range(total):
        batch = inflight.pop(0).result()
        if step + 2 < total:
            inflight.append(submit(step + 2))
        logits = model(batch["aux_hidden_states"].float(), batch["input_ids"])
        loss, entropy, agree = soft_cross_entropy(logits, batch["target_probs"], batch["position_mask"])
        opt.zero_grad(set_to_none=True)
        loss.backward()  # DDP all-reduces the gradients here
        opt.step()
        stats = torch.stack([loss.detach(), entropy, agree])
        dist.all_reduce(stats)
        loss_avg, entropy_avg, agree_avg = (stats / world).tolist()
        history.append(loss_avg)
        if rank == 0 and (step % args.log_every == 0 or step == total - 1):
            print(f"step {step:4d}  loss {loss_avg:.4f}  kl {loss_avg - entropy_avg:.4f}  top1 {agree_avg:.3f}",
                  flush=True)

    elapsed, stats, cache = time.perf_counter() - start, target.stats, target.cache
    target.close()
    dist.destroy_process_group()
    if rank != 0:
        return 0
    if args.history:
        Path(args.history).write_text(json.dumps(history))  # every step's loss, for exact comparisons
    window = max(1, total // 5)
    first, last = sum(history[:window]) / window, sum(history[-window:]) / window
    print(f"{total} steps in {elapsed:.1f}s; rank 0 client: {stats.completed} requests completed, "
          f"{stats.retried} retried", flush=True)
    if cache is not None:
        print(f"rank 0 cache: {cache.stats.hits} rows hit, {cache.stats.misses} missed, "
              f"{cache.stats.batches_all_hits} of {cache.stats.batches} batches sent no request", flush=True)
    print(f"initial loss {first:.4f}  final loss {last:.4f}  (mean of first/last {window} steps, "
          f"{world} ranks)", flush=True)
    if not last < first:
        print("FAILED: the loss did not go down", file=sys.stderr, flush=True)
        return 1
    return 0


def demo(args) -> int:
    """Build the tiny target (or take --target), start a broker and 2 workers here, and torchrun 2 ranks
    against them."""
    from spec_serve.tools.launch import local_cluster
    from spec_serve.tools.tiny import make_tiny_target

    with tempfile.TemporaryDirectory(prefix="spec-serve-eagle3-") as tmp:
        target_dir = Path(args.target) if args.target else make_tiny_target(Path(tmp) / "tiny")
        print(f"target in {target_dir}; starting a broker and 2 workers ...", flush=True)
        with local_cluster(target_dir, workers=2, env={"OMP_NUM_THREADS": "1"}) as cluster:
            print(f"broker at {cluster.frontend}; launching 2 training ranks", flush=True)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   __file__, "--broker", cluster.frontend, "--target", str(target_dir),
                   "--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq),
                   "--lr", str(args.lr), "--draft-vocab", str(args.draft_vocab), "--log-every", str(args.log_every),
                   "--epochs", str(args.epochs)]
            cmd += (["--cache", args.cache] if args.cache else []) + (["--compact"] if args.compact else [])
            cmd += ["--history", args.history] if args.history else []
            return subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--broker", help="broker frontend endpoint, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--target", help="the target's model directory (its tokenizer and config are read here); "
                                    "with --demo, served instead of a freshly built tiny target")
    p.add_argument("--curve-secret-key", default=os.environ.get("SPEC_SERVE_CURVE_SECRET_KEY"),
                   help="this rank's CURVE secret key, for a CURVE broker [env SPEC_SERVE_CURVE_SECRET_KEY]")
    p.add_argument("--curve-server-key", default=os.environ.get("SPEC_SERVE_CURVE_SERVER_KEY"),
                   help="the broker's public key [env SPEC_SERVE_CURVE_SERVER_KEY]")
    p.add_argument("--curve-worker-keys-dir", default=os.environ.get("SPEC_SERVE_CURVE_WORKER_KEYS_DIR"),
                   help="the workers' public keys [env SPEC_SERVE_CURVE_WORKER_KEYS_DIR]")
    p.add_argument("--demo", action="store_true", help="run a local tiny cluster and 2 ranks against it")
    p.add_argument("--steps", type=int, default=60, help="steps per epoch")
    p.add_argument("--epochs", type=int, default=1, help="passes over the same batches")
    p.add_argument("--cache", default=None, help="a supervision cache directory (docs/cache.md): later epochs read "
                                                 "rows from it instead of asking the workers")
    p.add_argument("--compact", action="store_true", help="compact EAGLE-3 replies always (compact=True): what a "
                                                          "cache stores, so the runs with and without one match")
    p.add_argument("--history", default=None, help="write rank 0's loss at every step to this JSON file")
    p.add_argument("--batch", type=int, default=4, help="rows per rank and step")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--draft-vocab", type=int, default=256)
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args()
    if args.demo:
        return demo(args)
    if not args.broker or not args.target:
        p.error("--broker and --target are required (or use --demo)")
    return train(args)


if __name__ == "__main__":
    sys.exit(main())
