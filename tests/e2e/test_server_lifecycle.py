"""The server's edges: request-size limit, API key, TLS (in-process), and graceful shutdown of the real
`lookahead-serve serve` process on SIGTERM."""

from __future__ import annotations

import datetime
import ipaddress
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx2 as httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lookahead_serve.engine import LLM
from lookahead_serve.deploy.cli import main
from lookahead_serve.proto.lookahead.v1 import lookahead_pb2 as pb
from lookahead_serve.proto.lookahead.v1 import lookahead_pb2_grpc as pb_grpc
from tests.e2e.conftest import serving

ROOT = Path(__file__).resolve().parents[2]
SERVICE = "lookahead.v1.LookaheadService"
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PROMPT = [3, 14, 15, 92]
TIMEOUT_S = 30.0


def _request(max_tokens: int = 4, ids=PROMPT) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True))


@pytest.fixture
def tiny_llm(tiny_llama):
    """A fresh engine per test: each server numbers its requests from 1, and an engine must not see an id twice."""
    return LLM(tiny_llama, block_size=8, num_kv_blocks=128, max_model_len=512)


# --- request size ---------------------------------------------------------------------------------


def test_oversized_request_is_resource_exhausted(tiny_llm):
    with serving(tiny_llm, "tiny", max_receive_message_bytes=256) as (port, _), \
            grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.LookaheadServiceStub(channel)
        for rpc in (stub.GenerateUnary, lambda r, timeout: list(stub.Generate(r, timeout=timeout))):
            with pytest.raises(grpc.RpcError) as err:
                rpc(_request(ids=[90] * 300), timeout=TIMEOUT_S)  # a valid prompt, but 300 bytes of ids
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert stub.GenerateUnary(_request(), timeout=TIMEOUT_S).finish_reason == "length"


# --- API key and TLS ------------------------------------------------------------------------------


