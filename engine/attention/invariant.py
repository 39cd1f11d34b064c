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

import torch

from dataclasses import dataclass

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.attention.sdpa import _cached

LANES = 16


@dataclass
class _Group:
    """Some segments of a step padded into one batch, built once per step and read by every layer:
    S segments of at most n query tokens whose cached keys span B blocks, plus (lookahead) ``width``
    in-step key columns."""

    blocks: torch.Tensor  # [S * B] block ids (padding: block 0, masked)
    num_blocks: int  # B
    query_idx: torch.Tensor  # [S, n] token index of each (segment, row); padding points at token 0
    valid: torch.Tensor  # [S, n] bool: a real row
    token_idx: torch.Tensor  # [num valid] the real rows' token indices, in ``valid`` order
    bias: torch.Tensor  # [S, 1, n, B * block_size + width] float32: 0 where a row may attend, -inf elsewhere
    width: int = 0
    key_seg: torch.Tensor | None = None  # [num in-step keys] segment of each in-step key ...
    key_col: torch.Tensor | None = None  # ... its column ...
    key_token: torch.Tensor | None = None  # ... and its token index


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


def _group(meta: AttentionMetadata, segs: list[int], in_step: bool, device) -> _Group:
    """``segs`` padded into one batch. Keys: each segment's cached blocks, covering its prefix and, when
    its tokens are committed as they run (decodes, prefill chunks, in_step False), its own tokens; for a
    lookahead segment (in_step True) its own transient tokens follow in lane-aligned columns."""
    bs, starts = meta.block_size, meta.query_start_loc
    lens = [starts[s + 1] - starts[s] for s in segs]
    ctxs = [meta.context_lens[s] for s in segs]
    cached = ctxs if in_step else [c + m for c, m in zip(ctxs, lens, strict=True)]
    S, n = len(segs), max(lens)
    B = max(1, max(-(-c // bs) for c in cached))
    while (B * bs) % LANES:  # the key axis holds whole lanes: no key in a scalar tail
        B += 1
    base = B * bs
    cols: list[list[int]] = []
    trees = []
    if in_step:
        trees = [meta.seg_masks[s].cpu().tolist() for s in segs]
        cols = [_columns(meta.positions[starts[s] : starts[s + 1]], tree) for s, tree in zip(segs, trees, strict=True)]
    width = -(-max((max(c) + 1 for c in cols), default=0) // LANES) * LANES
    table = meta.block_tables.cpu()
    blocks = torch.zeros(S, B, dtype=torch.long)
    query_idx = torch.zeros(S, n, dtype=torch.long)
    valid = torch.zeros(S, n, dtype=torch.bool)
    allowed = torch.zeros(S, 1, n, base + width, dtype=torch.bool)
    key_seg, key_col, key_token = [], [], []
    for i, (s, m, ctx, kc) in enumerate(zip(segs, lens, ctxs, cached, strict=True)):
        blocks[i, : -(-kc // bs)] = table[s, : -(-kc // bs)]
        query_idx[i, :m] = torch.arange(starts[s], starts[s] + m)
        valid[i, :m] = True
        if in_step:
            allowed[i, 0, :m, :ctx] = True
            col = torch.tensor(cols[i]) + base
            allowed[i, 0, :m, col] = torch.tensor(trees[i], dtype=torch.bool)
            key_seg += [i] * m
            key_col += cols[i]
            key_token += range(starts[s], starts[s] + m)
        else:  # causal over the cache: row r sits at position ctx + r
            allowed[i, 0, :m, : ctx + m] = torch.ones(m, ctx + m, dtype=torch.bool).tril_(diagonal=ctx)
        allowed[i, 0, m:, 0] = True  # padding rows: any finite softmax, never read
    bias = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
    g = _Group(blocks.view(-1).to(device), B, query_idx.to(device), valid.to(device), query_idx[valid].to(device),
               bias.to(device), width)
    if in_step:
        g.key_seg, g.key_col, g.key_token = (torch.tensor(x, dtype=torch.long, device=device)
                                             for x in (key_seg, key_col, key_token))
    return g


class InvariantBackend(AttentionBackend):
    name = "invariant"

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if meta.write_all:
            kv_cache[0].index_copy_(0, meta.slot_mapping, k)
            kv_cache[1].index_copy_(0, meta.slot_mapping, v)
        elif meta.write_slots.numel():
            kv_cache[0].index_copy_(0, meta.write_slots, k[meta.write_token_idx])
            kv_cache[1].index_copy_(0, meta.write_slots, v[meta.write_token_idx])
        groups = meta.backend_cache.get("invariant")
        if groups is None:
            chunks = [s for s in meta.other_segs if meta.seg_masks[s] is None]
            lookahead = [s for s in meta.other_segs if meta.seg_masks[s] is not None]
            groups = meta.backend_cache["invariant"] = [
                (_group(meta, segs, in_step, q.device), in_step)
                for segs, in_step in ((meta.decode_segs, False), (chunks, False), (lookahead, True)) if segs
            ]
        out = torch.empty_like(q)
        for b, in_step in groups:
            keys, vals = _cached(kv_cache, b, meta.block_size)
            if in_step:
                S, _, kvh, d = keys.shape
                ks, vs = keys.new_zeros(S, b.width, kvh, d), vals.new_zeros(S, b.width, kvh, d)
                ks[b.key_seg, b.key_col] = k[b.key_token]
                vs[b.key_seg, b.key_col] = v[b.key_token]
                keys, vals = torch.cat([keys, ks], dim=1), torch.cat([vals, vs], dim=1)
            out[b.token_idx] = attend_invariant(q[b.query_idx], keys, vals, b.bias, scale)[b.valid]
        return out
