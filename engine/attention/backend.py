"""The attention-backend interface and the per-step metadata.

A step is one packed batch of ragged segments (one per scheduled request). Each query token attends to

  (a) its request's cached prefix: the ``context_lens[s]`` tokens already in the paged cache, no mask
      (every token of the step comes after them), and
  (b) the tokens of its own segment, under the segment's mask (causal by default),

and the two parts are merged exactly by their log-sum-exps. Tokens that are committed as they run
(prefill chunks, plain decodes) are written to the cache first, so for them (a) and (b) can also be one
attention over the cache; lookahead segments are transient and always take the split. GPU backends
implement the same contract.

The runner describes a step once, on the host and for every backend (``CommonAttentionMetadata``). Each
backend's ``build`` turns that into the metadata its ``forward`` reads (a subclass of
``AttentionMetadata``), once per step, moving each tensor to the device once; every layer reuses it.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np
import torch


class SegmentKind(enum.Enum):
    PREFILL = "prefill"  # several committed tokens: written to the cache as the layers run, causal
    DECODE = "decode"  # one committed token: written, then attends to its prefix and itself in the cache
    LOOKAHEAD = "lookahead"  # transient tokens under a tree mask: never written by the layers


@dataclass
class CommonAttentionMetadata:
    """One packed step, backend-neutral, on the host."""

    num_tokens: int
    block_size: int
    device: torch.device  # where the backends' metadata goes
    kinds: list[SegmentKind]  # [num_segs]
    query_start_loc: list[int]  # [num_segs + 1] offsets of each segment in the packed batch
    context_lens: list[int]  # [num_segs] cached-prefix length of each segment
    positions: np.ndarray  # [num_tokens] int64 absolute position of each token
    block_table: np.ndarray  # [num_segs, max_blocks] int64
    slot_mapping: np.ndarray  # [num_tokens] int64; -1 = transient, never written by the layers
    tree_masks: list[np.ndarray | None]  # per segment: [n, n] bool (True = may attend) of a lookahead segment
    # Per layer, the (k, v) of every token of a step with lookahead segments: the runner commits the
    # accepted tokens from it after verification.
    transient_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    def segments(self, kind: SegmentKind) -> list[int]:
        return [s for s, k in enumerate(self.kinds) if k is kind]

    @property
    def has_lookahead(self) -> bool:
        return SegmentKind.LOOKAHEAD in self.kinds


@dataclass(kw_only=True)
class AttentionMetadata:
    """What every backend's metadata holds: the step's cache writes and its transient K/V record."""

    write_idx: torch.Tensor | None  # [num_written] tokens written as the layers run; None = every token
    write_slots: torch.Tensor  # [num_written] their slots
    transient_kv: dict | None  # the step's ``CommonAttentionMetadata.transient_kv`` if it has lookahead segments

    @staticmethod
    def common_fields(common: CommonAttentionMetadata) -> dict:
        """The base fields, for a subclass's constructor."""
        dev = common.device
        written = np.flatnonzero(common.slot_mapping >= 0)
        if len(written) == common.num_tokens:
            idx, slots = None, torch.from_numpy(common.slot_mapping).to(dev)
        else:
            idx = torch.from_numpy(written).to(dev)
            slots = torch.from_numpy(common.slot_mapping[written]).to(dev)
        return {"write_idx": idx, "write_slots": slots,
                "transient_kv": common.transient_kv if common.has_lookahead else None}

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the committed tokens' keys and values to the cache."""
        if self.write_idx is None:
            kv_cache[0].index_copy_(0, self.write_slots, k)
            kv_cache[1].index_copy_(0, self.write_slots, v)
        elif self.write_slots.numel():
            kv_cache[0].index_copy_(0, self.write_slots, k[self.write_idx])
            kv_cache[1].index_copy_(0, self.write_slots, v[self.write_idx])


class AttentionBackend(ABC):
    name: str

    @property
    def cost_key(self) -> str:
        """What sets this backend's step costs (a key of the cached step-cost profile)."""
        return type(self).__name__

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        """This backend's metadata for one step, on ``common.device``; called once per step."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks * block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,  # from this backend's ``build``
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
