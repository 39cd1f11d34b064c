"""Proto messages <-> engine types. Every bad field becomes a ValueError that names it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lookahead_serve.proto.lookahead.v1 import lookahead_pb2 as pb
from lookahead_serve.scheduler import LookaheadParams, SamplingParams

if TYPE_CHECKING:  # importing engine loads torch: clients (CLI client, locust) import this module too
    from lookahead_serve.engine.llm_engine import LLMEngine, PromptType
    from lookahead_serve.engine.outputs import RequestOutput


def to_prompt(request: pb.GenerateRequest, engine: LLMEngine) -> PromptType:
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise ValueError("prompt: one of text, token_ids or chat is required")
    if kind == "text":
        try:
            text = request.text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"text is not valid UTF-8 ({e.reason} at byte {e.start})") from None
        if not text:
            raise ValueError("text: the prompt is empty")
        return text
    if kind == "token_ids":
        ids = list(request.token_ids.ids)
        if not ids:
            raise ValueError("token_ids: the prompt is empty")
        return {"prompt_token_ids": ids}
    messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
    if not messages:
        raise ValueError("chat: at least one message is required")
    if any(not m["role"] for m in messages):
        raise ValueError("chat: every message needs a role")
    return engine.chat_prompt(messages)


def to_sampling_params(request: pb.GenerateRequest, max_model_len: int) -> SamplingParams:
    s = request.sampling
    kwargs: dict = {}
    for name in ("temperature", "top_p", "top_k", "seed", "max_tokens", "min_tokens"):
        if s.HasField(name):
            kwargs[name] = getattr(s, name)
    if s.stop:
        kwargs["stop"] = list(s.stop)
    if s.stop_token_ids:
        kwargs["stop_token_ids"] = list(s.stop_token_ids)
    kwargs["ignore_eos"] = s.ignore_eos
    if request.HasField("lookahead"):
        la = request.lookahead
        kwargs["lookahead"] = (
            LookaheadParams(la.window_size, la.ngram_size, la.verification_set_size)
            if la.enabled
            else LookaheadParams(enabled=False)
        )
    return checked_sampling_params(kwargs, max_model_len)


def checked_sampling_params(kwargs: dict, max_model_len: int) -> SamplingParams:
    """SamplingParams(**kwargs), with the server's own limits: what gRPC and HTTP both check."""
    if kwargs.get("max_tokens") is not None and kwargs["max_tokens"] > max_model_len:
        raise ValueError(f"max_tokens {kwargs['max_tokens']} exceeds the server's max_model_len {max_model_len}")
    return SamplingParams(**kwargs)


def to_lookahead_proto(params: LookaheadParams | tuple[int, int, int] | None, *,
                       enabled: bool | None = None) -> pb.LookaheadParams:
    """The one builder of proto LookaheadParams. None: lookahead off. A LookaheadParams keeps its
    fields, enabled unless plain; a (w, n, g) tuple is sent as given, unchecked (the server checks it).
    ``enabled`` overrides the flag."""
    if params is None:
        return pb.LookaheadParams(enabled=bool(enabled))
    if isinstance(params, LookaheadParams):
        on, (w, n, g) = not params.is_plain, (params.window_size, params.ngram_size, params.verification_set_size)
    else:
        on, (w, n, g) = True, params
    return pb.LookaheadParams(enabled=on if enabled is None else enabled, window_size=w, ngram_size=n,
                              verification_set_size=g)


def to_response(out: RequestOutput, text: str, token_ids: list[int]) -> pb.GenerateResponse:
    completion = out.outputs[0]
    response = pb.GenerateResponse(request_id=out.request_id, text=text, token_ids=token_ids)
    if out.finished:
        response.finish_reason = completion.finish_reason or ""
        response.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=len(out.prompt_token_ids),
                completion_tokens=len(completion.token_ids),
                decoding_steps=out.metrics.num_steps,
                tokens_per_step=out.metrics.tokens_per_step,
            )
        )
    return response
