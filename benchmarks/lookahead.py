"""Lookahead decoding on the default model: compression ratio and wall-clock against lookahead off.

For each prompt set (MT-bench first turns through the chat template; HumanEval prompts raw) and each
(W, N, G) in ``--configs``, plus lookahead off, it runs greedy generation of ``--max-tokens`` tokens:

* ``batch``  -- all ``--num-prompts`` prompts in one ``generate`` call (continuous batching);
* ``single`` -- the first ``--num-single`` prompts one at a time (batch 1).

Reported per row: generated tokens, decoding steps (forward passes that produced at least one token of
a request; the prefill that yields the first token counts), the compression ratio (tokens / steps, summed
over requests, and the mean of the per-request ratios), the same over the first 10 prompts, wall-clock
seconds, tokens/s, speedup over lookahead off in the same mode, and whether every output equals plain
greedy decoding token for token.

    .venv/bin/python benchmarks/lookahead.py --results benchmarks/results/DATE-NAME.md

``--concurrency 1,4,16,32`` runs the scheduling study instead (``concurrency_study``: adaptive, one mode
per ``--objectives``, vs off vs ``--fixed`` configs, on one engine), and ``--window-value`` what a
lookahead step without candidates is worth (``window_value_study``). ``--device cuda`` and ``--model``
run any of them on a GPU or another model (``benchmarks/gpu_lookahead.sh`` does so on the device machine).

Prompt files default to ../shared/data (``--mt-bench``, ``--humaneval``).
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import platform
import shlex
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from lookahead_serve.engine import LLM, LookaheadParams, SamplingParams
from lookahead_serve.scheduler.lookahead import step_tokens

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"
OFF = LookaheadParams(enabled=False)


@dataclass
class Row:
    prompt_set: str
    mode: str
    config: LookaheadParams
    tokens: list[int]
    steps: list[int]
    seconds: float
    identical: bool | None = None
    speedup: float | None = None

    @property
    def label(self) -> str:
        c = self.config
        return "off" if c.is_plain else f"({c.window_size},{c.ngram_size},{c.verification_set_size})"

    def ratio(self, n: int | None = None) -> float:
        return sum(self.tokens[:n]) / sum(self.steps[:n])

    def mean_ratio(self) -> float:
        return sum(t / s for t, s in zip(self.tokens, self.steps)) / len(self.tokens)


class Acc:
    """One mode's totals in a cell of the concurrency study, and its tokens and seconds round by round."""

    def __init__(self, units: int) -> None:
        self.first: list[list | None] = [None] * units  # outputs of the first round, unit by unit
        self.stable = True  # same outputs every round
        self.tokens = self.steps = 0
        self.seconds = self.abs_err = self.step_seconds = 0.0
        self.rounds: dict[int, list[float]] = {}  # round -> [tokens, seconds]

    @property
    def outputs(self) -> list:
        return [o for unit in self.first for o in unit]

    def add(self, rnd: int, tokens: int, steps: int, seconds: float) -> None:
        self.tokens += tokens
        self.steps += steps
        self.seconds += seconds
        r = self.rounds.setdefault(rnd, [0, 0.0])
        r[0] += tokens
        r[1] += seconds

    def paired_ratios(self, other: "Acc") -> list[float]:
        """This mode's tokens/s over the other's in each round both ran."""
        return [(t / s) / (other.rounds[r][0] / other.rounds[r][1]) for r, (t, s) in self.rounds.items() if r in other.rounds]

    def shared_ratio(self, other: "Acc") -> float:
        """This mode's tokens/s over the other's, both totalled over the rounds both ran (a mode screened out
        after a few rounds is compared on those rounds only, not against another period of the machine)."""
        shared = self.rounds.keys() & other.rounds.keys()

        def rate(acc: "Acc") -> float:
            return sum(acc.rounds[r][0] for r in shared) / sum(acc.rounds[r][1] for r in shared)

        return rate(self) / rate(other)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load_prompts(llm: LLM, mt_path: Path, he_path: Path, n: int) -> dict[str, list[str]]:
    with open(mt_path) as f:
        mt = [json.loads(line)["turns"][0] for line in f if line.strip()][:n]
    with gzip.open(he_path, "rt") as f:
        he = [json.loads(line)["prompt"] for line in f if line.strip()][:n]
    chat = [llm.engine.apply_chat_template([{"role": "user", "content": q}]) for q in mt]
    return {"MT-bench": chat, "HumanEval": he}


