"""Online serving through the gRPC server: N concurrent streaming clients, lookahead on vs off.

What it measures: the standalone server (``lookahead-serve serve``, the embedded default model unless
``--model``) in its own process, driven by ``--users`` concurrent clients (1, 8 and 32 by default) that
each stream ``Generate`` calls back to back over one grpc.aio channel. Every user count runs twice:
lookahead on (the request leaves ``lookahead`` unset, so the server's default, (5, 3, 5), applies) and
off (``lookahead.enabled = false`` in each request). A run lasts ``--duration`` seconds (no call starts
after it; calls in flight finish and count) or ``--num-requests`` calls in all. ``--rounds R`` repeats all
runs R times, alternating which of on and off goes first, and adds the on/off ratios of each round's pair
(median and range): the comparison to read, since the two runs of a pair are adjacent in time.

Requests are the first turns of MT-bench questions (``--questions``), sent as one-message chats (the
server applies the chat template), greedy, at most ``--max-tokens`` tokens (EOS ends a request unless
``--ignore-eos``). All runs draw the questions in the same order. Before measuring, every question is
sent once with max_tokens=1, so every run sees the same prefix cache: each prompt's full KV blocks
cached (the server's prefix caching cannot be turned off from its command line).

Reported per run: calls completed and failed, wall seconds (first call sent to last call finished),
requests/s, output tokens/s, time to first token (TTFT: call sent -> first token received) p50/p99,
time per output token (TPOT: (last token time - first token time) / (completion tokens - 1), per call,
calls with one token left out) p50/p99, and tokens per decoding step (sum of completion tokens / sum of
decoding steps, from the server's usage). Clients and server share the machine's cores.

    .venv/bin/python benchmarks/serving.py --results benchmarks/results/DATE-NAME.md      # or: make bench-serving

A quick smoke run::

    .venv/bin/python benchmarks/serving.py --users 1,2 --duration 5 --max-tokens 16

Run it on an otherwise idle machine (see benchmarks/throughput.py on why a busy CPU makes the numbers
meaningless).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lookahead_serve.proto.convert import to_lookahead_proto
from lookahead_serve.proto.lookahead.v1 import lookahead_pb2 as pb
from lookahead_serve.proto.lookahead.v1 import lookahead_pb2_grpc as pb_grpc

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_QUESTIONS = REPO_ROOT.parent / "shared" / "data" / "mt_bench_questions.jsonl"
SERVICE = "lookahead.v1.LookaheadService"
PROGRESS_EVERY_S = 10.0

_START = time.perf_counter()


def log(message: str) -> None:
    """Progress line on stderr, stamped with seconds since the script started."""
    print(f"[{time.perf_counter() - _START:7.1f}s] {message}", file=sys.stderr, flush=True)


@dataclass(slots=True)
class Call:
    """One finished (or failed) Generate call."""

    ttft: float | None = None  # seconds
    tpot: float | None = None  # seconds per token after the first
    completion_tokens: int = 0
    decoding_steps: int = 0
    error: str | None = None


@dataclass
class Run:
    users: int
    lookahead: bool
    calls: list[Call] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> list[Call]:
        return [c for c in self.calls if c.error is None]

    def row(self) -> list[str]:
        ok = self.ok
        tokens = sum(c.completion_tokens for c in ok)
        steps = sum(c.decoding_steps for c in ok)
        ttft = [c.ttft for c in ok if c.ttft is not None]
        tpot = [c.tpot for c in ok if c.tpot is not None]
        rate = (lambda x: f"{x / self.seconds:.2f}") if self.seconds > 0 else (lambda x: "—")
        return [str(self.users), "on" if self.lookahead else "off", str(len(ok)), str(len(self.calls) - len(ok)),
                f"{self.seconds:.1f}", rate(len(ok)), rate(tokens), *ms(ttft), *ms(tpot),
                f"{tokens / steps:.3f}" if steps else "—"]


def ms(values: list[float]) -> list[str]:
    """p50 and p99 in milliseconds (linear interpolation between ranks)."""
    if not values:
        return ["—", "—"]
    p50, p99 = np.percentile(np.array(values) * 1000, [50, 99])
    return [f"{p50:.0f}", f"{p99:.0f}"]


# ---- the server ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "lookahead_serve.deploy.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--http-port", "0", "--max-live-requests", str(max(args.users) + 8)]
    if args.model:
        command += ["--model", args.model]
    log(f"starting the server: {shlex.join(command)}")
    return subprocess.Popen(command, cwd=REPO_ROOT, stdout=sys.stderr)


async def wait_healthy(channel: grpc.aio.Channel, server: subprocess.Popen, timeout_s: float) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout_s
    while True:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with code {server.returncode}")
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=2)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.aio.AioRpcError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"the server was not healthy after {timeout_s:.0f} s")
        await asyncio.sleep(0.5)


# ---- the clients ---------------------------------------------------------------------------------


def make_request(question: str, max_tokens: int, lookahead: bool, ignore_eos: bool) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos)
    request = pb.GenerateRequest(sampling=sampling)
    request.chat.messages.add(role="user", content=question)
    if not lookahead:
        request.lookahead.CopyFrom(to_lookahead_proto(None))
    return request


async def timed_call(stub: pb_grpc.LookaheadServiceStub, request: pb.GenerateRequest, timeout_s: float) -> Call:
    call = Call()
    start = time.perf_counter()
    first = last = None
    try:
        async for chunk in stub.Generate(request, timeout=timeout_s):
            if chunk.token_ids:
                last = time.perf_counter()
                first = first or last
            if chunk.finish_reason:
                call.completion_tokens = chunk.usage.completion_tokens
                call.decoding_steps = chunk.usage.decoding_steps
    except grpc.aio.AioRpcError as e:
        call.error = f"{e.code().name}: {e.details()}"
        return call
    if first is not None:
        call.ttft = first - start
        if call.completion_tokens > 1:
            call.tpot = (last - first) / (call.completion_tokens - 1)
    return call


async def measure(stub, questions: list[str], users: int, lookahead: bool, args: argparse.Namespace) -> Run:
    run = Run(users, lookahead)
    issued = 0
    start = time.perf_counter()
    stop_at = start + args.duration if args.num_requests is None else float("inf")

    def next_question() -> str | None:
        nonlocal issued
        if (args.num_requests is not None and issued >= args.num_requests) or time.perf_counter() >= stop_at:
            return None
        issued += 1
        return questions[(issued - 1) % len(questions)]

    async def user() -> None:
        while (question := next_question()) is not None:
            request = make_request(question, args.max_tokens, lookahead, args.ignore_eos)
            run.calls.append(await timed_call(stub, request, args.request_timeout))

    async def progress() -> None:
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            log(f"  users={users} lookahead {'on' if lookahead else 'off'}: {len(run.calls)} done, "
                f"{issued - len(run.calls)} in flight, {time.perf_counter() - start:.0f} s")

    reporter = asyncio.create_task(progress())
    try:
        await asyncio.gather(*(user() for _ in range(users)))
    finally:
        reporter.cancel()
    run.seconds = time.perf_counter() - start
    return run


async def run_all(args: argparse.Namespace, questions: list[str], target: str, server: subprocess.Popen) -> list[Run]:
    async with grpc.aio.insecure_channel(target) as channel:
        await wait_healthy(channel, server, args.startup_timeout)
        log("server healthy")
        stub = pb_grpc.LookaheadServiceStub(channel)
        log(f"warm-up: each of {len(questions)} questions once, max_tokens=1 (fills the prefix cache) ...")
        slots = asyncio.Semaphore(8)  # under the server's cap on live requests

        async def warm_one(q: str):
            async with slots:
                return await timed_call(stub, make_request(q, 1, True, False), args.request_timeout)

        warm = await asyncio.gather(*(warm_one(q) for q in questions))
        if any(c.error for c in warm):
            raise SystemExit(f"warm-up failed: {next(c.error for c in warm if c.error)}")
        runs = []
        for rnd in range(args.rounds):
            for users in args.users:
                for lookahead in ((True, False) if rnd % 2 == 0 else (False, True)):  # alternate who goes first
                    log(f"round {rnd} users={users} lookahead {'on' if lookahead else 'off'} ...")
                    run = await measure(stub, questions, users, lookahead, args)
                    log(f"users={users} lookahead {'on' if lookahead else 'off'}: " + " | ".join(run.row()[2:]))
                    runs.append(run)
        return runs


# ---- reporting -----------------------------------------------------------------------------------

HEADER = ("| users | lookahead | calls | failed | wall s | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms "
          "| TPOT p50 ms | TPOT p99 ms | tokens/step |")


def markdown_table(runs: list[Run]) -> str:
    lines = [HEADER, "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += ["| " + " | ".join(run.row()) + " |" for run in runs]
    errors = sorted({c.error for run in runs for c in run.calls if c.error})
    return "\n".join(lines + ([""] + [f"Errors: {e}" for e in errors] if errors else []))


def ratio_table(runs: list[Run]) -> str:
    """Per user count: requests/s and output tokens/s of on over off, each round's pair (median, min-max)."""

    def spread(on: list[Run], off: list[Run], count) -> str:
        ratios = [count(a) / a.seconds / (count(b) / b.seconds) for a, b in zip(on, off, strict=True)]
        return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"

    lines = ["| users | rounds | req/s on / off | output tok/s on / off | failed calls |", "|---:|---:|---|---|---:|"]
    for users in dict.fromkeys(r.users for r in runs):
        on = [r for r in runs if r.users == users and r.lookahead]
        off = [r for r in runs if r.users == users and not r.lookahead]
        req = spread(on, off, lambda r: len(r.ok))
        tok = spread(on, off, lambda r: sum(c.completion_tokens for c in r.ok))
        failed = sum(len(r.calls) - len(r.ok) for r in on + off)
        lines.append(f"| {users} | {len(on)} | {req} | {tok} | {failed} |")
    return "\n".join(lines)


