"""The OpenAI-compatible HTTP API through a real server on 127.0.0.1 and the official `openai` client,
beside the gRPC service on the same engine."""

from __future__ import annotations

import asyncio
import logging
import ssl
import threading
import time
from contextlib import contextmanager

import grpc
import httpx2 as httpx
import openai
import pytest

from lookahead_serve.engine import LLM
from lookahead_serve.engine.async_engine import AsyncLLMEngine
from lookahead_serve.proto.lookahead.v1 import lookahead_pb2 as pb
from lookahead_serve.proto.lookahead.v1 import lookahead_pb2_grpc as pb_grpc
from lookahead_serve.proto.server import start_server

MESSAGES = [{"role": "user", "content": "Write a haiku about the sea."}]
KEY = "sk-test-key"


@contextmanager
def http_server(llm: LLM, model_name: str, **server_options):
    """Serve gRPC and HTTP on free ports from a background event loop; yields (running, engine)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    engine = AsyncLLMEngine(llm.engine)
    running = asyncio.run_coroutine_threadsafe(
        start_server(engine, model_name, "127.0.0.1", 0, http_port=0, **server_options), loop).result(30)
    try:
        yield running, engine
    finally:
        running.core.accepting = False
        asyncio.run_coroutine_threadsafe(running.http.stop(), loop).result(30)
        asyncio.run_coroutine_threadsafe(running.server.stop(grace=1), loop).result(30)
        engine.shutdown()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@pytest.fixture(scope="module")
def server(tiny_llama_chat):
    llm = LLM(tiny_llama_chat, block_size=8, num_kv_blocks=256, max_model_len=512)
    with http_server(llm, "tiny") as (running, engine):
        yield running, engine


@pytest.fixture
def client(server):
    running, _ = server
    with openai.OpenAI(base_url=f"http://127.0.0.1:{running.http.port}/v1", api_key="unused", max_retries=0,
                       timeout=60) as c:
        yield c


def _grpc_chat_text(running, max_tokens: int) -> str:
    request = pb.GenerateRequest(sampling=pb.SamplingParams(temperature=0, max_tokens=max_tokens))
    for m in MESSAGES:
        request.chat.messages.add(role=m["role"], content=m["content"])
    with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        return pb_grpc.LookaheadServiceStub(channel).GenerateUnary(request, timeout=60).text


def _wait_idle(engine: AsyncLLMEngine, free_before: int) -> None:
    kv = engine.engine.kv_manager
    deadline = time.monotonic() + 10
    while (kv.num_free_blocks != free_before or engine.num_live_requests) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert kv.num_free_blocks == free_before and engine.num_live_requests == 0


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"] and models[0].max_model_len == 512


def test_chat_greedy_equals_the_grpc_answer(server, client):
    expected = _grpc_chat_text(server[0], 20)
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=20)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 20 and r.usage.total_tokens == r.usage.prompt_tokens + 20
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=20,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_completions_text_and_token_prompts(server, client):
    running, engine = server
    ids = engine.engine.tokenize("The sea is")[1]
    r = client.completions.create(model="tiny", prompt="The sea is", temperature=0, max_tokens=12)
    assert r.object == "text_completion" and r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 12
    by_ids = client.completions.create(model="tiny", prompt=ids, temperature=0, max_tokens=12)
    assert by_ids.choices[0].text == r.choices[0].text
    streamed = client.completions.create(model="tiny", prompt="The sea is", temperature=0, max_tokens=12, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text
    default = client.completions.create(model="tiny", prompt="The sea is", temperature=0,
                                     extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16  # OpenAI's default max_tokens for completions


def test_vllm_extra_fields_and_lookahead(server, client):
    base = dict(model="tiny", messages=MESSAGES, temperature=0, max_tokens=24)
    plain = client.chat.completions.create(**base, extra_body={"lookahead": "off"})
    for lookahead in ("5,3,5", [4, 3, 4]):  # lookahead never changes a greedy token
        r = client.chat.completions.create(**base, extra_body={"lookahead": lookahead})
        assert r.choices[0].message.content == plain.choices[0].message.content
    r = client.chat.completions.create(**base, extra_body={"top_k": 1, "min_tokens": 24, "ignore_eos": True, "seed": 7})
    assert r.usage.completion_tokens == 24
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]), sampling=pb.SamplingParams(
        temperature=0, max_tokens=3, ignore_eos=True))
    with grpc.insecure_channel(f"127.0.0.1:{server[0].port}") as channel:
        ids = list(pb_grpc.LookaheadServiceStub(channel).GenerateUnary(request, timeout=60).token_ids)
    r = client.completions.create(model="tiny", prompt=[5, 6, 7], temperature=0, max_tokens=30,
                                  extra_body={"stop_token_ids": [ids[1]], "ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == ids.index(ids[1]) + 1


@pytest.mark.parametrize("kwargs, needle", [
    ({"temperature": -1}, "temperature"),
    ({"max_tokens": 100_000}, "max_model_len"),
    ({"n": 2}, "n"),
    ({"extra_body": {"lookahead": "1,2"}}, "lookahead"),
    ({"extra_body": {"top_k": -5}}, "top_k"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "image_url"),
])
def test_bad_input_is_a_400(client, kwargs, needle):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**body)
    assert err.value.status_code == 400 and needle in err.value.message


def test_errors_are_openai_shaped(server, client):
    running, _ = server
    url = f"http://127.0.0.1:{running.http.port}/v1"
    r = httpx.post(f"{url}/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    r = httpx.post(f"{url}/completions", json={"model": "tiny", "max_tokens": 4})  # no prompt
    assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=MESSAGES, max_tokens=4)


def test_cancel_mid_stream_frees_every_block(server, client):
    _, engine = server
    free_before = engine.engine.kv_manager.num_free_blocks
    stream = client.completions.create(model="tiny", prompt="The sea", temperature=0, max_tokens=400, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks), next(chunks)
    assert engine.num_live_requests == 1
    stream.close()
    _wait_idle(engine, free_before)


def test_a_client_gone_before_the_answer_aborts_it(server):
    running, engine = server
    free_before = engine.engine.kv_manager.num_free_blocks
    body = {"model": "tiny", "prompt": "The sea", "max_tokens": 480, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"http://127.0.0.1:{running.http.port}/v1/completions", json=body, timeout=0.5)
    _wait_idle(engine, free_before)


def test_health_metrics_and_shutting_down(server, client):
    running, _ = server
    base = f"http://127.0.0.1:{running.http.port}"
    assert httpx.get(f"{base}/health").status_code == 200
    client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=4)
    metrics = httpx.get(f"{base}/metrics")
    assert metrics.status_code == 200
    values = {line.rpartition(" ")[0]: float(line.rpartition(" ")[2]) for line in metrics.text.splitlines()
              if line and not line.startswith("#")}
    assert values['lookahead:generation_tokens_total{model_name="tiny"}'] >= 4
    assert values['lookahead:request_success_total{finished_reason="length",model_name="tiny"}'] >= 1
    assert values['lookahead:num_requests_running{model_name="tiny"}'] == 0
    assert 'lookahead:spec_decode_num_draft_tokens_total{model_name="tiny"}' in values
    running.core.accepting = False
    try:
        assert httpx.get(f"{base}/health").status_code == 503
        with pytest.raises(openai.InternalServerError) as err:
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
        assert err.value.status_code == 503
    finally:
        running.core.accepting = True


def test_api_key_is_required(tiny_llama_chat):
    llm = LLM(tiny_llama_chat, block_size=8, num_kv_blocks=64, max_model_len=256)
    with http_server(llm, "tiny", api_key=KEY) as (running, _):
        base = f"http://127.0.0.1:{running.http.port}"
        for key, ok in (("wrong", False), (KEY, True)):
            c = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
            if ok:
                assert c.models.list().data[0].id == "tiny"
            else:
                with pytest.raises(openai.AuthenticationError):
                    c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
        r = httpx.get(f"{base}/v1/models")  # no key at all
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        assert httpx.get(f"{base}/health").status_code == 200  # open to load balancers


def test_tls_serves_https(tiny_llama_chat, tmp_path):
    from tests.e2e.test_server_lifecycle import _self_signed

    cert_pem, key_pem = _self_signed(tmp_path)
    llm = LLM(tiny_llama_chat, block_size=8, num_kv_blocks=64, max_model_len=256)
    with http_server(llm, "tiny", ssl_cert_pem=cert_pem, ssl_key_pem=key_pem) as (running, _):
        url = f"https://localhost:{running.http.port}/v1"
        trust = ssl.create_default_context(cafile=tmp_path / "cert.pem")
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0,
                           http_client=openai.DefaultHttpxClient(verify=trust)) as c:
            assert c.models.list().data[0].id == "tiny"
        with pytest.raises(httpx.TransportError):  # plain HTTP is not served beside it
            httpx.get(f"http://127.0.0.1:{running.http.port}/health", timeout=5)


def test_one_log_line_per_finished_request_without_its_text(client, caplog):
    caplog.set_level(logging.INFO, logger="lookahead_serve.requests")
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=8)
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "lookahead_serve.requests"]
    assert len(lines) == 1 and r.id in lines[0] and "8 output tokens" in lines[0] and "tokens/step" in lines[0]
    content = r.choices[0].message.content
    assert "haiku" not in lines[0] and (not content.strip() or content not in lines[0])
