"""The shipped defaults against lookahead off and Hugging Face ``generate``, in one interleaved run.

``LLM()`` with no arguments is the product: its dtype ("auto"), attention backend and lookahead policy
(adaptive, up to the engine's default (W, N, G)). On one such engine, requests with the default lookahead
and requests with lookahead off run in turn, prompt by prompt, so both see the same machine drift:

* c=1: each prompt alone, MT-bench first turns (chat template) and HumanEval prompts (raw), plus Hugging
  Face ``generate`` (greedy, batch 1) in float32 and bfloat16 on the same prompts;
* c=8 and c=32: that many prompts in one ``generate`` call, defaults vs off;
* ``--maxima``: other per-request maxima for the adaptive policy, to choose the default by measurement;
* ``--invariance``: the cost of shape invariance in bfloat16 -- the ``invariant`` backend (the bf16
  default) against ``sdpa`` (not invariant) at c=1, lookahead off and fixed at the default (W, N, G), so
  both run the same steps -- and whether lookahead equals plain decoding token for token on each.

Every row reports tokens/s (generated tokens over wall-clock, summed over the prompts of a set) and the
ratio to lookahead off measured in the same round; the spread is over ``--rounds`` rounds.

    .venv/bin/python benchmarks/defaults.py --results benchmarks/results/DATE-NAME.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from lookahead_serve.engine import LLM, LookaheadParams, SamplingParams
from lookahead_serve.scheduler.config import DEFAULT_LOOKAHEAD
from lookahead import DATA, OFF, _emit, _header, load_prompts, log, parse_configs


def _timed(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[list[list[int]], float]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs], time.perf_counter() - start


class HF:
    """Hugging Face ``generate``, greedy, one prompt at a time, on the engine's converted weights."""

    def __init__(self, llm: LLM, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        self.tok = llm.tokenizer
        self.model = AutoModelForCausalLM.from_pretrained(llm.engine.model_path, dtype=dtype).eval()
        self.eos = list(llm.engine.eos_token_ids)

    @torch.inference_mode()
    def run(self, prompt: str, max_tokens: int) -> tuple[int, float]:
        ids = torch.tensor([self.tok(prompt).input_ids])
        start = time.perf_counter()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                  do_sample=False, eos_token_id=self.eos, pad_token_id=self.eos[0])
        return out.shape[1] - ids.shape[1], time.perf_counter() - start


def _rate_rows(name: str, tokens: dict[str, list[int]], seconds: dict[str, list[float]], base: str) -> list[str]:
    """Per mode: tokens/s (median over rounds) and the per-round ratio to ``base`` (median, min-max)."""
    rows = []
    for mode in tokens:
        rates = [t / s for t, s in zip(tokens[mode], seconds[mode], strict=True)]
        base_rates = [t / s for t, s in zip(tokens[base], seconds[base], strict=True)]
        ratios = [r / b for r, b in zip(rates, base_rates, strict=True)]
        spread = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" if mode != base else "1"
        rows.append(f"| {name} | {mode} | {statistics.median(rates):.1f} | {spread} |")
    return rows


def c1_study(args, llm: LLM, sets: dict[str, list[str]], maxima: list[LookaheadParams], raw: dict) -> list[str]:
    modes: dict[str, LookaheadParams | None] = {"lookahead off": OFF, "defaults": None}
    modes.update({f"adaptive up to {m.window_size},{m.ngram_size},{m.verification_set_size}": m for m in maxima})
    hf = {f"HF generate {d}": HF(llm, getattr(torch, d)) for d in args.hf_dtypes}
    rows = []
    for set_name, prompts in sets.items():
        prompts = prompts[: args.num_single]
        tokens = {m: [0] * args.rounds for m in [*modes, *hf]}
        seconds = {m: [0.0] * args.rounds for m in tokens}
        equal: dict[str, int] = {}
        for rnd in range(args.rounds):
            for i, p in enumerate(prompts):
                order = list(modes) if (rnd + i) % 2 == 0 else list(modes)[::-1]
                for m in order:
                    out, dt = _timed(llm, [p], SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                                              lookahead=modes[m]))
                    tokens[m][rnd] += len(out[0])
                    seconds[m][rnd] += dt
                    raw.setdefault("c1", []).append(dict(set=set_name, mode=m, round=rnd, prompt=i,
                                                         tokens=len(out[0]), seconds=dt))
                    outs = raw.setdefault("outputs", {}).setdefault(f"{set_name}/{i}", {})
                    outs[m] = out[0]
                for name, runner in hf.items():
                    n, dt = runner.run(p, args.max_tokens)
                    tokens[name][rnd] += n
                    seconds[name][rnd] += dt
                log(f"c=1 {set_name} round {rnd} prompt {i} done")
        for m in modes:
            equal[m] = sum(raw["outputs"][f"{set_name}/{i}"][m] == raw["outputs"][f"{set_name}/{i}"]["lookahead off"]
                           for i in range(len(prompts)))
        rows += [r + f" {equal.get(m, '-')}/{len(prompts)} |" for r, m in
                 zip(_rate_rows(f"{set_name}, c=1", tokens, seconds, "lookahead off"), tokens)]
    return rows