def legend(args: argparse.Namespace) -> str:
    workload = (f"{args.num_requests} calls per run" if args.num_requests is not None
                else f"{args.duration:.0f} s per run (calls in flight at the end finish and count)")
    model = args.model or "the embedded default model (SmolLM2-135M-Instruct)"
    return (f"Server: `lookahead-serve serve` on {model}, its own process; lookahead on = the server's "
            f"default, off = per request. MT-bench first turns as chats, greedy, at most {args.max_tokens} tokens"
            f"{' (EOS ignored)' if args.ignore_eos else ' (EOS ends a call)'}, {workload}; every question sent "
            "once with max_tokens=1 beforehand, so every run sees the same prefix cache. TTFT: call sent -> "
            "first token; TPOT: (last token - first token) / (completion tokens - 1) per call; tokens/step: "
            "completion tokens / decoding steps over all calls. Clients run on the same machine.")


def machine_info() -> str:
    import torch  # only to report the version and default thread count the server also gets

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"- machine: `{platform.platform()}`, {os.cpu_count()} CPUs, torch {torch.__version__}, "
            f"torch threads {torch.get_num_threads()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
            f"load average now {load}")


def append_results(path: Path, table: str, legend_text: str) -> None:
    stamp = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    section = (f"\n## Serving, {stamp}\n\n{machine_info()}\n- command: `{shlex.join(sys.orig_argv)}`\n\n"
               f"{table}\n\n{legend_text}\n")
    with path.open("a", encoding="utf-8") as f:
        f.write(section)
    log(f"appended results to {path}")


