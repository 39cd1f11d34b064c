"""Fuzzing the live gRPC server: random GenerateRequests (every field, extreme values included) and raw
random bytes get OK or a client-side status (INVALID_ARGUMENT, RESOURCE_EXHAUSTED), never INTERNAL or
UNKNOWN; afterwards the server still answers a greedy request with the same tokens and holds no request
or KV block.

DEADLINE_EXCEEDED is a clean status too, but here no request can legitimately need DEADLINE_S (at most
MAX_MODEL_LEN tokens of a tiny model, well under a second), so one means a request hung: it fails the test.
Shrinking is off: every example is a call to a live server, and a hang costs DEADLINE_S per try."""

from __future__ import annotations

import math
import time

import grpc
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from lookahead_serve.engine import LLM
from lookahead_serve.proto.convert import to_lookahead_proto
from lookahead_serve.proto.lookahead.v1 import lookahead_pb2 as pb
from lookahead_serve.proto.lookahead.v1 import lookahead_pb2_grpc as pb_grpc
from tests.e2e.conftest import serving

MAX_MODEL_LEN = 64  # bounds the slowest valid request (64 decoding steps of a tiny model)
DEADLINE_S = 10.0
CLEAN = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                phases=[Phase.explicit, Phase.reuse, Phase.generate])
GENERATE = "/lookahead.v1.LookaheadService/Generate"
GENERATE_UNARY = "/lookahead.v1.LookaheadService/GenerateUnary"
REFERENCE = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[40, 41, 42, 43, 44]),
                               sampling=pb.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))

INT64_EDGES = [0, 1, -1, 2, MAX_MODEL_LEN - 1, MAX_MODEL_LEN, MAX_MODEL_LEN + 1, 257, 258, 2**31 - 1, 2**31,
               2**63 - 1, -(2**63)]
FLOAT_EDGES = [0.0, -0.0, 1.0, -1.0, math.nan, math.inf, -math.inf, 1e-300, 5e-324, 1e308, -1e308]
INT64 = st.one_of(st.sampled_from(INT64_EDGES), st.integers(-(2**63), 2**63 - 1))
FLOAT = st.one_of(st.sampled_from(FLOAT_EDGES), st.floats())
TEXT = st.text(max_size=24)


def _mostly(valid: st.SearchStrategy, wild: st.SearchStrategy) -> st.SearchStrategy:
    """``valid`` 15 times in 16, else ``wild``: with a dozen fields, about half the requests are valid."""
    return st.integers(0, 15).flatmap(lambda dice: wild if dice == 0 else valid)


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    """A GenerateRequest with every field of lookahead.proto chosen at random: each field mostly valid
    (small prompts, at most 8 tokens), sometimes extreme (NaN, inf, int64 edges, bad UTF-8, huge lists)."""
    request = pb.GenerateRequest(model=draw(_mostly(st.sampled_from(["", "tiny-chat"]), TEXT)), request_id=draw(TEXT))
    prompt = draw(_mostly(st.sampled_from(["text", "token_ids", "chat"]), st.sampled_from(["bytes", "none"])))
    if prompt == "text":
        request.text = draw(_mostly(st.text(min_size=1, max_size=12), TEXT)).encode()
    elif prompt == "bytes":
        request.text = draw(st.binary(max_size=32))
    elif prompt == "token_ids":
        ids = draw(_mostly(st.lists(st.integers(0, 257), min_size=1, max_size=40),
                           st.lists(INT64, max_size=MAX_MODEL_LEN + 2)))
        request.token_ids.CopyFrom(pb.TokenIds(ids=ids))
    elif prompt == "chat":
        roles = _mostly(st.sampled_from(["system", "user", "assistant"]), TEXT)
        for role, content in draw(st.lists(st.tuples(roles, st.text(max_size=8)), min_size=1, max_size=2)):
            request.chat.messages.add(role=role, content=content)
    s = request.sampling
    s.max_tokens = draw(_mostly(st.integers(1, 8), INT64))
    optional = {"temperature": _mostly(st.floats(0.0, 2.0), FLOAT),
                "top_p": _mostly(st.floats(0.0, 1.0, exclude_min=True), FLOAT),
                "top_k": _mostly(st.integers(-1, 300), INT64),
                "seed": INT64,  # every int64 is a valid seed
                "min_tokens": _mostly(st.integers(0, max(0, s.max_tokens)), INT64)}
    for name, values in optional.items():
        if draw(st.booleans()):
            setattr(s, name, draw(values))
    s.stop.extend(draw(_mostly(st.lists(st.text(min_size=1, max_size=4), max_size=3), st.lists(TEXT, max_size=100))))
    s.stop_token_ids.extend(draw(_mostly(st.lists(st.integers(0, 257), max_size=3), st.lists(INT64, max_size=100))))
    s.ignore_eos = draw(st.booleans())
    if draw(st.booleans()):
        window, ngram, verification = (draw(_mostly(st.integers(low, high), INT64))
                                       for low, high in ((0, 16), (2, 8), (0, 16)))
        request.lookahead.CopyFrom(to_lookahead_proto((window, ngram, verification), enabled=draw(st.booleans())))
    return request


