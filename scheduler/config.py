"""Scheduler limits, checked on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.params import LookaheadParams


@dataclass(frozen=True)
class LookaheadConfig:
    """Engine-wide lookahead: the default for requests that do not say, and the most any may ask for.

    The scheduler's own default is plain decoding; the engine (engine.config) turns lookahead on.
    """

    default: LookaheadParams = field(default_factory=lambda: LookaheadParams(enabled=False))
    max_window_size: int = 16
    max_ngram_size: int = 8
    max_verification_set_size: int = 16

    def __post_init__(self) -> None:
        for name in ("max_window_size", "max_ngram_size", "max_verification_set_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be a non-negative int, got {getattr(self, name)!r}")
        self.check(self.default)

    def check(self, params: LookaheadParams) -> None:
        """ValueError if ``params`` asks for more than the engine allows."""
        if params.is_plain:
            return
        for name, limit in (
            ("window_size", self.max_window_size),
            ("ngram_size", self.max_ngram_size),
            ("verification_set_size", self.max_verification_set_size),
        ):
            if getattr(params, name) > limit:
                raise ValueError(f"lookahead.{name} {getattr(params, name)} exceeds the server maximum {limit}")


@dataclass(frozen=True)
class SchedulerConfig:
    """max_num_batched_tokens: token budget of one step (prefill chunks and decodes together).
    max_num_seqs: most requests running at once. max_model_len: prompt + output length cap
    (None until the engine fills in the model's limit).
    """

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the engine fills in the model's limit
    lookahead: LookaheadConfig = field(default_factory=LookaheadConfig)
    # "fixed": every lookahead request runs its own (W, N, G) when the budget has room; "adaptive": each
    # step chooses (w, n, g) up to that per request, for the most accepted tokens per second (scheduler.policy)
    lookahead_policy: str = "fixed"
    # adaptive: every so many steps, one lookahead upgrade runs even if predicted not to pay (0 = never)
    lookahead_explore_every: int = 16
    # adaptive: a step runs lookahead only if its expected rate beats the all-plain step's by this share
    # (the step-time model's own error is about 5%: gains inside it are mostly the winner's curse)
    lookahead_min_gain: float = 0.05
    # adaptive: what a token is worth. "throughput": every output token alike, so each step maximises
    # expected tokens per second (the sum of the requests' latencies, to first order: a server's aim);
    # "makespan": while nothing waits, a token counts by the chance its request would finish last, so the
    # batch as a whole finishes soonest (an offline batch, whose caller waits for its last request)
    lookahead_objective: str = "throughput"

    def __post_init__(self) -> None:
        if self.lookahead_policy not in ("fixed", "adaptive"):
            raise ValueError(f"lookahead_policy must be 'fixed' or 'adaptive', got {self.lookahead_policy!r}")
        if self.lookahead_objective not in ("throughput", "makespan"):
            raise ValueError(f"lookahead_objective must be 'throughput' or 'makespan', got {self.lookahead_objective!r}")
        if not isinstance(self.lookahead_explore_every, int) or self.lookahead_explore_every < 0:
            raise ValueError(f"lookahead_explore_every must be a non-negative int, got {self.lookahead_explore_every!r}")
        if not isinstance(self.lookahead_min_gain, (int, float)) or not 0.0 <= self.lookahead_min_gain < 1.0:
            raise ValueError(f"lookahead_min_gain must be a number in [0, 1), got {self.lookahead_min_gain!r}")
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            if value is None and name == "max_model_len":
                continue
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
