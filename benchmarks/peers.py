"""This engine against the tools a CPU user already has, on the same GGUF file, in one interleaved run.

Modes, prompt by prompt in turn so all see the same machine drift (greedy, ``--max-tokens`` new tokens):

* ``defaults``: ``LLM()`` with no arguments (block-quantized weights where the kernel runs, adaptive lookahead);
* ``lookahead off``: the same engine, requests with lookahead off;
* ``llama.cpp``: llama-cpp-python on the same GGUF file, batch 1, in a worker process of the venv given by
  ``--llama-venv`` (none: the row is left out). To build one (a C++ build of some minutes):
  ``python3 -m venv ../llama-venv && CMAKE_ARGS=-DGGML_NATIVE=ON ../llama-venv/bin/pip install llama-cpp-python==0.3.36``
* ``HF generate bf16`` (and ``--hf-dtypes``): Hugging Face ``generate`` on the dequantized weights;
* ``dequantized``: ``LLM(quantization="none")``, the engine's defaults on the dequantized weights (float32
  on a CPU without native bf16), to choose the default quantization by measurement.

c=1 on MT-bench first turns (chat template) and HumanEval prompts; then the engine with ``--concurrency``
prompts in one ``generate`` call against llama.cpp's c=1 rate on the set's c=1 prompts, measured in the same
round (the ratio's median and range over rounds). Also the start-up (a fresh process: load and
first token, caches warm) and peak RSS of the engine and of llama.cpp, and the engine's per-step time of a
1-token step and of lookahead segments of 2-16 tokens against the weight-streaming floor (alone:
``--steps-only``).

    .venv/bin/python benchmarks/peers.py --llama-venv ../llama-venv --results benchmarks/results/DATE-peers.md
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import textwrap
import time
import timeit
from pathlib import Path

import torch

from lookahead_serve.engine import LLM, SamplingParams
from lookahead_serve.engine.loader import default_model_file
from lookahead_serve.engine.step_profile import _decodes, _segments, _time_all
from defaults import HF
from lookahead import DATA, OFF, _emit, _header, load_prompts, log
from startup import start_once

LLAMA_WORKER = textwrap.dedent("""
    import json, resource, sys, time
    t0 = time.perf_counter()
    from llama_cpp import Llama
    llm = Llama(model_path=sys.argv[1], n_ctx=4096, n_threads=int(sys.argv[2]), n_batch=512, verbose=False)
    first = llm.create_completion(prompt=[1, 2, 3], max_tokens=1, temperature=0.0)
    print(json.dumps({"startup_s": time.perf_counter() - t0}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        start = time.perf_counter()
        out = llm.create_completion(prompt=req["prompt_token_ids"], max_tokens=req["max_tokens"], temperature=0.0,
                                    top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
        secs = time.perf_counter() - start
        print(json.dumps({"tokens": out["usage"]["completion_tokens"], "seconds": secs,
                          "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}), flush=True)
""")

class LlamaCpp:
    """llama-cpp-python in a worker process of another venv: token ids in, (tokens, seconds) out."""

    def __init__(self, python: Path, gguf: Path, threads: int) -> None:
        self.proc = subprocess.Popen([str(python), "-c", LLAMA_WORKER, str(gguf), str(threads)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.startup_s = json.loads(self.proc.stdout.readline())["startup_s"]
        self.rss_mb = 0.0

    def run(self, ids: list[int], max_tokens: int) -> tuple[int, float]:
        self.proc.stdin.write(json.dumps({"prompt_token_ids": ids, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        out = json.loads(self.proc.stdout.readline())
        self.rss_mb = out["rss_mb"]
        return out["tokens"], out["seconds"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _engine_run(llm: LLM, prompts: list[str], la, max_tokens: int) -> tuple[int, float]:
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, lookahead=la))
    return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - start


def _rows(name: str, tokens: dict, seconds: dict, base: str | None) -> list[str]:
    rows = []
    for mode in tokens:
        rates = [t / s for t, s in zip(tokens[mode], seconds[mode], strict=True)]
        ratio = ""
        if base in tokens and mode != base:
            r = [a / (bt / bs) for a, bt, bs in zip(rates, tokens[base], seconds[base], strict=True)]
            ratio = f"{statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})"
        spread = f"{min(rates):.1f}-{max(rates):.1f}" if len(rates) > 1 else ""
        rows.append(f"| {name} | {mode} | {statistics.median(rates):.1f} | {spread} | {ratio} |")
    return rows


STEP_CURVE = (2, 3, 4, 5, 8, 16)  # tokens of one lookahead segment


def step_times(llm: LLM) -> str:
    """Median seconds of a 1-token decode and of one lookahead segment of each size in STEP_CURVE (the cost
    curve the adaptive policy weighs), and the weight-streaming floor."""
    runner = llm.engine.runner
    blocks = list(range(runner.kv_caches[0].shape[1] // runner.block_size))[:32]
    one, *curve = _time_all(runner, [_decodes(1, blocks)] + [_segments(1, t, blocks) for t in STEP_CURVE],
                            repeats=15)
    packed = sum(b.numel() * b.element_size() for b in llm.engine.model.buffers())
    dense = sum(p.numel() * p.element_size() for n, p in llm.engine.model.named_parameters() if "embed" not in n)
    mb = (packed + dense) / 1e6
    gbs = read_rate()
    segments = ", ".join(f"{t}: {s * 1e3:.1f} ms ({s / one:.2f}x)" for t, s in zip(STEP_CURVE, curve, strict=True))
    return (f"Engine step ({llm.engine.quantization}, {llm.engine.model_info().dtype}): 1 token {one * 1e3:.1f} ms; "
            f"one segment of T tokens, T = {segments}; weights streamed per step {mb:.0f} MB (floor at this "
            f"machine's {torch.get_num_threads()}-thread read rate, {gbs:.0f} GB/s: {mb / gbs:.1f} ms)")


def read_rate() -> float:
    """GB/s that torch's threads read from memory (the best of 5 sums of a 1 GiB float32 tensor)."""
    x = torch.ones(1 << 28)
    x.sum()
    return x.numel() * 4 / min(timeit.repeat(x.sum, number=1, repeat=5)) / 1e9


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=DATA, help="folder with mt_bench_questions.jsonl and humaneval.jsonl.gz")
    ap.add_argument("--llama-venv", type=Path, default=None, help="venv with llama-cpp-python (none: no llama.cpp rows)")
    ap.add_argument("--num-prompts", type=int, default=6, help="prompts per set at c=1")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--concurrency", type=int, nargs="*", default=[8, 32])
    ap.add_argument("--hf-dtypes", nargs="*", default=["bfloat16"])
    ap.add_argument("--no-dequantized", action="store_true", help="leave out the dequantized engine")
    ap.add_argument("--results", type=Path, default=None, help="append the tables to this Markdown file")
    ap.add_argument("--steps-only", action="store_true", help="only the engine's step times (no peers, no prompts)")
    args = ap.parse_args(argv)
    if args.steps_only:
        _emit(f"{_header()}\n\n- {step_times(LLM())}", "Engine step times", args.results)
        return

    for _ in range(2):  # the first start may build the kernel, pack the weights and profile step costs
        startup = start_once(sys.executable)
    log(f"engine start-up: {startup}")
    llm = LLM()
    dequantized = None if args.no_dequantized else LLM(quantization="none")
    sets = load_prompts(llm, args.data / "mt_bench_questions.jsonl", args.data / "humaneval.jsonl.gz",
                        max(args.num_prompts, max(args.concurrency, default=0)))
    llama = None
    if args.llama_venv is not None:
        llama = LlamaCpp(args.llama_venv / "bin" / "python", default_model_file(), torch.get_num_threads())
    hf = {f"HF generate {d}": HF(llm, getattr(torch, d)) for d in args.hf_dtypes}
    ids = {s: [llm.tokenizer(p).input_ids for p in ps] for s, ps in sets.items()}
    lines = ["| set | mode | tokens/s (median) | range over rounds | vs lookahead off |", "|---|---|---|---|---|"]
    for set_name, prompts in sets.items():
        tokens: dict[str, list[int]] = {}
        seconds: dict[str, list[float]] = {}
        for r in range(args.rounds):
            acc: dict[str, list[float]] = {}
            for i, prompt in enumerate(prompts[: args.num_prompts]):
                runs = {"lookahead off": lambda: _engine_run(llm, [prompt], OFF, args.max_tokens),
                        "defaults": lambda: _engine_run(llm, [prompt], None, args.max_tokens)}
                if dequantized is not None:
                    runs["dequantized"] = lambda: _engine_run(dequantized, [prompt], None, args.max_tokens)
                if llama is not None:
                    runs["llama.cpp"] = lambda: llama.run(ids[set_name][i], args.max_tokens)
                for name, h in hf.items():
                    runs[name] = lambda h=h: h.run(prompt, args.max_tokens)
                for mode, fn in runs.items():
                    t, s = fn()
                    a = acc.setdefault(mode, [0, 0.0])
                    a[0] += t
                    a[1] += s
            for mode, (t, s) in acc.items():
                tokens.setdefault(mode, []).append(t)
                seconds.setdefault(mode, []).append(s)
            log(f"{set_name} round {r}: " + ", ".join(f"{m} {t / s:.1f} tok/s" for m, (t, s) in acc.items()))
        lines += _rows(f"{set_name}, c=1", tokens, seconds, "lookahead off")
    for c in args.concurrency:
        for set_name, prompts in sets.items():
            tokens, seconds = {}, {}
            vs_llama = []  # per round: the defaults' c rate over llama.cpp's c=1 rate measured beside it
            for r in range(args.rounds):
                modes = [("lookahead off", llm, OFF), ("defaults", llm, None)]
                if dequantized is not None:
                    modes.append(("dequantized", dequantized, None))
                for mode, engine, la in modes:
                    t, s = _engine_run(engine, prompts[:c], la, args.max_tokens)
                    tokens.setdefault(mode, []).append(t)
                    seconds.setdefault(mode, []).append(s)
                if llama is not None:
                    runs = [llama.run(i, args.max_tokens) for i in ids[set_name][: args.num_prompts]]
                    rate = sum(t for t, _ in runs) / sum(s for _, s in runs)
                    vs_llama.append(tokens["defaults"][-1] / seconds["defaults"][-1] / rate)
            rows = _rows(f"{set_name}, c={c}", tokens, seconds, "lookahead off")
            if vs_llama:
                rows[1] = rows[1][:-2] + (f" {statistics.median(vs_llama):.2f}x ({min(vs_llama):.2f}-{max(vs_llama):.2f}) "
                                          "llama.cpp c=1 |")
            lines += rows
            log(f"{set_name} c={c} done")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    notes = [f"Engine start-up (fresh process, caches warm): load {startup['load_s']:.1f} s, first token "
             f"{startup['first_token_s']:.1f} s, peak RSS {startup['rss_mb']:.0f} MB ({startup['quantization']}, "
             f"{startup['dtype']})."]
    if llama is not None:
        notes.append(f"llama.cpp start-up (load and first token): {llama.startup_s:.1f} s, peak RSS {llama.rss_mb:.0f} MB.")
        llama.close()
    notes.append(step_times(llm))
    notes.append(f"This benchmark process (engine and HF models together): peak RSS {rss:.0f} MB.")
    text = "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes)
    _emit(f"{_header()}\n\n{text}", "Peers: engine vs llama.cpp vs Hugging Face", args.results)


if __name__ == "__main__":
    main()
