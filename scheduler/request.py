"""A request's state as the scheduler sees it, and its lifecycle."""

from __future__ import annotations

import enum
import time
from collections import Counter
from dataclasses import dataclass, field

from lookahead_serve.scheduler.lookahead import LookaheadState
from lookahead_serve.scheduler.params import LookaheadParams
from lookahead_serve.scheduler.params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # a fault inside the engine while running this request (``Request.error`` says what)

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


def describe_error(e: BaseException) -> str:
    """What a client is told of a fault inside the engine that ended its request."""
    return f"internal error while running the request: {type(e).__name__}: {e}"


@dataclass(slots=True)
class RequestTiming:
    """time.monotonic() of a request's milestones, and the gaps between the steps that gave it tokens."""

    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    inter_token: list[float] = field(default_factory=list)  # seconds between token-giving steps, after the first

    def record_tokens(self, now: float) -> None:
        """A step gave the request tokens at ``now``."""
        if self.first_token is None:
            self.first_token = now
        else:
            self.inter_token.append(now - self.last_token)
        self.last_token = now


@dataclass(slots=True)
class DraftCounts:
    """Lookahead's drafts, counted as vLLM counts speculative decoding.

    A draft is a lookahead step that verified at least one candidate. ``num_draft_tokens`` adds each draft's
    candidate length (the most tokens it could accept beyond the first), ``num_accepted_tokens`` the tokens
    it accepted beyond the first; so the acceptance rate accepted / draft tokens is in [0, 1]. Example: a
    step verifying 5 candidates of 2 tokens that outputs 3 tokens adds 1 draft, 2 draft tokens, 2 accepted.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def add(self, candidate_len: int, num_sampled: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += candidate_len
        self.num_accepted_tokens += max(num_sampled - 1, 0)


class Request:
    """Tokens, progress and outcome of one request.

    ``num_computed_tokens`` counts the tokens whose keys and values are in the paged cache; the tokens
    still to run are ``all_token_ids[num_computed_tokens:]`` (a prefill chunk, or the last sampled token).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.error: str | None = None  # what failed, when status is FINISHED_ERROR
        self.num_preemptions = 0
        self.num_steps = 0  # forward passes that produced at least one output token
        self.timing = RequestTiming()
        self.lookahead: LookaheadState | None = None  # set by the scheduler when lookahead is on
        self.max_lookahead: LookaheadParams | None = None  # the most (W, N, G) it may run
        self.lookahead_step: LookaheadParams | None = None  # what its latest lookahead segment ran
        self.accepted_lengths: Counter[int] = Counter()  # tokens produced per lookahead step -> steps
        self.drafts = DraftCounts()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
