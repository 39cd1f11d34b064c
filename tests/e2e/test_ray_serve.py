"""Two replicas of a tiny model behind Ray Serve's gRPC proxy, on a local Ray cluster on loopback.

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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import grpc
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
}
STARTUP_TIMEOUT_S = 120.0
CALL_TIMEOUT_S = 60.0
PROMPT = [3, 14, 15, 92, 65, 35, 89]


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


@pytest.fixture(scope="module")
def ray_serve_app(tiny_llama):
    from lookahead_serve.deploy.ray_app import SERVICER_FUNCTION, build_app

    with pytest.MonkeyPatch.context() as mp:
        for name, value in RAY_ENV.items():
            mp.setenv(name, value)
        ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
                 runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    channel = None
    try:
        grpc_port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": _free_port()},
                    grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=[SERVICER_FUNCTION]))
        _wait_until(_proxies_healthy, "the Serve proxy healthy")
        app = build_app({"model": tiny_llama, "num_replicas": 2, "num_cpus": 1, "served_model_name": "tiny",
                         "engine_args": {"num_kv_blocks": 64, "block_size": 8}})
        _run_bounded(lambda: serve.run(app, name="lookahead", route_prefix="/lookahead"),
                     "the application RUNNING with 2 replicas")
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        grpc.channel_ready_future(channel).result(timeout=CALL_TIMEOUT_S)
        yield pb_grpc.LookaheadServiceStub(channel)
    finally:
        if channel is not None:
            channel.close()
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def expected(tiny_llama) -> list[int]:
    """What the offline engine generates for PROMPT, greedy."""
    out = LLM(tiny_llama).generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=12))
    return out[0].outputs[0].token_ids


def _request(ids: list[int]) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(temperature=0, max_tokens=12))


def test_two_replicas_answer_through_the_grpc_proxy(ray_serve_app, expected):
    stub = ray_serve_app
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
    stub = ray_serve_app
    for rpc in (stub.GenerateUnary, lambda r, timeout: list(stub.Generate(r, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as err:
            rpc(_request([]), timeout=CALL_TIMEOUT_S)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert "empty" in err.value.details()


def test_a_stopping_replica_lets_its_live_stream_finish(ray_serve_app):
    """Runs last: it deletes the application. Ray Serve stops both replicas, each waits for its ongoing
    streams (deploy/ray_app.py), so a stream that is live when the deletion starts still ends normally."""
    stub = ray_serve_app
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
