"""Two replicas of a tiny model behind Ray Serve's gRPC and HTTP proxies (the OpenAI-compatible API,
through the official client), on a local Ray cluster on loopback; their metrics through Ray's export.

Why the start-up is written the way it is (an earlier version missed the proxy's readiness check on a
loaded 2-core machine and never became ready):

* Ray renices every worker process (controller, proxy, replicas) to +15 (``RAY_worker_niceness``), so
  next to any ordinary process using the cores (a benchmark, another test run) a worker gets a few
  percent of a core. The proxy actor then needs far longer than Ray Serve's readiness check allows
  (``RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S``, 5 s, three tries, then kill and restart with a longer
  timeout): every restart throws away a half-started proxy, and on that machine it never converged.
  Here workers keep the test's niceness and the readiness and health checks get generous timeouts.
* The proxy is started and waited for before any replica exists, so its start does not compete with
  two replicas importing torch, and each replica asks for 1 of the 2 CPUs given to Ray (Ray then sets
  its OMP_NUM_THREADS=1, so two replicas do not fight over both cores).
* Every wait is bounded (``STARTUP_TIMEOUT_S``, deadlines on every call): a hang fails, with
  ``serve.status()`` in the message, and the teardown always shuts Serve and Ray down.
"""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402
from ray.serve.config import gRPCOptions  # noqa: E402
from ray.serve.schema import ApplicationStatus, ProxyStatus  # noqa: E402

from lookahead_serve.engine import LLM, SamplingParams  # noqa: E402
from lookahead_serve.proto.lookahead.v1 import lookahead_pb2 as pb  # noqa: E402
from lookahead_serve.proto.lookahead.v1 import lookahead_pb2_grpc as pb_grpc  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # Ray binds 127.0.0.1 only
    "RAY_worker_niceness": "0",  # workers compete fairly with other processes (Ray's default is +15)
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",  # default 5 s
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30",  # default 10 s
    "RAY_metrics_report_interval_ms": "1000",  # replicas report metrics every second (default 10 s)
}
STARTUP_TIMEOUT_S = 120.0
CALL_TIMEOUT_S = 60.0
PROMPT = [3, 14, 15, 92, 65, 35, 89]
MESSAGES = [{"role": "user", "content": "Write a haiku about the sea."}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_state() -> str:
    try:
        status = serve.status()
    except Exception as e:  # the message must not hide the original failure
        return f"serve.status() failed: {e!r}"
    apps = {name: (app.status, {d: dict(s.replica_states) for d, s in app.deployments.items()})
            for name, app in status.applications.items()}
    return f"proxies {dict(status.proxies)}, applications {apps}"


def _wait_until(ready: Callable[[], bool], what: str, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not after {timeout_s:.0f} s: {_serve_state()}")
        time.sleep(0.5)


def _run_bounded(fn: Callable[[], object], what: str, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Run a call that waits without a deadline of its own (serve.run) on a thread, with one."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="serve-run")
    try:
        pool.submit(fn).result(timeout=timeout_s)
    except FutureTimeout:
        raise TimeoutError(f"{what} not after {timeout_s:.0f} s: {_serve_state()}") from None
    finally:
        pool.shutdown(wait=False)  # a stuck call ends when the teardown shuts Ray down


def _proxies_healthy() -> bool:
    proxies = serve.status().proxies
    return bool(proxies) and all(s == ProxyStatus.HEALTHY for s in proxies.values())


@dataclass(frozen=True)
class RayApp:
    stub: pb_grpc.LookaheadServiceStub
    openai_url: str  # the OpenAI-compatible API through Ray's HTTP proxy
    metrics_url: str  # Ray's metrics export on this node


@pytest.fixture(scope="module")
def ray_serve_app(tiny_llama_chat):
    from lookahead_serve.deploy.ray_app import SERVICER_FUNCTION, build_app

    with pytest.MonkeyPatch.context() as mp:
        for name, value in RAY_ENV.items():
            mp.setenv(name, value)
        metrics_port = _free_port()
        ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", _metrics_export_port=metrics_port,
                 runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    channel = None
    try:
        grpc_port = _free_port()
        http_port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": http_port},
                    grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=[SERVICER_FUNCTION]))
        _wait_until(_proxies_healthy, "the Serve proxy healthy")
        app = build_app({"model": tiny_llama_chat, "num_replicas": 2, "num_cpus": 1, "served_model_name": "tiny",
                         "engine_args": {"num_kv_blocks": 64, "block_size": 8}})
        _run_bounded(lambda: serve.run(app, name="lookahead", route_prefix="/lookahead"),
                     "the application RUNNING with 2 replicas")
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        grpc.channel_ready_future(channel).result(timeout=CALL_TIMEOUT_S)
        yield RayApp(pb_grpc.LookaheadServiceStub(channel), f"http://127.0.0.1:{http_port}/lookahead/v1",
                     f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        if channel is not None:
            channel.close()
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def expected(tiny_llama_chat) -> list[int]:
    """What the offline engine generates for PROMPT, greedy."""
    out = LLM(tiny_llama_chat).generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=12))
    return out[0].outputs[0].token_ids


def _request(ids: list[int]) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(temperature=0, max_tokens=12))


