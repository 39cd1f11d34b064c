"""Offline throughput of lookahead-serve against Hugging Face transformers baselines, in one run.

What it measures: output tokens per second for the same greedy, fp32, CPU workload on four systems,
each at concurrency levels 1, 8 and 32 (``--concurrency``):

* ``ours``      -- ``LLM().generate`` over the c prompts in one call, with lookahead decoding off by
                   default (``--lookahead off``): this measures the paged, continuously batched engine
                   itself; ``--lookahead default`` or ``--lookahead W,N,G`` turns it on
                   (benchmarks/lookahead.py measures lookahead properly).
* ``hf``        -- ``model.generate`` one request at a time. Its tokens/s does not depend on c, so for
                   c > 1 it is measured once on ``--num-sequential`` prompts and that rate fills every row.
* ``hf_padded`` -- ``model.generate`` on one left-padded batch of the c prompts (attention mask passed).
* ``hf_cb``     -- transformers' continuous batching, ``model.generate_batch`` (paged KV cache, sdpa
                   attention on CPU), sized to the workload so it does not reserve most of the RAM.

The workload is the first turn of MT-bench questions (``--questions``, one JSON object a line with
``"turns": [first, second]``), rendered through the model's chat template and tokenized once, so every
system sees the same prompt token ids. Every system generates exactly ``--max-tokens`` tokens per prompt
(our ``ignore_eos=True``; HF's ``eos_token_id=-1``, which never matches, plus ``min_new_tokens``). For c = 1,
every system runs ``--num-single`` prompts one after another. Each system gets one short warm-up first.
The "same ids as ours" column compares each baseline's token ids with ours prompt by prompt (a sanity
check, not an assertion: fp32 kernels that differ can flip a near-tied argmax and diverge from there).

Run it from the repository root (a full run takes several minutes on a small CPU)::

    .venv/bin/python benchmarks/throughput.py --results benchmarks/results/DATE-NAME.md

A quick smoke run::

    .venv/bin/python benchmarks/throughput.py --concurrency 1,4 --max-tokens 16 --num-single 1 --num-sequential 1

Run it on an otherwise idle machine: with OpenMP's default spin-waiting, torch on the main thread slows
down many times over when other processes compete for the cores, while ``generate_batch`` (which runs the
model on a background thread) is hardly affected, so the ratios are meaningless on a busy machine. The
machine line records the load average; ``OMP_WAIT_POLICY=PASSIVE`` in the environment avoids the collapse.

The Markdown table goes to stdout; progress goes to stderr; ``--results FILE`` appends a dated section
(machine, versions, command line, table) to FILE.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import platform
import shlex
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel
from transformers.generation import ContinuousBatchingConfig

from lookahead_serve.engine import LLM, LLMEngine, LookaheadParams, SamplingParams

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_QUESTIONS = REPO_ROOT.parent / "shared" / "data" / "mt_bench_questions.jsonl"
SYSTEMS = ("ours", "hf", "hf_padded", "hf_cb")
DESCRIPTIONS = {
    "ours": "lookahead-serve `LLM.generate`, all c prompts in one call",
    "hf": "HF `generate`, one request at a time",
    "hf_padded": "HF `generate`, one left-padded batch of c prompts",
    "hf_cb": "HF continuous batching, `generate_batch`",
}
WARMUP_TOKENS = 8
CB_PAGE_SIZE = 256  # transformers' default page size, in tokens

TokenIds = list[int]
GenerateFn = Callable[[Sequence["Prompt"], int], list[TokenIds]]

_START = time.perf_counter()


class _DropMessage(logging.Filter):
    """Drops one log message by substring (HF warns about eos_token_id=-1 on every generate call)."""

    def __init__(self, substring: str) -> None:
        super().__init__()
        self.substring = substring

    def filter(self, record: logging.LogRecord) -> bool:
        return self.substring not in record.getMessage()


def log(message: str) -> None:
    """Progress line on stderr, stamped with seconds since the script started."""
    print(f"[{time.perf_counter() - _START:7.1f}s] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Prompt:
    text: str
    ids: TokenIds


@dataclass
class Measurement:
    system: str
    concurrency: int
    num_prompts: int
    seconds: float = 0.0
    outputs: list[TokenIds] = field(default_factory=list)
    error: str | None = None
    note: str = ""

    @property
    def tokens(self) -> int:
        return sum(map(len, self.outputs))

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.error is None and self.seconds > 0 else None


# ---- workload ------------------------------------------------------------------------------------


def load_first_turns(path: Path, count: int) -> list[str]:
    with path.open(encoding="utf-8") as f:
        questions = [json.loads(line)["turns"][0] for line in f if line.strip()]
    if len(questions) < count:
        raise SystemExit(f"{path} has {len(questions)} questions, the run needs {count}")
    return questions[:count]


def build_prompts(engine: LLMEngine, questions: Sequence[str]) -> list[Prompt]:
    """Render each question as a one-turn chat and tokenize it with the engine's own tokenizer call."""
    texts = [engine.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    return [Prompt(text, engine.tokenize(text)[1]) for text in texts]


# ---- the systems ---------------------------------------------------------------------------------


class Systems:
    """One generate function per system: (prompts, max_tokens) -> generated token ids per prompt."""

    def __init__(
        self,
        llm: LLM | None,
        hf_model: PreTrainedModel | None,
        pad_id: int,
        max_batched_tokens: int,
        lookahead: LookaheadParams | None = None,
    ):
        self.llm = llm
        self.lookahead = lookahead
        self.hf_model = hf_model
        self.pad_id = pad_id
        self.max_batched_tokens = max_batched_tokens
        self.ours_tokens_per_step: list[float] = []  # per request, appended by every `ours` call

    def get(self, name: str) -> GenerateFn:
        return {"ours": self.ours, "hf": self.hf, "hf_padded": self.hf_padded, "hf_cb": self.hf_cb}[name]

    def ours(self, prompts: Sequence[Prompt], max_tokens: int) -> list[TokenIds]:
        assert self.llm is not None
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, lookahead=self.lookahead)
        outputs = self.llm.generate([p.text for p in prompts], params)
        self.ours_tokens_per_step.extend(o.tokens_per_step for o in outputs)
        return [list(o.outputs[0].token_ids) for o in outputs]

    def _hf_config(self, max_tokens: int) -> GenerationConfig:
        # eos_token_id=-1 never matches, so no row stops early and EOS is not suppressed either: the same
        # semantics as our ignore_eos (min_new_tokens only masks ids in [0, vocab), so it is a no-op here).
        return GenerationConfig(
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=-1,
            pad_token_id=self.pad_id,
        )

    def hf_padded(self, prompts: Sequence[Prompt], max_tokens: int) -> list[TokenIds]:
        assert self.hf_model is not None
        input_ids, attention_mask = left_pad([p.ids for p in prompts], self.pad_id)
        out = self.hf_model.generate(
            input_ids, attention_mask=attention_mask, generation_config=self._hf_config(max_tokens)
        )
        return out[:, input_ids.shape[1] :].tolist()

    def hf(self, prompts: Sequence[Prompt], max_tokens: int) -> list[TokenIds]:
        return [self.hf_padded([p], max_tokens)[0] for p in prompts]

    def hf_cb(self, prompts: Sequence[Prompt], max_tokens: int) -> list[TokenIds]:
        assert self.hf_model is not None
        inputs = [p.ids for p in prompts]
        results = self.hf_model.generate_batch(
            inputs=inputs,
            generation_config=self._hf_config(max_tokens),
            continuous_batching_config=self._cb_config(inputs, max_tokens),
        )
        # generate_batch logs errors instead of raising: turn missing or failed requests into an exception
        failed = [f"{rid}: {r.error}" for rid, r in results.items() if r.error is not None]
        if failed or len(results) != len(inputs):
            raise RuntimeError(f"generate_batch returned {len(results)}/{len(inputs)} results; errors: {failed}")
        return [list(r.generated_tokens) for r in results.values()]

    def _cb_config(self, inputs: Sequence[TokenIds], max_tokens: int) -> ContinuousBatchingConfig:
        # Without num_blocks the cache is sized from free memory, which on CPU means 60% of the RAM
        # (seconds to allocate on every call); size it to hold every request at once instead, and give it the
        # same per-step token budget as our scheduler.
        pages_per_request = math.ceil((max(map(len, inputs)) + max_tokens) / CB_PAGE_SIZE)
        return ContinuousBatchingConfig(
            page_size=CB_PAGE_SIZE,
            num_blocks=len(inputs) * pages_per_request + 1,
            max_batch_tokens=self.max_batched_tokens,
            auto_switch_to_flash=False,  # no flash attention on CPU: keep sdpa
        )


