"""What the engine returns per request (vLLM's shapes: RequestOutput with CompletionOutputs)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """A request's timing (time.monotonic() seconds) and counts so far, as vLLM's request stats.

    Queue: arrival -> first scheduled; prefill: first scheduled -> first token; decode: first -> last
    token; inference: first scheduled -> last token; end to end: arrival -> finished. The draft counts
    are lookahead's, as ``scheduler.request.DraftCounts`` defines them.
    """

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_steps: int  # forward passes that produced at least one output token
    num_output_tokens: int = 0
    num_preemptions: int = 0
    accepted_lengths: dict[int, int] = field(default_factory=dict)  # tokens per lookahead step -> steps
    pool_hits: int = 0  # lookahead steps that found candidates in the n-gram pool
    last_token_time: float | None = None
    num_drafts: int = 0  # lookahead steps that verified at least one candidate
    num_draft_tokens: int = 0  # the most tokens those steps could accept beyond the first
    num_accepted_tokens: int = 0  # the tokens they accepted beyond the first
    inter_token_latencies: list[float] = field(default_factory=list)  # between token-giving steps; final output only

    @property
    def tokens_per_step(self) -> float:
        """Output tokens per decoding step: the compression ratio (1.0 for plain decoding)."""
        return self.num_output_tokens / self.num_steps if self.num_steps else 0.0

    @property
    def time_to_first_token(self) -> float | None:
        return _between(self.arrival_time, self.first_token_time)

    @property
    def queue_time(self) -> float | None:
        return _between(self.arrival_time, self.first_scheduled_time)

    @property
    def prefill_time(self) -> float | None:
        return _between(self.first_scheduled_time, self.first_token_time)

    @property
    def decode_time(self) -> float | None:
        return _between(self.first_token_time, self.last_token_time)

    @property
    def inference_time(self) -> float | None:
        return _between(self.first_scheduled_time, self.last_token_time)

    @property
    def e2e_latency(self) -> float | None:
        return _between(self.arrival_time, self.finished_time)

    @property
    def time_per_output_token(self) -> float | None:
        """Decode time per output token after the first (None with fewer than two tokens)."""
        decode = self.decode_time
        return None if decode is None or self.num_output_tokens < 2 else decode / (self.num_output_tokens - 1)


def _between(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


@dataclass
class CompletionOutput:
    index: int
    text: str  # all text so far
    token_ids: list[int]  # all output token ids so far
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    delta_text: str = ""  # text added since the previous output for this request (streaming)
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None  # set when a fault inside the engine ended this request (finish_reason "error")

    @property
    def num_generated_tokens(self) -> int:
        return len(self.outputs[0].token_ids)

    @property
    def tokens_per_step(self) -> float:
        return self.metrics.tokens_per_step
