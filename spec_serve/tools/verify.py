"""Is a remote batch what the colocated forward gives for the same input? (``spec-serve bench``,
``benchmarks/gpu_matrix.py`` and the tests.)

The contract (docs/equality.md) in two parts. Each shard is bit-equal (``torch.equal``, tensor by
tensor) to the colocated forward of the same rows in the same batch composition: the reference is
computed as a remote client receives it, each shard's rows by themselves, concatenated; a compact batch
expanded on the client's device after gathering, from the lm_head slice the client caches. The
assembled batch equals the unsharded forward bit for bit where the kernels are batch-invariant for
the two compositions (measured here: both are computed colocated), and lies within the target's
derived ``CompositionTolerance`` of it elsewhere.

A compact batch is also held to a reference that shares no code with the client's expansion: the
colocated *full* EAGLE-3 forward of the same composition (``full_reference_violations``), so a bug in
``expand_compact`` cannot cancel out of the comparison.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch

from spec_serve.client.api import shard_bounds
from spec_serve.supervision import fp8
from spec_serve.supervision.contract import FP8_TENSORS, Kind, model_dtype
from spec_serve.supervision.eagle3 import expand_compact, lm_head_slice
from spec_serve.supervision.tolerance import CompositionTolerance, ReferenceLogits, measure


def sharded_forward(engine, batch: tuple[torch.Tensor, ...], wire_kind: str,
                    shards: int = 1) -> dict[str, torch.Tensor]:
    """``engine``'s outputs of ``wire_kind`` for ``batch`` (input_ids, attention_mask, loss_mask), each of
    the client's ``shards`` row ranges computed alone, concatenated; on the engine's device."""
    parts = [engine.generate_batch(*(t[lo:hi] for t in batch), kind=wire_kind)
             for lo, hi in shard_bounds(batch[0].shape[0], shards)]
    return parts[0] if len(parts) == 1 else {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def expanded(compact: Mapping[str, torch.Tensor], weight: torch.Tensor, selected_mask: torch.Tensor,
             device: torch.device | str) -> dict[str, torch.Tensor]:
    """A compact batch expanded on ``device``, as a client there does (``weight``: the lm_head slice)."""
    device = torch.device(device)
    return expand_compact({k: v.to(device) for k, v in compact.items()}, weight.to(device), selected_mask.to(device))


def fp8_round_trip(engine, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (``engine``'s outputs) as a wire_dtype="fp8" client gets them: each hidden state quantized
    as the worker does and restored to the model dtype as the client does (supervision/fp8.py)."""
    info = engine.target_info()
    return fp8.restore_reply(fp8.quantize_reply(dict(tensors), FP8_TENSORS, info.hidden_size),
                             model_dtype(info))


def colocated_reference(engine, batch: tuple[torch.Tensor, ...], kind: str, *, shards: int = 1,
                        compact: bool = False, device: torch.device | str | None = None,
                        selected: tuple[torch.Tensor, torch.Tensor] | None = None,
                        wire_fp8: bool = False) -> dict[str, torch.Tensor]:
    """``engine``'s answer to ``batch`` as a client with ``shards`` shards gets it, on the engine's
    device; with ``wire_fp8``, its hidden states put through FP8 (``fp8_round_trip``); with ``compact``
    (EAGLE-3), expanded on ``device`` with the draft-vocab mapping ``selected`` = (selected_token_ids,
    selected_token_mask)."""
    out = sharded_forward(engine, batch, "eagle3_compact" if compact else kind, shards)
    if wire_fp8:
        out = fp8_round_trip(engine, out)
    if not compact:
        return out
    if selected is None:
        raise ValueError("a compact reference needs the draft-vocab mapping (selected)")
    weight = lm_head_slice(engine.get_output_embeddings().weight, selected[0])
    return expanded(out, weight, selected[1], device or engine.device)


def mismatch(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor], *,
             bits: bool = False) -> str | None:
    """None when ``got`` equals ``want`` (names, dtypes, shapes, values: ``torch.equal``); else what differs.
    With ``bits``, values are compared as raw bytes (``words``): about 3x faster on a CPU, and a NaN equals the
    same NaN; for a transport's checks, where the bytes sent are the claim."""
    if sorted(got) != sorted(want):
        return f"tensors {sorted(got)} != {sorted(want)}"
    for name, w in want.items():
        g = got[name]
        if g.dtype != w.dtype or g.shape != w.shape:
            return f"{name}: {g.dtype}{list(g.shape)} != {w.dtype}{list(w.shape)}"
        w = w.to(g.device)
        if bits or (g.is_floating_point() and g.element_size() == 1):  # torch.equal's float8 is slow
            if torch.equal(*words(g, w)):
                continue
        elif torch.equal(g, w):
            continue
        if g.is_floating_point():
            diff = (g.float() - w.float()).abs().max().item()
            return f"{name}: max abs diff {diff:.3g}" + (" (bytes differ: a signed zero or NaN)" if diff == 0 else "")
        return f"{name}: {int((g != w).sum())} elements differ"
    return None


