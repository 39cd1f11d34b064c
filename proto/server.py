"""The gRPC server: LookaheadService over the async engine, plus standard health and reflection.

Bad input (ValueError anywhere on the way in) -> INVALID_ARGUMENT with the message naming the field;
too many live requests -> RESOURCE_EXHAUSTED; a cancelled call, a disconnected client or a passed
deadline aborts the request and frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from engine.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError
from proto.convert import to_lookahead_proto, to_prompt, to_response, to_sampling_params
from proto.lookahead.v1 import lookahead_pb2 as pb
from proto.lookahead.v1 import lookahead_pb2_grpc as pb_grpc
from proto.metrics import ServerMetrics

logger = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["LookaheadService"].full_name


class RequestError(Exception):
    """A request that ends with a non-OK status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details

    def __reduce__(self):  # pickled across Ray workers: rebuild from both fields, not from args alone
        return type(self), (self.code, self.details)


class ServiceCore:
    """The service's logic, shared by the standalone server and the Ray Serve deployment."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics

    async def outputs(self, request: pb.GenerateRequest):
        """RequestOutputs of one call; every failure raised as a RequestError with its status code."""
        eng = self.engine.engine
        try:
            if request.model and request.model != self.model_name:
                raise ValueError(f"model {request.model!r} is not served here; this server serves {self.model_name!r}")
            prompt = to_prompt(request, eng)
            params = to_sampling_params(request, eng.scheduler.config.max_model_len)
            async for out in self.engine.generate(prompt, params, request.request_id or None):
                if out.finished and self.metrics is not None:
                    self.metrics.observe_finished(out)
                yield out
        except ValueError as e:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        except QueueFullError as e:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        except EngineDeadError as e:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        except RuntimeError as e:
            raise RequestError(grpc.StatusCode.INTERNAL, str(e)) from None

    async def stream(self, request: pb.GenerateRequest):
        async for out in self.outputs(request):
            c = out.outputs[0]
            if c.delta_token_ids or c.delta_text or out.finished:
                yield to_response(out, c.delta_text, c.delta_token_ids)

    async def unary(self, request: pb.GenerateRequest) -> pb.GenerateResponse:
        last = None
        async for out in self.outputs(request):
            last = out
        return to_response(last, last.outputs[0].text, last.outputs[0].token_ids)

    def model_info(self) -> pb.ModelInfo:
        eng = self.engine.engine
        la = eng.scheduler.config.lookahead
        return pb.ModelInfo(
            model=self.model_name,
            max_model_len=eng.scheduler.config.max_model_len,
            vocab_size=eng.vocab_size,
            default_lookahead=to_lookahead_proto(la.default),
            max_lookahead=pb.LookaheadParams(
                enabled=True,
                window_size=la.max_window_size,
                ngram_size=la.max_ngram_size,
                verification_set_size=la.max_verification_set_size,
            ),
        )


class LookaheadServicer(pb_grpc.LookaheadServiceServicer):
    def __init__(self, core: ServiceCore) -> None:
        self.core = core

    async def Generate(self, request, context):
        try:
            async for response in self.core.stream(request):
                yield response
        except RequestError as e:
            await context.abort(e.code, e.details)

    async def GenerateUnary(self, request, context):
        try:
            return await self.core.unary(request)
        except RequestError as e:
            await context.abort(e.code, e.details)

    async def GetModelInfo(self, request, context):
        return self.core.model_info()


async def start_server(
    engine: AsyncLLMEngine, model_name: str, host: str = "127.0.0.1", port: int = 50051, metrics_port: int | None = None
) -> tuple[grpc.aio.Server, int]:
    """Start serving; returns the server and the port it bound (port 0 picks a free one)."""
    metrics = ServerMetrics(engine.engine)
    if metrics_port is not None:
        start_http_server(metrics_port, addr=host, registry=metrics.registry)
    server = grpc.aio.server()
    pb_grpc.add_LookaheadServiceServicer_to_server(LookaheadServicer(ServiceCore(engine, model_name, metrics)), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise ValueError(f"cannot bind {host}:{port}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound


async def serve_forever(engine: AsyncLLMEngine, model_name: str, host: str, port: int, metrics_port: int | None) -> None:
    server, bound = await start_server(engine, model_name, host, port, metrics_port)
    logger.info("serving %s on %s:%d", model_name, host, bound)
    print(f"lookahead-serve: serving {model_name} on {host}:{bound}"
          + (f", metrics on http://{host}:{metrics_port}/metrics" if metrics_port else ""), flush=True)
    try:
        await server.wait_for_termination()
    except asyncio.CancelledError:
        pass
    finally:
        await server.stop(grace=2)
        engine.shutdown(drain_timeout=0)
