"""A STAND-IN for the parts of NeMo AutoModel 0.7's EAGLE-3 recipe that touch its target -- not NeMo.

nemo_automodel is not installed in CI, so this module restates, in our words, what these parts of
NeMo do, as read from its source (version 0.7.0):

- ``components/config/loader.py``: ``ConfigNode`` (nested mappings as attributes, ``get`` with dotted
  keys, ``to_dict``);
- ``components/datasets/llm/eagle3.py``: packed rows (``build_packed_eagle3_dataset``: documents end to end
  in rows of ``packed_sequence_size``, positions restarting per document, the row's trailing padding
  folded into its last document, ``doc_remaining`` = real tokens after each slot in its document) and
  their collate (``seq_lens`` 0-padded to ``[B, max_docs]``); unpacked rows padded to ``seq_length``;
- ``components/datasets/llm/packed_sequence.py``: ``build_block_causal_additive_mask``;
- ``components/speculative/eagle/target.py``: ``HFEagle3TargetModel.generate_batch``, the colocated
  target: forward hooks on the aux layers, with ``seq_lens`` a ``[B, 1, T, T]`` block-causal additive
  mask and per-document ``position_ids``; logits, ``input_ids`` and ``loss_mask`` shifted left with a zero
  tail; the packing metadata passed on unshifted; ``Eagle3TargetBatch.to_trainer_inputs``;
- ``components/speculative/eagle/core.py``: ``_compute_target_distribution`` (the trainer's projection of
  the logits on the draft vocab);
- ``recipes/llm/train_eagle3.py``: ``TrainEagle3Recipe``'s setup of the target (the backend check, the
  refusal of packing for any backend but colocated, the tensor-parallel gate, ``_setup_remote_target``:
  ``RemoteEagle3TargetModel.from_urls(remote_urls or [remote_url], device=, timeout=remote_timeout,
  max_retries=remote_max_retries)``, then ``set_vocab_mapping``), ``_resolve_prefetch_depth`` (capped at
  ``num_remote_servers``), ``_prefetched_batches`` (up to that many ``generate_batch_async(input_ids,
  attention_mask, loss_mask)`` handles queued, results in order, refilled only after a result) and
  ``_forward_batch`` (a prefetched batch's ``to_trainer_inputs()``; inline, the batch moved to the device
  and its packing metadata passed to ``generate_batch``).

Simplified, and named so: the training data is pre-tokenized documents (``{"input_ids", "loss_mask"}``
per line) instead of chat records and a tokenizer; the draft vocab is spec-serve's
``build_vocab_mapping``; the trainer module records what it is fed. tests/system/test_nemo_integration.py runs
NeMo's own code for the same steps where nemo_automodel imports.
"""

from __future__ import annotations

import json
from collections import deque
from types import SimpleNamespace
from typing import Any

import torch
import yaml

# ------------------------------------------------------------------------------------------ config


class ConfigNode:
    """NeMo's config node: a YAML mapping whose keys are attributes; nested mappings are nodes too."""

    def __init__(self, mapping: dict):
        for key, value in mapping.items():
            setattr(self, key, ConfigNode(value) if isinstance(value, dict) else value)

    def get(self, key: str, default: Any = None) -> Any:
        node: Any = self
        for part in key.split("."):
            if not isinstance(node, ConfigNode) or part not in node.__dict__:
                return default
            node = node.__dict__[part]
        return node

    def to_dict(self) -> dict:
        return {k: v.to_dict() if isinstance(v, ConfigNode) else v for k, v in self.__dict__.items()}


def load_config(path) -> ConfigNode:
    with open(path) as f:
        return ConfigNode(yaml.safe_load(f))


# -------------------------------------------------------------------------------------------- data


