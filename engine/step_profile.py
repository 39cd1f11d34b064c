"""Measure the step-cost model (scheduler.cost) on this machine: a short profile at engine start-up.

It times synthetic steps through the real model runner (``profile_step_cost`` says which) and derives
``f`` at each knot, the per-segment and the per-decode cost from them. The steps read and write only the first few KV blocks, before any request owns one,
and nothing they write is registered in the prefix cache.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from scheduler import LookaheadLayout, ScheduledRequest, SchedulerOutput
from scheduler.cost import StepCostModel

logger = logging.getLogger(__name__)

CONTEXT = 48  # tokens each synthetic request has in the cache


def knots_for(max_tokens: int) -> list[int]:
    knots, t = [], 1
    while t < max_tokens:
        knots.append(t)
        t *= 2
    knots.append(max_tokens)
    return knots


def _decodes(n: int, block_ids: list[int]) -> list[ScheduledRequest]:
    return [ScheduledRequest(f"p{i}", [0], CONTEXT, block_ids, True) for i in range(n)]


def _segment(i: int, size: int, block_ids: list[int]) -> ScheduledRequest:
    # A one-level window of ``size`` tokens (x and its row): the tree mask path, no candidates.
    return ScheduledRequest(f"l{i}", [0] * size, CONTEXT, block_ids, True, lookahead=LookaheadLayout(1, size, 0, 2))


def _segments(num_segments: int, tokens_each: int, block_ids: list[int]) -> list[ScheduledRequest]:
    return [_segment(i, tokens_each, block_ids) for i in range(num_segments)]


def _time(runner, step: list[ScheduledRequest], repeats: int) -> float:
    so = SchedulerOutput(scheduled=step, num_scheduled_tokens=sum(len(s.token_ids) for s in step))
    runner.execute(so)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.execute(so)
        best = min(best, time.perf_counter() - t0)
    return best


def _lookahead_step(num_tokens: int, block_ids: list[int]) -> list[ScheduledRequest]:
    """One plain decode and lookahead segments of at most 64 tokens, ``num_tokens`` in all."""
    step = _decodes(1, block_ids)
    rest = num_tokens - 1
    k = -(-rest // 64)
    sizes = [rest // k + (i < rest % k) for i in range(k)]
    return step + [_segment(i, size, block_ids) for i, size in enumerate(sizes)]


def profile_step_cost(runner, max_tokens: int, repeats: int = 2, learning_rate: float = 0.1) -> StepCostModel:
    """Fit a StepCostModel for steps of up to ``max_tokens`` tokens on ``runner`` (an engine ModelRunner).

    ``f`` at each knot ``T`` is the fastest of ``repeats`` steps (after one warm-up) of one plain decode
    and ``T - 1`` tokens of lookahead segments (64 tokens at most each): the steps the policy weighs.
    The per-decode cost is the median, over steps of 16 and 64 plain decodes, of the time beyond ``f``
    per decode; the per-segment cost is what four 16-token segments cost beyond one 64-token segment,
    per extra segment. Knots stop at 512 tokens: above that ``f`` extrapolates the last slope, and the
    live correction takes over.
    """
    start = time.perf_counter()
    block_ids = list(range(-(-(CONTEXT + 64) // runner.block_size)))
    knots = knots_for(min(max_tokens, 512))
    steps = [_decodes(t, block_ids) if t < 3 else _lookahead_step(t, block_ids) for t in knots]
    seconds = [_time(runner, step, repeats) for step in steps]
    for i in range(1, len(seconds)):  # f never falls as tokens grow: a dip is noise
        seconds[i] = max(seconds[i], seconds[i - 1])
    cost = StepCostModel(knots, seconds, learning_rate=learning_rate)
    extra = [(_time(runner, _decodes(d, block_ids), repeats) - cost.tokens_cost(d)) / d for d in (16, 64) if d <= max_tokens]
    per_decode = max(float(np.median(extra)), 0.0) if extra else 0.0
    per_segment = 0.0
    if max_tokens >= 65:
        four = _time(runner, _decodes(1, block_ids) + _segments(4, 16, block_ids), repeats)
        one = _time(runner, _decodes(1, block_ids) + _segments(1, 64, block_ids), repeats)
        per_segment = max((four - one) / 3, 0.0)
    # f is the tokens' own cost: take out the decodes and segments each profiled step had.
    seconds = [max(t - per_decode * sum(s.lookahead is None for s in step)
                   - per_segment * sum(s.lookahead is not None for s in step), 1e-6) for t, step in zip(seconds, steps)]
    for i in range(1, len(seconds)):
        seconds[i] = max(seconds[i], seconds[i - 1])
    cost = StepCostModel(knots, seconds, per_segment=per_segment, learning_rate=learning_rate, per_decode=per_decode)
    logger.info(
        "step-cost profile in %.1f s: %s ms; %.2f ms per looped segment, %.2f ms per plain decode",
        time.perf_counter() - start,
        ", ".join(f"{k} tok {s * 1e3:.1f}" for k, s in zip(knots, seconds)),
        cost.per_segment * 1e3, cost.per_decode * 1e3,
    )
    return cost