def _self_signed(tmp_path: Path) -> tuple[bytes, bytes]:
    """A certificate for localhost and 127.0.0.1 and its key, PEM."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    (tmp_path / "cert.pem").write_bytes(cert_pem)
    (tmp_path / "key.pem").write_bytes(key_pem)
    return cert_pem, key_pem


def _code(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_api_key_guards_the_service_but_not_health(tiny_llm):
    with serving(tiny_llm, "tiny", api_key="s3cret") as (port, _), \
            grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.LookaheadServiceStub(channel)
        for metadata, expected in [(None, grpc.StatusCode.UNAUTHENTICATED),
                                   ((("authorization", "Bearer wrong"),), grpc.StatusCode.UNAUTHENTICATED),
                                   ((("authorization", "s3cret"),), grpc.StatusCode.UNAUTHENTICATED),
                                   ((("authorization", "Bearer s3cret"),), grpc.StatusCode.OK)]:
            for rpc in (lambda: stub.GenerateUnary(_request(), timeout=TIMEOUT_S, metadata=metadata),
                        lambda: list(stub.Generate(_request(), timeout=TIMEOUT_S, metadata=metadata)),
                        lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=TIMEOUT_S, metadata=metadata)):
                assert _code(rpc) == expected, metadata
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=TIMEOUT_S).status
        assert status == health_pb2.HealthCheckResponse.SERVING


def test_tls_with_the_certificate_as_root(tiny_llm, tmp_path):
    cert_pem, key_pem = _self_signed(tmp_path)
    with serving(tiny_llm, "tiny", ssl_cert_pem=cert_pem, ssl_key_pem=key_pem) as (port, _):
        credentials = grpc.ssl_channel_credentials(root_certificates=cert_pem)
        with grpc.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
            reply = pb_grpc.LookaheadServiceStub(channel).GenerateUnary(_request(), timeout=TIMEOUT_S)
            assert len(reply.token_ids) == 4
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            code = _code(lambda: pb_grpc.LookaheadServiceStub(channel).GenerateUnary(_request(), timeout=5))
            assert code == grpc.StatusCode.UNAVAILABLE


def test_client_command_with_key_and_tls(tiny_llama_chat, tmp_path):
    """The `client` subcommand talks to a server that wants a key over TLS."""
    cert_pem, key_pem = _self_signed(tmp_path)
    llm = LLM(tiny_llama_chat, block_size=8, num_kv_blocks=64)
    with serving(llm, "chat", api_key="k", ssl_cert_pem=cert_pem, ssl_key_pem=key_pem) as (port, _):
        argv = [sys.executable, "-m", "lookahead_serve.deploy.cli", "client", "hi", "--raw", "--max-tokens", "3",
                "--server", f"localhost:{port}", "--ssl-ca-certfile", str(tmp_path / "cert.pem")]
        env = {**os.environ, "LOOKAHEAD_API_KEY": "k"}
        ok = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
        assert ok.returncode == 0 and "tokens/s" in ok.stderr, ok.stderr


@pytest.mark.parametrize(("flags", "message"), [
    (["--ssl-certfile", "cert.pem"], "--ssl-keyfile"),
    (["--ssl-certfile", "/nonexistent.pem", "--ssl-keyfile", "/nonexistent.pem"], "cannot read"),
    (["--shutdown-grace", "-1"], "--shutdown-grace"),
    (["--max-request-bytes", "0"], "--max-request-bytes"),
])
def test_bad_serve_flags_fail_before_the_model_loads(flags, message, capsys):
    assert main(["serve", "--model", "/nonexistent", *flags]) == 2  # the model would fail with another message
    assert message in capsys.readouterr().err


# --- graceful shutdown of `lookahead-serve serve` -------------------------------------------------


class ServeProcess:
    """`lookahead-serve serve` on a free port; its output lines are collected on a thread."""

    def __init__(self, model: str, *flags: str) -> None:
        argv = [sys.executable, "-m", "lookahead_serve.deploy.cli", "serve", "--model", model, "--port", "0",
                "--http-port", "0", "--kv-cache-memory-gib", "0.01", "--served-model-name", "tiny", *flags]
        self.proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        ports = self.wait_for(r"serving tiny on 127\.0\.0\.1:(\d+).*OpenAI API on (http://127\.0\.0\.1:\d+)")
        self.port, self.http_url = int(ports.group(1)), ports.group(2)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = pb_grpc.LookaheadServiceStub(self.channel)

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)  # end of output

    def wait_for(self, pattern: str, timeout_s: float = 60.0) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                continue
            if line is None:
                break
            self.output.append(line)
            if match := re.search(pattern, line):
                return match
        raise AssertionError(f"no {pattern!r} from the server; output: {''.join(self.output)}")

    def health(self) -> int:
        stub = health_pb2_grpc.HealthStub(self.channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5).status

    def close(self) -> None:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def serve_process(tiny_llama):
    started: list[ServeProcess] = []

    def start(*flags: str) -> ServeProcess:
        started.append(ServeProcess(tiny_llama, *flags))
        return started[-1]

    yield start
    for p in started:
        p.close()


def _until_not_serving(server: ServeProcess) -> None:
    deadline = time.monotonic() + 10
    while server.health() != NOT_SERVING:
        assert time.monotonic() < deadline, "health never turned NOT_SERVING"
        time.sleep(0.02)


def test_sigterm_drains_live_streams_and_exits_0(serve_process):
    server = serve_process("--shutdown-grace", "20")
    stream = server.stub.Generate(_request(max_tokens=500), timeout=TIMEOUT_S)  # ~2 s of decoding
    first = next(stream)
    server.proc.send_signal(signal.SIGTERM)
    _until_not_serving(server)
    health = health_pb2_grpc.HealthStub(server.channel)
    assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == NOT_SERVING
    for rpc in (lambda: server.stub.GenerateUnary(_request(), timeout=5),
                lambda: list(server.stub.Generate(_request(), timeout=5)),
                lambda: server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)):
        assert _code(rpc) == grpc.StatusCode.UNAVAILABLE
    assert httpx.get(f"{server.http_url}/health", timeout=5).status_code == 503  # the HTTP API drains alike
    r = httpx.post(f"{server.http_url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=5)
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
    rest = list(stream)  # the live stream runs to its end
    assert rest[-1].finish_reason == "length"
    assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == 500
    assert server.proc.wait(TIMEOUT_S) == 0
    server.wait_for("stopped")


def test_streams_past_the_grace_end_with_unavailable(serve_process):
    server = serve_process("--shutdown-grace", "0.2")
    stream = server.stub.Generate(_request(max_tokens=500), timeout=TIMEOUT_S)  # ~2 s of decoding
    next(stream)
    server.proc.send_signal(signal.SIGINT)
    with pytest.raises(grpc.RpcError) as err:
        list(stream)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    assert server.proc.wait(TIMEOUT_S) == 0
