"""A FAKE of the small SGLang surface ``spec_serve.engines.sglang`` uses -- not SGLang.

SGLang cannot run on the CPU test hosts, so this module imitates the pieces the engine
touches (``ServerArgs``, ``ModelConfig``, ``ModelRunner``, ``Req``, ``ScheduleBatch``,
``RadixCache``, ``ForwardBatch``, ...) over the plain HF model of the checkpoint, keeping
the semantics the engine depends on, as read from SGLang's source:

- ``set_eagle3_layers_to_capture(ids)`` stores ``[i + 1 for i in ids]``; layer ``k`` in that
  list records the residual stream *entering* layer ``k`` (HF ``hidden_states[k]``), in layer
  order, and fails for ``k == 0`` as SGLang does (its residual is still ``None`` there);
- an extend batch packs its requests' tokens ``[T, ...]`` in request order;
- the model hands ``(input_ids, final-norm hidden [T,H], lm_head, forward_batch, aux list)``
  to ``model.logits_processor``.

``install()`` puts the fake into ``sys.modules`` under the ``sglang`` names (``sglang.IS_FAKE``
is True); ``uninstall()`` removes it.
"""

from __future__ import annotations

import enum
import importlib.machinery
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import torch

MODULES = (
    "sglang",
    "sglang.srt",
    "sglang.srt.configs",
    "sglang.srt.configs.model_config",
    "sglang.srt.server_args",
    "sglang.srt.model_executor",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.model_executor.forward_batch_info",
    "sglang.srt.managers",
    "sglang.srt.managers.schedule_batch",
    "sglang.srt.mem_cache",
    "sglang.srt.mem_cache.cache_init_params",
    "sglang.srt.mem_cache.radix_cache",
    "sglang.srt.sampling",
    "sglang.srt.sampling.sampling_params",
    "sglang.srt.speculative",
    "sglang.srt.speculative.spec_info",
)


class ServerArgs:
    def __init__(self, model_path: str, dtype: str = "auto", mem_fraction_static: float = 0.8, page_size: int = 1,
                 **kw):
        self.model_path, self.dtype = model_path, dtype
        self.mem_fraction_static, self.page_size = mem_fraction_static, page_size
        self.__dict__.update(kw)


class ModelConfig:
    def __init__(self, server_args: ServerArgs):
        from transformers import AutoConfig

        self.model_path = server_args.model_path
        self.dtype = getattr(torch, server_args.dtype)
        self.hf_config = AutoConfig.from_pretrained(server_args.model_path)

    @classmethod
    def from_server_args(cls, server_args: ServerArgs) -> ModelConfig:
        return cls(server_args)


class CaptureHiddenMode(enum.IntEnum):
    NULL = 0
    LAST = 1
    FULL = 2


class SpeculativeAlgorithm(enum.Enum):
    NONE = "none"


@dataclass
class SamplingParams:
    temperature: float = 1.0
    max_new_tokens: int = 128


@dataclass
class Req:
    rid: str
    origin_input_text: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    prefix_indices: list[int] = field(default_factory=list)
    fill_ids: list[int] | None = None
    extend_input_len: int = 0
    logprob_start_len: int = 0


@dataclass
class CacheInitParams:
    disable: bool
    req_to_token_pool: Any
    token_to_kv_pool_allocator: Any
    page_size: int


class RadixCache:
    def __init__(self, params: CacheInitParams):
        self.params = params


class _Pool:
    """Counts allocations so tests can see the engine frees every slot after a batch."""

    def __init__(self):
        self.used = 0
        self.clears = 0

    def clear(self):
        self.used = 0
        self.clears += 1


class ScheduleBatch:
    def __init__(self, reqs, req_to_token_pool, token_to_kv_pool_allocator, **kw):
        self.reqs = reqs
        self.req_to_token_pool, self.token_to_kv_pool_allocator = req_to_token_pool, token_to_kv_pool_allocator
        self.extra = kw

    @classmethod
    def init_new(cls, reqs, req_to_token_pool, token_to_kv_pool_allocator, tree_cache, model_config, enable_overlap,
                 spec_algorithm):
        return cls(reqs, req_to_token_pool, token_to_kv_pool_allocator, tree_cache=tree_cache)

    def prepare_for_extend(self):
        for r in self.reqs:
            assert r.fill_ids is not None and r.extend_input_len == len(r.fill_ids), "req not set up for extend"
        self.req_to_token_pool.used += len(self.reqs)
        self.token_to_kv_pool_allocator.used += sum(len(r.fill_ids) for r in self.reqs)

    def get_model_worker_batch(self):
        return types.SimpleNamespace(reqs=self.reqs)


class ForwardBatch:
    def __init__(self, input_ids: torch.Tensor, seq_lens: list[int]):
        self.input_ids, self.seq_lens = input_ids, seq_lens
        self.capture_hidden_mode = CaptureHiddenMode.NULL

    @classmethod
    def init_new(cls, model_worker_batch, model_runner) -> ForwardBatch:
        reqs = model_worker_batch.reqs
        ids = torch.tensor([t for r in reqs for t in r.fill_ids], dtype=torch.int64)
        return cls(ids, [len(r.fill_ids) for r in reqs])


