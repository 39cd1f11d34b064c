"""The OpenAI-compatible HTTP API (FastAPI) over the same ServiceCore as gRPC: one engine, one check of
every request, one set of metrics.

Routes: ``POST /v1/chat/completions`` and ``/v1/completions`` (server-sent events with ``stream``),
``GET /v1/models``, ``/health`` and ``/metrics``. Beside OpenAI's fields a body may carry vLLM's
``top_k``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens`` and
``include_stop_str_in_output``, and ``lookahead``: "W,N,G", [W, N, G] or "off".

Status codes as OpenAI and vLLM use them: 400 bad input (the gRPC server's INVALID_ARGUMENT), 401 a missing
or wrong API key, 404 a model not served here, 429 too many live requests, 503 while shutting down, 500 an
engine fault; the body is ``{"error": {"message", "type", "param", "code"}}``. A client that disconnects
aborts its request, streaming or not, which frees its KV blocks before the next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Literal

import grpc
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from lookahead_serve.engine.llm_engine import LLMEngine, PromptType
from lookahead_serve.engine.outputs import RequestOutput
from lookahead_serve.proto.convert import checked_sampling_params
from lookahead_serve.proto.server import RequestError, ServiceCore, last_output
from lookahead_serve.scheduler import LookaheadParams, SamplingParams

_HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
                grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
                grpc.StatusCode.UNAVAILABLE: 503}
_ERROR_TYPE = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 429: "RateLimitError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}


def _error_body(status: int, message: str) -> dict:
    return {"error": {"message": message, "type": _ERROR_TYPE.get(status, "APIError"), "param": None, "code": status}}


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse(_error_body(status, message), status_code=status)


def _status(e: RequestError) -> int:
    return _HTTP_STATUS.get(e.code, 500)


class _Body(BaseModel):
    """Fields both completion endpoints share: OpenAI's, then vLLM's extra sampling fields."""

    model_config = ConfigDict(extra="ignore")  # as vLLM: unknown fields are ignored
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    top_k: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    lookahead: str | list[int] | None = None

    def unsupported(self) -> list[str]:
        """Fields set to something this server does not do (a 400, never silently ignored)."""
        bad = [name for name, on in (("n", self.n != 1), ("presence_penalty", self.presence_penalty != 0),
                                     ("frequency_penalty", self.frequency_penalty != 0)) if on]
        return bad

    def sampling_params(self, max_model_len: int, default_max_tokens: int) -> SamplingParams:
        if bad := self.unsupported():
            raise ValueError(f"not supported by this server: {', '.join(bad)}")
        kwargs = {name: getattr(self, name) for name in ("temperature", "top_p", "top_k", "seed", "stop",
                                                          "stop_token_ids") if getattr(self, name) is not None}
        kwargs.update(max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
                      min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
                      skip_special_tokens=self.skip_special_tokens,
                      include_stop_str_in_output=self.include_stop_str_in_output)
        if self.lookahead is not None:
            kwargs["lookahead"] = (LookaheadParams.parse(self.lookahead) if isinstance(self.lookahead, str)
                                   else LookaheadParams.parse(",".join(map(str, self.lookahead))))
        return checked_sampling_params(kwargs, max_model_len)

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict] | None = None

    def text(self) -> str:
        """The content as text: a string, or the text parts of a list (other parts are not supported)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"messages: content parts of type {part.get('type')!r} are not supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatBody(_Body):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    tools: list | None = None

    def unsupported(self) -> list[str]:
        return super().unsupported() + [name for name, on in (("logprobs", self.logprobs), ("tools", bool(self.tools)))
                                        if on]


class CompletionBody(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        return super().unsupported() + [name for name, on in (
            ("echo", self.echo), ("logprobs", self.logprobs is not None), ("best_of", self.best_of not in (None, 1)),
            ("suffix", bool(self.suffix))) if on]

    def single_prompt(self) -> PromptType:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):  # a batch of prompts
            if len(p) != 1:
                raise ValueError("prompt: one prompt per request (send a batch as separate requests)")
            p = p[0]
        if isinstance(p, list):
            return {"prompt_token_ids": p}
        if not p:
            raise ValueError("prompt: the prompt is empty")
        return p


def _usage(out: RequestOutput) -> dict:
    n_prompt, n_out = len(out.prompt_token_ids), out.num_generated_tokens
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


