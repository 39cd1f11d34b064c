"""Locust load test of the gRPC service (standalone server or Ray Serve's gRPC proxy).

    make load USERS=8 RUN_TIME=60s            # headless, writes locust CSVs under benchmarks/out/
    locust -f deploy/locustfile.py --host 127.0.0.1:50051 --headless -u 8 -r 8 -t 60s

Each user streams MT-bench first turns (``LOCUST_PROMPTS``, default ../shared/data/mt_bench_questions.jsonl;
a few built-in prompts when the file is missing) through the generated stub and reports two request types:
``ttft`` (time to the first streamed chunk) and ``generate`` (the whole response). ``LOCUST_MAX_TOKENS``
(default 64) and ``LOCUST_LOOKAHEAD`` (``off``, or ``W,N,G``; unset = the server's default) shape requests.
"""

from __future__ import annotations

import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()  # before any channel exists

import itertools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import grpc  # noqa: E402
from locust import User, between, events, task  # noqa: E402

from proto.lookahead.v1 import lookahead_pb2 as pb  # noqa: E402
from proto.lookahead.v1 import lookahead_pb2_grpc as pb_grpc  # noqa: E402

DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "data" / "mt_bench_questions.jsonl"
FALLBACK = ["Write a haiku about the sea.", "Explain recursion to a child.", "List three uses of copper."]


def load_prompts() -> list[str]:
    path = Path(os.environ.get("LOCUST_PROMPTS", DEFAULT_PROMPTS))
    if not path.is_file():
        return FALLBACK
    with open(path) as f:
        return [json.loads(line)["turns"][0] for line in f if line.strip()]


def lookahead_from_env() -> pb.LookaheadParams | None:
    value = os.environ.get("LOCUST_LOOKAHEAD")
    if not value:
        return None
    if value == "off":
        return pb.LookaheadParams(enabled=False)
    w, n, g = (int(v) for v in value.split(","))
    return pb.LookaheadParams(enabled=True, window_size=w, ngram_size=n, verification_set_size=g)


PROMPTS = load_prompts()
_counter = itertools.count()


class GrpcUser(User):
    wait_time = between(0.0, 0.2)

    def on_start(self) -> None:
        self.channel = grpc.insecure_channel(self.host or "127.0.0.1:50051")
        self.stub = pb_grpc.LookaheadServiceStub(self.channel)
        self.max_tokens = int(os.environ.get("LOCUST_MAX_TOKENS", "64"))
        self.lookahead = lookahead_from_env()

    def on_stop(self) -> None:
        self.channel.close()

    def _fire(self, name: str, start: float, length: int, exc: Exception | None) -> None:
        events.request.fire(request_type="grpc", name=name, response_time=(time.perf_counter() - start) * 1000,
                            response_length=length, exception=exc, context={})

    @task
    def generate(self) -> None:
        request = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=self.max_tokens, temperature=0))
        request.chat.messages.add(role="user", content=PROMPTS[next(_counter) % len(PROMPTS)])
        if self.lookahead is not None:
            request.lookahead.CopyFrom(self.lookahead)
        start = time.perf_counter()
        tokens, first = 0, True
        try:
            for chunk in self.stub.Generate(request, timeout=300):
                if first:
                    self._fire("ttft", start, 0, None)
                    first = False
                tokens += len(chunk.token_ids)
            self._fire("generate", start, tokens, None)
        except grpc.RpcError as e:
            self._fire("generate", start, tokens, e)
