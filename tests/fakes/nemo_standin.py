"""A STAND-IN for the part of NeMo AutoModel's EAGLE-3 recipe that drives its target -- not NeMo.

nemo_automodel is not installed in CI, so this module restates, in our words, what
``TrainEagle3Recipe`` (nemo_automodel/recipes/llm/train_eagle3.py) does with its
``target_wrapper`` when ``target_model_backend: remote``, as read from NeMo's source:

- setup builds the backend with ``RemoteEagle3TargetModel.from_urls(remote_urls, device=...,
  timeout=remote_timeout, max_retries=remote_max_retries)`` and calls ``set_vocab_mapping``;
- ``target_prefetch_depth > 0`` requires ``supports_async`` and is capped at
  ``num_remote_servers``;
- the prefetch loop keeps that many ``generate_batch_async(input_ids, attention_mask, loss_mask)``
  handles queued, takes ``handle.result()`` in order and refills only after a result;
- each step feeds ``target_batch.to_trainer_inputs()`` to the trainer module, reading attributes.

tests/test_nemo_integration.py also runs NeMo's own recipe methods where nemo_automodel imports.
"""

from __future__ import annotations

from collections import deque


def build_backend(backend_class, recipe_args: dict, device):
    urls = recipe_args.get("remote_urls") or [recipe_args["remote_url"]]
    return backend_class.from_urls(list(urls), device=device, timeout=recipe_args.get("remote_timeout", 120),
                                   max_retries=recipe_args.get("remote_max_retries", 3))


def resolve_prefetch_depth(target, depth: int) -> int:
    if depth == 0:
        return 0
    if not target.supports_async:
        raise ValueError("target_prefetch_depth > 0 needs an async backend")
    return min(depth, getattr(target, "num_remote_servers", 1))


def prefetched_batches(target, batches, depth: int):
    """Yield ``(batch, target_batch)`` with up to ``depth`` requests queued, in order."""
    pending: deque = deque()
    source = iter(batches)

    def fill():
        for batch in source:
            pending.append((batch, target.generate_batch_async(batch["input_ids"], batch["attention_mask"],
                                                                batch["loss_mask"])))
            if len(pending) >= depth:
                return

    fill()
    while pending:
        batch, handle = pending.popleft()
        target_batch = handle.result()
        fill()
        yield batch, target_batch


def trainer_step(target_batch) -> dict:
    """What the trainer module receives: the batch's trainer inputs, by attribute access."""
    inputs = target_batch.to_trainer_inputs()
    assert inputs["attention_mask"] is target_batch.attention_mask
    return inputs
