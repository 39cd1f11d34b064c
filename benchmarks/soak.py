"""Soak test of the gRPC server: concurrent clients, a mixed workload, and checks for errors and leaks.

The script starts ``lookahead-serve serve`` (the embedded default model unless ``--model``) as a
subprocess on 127.0.0.1 with a Prometheus endpoint, and runs ``--clients`` concurrent clients (grpc.aio,
a channel and a connection each) that send streaming ``Generate`` calls back to back. Each call draws one kind:

- 60% good: greedy or seeded sampling (temperature 0.5-1.2, sometimes top-p / top-k), lookahead on
  ((4,3,4), (5,3,5), (0,3,4) verification only, or the server's default) or off, short or long prompts
  as text, chat or token ids, sometimes with stop strings or min_tokens. Expected: OK.
- 20% cancel: a long generation that the client cancels after 0-5 chunks. Expected: CANCELLED.
- 10% deadline: a long generation with a deadline of 0.05-2 s or of 1-3x the median time to first token
  so far (so that some expire before the first token, some mid-stream). Expected: DEADLINE_EXCEEDED.
- 10% bad input, the kinds of ``bad_inputs`` in turn (top_p=2, NaN temperature, ...). Expected: INVALID_ARGUMENT.

RESOURCE_EXHAUSTED is allowed for every kind; a cancel or deadline call that finished first may be OK.
Anything else is an unexpected error: another status (INTERNAL, UNKNOWN, UNAVAILABLE, ...), an error on
a good call, OK on a bad one, or an OK stream that is inconsistent (no finish_reason, an "abort" finish,
streamed tokens != usage.completion_tokens, more tokens than max_tokens).

Phases: warm-up (``--warmup`` s of the same workload), then the clients stop (calls in flight finish),
the server settles (no running or waiting request) and the baseline is taken; then the soak
(``--duration`` s), stop, settle, and the end figures. Checks (exit status 1 if any fails):

- no unexpected error (warm-up included);
- KV blocks free (``lookahead:kv_blocks_free`` from /metrics) at the end = before the first request;
- the server's RSS at the end at most ``--max-rss-growth`` (5%) above the baseline;
- the server's thread count at the end at most the baseline's (after up to 30 s more idle: gRPC ends an
  extra EventEngine thread after 20 s idle), but for gRPC's EventEngine pool, which may stay up to one
  thread per core larger;
- the server still healthy, and no "engine step failed" in its log.

    .venv/bin/python benchmarks/soak.py --duration 600 --clients 16      # or: make soak DURATION=600

Prompts are built here (``--prompts`` reads a JSONL of {"prompt": ...}, {"messages": [...]} or MT-bench
{"turns": [...]} lines instead). Long prompts, outputs and deadlines scale with the server's
max_model_len, so a tiny test model (byte-level tokenizer, 512 positions) works as well as the real one.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

import serving  # benchmarks/serving.py, beside this script: its health wait
from lookahead_serve.proto.convert import to_lookahead_proto
from lookahead_serve.proto.lookahead.v1 import lookahead_pb2 as pb
from lookahead_serve.proto.lookahead.v1 import lookahead_pb2_grpc as pb_grpc

REPO_ROOT = Path(__file__).resolve().parent.parent
SERVICE = "lookahead.v1.LookaheadService"
PROGRESS_EVERY_S = 10.0
THREAD_SETTLE_S = 30.0  # longer than gRPC's 20 s before an idle extra EventEngine thread ends
GRPC_POOL = "event_engine"  # the thread name of gRPC's EventEngine pool (/proc/<pid>/task/*/comm)
KINDS = ("greedy, lookahead", "greedy, plain", "sampled, lookahead", "sampled, plain", "cancel", "deadline", "bad")
OUTCOMES = ("OK", "CANCELLED", "DEADLINE_EXCEEDED", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED")
EXPECTED = {"good": {"OK"}, "cancel": {"CANCELLED", "OK"}, "deadline": {"DEADLINE_EXCEEDED", "OK"},
            "bad": {"INVALID_ARGUMENT"}}
ALWAYS_ALLOWED = {"RESOURCE_EXHAUSTED"}
LOOKAHEAD_ON = [(4, 3, 4), (5, 3, 5), (0, 3, 4), None]  # None: leave it unset (the server's default)

_START = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _START:7.1f}s] {message}", file=sys.stderr, flush=True)


# ---- prompts -------------------------------------------------------------------------------------

SHORT = ["Why is the sky blue?", "Write a haiku about the sea.", "List three uses of copper.",
         "Explain recursion to a child.", "What is 17 times 23?", "Translate 'good morning' into French.",
         "Name a prime number larger than 100.", "def fibonacci(n):", "Summarise the water cycle."]
SENTENCES = [
    "The river rose through the night and by morning the lower fields were under water.",
    "A cache keeps recent results close so that the next request for them is cheap.",
    "The committee met twice, argued about the budget, and agreed on nothing but the date.",
    "Copper conducts heat and electricity well, which is why it lines pans and carries current.",
    "In the old town the streets are narrow, the houses lean, and every corner has a bakery.",
    "The algorithm keeps a window of guesses and checks several of them in one pass.",
    "She counted the steps twice, wrote the number down, and still got a different answer.",
    "Prime numbers have exactly two divisors, and there are infinitely many of them.",
    "The train left on time, stopped for an hour in the fields, and arrived late anyway.",
    "A good test fails for one reason, says which, and runs in a fraction of a second.",
]
PREAMBLE = "You are a careful assistant. Read the notes below and answer the question at the end. Notes: "


@dataclass
class Prompts:
    """Text prompts (sent as text or as one-message chats); long ones are built to a character budget."""

    short: list[str]
    long: list[str]

    @classmethod
    def built(cls, long_chars: int, seed: int) -> Prompts:
        rng = random.Random(seed)
        long = []
        for _ in range(16):
            body = PREAMBLE  # a shared prefix: long prompts hit the prefix cache
            while len(body) < long_chars - 60:
                body += rng.choice(SENTENCES) + " "
            long.append(body[: long_chars - 40] + " Question: " + rng.choice(SHORT))
        return cls(SHORT, long)

    @classmethod
    def from_jsonl(cls, path: Path, long_chars: int) -> Prompts:
        texts = []
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                text = row.get("prompt") or row.get("text") or (row.get("turns") or [None])[0]
                text = text or " ".join(m.get("content", "") for m in row.get("messages", []))
                if text:
                    texts.append(text[:long_chars])
        if not texts:
            raise SystemExit(f"{path} has no prompts")
        cut = sorted(len(t) for t in texts)[len(texts) // 2]
        short = [t for t in texts if len(t) <= cut]
        return cls(short, [t for t in texts if len(t) > cut] or short)


# ---- requests ------------------------------------------------------------------------------------


@dataclass
class ServerInfo:
    vocab_size: int
    max_model_len: int
    max_lookahead: tuple[int, int, int]


@dataclass
class Spec:
    """One call to make: its kind, the request, and how the client ends it."""

    kind: str
    category: str  # good, cancel, deadline, bad
    desc: str
    request: pb.GenerateRequest
    timeout: float
    max_tokens: int = 0
    cancel_after: int | None = None  # chunks read before cancelling; 0: cancel before reading any
    cancel_delay: float = 0.0  # seconds before a cancel_after=0 cancel


def _lookahead(la: tuple[int, int, int] | None, enabled: bool = True) -> pb.LookaheadParams | None:
    if not enabled:
        return to_lookahead_proto(None)
    return None if la is None else to_lookahead_proto(la)


def _with_prompt(rng: random.Random, prompts: Prompts, info: ServerInfo, long: bool, sampling: pb.SamplingParams):
    form = rng.choices(["text", "chat", "ids"], weights=[4, 4, 2])[0]
    if form == "ids":
        n = rng.randint(info.max_model_len // 4, info.max_model_len // 3) if long else rng.randint(1, 24)
        ids = [rng.randrange(info.vocab_size) for _ in range(n)]
        return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=sampling), f"ids[{n}]"
    text = rng.choice(prompts.long if long else prompts.short)
    desc = f"{form}[{len(text)} chars]"
    if form == "text":
        return pb.GenerateRequest(text=text.encode(), sampling=sampling), desc
    request = pb.GenerateRequest(sampling=sampling)
    request.chat.messages.add(role="user", content=text)
    return request, desc


def good_spec(rng: random.Random, prompts: Prompts, info: ServerInfo, max_tokens: int, timeout: float) -> Spec:
    sampled, lookahead = rng.random() < 0.5, rng.random() < 0.5
    n = rng.randint(1, max_tokens)
    sampling = pb.SamplingParams(max_tokens=n, ignore_eos=rng.random() < 0.5)
    parts = [f"max_tokens={n}"]
    if sampled:
        sampling.temperature, sampling.seed = round(rng.uniform(0.5, 1.2), 2), rng.randrange(2**31)
        parts.append(f"T={sampling.temperature} seed={sampling.seed}")
        if rng.random() < 0.3:
            sampling.top_p = 0.9
            parts.append("top_p=0.9")
        if rng.random() < 0.3:
            sampling.top_k = 40
            parts.append("top_k=40")
    else:
        sampling.temperature = 0.0
    if rng.random() < 0.1:
        sampling.stop.extend(["\n\n", "."])
        parts.append("stop")
    if rng.random() < 0.1:
        sampling.min_tokens = n // 2
        parts.append(f"min_tokens={n // 2}")
    request, prompt_desc = _with_prompt(rng, prompts, info, rng.random() < 0.3, sampling)
    la = rng.choice(LOOKAHEAD_ON)
    if (message := _lookahead(la, lookahead)) is not None:
        request.lookahead.CopyFrom(message)
    parts.append(f"lookahead={la if lookahead else 'off'}")
    kind = f"{'sampled' if sampled else 'greedy'}, {'lookahead' if lookahead else 'plain'}"
    return Spec(kind, "good", f"{prompt_desc} " + " ".join(parts), request, timeout, max_tokens=n)


def long_spec(rng: random.Random, prompts: Prompts, info: ServerInfo, category: str, timeout: float,
              ttft: float) -> Spec:
    """A generation much longer than the call lives: cancelled by the client, or cut by its deadline.

    Half the deadlines are short (0.05-2 s: most expire before the first token under load), half are 1-3x
    ``ttft``, the median time to first token seen so far (most expire mid-stream)."""
    n = min(1024, info.max_model_len // 2)
    sampling = pb.SamplingParams(max_tokens=n, ignore_eos=True, temperature=rng.choice([0.0, 0.8]),
                                 seed=rng.randrange(2**31))
    request, prompt_desc = _with_prompt(rng, prompts, info, rng.random() < 0.3, sampling)
    la, enabled = rng.choice(LOOKAHEAD_ON), rng.random() < 0.8
    if (message := _lookahead(la, enabled)) is not None:
        request.lookahead.CopyFrom(message)
    desc = f"{prompt_desc} max_tokens={n} T={sampling.temperature} lookahead={la if enabled else 'off'}"
    if category == "cancel":
        after = rng.randint(0, 5)
        spec = Spec("cancel", "cancel", f"{desc} cancel after {after} chunks", request, timeout, n, after)
        spec.cancel_delay = rng.uniform(0.0, 0.2)
        return spec
    deadline = rng.choice([0.05, 0.2, 0.5, 1.0, 2.0]) if rng.random() < 0.5 else round(ttft * rng.uniform(1, 3), 2)
    return Spec("deadline", "deadline", f"{desc} deadline {deadline} s", request, deadline, n)


def bad_inputs(info: ServerInfo) -> list[tuple[str, pb.GenerateRequest]]:
    """Requests the server must refuse with INVALID_ARGUMENT."""

    def req(ids=(1, 2, 3), la=None, **sampling) -> pb.GenerateRequest:
        r = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(ids)), sampling=pb.SamplingParams(**sampling))
        if la is not None:
            r.lookahead.CopyFrom(la)
        return r

    W, N, G = info.max_lookahead
    on = _lookahead
    no_role = pb.GenerateRequest()
    no_role.chat.messages.add(role="", content="hi")
    return [
        ("top_p=2", req(top_p=2.0, temperature=0.8, max_tokens=8)),
        ("top_p=0", req(top_p=0.0, max_tokens=8)),
        ("top_p=NaN", req(top_p=math.nan, max_tokens=8)),
        ("temperature=NaN", req(temperature=math.nan, max_tokens=8)),
        ("temperature=-1", req(temperature=-1.0, max_tokens=8)),
        ("top_k=-2", req(top_k=-2, max_tokens=8)),
        ("max_tokens=0", req(max_tokens=0)),
        ("max_tokens=-5", req(max_tokens=-5)),
        ("max_tokens>max_model_len", req(max_tokens=info.max_model_len + 1)),
        ("min_tokens>max_tokens", req(max_tokens=4, min_tokens=8)),
        ("empty text", pb.GenerateRequest(text=b"", sampling=pb.SamplingParams(max_tokens=8))),
        ("empty token_ids", req(ids=[], max_tokens=8)),
        ("no prompt", pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=8))),
        ("empty chat", pb.GenerateRequest(chat=pb.ChatMessages(), sampling=pb.SamplingParams(max_tokens=8))),
        ("chat message without role", no_role),
        ("invalid UTF-8", pb.GenerateRequest(text=b"\xff\xfe bad", sampling=pb.SamplingParams(max_tokens=8))),
        ("token id = vocab_size", req(ids=[1, info.vocab_size], max_tokens=8)),
        ("token id -1", req(ids=[-1, 2], max_tokens=8)),
        ("prompt over max_model_len", req(ids=[1] * (info.max_model_len + 1), max_tokens=8)),
        ("stop token id = vocab_size", req(stop_token_ids=[info.vocab_size], max_tokens=8)),
        ("stop token id -1", req(stop_token_ids=[-1], max_tokens=8)),
        ("window_size=1", req(la=on((1, 3, 4)), max_tokens=8)),
        ("ngram_size=2", req(la=on((4, 2, 4)), max_tokens=8)),
        ("window_size above max", req(la=on((W + 1, N, G)), max_tokens=8)),
        ("verification_set_size above max", req(la=on((W, N, G + 1)), max_tokens=8)),
        ("unknown model", pb.GenerateRequest(model="no-such-model", token_ids=pb.TokenIds(ids=[1]))),
    ]


class Workload:
    """Draws each client's next call from its own seeded generator."""

    def __init__(self, args: argparse.Namespace, info: ServerInfo, prompts: Prompts) -> None:
        self.args, self.info, self.prompts = args, info, prompts
        self.bad = bad_inputs(info)
        self.max_tokens = max(1, min(args.max_tokens, info.max_model_len // 4))
        self.ttfts: list[float] = []  # of good calls, for deadlines that expire mid-stream
        self.num_bad = 0

    @property
    def median_ttft(self) -> float:
        return float(np.median(self.ttfts[-200:])) if self.ttfts else 1.0

    def next(self, rng: random.Random) -> Spec:
        x = rng.random()
        if x < 0.6:
            return good_spec(rng, self.prompts, self.info, self.max_tokens, self.args.request_timeout)
        if x < 0.8:
            return long_spec(rng, self.prompts, self.info, "cancel", self.args.request_timeout, self.median_ttft)
        if x < 0.9:
            return long_spec(rng, self.prompts, self.info, "deadline", self.args.request_timeout, self.median_ttft)
        name, request = self.bad[self.num_bad % len(self.bad)]  # in turn: a short run sends every kind
        self.num_bad += 1
        return Spec("bad", "bad", name, request, self.args.request_timeout)


# ---- calls ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class Result:
    kind: str
    category: str
    desc: str
    phase: str
    outcome: str  # the status code's name
    problem: str | None  # what is wrong with an OK stream, if anything
    details: str
    latency: float  # seconds: call sent -> status (or our cancel)
    ttft: float | None  # seconds: call sent -> first token
    tokens: int

    @property
    def unexpected(self) -> bool:
        return self.problem is not None or self.outcome not in EXPECTED[self.category] | ALWAYS_ALLOWED


async def run_call(stub: pb_grpc.LookaheadServiceStub, spec: Spec, phase: str) -> Result:
    start = time.perf_counter()
    first = final = None
    tokens = chunks = 0
    call = stub.Generate(spec.request, timeout=spec.timeout)
    try:
        if spec.cancel_after == 0:
            await asyncio.sleep(spec.cancel_delay)
            call.cancel()
        else:
            async for chunk in call:
                chunks += 1
                tokens += len(chunk.token_ids)
                if chunk.token_ids and first is None:
                    first = time.perf_counter()
                if chunk.finish_reason:
                    final = chunk
                elif spec.cancel_after is not None and chunks >= spec.cancel_after:
                    call.cancel()
                    break
        code, details = await call.code(), await call.details()
    except grpc.aio.AioRpcError as e:
        code, details = e.code(), e.details() or ""
        debug = e.debug_error_string()
        if debug and code.name not in EXPECTED[spec.category] | ALWAYS_ALLOWED:
            details += f" [{debug}]"
    latency = time.perf_counter() - start
    problem = None
    if code == grpc.StatusCode.OK:
        if spec.category == "bad":
            problem = "OK for a bad input"
        elif final is None:
            problem = "stream ended without a finish_reason"
        elif final.finish_reason not in ("stop", "length"):
            problem = f"finish_reason {final.finish_reason!r}"
        elif final.usage.completion_tokens != tokens:
            problem = f"streamed {tokens} tokens, usage says {final.usage.completion_tokens}"
        elif spec.max_tokens and tokens > spec.max_tokens:
            problem = f"{tokens} tokens for max_tokens={spec.max_tokens}"
    return Result(spec.kind, spec.category, spec.desc, phase, code.name, problem, details or "", latency,
                  None if first is None else first - start, tokens)


# ---- the server ----------------------------------------------------------------------------------


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class Server:
    """``lookahead-serve serve`` in its own process, its log in a file, its metrics and memory read from here."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.port, self.metrics_port = free_ports(2)
        exe = Path(sys.executable).with_name("lookahead-serve")
        command = [str(exe)] if exe.exists() else [sys.executable, "-m", "lookahead_serve.deploy.cli"]
        command += ["serve", "--host", "127.0.0.1", "--port", str(self.port), "--http-port", "0",
                    "--metrics-port", str(self.metrics_port)]
        command += (["--model", args.model] if args.model else []) + shlex.split(args.server_args)
        self.command = command
        if args.server_log is None:
            fd, name = tempfile.mkstemp(prefix="soak-server-", suffix=".log")
            os.close(fd)
            args.server_log = Path(name)
        self.log_path = args.server_log
        self._log = self.log_path.open("w")
        log(f"starting the server: {shlex.join(command)} (log: {self.log_path})")
        self.proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT)
        self.ps = psutil.Process(self.proc.pid)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def metrics(self) -> dict[str, float]:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name.partition("{")[0]] = float(value)  # one model: its model_name label is dropped
        return values

    def sample(self) -> dict:
        """RSS (bytes), threads and the KV and queue gauges now; None values once the server is gone."""
        try:  # threads first: the metrics endpoint answers each scrape on a thread of its own
            rss, threads, names = self.ps.memory_info().rss, self.ps.num_threads(), self.thread_names()
            m = self.metrics()
        except (OSError, psutil.Error):
            return {"rss": None, "threads": None, "thread_names": None, "kv_free": None, "kv_used": None,
                    "running": None, "waiting": None}
        return {"rss": rss, "threads": threads, "thread_names": names, "kv_free": m.get("lookahead:kv_blocks_free"),
                "kv_used": m.get("lookahead:kv_blocks_used"), "running": m.get("lookahead:num_requests_running"),
                "waiting": m.get("lookahead:num_requests_waiting")}

    def thread_names(self) -> dict[str, int]:
        """Threads by their OS name (Linux: /proc/<pid>/task/*/comm; empty elsewhere)."""
        names = Counter()
        for comm in Path(f"/proc/{self.proc.pid}/task").glob("*/comm"):
            try:
                names[comm.read_text().strip()] += 1
            except OSError:  # the thread ended meanwhile
                pass
        return dict(sorted(names.items()))

    def log_count(self, text: str) -> int:
        self._log.flush()
        return self.log_path.read_text(errors="replace").count(text)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> int | None:
        """SIGINT (what Ctrl-C sends: a graceful stop); its exit code, or None if it had to be killed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            code = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            code = None
        self._log.close()
        return code


async def wait_healthy(channel: grpc.aio.Channel, server: Server, timeout_s: float) -> None:
    try:
        await serving.wait_healthy(channel, server.proc, timeout_s)
    except SystemExit as e:
        raise SystemExit(f"{e}:\n{server.log_tail()}") from None


async def settle(server: Server, kv_target: float | None, timeout_s: float, quiet_s: float,
                 max_threads: int | None = None) -> dict:
    """Wait until nothing runs or waits and (if given) the free KV blocks are back to kv_target, then
    ``quiet_s`` more, and (if given) until at most ``max_threads`` threads are left or ``THREAD_SETTLE_S``
    has passed; return the sample taken then. gRPC's EventEngine pool adds threads while work backs up
    and ends each extra one after 20 s idle, so a thread count above the baseline is a leak only if it
    outlasts that."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and server.proc.poll() is None:
        s = await asyncio.to_thread(server.sample)
        if s["running"] == 0 and s["waiting"] == 0 and kv_target in (None, s["kv_free"]):
            break
        await asyncio.sleep(0.25)
    await asyncio.sleep(quiet_s)
    s = await asyncio.to_thread(server.sample)
    deadline = time.monotonic() + THREAD_SETTLE_S
    while max_threads is not None and s["threads"] is not None and s["threads"] > max_threads \
            and time.monotonic() < deadline:
        await asyncio.sleep(1.0)
        s = await asyncio.to_thread(server.sample)
    return s


# ---- phases --------------------------------------------------------------------------------------


@dataclass
class Soak:
    args: argparse.Namespace
    server: Server
    workload: Workload | None = None
    results: list[Result] = field(default_factory=list)
    in_flight: int = 0
    series: list[dict] = field(default_factory=list)  # progress samples: t, rss, threads, kv_free
    samples: dict[str, dict] = field(default_factory=dict)  # start, baseline, end
    healthy_at_end: bool = False

    async def phase(self, name: str, seconds: float, stubs: list, rngs: list[random.Random]) -> None:
        stop_at = time.monotonic() + seconds

        async def client(i: int) -> None:
            while time.monotonic() < stop_at:
                spec = self.workload.next(rngs[i])
                self.in_flight += 1
                try:
                    result = await run_call(stubs[i], spec, name)
                finally:
                    self.in_flight -= 1
                self.results.append(result)
                if result.category == "good" and result.ttft is not None:
                    self.workload.ttfts.append(result.ttft)
                if result.unexpected:
                    log(f"  unexpected: {result.kind} -> {result.outcome}: {result.problem or result.details} "
                        f"({result.desc}; {result.tokens} tokens in {result.latency:.2f} s)")

        log(f"{name}: {len(stubs)} clients for {seconds:.0f} s")
        reporter = asyncio.create_task(self.progress(name, time.monotonic()))
        try:
            await asyncio.gather(*(client(i) for i in range(len(stubs))))
        finally:
            reporter.cancel()

    async def progress(self, name: str, start: float) -> None:
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            s = await asyncio.to_thread(self.server.sample)  # off the loop: the streams go on meanwhile
            self.series.append({"phase": name, "t": round(time.monotonic() - start, 1), **s})
            outcomes = Counter(r.outcome for r in self.results)
            unexpected = sum(r.unexpected for r in self.results)
            rss = f"{s['rss'] / 2**20:.0f} MiB" if s["rss"] else "?"
            log(f"  {name} {time.monotonic() - start:4.0f} s: {len(self.results)} calls done ("
                + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())) + f"), unexpected {unexpected}, "
                f"in flight {self.in_flight}, RSS {rss}, threads {s['threads']} {s['thread_names']}, "
                f"KV free {s['kv_free']}")

    async def run(self) -> None:
        a = self.args
        # A connection of its own for each client (channels to one target share one by default).
        channels = [grpc.aio.insecure_channel(self.server.target, options=[("grpc.use_local_subchannel_pool", 1)])
                    for _ in range(a.clients)]
        try:
            await wait_healthy(channels[0], self.server, a.startup_timeout)
            stubs = [pb_grpc.LookaheadServiceStub(c) for c in channels]
            m = await stubs[0].GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
            la = m.max_lookahead
            info = ServerInfo(m.vocab_size, m.max_model_len, (la.window_size, la.ngram_size, la.verification_set_size))
            long_chars = min(4000, info.max_model_len // 3)
            prompts = Prompts.from_jsonl(a.prompts, long_chars) if a.prompts else Prompts.built(long_chars, a.seed)
            self.workload = Workload(a, info, prompts)
            log(f"server healthy: {m.model}, max_model_len {info.max_model_len}, vocab {info.vocab_size}")
            self.samples["start"] = await asyncio.to_thread(self.server.sample)
            rngs = [random.Random(a.seed * 1000 + i) for i in range(a.clients)]
            await self.phase("warm-up", a.warmup, stubs, rngs)
            kv_start = self.samples["start"]["kv_free"]
            self.samples["baseline"] = await settle(self.server, kv_start, a.settle_timeout, a.quiet)
            log(f"baseline: {self.samples['baseline']}")
            await self.phase("soak", a.duration, stubs, rngs)
            self.samples["end"] = await settle(self.server, kv_start, a.settle_timeout, a.quiet,
                                               self.samples["baseline"]["threads"])
            log(f"end: {self.samples['end']}")
            health = health_pb2_grpc.HealthStub(channels[0])
            try:
                reply = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10)
                await stubs[0].GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
                self.healthy_at_end = reply.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.aio.AioRpcError as e:
                log(f"the server is not healthy at the end: {e.code().name}: {e.details()}")
        finally:
            for c in channels:
                await c.close()


# ---- report --------------------------------------------------------------------------------------


def ms(values: list[float]) -> list[str]:
    """p50 and p99 in milliseconds."""
    if not values:
        return ["—", "—"]
    return [f"{v:.0f}" for v in np.percentile(np.array(values) * 1000, [50, 99])]


def kind_rows(results: list[Result]) -> list[list[str]]:
    rows = []
    for kind in KINDS:
        rs = [r for r in results if r.kind == kind]
        if not rs:
            continue
        outcomes = Counter(r.outcome for r in rs)
        other = sum(v for k, v in outcomes.items() if k not in OUTCOMES)
        rows.append([kind, str(len(rs)), *(str(outcomes.get(o, 0)) for o in OUTCOMES), str(other),
                     str(sum(r.unexpected for r in rs)), *ms([r.latency for r in rs]),
                     *ms([r.ttft for r in rs if r.ttft is not None]), str(sum(r.tokens for r in rs))])
    return rows


def unexpected_groups(results: list[Result]) -> list[dict]:
    """Unexpected outcomes grouped by kind, status and message, with a count and the first call's request."""
    groups: dict[tuple, dict] = {}
    for r in results:
        if r.unexpected:
            key = (r.kind, r.outcome, r.problem or r.details[:200])
            g = groups.setdefault(key, {"kind": r.kind, "outcome": r.outcome, "details": key[2], "count": 0,
                                        "first_request": r.desc, "phase": r.phase,
                                        "first_latency_s": round(r.latency, 3), "first_tokens": r.tokens})
            g["count"] += 1
    return sorted(groups.values(), key=lambda g: -g["count"])


def bad_outcomes(results: list[Result]) -> dict[str, dict[str, int]]:
    """Each bad input's outcomes: {name: {status: count}}."""
    by_name: dict[str, Counter] = {}
    for r in results:
        if r.category == "bad":
            by_name.setdefault(r.desc, Counter())[r.outcome] += 1
    return {name: dict(c) for name, c in sorted(by_name.items())}


def mib(x: float | None) -> str:
    return "—" if x is None else f"{x / 2**20:.1f}"


def thread_change(base: dict, end: dict) -> str:
    """The end's thread count, with the names whose count changed (e.g. "16 (event_engine 4 -> 5)")."""
    before, after = base.get("thread_names") or {}, end.get("thread_names") or {}
    changed = [f"{n} {before.get(n, 0)} -> {after.get(n, 0)}" for n in sorted({*before, *after})
               if before.get(n, 0) != after.get(n, 0)]
    return f"{end.get('threads')}" + (f" ({', '.join(changed)})" if changed else "")


def threads_bounded(base: dict, end: dict) -> bool:
    """No more threads at the end than at the baseline, but for gRPC's EventEngine pool, which grows while
    work backs up and gives threads back only after they idle: it may end up to one thread per core larger.
    A leak (a thread per call) would show outside the pool or past that bound."""
    pool0 = (base.get("thread_names") or {}).get(GRPC_POOL, 0)
    pool1 = (end.get("thread_names") or {}).get(GRPC_POOL, 0)
    return end["threads"] - pool1 <= base["threads"] - pool0 and pool1 <= pool0 + (os.cpu_count() or 1)


def check(key: str, what: str, start, end, limit: str, passed: bool) -> dict:
    return {"key": key, "check": what, "start": str(start), "end": str(end), "limit": limit, "pass": bool(passed)}


def checks(soak: Soak, exit_code: int | None, step_failures: int) -> list[dict]:
    start, base, end = (soak.samples.get(k, {}) for k in ("start", "baseline", "end"))
    unexpected = sum(r.unexpected for r in soak.results)
    kv_start, kv_end = start.get("kv_free"), end.get("kv_free")
    rss0, rss1, th0, th1 = base.get("rss"), end.get("rss"), base.get("threads"), end.get("threads")
    growth = (rss1 - rss0) / rss0 if rss0 and rss1 else None
    limit = soak.args.max_rss_growth
    return [
        check("unexpected", "unexpected outcomes", "—", unexpected, "0", unexpected == 0),
        check("kv", "KV blocks free (start: before the first call)",
              f"{kv_start} (after warm-up {base.get('kv_free')})", kv_end, "end = start",
              kv_start is not None and kv_start == kv_end),
        check("rss", "server RSS MiB (start: after warm-up)", mib(rss0), mib(rss1),
              f"+{limit:.0%}" + ("" if growth is None else f" (growth {growth:+.2%})"),
              growth is not None and growth <= limit),
        check("threads", "server threads (start: after warm-up)", th0, thread_change(base, end),
              f"end <= start; gRPC's {GRPC_POOL} pool within start + {os.cpu_count()}",
              th0 is not None and th1 is not None and threads_bounded(base, end)),
        check("healthy", "server healthy after the soak", "—", "yes" if soak.healthy_at_end else "no", "yes",
              soak.healthy_at_end),
        check("step_failures", "'engine step failed' in the server log", "—", step_failures, "0", step_failures == 0),
        check("exit", "server exit code on SIGINT", "—", exit_code, "0 within 30 s", exit_code == 0),
    ]


def machine() -> dict:
    cpu = "unknown"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass

    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(REPO_ROOT), *cmd], capture_output=True, text=True).stdout.strip()
        except OSError:
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += " (with uncommitted changes)"
    return {"cpu": cpu, "cpus": os.cpu_count(), "platform": platform.platform(), "commit": commit,
            "load_average": [round(x, 2) for x in os.getloadavg()]}


