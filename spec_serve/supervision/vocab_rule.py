"""A draft-vocab mapping's rule and content digest on numpy arrays, without torch.

The broker checks and digests the mappings clients register straight from their wire bytes (it never
imports torch); ``contract.validate_vocab_mapping`` applies this same rule to tensors.
"""

from __future__ import annotations

import hashlib

import numpy as np

IDS_RULE = "selected_token_ids must be a non-empty 1-D int64 tensor"
MASK_RULE = "selected_token_mask must be a 1-D bool tensor"


def validate_mapping(ids: np.ndarray, mask: np.ndarray, vocab_size: int | None = None) -> None:
    """Raise ``ValueError`` unless (ids, mask) is a consistent draft-vocab mapping.

    ``ids``: int64 ``[Vd]``, distinct target ids in ``[0, V)``; ``mask``: bool ``[V]``, True exactly at
    those ids.
    """
    if ids.dtype != np.int64 or ids.ndim != 1 or ids.size == 0:
        raise ValueError(IDS_RULE)
    if mask.dtype != np.bool_ or mask.ndim != 1:
        raise ValueError(MASK_RULE)
    if vocab_size is not None and mask.size != vocab_size:
        raise ValueError(f"selected_token_mask has {mask.size} entries, the target vocab has {vocab_size}")
    if int(ids.min()) < 0 or int(ids.max()) >= mask.size:
        raise ValueError(f"selected_token_ids must lie in [0, {mask.size})")
    if np.unique(ids).size != ids.size:
        raise ValueError("selected_token_ids must be distinct")
    if int(mask.sum()) != ids.size or not bool(mask[ids].all()):
        raise ValueError("selected_token_mask must be True exactly at selected_token_ids")


def mapping_digest(ids: np.ndarray, mask: np.ndarray) -> str:
    """Content address of a draft-vocab mapping: equal mappings, equal digests."""
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(ids, dtype="<i8").tobytes())
    h.update(np.ascontiguousarray(mask, dtype=np.bool_).tobytes())
    return h.hexdigest()[:32]