class FakeSGLangLlama(torch.nn.Module):
    """SGLang's ``LlamaForCausalLM`` capture behaviour over an HF ``LlamaForCausalLM``."""

    def __init__(self, hf_model):
        super().__init__()
        self.hf = hf_model
        self.config = hf_model.config
        self.capture_aux_hidden_states = False
        self.layers_to_capture: list[int] = []
        self.logits_processor = None  # the real one is never needed by the engine
        self._seen: list[tuple[int, torch.Tensor]] = []
        for k, layer in enumerate(hf_model.model.layers):
            layer.register_forward_pre_hook(self._make_hook(k), with_kwargs=True)

    def _make_hook(self, k):
        def hook(module, args, kwargs):
            if k in self.layers_to_capture:
                if k == 0:  # SGLang: hidden_states + residual with residual None
                    raise TypeError("unsupported operand type(s) for +: 'Tensor' and 'NoneType'")
                self._seen.append((k, args[0] if args else kwargs["hidden_states"]))

        return hook

    def set_eagle3_layers_to_capture(self, layer_ids=None):
        self.capture_aux_hidden_states = True
        n = self.config.num_hidden_layers
        self.layers_to_capture = [2, n // 2, n - 3] if layer_ids is None else [v + 1 for v in layer_ids]

    @torch.no_grad()
    def forward(self, forward_batch: ForwardBatch):
        finals, per_req = [], []
        for chunk in torch.split(forward_batch.input_ids, forward_batch.seq_lens):
            self._seen = []
            out = self.hf.model(input_ids=chunk[None], use_cache=False, return_dict=True)
            finals.append(out.last_hidden_state[0])
            per_req.append([h[0] for _, h in self._seen])  # hooks fire in layer order
        aux = None
        if self.capture_aux_hidden_states:
            aux = [torch.cat([req[j] for req in per_req]) for j in range(len(per_req[0]))]
        return self.logits_processor(
            forward_batch.input_ids, torch.cat(finals), self.hf.lm_head, forward_batch, aux or None
        )


class ModelRunner:
    def __init__(self, model_config, mem_fraction_static, gpu_id, tp_rank, tp_size, moe_ep_rank, moe_ep_size,
                 pp_rank, pp_size, server_args, nccl_port, **kw):
        from transformers import AutoModelForCausalLM

        self.model_config, self.server_args = model_config, server_args
        hf = AutoModelForCausalLM.from_pretrained(model_config.model_path, dtype=model_config.dtype).eval()
        self.model = FakeSGLangLlama(hf)
        self.req_to_token_pool = _Pool()
        self.token_to_kv_pool_allocator = _Pool()
        self.forward_calls = 0

    def forward(self, forward_batch: ForwardBatch):
        self.forward_calls += 1
        return types.SimpleNamespace(logits_output=self.model(forward_batch), can_run_graph=False)


_CONTENTS = {
    "sglang.srt.server_args": {"ServerArgs": ServerArgs},
    "sglang.srt.configs.model_config": {"ModelConfig": ModelConfig},
    "sglang.srt.model_executor.model_runner": {"ModelRunner": ModelRunner},
    "sglang.srt.model_executor.forward_batch_info": {"ForwardBatch": ForwardBatch,
                                                     "CaptureHiddenMode": CaptureHiddenMode},
    "sglang.srt.managers.schedule_batch": {"Req": Req, "ScheduleBatch": ScheduleBatch},
    "sglang.srt.mem_cache.cache_init_params": {"CacheInitParams": CacheInitParams},
    "sglang.srt.mem_cache.radix_cache": {"RadixCache": RadixCache},
    "sglang.srt.sampling.sampling_params": {"SamplingParams": SamplingParams},
    "sglang.srt.speculative.spec_info": {"SpeculativeAlgorithm": SpeculativeAlgorithm},
}


def install() -> None:
    """Register the fake as ``sglang`` in ``sys.modules`` (refuses if a real sglang is loaded)."""
    if "sglang" in sys.modules and not getattr(sys.modules["sglang"], "IS_FAKE", False):
        raise RuntimeError("a real sglang is already imported; not shadowing it with the fake")
    for name in MODULES:
        mod = types.ModuleType(name, "FAKE sglang module (tests/fakes/fake_sglang.py)")
        # A spec makes importlib.util.find_spec("sglang") succeed, as load_engine checks it.
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        mod.__path__ = []
        mod.__dict__.update(_CONTENTS.get(name, {}))
        sys.modules[name] = mod
    sys.modules["sglang"].IS_FAKE = True
    sys.modules["sglang"].__version__ = "0.0.0+fake"


def uninstall() -> None:
    """Remove the fake from ``sys.modules``."""
    for name in MODULES:
        if getattr(sys.modules.get(name), "__doc__", "") and "FAKE sglang" in sys.modules[name].__doc__:
            del sys.modules[name]
