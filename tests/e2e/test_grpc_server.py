"""The gRPC service through a real server on 127.0.0.1 and the generated stub."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from lookahead_serve.engine import LLM, LookaheadParams, SamplingParams
from lookahead_serve.proto.convert import to_lookahead_proto
from lookahead_serve.proto.lookahead.v1 import lookahead_pb2 as pb
from tests.e2e.conftest import running_server

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50]


def _request(ids=PROMPT, max_tokens=16, lookahead=None, **sampling):
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(max_tokens=max_tokens, **sampling))
    if lookahead is not None:
        req.lookahead.CopyFrom(lookahead)
    return req


def _offline(server, ids, max_tokens, lookahead=None):
    """Greedy tokens from the served LLM directly. The server's engine loop steps the same engine from its
    own thread, so it is driven here under the async engine's lock."""
    _, _, engine, llm = server
    params = SamplingParams(temperature=0, max_tokens=max_tokens, lookahead=lookahead)
    with engine._locked():
        return llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids


def test_stream_and_unary_equal_offline(tiny_server):
    stub = tiny_server[0]
    expected = _offline(tiny_server, PROMPT, 24)
    chunks = list(stub.Generate(_request(max_tokens=24, temperature=0)))
    assert [t for c in chunks for t in c.token_ids] == expected
    assert chunks[-1].finish_reason == "length" and all(not c.finish_reason for c in chunks[:-1])
    assert chunks[-1].usage.completion_tokens == 24 and chunks[-1].usage.prompt_tokens == len(PROMPT)
    unary = stub.GenerateUnary(_request(max_tokens=24, temperature=0))
    assert list(unary.token_ids) == expected
    la = to_lookahead_proto((5, 3, 5))
    with_la = stub.GenerateUnary(_request(max_tokens=24, temperature=0, lookahead=la))
    assert list(with_la.token_ids) == expected
    assert with_la.usage.decoding_steps <= 24


def test_32_concurrent_streams_complete(tiny_server):
    stub, _, engine, _ = tiny_server
    prompts = [PROMPT[i % 7 :] + [i] for i in range(32)]
    expected = [_offline(tiny_server, p, 12) for p in prompts]

    def run(p):
        return [t for c in stub.Generate(_request(p, max_tokens=12, temperature=0)) for t in c.token_ids]

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(run, prompts))
    assert results == expected
    assert engine.num_live_requests == 0


def test_cancel_mid_stream_frees_every_block(tiny_server):
    stub, _, engine, _ = tiny_server
    kv = engine.engine.kv_manager
    free_before = kv.num_free_blocks
    call = stub.Generate(_request(max_tokens=400, temperature=0, ignore_eos=True))
    next(call)
    next(call)
    assert kv.num_free_blocks < free_before
    call.cancel()
    deadline = time.monotonic() + 10
    while (kv.num_free_blocks != free_before or engine.num_live_requests) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert kv.num_free_blocks == free_before and engine.num_live_requests == 0


def test_deadline_aborts_the_request(tiny_server):
    stub, _, engine, _ = tiny_server
    with pytest.raises(grpc.RpcError) as err:
        for _ in stub.Generate(_request(max_tokens=450, ignore_eos=True), timeout=0.3):
            pass
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 10
    while engine.num_live_requests and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.num_live_requests == 0


BAD = [
    ("empty token prompt", _request(ids=[]), "empty"),
    ("no prompt", pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=4)), "prompt"),
    ("empty text", pb.GenerateRequest(text=b""), "empty"),
    ("non-UTF-8 text", pb.GenerateRequest(text=b"\xff\xfe bad"), "UTF-8"),
    ("text without tokenizer", pb.GenerateRequest(text=b"hello"), "tokenizer"),
    ("prompt too long", _request(ids=[1] * 600), "max_model_len"),
    ("max_tokens 0", _request(max_tokens=0), "max_tokens"),
    ("max_tokens huge", _request(max_tokens=10**9), "max_tokens"),
    ("temperature < 0", _request(temperature=-0.5), "temperature"),
    ("top_p 0", _request(top_p=0.0), "top_p"),
    ("top_p > 1", _request(top_p=1.5), "top_p"),
    ("top_k < -1", _request(top_k=-2), "top_k"),
    ("token id outside vocab", _request(ids=[1, 96]), "prompt_token_ids"),
    ("negative token id", _request(ids=[-1]), "prompt_token_ids"),
    ("window above max", _request(lookahead=to_lookahead_proto((99, 3, 2))), "window_size"),
    ("ngram above max", _request(lookahead=to_lookahead_proto((4, 30, 2))), "ngram_size"),
    ("unknown model", pb.GenerateRequest(model="gpt-9", token_ids=pb.TokenIds(ids=[1])), "model"),
]


@pytest.mark.parametrize(("name", "request_msg", "field"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_invalid_argument(tiny_server, name, request_msg, field):
    stub, _, engine, _ = tiny_server
    for rpc in (stub.GenerateUnary, lambda r: list(stub.Generate(r))):
        with pytest.raises(grpc.RpcError) as err:
            rpc(request_msg)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert field in err.value.details()
    assert engine.num_live_requests == 0


def test_bad_input_does_not_disturb_requests_in_flight(tiny_server):
    stub = tiny_server[0]
    expected = _offline(tiny_server, PROMPT, 40)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("ids", list(stub.GenerateUnary(_request(max_tokens=40, temperature=0)).token_ids)))
    t.start()
    for _, request_msg, _ in BAD:
        with pytest.raises(grpc.RpcError):
            stub.GenerateUnary(request_msg)
    t.join(30)
    assert result["ids"] == expected


def test_full_queue_is_resource_exhausted(tiny_llama):
    llm = LLM(tiny_llama, block_size=8, num_kv_blocks=64)
    with running_server(llm, "tiny", max_live_requests=2) as (stub, _, engine):
        calls = [stub.Generate(_request(max_tokens=300, ignore_eos=True)) for _ in range(2)]
        for c in calls:
            next(c)
        with pytest.raises(grpc.RpcError) as err:
            stub.GenerateUnary(_request(max_tokens=4))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for c in calls:
            c.cancel()


def test_model_info_health_and_reflection(tiny_server):
    stub, channel, _, _ = tiny_server
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.model == "tiny" and info.max_model_len == 512 and info.vocab_size == 96
    assert info.max_lookahead.window_size == 16 and info.default_lookahead.enabled
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "lookahead.v1.LookaheadService"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    (resp,) = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in resp.list_services_response.service}
    assert {"lookahead.v1.LookaheadService", "grpc.health.v1.Health"} <= names
