"""The Hugging Face transformers engine: any local causal LM, run in-process.

Hidden states are captured with hooks on the decoder layers that are actually needed (never
``output_hidden_states=True``, which keeps all N+1 of them alive), and the logits come from the
model's own ``lm_head`` on the final-norm output, in the model dtype, exactly as the HF forward
computes them. Only the draft-vocab slice is ever softmaxed in float32.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from spec_serve.engines import compiled, packing
from spec_serve.engines.checkpoint import fingerprint, parse_dtype
from spec_serve.supervision import assemble, contract
from spec_serve.supervision.contract import Kind
from spec_serve.supervision.target_info import TargetInfo
from spec_serve.supervision.vocab import VocabMappingSlot


def parse_devices(device: str | torch.device | Sequence[str | torch.device]) -> list[torch.device]:
    """``"cuda:0,cuda:1"`` or a list -> the devices one target is spread over; one device -> ``[it]``."""
    items = device.split(",") if isinstance(device, str) else [device] if isinstance(device, torch.device) else device
    devices = [torch.device(d.strip() if isinstance(d, str) else d)
               for d in items if not isinstance(d, str) or d.strip()]
    if not devices:
        raise ValueError(f"no device in {device!r}")
    if len({d.type for d in devices}) > 1:
        raise ValueError(f"devices of one target must be of one type, got {[str(d) for d in devices]}")
    return devices


def layer_devices(num_layers: int, devices: Sequence[torch.device]) -> list[torch.device]:
    """A balanced split of the decoder layers: contiguous runs, sizes differing by at most one."""
    if num_layers < len(devices):
        raise ValueError(f"{num_layers} decoder layers cannot be spread over {len(devices)} devices")
    runs = torch.arange(num_layers).tensor_split(len(devices))
    return [devices[d] for d, run in enumerate(runs) for _ in run]


def _to_device(value, device: torch.device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


def _inputs_to(module: torch.nn.Module, device: torch.device) -> None:
    """Move every tensor a module is called with to ``device`` (copies are exact, so values are kept)."""
    module.register_forward_pre_hook(lambda _, args, kwargs: (_to_device(args, device), _to_device(kwargs, device)),
                                     with_kwargs=True)


def spread_model(model, devices: Sequence[torch.device]) -> None:
    """Place one causal LM over ``devices``: embeddings (and all else) on the first, the decoder layers
    split evenly in order, the final norm and lm_head on the last. Each placed module moves its inputs
    to its own device, so activations hop between devices between layers."""
    base = model.base_model
    first, last = devices[0], devices[-1]
    head = model.get_output_embeddings()
    tied = head.weight is model.get_input_embeddings().weight
    for name, child in base.named_children():
        if name == "layers":
            for layer, device in zip(child, layer_devices(len(child), devices)):
                layer.to(device)
                _inputs_to(layer, device)
        elif name != "norm":
            child.to(first)
    base.norm.to(last)
    _inputs_to(base.norm, last)
    if tied:  # a copy of the embedding on the last device; the values are the same
        head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().to(last), requires_grad=False)
    head.to(last)
    _inputs_to(base, first)


# Test-only fault injection (tests/worker/test_engine_death.py): "oom:N" or "cuda:N" makes the N-th forward and
# every later one raise what a GPU out of memory or a CUDA error raises, so engine death is testable on
# CPU; "error:N" raises an error the engine survives.
TEST_FAULT_ENV = "SPEC_SERVE_TEST_ENGINE_FAULT"
_TEST_FAULTS = {
    "oom": lambda: torch.OutOfMemoryError(f"CUDA out of memory ({TEST_FAULT_ENV})"),
    "cuda": lambda: torch.AcceleratorError(f"CUDA error: an illegal memory access was encountered ({TEST_FAULT_ENV})"),
    "error": lambda: RuntimeError(f"a forward failed ({TEST_FAULT_ENV})"),
}


def _test_fault() -> tuple[str, int] | None:
    value = os.environ.get(TEST_FAULT_ENV)
    if not value:
        return None
    kind, _, nth = value.partition(":")
    if kind not in _TEST_FAULTS or not nth.isdigit():
        raise ValueError(f"{TEST_FAULT_ENV} must be oom:N, cuda:N or error:N, got {value!r}")
    return kind, int(nth)


# A weightless target dir (a benchmark fixture, ``spec_serve.tools.random_target``) holds config.json
# plus this small file instead of weights: the model is built with random weights straight on the
# device, with no download or disk write of weights. Same file, same seed, same weights on the same
# kind of device.
RANDOM_INIT_FILE = "random_init.safetensors"


def _random_init_model(config, marker: Path, dtype, device: torch.device, trust_remote_code: bool = False):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    seed = int(load_file(str(marker))["seed"][0])
    dtype = torch.float32 if dtype == "auto" else dtype
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    return model


def _load_model(path: Path, config, dtype: str | torch.dtype | None, devices: Sequence[torch.device],
                trust_remote_code: bool):
    """The checkpoint's causal LM on ``devices`` (spread over them if several), frozen, in eval mode."""
    from transformers import AutoModelForCausalLM

    # `dtype=` replaced `torch_dtype=` in transformers 4.56; both 4.57 and 5.x accept it.
    if (path / RANDOM_INIT_FILE).exists():
        model = _random_init_model(config, path / RANDOM_INIT_FILE, parse_dtype(dtype), devices[0], trust_remote_code)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), config=config, dtype=parse_dtype(dtype),
                                                     trust_remote_code=trust_remote_code)
    if len(devices) > 1:
        spread_model(model, devices)
    else:
        model.to(devices[0])
    return model.eval().requires_grad_(False)