def run(llm: LLM, prompts: list[str], config: LookaheadParams, max_tokens: int, single: bool,
        seed: int | None = None) -> tuple[list, float]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, lookahead=config, seed=seed)
    start = time.perf_counter()
    if single:
        outs = [llm.generate(p, params)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, params)
    return outs, time.perf_counter() - start


def parse_configs(text: str) -> list[LookaheadParams]:
    return [LookaheadParams.parse(part) for part in text.split(";") if part]


def table(rows: list[Row]) -> str:
    head = (
        "| prompts | mode | (W,N,G) | n | tokens | steps | tokens/step | mean per request | first 10 | "
        "wall s | tok/s | speedup vs off | identical to off |\n|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
    )
    lines = [head]
    for r in rows:
        ident = "-" if r.identical is None else ("yes" if r.identical else "**no**")
        lines.append(
            f"| {r.prompt_set} | {r.mode} | {r.label} | {len(r.tokens)} | {sum(r.tokens)} | {sum(r.steps)} | "
            f"{r.ratio():.3f} | {r.mean_ratio():.3f} | {r.ratio(10):.3f} | {r.seconds:.1f} | "
            f"{sum(r.tokens) / r.seconds:.1f} | {r.speedup:.2f}x | {ident} |"
        )
    return "\n".join(lines)


def seed_study(llm: LLM, sets: dict[str, list[str]], args: argparse.Namespace) -> str:
    """Compression ratio on the first 10 prompts (batch mode) for each seed of the window's random start."""
    lines = [
        f"\n\nCompression ratio (tokens / steps, first 10 prompts, batch mode) by request seed {args.seeds}; "
        "the seed only picks the prompt tokens the window starts from.\n\n"
        "| prompts | (W,N,G) | " + " | ".join(f"seed {s}" for s in args.seeds) + " | mean | min | max | identical to off |",
        "|---|---|" + "---:|" * (len(args.seeds) + 3) + "---|",
    ]
    for name, prompts in sets.items():
        prompts = prompts[:10]
        off, _ = run(llm, prompts, OFF, args.max_tokens, False)
        off_ids = [o.outputs[0].token_ids for o in off]
        for config in args.configs:
            ratios, identical = [], True
            for seed in args.seeds:
                outs, seconds = run(llm, prompts, config, args.max_tokens, False, seed)
                identical &= [o.outputs[0].token_ids for o in outs] == off_ids
                ratios.append(sum(o.metrics.num_output_tokens for o in outs) / sum(o.metrics.num_steps for o in outs))
                log(f"{name} {config} seed {seed}: {ratios[-1]:.3f} tokens/step, {seconds:.1f} s")
            label = Row(name, "batch", config, [], [], 0.0).label
            lines.append(f"| {name} | {label} | " + " | ".join(f"{r:.3f}" for r in ratios)
                         + f" | {sum(ratios) / len(ratios):.3f} | {min(ratios):.3f} | {max(ratios):.3f} | "
                         + ("yes" if identical else "**no**") + " |")
    return "\n".join(lines)


def _prefix_match(a: list[int], b: list[int]) -> float:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return n / max(len(a), len(b), 1)


