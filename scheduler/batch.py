"""The contract types between scheduler, model runner and engine: one per step in each direction, and the
step's record (``StepStats``).

Only ints, floats, strings and lists cross, so the same contract works in-process and across workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lookahead_serve.scheduler.lookahead import LookaheadLayout
from lookahead_serve.scheduler.params import LookaheadParams


@dataclass(slots=True)
class ScheduledRequest:
    """One request's ragged segment of the packed batch."""

    req_id: str
    token_ids: list[int]  # tokens to run this step: a prefill chunk, or the last sampled token
    start_pos: int  # position of token_ids[0] = tokens already in the cache
    block_ids: list[int]  # the request's whole block table
    sample: bool  # the segment ends at the newest token, so its last logits give the next token
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    lookahead: LookaheadLayout | None = None  # set for a lookahead step: token_ids follow this layout


@dataclass(frozen=True, slots=True)
class StepStats:
    """One step's record: its shape and predicted seconds when scheduled; the engine adds the observed
    seconds (``dataclasses.replace``) and hands it back through ``Scheduler.update_from_output``."""

    num_tokens: int
    num_segments: int  # segments of several tokens (prefill chunks, lookahead segments)
    num_decodes: int  # plain decodes
    predicted_seconds: float | None = None  # None without a step-cost model
    plain_seconds: float | None = None  # the same step with every request decoding plainly, predicted
    num_sampling: int = 0  # segments that sample a token
    lookahead: tuple[LookaheadParams, ...] = ()  # the (w, n, g) each lookahead segment runs
    explored: bool = False  # the adaptive policy's exploration chose this step
    adaptive: bool = False  # the adaptive policy chose it
    cost_scale: float = 1.0  # the lookahead cost check's scale the policy planned with
    seconds: float | None = None  # observed, filled in by the engine


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    preempted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)  # since the last step: drop runner state
    stats: StepStats | None = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class ModelRunnerOutput:
    req_ids: list[str]
    # Per scheduled request; empty for a prefill chunk that samples nothing. For a lookahead step: the
    # accepted tokens (matched candidate tokens, then the bonus token), whose first len - 1 inputs were
    # committed to the cache together with x.
    sampled_token_ids: list[list[int]]
    # Per scheduled request: for a lookahead step the model's argmax at the newest window level, else [].
    lookahead_outputs: list[list[int]] | None = None
    # Requests whose part of the step raised (sampling, verification, committing, or the forward pass
    # when run alone), with what was raised: they end with an error, the rest of the step stands.
    failed: dict[str, str] = field(default_factory=dict)