class HFTarget:
    """A frozen local causal LM serving the supervision contract (engine "hf").

    ``compile=True`` compiles the decoder layers (:mod:`spec_serve.engines.compiled`): results within
    ``compiled.TOLERANCE`` of the eager forward, bit-equal to another compiled engine of the same model on
    the same device; if compilation fails the engine serves eager (``compile_report`` says why).
    ``compile_cache``: Inductor's cache directory (process-wide; default ``TORCHINDUCTOR_CACHE_DIR``, else
    torch's own). ``compile_packed=False``: an engine that will not be asked for ``generate_packed`` (a worker
    without --packing) does not compile the packed batch class at load; a packed forward would compile it
    when it first comes.

    ``device`` may list several devices (``"cuda:0,cuda:1"``) for a target bigger than one: the
    layers are spread over them in order (:func:`spread_model`) and the outputs are on the last.
    Every module computes what it computes on one device; only exact copies are added between them.
    """

    engine = "hf"

    def __init__(
        self,
        path: str | Path,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
        aux_layer_ids: Sequence[int] | None = None,
        dspark_layer_ids: Sequence[int] | None = None,
        model_name: str | None = None,
        trust_remote_code: bool = False,
        compile: bool = False,
        compile_cache: str | Path | None = None,
        compile_packed: bool = True,
    ):
        from transformers import AutoConfig

        self.path = Path(path)
        # Several devices: one target spread over them (spread_model); outputs live on the last.
        self.devices = parse_devices(device)
        self.device = self.devices[-1]
        config = AutoConfig.from_pretrained(str(self.path), trust_remote_code=trust_remote_code)
        for key in ("final_logit_softcapping", "logit_scale"):
            # Such models post-process lm_head's output; our logits would not equal HF's.
            if getattr(config, key, None) not in (None, 1.0):
                raise NotImplementedError(f"HFTarget does not support models with {key}={getattr(config, key)}")
        # Layer ids are checked before the (at 8B, slow) weight load so a typo fails at once.
        self.num_layers = int(config.num_hidden_layers)
        self.aux_layer_ids = contract.validate_aux_layer_ids(
            contract.default_aux_layer_ids(self.num_layers) if aux_layer_ids is None else aux_layer_ids, self.num_layers
        )
        self.dspark_layer_ids = contract.validate_dspark_layer_ids(
            contract.default_dspark_layer_ids(self.num_layers) if dspark_layer_ids is None else dspark_layer_ids,
            self.num_layers,
        )
        self.model = model = _load_model(self.path, config, dtype, self.devices, trust_remote_code)
        self._base = model.base_model
        self._layers = self._base.layers
        self._lm_head = model.get_output_embeddings()
        self.hidden_size = int(config.hidden_size)
        self.vocab_size = int(self._lm_head.weight.shape[0])
        self.model_name = model_name or os.path.basename(os.path.normpath(str(self.path))) or config._name_or_path
        self._vocab = VocabMappingSlot(self.vocab_size, self.device)
        self._fingerprint: str | None = None
        self._captured: dict[int, torch.Tensor] = {}
        self._wanted: frozenset[int] = frozenset()
        # The hooks share _wanted/_captured, so concurrent forwards would mix their captures.
        self._forward_lock = threading.Lock()
        self._forwards = 0
        self._fault = _test_fault()
        self._install_hooks()
        self._compiled: compiled.CompiledLayers | None = None
        if compile:
            compiled.cache_dir_from(compile_cache)
            self._compiled = compiled.CompiledLayers(self.model, self._layers, self.model_name, self._warm_up,
                                                     packed=compile_packed)
            self._compiled.install(self.devices[0])

    # -- capture ---------------------------------------------------------------------------------

    def _install_hooks(self) -> None:
        # Layer id -1 is the input of the first decoder layer (HF hidden_states[0], which for some
        # models is the scaled embedding, so the embedding module's own output would be wrong).
        def capture_input(module, args, kwargs):
            if -1 in self._wanted:
                self._captured[-1] = args[0] if args else kwargs["hidden_states"]

        self._layers[0].register_forward_pre_hook(capture_input, with_kwargs=True)
        # The last layer's output is never needed from a hook: contract id N-1 is the post-norm state.
        for i, layer in enumerate(self._layers[:-1]):
            layer.register_forward_hook(self._make_capture_output(i))

    def _make_capture_output(self, layer_id: int):
        def capture_output(module, args, output):
            if layer_id in self._wanted:
                # Decoder layers return a tensor (transformers >= 4.56-ish) or a tuple (older/other models).
                self._captured[layer_id] = output[0] if isinstance(output, (tuple, list)) else output

        return capture_output

    def _forward(self, input_ids: torch.Tensor, layer_ids: Sequence[int], **model_kwargs):
        """Final-norm output and ``{layer_id: HF hidden_states[layer_id+1]}`` for ``layer_ids``, shaped like
        ``input_ids`` plus a hidden dimension. ``model_kwargs``: attention_mask, or the packed inputs."""
        with self._forward_lock:
            self._forwards += 1
            if self._fault is not None and self._forwards >= self._fault[1]:
                raise _TEST_FAULTS[self._fault[0]]()
            self._wanted = frozenset(layer_ids)
            self._captured = {}
            try:
                last = self._trunk(input_ids, **model_kwargs)
                captured = dict(self._captured)
            finally:
                self._wanted = frozenset()
                self._captured = {}
        # HF's hidden_states[N] is the final-norm output, so layer N-1 means that (see DESIGN.md).
        captured[self.num_layers - 1] = last
        # Spread over devices, a layer's output is on its own device (.to is a no-op on one device).
        return last, {i: captured[i].to(self.device) for i in layer_ids}

    def _trunk(self, input_ids: torch.Tensor, **model_kwargs) -> torch.Tensor:
        """The decoder's final-norm output (the hooks capture layers on the way); compiled layers that fail
        to compile a new shape fall back to eager and the forward runs again. Under the forward lock."""
        layers = self._compiled if self._compiled is not None and self._compiled.report.active else None
        try:
            with layers.watch(input_ids.shape) if layers is not None else contextlib.nullcontext():
                return self._decoder(input_ids, **model_kwargs)
        except Exception as e:
            if layers is None or not compiled.compile_error(e):
                raise
            layers.fall_back(e)
            self._captured = {}
            return self._decoder(input_ids, **model_kwargs)

    def _decoder(self, input_ids: torch.Tensor, **model_kwargs) -> torch.Tensor:
        with packing.row_attention(self.model) if packing.SEGMENTS_KWARG in model_kwargs \
                else contextlib.nullcontext():
            out = self._base(input_ids=input_ids, use_cache=False, return_dict=True, **model_kwargs)
        return out.last_hidden_state

    @torch.inference_mode()
    def _warm_up(self, rows: int, tokens: int, padding: bool, packed: bool) -> None:
        """One forward of ``rows`` x ``tokens`` (with ``padding``, or ``packed`` as one sequence), so that compiled
        layers compile that class of batch (``compiled.WARMUP``). A model that cannot pack skips the packed class."""
        if packed and self.packing_unsupported() is not None:
            return
        ids = (torch.arange(rows * tokens) % self.vocab_size).view(rows, tokens).to(self.devices[0])
        mask = torch.ones_like(ids)
        if padding:  # the last row half padding
            mask[-1, tokens // 2:] = 0
        with self._forward_lock:
            if packed:
                layout = packing.PackedLayout.build([(ids, mask, mask)]).to(self.devices[0], self.device)
                self._decoder(layout.input_ids, position_ids=layout.position_ids,
                              **{packing.SEGMENTS_KWARG: layout.bounds})
            else:
                self._decoder(ids, attention_mask=mask)

    @property
    def compile_report(self) -> compiled.CompileReport | None:
        """What ``compile=True`` did (compiled or eager and why, seconds, graphs, recompiles); None without it."""
        return None if self._compiled is None else self._compiled.report

    def _per_token(self, kind: Kind, mapping, input_ids: torch.Tensor, **model_kwargs) -> dict[str, torch.Tensor]:
        """The forward's outputs for each token of ``input_ids`` (``assemble.per_token``).

        ``lm_head`` is the model's own module on the final-norm output: the same op on the same
        tensor as ``LlamaForCausalLM.forward``, so its logits equal ``model(...).logits``.
        """
        ids = assemble.layer_ids(kind, self.aux_layer_ids, self.dspark_layer_ids)
        last, layers = self._forward(input_ids, ids, **model_kwargs)
        return assemble.per_token(kind, last, layers, ids, self._lm_head, mapping)

    def _model_mask(self, attention_mask: torch.Tensor) -> torch.Tensor | None:
        """The padding mask the model gets, on the engine's device. Compiled layers get none for right-padded
        rows: under the causal mask alone each real position attends to the same (real) keys, and attention runs
        flash's causal kernel instead of the memory-efficient one a padding mask calls for (cuDNN's is kept out
        of compiled layers: ``packing.any_length_attention``). Padded positions then hold values of their own
        (docs/compile.md, "Padded rows"); eager layers keep the mask, as the contract's HF forward has it."""
        layers = self._compiled
        if layers is not None and layers.report.active and contract.right_padded(attention_mask):
            return None
        return attention_mask.to(self.device, torch.int64)

    # -- public API ------------------------------------------------------------------------------

    @torch.inference_mode()
    def generate_batch(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        loss_mask: torch.Tensor,
        kind: str | Kind = "eagle3",
    ) -> dict[str, torch.Tensor]:
        """Run the target on one right-padded ``[B,S]`` batch; return the contract tensors of ``kind``.

        Inputs may live on any device; outputs are on the engine's device. ``ValueError`` for an
        invalid request, ``RuntimeError`` for EAGLE-3 before ``set_vocab_mapping``.
        """
        kind = self._check_request(kind, input_ids, attention_mask, loss_mask)
        input_ids = input_ids.to(self.device, torch.int64)
        model_mask = self._model_mask(attention_mask)
        loss_mask = loss_mask.to(self.device)
        mapping = self._vocab.on_device
        per_token = self._per_token(kind, mapping, input_ids, attention_mask=model_mask)
        return assemble.contract_tensors(kind, per_token, input_ids, loss_mask, mapping)

    @torch.inference_mode()
    def generate_packed(
        self,
        requests: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        kind: str | Kind = "eagle3",
    ) -> list[dict[str, torch.Tensor]]:
        """``generate_batch`` for each ``(input_ids, attention_mask, loss_mask)`` request, in one packed forward.

        The real tokens of every row of every request run as one sequence, each row attending only to
        itself (``spec_serve.engines.packing``); the results come back in each request's padded layout. They
        match ``generate_batch`` of each request alone at real positions up to kernel rounding
        (``packing.TOLERANCE``); padded positions hold what docs/packing.md states. ``ValueError``
        for an invalid request or one that cannot be packed (``packing.row_lengths``).
        """
        kind = Kind.parse(kind)
        for request in requests:
            self._check_request(kind, *request)
        reason = self.packing_unsupported()
        if reason is not None:
            raise NotImplementedError(reason)
        layout = packing.PackedLayout.build(requests).to(self.devices[0], self.device)
        mapping = self._vocab.on_device
        per_token = self._per_token(kind, mapping, layout.input_ids, position_ids=layout.position_ids,
                                    **{packing.SEGMENTS_KWARG: layout.bounds})
        outputs = []
        for i, (input_ids, _, loss_mask) in enumerate(requests):
            padded = {name: layout.scatter(t, i) for name, t in per_token.items()}
            outputs.append(assemble.contract_tensors(kind, padded, input_ids.to(self.device, torch.int64),
                                                     loss_mask.to(self.device), mapping))
        return outputs

    def packing_unsupported(self) -> str | None:
        """Why this model cannot run ``generate_packed``, or None if it can."""
        reason = packing.unsupported_reason(self.model)
        return None if reason is None else f"{self.model_name}: {reason}"

    def _check_request(self, kind: str | Kind, input_ids, attention_mask, loss_mask) -> Kind:
        kind = Kind.parse(kind)
        contract.validate_request(input_ids, attention_mask, loss_mask, self.vocab_size)
        if kind is Kind.EAGLE3 and self._vocab.on_device is None:
            raise RuntimeError("EAGLE-3 needs a draft-vocab mapping: call set_vocab_mapping() first")
        return kind

    def set_vocab_mapping(self, selected_token_ids: torch.Tensor, selected_token_mask: torch.Tensor) -> None:
        """Install the draft-vocab mapping EAGLE-3 batches are computed with (``ValueError`` if invalid)."""
        self._vocab.set(selected_token_ids, selected_token_mask)

    def vocab_mapping(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The current ``(selected_token_ids, selected_token_mask)`` on CPU, or ``None`` if unset."""
        return self._vocab.get()

    def target_info(self) -> TargetInfo:
        """What this engine serves, as checked by clients at setup."""
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self.path)
        return TargetInfo(
            num_hidden_layers=self.num_layers,
            hidden_size=self.hidden_size,
            vocab_size=self.vocab_size,
            aux_layer_ids=tuple(self.aux_layer_ids),
            dspark_layer_ids=tuple(self.dspark_layer_ids),
            model_name=self.model_name,
            dtype=str(self.model.dtype).removeprefix("torch."),
            engine=self.engine,
            fingerprint=self._fingerprint,
        )

    def get_input_embeddings(self) -> torch.nn.Module:
        """The input embedding module (``.weight`` ``[V, H]``)."""
        return self.model.get_input_embeddings()

    def get_output_embeddings(self) -> torch.nn.Module:
        """The lm_head (``.weight`` ``[V, H]``); for tied models that weight is the input embedding's."""
        return self._lm_head

    def close(self) -> None:
        """Nothing to release: the model lives in this process and goes with it."""
