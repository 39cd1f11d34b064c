"""The gRPC server: LookaheadService over the async engine, plus standard health and reflection.

Bad input (ValueError anywhere on the way in, or a message that does not parse) -> INVALID_ARGUMENT with
the message naming the field; too many live requests or a request over ``max_receive_message_bytes`` ->
RESOURCE_EXHAUSTED; a missing or wrong API key -> UNAUTHENTICATED; while shutting down -> UNAVAILABLE.
A cancelled call, a disconnected client or a passed deadline aborts the request and frees its KV blocks
at once.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import signal
import socket
import ssl
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from lookahead_serve.engine.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError
from lookahead_serve.engine.llm_engine import LLMEngine, PromptType
from lookahead_serve.engine.outputs import RequestOutput
from lookahead_serve.proto.convert import to_lookahead_proto, to_prompt, to_response, to_sampling_params
from lookahead_serve.proto.lookahead.v1 import lookahead_pb2 as pb
from lookahead_serve.proto.lookahead.v1 import lookahead_pb2_grpc as pb_grpc
from lookahead_serve.proto.metrics import ServerMetrics
from lookahead_serve.scheduler import SamplingParams

logger = logging.getLogger(__name__)
request_log = logging.getLogger("lookahead_serve.requests")  # one line per request: vLLM's request log
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["LookaheadService"].full_name
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024  # gRPC's own default; a 32k-token prompt is well under 1 MiB
STATUS_FLUSH_S = 5.0  # after a drain: time for the last statuses to reach their clients before the server closes


class RequestError(Exception):
    """A request that ends with a non-OK status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details

    def __reduce__(self):  # pickled across Ray workers: rebuild from both fields, not from args alone
        return type(self), (self.code, self.details)


