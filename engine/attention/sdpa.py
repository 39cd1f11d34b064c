"""The CPU backend: the reference's semantics, with the paged cache read a block at a time and every plain
decode, and every lookahead segment, of a step attended in one batched call each.

On the 2-core CPU in bfloat16, three costs dominate the reference at these sizes, none of them arithmetic
(one-off timings of the ops, per layer, while writing this backend; whole steps are in
``benchmarks/attention.py`` and benchmarks/RESULTS.md, "Attention backend"):

* reading the cache slot by slot: ``cache[slots]`` over 16 contexts of 300 tokens took 2.5 ms a layer,
  the same keys read as whole blocks (``index_select`` over block ids) 0.11 ms;
* ``scaled_dot_product_attention`` with one query row in bfloat16: 3.4 ms for 16 decodes over 301 keys,
  against 0.3 ms for the two matmuls and a float32 softmax -- which is what the decodes and batched
  segments here run (scores in the model's dtype, softmax in float32, as Hugging Face's eager attention);
* a call per lookahead segment per layer, each with a fixed overhead: a step's segments are padded into
  one batch instead (to the longest prefix and the longest segment; padding is masked).

A step's single lookahead segment keeps one fused ``scaled_dot_product_attention`` over its prefix and
itself under the dense mask ``[prefix: all true | tree mask]``, which is the fastest for one segment.
Prefill chunks take the reference's path. Block-level reads cover whole blocks, so keys past a
sequence's length are read and masked out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from engine.attention.backend import AttentionMetadata
from engine.attention.torch_ref import TorchReferenceBackend


@dataclass
class _Batch:
    """Some segments of a step, padded into one batch, built once per step and read by every layer:
    S segments of at most n query tokens, whose prefixes span at most B cache blocks."""

    blocks: torch.Tensor  # [S * B] block ids, each segment's first B blocks (padding: block 0, masked)
    num_blocks: int  # B
    query_idx: torch.Tensor  # [S, n] token index of each (segment, row); padding points at token 0
    valid: torch.Tensor  # [S, n] bool: a real row
    token_idx: torch.Tensor  # [num valid] the real rows' token indices, in ``valid`` order
    bias: torch.Tensor  # [S, 1, n, B * block_size (+ n)] float32: 0 where a row may attend, -inf elsewhere


def _batch(meta: AttentionMetadata, segs: list[int], key_lens: list[int], trees: list[torch.Tensor] | None,
           device) -> _Batch:
    """``key_lens[i]``: cached keys segment ``segs[i]`` attends to; ``trees``: each segment's own tree mask
    (its own keys come after the cached ones), or None when the segments' tokens are in the cache."""
    bs, starts = meta.block_size, meta.query_start_loc
    lens = [starts[s + 1] - starts[s] for s in segs]
    S, n = len(segs), max(lens)
    B = max(1, max(-(-k // bs) for k in key_lens))
    width = B * bs + (n if trees is not None else 0)
    table = meta.block_tables.cpu()
    blocks = torch.zeros(S, B, dtype=torch.long)
    query_idx = torch.zeros(S, n, dtype=torch.long)
    valid = torch.zeros(S, n, dtype=torch.bool)
    allowed = torch.zeros(S, 1, n, width, dtype=torch.bool)
    for i, (s, m, ctx) in enumerate(zip(segs, lens, key_lens, strict=True)):
        nb = -(-ctx // bs)
        blocks[i, :nb] = table[s, :nb]
        query_idx[i, :m] = torch.arange(starts[s], starts[s] + m)
        valid[i, :m] = True
        allowed[i, 0, :m, :ctx] = True
        if trees is not None:
            allowed[i, 0, :m, B * bs : B * bs + m] = trees[i].cpu()
        allowed[i, 0, m:, :] = True  # padding rows: any finite softmax, never read
    bias = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
    return _Batch(blocks.view(-1).to(device), B, query_idx.to(device), valid.to(device), query_idx[valid].to(device),
                  bias.to(device))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """q [S, n, H, D]; k, v [S, L, KVH, D]; bias [S, 1, n, L] -> [S, n, H, D]. Grouped-query attention as
    two batched matmuls: scores in the inputs' dtype, softmax in float32."""
    S, n, H, D = q.shape
    kvh = k.shape[2]
    g = H // kvh
    qg = q.view(S, n, kvh, g, D).permute(0, 2, 3, 1, 4).reshape(S, kvh, g * n, D)
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).view(S, kvh, g, n, -1).float() * scale
    probs = torch.softmax(scores + bias.unsqueeze(1), dim=-1).to(q.dtype).view(S, kvh, g * n, -1)
    o = torch.matmul(probs, v.transpose(1, 2))  # [S, kvh, g * n, D]
    return o.view(S, kvh, g, n, D).permute(0, 3, 1, 2, 4).reshape(S, n, H, D)


def _cached(kv_cache: torch.Tensor, b: _Batch, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the batch's blocks: [S, B * block_size, KVH, D] each."""
    _, _, kvh, d = kv_cache.shape
    paged = kv_cache.view(2, -1, block_size, kvh, d)
    shape = (-1, b.num_blocks * block_size, kvh, d)
    return paged[0].index_select(0, b.blocks).view(shape), paged[1].index_select(0, b.blocks).view(shape)


class SDPABackend(TorchReferenceBackend):
    name = "sdpa"

    def _decodes(self, q, kv_cache, meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
        b = meta.backend_cache.get("decodes")
        if b is None:
            segs = meta.decode_segs
            b = meta.backend_cache["decodes"] = _batch(meta, segs, [meta.context_lens[s] + 1 for s in segs], None,
                                                       q.device)
        keys, vals = _cached(kv_cache, b, meta.block_size)
        out[b.token_idx] = _attend(q[b.query_idx], keys, vals, b.bias, scale)[b.valid]

    def _segments(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
        lookahead = [s for s in meta.other_segs if meta.seg_masks[s] is not None]
        if len(lookahead) < 2:
            super()._segments(q, k, v, kv_cache, meta, scale, out)
            return
        for s in meta.other_segs:
            if meta.seg_masks[s] is None:
                lo, hi = meta.query_start_loc[s], meta.query_start_loc[s + 1]
                out[lo:hi] = self._chunk(q[lo:hi], k[lo:hi], v[lo:hi], kv_cache, meta.prefix_slots[s], scale)
        b = meta.backend_cache.get("lookahead")
        if b is None:
            b = meta.backend_cache["lookahead"] = _batch(
                meta, lookahead, [meta.context_lens[s] for s in lookahead], [meta.seg_masks[s] for s in lookahead],
                q.device)
        # Keys: each segment's cached prefix (whole blocks), then its own transient tokens.
        pk, pv = _cached(kv_cache, b, meta.block_size)
        keys = torch.cat([pk, k[b.query_idx]], dim=1)
        vals = torch.cat([pv, v[b.query_idx]], dim=1)
        out[b.token_idx] = _attend(q[b.query_idx], keys, vals, b.bias, scale)[b.valid]

    @staticmethod
    def _lookahead(q, k, v, kv_cache, prefix: torch.Tensor | None, tree: torch.Tensor, scale: float):
        """One segment: q [n, H, D]; k, v [n, KVH, D] of the segment; tree [n, n] -> [n, H, D]."""
        n = q.shape[0]
        if prefix is None:
            keys, vals, mask = k, v, tree
        else:
            ctx = prefix.shape[0]
            keys = torch.cat([kv_cache[0][prefix], k])
            vals = torch.cat([kv_cache[1][prefix], v])
            mask = torch.cat([torch.ones(n, ctx, dtype=torch.bool, device=q.device), tree], dim=1)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0), vals.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, scale=scale, enable_gqa=True,
        )
        return o.squeeze(0).transpose(0, 1)
