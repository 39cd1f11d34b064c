"""Measure the step-cost model (scheduler.cost) on this machine: a short profile at engine start-up.

It times synthetic steps through the real model runner (``profile_step_cost`` says which), each several
times in alternating order, and derives ``f`` at each knot, the per-segment and per-decode costs and the
decode overhead from their medians. The model's live fit starts from these. The steps read and write only
the first few KV blocks, before any request owns one, and nothing they write is registered in the prefix
cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from lookahead_serve.engine import native
from lookahead_serve.kv_cache import cdiv
from lookahead_serve.scheduler import LookaheadLayout, ScheduledRequest, SchedulerOutput
from lookahead_serve.scheduler.cost import StepCostModel

logger = logging.getLogger(__name__)

CONTEXT = 48  # tokens each synthetic request has in the cache
PROFILE_VERSION = 2  # 2: the C decoder step; bump when the profile's steps or derivation change: older cached profiles are ignored


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


def _time_all(runner, steps: list[list[ScheduledRequest]], repeats: int) -> list[float]:
    """Median seconds of each step over ``repeats`` rounds, after one warm-up each; the rounds alternate
    forward and backward through the steps, so a machine that speeds up or slows down during the profile
    shifts every step alike instead of the last ones."""
    outs = [SchedulerOutput(scheduled=s, num_scheduled_tokens=sum(len(r.token_ids) for r in s)) for s in steps]
    for so in outs:
        runner.execute(so)
    times: list[list[float]] = [[] for _ in outs]
    for r in range(repeats):
        for i in (range(len(outs)) if r % 2 == 0 else reversed(range(len(outs)))):
            t0 = time.perf_counter()
            runner.execute(outs[i])
            times[i].append(time.perf_counter() - t0)
    return [float(np.median(t)) for t in times]


def _lookahead_step(num_tokens: int, block_ids: list[int]) -> list[ScheduledRequest]:
    """One plain decode and lookahead segments of at most 64 tokens, ``num_tokens`` in all."""
    step = _decodes(1, block_ids)
    rest = num_tokens - 1
    k = cdiv(rest, 64)
    sizes = [rest // k + (i < rest % k) for i in range(k)]
    return step + [_segment(i, size, block_ids) for i, size in enumerate(sizes)]


def profile_step_cost(runner, max_tokens: int, repeats: int = 5, learning_rate: float = 0.1) -> StepCostModel:
    """Measure a StepCostModel for steps of up to ``max_tokens`` tokens on ``runner`` (an engine ModelRunner).

    Every step below is timed ``repeats`` times (``_time_all``: the median, in alternating order).
    ``f`` at each knot ``T`` comes from a step of one plain decode and ``T - 1`` tokens of lookahead
    segments (64 tokens at most each), the steps the policy weighs (``T`` < 3: ``T`` plain decodes). The
    per-decode cost is the median, over steps of 16 and 64 plain decodes, of their time beyond ``f`` per
    decode; the per-segment cost is what four 16-token segments cost beyond one 64-token segment, per extra
    segment; the decode overhead is what one plain decode next to a 15-token segment costs beyond a
    16-token segment alone, less one decode. Knots stop at 512 tokens: above that ``f`` extrapolates the
    last slope, and the live fit takes over.
    """
    start = time.perf_counter()
    block_ids = list(range(cdiv(CONTEXT + 64, runner.block_size)))
    knots = knots_for(min(max_tokens, 512))
    steps = [_decodes(t, block_ids) if t < 3 else _lookahead_step(t, block_ids) for t in knots]
    extra: dict[str, list[ScheduledRequest]] = {f"{d} decodes": _decodes(d, block_ids) for d in (16, 64) if d <= max_tokens}
    if max_tokens >= 65:
        extra["4 x 16"] = _decodes(1, block_ids) + _segments(4, 16, block_ids)
        extra["1 x 64"] = _decodes(1, block_ids) + _segments(1, 64, block_ids)
    if max_tokens >= 16:
        extra["16 alone"] = [_segment(0, 16, block_ids)]
        extra["15 + decode"] = _decodes(1, block_ids) + [_segment(0, 15, block_ids)]
    measured = _time_all(runner, steps + list(extra.values()), repeats)
    seconds, timed = measured[: len(steps)], dict(zip(extra, measured[len(steps) :]))
    for i in range(1, len(seconds)):  # f never falls as tokens grow: a dip is noise
        seconds[i] = max(seconds[i], seconds[i - 1])
    # Provisional f (every knot as measured, with its decode and segments) to take per-decode costs from.
    rough = StepCostModel(knots, seconds, learning_rate=0.0)
    beyond = [(timed[f"{d} decodes"] - rough.tokens_cost(d)) / d for d in (16, 64) if f"{d} decodes" in timed]
    per_decode = max(float(np.median(beyond)), 0.0) if beyond else 0.0
    per_segment = max((timed["4 x 16"] - timed["1 x 64"]) / 3, 0.0) if "4 x 16" in timed else 0.0
    overhead = max(timed["15 + decode"] - timed["16 alone"] - per_decode, 0.0) if "16 alone" in timed else 0.0
    # f is the tokens' own cost: take out the decodes and segments each profiled step had.
    seconds = [max(t - (per_decode * d + overhead * (d > 0)) - per_segment * (len(step) - d), 1e-6)
               for t, step in zip(seconds, steps) for d in [sum(s.lookahead is None for s in step)]]
    for i in range(1, len(seconds)):
        seconds[i] = max(seconds[i], seconds[i - 1])
    cost = StepCostModel(knots, seconds, per_segment=per_segment, learning_rate=learning_rate,
                         per_decode=per_decode, decode_overhead=overhead)
    logger.info(
        "step-cost profile in %.1f s: %s ms; %.2f ms per looped segment, %.2f ms per plain decode, "
        "%.2f ms for a step having plain decodes",
        time.perf_counter() - start,
        ", ".join(f"{k} tok {s * 1e3:.1f}" for k, s in zip(knots, seconds)),
        cost.per_segment * 1e3, cost.per_decode * 1e3, cost.decode_overhead * 1e3,
    )
    return cost


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _model_key(model_path: Path) -> list:
    """The model folder and the size and modification time of its weights and config."""
    files = sorted(p for p in Path(model_path).iterdir() if p.suffix in (".safetensors", ".json"))
    return [str(model_path)] + [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]


def profile_key(runner, model_path: Path, backend: str, max_tokens: int, quantization: str = "none") -> str:
    """What a profile depends on: the machine (processor, threads, device), the model, its quantization,
    dtype, attention backend, step budget and the profile's own version."""
    device = runner.device
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    parts = [PROFILE_VERSION, platform.machine(), device_name, torch.__version__, torch.get_num_threads(),
             _model_key(model_path), str(runner.kv_caches[0].dtype), backend, runner.block_size, max_tokens]
    if quantization != "none":  # keeps the keys of dequantized models' profiles as they were
        parts += [quantization, native.source_digest()]  # the C step's kernels: a change re-measures
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:20]


def cached_step_cost(runner, model_path: Path, backend: str, max_tokens: int, cache_dir: Path,
                     quantization: str = "none") -> StepCostModel:
    """The step-cost profile for this machine, model, dtype and backend: read from ``cache_dir`` when it was
    measured before, else measured now (``profile_step_cost``) and saved. The live fit corrects the saved
    profile as steps run, as it corrects a fresh one."""
    path = Path(cache_dir) / f"{profile_key(runner, model_path, backend, max_tokens, quantization)}.json"
    try:
        fields = json.loads(path.read_text())
        cost = StepCostModel(**fields)
        logger.info("step-cost profile read from %s", path)
        return cost
    except (OSError, ValueError, TypeError):
        pass  # none yet, or unreadable: measure
    cost = profile_step_cost(runner, max_tokens)
    fields = dict(knots=list(cost.knots), seconds=list(cost.seconds), per_segment=cost.per_segment,
                  learning_rate=cost.learning_rate, per_decode=cost.per_decode, decode_overhead=cost.decode_overhead)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(fields))
        tmp.replace(path)  # atomic: a concurrent reader sees the old file or the new one
    except OSError as e:
        logger.warning("could not save the step-cost profile to %s: %s", path, e)
    return cost