class ServiceCore:
    """The service's logic, shared by the standalone server and the Ray Serve deployment.

    ``accepting`` turns False when a shutdown begins: new calls get UNAVAILABLE, live ones go on.
    """

    def __init__(self, engine: AsyncLLMEngine, model_name: str, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.accepting = True

    def check_accepting(self) -> None:
        if not self.accepting:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")

    async def run(self, build: Callable[[LLMEngine], tuple[PromptType, SamplingParams]],
                  request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """RequestOutputs of one request; every failure raised as a RequestError with its status code.
        ``build`` turns the call into a prompt and sampling params (a ValueError there is bad input)."""
        self.check_accepting()
        last = None
        try:
            prompt, params = build(self.engine.engine)
            async for last in self.engine.generate(prompt, params, request_id):
                if last.finished:
                    self._observe_finished(last)
                yield last
        except ValueError as e:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        except QueueFullError as e:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        except EngineDeadError as e:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        except RuntimeError as e:
            raise RequestError(grpc.StatusCode.INTERNAL, str(e)) from None
        finally:
            if last is not None and not last.finished:
                request_log.info("request %s ended early after %d tokens", last.request_id, last.num_generated_tokens)

    def _observe_finished(self, out: RequestOutput) -> None:
        """Metrics, and one log line per finished request (never its text)."""
        if self.metrics is not None:
            self.metrics.observe_finished(out)
        m = out.metrics
        latency = (m.finished_time - m.arrival_time) if m.finished_time is not None else 0.0
        ttft = m.time_to_first_token or 0.0
        request_log.info("request %s finished (%s): %d prompt + %d output tokens, %.2f tokens/step, %.3f s, "
                         "first token %.3f s", out.request_id, out.outputs[0].finish_reason, len(out.prompt_token_ids),
                         out.num_generated_tokens, m.tokens_per_step, latency, ttft)

    async def outputs(self, request: pb.GenerateRequest) -> AsyncIterator[RequestOutput]:
        """RequestOutputs of one gRPC call (see ``run``)."""

        def build(eng: LLMEngine) -> tuple[PromptType, SamplingParams]:
            if request.model and request.model != self.model_name:
                raise ValueError(f"model {request.model!r} is not served here; this server serves {self.model_name!r}")
            return to_prompt(request, eng), to_sampling_params(request, eng.model_info().max_model_len)

        async for out in self.run(build, request.request_id or None):
            yield out

    async def stream(self, request: pb.GenerateRequest):
        async for out in self.outputs(request):
            c = out.outputs[0]
            if c.delta_token_ids or c.delta_text or out.finished:
                yield to_response(out, c.delta_text, c.delta_token_ids)

    async def unary(self, request: pb.GenerateRequest) -> pb.GenerateResponse:
        last = await last_output(self.outputs(request))
        return to_response(last, last.outputs[0].text, last.outputs[0].token_ids)

    def model_info(self) -> pb.ModelInfo:
        self.check_accepting()
        info = self.engine.engine.model_info()
        la = info.lookahead
        return pb.ModelInfo(
            model=self.model_name,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            default_lookahead=to_lookahead_proto(la.default),
            max_lookahead=to_lookahead_proto((la.max_window_size, la.max_ngram_size, la.max_verification_set_size)),
        )


async def last_output(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    """A request's final output (the whole answer), once its stream ends."""
    last = None
    async for last in outputs:
        pass
    assert last is not None  # a stream ends with its finished output or raises
    return last


@dataclass(frozen=True, slots=True)
class UndecodableRequest:
    """Stands in for a request message that did not parse (``error`` says why)."""

    error: str


def _lenient(parse: Callable[[bytes], object]) -> Callable[[bytes], object]:
    """A request deserializer that never raises: gRPC answers a parse error with UNKNOWN, while the
    servicer answers the stand-in with INVALID_ARGUMENT."""

    def deserialize(data: bytes) -> object:
        try:
            return parse(data)
        except DecodeError as e:
            return UndecodableRequest(str(e))

    return deserialize


def _check_decoded(request: object) -> None:
    if isinstance(request, UndecodableRequest):
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"the request message does not parse: {request.error}")


class LookaheadServicer(pb_grpc.LookaheadServiceServicer):
    def __init__(self, core: ServiceCore) -> None:
        self.core = core

    async def Generate(self, request, context):
        try:
            _check_decoded(request)
            async for response in self.core.stream(request):
                yield response
        except RequestError as e:
            await context.abort(e.code, e.details)

    async def GenerateUnary(self, request, context):
        try:
            _check_decoded(request)
            return await self.core.unary(request)
        except RequestError as e:
            await context.abort(e.code, e.details)

    async def GetModelInfo(self, request, context):
        try:
            _check_decoded(request)
            return self.core.model_info()
        except RequestError as e:
            await context.abort(e.code, e.details)


def _add_servicer(servicer: LookaheadServicer, server: grpc.aio.Server) -> None:
    """Register the service as the generated ``add_LookaheadServiceServicer_to_server`` does, but with
    request deserializers that never raise."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, _lenient(pb.GenerateRequest.FromString), pb.GenerateResponse.SerializeToString),
        "GenerateUnary": grpc.unary_unary_rpc_method_handler(
            servicer.GenerateUnary, _lenient(pb.GenerateRequest.FromString), pb.GenerateResponse.SerializeToString),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetModelInfo, _lenient(pb.GetModelInfoRequest.FromString), pb.ModelInfo.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """LookaheadService calls need the metadata ``authorization: Bearer <key>``, else UNAUTHENTICATED.
    Health and reflection stay open: load balancers and grpcurl call them without a key."""

    def __init__(self, api_key: str) -> None:
        if not api_key:
            raise ValueError("api_key must not be empty")
        self._expected = f"Bearer {api_key}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if (handler is None or not handler_call_details.method.startswith(f"/{SERVICE_NAME}/")
                or self._authorized(handler_call_details.invocation_metadata)):
            return handler

        async def refuse(request, context):  # request stays raw bytes: nothing of it is parsed
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key "
                                "(send the metadata authorization: Bearer <key>)")

        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(refuse)
        return grpc.unary_unary_rpc_method_handler(refuse)

    def _authorized(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(given, self._expected)  # constant time: no timing oracle
        return False


@dataclass
class RunningServer:
    """A started server: the gRPC server, the port it bound, the service core and the health servicer."""

    server: grpc.aio.Server
    port: int
    core: ServiceCore
    health: health.aio.HealthServicer
    http: HttpServer | None = None  # the OpenAI-compatible HTTP API, when it was asked for

    async def shutdown(self, grace: float) -> None:
        """Drain, then stop: health NOT_SERVING and new LookaheadService calls UNAVAILABLE at once, live
        requests finish for up to ``grace`` s, the rest end with UNAVAILABLE, then the server closes."""
        self.core.accepting = False
        await self.health.enter_graceful_shutdown()
        await asyncio.to_thread(self.core.engine.shutdown, grace)  # blocks until drained or grace is up
        if self.http is not None:
            await self.http.stop()
        await self.server.stop(STATUS_FLUSH_S)  # lets the aborted calls send their UNAVAILABLE


class HttpServer:
    """uvicorn serving the OpenAI-compatible app in this event loop. The server's own signal handling
    (serve_forever) stays in charge: uvicorn's is turned off."""

    def __init__(self, app, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> None:
        import uvicorn

        class Server(uvicorn.Server):
            @contextmanager
            def capture_signals(self):
                yield

        tls = {} if ssl_context is None else {"ssl_context_factory": lambda config, default: ssl_context}
        self.server = Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                                            timeout_graceful_shutdown=STATUS_FLUSH_S, **tls))
        self.task: asyncio.Task | None = None
        self.host, self.port = host, port

    async def start(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:  # bound here, so a port in use is a clear error rather than uvicorn's exit
            sock.bind((self.host, self.port))
        except OSError as e:
            sock.close()
            raise ValueError(f"cannot serve HTTP on {self.host}:{self.port}: {e.strerror}") from None
        self.port = sock.getsockname()[1]
        self.task = asyncio.create_task(self.server.serve(sockets=[sock]))
        while not self.server.started and not self.task.done():
            await asyncio.sleep(0.01)

    @staticmethod
    def tls_context(cert_pem: bytes, key_pem: bytes) -> ssl.SSLContext:
        """A server TLS context from PEM bytes (the ones gRPC takes); OpenSSL loads them from files only."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        with tempfile.TemporaryDirectory() as folder:  # private to this user, removed at once
            cert, key = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
            for path, data in ((cert, cert_pem), (key, key_pem)):
                with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
                    f.write(data)
            context.load_cert_chain(cert, key)
        return context

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await self.task


async def start_server(
    engine: AsyncLLMEngine,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 50051,
    metrics_port: int | None = None,
    *,
    max_receive_message_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    api_key: str | None = None,
    ssl_cert_pem: bytes | None = None,
    ssl_key_pem: bytes | None = None,
    http_port: int | None = None,
) -> RunningServer:
    """Start serving (port 0 picks a free one). Larger request messages get RESOURCE_EXHAUSTED; with
    ``api_key`` LookaheadService calls need it; with a PEM certificate chain and key it serves TLS. With
    ``http_port`` the OpenAI-compatible HTTP API is served too (proto/openai_api.py), with the same API
    key and TLS."""
    if max_receive_message_bytes < 1:
        raise ValueError(f"max_receive_message_bytes must be positive, got {max_receive_message_bytes}")
    if (ssl_cert_pem is None) != (ssl_key_pem is None):
        raise ValueError("TLS needs both a certificate (ssl_cert_pem) and its private key (ssl_key_pem)")
    metrics = ServerMetrics(engine.engine, model_name)
    if metrics_port is not None:
        start_http_server(metrics_port, addr=host, registry=metrics.registry)
    server = grpc.aio.server(
        interceptors=[ApiKeyInterceptor(api_key)] if api_key is not None else None,
        options=[("grpc.max_receive_message_length", max_receive_message_bytes)],
    )
    core = ServiceCore(engine, model_name, metrics)
    _add_servicer(LookaheadServicer(core), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{host}:{port}"
    if ssl_cert_pem is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, grpc.ssl_server_credentials([(ssl_key_pem, ssl_cert_pem)]))
    if bound == 0:
        raise ValueError(f"cannot bind {address}")
    await server.start()
    http = None
    if http_port is not None:
        from lookahead_serve.proto.openai_api import build_app

        tls = None if ssl_cert_pem is None else HttpServer.tls_context(ssl_cert_pem, ssl_key_pem)
        http = HttpServer(build_app(core, api_key, metrics.registry), host, http_port, tls)
        try:
            await http.start()
        except BaseException:
            await server.stop(None)
            raise
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server, bound, core, health_servicer, http)


async def serve_forever(engine: AsyncLLMEngine, model_name: str, host: str, port: int, metrics_port: int | None,
                        *, shutdown_grace: float = 30.0, **server_options) -> None:
    """Serve until SIGTERM or SIGINT, then drain for up to ``shutdown_grace`` s (a second signal ends the
    drain at once: live requests get UNAVAILABLE) and return. ``server_options`` go to start_server."""
    running = await start_server(engine, model_name, host, port, metrics_port, **server_options)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    pending: set[asyncio.Task] = set()

    def on_signal(sig: signal.Signals) -> None:
        if not stop.is_set():
            print(f"lookahead-serve: {sig.name}: draining for up to {shutdown_grace:g} s", flush=True)
            stop.set()
        else:  # a second signal: fail the live requests now (concurrent shutdowns are safe)
            print(f"lookahead-serve: {sig.name}: ending live requests now", flush=True)
            task = loop.create_task(asyncio.to_thread(engine.shutdown, 0.0))
            pending.add(task)
            task.add_done_callback(pending.discard)

    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, on_signal, sig)
    tls = ", TLS" if server_options.get("ssl_cert_pem") else ""
    key = ", API key required" if server_options.get("api_key") else ""
    scheme = "https" if server_options.get("ssl_cert_pem") else "http"
    http = f", OpenAI API on {scheme}://{host}:{running.http.port}/v1" if running.http is not None else ""
    logger.info("serving %s on %s:%d%s%s%s", model_name, host, running.port, tls, key, http)
    print(f"lookahead-serve: serving {model_name} on {host}:{running.port}{tls}{key}{http}"
          + (f", metrics on http://{host}:{metrics_port}/metrics" if metrics_port else ""), flush=True)
    try:
        await stop.wait()
    finally:  # a cancelled serve_forever stops at once, without a drain
        await running.shutdown(shutdown_grace if stop.is_set() else 0.0)
        for sig in signals:
            loop.remove_signal_handler(sig)
    print("lookahead-serve: stopped", flush=True)