def table(header: list[str], rows: list[list[str]], align: str) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def report(soak: Soak, checks_: list[dict], info: dict) -> str:
    a = soak.args
    soaked = [r for r in soak.results if r.phase == "soak"]
    warm = [r for r in soak.results if r.phase == "warm-up"]
    header = ["kind", "calls", *OUTCOMES, "other", "unexpected", "latency p50 ms", "p99", "TTFT p50 ms", "p99",
              "tokens"]
    lines = [
        f"- commit {info['commit']}; machine: {info['cpus']} CPUs, {info['cpu']}, `{info['platform']}`; "
        f"load average at the end {', '.join(map(str, info['load_average']))}",
        f"- command: `{shlex.join(sys.orig_argv)}`",
        f"- server: `{shlex.join(soak.server.command)}`",
        f"- {a.clients} clients, warm-up {a.warmup:.0f} s ({len(warm)} calls, "
        f"{sum(r.unexpected for r in warm)} unexpected), soak {a.duration:.0f} s ({len(soaked)} calls), seed {a.seed}",
        "",
        "Soak calls by kind and status (latency: call sent -> status or our cancel; TTFT: -> first token):",
        "",
        table(header, kind_rows(soaked), "lrrrrrrrrrrrrr"),
        "",
        table(["check", "start", "end", "limit", "pass"],
              [[c["check"], c["start"], c["end"], c["limit"], "yes" if c["pass"] else "**NO**"] for c in checks_],
              "lrrll"),
    ]
    rss = [s["rss"] for s in soak.series if s["phase"] == "soak" and s["rss"]]
    if rss:
        lines += ["", f"Server RSS during the soak (every {PROGRESS_EVERY_S:.0f} s, under load): "
                  f"min {mib(min(rss))}, max {mib(max(rss))} MiB."]
    bad = bad_outcomes(soak.results)
    lines += ["", "Bad inputs sent (warm-up and soak): " + "; ".join(
        f"{name}: " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())) for name, c in bad.items()) + "."]
    groups = unexpected_groups(soak.results)
    if groups:
        lines += ["", "Unexpected outcomes (grouped; the first call's request shown):", ""]
        lines += [f"- {g['count']} x {g['kind']} -> {g['outcome']}: {g['details']} (first: {g['first_request']}, "
                  f"{g['phase']}, {g['first_tokens']} tokens in {g['first_latency_s']} s)" for g in groups[:40]]
    return "\n".join(lines)