def pack_documents(documents: list[dict], packed_sequence_size: int, pad_token_id: int) -> list[dict]:
    """Documents laid end to end in rows of ``packed_sequence_size`` (a document never spans two rows)."""
    rows: list[dict] = []
    row: dict[str, list[int]] = {"input_ids": [], "loss_mask": [], "position_ids": [], "doc_remaining": [],
                                 "seq_lens": []}

    def flush():
        if not row["input_ids"]:
            return
        real = len(row["input_ids"])
        pad = packed_sequence_size - real
        last_position = row["position_ids"][-1]
        rows.append({
            "input_ids": row["input_ids"] + [pad_token_id] * pad,
            "loss_mask": row["loss_mask"] + [0] * pad,
            "attention_mask": [1] * real + [0] * pad,
            # the padding continues the last document's positions (and is part of that document)
            "position_ids": row["position_ids"] + [min(last_position + 1 + j, packed_sequence_size - 1)
                                                   for j in range(pad)],
            "doc_remaining": row["doc_remaining"] + [0] * pad,
            "seq_lens": row["seq_lens"][:-1] + [row["seq_lens"][-1] + pad],
        })
        for values in row.values():
            values.clear()

    for document in documents:
        ids, loss = list(document["input_ids"])[:packed_sequence_size], list(document["loss_mask"])
        n = len(ids)
        if n == 0:
            continue
        if row["input_ids"] and len(row["input_ids"]) + n > packed_sequence_size:
            flush()
        row["input_ids"] += ids
        row["loss_mask"] += [int(bool(m)) for m in loss[:n]]
        row["position_ids"] += list(range(n))
        row["doc_remaining"] += list(range(n - 1, -1, -1))
        row["seq_lens"].append(n)
    flush()
    return rows


def collate_packed(rows: list[dict]) -> dict[str, torch.Tensor]:
    batch = {key: torch.tensor([r[key] for r in rows], dtype=torch.long)
             for key in ("input_ids", "loss_mask", "attention_mask", "position_ids", "doc_remaining")}
    seq_lens = torch.zeros(len(rows), max(len(r["seq_lens"]) for r in rows), dtype=torch.long)
    for i, r in enumerate(rows):
        seq_lens[i, :len(r["seq_lens"])] = torch.tensor(r["seq_lens"])
    batch["seq_lens"] = seq_lens
    return batch


def pad_document(document: dict, seq_length: int, pad_token_id: int) -> dict:
    ids, loss = list(document["input_ids"])[:seq_length], list(document["loss_mask"])[:seq_length]
    pad = seq_length - len(ids)
    return {"input_ids": ids + [pad_token_id] * pad, "loss_mask": loss + [0] * pad,
            "attention_mask": [1] * len(ids) + [0] * pad}


def collate_padded(rows: list[dict]) -> dict[str, torch.Tensor]:
    return {key: torch.tensor([r[key] for r in rows], dtype=torch.long)
            for key in ("input_ids", "loss_mask", "attention_mask")}


