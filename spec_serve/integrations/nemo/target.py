"""NeMo AutoModel's remote EAGLE-3 target interface, served by spec-serve.

NeMo's EAGLE-3 recipe (``nemo_automodel/recipes/llm/train_eagle3.py``) drives its target through
``RemoteEagle3TargetModel``: ``from_urls(urls, device=, timeout=, max_retries=)``,
``supports_async``, ``num_remote_servers``, ``model_info()``, ``set_vocab_mapping``,
``get_input_embeddings()``, ``generate_batch`` / ``generate_batch_async`` returning an
``Eagle3TargetBatch`` (attribute access, ``to_trainer_inputs()``), and ``close()``.
:class:`SpecServeEagle3Target` has that surface over :class:`~spec_serve.client.api.RemoteTargetModel`,
and serves packed batches (``seq_lens``, packed.py) too. nemo_automodel is optional: when it is
importable, batches are its own ``Eagle3TargetBatch``; otherwise :class:`Eagle3Batch`, which has the
same fields and method.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from spec_serve.client import RemoteTargetModel, options
from spec_serve.integrations.nemo.packed import PACKING_KEYS, Documents


@dataclasses.dataclass
class Eagle3Batch:
    """The fields of NeMo's ``Eagle3TargetBatch`` a remote target fills (``logits`` stays None:
    the draft-vocab ``target_probs``/``position_mask`` come precomputed)."""

    aux_hidden_states: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    logits: torch.Tensor | None = None
    target_probs: torch.Tensor | None = None
    position_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    doc_remaining: torch.Tensor | None = None

    def to_trainer_inputs(self) -> dict[str, torch.Tensor | None]:
        """The keyword arguments of NeMo's EAGLE-3 trainer module for this batch (with a packed batch's
        ``position_ids``, ``seq_lens`` and ``doc_remaining``, as NeMo's batch gives them)."""
        inputs = {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "loss_mask": self.loss_mask,
                  "aux_hidden_states": self.aux_hidden_states, "target_probs": self.target_probs,
                  "position_mask": self.position_mask}
        if self.seq_lens is not None:
            inputs.update(position_ids=self.position_ids, seq_lens=self.seq_lens, doc_remaining=self.doc_remaining)
        return inputs


def batch_class() -> type:
    """NeMo's ``Eagle3TargetBatch`` when nemo_automodel is installed, else :class:`Eagle3Batch`."""
    try:
        from nemo_automodel.components.speculative.eagle.target import Eagle3TargetBatch
    except ImportError:
        return Eagle3Batch
    return Eagle3TargetBatch


class _AsyncBatch:
    """What ``generate_batch_async`` returns: ``result(timeout)`` gives the batch, as NeMo's handle does."""

    def __init__(self, future: concurrent.futures.Future, convert: Callable[[dict[str, torch.Tensor]], Any]):
        self._future, self._convert = future, convert

    def result(self, timeout: float | None = None):
        return self._convert(self._future.result(timeout=timeout))

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> bool:
        return self._future.cancel()


