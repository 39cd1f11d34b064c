"""Locust load test of the gRPC service (the standalone server or Ray Serve's gRPC proxy).

    make load USERS=8 RUN_TIME=60s          # headless against 127.0.0.1:50051, CSVs in benchmarks/out/
    .venv/bin/locust -f deploy/locustfile.py --host 127.0.0.1:50051 --headless -u 8 -r 8 -t 60s \\
        --prompts ../shared/data/mt_bench_questions.jsonl --max-tokens 64 --lookahead off

Each user streams ``Generate`` calls through the generated stub, one after another: the first turn of an
MT-bench style question (``--prompts``, one JSON object a line with ``"turns"``; default deploy/prompts.jsonl,
20 prompts that ship with the package) as a one-message chat, greedy. Two request types are reported:
``ttft`` (time to the first streamed chunk) and ``generate`` (the whole response; its length is the
number of tokens). A call that fails, or a stream that ends without a ``finish_reason``, is a failure.
``--max-tokens`` (default 64) and ``--lookahead`` (``off`` or ``W,N,G``; unset = the server's default)
shape the requests. Every option can also be set through its environment variable (``LOCUST_PROMPTS``,
``LOCUST_MAX_TOKENS``, ``LOCUST_LOOKAHEAD``).
"""

from __future__ import annotations

import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()  # before any channel exists: gRPC's I/O must yield to locust's greenlets

import itertools  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import grpc  # noqa: E402
from locust import User, between, events, task  # noqa: E402

from lookahead_serve.proto.convert import to_lookahead_proto  # noqa: E402  (no torch: engine types are annotations only)
from lookahead_serve.proto.lookahead.v1 import lookahead_pb2 as pb  # noqa: E402
from lookahead_serve.proto.lookahead.v1 import lookahead_pb2_grpc as pb_grpc  # noqa: E402
from lookahead_serve.scheduler.params import LookaheadParams  # noqa: E402  (pure Python)

DEFAULT_PROMPTS = Path(__file__).with_name("prompts.jsonl")  # 20 prompts of our own, shipped with the package
CALL_TIMEOUT_S = 600.0

PROMPTS: list[str] = []
_next_prompt = itertools.count()


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    parser.add_argument("--prompts", default=str(DEFAULT_PROMPTS), env_var="LOCUST_PROMPTS",
                        help="MT-bench style JSONL; each line's first turn is one prompt (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=64, env_var="LOCUST_MAX_TOKENS",
                        help="most tokens per response (default: %(default)s)")
    parser.add_argument("--lookahead", default="", env_var="LOCUST_LOOKAHEAD",
                        help="off or W,N,G; empty = the server's default")


@events.init.add_listener
def _load_prompts(environment, **_) -> None:
    """Read the prompts once per process; a missing or empty file stops locust before any user starts."""
    path = Path(environment.parsed_options.prompts)
    try:
        with path.open(encoding="utf-8") as f:
            PROMPTS[:] = [json.loads(line)["turns"][0] for line in f if line.strip()]
        lookahead_proto(environment.parsed_options.lookahead)
    except (OSError, ValueError, KeyError, IndexError) as e:
        logging.error("locustfile: cannot use --prompts %s / --lookahead: %r", path, e)
        sys.exit(1)
    if not PROMPTS:
        logging.error("locustfile: no prompts in %s", path)
        sys.exit(1)


def lookahead_proto(value: str) -> pb.LookaheadParams | None:
    if not value:
        return None
    params = LookaheadParams.parse(value)
    return to_lookahead_proto(None if params.is_plain else params)


class GrpcUser(User):
    wait_time = between(0.0, 0.2)

    def on_start(self) -> None:
        target = (self.host or "127.0.0.1:50051").split("://")[-1]
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.LookaheadServiceStub(self.channel)
        options = self.environment.parsed_options
        self.max_tokens = options.max_tokens
        self.lookahead = lookahead_proto(options.lookahead)

    def on_stop(self) -> None:
        self.channel.close()

    def _report(self, name: str, start: float, length: int, exc: Exception | None) -> None:
        self.environment.events.request.fire(
            request_type="grpc", name=name, response_time=(time.perf_counter() - start) * 1000,
            response_length=length, exception=exc, context={},
        )

    @task
    def generate(self) -> None:
        request = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=self.max_tokens, temperature=0))
        request.chat.messages.add(role="user", content=PROMPTS[next(_next_prompt) % len(PROMPTS)])
        if self.lookahead is not None:
            request.lookahead.CopyFrom(self.lookahead)
        start = time.perf_counter()
        tokens, finish_reason = 0, ""
        try:
            for i, chunk in enumerate(self.stub.Generate(request, timeout=CALL_TIMEOUT_S)):
                if i == 0:
                    self._report("ttft", start, 0, None)
                tokens += len(chunk.token_ids)
                finish_reason = chunk.finish_reason or finish_reason
        except grpc.RpcError as e:
            self._report("generate", start, tokens, e)
            return
        error = None if finish_reason else RuntimeError("the stream ended without a finish_reason")
        self._report("generate", start, tokens, error)