def batch_study(args, llm: LLM, sets: dict[str, list[str]], raw: dict) -> list[str]:
    pool = [p for pair in zip(*sets.values()) for p in pair]  # chat and code alternating
    rows = []
    for c in args.concurrency:
        prompts = pool[:c]
        modes = {"lookahead off": OFF, "defaults": None}
        tokens = {m: [0] * args.rounds for m in modes}
        seconds = {m: [0.0] * args.rounds for m in modes}
        outs = {}
        for rnd in range(args.rounds):
            for m in (list(modes) if rnd % 2 == 0 else list(modes)[::-1]):
                out, dt = _timed(llm, prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                                              lookahead=modes[m]))
                tokens[m][rnd], seconds[m][rnd], outs[m] = sum(map(len, out)), dt, out
                raw.setdefault("batch", []).append(dict(c=c, mode=m, round=rnd, tokens=tokens[m][rnd], seconds=dt))
            log(f"c={c} round {rnd} done")
        same = sum(a == b for a, b in zip(outs["defaults"], outs["lookahead off"], strict=True))
        rows += [r + f" {same if m == 'defaults' else '-'}/{c} |"
                 for r, m in zip(_rate_rows(f"mixed, c={c}", tokens, seconds, "lookahead off"), modes)]
    return rows


def invariance_study(args, sets: dict[str, list[str]], raw: dict) -> list[str]:
    """bf16 at c=1: invariant (the bf16 default) vs sdpa, lookahead off and fixed at the default, interleaved."""
    llms = {b: LLM(dtype="bfloat16", attention_backend=b, lookahead_policy="fixed") for b in ("invariant", "sdpa")}
    prompts = [p for pair in zip(*sets.values()) for p in pair][: args.num_invariance]
    keys = [(b, m) for b in llms for m in ("lookahead off", "fixed default")]
    tokens = {k: [0] * args.rounds for k in keys}
    seconds = {k: [0.0] * args.rounds for k in keys}
    outs: dict = {}
    for rnd in range(args.rounds):
        for i, p in enumerate(prompts):
            for b, m in (keys if (rnd + i) % 2 == 0 else keys[::-1]):
                out, dt = _timed(llms[b], [p], SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                                              lookahead=OFF if m == "lookahead off" else None))
                tokens[(b, m)][rnd] += len(out[0])
                seconds[(b, m)][rnd] += dt
                outs[(b, m, i)] = out[0]
                raw.setdefault("invariance", []).append(dict(backend=b, mode=m, round=rnd, prompt=i,
                                                             tokens=len(out[0]), seconds=dt))
            log(f"invariance round {rnd} prompt {i} done")
    rows = []
    for m in ("lookahead off", "fixed default"):
        rates = {b: [t / s for t, s in zip(tokens[(b, m)], seconds[(b, m)], strict=True)] for b in llms}
        ratios = [a / b for a, b in zip(rates["invariant"], rates["sdpa"], strict=True)]
        rows.append(f"| bf16, c=1, {m} | {statistics.median(rates['invariant']):.1f} | "
                    f"{statistics.median(rates['sdpa']):.1f} | {statistics.median(ratios):.2f}x "
                    f"({min(ratios):.2f}-{max(ratios):.2f}) |")
    for b in llms:
        same = sum(outs[(b, "fixed default", i)] == outs[(b, "lookahead off", i)] for i in range(len(prompts)))
        rows.append(f"| bf16, {b}: lookahead == off | {same}/{len(prompts)} | | |")
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mt-bench", type=Path, default=DATA / "mt_bench_questions.jsonl")
    ap.add_argument("--humaneval", type=Path, default=DATA / "humaneval.jsonl.gz")
    ap.add_argument("--num-single", type=int, default=5, help="prompts per set at c=1 (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=lambda t: [int(v) for v in t.split(",") if v], default=[8, 32])
    ap.add_argument("--maxima", type=parse_configs, default=[],
                    help="other adaptive maxima to compare at c=1, e.g. '7,4,7;15,5,15'")
    ap.add_argument("--hf-dtypes", type=lambda t: [d for d in t.split(",") if d], default=["float32", "bfloat16"])
    ap.add_argument("--invariance", action="store_true", help="also measure the cost of invariance in bf16")
    ap.add_argument("--num-invariance", type=int, default=4, help="prompts of the invariance study")
    ap.add_argument("--raw", type=Path, help="write every timed run here as JSON")
    ap.add_argument("--results", type=Path, help="append a dated Markdown section to this file")
    args = ap.parse_args(argv)

    llm = LLM()
    eng = llm.engine
    sets = load_prompts(llm, args.mt_bench, args.humaneval, max(args.num_single, max(args.concurrency, default=0)))
    d = DEFAULT_LOOKAHEAD
    log(f"defaults: dtype {eng.dtype}, backend {eng.model.model.layers[0].self_attn.backend.name}, "
        f"policy {eng.scheduler.config.lookahead.policy}, lookahead {d.window_size},{d.ngram_size},{d.verification_set_size}")
    raw: dict = {}
    head = [f"Defaults: dtype {str(eng.dtype).removeprefix('torch.')}, attention "
            f"{eng.model.model.layers[0].self_attn.backend.name}, lookahead policy "
            f"{eng.scheduler.config.lookahead.policy} up to ({d.window_size},{d.ngram_size},{d.verification_set_size}); "
            f"greedy, {args.max_tokens} new tokens, {args.rounds} rounds (ratio: median, min-max over rounds).", "",
            "| prompts | mode | tokens/s | vs lookahead off | outputs == off |", "|---|---|---|---|---|"]
    rows = c1_study(args, llm, sets, args.maxima, raw) + batch_study(args, llm, sets, raw)
    text = "\n".join([_header(), "", *head, *rows])
    if args.invariance:
        text += "\n\n" + "\n".join(["| bf16 invariance | invariant tok/s | sdpa tok/s | invariant / sdpa |",
                                    "|---|---|---|---|", *invariance_study(args, sets, raw)])
    if args.raw:
        args.raw.write_text(json.dumps(raw))
    _emit(text, "Shipped defaults vs lookahead off vs Hugging Face", args.results)


if __name__ == "__main__":
    main()