# ---- main ----------------------------------------------------------------------------------------


def int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def load_first_turns(path: Path) -> list[str]:
    with path.open(encoding="utf-8") as f:
        questions = [json.loads(line)["turns"][0] for line in f if line.strip()]
    if not questions:
        raise SystemExit(f"{path} has no questions")
    return questions


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS, help="MT-bench JSONL (default: %(default)s)")
    p.add_argument("--users", type=int_list, default=[1, 8, 32], help="concurrent clients per run (default: 1,8,32)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds per run (default: %(default)s)")
    p.add_argument("--num-requests", type=int, default=None, help="calls per run instead of --duration")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens per call (default: %(default)s)")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens tokens per call")
    p.add_argument("--model", default=None, help="model for the server (default: the embedded one)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="deadline per call, s (default: %(default)s)")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="wait for the server, s (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat every (users, on/off) run, alternating which of on and off goes first; with 2 or "
                        "more, also a table of on/off ratios per round (default: %(default)s)")
    p.add_argument("--results", type=Path, help="append a dated Markdown section to this file")
    args = p.parse_args(argv)
    if args.num_requests is not None and args.num_requests < 1:
        p.error("--num-requests must be positive")
    if args.duration <= 0 or args.max_tokens < 1 or args.rounds < 1:
        p.error("--duration, --max-tokens and --rounds must be positive")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    questions = load_first_turns(args.questions)
    port = free_port()
    server = start_server(args, port)
    try:
        runs = asyncio.run(run_all(args, questions, f"127.0.0.1:{port}", server))
    finally:
        server.send_signal(signal.SIGINT)  # what Ctrl-C sends: the server stops gracefully
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    table, legend_text = markdown_table(runs), legend(args)
    if args.rounds > 1:
        table += "\n\nOn over off, per round (runs of one round are adjacent in time):\n\n" + ratio_table(runs)
    print(f"{machine_info()}\n\n{table}\n\n{legend_text}")
    if args.results:
        append_results(args.results, table, legend_text)


if __name__ == "__main__":
    main()
