"""The batches a run times: row lengths (log-normal, full, or a dataset's), right-padded batches, and the math
threads a worker gets."""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_batch(batch: int, seq: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full-length rows (every token counts), random ids, loss on the last three quarters."""
    return padded_batch([seq] * batch, vocab, seed)


# The log-normal workload: median LOGNORMAL_MEDIAN_SHARE * seq, spread LOGNORMAL_SIGMA (ln units). At
# seq 2048: median 600, 6% of rows at the cap, about 55% of a 4-row batch real tokens (issue 16).
LOGNORMAL_MEDIAN_SHARE = 600 / 2048


LOGNORMAL_SIGMA = 0.8


def row_lengths(spec: str, batches: int, rows: int, seq: int) -> list[list[int]]:
    """Each batch's row lengths for the ``--lengths`` spec (see the module doc); batch ``i`` uses seed ``i``."""
    if spec == "full":
        return [[seq] * rows for _ in range(batches)]
    if spec == "lognormal":
        median = math.log(LOGNORMAL_MEDIAN_SHARE * seq)
        draws = [torch.randn(rows, generator=torch.Generator().manual_seed(i)) for i in range(batches)]
        return [[min(seq, max(2, round(math.exp(median + LOGNORMAL_SIGMA * float(z))))) for z in d] for d in draws]
    pool = _jsonl_lengths(Path(spec))
    picks = [torch.randint(len(pool), (rows,), generator=torch.Generator().manual_seed(i)) for i in range(batches)]
    return [[min(seq, max(2, pool[int(j)])) for j in p] for p in picks]


def _jsonl_lengths(path: Path) -> list[int]:
    if not path.is_file():
        raise ValueError(f"--lengths {path}: not 'full', 'lognormal' or an existing JSONL file")
    lengths = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            n = int(row["length"]) if "length" in row else len(row["input_ids"])
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path}:{number}: expected {{\"length\": N}} or {{\"input_ids\": [...]}}") from None
        lengths.append(n)
    if not lengths:
        raise ValueError(f"{path}: no rows")
    return lengths


def padded_batch(lengths: list[int], vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of these lengths, right-padded (pad id 0) to the longest; random ids, loss on each row's last
    three quarters. All lengths equal to ``seq``: the same batch as ``make_batch``."""
    gen = torch.Generator().manual_seed(seed)
    batch, seq = len(lengths), max(lengths)
    positions = torch.arange(seq)[None, :]
    n = torch.tensor(lengths)[:, None]
    attn = (positions < n).to(torch.int64)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen) * attn
    loss = attn * (positions >= n // 4)
    return ids, attn, loss


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _tokens(batches) -> tuple[int, int]:
    """(real, padded) tokens of host batches (counted on the host: no device sync in a timed loop)."""
    return sum(int(b[1].sum()) for b in batches), sum(b[1].numel() for b in batches)


@contextlib.contextmanager
def worker_threads(device: torch.device):
    """On CPU, run with the math threads one worker gets (``launch`` starts each with OMP_NUM_THREADS,
    1 unless set): more threads than that, on cores the workers share, measure oversubscription (on
    the loaded 2-core box a 2-thread forward ran 25x slower than a 1-thread one) instead of the forward."""
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        yield
    finally:
        torch.set_num_threads(before)
