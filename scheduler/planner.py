"""Lookahead planning: which decoding requests run a lookahead segment this step, and at what (w, n, g).

The scheduler places prefill chunks and plain decodes first; ``LookaheadPlanner.plan`` then turns chosen
plain decodes into lookahead segments from the budget left, and returns the step's ``StepStats`` (its
shape and predicted time). The engine runs the step, fills in the observed seconds and hands the record
back through ``Scheduler.update_from_output``, which calls ``observe``: the step-cost model, the lookahead
cost check and the policy's exploration learn from it, and each lookahead request's acceptance model from
its own result (``observe_request``). Requests without lookahead never reach this module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

from lookahead_serve.kv_cache import KVCacheManager
from lookahead_serve.scheduler.batch import ScheduledRequest, StepStats
from lookahead_serve.scheduler.config import LookaheadConfig
from lookahead_serve.scheduler.cost import StepCostModel
from lookahead_serve.scheduler.lookahead import LookaheadLayout, shape_after_resize
from lookahead_serve.scheduler.objective import EarlyStops, makespan_values
from lookahead_serve.scheduler.params import LookaheadParams
from lookahead_serve.scheduler.policy import (
    AcceptanceModel,
    AdaptivePolicy,
    Decision,
    FixedPolicy,
    LookaheadCostCheck,
    Option,
    ladder,
    planned_gain,
)
from lookahead_serve.scheduler.request import Request, RequestStatus


class Rung(NamedTuple):
    """One (w, n, g) a request could run this step, as far as its pool and window decide it."""

    params: LookaheadParams
    num_tokens: int  # the segment's tokens
    gain: float  # the prior's expected extra tokens
    reach: int  # positions past the request's last token the segment reaches


@functools.lru_cache(maxsize=1024)
def _ngram_sizes(maximum: LookaheadParams) -> tuple[int, ...]:
    """The n-gram sizes of the rungs of ``maximum``'s ladder, in ladder order."""
    return tuple(dict.fromkeys(p.ngram_size for p in ladder(maximum)))


@functools.lru_cache(maxsize=8192)
def rungs(maximum: LookaheadParams, found: tuple[int, ...], num_levels: int) -> tuple[Rung, ...]:
    """A request's rungs given the candidates its pool holds for each of ``_ngram_sizes(maximum)``
    (``found``) and the levels its window has: all a rung depends on but the request's acceptance, so
    requests in the same state share the table."""
    num_found = dict(zip(_ngram_sizes(maximum), found, strict=True))
    seen_verify: set[LookaheadParams] = set()
    out = []
    for p in ladder(maximum):
        n = p.ngram_size
        if p.verify_only:
            if not num_found[n]:
                continue  # nothing to verify: the step would be a plain decode
            # Verifying g candidates where the pool has fewer is verifying those it has: one option each.
            p = LookaheadParams(0, n, min(p.verification_set_size, num_found[n]))
            if p in seen_verify:
                continue
            seen_verify.add(p)
            reach, num_window = n - 1, 1
        else:
            levels, cols = shape_after_resize(num_levels, p.window_size, n)
            reach, num_window = max(levels + cols - 2, n - 1), levels * cols
        num_tokens = num_window + min(p.verification_set_size, num_found[n]) * (n - 1)
        out.append(Rung(p, num_tokens, planned_gain(p, num_found[n]), reach))
    return tuple(out)


SegmentFactory = Callable[[Request, int, "tuple[LookaheadLayout, list[int]] | None"], ScheduledRequest]