def test_two_replicas_answer_through_the_grpc_proxy(ray_serve_app, expected):
    stub = ray_serve_app.stub
    for _ in range(6):  # several calls, which Ray's router spreads over both replicas
        chunks = list(stub.Generate(_request(PROMPT), timeout=CALL_TIMEOUT_S))
        assert [t for c in chunks for t in c.token_ids] == expected
        assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 12
    unary = stub.GenerateUnary(_request(PROMPT), timeout=CALL_TIMEOUT_S)
    assert list(unary.token_ids) == expected and unary.finish_reason == "length"
    assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=CALL_TIMEOUT_S).model == "tiny"
    deployment = serve.status().applications["lookahead"].deployments["LookaheadDeployment"]
    assert deployment.replica_states.get("RUNNING") == 2


def test_bad_input_keeps_its_status_through_the_proxy(ray_serve_app):
    stub = ray_serve_app.stub
    for rpc in (stub.GenerateUnary, lambda r, timeout: list(stub.Generate(r, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as err:
            rpc(_request([]), timeout=CALL_TIMEOUT_S)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert "empty" in err.value.details()


def _openai(app: RayApp) -> openai.OpenAI:
    return openai.OpenAI(base_url=app.openai_url, api_key="unused", max_retries=0, timeout=CALL_TIMEOUT_S)


def test_openai_client_through_the_http_proxy(ray_serve_app):
    client = _openai(ray_serve_app)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    request = pb.GenerateRequest(sampling=pb.SamplingParams(temperature=0, max_tokens=16))
    request.chat.messages.add(role="user", content=MESSAGES[0]["content"])
    expected = ray_serve_app.stub.GenerateUnary(request, timeout=CALL_TIMEOUT_S).text
    for _ in range(3):  # spread over both replicas
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=16)
        assert r.choices[0].message.content == expected and r.usage.completion_tokens == 16
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=16, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected
    text = client.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=4).choices[0].text
    assert isinstance(text, str)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=-1, max_tokens=4)
    assert "temperature" in err.value.message


def _ray_metrics(url: str) -> dict[str, float]:
    """Ray's export, summed over replicas (label sets) per name and model_name="tiny"."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("ray_lookahead_") and 'model_name="tiny"' in line:
            name, _, value = line.rpartition(" ")
            key = name.partition("{")[0]
            totals[key] = totals.get(key, 0.0) + float(value)
    return totals


def test_cancel_through_the_http_proxy_frees_the_kv_blocks_and_metrics_reach_ray(ray_serve_app):
    client = _openai(ray_serve_app)
    stream = client.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=480, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks), next(chunks)
    stream.close()
    seen: dict[str, float] = {}

    def settled() -> bool:  # the replicas' pushes (every second) show every request done and no block in use
        seen.update(_ray_metrics(ray_serve_app.metrics_url))
        return (seen.get("ray_lookahead_generation_tokens_total", 0) > 0
                and seen.get("ray_lookahead_num_requests_running", 1) == 0
                and seen.get("ray_lookahead_kv_cache_usage_perc", 1) == 0)

    _wait_until(settled, "the cancelled request freed in Ray's metrics", 60)
    assert seen["ray_lookahead_request_success_total"] >= 6  # the earlier tests' finished requests
    assert seen["ray_lookahead_e2e_request_latency_seconds_count"] >= 6
    # Ray exports a counter from its first increment on: no lookahead draft yet (the adaptive policy may have
    # decoded plainly) leaves both draft counters absent, i.e. zero
    drafts = [seen.get(f"ray_lookahead_spec_decode_num_{n}_tokens_total", 0.0) for n in ("accepted", "draft")]
    assert drafts[0] <= drafts[1]


def test_a_stopping_replica_lets_its_live_stream_finish(ray_serve_app):
    """Runs last: it deletes the application. Ray Serve stops both replicas, each waits for its ongoing
    streams (deploy/ray_app.py), so a stream that is live when the deletion starts still ends normally."""
    stub = ray_serve_app.stub
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT), sampling=pb.SamplingParams(
        temperature=0, max_tokens=480, ignore_eos=True))
    arrivals: list[tuple[float, pb.GenerateResponse]] = []
    stream = stub.Generate(request, timeout=CALL_TIMEOUT_S)
    arrivals.append((time.monotonic(), next(stream)))
    pool = ThreadPoolExecutor(2, thread_name_prefix="drain")
    reading = pool.submit(lambda: arrivals.extend((time.monotonic(), c) for c in stream))
    deleting = pool.submit(serve.delete, "lookahead")

    def stopping() -> bool:
        app = serve.status().applications.get("lookahead")
        return app is None or app.status == ApplicationStatus.DELETING

    _wait_until(stopping, "the application DELETING", 30)
    deleting_seen = time.monotonic()
    reading.result(timeout=CALL_TIMEOUT_S)
    deleting.result(timeout=CALL_TIMEOUT_S)
    pool.shutdown()
    assert arrivals[-1][1].finish_reason == "length"
    assert sum(len(c.token_ids) for _, c in arrivals) == 480
    assert arrivals[-1][0] > deleting_seen, "the stream ended before the replicas began to stop"
    assert "lookahead" not in serve.status().applications
