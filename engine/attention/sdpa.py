"""A faster CPU backend: the reference's semantics with one fused attention call per lookahead segment.

The reference backend attends a lookahead segment to its cached prefix and to its own tokens separately
and merges the two by log-sum-exp (the split a varlen GPU kernel needs). On a CPU, one
``scaled_dot_product_attention`` over the prefix and the segment together, under the dense mask
``[prefix: all true | tree mask]``, computes the same softmax in one fused kernel instead of about ten
small ops per layer (benchmarks/RESULTS.md has the measurement). Prefill chunks and plain decodes take
the reference's paths unchanged.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from engine.attention.torch_ref import TorchReferenceBackend


class SDPABackend(TorchReferenceBackend):
    name = "sdpa"

    @staticmethod
    def _lookahead(q, k, v, kv_cache, prefix: torch.Tensor | None, tree: torch.Tensor, scale: float):
        """q [n, H, D]; k, v [n, KVH, D] of the segment; tree [n, n] -> [n, H, D]."""
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
