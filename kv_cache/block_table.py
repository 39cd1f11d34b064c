"""Block tables and slot mappings, vectorised with numpy.

A slot is a flat index into a layer's cache of shape [num_blocks * block_size, ...]: the token at
position ``pos`` of a request lives in slot ``table[pos // block_size] * block_size + pos % block_size``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def build_block_table(block_ids: Sequence[Sequence[int]], pad: int = 0) -> np.ndarray:
    """Stack ragged per-request block lists into one [num_reqs, max_blocks] int64 array."""
    width = max((len(ids) for ids in block_ids), default=0)
    table = np.full((len(block_ids), max(width, 1)), pad, dtype=np.int64)
    for row, ids in enumerate(block_ids):
        table[row, : len(ids)] = ids
    return table


def compute_slot_mapping(
    block_table: np.ndarray, req_indices: np.ndarray, positions: np.ndarray, block_size: int
) -> np.ndarray:
    """Slot of each token, given its request's row in ``block_table`` and its position.

    >>> t = build_block_table([[7, 2], [5]])
    >>> compute_slot_mapping(t, np.array([0, 0, 1]), np.array([3, 4, 1]), block_size=4).tolist()
    [31, 8, 21]
    """
    return block_table[req_indices, positions // block_size] * block_size + positions % block_size
