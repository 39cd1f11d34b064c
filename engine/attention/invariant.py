"""Shape-invariant attention: a query's output has the same bits whatever else shares its step.

Every query, whatever kind of segment carries it (plain decode, prefill chunk, lookahead window or
candidate), runs the same arithmetic over one key axis on which the keys it may see sit in increasing
absolute position; masked keys may sit anywhere on that axis and are exact no-ops:

* scores ``q @ k^T`` in the model's dtype (one dot product over ``head_dim`` per score), then in float32
  the scale, the 0 / -inf bias and the row maximum (exact whatever the order);
* ``exp(s - max)``, elementwise; the denominator is the last element of a cumulative sum over keys: a
  sequential sum, so the zeros of masked keys change nothing, unlike ``sum``, whose blocking follows the
  padded length;
* probabilities cast to the model's dtype, then ``P @ V``.

The CPU kernel of ``P @ V`` accumulates over keys in vector lanes: key ``j`` goes to lane ``j % 8``, and
a key in the scalar tail past the last full vector rounds differently. So every key sits at an index
congruent to its absolute position modulo ``LANES`` (16: also right for 16-float vectors), and the key
axis is a multiple of ``LANES`` long. Cached keys are there already (block by block from position 0).
A lookahead segment's own keys follow in columns of width ``LANES``: token t at ``LANES * slot(t) +
position(t) % LANES``, its slot no lower than its ancestors' (so along a lane a query meets its keys in
increasing position, as a plain decode of the same token does once it is committed). Segments are padded into one batch per
kind (decodes, prefill chunks, lookahead segments), built once per step. Measured invariant in bfloat16 and
float16 on CPU (``tests/model/test_invariance.py``); float32 uses the ``sdpa`` backend, whose matmuls
are not (docs/batch-invariance.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lookahead_serve.engine.attention.backend import AttentionBackend, AttentionMetadata, CommonAttentionMetadata, SegmentKind
from lookahead_serve.engine.attention.shared import PaddedBatch, cached_keys, padded_batch

LANES = 16


@dataclass(kw_only=True)
class InvariantMetadata(AttentionMetadata):
    groups: list[PaddedBatch]  # one padded batch per segment kind present: decodes, prefill chunks, lookahead


def _columns(positions, tree) -> list[int]:
    """In-step key column of each token of a lookahead segment (see the module docstring)."""
    used: set[tuple[int, int]] = set()
    slots: list[int] = []
    for t, pos in enumerate(positions):
        slot = max((slots[a] for a in range(t) if tree[t][a]), default=0)
        lane = int(pos) % LANES
        while (slot, lane) in used:
            slot += 1
        used.add((slot, lane))
        slots.append(slot)
    return [LANES * s + int(p) % LANES for s, p in zip(slots, positions, strict=True)]


def attend_invariant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """q [S, n, H, D]; k, v [S, L, KVH, D]; bias [S, 1, n, L] float32 (0 or -inf) -> [S, n, H, D]."""
    S, n, H, D = q.shape
    kvh = k.shape[2]
    g = H // kvh
    qg = q.view(S, n, kvh, g, D).permute(0, 2, 3, 1, 4).reshape(S, kvh, g * n, D)
    kt = k.transpose(1, 2).contiguous().transpose(-1, -2)  # [S, kvh, D, L] over rows of D: one dot per score
    vt = v.transpose(1, 2)  # [S, kvh, L, D]: P @ V accumulates over keys in order
    s = torch.matmul(qg, kt).view(S, kvh, g, n, -1).float().mul_(scale).add_(bias.unsqueeze(1))
    e = torch.exp(s - s.amax(-1, keepdim=True))
    denom = torch.cumsum(e, -1)[..., -1:]
    probs = e.div_(denom).to(q.dtype).view(S, kvh, g * n, -1)
    o = torch.matmul(probs, vt)  # [S, kvh, g * n, D]
    return o.view(S, kvh, g, n, D).permute(0, 3, 1, 2, 4).reshape(S, n, H, D)


class InvariantBackend(AttentionBackend):
    name = "invariant"

    def build(self, common: CommonAttentionMetadata) -> InvariantMetadata:
        starts = common.query_start_loc
        groups = [padded_batch(common, segs, align=LANES)
                  for segs in (common.segments(SegmentKind.DECODE), common.segments(SegmentKind.PREFILL)) if segs]
        if lookahead := common.segments(SegmentKind.LOOKAHEAD):
            cols = [_columns(common.positions[starts[s] : starts[s + 1]], common.tree_masks[s].tolist())
                    for s in lookahead]
            groups.append(padded_batch(common, lookahead, cols, align=LANES))
        return InvariantMetadata(**AttentionMetadata.common_fields(common), groups=groups)

    def forward(self, q, k, v, kv_cache, meta: InvariantMetadata, scale: float) -> torch.Tensor:
        meta.write_kv(kv_cache, k, v)
        out = torch.empty_like(q)
        for b in meta.groups:
            keys, vals = cached_keys(kv_cache, b)
            if b.in_step:
                S, _, kvh, d = keys.shape
                ks, vs = keys.new_zeros(S, b.width, kvh, d), vals.new_zeros(S, b.width, kvh, d)
                ks[b.key_seg, b.key_col] = k[b.key_token]
                vs[b.key_seg, b.key_col] = v[b.key_token]
                keys, vals = torch.cat([keys, ks], dim=1), torch.cat([vals, vs], dim=1)
            out[b.token_idx] = attend_invariant(q[b.query_idx], keys, vals, b.bias, scale)[b.valid]
        return out
