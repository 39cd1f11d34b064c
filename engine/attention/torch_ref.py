"""Reference attention backend in plain torch over the paged cache (CPU and any device).

Prefix and in-step parts are computed separately, each with its log-sum-exp, then merged. Decode
segments (one query token each) run as one padded batch; longer segments run one by one.
"""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata, merge_attention


def _attend(
    q: torch.Tensor,  # [kv_heads, group, q_len, head_dim]
    k: torch.Tensor,  # [kv_heads, k_len, head_dim]
    v: torch.Tensor,  # [kv_heads, k_len, head_dim]
    mask: torch.Tensor | None,  # [q_len, k_len] bool or None
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.matmul(q, k.unsqueeze(1).transpose(-1, -2)) * scale  # [kvh, g, q, k]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [kvh, g, q]
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return torch.matmul(probs, v.unsqueeze(1)), lse


class TorchReferenceBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        group = num_heads // num_kv_heads
        write = meta.slot_mapping >= 0
        if bool(write.all()):
            kv_cache[0].index_copy_(0, meta.slot_mapping, k)
            kv_cache[1].index_copy_(0, meta.slot_mapping, v)
        elif bool(write.any()):
            kv_cache[0].index_copy_(0, meta.slot_mapping[write], k[write])
            kv_cache[1].index_copy_(0, meta.slot_mapping[write], v[write])
        out = torch.empty_like(q)

        if meta.decode_segs:
            idx = meta.decode_token_idx
            qd = q[idx].view(-1, num_kv_heads, group, 1, head_dim)  # [b, kvh, g, 1, d]
            kd, vd = k[idx].unsqueeze(2), v[idx].unsqueeze(2)  # [b, kvh, 1, d]
            # (b) the token itself: a softmax over one key.
            own_lse = (torch.matmul(qd, kd.unsqueeze(2).transpose(-1, -2)) * scale).squeeze(-1)
            own_out = vd.unsqueeze(2).expand_as(qd)
            if meta.decode_prefix_slots.shape[1] > 0:
                # (a) the cached prefix, padded to the longest context in the batch.
                kp = kv_cache[0][meta.decode_prefix_slots].transpose(1, 2)  # [b, kvh, ctx, d]
                vp = kv_cache[1][meta.decode_prefix_slots].transpose(1, 2)
                scores = torch.matmul(qd, kp.unsqueeze(2).transpose(-1, -2)) * scale  # [b, kvh, g, 1, ctx]
                scores = scores.masked_fill(~meta.decode_prefix_mask[:, None, None, None, :], float("-inf"))
                lse = torch.logsumexp(scores, dim=-1)
                pre_out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), vp.unsqueeze(2))
                has_prefix = meta.decode_prefix_mask.any(dim=1)[:, None, None, None]
                lse = torch.where(has_prefix, lse, torch.full_like(lse, float("-inf")))
                pre_out = torch.where(has_prefix.unsqueeze(-1), pre_out, torch.zeros_like(pre_out))
                dec = merge_attention(pre_out, lse, own_out, own_lse)
            else:
                dec = own_out
            out[idx] = dec.reshape(len(meta.decode_segs), num_heads, head_dim)

        for s in meta.other_segs:
            lo, hi = meta.query_start_loc[s], meta.query_start_loc[s + 1]
            n = hi - lo
            qs = q[lo:hi].view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [kvh, g, n, d]
            mask = meta.seg_masks[s]
            if mask is None:
                mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril_()
            o, lse = _attend(qs, k[lo:hi].transpose(0, 1), v[lo:hi].transpose(0, 1), mask, scale)
            slots = meta.prefix_slots[s]
            if slots is not None:
                kp = kv_cache[0][slots].transpose(0, 1)  # [kvh, ctx, d]
                vp = kv_cache[1][slots].transpose(0, 1)
                po, plse = _attend(qs, kp, vp, None, scale)
                o = merge_attention(po, plse, o, lse)
            out[lo:hi] = o.permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)
        return out
