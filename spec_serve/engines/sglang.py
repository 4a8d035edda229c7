"""The SGLang engine: the target runs in an in-process SGLang ``ModelRunner``.

The way SpecForge drives SGLang for EAGLE-3 training: build a ``ModelRunner``,
call ``model.set_eagle3_layers_to_capture(ids)`` and run one extend (prefill)
batch with ``CaptureHiddenMode.FULL``. SGLang's own id convention matches the
contract's: it adds one to each id and records the residual *entering* that
layer, i.e. HF layer ``i``'s output. It cannot record the embedding output (the
residual is still ``None`` before layer 0) nor the last layer's output (the
loop ends first), so id -1 is the embedding lookup done here and id N-1 is the
final-norm output, which is what the contract means there anyway.

The model's logits processor is swapped for a module that only keeps its
inputs (the final-norm output and the captured states): SGLang's processor
prunes an extend batch to its last token, while the contract needs every
position. Logits then come from the checkpoint's lm_head in torch, as in the
vLLM engine. sglang is imported only inside :class:`SGLangTarget`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from spec_serve.engines.captured import CapturedTarget
from spec_serve.supervision.contract import Kind
from spec_serve.transport.sockets import free_port


class _KeepHiddenStates(torch.nn.Module):
    """Stands in for the model's ``LogitsProcessor``: records what it is given, computes nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden_states: torch.Tensor | None = None
        self.aux_hidden_states: list[torch.Tensor] | None = None

    def forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None, *args, **kwargs):
        self.hidden_states = hidden_states
        self.aux_hidden_states = list(aux_hidden_states or [])
        # ModelRunner wraps whatever comes back; nothing downstream of an extend is sampled here.
        return _NoLogits()


class _NoLogits:
    next_token_logits = None
    hidden_states = None


