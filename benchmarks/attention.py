"""CPU attention backends on the default model: the time of whole engine steps, per backend, one run.

Each step shape (plain decodes over contexts of ``--context`` tokens, lookahead segments, mixes) runs
through the real ModelRunner of an engine per backend (``torch``: the reference; ``sdpa``: the default
CPU backend), ``--repeats`` times in alternating order across every (backend, shape), after a warm-up;
the table gives the median milliseconds and sdpa's speedup. The steps use synthetic token ids over the
first KV blocks, like the engine's start-up profile.

    .venv/bin/python benchmarks/attention.py --dtype bfloat16 --results benchmarks/results/DATE-NAME.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from lookahead_serve.engine import LLM
from lookahead_serve.kv_cache import cdiv
from lookahead_serve.scheduler import LookaheadLayout, ScheduledRequest, SchedulerOutput


def shapes(context: int, block_ids: list[int]) -> dict[str, list[ScheduledRequest]]:
    def decodes(n: int) -> list[ScheduledRequest]:
        return [ScheduledRequest(f"d{i}", [0], context, block_ids, True) for i in range(n)]

    def segments(n: int, size: int) -> list[ScheduledRequest]:
        # (4,3,4)-like: two levels of four columns and four candidates of two tokens
        lay = LookaheadLayout(2, 4, 4, 2) if size == 16 else LookaheadLayout(1, size, 0, 2)
        return [ScheduledRequest(f"l{i}", [0] * lay.num_tokens, context, block_ids, True, lookahead=lay)
                for i in range(n)]

    return {
        "1 decode": decodes(1), "16 decodes": decodes(16), "32 decodes": decodes(32),
        "1 segment of 16": segments(1, 16), "4 segments of 16": segments(4, 16),
        "16 segments of 16": segments(16, 16), "8 decodes + 8 segments of 16": decodes(8) + segments(8, 16),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", type=int, default=300, help="cached tokens of every request (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--backends", default="torch,sdpa")
    ap.add_argument("--results", type=Path, help="append a dated Markdown section to this file")
    args = ap.parse_args(argv)
    backends = args.backends.split(",")
    llms = {b: LLM(dtype=args.dtype, attention_backend=b, num_kv_blocks=64) for b in backends}
    block_size = llms[backends[0]].engine.runner.block_size
    block_ids = list(range(cdiv(args.context + 32, block_size)))
    steps = shapes(args.context, block_ids)
    outs = {k: SchedulerOutput(scheduled=v, num_scheduled_tokens=sum(len(s.token_ids) for s in v)) for k, v in steps.items()}
    cells = [(b, k) for b in backends for k in outs]
    for b, k in cells:
        llms[b].engine.runner.execute(outs[k])  # warm-up
    times: dict[tuple[str, str], list[float]] = {c: [] for c in cells}
    for r in range(args.repeats):
        for b, k in cells if r % 2 == 0 else cells[::-1]:
            t0 = time.perf_counter()
            llms[b].engine.runner.execute(outs[k])
            times[(b, k)].append(time.perf_counter() - t0)
        print(f"[{time.strftime('%H:%M:%S')}] round {r + 1}/{args.repeats}", file=sys.stderr, flush=True)
    med = {c: statistics.median(v) * 1e3 for c, v in times.items()}
    head = "| step | tokens | " + " | ".join(f"{b} ms" for b in backends) + " | speedup of the last |"
    lines = [head, "|---|---:|" + "---:|" * (len(backends) + 1)]
    for k, so in outs.items():
        lines.append(f"| {k} | {so.num_scheduled_tokens} | " + " | ".join(f"{med[(b, k)]:.1f}" for b in backends)
                     + f" | {med[(backends[0], k)] / med[(backends[-1], k)]:.2f}x |")
    text = (f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads\n\nCommand: `{shlex.join(['python', *sys.argv])}`\n\n"
            f"Default model, {args.dtype}, every request with {args.context} cached tokens; median of "
            f"{args.repeats} steps in alternating order.\n\n" + "\n".join(lines))
    print(text)
    if args.results:
        with open(args.results, "a") as f:
            f.write(f"\n## Attention backend, {datetime.date.today()}\n\n{text}\n")


if __name__ == "__main__":
    main()