class SpecServeEagle3Target:
    """NeMo's ``RemoteEagle3TargetModel`` surface over a spec-serve broker.

    Every :class:`RemoteTargetModel` option comes from, in order: a keyword argument here, its
    ``SPEC_SERVE_*`` variable, NeMo's ``NEMO_EAGLE_ENABLE_NCCL``, the recipe YAML (``recipe_args``: NeMo's
    ``remote_urls``/``remote_url``, ``remote_timeout``, ``remote_max_retries``, and
    ``spec_serve: {compact: true, num_shards: 2, ...}``), the default (docs/client-options.md).
    NeMo's ``max_retries`` means HTTP retries; here it is the client's re-sends of a request after a
    worker or broker loss.
    """

    def __init__(self, urls: str | Sequence[str] | None = None, *, device: str | torch.device,
                 recipe_args: Any = None, **client_kwargs: Any):
        explicit = {"broker_url": urls, "device": device, **client_kwargs}
        resolved = options.resolve(explicit, config=recipe_args, nemo=True)
        self.options = resolved
        self.client = RemoteTargetModel(**resolved.client_kwargs())
        self.device = self.client.device
        self._batch_class = batch_class()
        self._input_embeddings: types.SimpleNamespace | None = None
        # Set by the recipe (recipe.py) when packed_sequence_size > 0: a batch without its seq_lens is
        # then refused, never served as one causal sequence across its documents.
        self.expect_packed = False
        # A packed batch's boundaries, from packed_source() to the generate_batch_async call for its input_ids.
        self._handoff: tuple[torch.Tensor, dict[str, torch.Tensor]] | None = None

    @classmethod
    def from_urls(cls, urls: Sequence[str], *, device, **kwargs) -> SpecServeEagle3Target:
        """NeMo's constructor: ``from_urls(remote_urls, device=, timeout=, max_retries=)``."""
        return cls(urls, device=device, **kwargs)

    @classmethod
    def from_recipe(cls, recipe_args: Any, *, device) -> SpecServeEagle3Target:
        """The target a recipe's ``recipe_args`` (NeMo's YAML section) asks for, the environment applied."""
        target = cls(device=device, recipe_args=recipe_args)
        target.expect_packed = int(_get(recipe_args, "packed_sequence_size") or 0) > 0
        return target

    @property
    def supports_async(self) -> bool:
        return True

    @property
    def num_remote_servers(self) -> int:
        """Workers serving this service now (at least 1). NeMo's own recipe caps ``target_prefetch_depth`` at
        it; ``SpecServeEagle3Recipe`` does not (recipe.py)."""
        self.client.target_info()  # waits (up to timeout) for a first worker
        workers = self.client.status()["workers"]
        return max(1, sum(1 for w in workers if w["service"] == self.client.service))

    def model_info(self) -> dict[str, Any]:
        """NeMo's keys (num_hidden_layers, hidden_size, vocab_size, aux_layer_ids) and spec-serve's
        (dspark_layer_ids, model_name, dtype, engine, fingerprint)."""
        return self.client.target_info().to_dict()

    def set_vocab_mapping(self, selected_token_ids: torch.Tensor, selected_token_mask: torch.Tensor) -> None:
        self.client.set_vocab_mapping(selected_token_ids, selected_token_mask)

    def get_input_embeddings(self) -> types.SimpleNamespace:
        """The target's input embedding as ``.weight`` on ``device``, fetched once."""
        if self._input_embeddings is None:
            self._input_embeddings = self.client.get_input_embeddings()
        return self._input_embeddings

    def get_output_embeddings(self) -> types.SimpleNamespace:
        return self.client.get_output_embeddings()

    def packed_source(self, batches: Iterable[Mapping[str, Any]]) -> Iterator[Mapping[str, Any]]:
        """``batches`` as they are; each packed one's ``position_ids``, ``seq_lens`` and ``doc_remaining`` wait
        here for the ``generate_batch_async`` call with its ``input_ids``: NeMo's prefetch loop passes only
        ``input_ids``, ``attention_mask`` and ``loss_mask``, right after taking the batch."""
        for batch in batches:
            if "seq_lens" in batch:
                self._handoff = (batch["input_ids"], {k: batch[k] for k in PACKING_KEYS if k in batch})
            yield batch

    def generate_batch(self, input_ids, attention_mask, loss_mask, **packing: Any):
        """One batch's supervision as an ``Eagle3TargetBatch``, every tensor on ``device``."""
        return self.generate_batch_async(input_ids, attention_mask, loss_mask, **packing).result()

    def generate_batch_async(self, input_ids, attention_mask, loss_mask, **packing: Any) -> _AsyncBatch:
        """Submit a batch; ``.result()`` gives the ``Eagle3TargetBatch``. With ``seq_lens`` (NeMo's packed
        rows) each document is a request row of its own (packed.py)."""
        packing = self._packing_of(input_ids, packing)
        if packing.get("seq_lens") is None:
            future = self.client.generate_batch_async(input_ids, attention_mask, loss_mask, kind="eagle3")
            return _AsyncBatch(future, lambda tensors: self._to_batch(tensors, attention_mask, {}))
        documents = Documents.split(input_ids, attention_mask, loss_mask, packing["seq_lens"],
                                    packing.get("position_ids"))
        future = self.client.generate_batch_async(documents.input_ids, documents.attention_mask,
                                                  documents.loss_mask, kind="eagle3")
        return _AsyncBatch(future, lambda tensors: self._to_batch(documents.gather(tensors, self.device),
                                                                  attention_mask, packing))

    def _packing_of(self, input_ids: torch.Tensor, packing: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(packing) - set(PACKING_KEYS))
        if unknown:
            raise TypeError(f"generate_batch got unexpected keyword arguments {unknown} (NeMo passes {PACKING_KEYS})")
        handoff, self._handoff = self._handoff, None
        if not packing and handoff is not None and handoff[0] is input_ids:
            packing = handoff[1]
        if self.expect_packed and packing.get("seq_lens") is None:
            raise RuntimeError("packed_sequence_size > 0, but this batch came without its seq_lens: its documents "
                               "would attend to each other; run the recipe through spec_serve.integrations.nemo "
                               "(SpecServeEagle3Recipe), which passes them on")
        return packing

    def _to_batch(self, tensors: Mapping[str, torch.Tensor], attention_mask: torch.Tensor,
                  packing: Mapping[str, torch.Tensor]):
        # As NeMo's remote batches: input_ids/loss_mask shifted (contract), attention_mask as sent; a packed
        # batch's metadata unshifted, on the training device, as NeMo's colocated target returns it.
        extra = {k: v.to(self.device) for k, v in packing.items() if v is not None}
        return self._batch_class(aux_hidden_states=tensors["aux_hidden_states"], input_ids=tensors["input_ids"],
                                 attention_mask=attention_mask.to(self.device), loss_mask=tensors["loss_mask"],
                                 target_probs=tensors["target_probs"], position_mask=tensors["position_mask"], **extra)

    def close(self) -> None:
        """Leave the broker; the workers keep serving other clients."""
        self.client.close()


def _get(config: Any, key: str) -> Any:
    getter = getattr(config, "get", None)
    return getter(key, None) if getter is not None else None
