"""The CPU backend: the reference's semantics, with the paged cache read a block at a time and every plain
decode, and every lookahead segment, of a step attended in one batched call each.

At these sizes on a CPU the reference's costs are not arithmetic (whole steps are timed in
``benchmarks/attention.py``, results in benchmarks/RESULTS.md, "Attention backend"):

* reading the cache slot by slot: here whole blocks are read (``index_select`` over block ids);
* ``scaled_dot_product_attention`` with one query row in bfloat16: decodes and batched segments run two
  matmuls and a float32 softmax instead (scores in the model's dtype, as Hugging Face's eager attention);
* a call per lookahead segment per layer: a step's segments are padded into one batch (to the longest
  prefix and the longest segment; padding is masked).

A step's single lookahead segment keeps one fused ``scaled_dot_product_attention`` over its prefix and
itself under the dense mask ``[prefix: all true | tree mask]``. Prefill chunks take the reference's path.
Block-level reads cover whole blocks, so keys past a sequence's length are read and masked out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from lookahead_serve.engine.attention.backend import AttentionBackend, AttentionMetadata, CommonAttentionMetadata, SegmentKind
from lookahead_serve.engine.attention.shared import PaddedBatch, Segment, cached_keys, chunk_attention, padded_batch, segment


@dataclass
class _Fused:
    """A step's only lookahead segment, attended in one call over its prefix and itself."""

    lo: int
    hi: int
    prefix: torch.Tensor | None  # slots of its cached prefix (None if empty)
    mask: torch.Tensor  # [n, ctx + n] bool: the prefix unmasked, then the tree mask


@dataclass(kw_only=True)
class SDPAMetadata(AttentionMetadata):
    decodes: PaddedBatch | None  # every plain decode
    chunks: list[Segment]  # prefill chunks, one by one
    fused: _Fused | None  # a single lookahead segment ...
    lookahead: PaddedBatch | None  # ... or two or more, padded into one batch


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


def _fused(common: CommonAttentionMetadata, s: int) -> _Fused:
    seg = segment(common, s)
    tree = common.tree_masks[s]
    mask = np.concatenate([np.ones((tree.shape[0], common.context_lens[s]), dtype=bool), tree], axis=1)
    return _Fused(seg.lo, seg.hi, seg.prefix, torch.from_numpy(mask).to(common.device))


class SDPABackend(AttentionBackend):
    name = "sdpa"

    def build(self, common: CommonAttentionMetadata) -> SDPAMetadata:
        decodes = common.segments(SegmentKind.DECODE)
        lookahead = common.segments(SegmentKind.LOOKAHEAD)
        starts = common.query_start_loc
        in_order = [list(range(starts[s + 1] - starts[s])) for s in lookahead]  # own keys in token order
        return SDPAMetadata(
            **AttentionMetadata.common_fields(common),
            decodes=padded_batch(common, decodes) if decodes else None,
            chunks=[segment(common, s) for s in common.segments(SegmentKind.PREFILL)],
            fused=_fused(common, lookahead[0]) if len(lookahead) == 1 else None,
            lookahead=padded_batch(common, lookahead, in_order) if len(lookahead) > 1 else None,
        )

    def forward(self, q, k, v, kv_cache, meta: SDPAMetadata, scale: float) -> torch.Tensor:
        meta.write_kv(kv_cache, k, v)
        out = torch.empty_like(q)
        if (b := meta.decodes) is not None:
            keys, vals = cached_keys(kv_cache, b)
            out[b.token_idx] = _attend(q[b.query_idx], keys, vals, b.bias, scale)[b.valid]
        for seg in meta.chunks:
            out[seg.lo : seg.hi] = chunk_attention(q[seg.lo : seg.hi], k[seg.lo : seg.hi], v[seg.lo : seg.hi],
                                                   kv_cache, seg.prefix, scale)
        if (f := meta.fused) is not None:
            qs, ks, vs = q[f.lo : f.hi], k[f.lo : f.hi], v[f.lo : f.hi]
            if f.prefix is not None:
                ks = torch.cat([kv_cache[0][f.prefix], ks])
                vs = torch.cat([kv_cache[1][f.prefix], vs])
            o = F.scaled_dot_product_attention(
                qs.transpose(0, 1).unsqueeze(0), ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
                attn_mask=f.mask, scale=scale, enable_gqa=True,
            )
            out[f.lo : f.hi] = o.squeeze(0).transpose(0, 1)
        if (b := meta.lookahead) is not None:
            # Keys: each segment's cached prefix (whole blocks), then its own transient tokens in order.
            pk, pv = cached_keys(kv_cache, b)
            keys = torch.cat([pk, k[b.query_idx]], dim=1)
            vals = torch.cat([pv, v[b.query_idx]], dim=1)
            out[b.token_idx] = _attend(q[b.query_idx], keys, vals, b.bias, scale)[b.valid]
        return out
