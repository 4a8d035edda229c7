"""How many argmax flips a deviation within the tolerance causes: the flip bound, measured on the reference.

``argmax_ids`` and ``position_mask`` come from the full-vocab argmax of the logits. A forward that deviates
from the reference (compiled kernels, another batch composition, packing) moves the final hidden state by
some relative size ``rho``; through lm_head that moves each logit by about ``rho`` times its own scale, and
the argmax flips where the reference's top-2 margin is smaller than that move. So the flip rate is not a
quantity of its own: it is what the hidden states' deviation implies, and how much depends on the logits
(flat random-weight logits have near-ties everywhere; a trained model's have few). The bound is therefore
taken from the reference itself: its forward again, with lm_head's input (the final-norm output) moved at
every position in a random direction by ``rho`` of its norm, where ``rho`` is the tolerance's hidden
rel_norm; the flips of that forward against the unmoved one, plus their sampling error, are as many flips
as a deviation at the tolerance's edge causes on these rows (docs/compile.md, "Why these bounds").
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

from spec_serve.engines import packing

# The flip rates of the bound, and of what is checked against it, are each counted over n positions: the
# bound allows SAMPLING_SIGMAS binomial standard deviations of their difference on top.
SAMPLING_SIGMAS = 3.0


@contextlib.contextmanager
def moved_final_hidden(engine, rel_norm: float, seed: int = 0) -> Iterator[None]:
    """Within this block ``engine``'s lm_head sees its input moved, at each position, by ``rel_norm`` of that
    position's norm in a random direction (seeded), computed in float32 and rounded to the model dtype."""
    head = engine.get_output_embeddings()
    generator = torch.Generator(device=head.weight.device).manual_seed(seed)

    def move(module, args):
        hidden = args[0].float()
        noise = torch.randn(hidden.shape, generator=generator, device=hidden.device, dtype=torch.float32)
        scale = rel_norm * hidden.norm(dim=-1, keepdim=True) / math.sqrt(hidden.shape[-1])
        return ((hidden + noise * scale).to(args[0].dtype), *args[1:])

    handle = head.register_forward_pre_hook(move)
    try:
        yield
    finally:
        handle.remove()


def flip_bound(engine, batch: tuple[torch.Tensor, ...], rel_norm: float, kind: str = "eagle3",
               reference: dict[str, torch.Tensor] | None = None, seed: int = 0) -> dict[str, float]:
    """Per argmax tensor of ``kind`` (``position_mask``, ``argmax_ids``), the most flips a forward of ``batch``
    within ``rel_norm`` of ``engine``'s may show: the rate measured with the final hidden state moved by
    ``rel_norm`` (``moved_final_hidden``) against ``reference`` (``engine``'s own forward; computed if not
    given), plus SAMPLING_SIGMAS standard deviations of the difference of two rates over those positions."""
    if reference is None:
        reference = engine.generate_batch(*batch, kind=kind)
    with moved_final_hidden(engine, rel_norm, seed):
        moved = engine.generate_batch(*batch, kind=kind)
    mask = batch[1].to(engine.device)
    positions = mask.numel()
    rates = {name: m["flip_rate"] for name, m in packing.compare(moved, reference, mask).items() if "flip_rate" in m}
    return {name: rate + SAMPLING_SIGMAS * math.sqrt(2 * rate * (1 - rate) / positions) for name, rate in rates.items()}
