"""The torch half shared by engines that capture hidden states elsewhere (vllm, sglang).

:class:`CapturedHead` applies the checkpoint's own final RMSNorm and lm_head (loaded from its
safetensors) to captured states and hands them to the contract assembly the HF engine uses
(:mod:`spec_serve.supervision.assemble`); :class:`CapturedTarget` is the engine surface built on it.
Nothing here imports vllm or sglang.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from spec_serve.engines.checkpoint import fingerprint, load_checkpoint_tensors, resolve_dtype
from spec_serve.supervision import assemble, contract
from spec_serve.supervision.contract import Kind
from spec_serve.supervision.target_info import TargetInfo
from spec_serve.supervision.vocab import VocabMappingSlot


class _Weight(torch.nn.Module):
    """A bare ``.weight`` holder, the shape of ``get_input_embeddings()``'s answer."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)


class CapturedHead:
    """Turns per-row captured residual-stream states into contract tensors.

    Holds the checkpoint's final-norm weight and eps, lm_head and input
    embedding (Llama-family names; the lm_head is the embedding when tied) in
    the model dtype on ``device``. An engine captures, for each row of a batch,
    the states :meth:`needed_layer_ids` names (and the final-norm output) and hands them to :meth:`assemble`.
    """

    def __init__(
        self,
        path: str | Path,
        dtype: torch.dtype,
        device: str | torch.device,
        aux_layer_ids: Sequence[int] | None,
        dspark_layer_ids: Sequence[int] | None,
    ):
        self.path = Path(path)
        config = json.loads((self.path / "config.json").read_text())
        self.config = config
        for key in ("final_logit_softcapping", "logit_scale"):
            if config.get(key) not in (None, 1.0):
                raise NotImplementedError(f"models with {key}={config[key]} are not supported")
        self.num_layers = int(config["num_hidden_layers"])
        self.hidden_size = int(config["hidden_size"])
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        self.dtype = dtype
        self.device = torch.device(device)
        n = self.num_layers
        self.aux_layer_ids = contract.validate_aux_layer_ids(
            contract.default_aux_layer_ids(n) if aux_layer_ids is None else aux_layer_ids, n
        )
        self.dspark_layer_ids = contract.validate_dspark_layer_ids(
            contract.default_dspark_layer_ids(n) if dspark_layer_ids is None else dspark_layer_ids, n
        )
        names = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
        weights = load_checkpoint_tensors(self.path, names)
        for name in names[:2]:
            if name not in weights:
                raise ValueError(f"{self.path} lacks {name} (only Llama-style checkpoint names are supported)")
        embed = weights["model.embed_tokens.weight"].to(self.device, dtype)
        tied = "lm_head.weight" not in weights or config.get("tie_word_embeddings", False)
        self.embedding = _Weight(embed)
        self.lm_head = self.embedding if tied else _Weight(weights["lm_head.weight"].to(self.device, dtype))
        self.norm_weight = weights["model.norm.weight"].to(self.device, dtype)
        self.vocab_size = int(self.lm_head.weight.shape[0])
        self._vocab = VocabMappingSlot(self.vocab_size, self.device)

    def needed_layer_ids(self) -> list[int]:
        """Contract layer ids whose states an engine must capture, ascending.

        Layer N-1 is never among them: the contract means the post-norm state there, which
        every engine reports as ``last``. Id -1 is the first decoder layer's input.
        """
        return sorted((set(self.aux_layer_ids) | set(self.dspark_layer_ids)) - {self.num_layers - 1})

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The model's final RMSNorm, op for op as HF's ``LlamaRMSNorm``."""
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.norm_weight * h.to(x.dtype)

    def set_vocab_mapping(self, selected_token_ids: torch.Tensor, selected_token_mask: torch.Tensor) -> None:
        self._vocab.set(selected_token_ids, selected_token_mask)

    def vocab_mapping(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._vocab.get()

    def check_request(self, input_ids, attention_mask, loss_mask, kind: str | Kind) -> tuple[Kind, list[int]]:
        """Validate a request; return its kind and each row's true length (right padding required)."""
        kind = Kind.parse(kind)
        contract.validate_request(input_ids, attention_mask, loss_mask, self.vocab_size)
        if kind is Kind.EAGLE3 and self._vocab.on_device is None:
            raise RuntimeError("EAGLE-3 needs a draft-vocab mapping: call set_vocab_mapping() first")
        mask = attention_mask.detach().to("cpu").bool()
        lengths = mask.sum(dim=1)
        positions = torch.arange(mask.shape[1])
        if not torch.equal(mask, positions[None, :] < lengths[:, None]):
            raise ValueError("attention_mask must be right-padded: each row ones then zeros")
        if int(lengths.min()) < 1:
            raise ValueError("every row needs at least one token (attention_mask all zero in some row)")
        return kind, [int(n) for n in lengths]

    def pad_rows(self, rows: Sequence[torch.Tensor], seq: int) -> torch.Tensor:
        """Stack per-row ``[L_b, ...]`` states into ``[B, seq, ...]`` in the model dtype, zero past each row."""
        out = torch.zeros(len(rows), seq, *rows[0].shape[1:], dtype=self.dtype, device=self.device)
        for b, row in enumerate(rows):
            out[b, : row.shape[0]] = row.to(self.device, self.dtype)
        return out

    @torch.inference_mode()
    def assemble(
        self,
        kind: Kind,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        loss_mask: torch.Tensor,
        layers: Mapping[int, torch.Tensor],
        last: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """Contract tensors of ``kind`` from captured states, each ``[B,S,H]``, zero past a row's end.

        ``layers`` maps each of :meth:`needed_layer_ids` to HF ``hidden_states[id+1]``; ``last`` is
        the final-norm output. The last valid position of a row has padding as its next token:
        its ``target_probs`` row is zero and its ``position_mask`` false, like the padding itself.
        The last position of every row (index ``S-1``) is the softmax of a zero row, ``1/Vd``, as
        the HF engine and NeMo give it.
        """
        mapping = self._vocab.on_device  # read once: see assemble.contract_tensors
        ids = assemble.layer_ids(kind, self.aux_layer_ids, self.dspark_layer_ids)
        per_token = assemble.per_token(kind, last, {**layers, self.num_layers - 1: last}, ids, self.logits, mapping)
        next_real = assemble.next_token_real(attention_mask.to(self.device))
        return assemble.contract_tensors(kind, per_token, input_ids.to(self.device, torch.int64),
                                         loss_mask.to(self.device), mapping, next_real)

    def logits(self, last: torch.Tensor) -> torch.Tensor:
        """The checkpoint's lm_head on final-norm states, in the model dtype (``F.linear``, as ``nn.Linear``)."""
        return F.linear(last, self.lm_head.weight)

    def target_info(self, *, model_name: str, engine: str, fingerprint_: str) -> TargetInfo:
        return TargetInfo(
            num_hidden_layers=self.num_layers,
            hidden_size=self.hidden_size,
            vocab_size=self.vocab_size,
            aux_layer_ids=tuple(self.aux_layer_ids),
            dspark_layer_ids=tuple(self.dspark_layer_ids),
            model_name=model_name,
            dtype=str(self.dtype).removeprefix("torch."),
            engine=engine,
            fingerprint=fingerprint_,
        )


class CapturedTarget:
    """What engines that capture states and finish the contract with :class:`CapturedHead` share:
    the mapping, target info and embeddings, served from the checkpoint in torch."""

    engine = "captured"

    def __init__(
        self,
        path: str | Path,
        device: str | torch.device,
        dtype: str | torch.dtype | None,
        aux_layer_ids: Sequence[int] | None,
        dspark_layer_ids: Sequence[int] | None,
        model_name: str | None,
    ):
        self.path = Path(path)
        self.device = torch.device(device)
        self.dtype = resolve_dtype(self.path, dtype)
        self.head = CapturedHead(self.path, self.dtype, self.device, aux_layer_ids, dspark_layer_ids)
        self.model_name = model_name or os.path.basename(os.path.normpath(str(self.path)))
        self._fingerprint: str | None = None
        self._lock = threading.Lock()  # neither engine's forward is re-entrant

    def set_vocab_mapping(self, selected_token_ids: torch.Tensor, selected_token_mask: torch.Tensor) -> None:
        """Install the draft-vocab mapping EAGLE-3 batches are computed with (``ValueError`` if invalid)."""
        self.head.set_vocab_mapping(selected_token_ids, selected_token_mask)

    def vocab_mapping(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The current ``(selected_token_ids, selected_token_mask)`` on CPU, or ``None`` if unset."""
        return self.head.vocab_mapping()

    def target_info(self) -> TargetInfo:
        """What this engine serves; the fingerprint is the HF engine's, so both agree on one checkpoint."""
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self.path)
        return self.head.target_info(model_name=self.model_name, engine=self.engine, fingerprint_=self._fingerprint)

    def get_input_embeddings(self) -> torch.nn.Module:
        """The input embedding (``.weight`` ``[V, H]``), read from the checkpoint."""
        return self.head.embedding

    def get_output_embeddings(self) -> torch.nn.Module:
        """The lm_head (``.weight`` ``[V, H]``); the input embedding for tied models."""
        return self.head.lm_head

    def close(self) -> None:
        """Nothing to release here; an engine that starts processes or files overrides this."""
