"""A target with no model, for transport-only benchmarks: ``NullEngine`` answers every request with ready
tensors of the Llama-3.1-8B reply shape (hidden 4096, vocab 128256, draft vocab 32000, bf16), full EAGLE-3
(149 KiB a token) or compact (32 KiB a token; 20 KiB with wire_dtype="fp8"), so figures measured on a CPU box
and on a GPU machine move the same bytes. Its target info says that shape, so clients check replies against it
as against any worker's; the draft-vocab mapping it is used with is ``null_mapping()``.
"""

from __future__ import annotations

import math
import signal
import time
import types
from typing import TYPE_CHECKING, cast

import torch

from spec_serve.supervision.contract import TargetInfo, default_dspark_layer_ids

if TYPE_CHECKING:
    from spec_serve.engines.base import TargetEngine

HIDDEN, VOCAB, DRAFT_VOCAB, LAYERS = 4096, 128256, 32000, 32
INFO = TargetInfo(num_hidden_layers=LAYERS, hidden_size=HIDDEN, vocab_size=VOCAB, aux_layer_ids=(1, 15, 28),
                  dspark_layer_ids=tuple(default_dspark_layer_ids(LAYERS)), model_name="null-llama-3.1-8b-shape",
                  dtype="bfloat16", engine="null", fingerprint="0" * 32)


def null_mapping() -> tuple[torch.Tensor, torch.Tensor]:
    """The draft-vocab mapping null replies are shaped for: the first ``DRAFT_VOCAB`` target ids."""
    ids = torch.arange(DRAFT_VOCAB, dtype=torch.int64)
    mask = torch.zeros(VOCAB, dtype=torch.bool)
    mask[ids] = True
    return ids, mask


def null_tensors(batch: int, seq: int, kind: str = "eagle3") -> dict[str, torch.Tensor]:
    """Ready-made reply tensors of the real shapes: EAGLE-3 (bf16 aux, f32 probs) or compact EAGLE-3 (bf16
    aux and last hidden state, int32 argmax)."""
    common = {"input_ids": torch.zeros(batch, seq, dtype=torch.int64),
              "loss_mask": torch.ones(batch, seq, dtype=torch.int64)}
    aux = torch.ones(batch, seq, 3 * HIDDEN, dtype=torch.bfloat16)
    if kind == "eagle3_compact":
        return {"aux_hidden_states": aux, "last_hidden_states": torch.ones(batch, seq, HIDDEN, dtype=torch.bfloat16),
                "argmax_ids": torch.zeros(batch, seq, dtype=torch.int32), **common}
    return {"aux_hidden_states": aux, "target_probs": torch.full((batch, seq, DRAFT_VOCAB), 1.0 / DRAFT_VOCAB),
            "position_mask": torch.ones(batch, seq, 1, dtype=torch.bool), **common}


class Constants:
    """Tensors each of one value throughout, handed out as views of one flat buffer per name, grown to the
    largest shape asked: no allocation per new shape (rows of varying length ask a new one nearly every
    batch), memory bounded by the largest reply. A name always holds the same value; the views are only read
    (replies are sent, never written)."""

    def __init__(self) -> None:
        self._flat: dict[str, torch.Tensor] = {}

    def view(self, name: str, value: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        n = math.prod(shape)
        flat = self._flat.get(name)
        if flat is None or flat.numel() < n:
            flat = self._flat[name] = value.reshape(1).expand(max(n, 1)).contiguous()
        return flat[:n].view(shape)


class NullEngine:
    """Answers every request with ``null_tensors`` of the request's shape (``Constants`` views: no work per
    shape), after ``forward_s`` seconds of an emulated forward (a sleep: it frees the GIL, as a GPU forward
    mostly does)."""

    engine = "null"

    def __init__(self, forward_s: float = 0.0) -> None:
        self.forward_s = forward_s
        self._constants = Constants()
        # An lm_head of zeros that takes no memory (one row, broadcast): a compact client's slice of it
        # (index_select) is the only copy.
        self._lm_head = types.SimpleNamespace(weight=torch.zeros(1, HIDDEN, dtype=torch.bfloat16).expand(VOCAB, HIDDEN))

    def target_info(self) -> TargetInfo:
        return INFO

    def set_vocab_mapping(self, ids: torch.Tensor, mask: torch.Tensor) -> None:
        pass

    def get_output_embeddings(self) -> types.SimpleNamespace:
        return self._lm_head

    def generate_batch(self, input_ids, attention_mask, loss_mask, kind="eagle3"):
        if self.forward_s:
            time.sleep(self.forward_s)
        rows, seq = input_ids.shape
        return {name: self._constants.view(f"{kind}.{name}", one.reshape(-1)[0], (rows, seq, *one.shape[2:]))
                for name, one in null_tensors(1, 1, kind).items()}


def quantize_once() -> None:
    """In this process, the worker's ``fp8.quantize_reply`` of ``NullEngine``'s replies costs no quantizing: each
    of their tensors holds one value throughout (``null_tensors``), so its FP8 form does too, and is handed
    out as a view of a buffer of that value (``Constants``). A transport figure then moves FP8 bytes at the
    link's pace rather than at this CPU's quantizing pace (a GPU worker quantizes at its memory's bandwidth);
    the bench checks every reply against the real ``quantize_reply`` of the same tensors."""
    from spec_serve.supervision import fp8

    constants = Constants()

    def once(tensors: dict[str, torch.Tensor], names: tuple[str, ...], block: int) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if name not in names:
                out[name] = t
                continue
            q, scale = fp8.quantize_blocks(t.reshape(-1)[:block], block)  # one block: the value's form
            out[name] = constants.view(name, q[0], tuple(t.shape))
            scale_name = name + fp8.SCALE_SUFFIX
            out[scale_name] = constants.view(scale_name, scale[0], (*t.shape[:-1], t.shape[-1] // block))
        return out

    fp8.quantize_reply = once


def run_worker(broker: str, service: str, forward_s: float = 0.0, capacity: int = 2) -> None:
    """A worker of ``capacity`` serving ``NullEngine(forward_s)`` until SIGTERM (its FP8 replies quantized once
    each: ``quantize_once``)."""
    from spec_serve.worker.server import Worker

    quantize_once()

    # cast: a transport-only stand-in (generate requests and lm_head slices; nothing to close)
    worker = Worker(cast("TargetEngine", NullEngine(forward_s)), broker, service=service, capacity=capacity)
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    worker.run()