@st.composite
def mangled_messages(draw) -> bytes:
    """A serialized GenerateRequest with a few bytes overwritten: mostly still parses, often oddly."""
    data = bytearray(draw(generate_requests()).SerializeToString())
    for _ in range(draw(st.integers(1, 4)) if data else 0):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data)


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama_chat):
    llm = LLM(tiny_llama_chat, block_size=8, num_kv_blocks=128, max_model_len=MAX_MODEL_LEN)
    with serving(llm, "tiny-chat", max_live_requests=8) as (port, engine), \
            grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield channel, engine


def _status(call, request) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as e:
        assert e.code() in CLEAN, f"{e.code().name}: {e.details()} for {request!r}"
        return e.code()
    return grpc.StatusCode.OK


def _assert_unharmed(channel: grpc.Channel, engine, expected: list[int], free_blocks: int) -> None:
    """Same greedy tokens as before; no live request and every KV block free once the last call ends."""
    stub = pb_grpc.LookaheadServiceStub(channel)
    assert list(stub.GenerateUnary(REFERENCE, timeout=DEADLINE_S).token_ids) == expected
    kv = engine.engine.kv_manager
    deadline = time.monotonic() + 10
    while (engine.num_live_requests or kv.num_free_blocks != free_blocks) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.num_live_requests == 0 and kv.num_free_blocks == free_blocks


def test_random_requests_get_clean_statuses(fuzz_server):
    channel, engine = fuzz_server
    stub = pb_grpc.LookaheadServiceStub(channel)
    expected = list(stub.GenerateUnary(REFERENCE, timeout=DEADLINE_S).token_ids)
    free_blocks = engine.engine.kv_manager.num_free_blocks

    @FUZZ
    @given(request=generate_requests(), streaming=st.booleans())
    def check(request: pb.GenerateRequest, streaming: bool) -> None:
        if streaming:
            _status(lambda: list(stub.Generate(request, timeout=DEADLINE_S)), request)
        else:
            _status(lambda: stub.GenerateUnary(request, timeout=DEADLINE_S), request)

    check()
    _assert_unharmed(channel, engine, expected, free_blocks)


def test_undecodable_bytes_are_invalid_argument(fuzz_server):
    channel, engine = fuzz_server
    unary = channel.unary_unary(GENERATE_UNARY)  # no serializers: raw bytes go out as they are
    stream = channel.unary_stream(GENERATE)
    for payload in (b"\xff\xff\xff", b"\x0a\x02\xff\xfe"):  # corrupt wire format; bad UTF-8 in `model`
        for call in (lambda: unary(payload, timeout=DEADLINE_S), lambda: list(stream(payload, timeout=DEADLINE_S))):
            assert _status(call, payload) == grpc.StatusCode.INVALID_ARGUMENT


def test_random_bytes_get_clean_statuses(fuzz_server):
    channel, engine = fuzz_server
    expected = list(pb_grpc.LookaheadServiceStub(channel).GenerateUnary(REFERENCE, timeout=DEADLINE_S).token_ids)
    free_blocks = engine.engine.kv_manager.num_free_blocks
    unary = channel.unary_unary(GENERATE_UNARY)
    stream = channel.unary_stream(GENERATE)
    model_info = channel.unary_unary("/lookahead.v1.LookaheadService/GetModelInfo")

    @FUZZ
    @given(payload=st.binary(max_size=256) | mangled_messages(), method=st.sampled_from(["unary", "stream", "info"]))
    def check(payload: bytes, method: str) -> None:
        calls = {"unary": lambda: unary(payload, timeout=DEADLINE_S),
                 "stream": lambda: list(stream(payload, timeout=DEADLINE_S)),
                 "info": lambda: model_info(payload, timeout=DEADLINE_S)}
        _status(calls[method], payload)

    check()
    _assert_unharmed(channel, engine, expected, free_blocks)