_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def words(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Views of the bytes of ``tensors`` (one dtype) as the widest integers all their layouts allow (8 bytes
    where each last dimension is contiguous and its rows align): compared element by element, as torch.equal
    does, in fewer, wider steps."""
    flat = [t.reshape(1) if t.dim() == 0 else t for t in tensors]
    for size in (8, 4, 2):
        if size > flat[0].element_size():
            try:
                return [t.view(_WORDS[size]) for t in flat]
            except RuntimeError:
                continue  # a last dimension is strided, or its bytes do not divide into such words
    return [t.view(_WORDS[t.element_size()]) for t in flat]


# A fingerprint's weights: one fixed pseudo-random odd 32-bit word per position (splitmix64 of the position),
# kept per device and grown as larger tensors come (the same words whatever the length: a prefix never changes).
_weights: dict[torch.device, torch.Tensor] = {}


def _signed64(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_WEIGHT_CHUNK = 1 << 24  # positions mixed at a time (int64 temporaries of 128 MiB, not of the whole tensor)


def _position_weights(n: int, device: torch.device) -> torch.Tensor:
    have = _weights.get(device)
    if have is None or have.numel() < n:
        have = _weights[device] = torch.empty(max(n + n // 4, 1024), dtype=torch.int32, device=device)
        for lo in range(0, have.numel(), _WEIGHT_CHUNK):
            x = torch.arange(lo, min(lo + _WEIGHT_CHUNK, have.numel()), dtype=torch.int64, device=device)
            x = x * _signed64(0x9E3779B97F4A7C15)
            x = (x ^ (x >> 30)) * _signed64(0xBF58476D1CE4E5B9)  # int64 products wrap: splitmix64's mixing
            x = (x ^ (x >> 27)) * _signed64(0x94D049BB133111EB)
            have[lo : lo + x.numel()] = ((x ^ (x >> 31)) | 1).to(torch.int32)  # the low 32 bits, odd
    return have[:n]


Fingerprint = tuple[torch.dtype, tuple[int, ...], torch.Tensor]


def fingerprint(tensors: Mapping[str, torch.Tensor]) -> dict[str, Fingerprint]:
    """Each tensor's dtype, shape and two wrapping 32-bit sums of its bytes read as words: plain, and each
    word times its position's weight. Queued on the tensors' device, not synchronized (read with ``.tolist()``
    once the clock stopped), so a bench can check many batches without keeping them.

    Equal tensors give equal fingerprints; a difference goes unnoticed with probability about 2**-32 per
    tensor (the weights are fixed pseudo-random odd words: any change confined to one word always shows, and
    rows swapped or shifted change the weighted sum like a random change would)."""
    out = {}
    for name, t in tensors.items():
        data = t.detach().reshape(-1).contiguous().view(torch.uint8)
        if data.numel() % 4:
            padded = torch.zeros((data.numel() + 3) // 4 * 4, dtype=torch.uint8, device=data.device)
            padded[: data.numel()] = data
            data = padded
        words = data.view(torch.int32)
        weighted = (words * _position_weights(words.numel(), words.device)).sum(dtype=torch.int32)
        out[name] = (t.dtype, tuple(t.shape), torch.stack([words.sum(dtype=torch.int32), weighted]))
    return out


def fingerprint_mismatch(got: Mapping[str, Fingerprint], want: Mapping[str, Fingerprint]) -> str | None:
    """None when two fingerprints agree (names, dtypes, shapes, sums); else what differs."""
    if sorted(got) != sorted(want):
        return f"tensors {sorted(got)} != {sorted(want)}"
    for name, (dtype, shape, sums) in want.items():
        g_dtype, g_shape, g_sums = got[name]
        if (g_dtype, g_shape) != (dtype, shape):
            return f"{name}: {g_dtype}{list(g_shape)} != {dtype}{list(shape)}"
        if g_sums.tolist() != sums.tolist():
            return f"{name}: bytes differ (fingerprint {g_sums.tolist()} != {sums.tolist()})"
    return None


def tolerance_for(engine) -> CompositionTolerance:
    """``engine``'s derived composition tolerance: its dtype, depth and longest reduction (the MLP's
    intermediate size; 4 x hidden where the config does not say)."""
    config = engine.model.config
    hidden = int(config.hidden_size)
    reduction = max(hidden, int(getattr(config, "intermediate_size", None) or 4 * hidden))
    return CompositionTolerance.derive(engine.model.dtype, int(config.num_hidden_layers), reduction)


def reference_logits(engine, batch: tuple[torch.Tensor, ...]) -> ReferenceLogits:
    """The full-vocab logits of ``engine``'s unsharded forward of ``batch``, as the tolerance of
    ``target_probs`` and of an argmax needs them."""
    last = engine.generate_batch(*batch, kind=Kind.EAGLE3_COMPACT.value)["last_hidden_states"]
    with torch.inference_mode():
        return ReferenceLogits.of(engine.get_output_embeddings()(last))


def full_reference_violations(got: Mapping[str, torch.Tensor], engine, batch: tuple[torch.Tensor, ...], *,
                              shards: int = 1) -> list[str]:
    """A compact client's expanded EAGLE-3 batch against ``engine``'s colocated full EAGLE-3 forward of the same
    composition, one line per tensor outside the contract (empty: within it). Every tensor but
    ``target_probs`` is bit-equal: the same forward's hidden states, the target's own argmax (so
    ``position_mask`` but at a near-tie within that rounding), the request's ids and mask. ``target_probs``
    differ by one GEMM's rounding at most: the client's draft logits come from the ``[Vd, H]`` lm_head slice
    instead of the ``[V, H]`` lm_head, one reduction of length H in another order
    (``CompositionTolerance.one_gemm``), scaled by 2 max|logit| as every probability bound is."""
    full = colocated_reference(engine, batch, "eagle3", shards=shards)
    if mismatch(got, full) is None:
        return []
    tolerance = CompositionTolerance.one_gemm(engine.model.dtype, engine.hidden_size)
    return [f"{line} (against the full forward)"
            for line in tolerance.violations(got, full, reference_logits(engine, batch))]


@dataclasses.dataclass
class ContractCheck:
    """One batch against the contract: ``shard_mismatch`` (None: every shard bit-equal to the colocated
    forward of its rows); ``invariant`` (the kernels gave the per-shard and the unsharded compositions the
    same bits); ``violations`` of the tolerance by the assembled batch where they did not, and its
    ``deviation`` from the unsharded forward (per tensor that differs); for a compact batch, ``off_full``: how it
    lies outside the contract against the colocated full forward (``full_reference_violations``)."""

    shards: list[tuple[int, int]]
    shard_mismatch: str | None
    invariant: bool
    violations: list[str]
    deviation: dict[str, dict[str, float]]
    off_full: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.shard_mismatch is None and not self.violations and not self.off_full

    def describe(self) -> str:
        if self.off_full:
            return f"the compact batch expanded is off the colocated full forward: {'; '.join(self.off_full)}"
        if self.shard_mismatch is not None:
            return f"a shard differs from the colocated forward of its rows: {self.shard_mismatch}"
        if self.invariant:
            return f"bit-equal per shard {self.shards} and to the unsharded forward (batch-invariant kernels)"
        worst = ", ".join(f"{name} " + " ".join(f"{k} {v:.2g}" for k, v in m.items())
                          for name, m in self.deviation.items())
        within = "within the tolerance" if not self.violations else "OUTSIDE the tolerance: " + "; ".join(
            self.violations)
        return f"bit-equal per shard {self.shards}; the kernels are batch-variant here: {within} ({worst})"


@dataclasses.dataclass
class Composition:
    """The contract's second part for one batch: the per-shard reference against the unsharded one, both
    colocated. ``invariant``: the same bits; else the tolerance's ``violations`` (none: within it) and the
    ``deviation`` measured (per tensor that differs)."""

    invariant: bool
    violations: list[str]
    deviation: dict[str, dict[str, float]]


def composition(per_shard: Mapping[str, torch.Tensor], whole: Mapping[str, torch.Tensor],
                tolerance: CompositionTolerance, logits: Callable[[], ReferenceLogits | None]) -> Composition:
    """``per_shard`` against ``whole``; ``logits`` (the unsharded forward's, None for DSpark) is called only
    where the two differ, since it costs a forward."""
    if mismatch(per_shard, whole) is None:
        return Composition(True, [], {})
    return Composition(False, tolerance.violations(per_shard, whole, logits()), measure(per_shard, whole))


def check_contract(got: Mapping[str, torch.Tensor], engine, batch: tuple[torch.Tensor, ...], kind: str, *,
                   shards: int = 1, compact: bool = False, device: torch.device | str | None = None,
                   selected: tuple[torch.Tensor, torch.Tensor] | None = None,
                   tolerance: CompositionTolerance | None = None) -> ContractCheck:
    """``got``, a client's batch (``shards``, ``compact`` and ``device`` as it was configured), against both
    parts of the contract, with ``engine`` colocated (see the module docstring)."""
    bounds = shard_bounds(batch[0].shape[0], shards)
    per_shard = colocated_reference(engine, batch, kind, shards=shards, compact=compact, device=device,
                                    selected=selected)
    wrong = mismatch(got, per_shard)
    whole = per_shard if len(bounds) == 1 else colocated_reference(engine, batch, kind, compact=compact,
                                                                     device=device, selected=selected)
    part2 = composition(per_shard, whole, tolerance or tolerance_for(engine),
                        lambda: None if kind == Kind.DSPARK.value else reference_logits(engine, batch))
    off_full = full_reference_violations(got, engine, batch, shards=shards) if compact else []
    return ContractCheck(bounds, wrong, part2.invariant, part2.violations, part2.deviation, off_full)
