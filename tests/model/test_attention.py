"""Every backend (the reference: paged prefix + masked in-step part, merged by log-sum-exp) against a naive
dense-mask oracle, on a packed batch of prefill chunks, decodes and lookahead segments."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from lookahead_serve.engine.attention import BACKENDS, InvariantBackend, SegmentKind
from lookahead_serve.engine.attention.invariant import kernel_supports
from lookahead_serve.engine.model_runner import build_step_inputs, tree_layout
from lookahead_serve.scheduler import ScheduledRequest
from lookahead_serve.scheduler.lookahead import LookaheadLayout

BLOCK = 4
KV_HEADS, HEADS, DIM = 2, 6, 8


def _oracle(q, k, v, mask, scale):
    """q [n, H, D]; k, v [m, KVH, D]; mask [n, m] bool -> [n, H, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,mhd->hnm", q, k) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hnm,mhd->nhd", torch.softmax(scores, dim=-1), v)


IMPLS = {**BACKENDS, "invariant": lambda: InvariantBackend(impl="torch"),
         "invariant-kernel": lambda: InvariantBackend(impl="kernel")}  # both formulations of the invariant one


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", sorted(IMPLS))
@pytest.mark.parametrize(("seed", "num_lookahead"), [(0, 1), (1, 2), (2, 3), (3, 3)])
def test_split_attention_equals_dense_oracle(seed, num_lookahead, backend, dtype):
    """One lookahead segment, or several (the sdpa backend batches those into one padded call); the oracle
    runs in float32 on the same (rounded) inputs."""
    if backend == "invariant-kernel" and not kernel_supports(DIM):
        pytest.skip("the invariant CPU kernel does not run here")
    gen = torch.Generator().manual_seed(seed)
    la = LookaheadLayout(num_levels=3, num_cols=4, num_candidates=2, candidate_len=3)
    warm = LookaheadLayout(num_levels=1, num_cols=6, num_candidates=0, candidate_len=3)
    # (context already cached, tokens this step, lookahead layout)
    plan = [(0, 7, None), (9, 5, None), (13, 1, None), (0, 1, None), (6, 1, None)] + [
        (11, la.num_tokens, la), (3, warm.num_tokens, warm), (0, la.num_tokens, la)][:num_lookahead]
    num_blocks = 64
    cache = torch.zeros(2, num_blocks * BLOCK, KV_HEADS, DIM)
    segs, prefixes = [], []
    next_block = 0
    for i, (ctx, n, lay) in enumerate(plan):
        total = ctx + (n if lay is None else la.candidate_len + 1)
        nb = -(-max(total, 1) // BLOCK)
        blocks = list(range(next_block, next_block + nb))[::-1]  # non-contiguous, reversed order
        next_block += nb
        pk, pv = torch.randn(ctx, KV_HEADS, DIM, generator=gen), torch.randn(ctx, KV_HEADS, DIM, generator=gen)
        for pos in range(ctx):
            slot = blocks[pos // BLOCK] * BLOCK + pos % BLOCK
            cache[0, slot], cache[1, slot] = pk[pos], pv[pos]
        prefixes.append((pk, pv))
        segs.append(ScheduledRequest(str(i), [1] * n, ctx, blocks, sample=True, lookahead=lay))
    inputs = build_step_inputs(segs, BLOCK, torch.device("cpu"))
    t = inputs.meta.num_tokens
    q = torch.randn(t, HEADS, DIM, generator=gen)
    k = torch.randn(t, KV_HEADS, DIM, generator=gen)
    v = torch.randn(t, KV_HEADS, DIM, generator=gen)
    scale = DIM**-0.5
    q, k, v = (x.to(dtype).float() for x in (q, k, v))  # the oracle's inputs: exactly the backend's
    cache = cache.to(dtype)
    prefixes = [(pk.to(dtype).float(), pv.to(dtype).float()) for pk, pv in prefixes]
    impl = IMPLS[backend]()
    out = impl.forward(q.to(dtype), k.to(dtype), v.to(dtype), cache, impl.build(inputs.meta), scale).float()

    starts = inputs.meta.query_start_loc
    for i, (ctx, n, lay) in enumerate(plan):
        lo, hi = starts[i], starts[i + 1]
        pk, pv = prefixes[i]
        step_mask = torch.tensor(tree_layout(lay)[1]) if lay is not None else torch.ones(n, n, dtype=torch.bool).tril()
        mask = torch.cat([torch.ones(n, ctx, dtype=torch.bool), step_mask], dim=1)
        want = _oracle(q[lo:hi], torch.cat([pk, k[lo:hi]]), torch.cat([pv, v[lo:hi]]), mask, scale)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[lo:hi], want, rtol=tol, atol=tol)


def test_plain_tokens_are_written_and_lookahead_tokens_are_not():
    la = LookaheadLayout(num_levels=2, num_cols=3, num_candidates=1, candidate_len=2)
    segs = [ScheduledRequest("a", [1, 2, 3], 2, [5, 8], sample=True),
            ScheduledRequest("b", [1] * la.num_tokens, 1, [2, 9], sample=True, lookahead=la)]
    inputs = build_step_inputs(segs, BLOCK, torch.device("cpu"))
    assert inputs.meta.kinds == [SegmentKind.PREFILL, SegmentKind.LOOKAHEAD]
    # positions 2, 3 in block 5 and 4 in block 8; every lookahead token is transient (-1)
    assert inputs.meta.slot_mapping.tolist() == [22, 23, 32] + [-1] * la.num_tokens
    assert inputs.positions.tolist() == [2, 3, 4] + [1 + o for o in la.tree()[0]]


def test_a_failed_kernel_build_falls_back_to_torch(tmp_path):
    """A machine that could run the C kernels but cannot build them (here: a compiler that fails) gets the
    torch paths everywhere, not an error at the first step."""
    from lookahead_serve.engine import native

    if native.unavailable_reason() is not None:
        pytest.skip(native.unavailable_reason())
    script = ("from lookahead_serve.engine import native\n"
              "from lookahead_serve.engine.attention.invariant import kernel_supports\n"
              "from lookahead_serve.engine.models import cpu_ops\n"
              "from lookahead_serve.engine.quant import resolve_quantization\n"
              "print(native.load_error().startswith('building'), kernel_supports(64),\n"
              "      cpu_ops._library() is None, resolve_quantization('auto', 'm.gguf', 'cpu'))\n")
    env = {**os.environ, "CC": "false", "XDG_CACHE_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "False", "True", "none"], out.stderr


def test_cpu_kv_caches_are_zero_and_disjoint():
    from lookahead_serve.engine.model_runner import _zeroed

    caches = _zeroed(3, (2, 64, 2, 8), torch.bfloat16, torch.device("cpu"))
    assert all(c.shape == (2, 64, 2, 8) and c.dtype == torch.bfloat16 and not c.any() for c in caches)
    caches[1].fill_(1.5)
    assert not caches[0].any() and not caches[2].any() and bool((caches[1] == 1.5).all())