class SGLangTarget(CapturedTarget):
    """A frozen target served by SGLang (engine "sglang"), with the HF engine's surface.

    ``server_kwargs`` go to SGLang's ``ServerArgs`` and override the defaults here
    (no CUDA graphs, tp/pp 1).
    """

    engine = "sglang"

    def __init__(
        self,
        path: str | Path,
        device: str | torch.device = "cuda",
        dtype: str | torch.dtype | None = None,
        aux_layer_ids: Sequence[int] | None = None,
        dspark_layer_ids: Sequence[int] | None = None,
        model_name: str | None = None,
        **server_kwargs: Any,
    ):
        super().__init__(path, device, dtype, aux_layer_ids, dspark_layer_ids, model_name)

        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.model_executor.model_runner import ModelRunner

        self.server_args = self._server_args(server_kwargs)
        self.runner = ModelRunner(
            model_config=ModelConfig.from_server_args(self.server_args),
            mem_fraction_static=self.server_args.mem_fraction_static,
            gpu_id=self.device.index or 0,
            tp_rank=0,
            tp_size=1,
            moe_ep_rank=0,
            moe_ep_size=1,
            pp_rank=0,
            pp_size=1,
            server_args=self.server_args,
            nccl_port=free_port(),
        )
        model = self.runner.model
        # Contract ids go in as they are (SGLang adds one, see the module docstring); -1 is
        # the embedding, computed here. SGLang returns captures in layer order: keep them sorted.
        self._layer_ids = [i for i in self.head.needed_layer_ids() if i >= 0]
        model.set_eagle3_layers_to_capture(self._layer_ids)
        self._keep = _KeepHiddenStates()
        model.logits_processor = self._keep

    def _server_args(self, server_kwargs: dict[str, Any]):
        """SGLang's ``ServerArgs`` for one in-process ``ModelRunner``: ours, ``server_kwargs`` overriding them."""
        from sglang.srt.server_args import ServerArgs

        kwargs: dict[str, Any] = dict(
            model_path=str(self.path),
            dtype=str(self.dtype).removeprefix("torch."),
            disable_cuda_graph=True,
            tp_size=1,
            pp_size=1,
        )
        for key, flag in (("model_path", "--target"), ("dtype", "--dtype")):
            if key in server_kwargs:
                raise ValueError(f"SGLang's {key!r} is set by spec-serve; use {flag}")
        for key in ("tp_size", "pp_size"):  # one in-process ModelRunner: one rank
            if server_kwargs.get(key, 1) != 1:
                raise ValueError(f"the sglang engine runs one in-process ModelRunner, so {key} must be 1, got "
                                 f"{server_kwargs[key]}; for a target bigger than one GPU use --engine vllm")
        kwargs.update(server_kwargs)
        return ServerArgs(**kwargs)

    def _extend_batch(self, input_ids: torch.Tensor, lengths: Sequence[int]):
        """SGLang's ``ForwardBatch`` of one extend (prefill) over ``input_ids``, each row its own request,
        capturing every position's hidden states. Takes KV slots: :meth:`_forward` hands them back."""
        from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.radix_cache import RadixCache
        from sglang.srt.model_executor.forward_batch_info import (
            CaptureHiddenMode,
            ForwardBatch,
        )
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        runner = self.runner
        ids = input_ids.detach().to("cpu", torch.int64)
        sampling = SamplingParams(temperature=0, max_new_tokens=1)
        reqs = []
        for b, n in enumerate(lengths):
            req = Req(rid=str(b), origin_input_text="", origin_input_ids=ids[b, :n].tolist(), sampling_params=sampling)
            req.fill_ids = req.origin_input_ids
            req.extend_input_len = len(req.fill_ids) - len(req.prefix_indices)
            req.logprob_start_len = len(req.origin_input_ids) - 1
            reqs.append(req)
        tree_cache = RadixCache(
            # Nothing is ever inserted, so no prefix is ever reused (as in SpecForge).
            CacheInitParams(
                disable=False,
                req_to_token_pool=runner.req_to_token_pool,
                token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
                page_size=runner.server_args.page_size,
            )
        )
        batch = ScheduleBatch.init_new(
            reqs=reqs,
            req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
            tree_cache=tree_cache,
            model_config=runner.model_config,
            enable_overlap=False,
            spec_algorithm=SpeculativeAlgorithm.NONE,
        )
        batch.prepare_for_extend()
        forward_batch = ForwardBatch.init_new(batch.get_model_worker_batch(), runner)
        forward_batch.capture_hidden_mode = CaptureHiddenMode.FULL
        return forward_batch

    def _forward(self, input_ids: torch.Tensor, lengths: Sequence[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One extend batch, each row its own request: packed ``([T, H] final-norm, [[T, H]] per layer)``."""
        runner = self.runner
        forward_batch = self._extend_batch(input_ids, lengths)
        try:
            runner.forward(forward_batch)
            last, aux = self._keep.hidden_states, self._keep.aux_hidden_states
        finally:
            self._keep.hidden_states = self._keep.aux_hidden_states = None
            # Prefill only: nothing is decoded later, so every KV slot is free again.
            runner.req_to_token_pool.clear()
            runner.token_to_kv_pool_allocator.clear()
        if last is None or aux is None:
            raise RuntimeError("SGLang's forward never reached the logits processor: no hidden states captured")
        if len(aux) != len(self._layer_ids):
            raise RuntimeError(f"SGLang captured {len(aux)} layers, expected {len(self._layer_ids)}")
        return last, aux

    def generate_batch(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        loss_mask: torch.Tensor,
        kind: str | Kind = "eagle3",
    ) -> dict[str, torch.Tensor]:
        """Run the target on one right-padded ``[B,S]`` batch; return the contract tensors of ``kind``."""
        kind, lengths = self.head.check_request(input_ids, attention_mask, loss_mask, kind)
        with self._lock, torch.inference_mode():
            last, aux = self._forward(input_ids, lengths)
        seq = input_ids.shape[1]

        def unpack(packed: torch.Tensor) -> torch.Tensor:
            return self.head.pad_rows(torch.split(packed, lengths, dim=0), seq)

        layers = {i: unpack(t) for i, t in zip(self._layer_ids, aux)}
        if -1 in self.head.needed_layer_ids():
            # Llama-family models feed the plain embedding to layer 0 (no scaling).
            emb = self.head.embedding.weight[input_ids.to(self.device, torch.int64)]
            layers[-1] = emb * (attention_mask.to(self.device) != 0).unsqueeze(-1)
        return self.head.assemble(kind, input_ids, attention_mask, loss_mask, layers, unpack(last))

