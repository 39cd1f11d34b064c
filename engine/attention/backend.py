"""The attention-backend interface and the per-step metadata every layer reads.

A step is one packed batch of ragged segments (one per scheduled request). Each query token attends to

  (a) its request's cached prefix: the ``context_lens[s]`` tokens already in the paged cache, no mask
      (every token of the step comes after them), and
  (b) the tokens of its own segment, under the segment's mask (causal by default),

and the two parts are merged exactly by their log-sum-exps. Tokens that are committed as they run
(prefill chunks, plain decodes) are written to the cache first, so for them (a) and (b) can also be one
attention over the cache; lookahead segments are transient and always take the split. GPU backends
implement the same contract.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    num_tokens: int
    query_start_loc: list[int]  # [num_segs + 1] offsets of each segment in the packed batch
    context_lens: list[int]  # [num_segs] cached-prefix length of each segment
    block_tables: torch.Tensor  # [num_segs, max_blocks] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 = transient, never written to the cache
    block_size: int
    # Tokens whose K/V go to the cache as the layer runs (all of them, or an index subset).
    write_all: bool
    write_token_idx: torch.Tensor  # [num_written]
    write_slots: torch.Tensor  # [num_written]
    # Decode segments (one query token) batched together: the token attends to its prefix and itself,
    # all in the cache once written. Slots are padded with 0 and masked.
    decode_segs: list[int]
    decode_token_idx: torch.Tensor  # [num_decodes]
    decode_slots: torch.Tensor  # [num_decodes, max_ctx + 1] int64
    decode_mask: torch.Tensor  # [num_decodes, max_ctx + 1] bool
    other_segs: list[int]  # segments of several tokens, run one by one
    prefix_slots: list[torch.Tensor | None]  # per segment: slots of its cached prefix (None if empty)
    seg_masks: list[torch.Tensor | None]  # per segment: in-step tree mask [q, q] (None = causal, written)
    positions: np.ndarray | None = None  # [num_tokens] absolute position of each token, on the host
    # What a backend derives from the above once per step and reuses in every layer.
    backend_cache: dict = field(default_factory=dict, repr=False)


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks * block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


def merge_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Exact softmax over the union of two key sets from each part's output and log-sum-exp.

    out_*: [..., heads, q, head_dim]; lse_*: [..., heads, q].
    """
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse).unsqueeze(-1)
    w_b = torch.exp(lse_b - lse).unsqueeze(-1)
    return out_a * w_a + out_b * w_b
