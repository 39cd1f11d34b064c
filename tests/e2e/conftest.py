"""A real gRPC server on 127.0.0.1 in a background event loop, and stubs to talk to it."""

from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager

import grpc
import pytest

from lookahead_serve.engine import LLM
from lookahead_serve.engine.async_engine import AsyncLLMEngine
from lookahead_serve.proto.lookahead.v1 import lookahead_pb2_grpc as pb_grpc
from lookahead_serve.proto.server import start_server


@contextmanager
def serving(llm: LLM, model_name: str, max_live_requests: int = 256, **server_options):
    """Serve ``llm`` on 127.0.0.1 (a free port) from a background event loop; yields (port, engine).
    ``server_options`` go to start_server (api_key, ssl_cert_pem, max_receive_message_bytes, ...)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    engine = AsyncLLMEngine(llm.engine, max_live_requests=max_live_requests)
    running = asyncio.run_coroutine_threadsafe(
        start_server(engine, model_name, "127.0.0.1", 0, **server_options), loop).result(30)
    try:
        yield running.port, engine
    finally:
        asyncio.run_coroutine_threadsafe(running.server.stop(grace=1), loop).result(30)
        engine.shutdown()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@contextmanager
def running_server(llm: LLM, model_name: str, max_live_requests: int = 256):
    """``serving`` plus a channel and stub to it; yields (stub, channel, engine)."""
    with serving(llm, model_name, max_live_requests) as (port, engine):
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        try:
            yield pb_grpc.LookaheadServiceStub(channel), channel, engine
        finally:
            channel.close()


@pytest.fixture(scope="module")
def tiny_server(tiny_llama):
    llm = LLM(tiny_llama, block_size=8, num_kv_blocks=256, max_num_batched_tokens=1024, max_model_len=512)
    with running_server(llm, "tiny", max_live_requests=40) as (stub, channel, engine):
        yield stub, channel, engine, llm
