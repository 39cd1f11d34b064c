"""Reference attention backend in plain torch over the paged cache (CPU and any device).

* Plain decodes (one committed token each): written to the cache, then one padded batch attends over
  each token's prefix and itself with ``scaled_dot_product_attention``.
* Prefill chunks: a first chunk attends causally to itself; a later chunk, once written, attends to its
  cached prefix and itself under a causal mask.
* Lookahead segments (transient tokens): the split of the contract, prefix from the cache without a mask
  and in-step part under the tree mask, each with its log-sum-exp, merged exactly.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from engine.attention.backend import AttentionBackend, AttentionMetadata, merge_attention


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


class TorchReferenceBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.write_all:
            kv_cache[0].index_copy_(0, meta.slot_mapping, k)
            kv_cache[1].index_copy_(0, meta.slot_mapping, v)
        elif meta.write_slots.numel():
            kv_cache[0].index_copy_(0, meta.write_slots, k[meta.write_token_idx])
            kv_cache[1].index_copy_(0, meta.write_slots, v[meta.write_token_idx])
        out = torch.empty_like(q)
        if meta.decode_segs:
            self._decodes(q, kv_cache, meta, scale, out)
        self._segments(q, k, v, kv_cache, meta, scale, out)
        return out

    def _decodes(self, q, kv_cache, meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
        """Every plain decode in one padded call: each token over its prefix and itself, all in the cache."""
        idx = meta.decode_token_idx
        kd = kv_cache[0][meta.decode_slots].transpose(1, 2)  # [b, kvh, ctx + 1, d]
        vd = kv_cache[1][meta.decode_slots].transpose(1, 2)
        qd = q[idx].unsqueeze(2)  # [b, h, 1, d]
        o = F.scaled_dot_product_attention(
            qd, kd, vd, attn_mask=meta.decode_mask[:, None, None, :], scale=scale, enable_gqa=True
        )
        out[idx] = o.squeeze(2)

    def _segments(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
        """Prefill chunks and lookahead segments, one by one, into ``out``."""
        for s in meta.other_segs:
            lo, hi = meta.query_start_loc[s], meta.query_start_loc[s + 1]
            tree = meta.seg_masks[s]
            prefix = meta.prefix_slots[s]
            if tree is None:
                out[lo:hi] = self._chunk(q[lo:hi], k[lo:hi], v[lo:hi], kv_cache, prefix, scale)
                continue
            out[lo:hi] = self._lookahead(q[lo:hi], k[lo:hi], v[lo:hi], kv_cache, prefix, tree, scale)

    @staticmethod
    def _lookahead(q, k, v, kv_cache, prefix: torch.Tensor | None, tree: torch.Tensor, scale: float) -> torch.Tensor:
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

    @staticmethod
    def _chunk(q, k, v, kv_cache, prefix: torch.Tensor | None, scale: float) -> torch.Tensor:
        """A committed chunk of n tokens: causal over its cached prefix (if any) and itself."""
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