def left_pad(sequences: Sequence[TokenIds], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask for a left-padded batch (what tokenizer.padding_side="left" gives)."""
    width = max(map(len, sequences))
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        input_ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
        attention_mask[row, width - len(seq) :] = 1
    return input_ids, attention_mask


# ---- measuring -----------------------------------------------------------------------------------


def batches_for(
    system: str, concurrency: int, prompts: Sequence[Prompt], args: argparse.Namespace
) -> list[list[Prompt]]:
    """What one measurement runs: at c=1 (and for sequential HF) prompts one at a time, else one batch of c."""
    if concurrency == 1:
        return [[p] for p in prompts[: args.num_single]]
    if system == "hf":
        return [[p] for p in prompts[: args.num_sequential]]
    return [list(prompts[:concurrency])]


def timed_run(fn: GenerateFn, batches: Sequence[Sequence[Prompt]], max_tokens: int) -> tuple[float, list[TokenIds]]:
    outputs: list[TokenIds] = []
    start = time.perf_counter()
    for batch in batches:
        outputs.extend(fn(batch, max_tokens))
    return time.perf_counter() - start, outputs


def measure(system: str, fn: GenerateFn, concurrency: int, batches: list[list[Prompt]], max_tokens: int) -> Measurement:
    m = Measurement(system, concurrency, sum(map(len, batches)))
    log(f"{system} c={concurrency}: {m.num_prompts} prompts in {len(batches)} call(s) ...")
    try:
        m.seconds, m.outputs = timed_run(fn, batches, max_tokens)
    except Exception as e:  # a system that cannot run is reported, not faked
        m.error = describe(e)
        log(f"{system} c={concurrency}: FAILED {m.error}")
        return m
    short = [len(o) for o in m.outputs if len(o) != max_tokens]
    if short:
        m.note = f"rows with != {max_tokens} tokens: {short}"
    log(f"{system} c={concurrency}: {m.tokens} tokens in {m.seconds:.2f} s = {m.tokens_per_s:.1f} tok/s")
    return m


def warm_up(name: str, fn: GenerateFn, prompts: Sequence[Prompt]) -> str | None:
    """One short untimed call (two prompts, a few tokens); returns the error text if it fails."""
    log(f"warm-up {name} ...")
    try:
        fn(prompts[:2], WARMUP_TOKENS)
    except Exception as e:
        log(f"warm-up {name}: FAILED {describe(e)}")
        return describe(e)
    return None


def describe(error: Exception) -> str:
    """The exception and where it was raised, on one line (it goes into a table cell)."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    text = f"{type(error).__name__}: {error}{where}"
    return " ".join(text.replace("|", "\\|").split())


def run_all(
    systems: Systems, names: Sequence[str], prompts: Sequence[Prompt], args: argparse.Namespace
) -> list[Measurement]:
    """Every (system, concurrency), concurrency-major; identical workloads are measured once and reused."""
    warmup_errors = {name: warm_up(name, systems.get(name), prompts) for name in names}
    cache: dict[tuple[str, tuple[int, ...]], Measurement] = {}
    results = []
    for c in args.concurrency:
        for name in names:
            batches = batches_for(name, c, prompts, args)
            key = (name, tuple(map(len, batches)))
            if warmup_errors[name] is not None:
                m = Measurement(name, c, sum(map(len, batches)), error=warmup_errors[name])
            elif key in cache:
                m = Measurement(name, c, cache[key].num_prompts, cache[key].seconds, cache[key].outputs)
                m.note = f"same workload as c={cache[key].concurrency}, reused"
            else:
                systems.ours_tokens_per_step.clear()
                m = cache[key] = measure(name, systems.get(name), c, batches, args.max_tokens)
                if name == "ours" and systems.ours_tokens_per_step:
                    tps = systems.ours_tokens_per_step
                    m.note = f"mean tokens/step {sum(tps) / len(tps):.2f}" + (f"; {m.note}" if m.note else "")
            if name == "hf" and c > 1:
                m.note = f"one at a time on {m.num_prompts} prompt(s); its tok/s holds for any c" + (
                    f" ({m.note})" if m.note else ""
                )
            results.append(m)
    return results


# ---- reporting -----------------------------------------------------------------------------------


def same_ids(ours: Measurement | None, other: Measurement) -> str:
    """How many prompts (the first ones, which both ran) got identical token ids from both systems."""
    if ours is None or ours is other or ours.error or other.error:
        return "—"
    pairs = list(zip(ours.outputs, other.outputs))
    equal = sum(a == b for a, b in pairs)
    text = f"{equal}/{len(pairs)}"
    if equal < len(pairs):
        text += f" (first diff at token {min(common_prefix(a, b) for a, b in pairs if a != b)})"
    return text


def common_prefix(a: TokenIds, b: TokenIds) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def ratio(ours: Measurement | None, other: Measurement) -> str:
    if ours is None or ours.tokens_per_s is None or other.tokens_per_s is None:
        return "—"
    return f"{ours.tokens_per_s / other.tokens_per_s:.2f}x"


def markdown_table(results: Sequence[Measurement]) -> str:
    header = "| c | system | prompts | wall s | gen tokens | tok/s | ours ÷ system | same ids as ours | note |"
    lines = [header, "|---:|---|---:|---:|---:|---:|---:|---|---|"]
    ours_by_c = {m.concurrency: m for m in results if m.system == "ours"}
    for m in results:
        ours = ours_by_c.get(m.concurrency)
        if m.error:
            cells = ["—"] * 5 + [f"ERROR: {m.error}"]
        else:
            rate = f"{m.tokens_per_s:.1f}"
            cells = [f"{m.seconds:.2f}", str(m.tokens), rate, ratio(ours, m), same_ids(ours, m), m.note]
        lines.append("| " + " | ".join([str(m.concurrency), m.system, str(m.num_prompts), *cells]) + " |")
    return "\n".join(lines)


def legend(args: argparse.Namespace, names: Sequence[str]) -> str:
    systems = "\n".join(f"- `{n}`: {DESCRIPTIONS[n]}" for n in names)
    la = args.lookahead
    lookahead = "engine default" if la is None else ("off" if la.is_plain else f"({la.window_size},{la.ngram_size},{la.verification_set_size})")
    systems += f"\n\nOur lookahead: {lookahead}."
    sequential = (
        f"`hf` at c>1 is measured one request at a time on {args.num_sequential} prompt(s): sequential "
        "tokens/s is the same whatever c, so that rate is reported in every c>1 row. "
        if "hf" in names
        else ""
    )
    return (
        f"{systems}\n\n"
        f"{args.max_tokens} new tokens per prompt, greedy, fp32, EOS ignored by every system. "
        f"c=1 runs {args.num_single} prompt(s) one after another for every system. {sequential}"
        "\"ours ÷ system\" is our tok/s over the system's at the same c; "
        "\"same ids as ours\" compares token ids on the prompts both ran."
    )


def machine_info() -> str:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"- machine: `{platform.platform()}`, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, torch threads {torch.get_num_threads()}, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, load average now {load}"
    )