# ---- main ----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of soak after the warm-up (default: 600)")
    p.add_argument("--warmup", type=float, default=None, help="seconds of warm-up (default: 10%% of --duration, 10-60)")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients (default: %(default)s)")
    p.add_argument("--model", default=None, help="model for the server (default: the embedded one)")
    p.add_argument("--max-tokens", type=int, default=96,
                   help="most tokens of a good call, drawn in [1, this]; at most max_model_len/4 (default: 96)")
    p.add_argument("--seed", type=int, default=0, help="seeds every client's draws (default: %(default)s)")
    p.add_argument("--prompts", type=Path, default=None, help="JSONL of prompts instead of the built-in ones")
    p.add_argument("--server-args", default="", help="more arguments for `lookahead-serve serve`, one string")
    p.add_argument("--server-log", type=Path, default=None, help="the server's output (default: a temporary file)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="deadline of a good call, s (default: 600)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="wait for the server, s (default: %(default)s)")
    p.add_argument("--settle-timeout", type=float, default=60.0,
                   help="wait for the server to go idle after the clients stop, s (default: %(default)s)")
    p.add_argument("--quiet", type=float, default=2.0, help="seconds idle before the figures are read (default: 2)")
    p.add_argument("--max-rss-growth", type=float, default=0.05, help="allowed RSS growth (default: %(default)s)")
    p.add_argument("--json", type=Path, default=None, help="write every figure and the unexpected outcomes as JSON")
    p.add_argument("--results", type=Path, default=None, help="write the report as a Markdown file")
    args = p.parse_args(argv)
    if args.duration <= 0 or args.clients < 1 or args.max_tokens < 1:
        p.error("--duration, --clients and --max-tokens must be positive")
    if args.warmup is None:
        args.warmup = min(60.0, max(10.0, args.duration / 10))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server = Server(args)
    soak = Soak(args, server)
    try:
        asyncio.run(soak.run())
    finally:
        step_failures = server.log_count("engine step failed")
        exit_code = server.stop()
    info = machine()
    checks_ = checks(soak, exit_code, step_failures)
    text = report(soak, checks_, info)
    passed = all(c["pass"] for c in checks_)
    print(f"\n{text}\n\nsoak {'PASSED' if passed else 'FAILED'} (server log: {server.log_path})", flush=True)
    if args.results:
        stamp = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(f"# Soak, {stamp}\n\n{text}\n", encoding="utf-8")
        log(f"wrote {args.results}")
    if args.json:
        kinds = {row[0]: dict(zip(["kind", "calls", *OUTCOMES, "other", "unexpected", "latency_p50_ms",
                                   "latency_p99_ms", "ttft_p50_ms", "ttft_p99_ms", "tokens"], row))
                 for row in kind_rows([r for r in soak.results if r.phase == "soak"])}
        payload = {"passed": passed, "machine": info, "args": {k: str(v) for k, v in vars(args).items()},
                   "server_command": server.command, "samples": soak.samples, "series": soak.series,
                   "checks": checks_, "kinds": kinds, "unexpected": unexpected_groups(soak.results),
                   "bad_inputs": bad_outcomes(soak.results),
                   "bad_kinds": len(soak.workload.bad) if soak.workload else 0,
                   "calls": {"warm-up": sum(r.phase == "warm-up" for r in soak.results),
                             "soak": sum(r.phase == "soak" for r in soak.results)}}
        args.json.write_text(json.dumps(payload, indent=1), encoding="utf-8")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