def concurrency_study(args: argparse.Namespace, sets: dict[str, list[str]]) -> str:
    """Adaptive vs lookahead off vs fixed configs at each concurrency, in one run on one engine: the
    scheduler switches policy between modes, so every mode runs the same weights in the same memory."""
    budget = args.max_step_tokens
    log("profiling the step cost ...")
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_num_batched_tokens=budget, max_num_seqs=256,
              lookahead_policy="adaptive")
    cost = llm.engine.scheduler.planner.cost_model
    profile = ", ".join(f"{k}: {v * 1e3:.1f}" for k, v in zip(cost.knots, cost.seconds))
    adaptive_chosen: dict[str, Counter[str]] = {}
    top = Row('', '', args.adaptive_max, [], [], 0).label[1:-1]
    modes = [("off", "fixed", OFF, None)] + [(Row("", "", c, [], [], 0).label, "fixed", c, None) for c in args.fixed] + [
        (f"adaptive, {objective} (max {top})", "adaptive", args.adaptive_max, objective) for objective in args.objectives]
    lines = [
        f"\n\nConcurrency study: {args.dtype}, greedy, {args.max_tokens} new tokens, the first max({args.min_prompts}, c) prompts "
        f"of each set at concurrency c (max_num_seqs = c), token budget {budget} per step. Each (set, c) runs every mode "
        f"for {min(args.screen_rounds, args.rounds)} rounds; then the modes more than {args.screen_margin:.0%} slower than the best "
        f"stop and the rest (adaptive always) run to {args.rounds} rounds. "
        + ("A round runs every mode on each batch of c prompts in turn, " if args.interleave == "batch" else
           "A round runs every mode on the cell's prompts in turn, ")
        + "the order alternating and rotating from one batch to the next, so that the machine's drift falls on every "
        f"mode alike. Tokens, steps and wall seconds are totals over a mode's rounds; 'vs best other' gives in brackets "
        f"the lowest and highest ratio in single rounds (the machine's noise), and 'round ratio' the mean of those "
        f"single-round ratios ± twice its standard error. Fixed configs whose c x step tokens "
        f"exceed {args.max_fixed_step_tokens} are not run (marked skipped). All modes run on one engine, which switches policy between them. Step-cost profile at start-up "
        f"(tokens: ms): {profile}; {cost.per_segment * 1e3:.2f} ms per looped segment, "
        f"{cost.per_decode * 1e3:.2f} ms per plain decode, {cost.decode_overhead * 1e3:.2f} ms for a step having plain "
        "decodes. 'vs best other' compares each mode with the best mode of the other policy (adaptive against off "
        "and the fixed configs; those against every other mode): the one it trails most. 'vs off' and 'vs best other' "
        "total each pair over the rounds both ran, so a mode screened out early is compared on its own rounds.\n",
        "| prompts | c | mode | requests | rounds | tokens | steps | tokens/step | wall s | tok/s | vs off | vs best other | "
        "round ratio | step-time model error | identical to off | mean matching prefix |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, all_prompts in sets.items():
        for c in args.concurrency:
            prompts = all_prompts[: max(args.min_prompts, c)]
            runnable = [(label, policy, config, objective) for label, policy, config, objective in modes
                        if config.is_plain or policy == "adaptive" or c * step_tokens(
                            config.window_size, config.ngram_size, config.verification_set_size) <= args.max_fixed_step_tokens]
            # A unit is what one generate call runs: c prompts (--interleave batch) or the cell's prompts (set).
            step = c if args.interleave == "batch" else len(prompts)
            units = [prompts[i: i + step] for i in range(0, len(prompts), step)]
            run(llm, prompts, OFF, 1, False)  # untimed: every timed run finds the prompts in the prefix cache
            acc = {label: Acc(len(units)) for label, *_ in runnable}
            active = runnable
            for rnd in range(args.rounds):
                if rnd == args.screen_rounds and args.screen_rounds < args.rounds:
                    best = max(a.tokens / a.seconds for a in acc.values())
                    active = [m for m in runnable if m[1] == "adaptive"
                              or acc[m[0]].tokens / acc[m[0]].seconds >= (1 - args.screen_margin) * best]
                    dropped = [m[0] for m in runnable if m not in active]
                    log(f"{name} c={c}: after {rnd} rounds, {', '.join(dropped) or 'no mode'} more than "
                        f"{args.screen_margin:.0%} slower than the best; the rest run {args.rounds} rounds")
                log(f"{name} c={c}, round {rnd + 1}/{args.rounds}: {len(active)} modes x {len(units)} units ...")
                for j, unit in enumerate(units):
                    # Alternate the order and rotate it, unit by unit, so that every mode runs in every place.
                    k = rnd * len(units) + j
                    order = active if k % 2 == 0 else active[::-1]
                    shift = (k // 2) % len(order)
                    for label, policy, config, objective in order[shift:] + order[:shift]:
                        eng = llm.engine
                        cfg = eng.scheduler.config
                        eng.scheduler.reconfigure(replace(cfg, max_num_seqs=c, lookahead=replace(
                            cfg.lookahead, policy=policy, objective=objective or "throughput")))
                        before = (eng.step_abs_error_seconds_total, eng.step_seconds_total)
                        chosen_before = Counter(eng.lookahead_chosen)
                        outs, seconds = run(llm, unit, config, args.max_tokens, False)
                        a = acc[label]
                        ids = [o.outputs[0].token_ids for o in outs]
                        if a.first[j] is None:
                            a.first[j] = outs
                        else:
                            a.stable &= ids == [o.outputs[0].token_ids for o in a.first[j]]  # same every round
                        toks = sum(o.metrics.num_output_tokens for o in outs)
                        a.add(rnd, toks, sum(o.metrics.num_steps for o in outs), seconds)
                        if policy == "adaptive":
                            adaptive_chosen.setdefault(label, Counter()).update(eng.lookahead_chosen - chosen_before)
                        a.abs_err += eng.step_abs_error_seconds_total - before[0]
                        a.step_seconds += eng.step_seconds_total - before[1]
                log("  " + ", ".join(f"{lab}: {acc[lab].tokens / acc[lab].steps:.3f} tokens/step, "
                                     f"{acc[lab].tokens / acc[lab].seconds:.1f} tok/s" for lab, *_ in active))
            first_row = len(lines)
            off_ids = [o.outputs[0].token_ids for o in acc["off"].outputs]
            rates = {lab: a.tokens / a.seconds for lab, a in acc.items()}
            policy_of = {lab: policy for lab, policy, *_ in modes}
            for lab, _, config, _ in modes:
                if lab not in acc:
                    lines.append(f"| {name} | {c} | {lab} | {len(prompts)} | | skipped | | | | | | | | | | |")
                    continue
                a = acc[lab]
                err = a.abs_err / a.step_seconds if a.step_seconds else None
                ids = [o.outputs[0].token_ids for o in a.outputs]
                others = [k for k in rates if k != lab and (policy_of[lab] != "adaptive" or policy_of[k] != "adaptive")]
                # The best other mode is the one this mode trails most (or leads least) over the rounds both ran.
                vs = {k: a.shared_ratio(acc[k]) for k in others}
                best_label = min(vs, key=vs.__getitem__)
                paired = a.paired_ratios(acc[best_label])
                mean = sum(paired) / len(paired)
                se = (sum((r - mean) ** 2 for r in paired) / (len(paired) - 1) / len(paired)) ** 0.5 if len(paired) > 1 else 0.0
                same = sum(x == y for x, y in zip(ids, off_ids))
                match = sum(_prefix_match(x, y) for x, y in zip(ids, off_ids)) / len(ids)
                lines.append(
                    f"| {name} | {c} | {lab} | {len(prompts)} | {len(a.rounds)} | {a.tokens} | {a.steps} | "
                    f"{a.tokens / a.steps:.3f} | {a.seconds:.1f} | {rates[lab]:.1f} | {a.shared_ratio(acc['off']):.2f}x | "
                    f"{vs[best_label]:.2f}x ({min(paired):.2f}-{max(paired):.2f}) | {mean:.2f} ± {2 * se:.2f} | "
                    f"{'-' if err is None else f'{err * 100:.0f}%'} | {same}/{len(ids)}{'' if a.stable else ' (varied by round)'} | "
                    f"{match * 100:.1f}% |"
                )
            log("cell done:\n" + "\n".join(lines[first_row:]))  # a run cut short keeps the cells it finished
    for label, counts in adaptive_chosen.items():
        chosen = ", ".join(f"{k}: {v}" for k, v in counts.most_common(8))
        lines.append(f"\nMode {label}, lookahead segments run by (w,n,g), most common first: {chosen or 'none'}.")
    return "\n".join(lines)


def window_value_study(args: argparse.Namespace, sets: dict[str, list[str]]) -> str:
    """What a lookahead step whose pool lookup finds no candidate is worth (``scheduler.policy.WINDOW_VALUE``):
    each of ``--configs``, fixed, at concurrency 1 on the first ``--min-prompts`` prompts of each set, once as
    is and once with such steps decoded plainly instead (their window then does not advance). The extra
    tokens lost per step so replaced, over the prior gain of the config, is the window's value (bf16 outputs
    of the two runs may differ in length, so the loss is taken per output token)."""
    from lookahead_serve.scheduler import Scheduler
    from lookahead_serve.scheduler.policy import prior_gain

    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_num_batched_tokens=args.max_step_tokens,
              max_num_seqs=1)
    options = Scheduler._options

    def with_candidates_only(self, req):
        state = req.lookahead
        if not state.pool.lookup(req.all_token_ids[-1], 1, state.ngram_size - 1):
            return []
        return options(self, req)

    lines = [
        f"\n\nWindow-only steps: {args.dtype}, greedy, {args.max_tokens} new tokens, concurrency 1, the first "
        f"{args.min_prompts} prompts of each set. 'window-only steps' counts the steps that found no candidate when run "
        "as usual; 'value' = extra tokens lost per such step (the usual run's tokens times the change in steps per "
        "token) / the prior gain of the config.\n",
        "| prompts | (W,N,G) | tokens/step as usual | window-only steps | tokens/step without them | value |",
        "|---|---|---:|---:|---:|---:|",
    ]
    try:
        for config in args.configs:
            for name, all_prompts in sets.items():
                prompts = all_prompts[: args.min_prompts]
                res = []
                for skip in (False, True):
                    Scheduler._options = with_candidates_only if skip else options
                    outs, _ = run(llm, prompts, config, args.max_tokens, False)
                    toks = sum(o.metrics.num_output_tokens for o in outs)
                    steps = sum(o.metrics.num_steps for o in outs)
                    dry = sum(sum(o.metrics.accepted_lengths.values()) - o.metrics.pool_hits for o in outs)
                    res.append((toks, steps, dry))
                (t0, s0, dry0), (t1, s1, _) = res
                lost = t0 * (s1 / t1 - s0 / t0)  # steps the usual run would need more, at its own token count
                gain = prior_gain(config.window_size, config.ngram_size, config.verification_set_size)
                label = Row("", "", config, [], [], 0).label
                lines.append(f"| {name} | {label} | {t0 / s0:.3f} | {dry0} | {t1 / s1:.3f} | "
                             f"{lost / dry0 / gain if dry0 else float('nan'):.2f} |")
                log(lines[-1])
    finally:
        Scheduler._options = options
    return "\n".join(lines)


def _header() -> str:
    gpu = f", GPU: {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (f"Machine: {platform.platform()}, {os.cpu_count()} CPUs{gpu}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads\n\nCommand: `{shlex.join([sys.executable.split('/')[-1], *sys.argv])}`")


def _emit(text: str, heading: str, results: Path | None) -> None:
    """Print ``text``; with ``results``, append it there as a dated Markdown section."""
    print(text)
    if results:
        with open(results, "a") as f:
            f.write(f"\n## {heading}, {datetime.date.today()}\n\n{text}\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mt-bench", type=Path, default=DATA / "mt_bench_questions.jsonl")
    ap.add_argument("--humaneval", type=Path, default=DATA / "humaneval.jsonl.gz")
    ap.add_argument("--num-prompts", type=int, default=20, help="prompts per set in batch mode (default: %(default)s)")
    ap.add_argument("--num-single", type=int, default=5, help="prompts per set at batch 1 (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--configs", type=parse_configs, default=parse_configs("15,5,15;7,5,7;5,3,5;4,3,4"),
                    help="semicolon-separated W,N,G (default: 15,5,15;7,5,7;5,3,5;4,3,4)")
    ap.add_argument("--modes", default="batch,single", help="batch and/or single (default: %(default)s)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    ap.add_argument("--model", default=None, help="a .gguf file or Hugging Face folder (default: the embedded model)")
    ap.add_argument("--seeds", type=lambda t: [int(v) for v in t.split(",")], default=[],
                    help="also run batch mode on the first 10 prompts once per request seed (the window's random "
                         "start) and report the spread of the compression ratio, e.g. 0,1,2,3,4")
    ap.add_argument("--concurrency", type=lambda t: [int(v) for v in t.split(",")], default=[],
                    help="run the scheduling study at these concurrencies, e.g. 1,4,16,32: adaptive vs off vs --fixed "
                         "(see --rounds, --screen-rounds, --interleave)")
    ap.add_argument("--fixed", type=parse_configs, default=parse_configs("15,5,15;4,3,4"),
                    help="fixed configs of the concurrency study (default: 15,5,15;4,3,4)")
    ap.add_argument("--adaptive-max", type=lambda t: parse_configs(t)[0], default=LookaheadParams(15, 5, 15),
                    help="every request's maximum (W,N,G) under the adaptive policy (default: 15,5,15)")
    ap.add_argument("--objectives", type=lambda t: t.split(","), default=["makespan"],
                    help="adaptive modes of the study, one per lookahead objective: makespan and/or throughput "
                         "(default: makespan, what LLM.generate uses)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds per (set, concurrency) in the study for adaptive and the modes that pass the screen "
                         "(default: %(default)s)")
    ap.add_argument("--screen-rounds", type=int, default=3,
                    help="rounds every mode runs before those more than --screen-margin slower than the best stop "
                         "(default: %(default)s)")
    ap.add_argument("--screen-margin", type=float, default=0.2, help="see --screen-rounds (default: %(default)s)")
    ap.add_argument("--interleave", choices=["batch", "set"], default="batch",
                    help="what each mode runs in turn within a round: each batch of c prompts, or the cell's whole "
                         "prompt set as one queue (default: %(default)s)")
    ap.add_argument("--min-prompts", type=int, default=4,
                    help="prompts per set at concurrency c in the study: max(this, c) (default: %(default)s)")
    ap.add_argument("--max-step-tokens", type=int, default=4096, help="token budget per step in the study")
    ap.add_argument("--max-fixed-step-tokens", type=int, default=1024,
                    help="skip a fixed config at a concurrency whose full steps exceed this many tokens (time)")
    ap.add_argument("--results", type=Path, help="append a dated Markdown section to this file")
    ap.add_argument("--window-value", action="store_true",
                    help="measure what a lookahead step without candidates is worth, for each of --configs")
    args = ap.parse_args(argv)
    study = window_value_study if args.window_value else concurrency_study if args.concurrency else None
    if study is not None:
        llm0 = LLM(args.model, dtype=args.dtype, num_kv_blocks=64)  # only for the chat template
        sets = load_prompts(llm0, args.mt_bench, args.humaneval, max(args.concurrency + [args.min_prompts]))
        del llm0
        heading = "Lookahead window value" if args.window_value else "Lookahead scheduling"
        _emit(_header() + study(args, sets), heading, args.results)
        return

    budget = max(step_tokens(c.window_size, c.ngram_size, c.verification_set_size) for c in args.configs)
    # Room for every request's largest lookahead segment at once: no request falls back for lack of budget.
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_num_batched_tokens=max(512, budget * args.num_prompts),
              max_num_seqs=256)
    sets = load_prompts(llm, args.mt_bench, args.humaneval, args.num_prompts)
    rows: list[Row] = []
    for mode in filter(None, args.modes.split(",")):
        for name, prompts in sets.items():
            if mode == "single":
                prompts = prompts[: args.num_single]
            baseline = None
            for config in [OFF, *args.configs]:
                log(f"{name} {mode} {config} on {len(prompts)} prompts ...")
                outs, seconds = run(llm, prompts, config, args.max_tokens, mode == "single")
                row = Row(name, mode, config, [o.metrics.num_output_tokens for o in outs],
                          [o.metrics.num_steps for o in outs], seconds)
                ids = [o.outputs[0].token_ids for o in outs]
                if baseline is None:
                    baseline = (ids, row)
                else:
                    row.identical = ids == baseline[0]
                row.speedup = (sum(row.tokens) / seconds) / (sum(baseline[1].tokens) / baseline[1].seconds)
                log(f"  {row.ratio():.3f} tokens/step, {seconds:.1f} s, identical={row.identical}")
                rows.append(row)
    seed_rows = seed_study(llm, sets, args) if args.seeds else ""
    text = (
        f"{_header()}\n\nGreedy, {args.dtype}, at most {args.max_tokens} new tokens (EOS ends a request), default "
        f"model.\n\n{table(rows) if rows else ''}{seed_rows}"
    )
    _emit(text, "Lookahead decoding", args.results)


if __name__ == "__main__":
    main()
