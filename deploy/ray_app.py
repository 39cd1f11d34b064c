"""Ray Serve application: each replica holds an async engine; Ray Serve's gRPC proxy serves the same
`lookahead.v1.LookaheadService`, and its HTTP proxy the same OpenAI-compatible routes
(proto/openai_api.py, under the application's route prefix), so the same clients talk to one server or
to a Ray cluster. Each replica's metrics go out through Ray's metrics export (``ray_lookahead_*``, with
Ray's replica labels), as Ray Serve's own do.

    serve run deploy/serve_config.yaml          # or: make serve-ray

Keep Ray on loopback on a developer machine: set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before Ray starts.

A replica that is stopped (scale-down, redeploy, `serve shutdown`) drains like `lookahead-serve serve` on
SIGTERM. Ray Serve 2.60 (`ray/serve/_private/replica.py`, `_perform_graceful_shutdown`) stops routing to
it, waits until it has no ongoing request (checking every `graceful_shutdown_wait_loop_s`), then awaits
its `__del__`; the controller kills it `graceful_shutdown_timeout_s` after the stop began, whatever still
runs. So live streams get `SHUTDOWN_GRACE_S` to finish, then `__del__` closes the engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ray import serve
from ray.serve.grpc_util import RayServegRPCContext

from lookahead_serve.proto.lookahead.v1 import lookahead_pb2 as pb

logger = logging.getLogger(__name__)
SERVICER_FUNCTION = "lookahead_serve.proto.lookahead.v1.lookahead_pb2_grpc.add_LookaheadServiceServicer_to_server"
SHUTDOWN_GRACE_S = 30.0  # as `lookahead-serve serve --shutdown-grace`: what live streams get on a stop
DESTRUCTOR_S = 10.0  # on top of the grace: __del__ closing the engine, and Ray closing the replica's servers
METRICS_REFRESH_S = 1.0  # how often a replica pushes its engine's gauges and totals to Ray's metrics


@contextmanager
def _grpc_status(grpc_context: RayServegRPCContext) -> Iterator[None]:
    """Put a RequestError's status code and message on Ray's gRPC context, then re-raise it: Ray's proxy
    answers the call with that status (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...) instead of INTERNAL."""
    from lookahead_serve.proto.server import RequestError  # lazily: importing this module must not import torch

    try:
        yield
    except RequestError as e:
        grpc_context.set_code(e.code)
        grpc_context.set_details(e.details)
        raise


# max_ongoing_requests matches the engine's default max_num_seqs (64): a replica takes as many requests
# as its engine can run at once, and Ray's router sends the rest to another replica instead of queueing
# them inside this one's engine. A stopping replica checks every second whether its streams are done.
@serve.deployment(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=64, graceful_shutdown_wait_loop_s=1.0,
                  graceful_shutdown_timeout_s=SHUTDOWN_GRACE_S + DESTRUCTOR_S)
@serve.ingress()  # the HTTP app is built on each replica, around its engine: __serve_build_asgi_app__
class LookaheadDeployment:
    def __init__(self, model: str | None = None, served_model_name: str | None = None,
                 engine_args: dict[str, Any] | None = None, max_live_requests: int = 256) -> None:
        from lookahead_serve.engine import LLM
        from lookahead_serve.engine.async_engine import AsyncLLMEngine
        from lookahead_serve.engine.loader import default_served_name
        from lookahead_serve.proto.metrics import RayServerMetrics
        from lookahead_serve.proto.server import ServiceCore

        # A server's requests come and go: the adaptive lookahead policy values every token alike.
        llm = LLM(model, **{"lookahead_objective": "throughput", **(engine_args or {})})
        engine = AsyncLLMEngine(llm.engine, max_live_requests=max_live_requests)
        name = served_model_name or default_served_name(model)
        self.core = ServiceCore(engine, name, RayServerMetrics(llm.engine, name))
        self._refresher: asyncio.Task | None = None

    async def __serve_build_asgi_app__(self):
        """The OpenAI-compatible app over this replica's engine (no /metrics route: Ray exports them).
        Also starts pushing the engine's gauges and totals to Ray every METRICS_REFRESH_S."""
        from lookahead_serve.proto.openai_api import build_app

        self._refresher = asyncio.get_running_loop().create_task(self._refresh_metrics())
        return build_app(self.core)

    async def _refresh_metrics(self) -> None:
        while True:
            try:
                self.core.metrics.refresh()
            except Exception:  # a metrics fault must not end the pushes, nor touch a request
                logger.exception("refreshing the Ray metrics failed")
            await asyncio.sleep(METRICS_REFRESH_S)

    async def Generate(self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext):
        with _grpc_status(grpc_context):
            async for response in self.core.stream(request):
                yield response

    async def GenerateUnary(self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext):
        with _grpc_status(grpc_context):
            return await self.core.unary(request)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest) -> pb.ModelInfo:
        return self.core.model_info()

    async def __del__(self) -> None:
        """Ray Serve awaits this once the replica's streams are done: refuse new calls with UNAVAILABLE,
        give anything still in the engine a short drain, then end it with UNAVAILABLE too."""
        if getattr(self, "_refresher", None) is not None:
            self._refresher.cancel()
        core = getattr(self, "core", None)
        if core is not None:
            core.accepting = False
            await asyncio.to_thread(core.engine.shutdown, DESTRUCTOR_S / 2)


def build_app(args: dict[str, Any]) -> serve.Application:
    """Application builder for `serve run deploy.ray_app:build_app model=... num_replicas=...` and the YAML.
    ``shutdown_grace_s`` (default SHUTDOWN_GRACE_S) is how long a stopping replica's streams may run."""
    options: dict[str, Any] = {}
    if "num_replicas" in args:
        options["num_replicas"] = int(args["num_replicas"])
    if "num_cpus" in args:
        options["ray_actor_options"] = {"num_cpus": float(args["num_cpus"])}
    if "shutdown_grace_s" in args:
        options["graceful_shutdown_timeout_s"] = float(args["shutdown_grace_s"]) + DESTRUCTOR_S
    return LookaheadDeployment.options(**options).bind(
        model=args.get("model"),
        served_model_name=args.get("served_model_name"),
        engine_args=args.get("engine_args"),
        max_live_requests=int(args.get("max_live_requests", 256)),
    )