def read_documents(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ------------------------------------------------------------------------------ the colocated target


def block_causal_additive_mask(seq_lens: torch.Tensor, seq_length: int, dtype: torch.dtype,
                               device: torch.device) -> torch.Tensor:
    """``[B, 1, T, T]``: 0 where a slot may attend (earlier or same slot of its own document), dtype min else."""
    if seq_lens.dim() != 2 or not bool((seq_lens.sum(dim=1) == seq_length).all()):
        raise ValueError("seq_lens rows must sum to seq_length")
    positions = torch.arange(seq_length, device=device)
    ends = seq_lens.to(device).cumsum(dim=1)
    document = (ends.unsqueeze(1) <= positions.view(1, -1, 1)).sum(dim=2)
    same = document.unsqueeze(2) == document.unsqueeze(1)
    causal = torch.tril(torch.ones(seq_length, seq_length, dtype=torch.bool, device=device))
    allowed = same & causal
    return torch.where(allowed, torch.zeros((), dtype=dtype, device=device), torch.finfo(dtype).min).unsqueeze(1)


def shift_left_with_zero(t: torch.Tensor) -> torch.Tensor:
    return torch.cat((t[:, 1:], torch.zeros_like(t[:, :1])), dim=1)


class Eagle3TargetBatch(SimpleNamespace):
    """NeMo's batch: ``to_trainer_inputs`` by attribute, logits or precomputed probabilities, packing metadata."""

    def to_trainer_inputs(self) -> dict:
        inputs = {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "loss_mask": self.loss_mask,
                  "aux_hidden_states": self.aux_hidden_states}
        if getattr(self, "logits", None) is not None:
            inputs["target_logits"] = self.logits
        else:
            inputs.update(target_probs=self.target_probs, position_mask=self.position_mask)
        if getattr(self, "seq_lens", None) is not None:
            inputs.update(position_ids=self.position_ids, seq_lens=self.seq_lens, doc_remaining=self.doc_remaining)
        return inputs


class ColocatedEagle3Target:
    """NeMo's ``HFEagle3TargetModel``: the frozen HF model in the trainer's process."""

    def __init__(self, model, aux_layer_ids):
        self.model = model.eval()
        self.aux_layer_ids = list(aux_layer_ids)

    @torch.no_grad()
    def generate_batch(self, input_ids, attention_mask, loss_mask, position_ids=None, seq_lens=None,
                       doc_remaining=None) -> Eagle3TargetBatch:
        captured: dict[int, torch.Tensor] = {}
        layers = self.model.model.layers
        handles = [layers[i].register_forward_hook(
            lambda _m, _in, out, i=i: captured.__setitem__(i, out[0] if isinstance(out, tuple) else out))
            for i in self.aux_layer_ids]
        kwargs: dict[str, Any] = {"use_cache": False}
        mask = attention_mask
        if seq_lens is not None:
            kwargs["position_ids"] = position_ids
            mask = block_causal_additive_mask(seq_lens, input_ids.shape[1], next(self.model.parameters()).dtype,
                                              input_ids.device)
        try:
            logits = self.model(input_ids=input_ids, attention_mask=mask, **kwargs).logits
        finally:
            for handle in handles:
                handle.remove()
        return Eagle3TargetBatch(aux_hidden_states=torch.cat([captured[i] for i in self.aux_layer_ids], dim=-1),
                                 logits=shift_left_with_zero(logits), input_ids=shift_left_with_zero(input_ids),
                                 attention_mask=attention_mask, loss_mask=shift_left_with_zero(loss_mask),
                                 position_ids=position_ids, seq_lens=seq_lens, doc_remaining=doc_remaining)

    def set_vocab_mapping(self, selected_token_ids, selected_token_mask) -> None:
        pass  # colocated: the trainer module projects the logits itself


def target_distribution(logits, selected_token_ids, selected_token_mask, loss_mask):
    """The trainer's ``(target_probs, position_mask)`` from a colocated batch's shifted logits."""
    top = logits.argmax(dim=-1)
    position_mask = (selected_token_mask[top] & loss_mask.bool()).unsqueeze(-1)
    probs = torch.softmax(logits.index_select(-1, selected_token_ids.to(logits.device)).float(), dim=-1)
    return probs, position_mask


# -------------------------------------------------------------------------------------------- recipe


class RemoteEagle3TargetModel:
    """Where NeMo's HTTP client would be: not part of the stand-in (a run must swap in spec-serve's)."""

    @classmethod
    def from_urls(cls, urls, **kwargs):
        raise RuntimeError("NeMo's own HTTP remote target is not part of the stand-in")


class RecordingTrainer:
    """Takes the place of NeMo's trainer module: records what the recipe feeds it."""

    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, **inputs):
        self.calls.append(inputs)
        return SimpleNamespace(loss=torch.tensor(0.0), accuracy=torch.tensor(0.0))


