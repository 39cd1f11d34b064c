"""Engine start-up: fresh processes that import the engine, load the default model and generate one token
(caches warm: the kernels built, the model converted, the step-cost profile measured). Several Python
interpreters (e.g. the venvs of two checkouts) are run interleaved, round by round, so their figures
share the machine's drift.

    .venv/bin/python benchmarks/startup.py --rounds 7 --python ../base/.venv/bin/python .venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

STARTUP = textwrap.dedent("""
    import json, resource, sys, time
    t0 = time.perf_counter()
    from lookahead_serve import LLM, SamplingParams
    llm = LLM()
    loaded = time.perf_counter() - t0
    llm.generate("Hello", SamplingParams(max_tokens=1, temperature=0))
    print(json.dumps({"load_s": loaded, "first_token_s": time.perf_counter() - t0,
                      "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "quantization": llm.engine.quantization, "dtype": llm.engine.model_info().dtype,
                      "transformers": "transformers" in sys.modules}))
""")


def start_once(python: str) -> dict:
    out = subprocess.run([python, "-c", STARTUP], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", nargs="+", default=[sys.executable], help="interpreters to compare (default: this one)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--results", type=Path, default=None, help="append the table to this Markdown file")
    args = ap.parse_args(argv)
    for python in args.python:  # a first start may still build, convert or profile: not counted
        start_once(python)
    runs: dict[str, list[dict]] = {p: [] for p in args.python}
    for r in range(args.rounds):
        for python in args.python:
            runs[python].append(start_once(python))
            print(f"round {r + 1} {python}: {runs[python][-1]}", file=sys.stderr, flush=True)
    lines = ["| interpreter | load s | first token s | peak RSS MB | transformers imported |", "|---|---|---|---|---|"]
    for python, rs in runs.items():
        lines.append(f"| `{python}` | {_spread([x['load_s'] for x in rs])} | {_spread([x['first_token_s'] for x in rs])} "
                     f"| {statistics.median(x['rss_mb'] for x in rs):.0f} | {rs[0]['transformers']} |")
    table = "\n".join(lines)
    print(table)
    if args.results is not None:
        with args.results.open("a") as f:
            f.write(f"\n## Start-up ({args.rounds} rounds, interleaved; median (min-max))\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
