"""NeMo AutoModel's remote EAGLE-3 target interface, served by spec-serve.

NeMo's EAGLE-3 recipe (``nemo_automodel/recipes/llm/train_eagle3.py``) drives its target through
``RemoteEagle3TargetModel``: ``from_urls(urls, device=, timeout=, max_retries=)``,
``supports_async``, ``num_remote_servers``, ``model_info()``, ``set_vocab_mapping``,
``get_input_embeddings()``, ``generate_batch`` / ``generate_batch_async`` returning an
``Eagle3TargetBatch`` (attribute access, ``to_trainer_inputs()``), and ``close()``.
:class:`SpecServeEagle3Target` has that surface over :class:`~spec_serve.client.api.RemoteTargetModel`,
so a NeMo run switches by pointing ``remote_urls`` at a spec-serve broker and calling
:func:`patch_recipe` (docs/migrating-from-nemo.md). nemo_automodel is optional: when it is
importable, batches are its own ``Eagle3TargetBatch``; otherwise :class:`Eagle3Batch`, which has the
same fields and method.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import types
from collections.abc import Sequence
from typing import Any

import torch

from spec_serve.client import RemoteTargetModel

_RECIPE_MODULE = "nemo_automodel.recipes.llm.train_eagle3"


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
        """The keyword arguments of NeMo's EAGLE-3 trainer module for this batch."""
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "loss_mask": self.loss_mask,
                "aux_hidden_states": self.aux_hidden_states, "target_probs": self.target_probs,
                "position_mask": self.position_mask}


def batch_class() -> type:
    """NeMo's ``Eagle3TargetBatch`` when nemo_automodel is installed, else :class:`Eagle3Batch`."""
    try:
        from nemo_automodel.components.speculative.eagle.target import Eagle3TargetBatch
    except ImportError:
        return Eagle3Batch
    return Eagle3TargetBatch


def broker_url(urls: str | Sequence[str]) -> str:
    """The one broker frontend in NeMo's ``remote_urls`` (``ValueError`` with the fix otherwise)."""
    given = [urls] if isinstance(urls, str) else list(dict.fromkeys(urls))
    if len(given) != 1:
        raise ValueError(f"spec-serve needs one broker frontend URL (its workers register there), got {given}; "
                         "set remote_urls: ['tcp://BROKER:5555']")
    url = given[0]
    if url.startswith(("http://", "https://")):
        raise ValueError(f"{url} is an HTTP URL (NeMo's serve_target); spec-serve clients connect to the broker's "
                         "ZeroMQ frontend: remote_urls: ['tcp://BROKER:5555']")
    return url


class _AsyncBatch:
    """What ``generate_batch_async`` returns: ``result(timeout)`` gives the batch, as NeMo's handle does."""

    def __init__(self, future: concurrent.futures.Future, convert):
        self._future, self._convert = future, convert

    def result(self, timeout: float | None = None):
        return self._convert(self._future.result(timeout=timeout))

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> bool:
        return self._future.cancel()


class SpecServeEagle3Target:
    """NeMo's ``RemoteEagle3TargetModel`` surface over a spec-serve broker.

    ``client_kwargs`` go to :class:`RemoteTargetModel` (``service``, ``prefetch_depth``,
    ``num_shards``, ``compact``, ``enable_nccl``, ``security``, ...). NeMo's ``max_retries`` means
    HTTP retries; here it is the client's re-sends of a request after a worker or broker loss.
    """

    def __init__(self, urls: str | Sequence[str], *, device: str | torch.device, timeout: float = 120,
                 max_retries: int = 3, prefetch_depth: int = 4, **client_kwargs: Any):
        self.device = torch.device(device)
        self.client = RemoteTargetModel(broker_url(urls), device=self.device, timeout=timeout,
                                        max_retries=max_retries, prefetch_depth=prefetch_depth, **client_kwargs)
        self._batch_class = batch_class()
        self._input_embeddings: types.SimpleNamespace | None = None

    @classmethod
    def from_urls(cls, urls: Sequence[str], *, device, **kwargs) -> SpecServeEagle3Target:
        """NeMo's constructor: ``from_urls(remote_urls, device=, timeout=, max_retries=)``."""
        return cls(urls, device=device, **kwargs)

    @property
    def supports_async(self) -> bool:
        return True

    @property
    def num_remote_servers(self) -> int:
        """Workers serving this service now (at least 1). NeMo caps ``target_prefetch_depth`` at it:
        one batch in flight per worker, each computing while the previous reply travels."""
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

    def generate_batch(self, input_ids, attention_mask, loss_mask, **packing: Any):
        """One batch's supervision as an ``Eagle3TargetBatch``, every tensor on ``device``."""
        return self.generate_batch_async(input_ids, attention_mask, loss_mask, **packing).result()

    def generate_batch_async(self, input_ids, attention_mask, loss_mask, **packing: Any) -> _AsyncBatch:
        """Submit a batch; ``.result()`` gives the ``Eagle3TargetBatch``."""
        if packing:  # NeMo passes position_ids, seq_lens, doc_remaining only when packing is on
            raise NotImplementedError(f"spec-serve targets run each row causally over the whole row and do not "
                                      f"serve packed sequences ({', '.join(sorted(packing))}); set "
                                      f"packed_sequence_size: 0")
        future = self.client.generate_batch_async(input_ids, attention_mask, loss_mask, kind="eagle3")
        return _AsyncBatch(future, lambda tensors: self._to_batch(tensors, attention_mask))

    def _to_batch(self, tensors: dict[str, torch.Tensor], attention_mask: torch.Tensor):
        # As NeMo's remote batches: input_ids/loss_mask shifted (contract), attention_mask as sent.
        return self._batch_class(aux_hidden_states=tensors["aux_hidden_states"], input_ids=tensors["input_ids"],
                                 attention_mask=attention_mask.to(self.device), loss_mask=tensors["loss_mask"],
                                 target_probs=tensors["target_probs"], position_mask=tensors["position_mask"])

    def close(self) -> None:
        """Leave the broker; the workers keep serving other clients."""
        self.client.close()


def patch_recipe() -> type:
    """Make NeMo's EAGLE-3 recipe build :class:`SpecServeEagle3Target` for ``target_model_backend:
    remote``; returns the class it replaced. Call it before the recipe's ``setup()``."""
    import importlib

    recipe: Any = importlib.import_module(_RECIPE_MODULE)
    previous = recipe.RemoteEagle3TargetModel
    recipe.RemoteEagle3TargetModel = SpecServeEagle3Target
    return previous
