"""Scheduler limits and lookahead settings: one home for each, with one default each, checked on
construction. Each field's ``help`` is what the CLI shows for its flag (``config_flags``)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from lookahead_serve.scheduler.params import LookaheadParams

# The default per-request lookahead (W, N, G): under the adaptive policy, the most any step runs for a
# request that does not choose; benchmarks/RESULTS.md ("Shipped defaults") has the measurement.
DEFAULT_LOOKAHEAD = LookaheadParams(window_size=5, ngram_size=3, verification_set_size=5)


def _help(text: str, choices: tuple[str, ...] | None = None, **kw):
    """A config field with its help text (and choices): what the CLI shows for its flag."""
    return field(metadata={"help": text, "choices": choices}, **kw)


@dataclass(frozen=True)
class LookaheadConfig:
    """Engine-wide lookahead: the default for requests that do not say, the most any may ask for, and how
    each step chooses what to run."""

    default: LookaheadParams = _help("lookahead (W,N,G) of requests that do not choose, or off",
                                     default=DEFAULT_LOOKAHEAD)
    max_window_size: int = _help("largest W a request may ask for", default=16)
    max_ngram_size: int = _help("largest N a request may ask for", default=8)
    max_verification_set_size: int = _help("largest G a request may ask for", default=16)
    policy: str = _help("adaptive: each step picks (w,n,g) up to each request's (W,N,G) from a step-cost model "
                        "(profiled once per machine, model, dtype and backend, and cached); fixed: every request "
                        "runs its (W,N,G) while the budget has room", choices=("adaptive", "fixed"), default="adaptive")
    objective: str = _help("what the adaptive policy maximises: throughput (tokens per second, every token alike) "
                           "or makespan (while nothing waits, the batch done soonest)", choices=("throughput", "makespan"),
                           default="throughput")
    explore_every: int = _help("adaptive: every so many steps one lookahead upgrade runs even if predicted not to "
                               "pay (0 = never)", default=16)
    min_gain: float = _help("adaptive: a step runs lookahead only if its expected rate beats the all-plain "
                            "step's by this share (the step-time model's error is about 5%)", default=0.05)

    def __post_init__(self) -> None:
        for name in ("max_window_size", "max_ngram_size", "max_verification_set_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be a non-negative int, got {getattr(self, name)!r}")
        if self.policy not in ("fixed", "adaptive"):
            raise ValueError(f"lookahead policy must be 'fixed' or 'adaptive', got {self.policy!r}")
        if self.objective not in ("throughput", "makespan"):
            raise ValueError(f"lookahead objective must be 'throughput' or 'makespan', got {self.objective!r}")
        if not isinstance(self.explore_every, int) or self.explore_every < 0:
            raise ValueError(f"lookahead explore_every must be a non-negative int, got {self.explore_every!r}")
        if not isinstance(self.min_gain, (int, float)) or not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"lookahead min_gain must be a number in [0, 1), got {self.min_gain!r}")
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
    max_num_batched_tokens: int = _help("token budget of one step (prefill chunks and decodes together)", default=512)
    max_num_seqs: int = _help("most requests running at once", default=64)
    max_model_len: int | None = _help("prompt + output token cap (default: the model's)", default=None)
    lookahead: LookaheadConfig = field(default_factory=LookaheadConfig)

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            if value is None and name == "max_model_len":
                continue
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")


def field_help(cls) -> dict[str, str]:
    """Each field of a config dataclass and its help text."""
    return {f.name: f.metadata.get("help", "") for f in fields(cls)}