class LookaheadPlanner:
    """config: the engine's lookahead settings (policy, objective, exploration, minimum gain);
    max_model_len: no segment may reach past it; cost_model: the step-cost model (required by the
    adaptive policy; with either policy it learns from every observed step)."""

    def __init__(self, config: LookaheadConfig, max_model_len: int, cost_model: StepCostModel | None = None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.cost_model = cost_model
        self._acceptance: dict[str, AcceptanceModel] = {}
        # Every request's lookahead steps together, slowly discounted: where a new request's model starts.
        self._acceptance_all = AcceptanceModel(prior_weight=8.0, decay=0.999)
        # How many recent requests stopped before their length bound: how much a bound says (makespan).
        self.early_stops = EarlyStops()
        self.lookahead_cost = LookaheadCostCheck()  # what lookahead really adds to a step, over the model's figure
        self._adaptive: AdaptivePolicy | None = None
        self.set_policy(config.policy)

    def set_policy(self, name: str) -> None:
        """Switch between the "fixed" and "adaptive" policies from the next step on. The acceptance and
        step-cost models carry over, and so does the adaptive policy's exploration (how far it has backed
        off), as in a server that never switched; the config's explore interval and minimum gain are read
        again."""
        if name == "adaptive" and self.cost_model is None:
            raise ValueError("the adaptive lookahead policy needs a step-cost model")
        self.config = replace(self.config, policy=name)  # validates the name
        if name != "adaptive":
            self.policy: AdaptivePolicy | FixedPolicy = FixedPolicy()
            return
        policy = AdaptivePolicy(self.cost_model, self.config.explore_every, self.config.min_gain)
        if self._adaptive is not None:
            policy.continue_exploration(self._adaptive)
        self.policy = self._adaptive = policy

    def reconfigure(self, config: LookaheadConfig) -> None:
        """New settings from the next step on; the models and the exploration carry over (``set_policy``)."""
        self.config = config
        self.set_policy(config.policy)

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self._acceptance[req.request_id] = AcceptanceModel(self._acceptance_all.multiplier)

    def observe_request(self, req: Request, seg: ScheduledRequest, sampled: list[int]) -> None:
        """A lookahead request's part of a step: a lookahead segment's accepted tokens, or a plain decode."""
        if seg.lookahead is not None:
            found = seg.lookahead.num_candidates
            self._acceptance[req.request_id].observe(req.lookahead_step, len(sampled), found)
            self._acceptance_all.observe(req.lookahead_step, len(sampled), found)
        elif sampled:
            self._acceptance[req.request_id].observe(None, 1)

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            self.early_stops.observe(status == RequestStatus.FINISHED_STOPPED)
        self._acceptance.pop(req.request_id, None)

    # ---- one step ------------------------------------------------------------------------------
    def plan(self, scheduled: list[ScheduledRequest], budget: int, requests: dict[str, Request],
             running: list[Request], waiting: bool, kv: KVCacheManager, segment: SegmentFactory) -> StepStats:
        """Turn chosen plain decodes of ``scheduled`` into lookahead segments in place (``segment`` builds
        one), within ``budget`` extra tokens and the KV blocks free now; return the step as it will run."""
        num_tokens = sum(len(seg.token_ids) for seg in scheduled)
        num_segments = sum(len(seg.token_ids) > 1 for seg in scheduled)
        num_decodes = sum(len(seg.token_ids) == 1 for seg in scheduled)
        values = self._token_values(num_tokens, num_segments, num_decodes, running, waiting)
        num_yield = 0.0
        cands: list[tuple[int, Request, list[Option]]] = []
        for k, seg in enumerate(scheduled):
            value = values.get(seg.req_id, 1.0) if values else 1.0
            num_yield += seg.sample * value
            req = requests[seg.req_id]
            if len(seg.token_ids) == 1 and seg.sample and req.lookahead is not None:
                opts = self._options(req, value)
                if opts:
                    cands.append((k, req, opts))
        plain = self._predict(num_tokens, num_segments, num_decodes)
        stats = StepStats(num_tokens, num_segments, num_decodes, plain, plain_seconds=plain,
                          num_sampling=sum(seg.sample for seg in scheduled))
        if not cands:
            return stats
        scale = self.lookahead_cost.scale
        decision = self.policy.choose([c[2] for c in cands], num_tokens, num_segments, num_yield, budget, num_decodes,
                                      cost_scale=scale)
        ran: list[LookaheadParams] = []
        added = 0
        for (k, req, opts), choice in zip(cands, decision.choices, strict=True):
            if choice is None:
                continue
            params = opts[choice].params
            state = req.lookahead
            assert state is not None
            x = req.all_token_ids[-1]
            if params.verify_only:  # the window, if any, waits for the next step that runs it
                layout, tokens = state.plan_verify(x, params.ngram_size, params.verification_set_size)
            else:
                state.resize(params.window_size, params.ngram_size)
                layout, tokens = state.plan(x, params.verification_set_size)
            # A lookahead step commits x plus at most candidate_len accepted tokens; plain if blocks are short.
            reserve = 1 + layout.candidate_len if layout.num_candidates else 1
            if kv.allocate_slots(req.request_id, req.num_computed_tokens + reserve) is None:
                continue  # decodes plainly after all
            scheduled[k] = segment(req, 1, (layout, tokens))
            req.lookahead_step = params
            ran.append(params)
            added += layout.num_tokens - 1
        n = len(ran)
        return replace(
            stats, num_tokens=num_tokens + added, num_segments=num_segments + n, num_decodes=num_decodes - n,
            predicted_seconds=self._predict(num_tokens + added, num_segments + n, num_decodes - n),
            lookahead=tuple(ran), explored=decision.explored, adaptive=decision.adaptive, cost_scale=scale)

    def observe(self, stats: StepStats, num_produced: int) -> None:
        """The step ``stats`` describes ran in ``stats.seconds`` and produced ``num_produced`` tokens."""
        if self.cost_model is None or stats.seconds is None:
            return
        predicted = self.cost_model.observe(stats.num_tokens, stats.num_segments, stats.seconds, stats.num_decodes)
        # The check corrects the adaptive policy's own picks; a frozen model stays as it is.
        if stats.lookahead and stats.adaptive and self.cost_model.learning_rate > 0:
            self.lookahead_cost.observe(stats.seconds, predicted, stats.plain_seconds)
        if stats.explored and stats.lookahead and isinstance(self.policy, AdaptivePolicy):
            # Paid: more output tokens per second than the same step decoded plainly was predicted to give.
            self.policy.exploration_paid(num_produced * stats.plain_seconds >= stats.num_sampling * stats.seconds)

    def _predict(self, num_tokens: int, num_segments: int, num_decodes: int) -> float | None:
        return self.cost_model.predict(num_tokens, num_segments, num_decodes) if self.cost_model else None

    def _token_values(self, num_tokens: int, num_segments: int, num_decodes: int, running: list[Request],
                      waiting: bool) -> dict[str, float] | None:
        """What an output token of each running request is worth this step, relative to the most valuable
        (1.0); None: every token alike -- the "throughput" objective, or requests are waiting (ending any
        sooner admits the next). The "makespan" objective: ``scheduler.objective``."""
        if self.config.objective != "makespan" or waiting or self.cost_model is None:
            return None
        left = {r.request_id: min(r.sampling_params.max_tokens - r.num_output_tokens,
                                  self.max_model_len - r.num_tokens) for r in running}
        if len(left) < 2:
            return None
        step = self.cost_model.predict(num_tokens, num_segments, num_decodes)
        if num_decodes and num_tokens > 1 and step > 0:  # what one plain decode adds to this step, as a share
            share = (step - self.cost_model.predict(num_tokens - 1, num_segments, num_decodes - 1)) / step
        else:
            share = 1.0
        return makespan_values(left, share, self.early_stops.share)

    def _options(self, req: Request, value: float = 1.0) -> list[Option]:
        """The rungs of the request's ladder it can run this step, with their tokens and expected gain
        (times ``value``, what an output token of the request is worth this step)."""
        state = req.lookahead
        top = req.max_lookahead
        assert state is not None and top is not None
        x = req.all_token_ids[-1]
        found = tuple(len(state.pool.lookup(x, top.verification_set_size, n - 1)) for n in _ngram_sizes(top))
        expected, optimistic = self._acceptance[req.request_id].multipliers()
        room = self.max_model_len - req.num_computed_tokens
        return [Option(r.params, r.num_tokens, expected * r.gain * value, optimistic * r.gain * value)
                for r in rungs(top, found, len(state.levels))
                if r.reach < room]  # else the segment would reach past the model's positions
