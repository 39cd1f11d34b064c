"""Two replicas of a tiny model behind Ray Serve's gRPC proxy, on a local Ray cluster on loopback."""

from __future__ import annotations

import os
import socket
import time

import grpc
import pytest

if os.environ.get("LOOKAHEAD_RAY_TESTS") != "1":
    pytest.skip("Ray Serve test is opt-in while the deployment is in progress: set LOOKAHEAD_RAY_TESTS=1",
                allow_module_level=True)
ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402
from ray.serve.config import gRPCOptions  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from proto.lookahead.v1 import lookahead_pb2 as pb  # noqa: E402
from proto.lookahead.v1 import lookahead_pb2_grpc as pb_grpc  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_serve_app(tiny_llama):
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # Ray binds 127.0.0.1 only
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": root}},
             _node_ip_address="127.0.0.1")
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": _free_port()},
                grpc_options=gRPCOptions(port=port, grpc_servicer_functions=[
                    "proto.lookahead.v1.lookahead_pb2_grpc.add_LookaheadServiceServicer_to_server"]))
    from deploy.ray_app import build_app

    app = build_app({"model": tiny_llama, "num_replicas": 2, "num_cpus": 0.5, "served_model_name": "tiny",
                     "engine_args": {"num_kv_blocks": 64, "block_size": 8}})
    serve.run(app, name="lookahead", route_prefix="/lookahead")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield pb_grpc.LookaheadServiceStub(channel)
    channel.close()
    serve.shutdown()
    ray.shutdown()


def test_two_replicas_answer_through_the_grpc_proxy(ray_serve_app, tiny_llama):
    stub = ray_serve_app
    prompt = [3, 14, 15, 92, 65, 35, 89]
    expected = LLM(tiny_llama).generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12))
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(temperature=0, max_tokens=12))
    deadline = time.monotonic() + 60
    for _ in range(6):  # several calls, spread over both replicas
        chunks = list(stub.Generate(req, timeout=max(deadline - time.monotonic(), 1)))
        assert [t for c in chunks for t in c.token_ids] == expected[0].outputs[0].token_ids
        assert chunks[-1].finish_reason == "length"
    assert list(stub.GenerateUnary(req).token_ids) == expected[0].outputs[0].token_ids
    assert serve.status().applications["lookahead"].deployments["LookaheadDeployment"].replica_states.get("RUNNING") == 2


def test_bad_input_keeps_its_status_through_the_proxy(ray_serve_app):
    with pytest.raises(grpc.RpcError) as err:
        ray_serve_app.GenerateUnary(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[]), sampling=pb.SamplingParams(max_tokens=4)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "empty" in err.value.details()
