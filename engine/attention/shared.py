"""Metadata builders and attention pieces shared by the backends."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from lookahead_serve.engine.attention.backend import CommonAttentionMetadata
from lookahead_serve.kv_cache import cdiv


def prefix_slots(common: CommonAttentionMetadata, s: int) -> np.ndarray:
    """Slots of segment ``s``'s cached prefix, in position order."""
    bs = common.block_size
    p = np.arange(common.context_lens[s])
    return common.block_table[s, p // bs] * bs + p % bs


@dataclass
class Segment:
    """One segment run on its own."""

    lo: int  # its tokens in the packed batch: [lo, hi)
    hi: int
    prefix: torch.Tensor | None  # slots of its cached prefix (None if empty)
    tree: torch.Tensor | None  # [n, n] bool tree mask of a lookahead segment; None: a causal prefill chunk


def segment(common: CommonAttentionMetadata, s: int) -> Segment:
    dev = common.device
    prefix = torch.from_numpy(prefix_slots(common, s)).to(dev) if common.context_lens[s] else None
    tree = common.tree_masks[s]
    return Segment(common.query_start_loc[s], common.query_start_loc[s + 1], prefix,
                   None if tree is None else torch.tensor(tree, device=dev))


@dataclass
class PaddedBatch:
    """Some segments of a step padded into one batch: S segments of at most n query tokens whose cached
    keys span B blocks, then (transient segments) ``width`` in-step key columns."""

    block_size: int
    blocks: torch.Tensor  # [S * B] block ids, each segment's first B blocks (padding: block 0, masked)
    num_blocks: int  # B
    query_idx: torch.Tensor  # [S, n] token index of each (segment, row); padding points at token 0
    valid: torch.Tensor  # [S, n] bool: a real row
    token_idx: torch.Tensor  # [num valid] the real rows' token indices, in ``valid`` order
    bias: torch.Tensor  # [S, 1, n, B * block_size + width] float32: 0 where a row may attend, -inf elsewhere
    width: int = 0
    key_seg: torch.Tensor | None = None  # [num in-step keys] segment of each in-step key ...
    key_col: torch.Tensor | None = None  # ... its column ...
    key_token: torch.Tensor | None = None  # ... and its token index

    @property
    def in_step(self) -> bool:
        return self.key_token is not None


def padded_batch(common: CommonAttentionMetadata, segs: list[int], cols: list[list[int]] | None = None,
                 align: int = 1) -> PaddedBatch:
    """``segs`` padded into one batch on ``common.device``. Committed segments (``cols`` None): keys are the
    cached blocks covering the prefix and the segment's own tokens, causal. Transient segments: the
    prefix's blocks without a mask, then in-step columns, token t of ``segs[i]`` at column ``cols[i][t]``,
    under the segment's tree mask. The cached key axis and the in-step width are multiples of ``align``."""
    bs, starts = common.block_size, common.query_start_loc
    in_step = cols is not None
    lens = [starts[s + 1] - starts[s] for s in segs]
    ctxs = [common.context_lens[s] for s in segs]
    cached = ctxs if in_step else [c + m for c, m in zip(ctxs, lens, strict=True)]
    S, n = len(segs), max(lens)
    B = max(1, max(cdiv(c, bs) for c in cached))
    while (B * bs) % align:
        B += 1
    base = B * bs
    width = cdiv(max((max(c) + 1 for c in cols), default=0), align) * align if in_step else 0
    blocks = torch.zeros(S, B, dtype=torch.long)
    query_idx = torch.zeros(S, n, dtype=torch.long)
    valid = torch.zeros(S, n, dtype=torch.bool)
    allowed = torch.zeros(S, 1, n, base + width, dtype=torch.bool)
    key_seg, key_col, key_token = [], [], []
    for i, (s, m, ctx, kc) in enumerate(zip(segs, lens, ctxs, cached, strict=True)):
        nb = cdiv(kc, bs)
        blocks[i, :nb] = torch.from_numpy(common.block_table[s, :nb])
        query_idx[i, :m] = torch.arange(starts[s], starts[s] + m)
        valid[i, :m] = True
        if in_step:
            allowed[i, 0, :m, :ctx] = True
            allowed[i, 0, :m, torch.tensor(cols[i]) + base] = torch.tensor(common.tree_masks[s])
            key_seg += [i] * m
            key_col += cols[i]
            key_token += range(starts[s], starts[s] + m)
        else:  # causal over the cache: row r sits at position ctx + r
            allowed[i, 0, :m, : ctx + m] = torch.ones(m, ctx + m, dtype=torch.bool).tril_(diagonal=ctx)
        allowed[i, 0, m:, 0] = True  # padding rows: any finite softmax, never read
    bias = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
    dev = common.device
    b = PaddedBatch(bs, blocks.view(-1).to(dev), B, query_idx.to(dev), valid.to(dev), query_idx[valid].to(dev),
                    bias.to(dev), width)
    if in_step:
        b.key_seg, b.key_col, b.key_token = (torch.tensor(x, dtype=torch.long, device=dev)
                                             for x in (key_seg, key_col, key_token))
    return b


def cached_keys(kv_cache: torch.Tensor, b: PaddedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the batch's blocks, read a block at a time: [S, B * block_size, KVH, D] each."""
    _, _, kvh, d = kv_cache.shape
    paged = kv_cache.view(2, -1, b.block_size, kvh, d)
    shape = (-1, b.num_blocks * b.block_size, kvh, d)
    return paged[0].index_select(0, b.blocks).view(shape), paged[1].index_select(0, b.blocks).view(shape)


def chunk_attention(q, k, v, kv_cache: torch.Tensor, prefix: torch.Tensor | None, scale: float) -> torch.Tensor:
    """A committed chunk of n tokens (q [n, H, D]; k, v [n, KVH, D]): causal over its cached prefix (slots
    ``prefix``, if any) and itself."""
    n = q.shape[0]
    qt = q.transpose(0, 1).unsqueeze(0)  # [1, h, n, d]
    if prefix is None:
        o = F.scaled_dot_product_attention(
            qt, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
            is_causal=True, scale=scale, enable_gqa=True,
        )
    else:
        ctx = prefix.shape[0]
        keys = torch.cat([kv_cache[0][prefix], k]).transpose(0, 1).unsqueeze(0)  # [1, kvh, ctx + n, d]
        vals = torch.cat([kv_cache[1][prefix], v]).transpose(0, 1).unsqueeze(0)
        mask = torch.ones(n, ctx + n, dtype=torch.bool, device=q.device).tril_(diagonal=ctx)
        o = F.scaled_dot_product_attention(qt, keys, vals, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)