class TrainEagle3Recipe:
    """NeMo's ``TrainEagle3Recipe``, its target-facing methods only (see the module docstring)."""

    def __init__(self, cfg):
        self.cfg = cfg

    def setup(self) -> None:
        recipe_cfg = self.cfg.recipe_args
        self.device = torch.device("cpu")
        self.dist_env = SimpleNamespace(is_main=True, world_size=1)
        self.target_model = self.target_wrapper = None
        self.selected_token_ids, self.selected_token_mask = self._setup_online_target(
            recipe_cfg, recipe_cfg.target_model_name_or_path, None)
        self.target_prefetch_depth = self._resolve_prefetch_depth(recipe_cfg)
        self.trainer_module = RecordingTrainer()

    def _setup_online_target(self, recipe_cfg, target_path, draft_base_config):
        backend = recipe_cfg.get("target_model_backend", "colocated")
        if backend not in ("colocated", "sglang", "vllm", "remote"):
            raise ValueError(f"Unknown target_model_backend={backend!r}")
        packed_sequence_size = recipe_cfg.get("packed_sequence_size", 0)
        if packed_sequence_size > 0 and backend != "colocated":
            raise NotImplementedError("packed_sequence_size > 0 is only supported with the colocated target backend")
        if int(self.cfg.get("distributed.tp_size", 1) or 1) > 1 and backend != "colocated":
            raise ValueError("Tensor parallelism (tp_size>1) is only supported with the colocated target backend")
        if backend == "remote":
            self._setup_remote_target(recipe_cfg)
        else:
            self._setup_colocated_target(recipe_cfg, target_path, draft_base_config)
        self.train_dataloader = self._build_train_dataloader(recipe_cfg.train_data_path)
        # NeMo counts token frequencies over the training data (load_or_build_eagle3_token_mapping).
        from transformers import AutoConfig

        from spec_serve.supervision.vocab import build_vocab_mapping

        mapping = build_vocab_mapping(torch.cat([b["input_ids"] for b in self.train_dataloader]),
                                      torch.cat([b["loss_mask"] for b in self.train_dataloader]),
                                      AutoConfig.from_pretrained(target_path).vocab_size, recipe_cfg.draft_vocab_size)
        self.target_wrapper.set_vocab_mapping(*mapping)
        return mapping

    def _setup_remote_target(self, recipe_cfg) -> None:
        urls = recipe_cfg.get("remote_urls", None)
        if not urls and recipe_cfg.get("remote_url", None):
            urls = [recipe_cfg.remote_url]
        if not urls:
            raise ValueError("target_model_backend='remote' requires recipe_args.remote_urls (or remote_url)")
        self.target_model = None
        self.target_wrapper = RemoteEagle3TargetModel.from_urls(list(urls), device=self.device,
                                                                 timeout=recipe_cfg.get("remote_timeout", 120),
                                                                 max_retries=recipe_cfg.get("remote_max_retries", 3))

    def _setup_colocated_target(self, recipe_cfg, target_path, draft_base_config) -> None:
        from transformers import AutoModelForCausalLM

        self.target_model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32)
        num_layers = self.target_model.config.num_hidden_layers
        self.target_wrapper = ColocatedEagle3Target(self.target_model, [1, num_layers // 2 - 1, num_layers - 4])

    def _build_train_dataloader(self, data_path) -> list[dict]:
        recipe_cfg = self.cfg.recipe_args
        documents = read_documents(data_path)
        size, width = recipe_cfg.micro_batch_size, recipe_cfg.get("packed_sequence_size", 0)
        if width > 0:
            rows, collate = pack_documents(documents, width, 0), collate_packed
        else:
            rows, collate = [pad_document(d, recipe_cfg.seq_length, 0) for d in documents], collate_padded
        return [collate(rows[i:i + size]) for i in range(0, len(rows), size)]

    def _resolve_prefetch_depth(self, recipe_cfg) -> int:
        depth = int(recipe_cfg.get("target_prefetch_depth", 0))
        if depth == 0:
            return 0
        if self.target_wrapper is None or not self.target_wrapper.supports_async:
            raise ValueError("target_prefetch_depth > 0 requires an async-capable backend")
        return min(depth, getattr(self.target_wrapper, "num_remote_servers", 1))

    def _forward_batch(self, batch, target_batch=None):
        if target_batch is not None:
            return self.trainer_module(**target_batch.to_trainer_inputs())
        batch = {k: v.to(self.device) for k, v in batch.items()}
        packing = {}
        if "seq_lens" in batch:
            packing = {k: batch[k] for k in ("position_ids", "seq_lens", "doc_remaining")}
        target_batch = self.target_wrapper.generate_batch(input_ids=batch["input_ids"],
                                                          attention_mask=batch["attention_mask"],
                                                          loss_mask=batch["loss_mask"], **packing)
        return self.trainer_module(**target_batch.to_trainer_inputs())

    def _prefetched_batches(self, dataloader):
        depth = self.target_prefetch_depth
        source = iter(dataloader)
        queue: deque = deque()
        exhausted = False

        def fill():
            nonlocal exhausted
            while not exhausted and len(queue) < depth:
                try:
                    batch = next(source)
                except StopIteration:
                    exhausted = True
                    return
                queue.append((batch, self.target_wrapper.generate_batch_async(
                    batch["input_ids"], batch["attention_mask"], batch["loss_mask"])))

        fill()
        try:
            while queue:
                batch, handle = queue.popleft()
                target_batch = handle.result()
                fill()
                yield batch, target_batch
        finally:
            while queue:
                queue.popleft()[1].result()

    def run_train_validation_loop(self) -> None:
        if self.target_prefetch_depth > 0:
            pairs = self._prefetched_batches(self.train_dataloader)
        else:
            pairs = ((b, None) for b in self.train_dataloader)
        for batch, target_batch in pairs:
            self._forward_batch(batch, target_batch)
