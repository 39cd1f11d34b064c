"""Reference attention backend in plain torch over the paged cache (CPU and any device).

* Plain decodes (one committed token each): written to the cache, then one padded batch attends over
  each token's prefix and itself with ``scaled_dot_product_attention``.
* Prefill chunks: a first chunk attends causally to itself; a later chunk, once written, attends to its
  cached prefix and itself under a causal mask.
* Lookahead segments (transient tokens): the split of the contract, prefix from the cache without a mask
  and in-step part under the tree mask, each with its log-sum-exp, merged exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from lookahead_serve.engine.attention.backend import (AttentionBackend, AttentionMetadata, CommonAttentionMetadata, SegmentKind,
                                      merge_attention)
from lookahead_serve.engine.attention.shared import Segment, chunk_attention, segment


@dataclass(kw_only=True)
class TorchMetadata(AttentionMetadata):
    # Plain decodes in one padded batch: each token's prefix and itself, all in the cache once written.
    decode_idx: torch.Tensor | None  # [num_decodes] token index of each (None: no decodes)
    decode_slots: torch.Tensor | None  # [num_decodes, max_ctx + 1] int64, padded with slot 0 ...
    decode_mask: torch.Tensor | None  # [num_decodes, max_ctx + 1] bool: ... and masked there
    segments: list[Segment]  # prefill chunks and lookahead segments, run one by one


def attend_with_lse(
    q: torch.Tensor,  # [kv_heads, group, q_len, head_dim]
    k: torch.Tensor,  # [kv_heads, k_len, head_dim]
    v: torch.Tensor,  # [kv_heads, k_len, head_dim]
    mask: torch.Tensor | None,  # [q_len, k_len] bool (True = attend) or None
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [kvh, g, q, d], lse [kvh, g, q]
    scores = torch.matmul(q, k.unsqueeze(1).transpose(-1, -2)) * scale  # [kvh, g, q, k]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return torch.matmul(probs, v.unsqueeze(1)), lse


def lookahead_attention(q, k, v, kv_cache, prefix: torch.Tensor | None, tree: torch.Tensor, scale: float):
    """A transient segment of n tokens: its cached prefix without a mask and itself under the tree mask,
    each with its log-sum-exp, merged exactly."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    qs = q.view(n, num_kv_heads, num_heads // num_kv_heads, head_dim).permute(1, 2, 0, 3)  # [kvh, g, n, d]
    o, lse = attend_with_lse(qs, k.transpose(0, 1), v.transpose(0, 1), tree, scale)
    if prefix is not None:
        kp = kv_cache[0][prefix].transpose(0, 1)  # [kvh, ctx, d]
        vp = kv_cache[1][prefix].transpose(0, 1)
        po, plse = attend_with_lse(qs, kp, vp, None, scale)
        o = merge_attention(po, plse, o, lse)
    return o.permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)


class TorchReferenceBackend(AttentionBackend):
    name = "torch"

    def build(self, common: CommonAttentionMetadata) -> TorchMetadata:
        dev = common.device
        decodes = common.segments(SegmentKind.DECODE)
        idx = slots = mask = None
        if decodes:
            bs, table = common.block_size, common.block_table
            ctx = np.asarray(common.context_lens)[decodes] + 1
            grid = np.arange(int(ctx.max()))
            valid = grid[None, :] < ctx[:, None]
            block = np.minimum(grid // bs, table.shape[1] - 1)
            idx = torch.tensor([common.query_start_loc[s] for s in decodes], device=dev)
            slots = torch.from_numpy(np.where(valid, table[decodes][:, block] * bs + grid % bs, 0)).to(dev)
            mask = torch.from_numpy(valid).to(dev)
        others = [segment(common, s) for s, kind in enumerate(common.kinds) if kind is not SegmentKind.DECODE]
        return TorchMetadata(**AttentionMetadata.common_fields(common), decode_idx=idx, decode_slots=slots,
                             decode_mask=mask, segments=others)

    def forward(self, q, k, v, kv_cache, meta: TorchMetadata, scale: float) -> torch.Tensor:
        meta.write_kv(kv_cache, k, v)
        out = torch.empty_like(q)
        if meta.decode_idx is not None:
            idx = meta.decode_idx
            kd = kv_cache[0][meta.decode_slots].transpose(1, 2)  # [b, kvh, ctx + 1, d]
            vd = kv_cache[1][meta.decode_slots].transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q[idx].unsqueeze(2), kd, vd, attn_mask=meta.decode_mask[:, None, None, :], scale=scale,
                enable_gqa=True,
            )
            out[idx] = o.squeeze(2)
        for seg in meta.segments:
            lo, hi = seg.lo, seg.hi
            if seg.tree is None:
                out[lo:hi] = chunk_attention(q[lo:hi], k[lo:hi], v[lo:hi], kv_cache, seg.prefix, scale)
            else:
                out[lo:hi] = lookahead_attention(q[lo:hi], k[lo:hi], v[lo:hi], kv_cache, seg.prefix, seg.tree, scale)
        return out
