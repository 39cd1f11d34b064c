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

On an x86 CPU with AVX2 (``engine.native``) the backend runs one C kernel per layer instead
(``paged_cpu.c``): per query and head, the keys in position order straight from the paged cache and the
step, a fixed reduction over head_dim and over keys (key j in vector lane j % 8): the same property without
padding, gathers or dense masks. Elsewhere (GPU tensors, no compiler) the torch formulation above runs.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np
import torch

from lookahead_serve.engine import native
from lookahead_serve.engine.attention.backend import AttentionBackend, AttentionMetadata, CommonAttentionMetadata, SegmentKind
from lookahead_serve.engine.attention.shared import PaddedBatch, cached_keys, padded_batch

LANES = 16


def kernel_supports(head_dim: int | None) -> bool:
    """Whether the C kernel runs here (it builds and loads) for this head width (None: any it takes)."""
    return (head_dim is None or (head_dim % 8 == 0 and head_dim <= 256)) and native.load_error() is None


@functools.cache
def _library() -> ctypes.CDLL:
    lib = native.library()
    i, l, p = ctypes.c_int, ctypes.c_long, ctypes.c_void_p
    lib.paged_attention.restype = i
    lib.paged_attention.argtypes = [i, i, i, i, i, p, l, p, l, p, l, p, p, p, p, i, i, p, p, p, p, ctypes.c_float, p, i]
    return lib


@dataclass
class KeyPlan:
    """The C kernel's view of a step: token t (written to cache slot ``slots[t]`` first if that is >= 0) sees
    the first ``num_cached[t]`` positions of its segment's block-table row, then the step's tokens
    ``chain_idx[chain_ptr[t]:chain_ptr[t + 1]]``."""

    slots: torch.Tensor  # [T] int64
    block_table: torch.Tensor  # [S, max_blocks] int64
    tok_seg: torch.Tensor  # [T] int32
    num_cached: torch.Tensor  # [T] int32
    chain_ptr: torch.Tensor  # [T + 1] int32
    chain_idx: torch.Tensor  # [num chain keys] int32


def key_plan(common: CommonAttentionMetadata) -> KeyPlan:
    """Committed tokens (written to the cache before attention) see positions 0..p in the cache; a lookahead
    token sees the cached prefix, then its ancestors and itself (a chain: one token per position)."""
    starts = np.asarray(common.query_start_loc, dtype=np.int64)
    lens = np.diff(starts)
    tok_seg = np.repeat(np.arange(len(lens), dtype=np.int32), lens)
    num_cached = common.positions.astype(np.int32) + 1
    chain_len = np.zeros(common.num_tokens, dtype=np.int32)
    chains = []
    for s in common.segments(SegmentKind.LOOKAHEAD):
        lo, hi = starts[s], starts[s + 1]
        mask = common.tree_masks[s]
        num_cached[lo:hi] = common.context_lens[s]
        chain_len[lo:hi] = mask.sum(1)
        chains.append(np.nonzero(mask)[1].astype(np.int32) + np.int32(lo))  # row-major: each row's chain in order
    chain_ptr = np.zeros(common.num_tokens + 1, dtype=np.int32)
    np.cumsum(chain_len, out=chain_ptr[1:])
    chain_idx = np.concatenate(chains) if chains else np.zeros(1, dtype=np.int32)
    if common.num_tokens and int(num_cached.max()) > common.block_table.shape[1] * common.block_size:
        raise ValueError("a segment's keys reach past its block table")  # the kernel would read out of bounds
    return KeyPlan(torch.from_numpy(np.ascontiguousarray(common.slot_mapping, dtype=np.int64)),
                   torch.from_numpy(np.ascontiguousarray(common.block_table, dtype=np.int64)),
                   *(torch.from_numpy(x) for x in (tok_seg, num_cached, chain_ptr, chain_idx)))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] with heads and D packed (rows may be strided), as the kernel reads it."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def attend_kernel(q, k, v, kv_cache: torch.Tensor, plan: KeyPlan, block_size: int, scale: float) -> torch.Tensor:
    """The C kernel over a whole step (writing the committed tokens' k, v first): q [T, H, D]; k, v [T, KVH, D]
    (the step's); kv_cache [2, slots, KVH, D], contiguous."""
    T, H, D = q.shape
    kvh = k.shape[1]
    if not (q.dtype == k.dtype == v.dtype == kv_cache.dtype) or q.dtype not in native.DTYPE_CODES:
        raise ValueError(f"the invariant CPU kernel takes one of {list(native.DTYPE_CODES)}, got q {q.dtype}, "
                         f"cache {kv_cache.dtype}")
    if not kv_cache.is_contiguous():
        raise ValueError("the invariant CPU kernel needs a contiguous KV cache")
    q, k, v = _rows(q), _rows(k), _rows(v)
    out = torch.empty(T, H, D, dtype=q.dtype)
    if T:
        rc = _library().paged_attention(
            T, H, kvh, D, native.DTYPE_CODES[q.dtype], q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0),
            v.data_ptr(), v.stride(0), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), plan.slots.data_ptr(),
            plan.block_table.data_ptr(),
            plan.block_table.shape[1], block_size, plan.tok_seg.data_ptr(), plan.num_cached.data_ptr(),
            plan.chain_ptr.data_ptr(), plan.chain_idx.data_ptr(), scale, out.data_ptr(), torch.get_num_threads())
        if rc:
            raise MemoryError("the invariant attention kernel could not allocate its scratch memory")
    return out


@dataclass(kw_only=True)
class InvariantMetadata(AttentionMetadata):
    groups: list[PaddedBatch]  # torch path: one padded batch per segment kind present (decodes, prefill, lookahead)
    plan: KeyPlan | None = None  # C kernel path
    block_size: int = 0


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

    def __init__(self, device: str | torch.device = "cpu", head_dim: int | None = None, impl: str = "auto") -> None:
        """impl: ``kernel`` (the C kernel, CPU), ``torch``, or ``auto`` = the kernel where it runs."""
        if impl not in ("auto", "kernel", "torch"):
            raise ValueError(f"impl must be auto, kernel or torch, got {impl!r}")
        if impl == "kernel" and not kernel_supports(head_dim):
            raise ValueError("the invariant CPU kernel does not run here (see engine.native.load_error)")
        on_cpu = torch.device(device).type == "cpu"
        self.use_kernel = impl == "kernel" or (impl == "auto" and on_cpu and kernel_supports(head_dim))

    @property
    def cost_key(self) -> str:
        return f"{type(self).__name__}:{'kernel' if self.use_kernel else 'torch'}"

    def build(self, common: CommonAttentionMetadata) -> InvariantMetadata:
        if self.use_kernel:
            return InvariantMetadata(**AttentionMetadata.common_fields(common), groups=[], plan=key_plan(common),
                                     block_size=common.block_size)
        starts = common.query_start_loc
        groups = [padded_batch(common, segs, align=LANES)
                  for segs in (common.segments(SegmentKind.DECODE), common.segments(SegmentKind.PREFILL)) if segs]
        if lookahead := common.segments(SegmentKind.LOOKAHEAD):
            cols = [_columns(common.positions[starts[s] : starts[s + 1]], common.tree_masks[s].tolist())
                    for s in lookahead]
            groups.append(padded_batch(common, lookahead, cols, align=LANES))
        return InvariantMetadata(**AttentionMetadata.common_fields(common), groups=groups)

    def forward(self, q, k, v, kv_cache, meta: InvariantMetadata, scale: float) -> torch.Tensor:
        if meta.plan is not None:
            return attend_kernel(q, k, v, kv_cache, meta.plan, meta.block_size, scale)
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