def append_results(path: Path, table: str, legend_text: str) -> None:
    stamp = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    section = (
        f"\n## Throughput, {stamp}\n\n{machine_info()}\n- command: `{shlex.join(sys.orig_argv)}`\n\n"
        f"{table}\n\n{legend_text}\n"
    )
    with path.open("a", encoding="utf-8") as f:
        f.write(section)
    log(f"appended results to {path}")


# ---- main ----------------------------------------------------------------------------------------


def int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def system_list(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = sorted(set(names) - set(SYSTEMS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown systems {unknown}; choose from {','.join(SYSTEMS)}")
    return [n for n in SYSTEMS if n in names]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS, help="MT-bench JSONL (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt (default: %(default)s)")
    p.add_argument("--concurrency", type=int_list, default=[1, 8, 32], help="comma-separated levels (default: 1,8,32)")
    p.add_argument("--num-single", type=int, default=4, help="prompts run one at a time at c=1 (default: %(default)s)")
    p.add_argument(
        "--num-sequential", type=int, default=4, help="prompts for sequential HF at c>1 (default: %(default)s)"
    )
    p.add_argument("--systems", type=system_list, default=list(SYSTEMS), help=f"default: {','.join(SYSTEMS)}")
    p.add_argument(
        "--max-batched-tokens",
        type=int,
        default=512,
        help="per-step token budget, for our scheduler and HF continuous batching alike (default: %(default)s)",
    )
    p.add_argument(
        "--lookahead",
        type=lookahead_arg,
        default=LookaheadParams(enabled=False),
        help="our lookahead: off, default (the engine's) or W,N,G (default: off)",
    )
    p.add_argument("--results", type=Path, help="append a dated Markdown section to this file")
    return p.parse_args(argv)


def lookahead_arg(text: str) -> LookaheadParams | None:
    if text == "off":
        return LookaheadParams(enabled=False)
    if text == "default":
        return None
    try:
        w, n, g = (int(v) for v in text.split(","))
        return LookaheadParams(w, n, g)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--lookahead takes off, default or W,N,G: {e}") from e


def load_hf_model(path: Path) -> PreTrainedModel:
    log(f"loading HF model from {path} ...")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.getLogger("transformers.generation.utils").addFilter(_DropMessage("should consist of positive integers"))
    names = args.systems
    log("loading our engine ...")
    llm = LLM(max_num_batched_tokens=args.max_batched_tokens)
    tokenizer = llm.tokenizer
    hf_model = load_hf_model(llm.engine.model_path) if set(names) - {"ours"} else None
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    systems = Systems(llm if "ours" in names else None, hf_model, pad_id, args.max_batched_tokens, args.lookahead)

    count = max([*args.concurrency, args.num_single, args.num_sequential, 2])
    prompts = build_prompts(llm.engine, load_first_turns(args.questions, count))
    log(f"{len(prompts)} prompts, {min(len(p.ids) for p in prompts)}-{max(len(p.ids) for p in prompts)} tokens")

    results = run_all(systems, names, prompts, args)
    table, legend_text = markdown_table(results), legend(args, names)
    print(f"{machine_info()}\n\n{table}\n\n{legend_text}")
    if args.results:
        append_results(args.results, table, legend_text)


if __name__ == "__main__":
    main()
