"""A hidden-states KV connector for vLLM that also works without CUDA.

vLLM's ``ExampleHiddenStatesConnector`` copies captured hidden states out of
its cache on a CUDA stream into pinned memory and marks completion with CUDA
events; none of that exists on a CPU host. This subclass does the same
extraction with plain tensor copies and a synchronous write, and keeps
everything else (file naming, the flock handshake that ``load_hidden_states``
waits on, block accounting) from the stock class.

vLLM loads it by name: ``kv_transfer_config={"kv_connector":
"CPUHiddenStatesConnector", "kv_connector_module_path":
"spec_serve.engines.vllm_connector", ...}``. Importing this module imports vllm.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for the CUDA event the base class polls: the copy is already complete."""

    @staticmethod
    def query() -> bool:
        return True


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` with a synchronous, stream-free save."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        bs = self._block_size
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * bs + torch.arange(bs, dtype=torch.long)[None, :]).flatten()
        # The cache is [blocks, num_layers, block_size, hidden]; this gathers
        # [tokens, num_layers, hidden]. Clone: the blocks are freed and reused
        # as soon as get_finished reports the request done.
        hidden = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), pending.token_ids.shape[0])
        tensors = {"hidden_states": hidden.to("cpu", copy=True).contiguous(), "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file(tensors, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: readers may load now
        # get_finished reports a request as sent once its "copy event" is done.
        self._req_copy_events[pending.req_id] = _Done()