async def _until_disconnected(request: Request, work: asyncio.Future) -> Response | None:
    """Wait for ``work`` unless the client disconnects first: then cancel it (aborting its request)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if work not in done:
        work.cancel()
        return None
    return work.result()


class OpenAIServer:
    """The routes over a ServiceCore; ``registry``: the Prometheus registry /metrics serves (None: no
    /metrics route, as under Ray Serve, whose replicas export through Ray)."""

    def __init__(self, core: ServiceCore, api_key: str | None = None, registry=None) -> None:
        self.core = core
        self._expected = f"Bearer {api_key}".encode() if api_key else None
        self.registry = registry

    def app(self) -> FastAPI:
        app = FastAPI(title="lookahead-serve", docs_url=None, redoc_url=None)
        auth = [Depends(self._authorize)]
        app.post("/v1/chat/completions", dependencies=auth)(self.chat_completions)
        app.post("/v1/completions", dependencies=auth)(self.completions)
        app.get("/v1/models", dependencies=auth)(self.models)
        app.get("/health")(self.health)
        if self.registry is not None:
            app.get("/metrics")(self.metrics)
        app.add_exception_handler(RequestError, lambda _, e: error_response(_status(e), e.details))
        app.add_exception_handler(RequestValidationError, lambda _, e: error_response(400, _validation_message(e)))
        return app

    def _authorize(self, request: Request) -> None:
        if self._expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, self._expected):
            raise RequestError(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key "
                               "(send the header Authorization: Bearer <key>)")

    def _check_model(self, model: str | None) -> None:
        if model and model != self.core.model_name:
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"The model `{model}` does not exist; this server serves "
                               f"`{self.core.model_name}`")

    async def health(self) -> Response:
        if not self.core.accepting:
            return error_response(503, "the server is shutting down")
        return Response(status_code=200)

    async def metrics(self) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self) -> dict:
        self.core.check_accepting()
        info = self.core.engine.engine.model_info()
        return {"object": "list", "data": [{"id": self.core.model_name, "object": "model", "created": 0,
                                            "owned_by": "lookahead-serve", "root": self.core.model_name,
                                            "max_model_len": info.max_model_len}]}

    async def chat_completions(self, body: ChatBody, request: Request) -> Response:
        def build(eng: LLMEngine) -> tuple[PromptType, SamplingParams]:
            if not body.messages:
                raise ValueError("messages: at least one message is required")
            prompt = eng.chat_prompt([{"role": m.role, "content": m.text()} for m in body.messages])
            max_len = eng.model_info().max_model_len
            if body.max_completion_tokens is not None and body.max_tokens is None:
                body.max_tokens = body.max_completion_tokens
            return prompt, body.sampling_params(max_len, default_max_tokens=max_len)

        return await self._respond(body, request, build, "chatcmpl", "chat.completion")

    async def completions(self, body: CompletionBody, request: Request) -> Response:
        def build(eng: LLMEngine) -> tuple[PromptType, SamplingParams]:
            prompt = body.single_prompt()
            return prompt, body.sampling_params(eng.model_info().max_model_len, default_max_tokens=16)  # OpenAI's

        return await self._respond(body, request, build, "cmpl", "text_completion")

    async def _respond(self, body: _Body, request: Request, build, prefix: str, kind: str) -> Response:
        self._check_model(body.model)
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        outputs = self.core.run(build, request_id)
        shape = _Shape(request_id, self.core.model_name, kind)
        if not body.stream:
            work = asyncio.ensure_future(last_output(outputs))
            last = await _until_disconnected(request, work)
            return Response(status_code=499) if last is None else JSONResponse(shape.whole(last))
        try:  # the first output comes after the request is checked and added: errors keep their status
            first = await outputs.__anext__()
        except BaseException:
            await outputs.aclose()
            raise
        return StreamingResponse(shape.stream(first, outputs, body.include_usage), media_type="text/event-stream")


def _validation_message(e: RequestValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts) or "the request body is not valid"


class _Shape:
    """OpenAI's response objects for one request: ``kind`` "chat.completion" or "text_completion"."""

    def __init__(self, request_id: str, model: str, kind: Literal["chat.completion", "text_completion"]) -> None:
        self.id, self.model, self.kind, self.created = request_id, model, kind, int(time.time())

    def _choice(self, text: str, finish_reason: str | None, first: bool = False) -> dict:
        if self.kind == "text_completion":
            return {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}

    def _object(self, choices: list[dict], stream: bool) -> dict:
        kind = self.kind + (".chunk" if stream and self.kind == "chat.completion" else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def whole(self, out: RequestOutput) -> dict:
        c = out.outputs[0]
        if self.kind == "text_completion":
            choice = {"index": 0, "text": c.text, "finish_reason": c.finish_reason, "logprobs": None}
        else:
            choice = {"index": 0, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason,
                      "logprobs": None}
        return {**self._object([choice], stream=False), "usage": _usage(out)}

    async def stream(self, out: RequestOutput, rest: AsyncIterator[RequestOutput], include_usage: bool):
        """Server-sent events: one chunk per output with new text, the finish reason on the last, a usage
        chunk if asked, then ``[DONE]``. An error after the first chunk is sent as an error event."""
        first = self.kind == "chat.completion"
        try:
            while True:
                c = out.outputs[0]
                if c.delta_text or out.finished or first:
                    yield _sse(self._object([self._choice(c.delta_text, c.finish_reason, first)], stream=True))
                    first = False
                if out.finished:
                    break
                out = await rest.__anext__()
            if include_usage:
                yield _sse({**self._object([], stream=True), "usage": _usage(out)})
        except RequestError as e:
            yield _sse(_error_body(_status(e), e.details))
        finally:
            await rest.aclose()  # a client gone mid-stream: the engine aborts the request
        yield "data: [DONE]\n\n"


def build_app(core: ServiceCore, api_key: str | None = None, registry=None) -> FastAPI:
    """The FastAPI app of ``core``; see OpenAIServer."""
    return OpenAIServer(core, api_key, registry).app()

