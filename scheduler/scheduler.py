"""Continuous batching with one token budget per step, chunked prefill, FCFS and preemption.

There are no prefill or decode phases. Each request has ``num_computed_tokens`` and a target (all its
known tokens); every step tops the running requests up from the budget first, oldest first, then admits
waiting requests in arrival order. When the KV pool cannot hold a running request's next tokens, the
newest running request is preempted (its blocks freed, to be recomputed later) and the allocation is
retried.

Lookahead comes last: once prefill chunks and plain decodes hold their place in the budget, the policy
(``SchedulerConfig.lookahead_policy``, scheduler.policy) picks which decoding requests run a lookahead
segment this step and at what (w, n, g), from the budget left. A segment's extra KV slots are reserved
only from free blocks: when they are short the request decodes plainly; lookahead never preempts.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import replace

from kv_cache import KVCacheManager
from scheduler.batch import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from scheduler.config import SchedulerConfig
from scheduler.cost import StepCostModel
from scheduler.lookahead import LookaheadLayout, LookaheadState, shape_after_resize
from scheduler.objective import EarlyStops, makespan_values
from scheduler.params import LookaheadParams
from scheduler.policy import (
    AcceptanceModel,
    AdaptivePolicy,
    Decision,
    FixedPolicy,
    LookaheadCostCheck,
    Option,
    ladder,
    planned_gain,
)
from scheduler.request import Request, RequestStatus, describe_error

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1024)
def _ngram_sizes(maximum: LookaheadParams) -> tuple[int, ...]:
    """The n-gram sizes of the rungs of ``maximum``'s ladder, in ladder order."""
    return tuple(dict.fromkeys(p.ngram_size for p in ladder(maximum)))


@functools.lru_cache(maxsize=8192)
def _rungs(maximum: LookaheadParams, found: tuple[int, ...], num_levels: int
           ) -> tuple[tuple[LookaheadParams, int, float, int], ...]:
    """A request's rungs this step, as (params, step tokens, planned gain, positions the segment reaches
    past the last token), given the candidates its pool holds for each of ``_ngram_sizes(maximum)``
    (``found``) and the levels its window has: all a rung depends on but the request's acceptance
    multiplier, so requests in the same state share the table (a step at concurrency 32 asks for 32
    tables of 26 rungs; most are the same few)."""
    num_found = dict(zip(_ngram_sizes(maximum), found, strict=True))
    seen_verify: set[LookaheadParams] = set()
    rungs = []
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
        rungs.append((p, num_tokens, planned_gain(p, num_found[n]), reach))
    return tuple(rungs)


class Scheduler:
    """cost_model: the step-cost model the adaptive lookahead policy plans with (required for it; the
    engine measures one at start-up); with either policy, observed step times given to ``observe_step``
    keep it current and measure its error."""

    def __init__(
        self, config: SchedulerConfig, kv_manager: KVCacheManager, cost_model: StepCostModel | None = None
    ) -> None:
        if config.max_model_len is None:
            raise ValueError("SchedulerConfig.max_model_len must be set before building a Scheduler")
        self.config = config
        self.kv = kv_manager
        self.cost_model = cost_model
        self.set_lookahead_policy(config.lookahead_policy)
        self._acceptance: dict[str, AcceptanceModel] = {}
        # Every request's lookahead steps together, slowly discounted: where a new request's model starts.
        self._acceptance_all = AcceptanceModel(prior_weight=8.0, decay=0.999)
        # How many recent requests stopped before their length bound: how much a bound says (makespan objective).
        self.early_stops = EarlyStops()
        self.lookahead_cost = LookaheadCostCheck()  # what lookahead really adds to a step, over the model's figure
        self.last_decision: Decision | None = None
        self.last_lookahead: list[LookaheadParams] = []  # the (w, n, g) each lookahead segment ran last step
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_since_step: list[str] = []
        self.num_preemptions = 0

    def set_lookahead_policy(self, name: str) -> None:
        """Switch between the "fixed" and "adaptive" lookahead policies from the next step on. The acceptance
        and step-cost models carry over, and so does the adaptive policy's exploration (how far it has backed
        off), as it would in a server that never switched; the config's explore interval and minimum gain
        are read again."""
        if name == "adaptive" and self.cost_model is None:
            raise ValueError("the adaptive lookahead policy needs a step-cost model")
        self.config = replace(self.config, lookahead_policy=name)  # validates the name
        if name != "adaptive":
            self.policy = FixedPolicy()
            return
        previous = getattr(self, "_adaptive", None)
        policy = AdaptivePolicy(self.cost_model, self.config.lookahead_explore_every, self.config.lookahead_min_gain)
        if previous is not None:
            policy.continue_exploration(previous)
        self.policy = self._adaptive = policy

    # ---- requests in and out -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens; max_model_len is "
                f"{self.config.max_model_len}, which must leave room for at least one output token"
            )
        blocks_needed = -(-(request.num_prompt_tokens + 1) // self.kv.block_size)
        if blocks_needed > self.kv.pool.num_blocks:
            raise ValueError(
                f"prompt of {request.num_prompt_tokens} tokens needs {blocks_needed} KV blocks; "
                f"the cache has {self.kv.pool.num_blocks}"
            )
        la = request.sampling_params.lookahead or self.config.lookahead.default
        self.config.lookahead.check(la)
        if not la.is_plain:
            request.lookahead = LookaheadState(
                la.window_size, la.ngram_size, la.verification_set_size, request.prompt_token_ids, request.eos_token_ids,
                seed=request.sampling_params.seed or 0,  # the window's random start comes from the request's seed
            )
            request.max_lookahead = la
            self._acceptance[request.request_id] = AcceptanceModel(self._acceptance_all.multiplier)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_requests(self, req_ids: Iterable[str]) -> list[Request]:
        aborted = []
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is not None and not req.status.finished:
                self._finish(req, RequestStatus.FINISHED_ABORTED)
                aborted.append(req)
        return aborted

    def finish_request(self, req_id: str, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        """End a request from outside the step (a stop string found by the detokenizer)."""
        req = self.requests.get(req_id)
        if req is not None and not req.status.finished:
            req.stop_reason = stop_reason
            self._finish(req, status)

    def fail_requests(self, errors: dict[str, str]) -> None:
        """End requests whose part of a step raised, with FINISHED_ERROR; their blocks are freed."""
        for req_id, message in errors.items():
            req = self.requests.get(req_id)
            if req is not None and not req.status.finished:
                req.error = message
                self._finish(req, RequestStatus.FINISHED_ERROR)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        now = time.monotonic()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while self.kv.allocate_slots(req.request_id, req.num_computed_tokens + num_new) is None:
                if i == 0 and len(self.running) == 1:
                    # Alone and still out of blocks: the request has outgrown the whole cache.
                    self._finish(req, RequestStatus.FINISHED_LENGTH)
                    req = None
                    break
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                assert req is not None
                scheduled.append(self._segment(req, num_new))
                budget -= num_new
                i += 1
                continue
            break

        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            hits, num_hit = self.kv.get_computed_blocks(req.all_token_ids)
            num_new = min(req.num_tokens - num_hit, budget)
            if self.kv.allocate_slots(req.request_id, num_hit + num_new, hits) is None:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            if req.timing.first_scheduled is None:
                req.timing.first_scheduled = now
            self.running.append(req)
            scheduled.append(self._segment(req, num_new))
            budget -= num_new

        budget -= self._schedule_lookahead(scheduled, budget)
        finished, self._finished_since_step = self._finished_since_step, []
        return SchedulerOutput(
            scheduled=scheduled,
            num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            preempted_req_ids=preempted,
            finished_req_ids=finished,
        )

    def update_from_output(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[Request]:
        """Advance every scheduled request by what the runner computed; return those given new tokens."""
        now = time.monotonic()
        updated = []
        self._report_exploration(sched_out, runner_out)
        for i, (seg, sampled) in enumerate(zip(sched_out.scheduled, runner_out.sampled_token_ids, strict=True)):
            req = self.requests.get(seg.req_id)
            if req is None or req.status.finished:
                continue  # aborted or failed while the model ran: its output is dropped
            try:
                if self._advance(req, seg, sampled, runner_out.lookahead_outputs, i, now):
                    updated.append(req)
            except Exception as e:  # a fault in one request's bookkeeping ends that request alone
                logger.exception("request %s failed while updating from the step", req.request_id)
                self.fail_requests({req.request_id: describe_error(e)})
                updated.append(req)
        return updated

    def _advance(self, req: Request, seg: ScheduledRequest, sampled: list[int],
                 lookahead_outputs: list[list[int]] | None, i: int, now: float) -> bool:
        """Apply one segment's result to its request; True if the request was given new tokens."""
        if seg.lookahead is not None:
            assert req.lookahead is not None and lookahead_outputs is not None
            req.num_computed_tokens += len(sampled)  # x and the matched candidate tokens
            req.lookahead.update(seg.token_ids[0], lookahead_outputs[i], sampled)  # no outputs: verify only
            req.accepted_lengths[len(sampled)] += 1
            if seg.lookahead.num_candidates:
                req.lookahead.num_pool_hits += 1
            found = seg.lookahead.num_candidates
            self._acceptance[req.request_id].observe(req.lookahead_step, len(sampled), found)
            self._acceptance_all.observe(req.lookahead_step, len(sampled), found)
        else:
            req.num_computed_tokens += len(seg.token_ids)
            if sampled and req.lookahead is not None:
                req.lookahead.add_output(sampled)
                self._acceptance[req.request_id].observe(None, 1)
        if sampled:
            req.num_steps += 1
            if req.timing.first_token is None:
                req.timing.first_token = now
            for token_id in sampled:
                req.append_output(token_id)
                status = self._check_stop(req, token_id)
                if status is not None:
                    self._finish(req, status)
                    break
        if not req.status.finished:
            self.kv.cache_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens)
        return bool(sampled)

    # ---- internals -----------------------------------------------------------------------------
    def _report_exploration(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> None:
        """Tell the policy whether the step it explored paid: more output tokens per second than the same
        step decoded plainly was predicted to give (one token per sampling segment)."""
        d = self.last_decision
        if d is None or not d.explored or d.observed_seconds is None or d.plain_seconds is None:
            return
        if not isinstance(self.policy, AdaptivePolicy):
            return
        produced = sum(len(sampled) for sampled in runner_out.sampled_token_ids)
        plain = sum(seg.sample for seg in sched_out.scheduled)
        self.policy.exploration_paid(produced * d.plain_seconds >= plain * d.observed_seconds)

    def _schedule_lookahead(self, scheduled: list[ScheduledRequest], budget: int) -> int:
        """Turn chosen plain decodes into lookahead segments in place; return the tokens added."""
        cands: list[tuple[int, Request, list[Option]]] = []
        num_tokens = sum(len(seg.token_ids) for seg in scheduled)
        num_segments = sum(len(seg.token_ids) > 1 for seg in scheduled)
        num_decodes = sum(len(seg.token_ids) == 1 for seg in scheduled)
        values = self._token_values(num_tokens, num_segments, num_decodes)
        num_yield = 0.0
        for k, seg in enumerate(scheduled):
            value = values.get(seg.req_id, 1.0) if values else 1.0
            num_yield += seg.sample * value
            req = self.requests[seg.req_id]
            if len(seg.token_ids) == 1 and seg.sample and req.lookahead is not None:
                opts = self._options(req, value)
                if opts:
                    cands.append((k, req, opts))
        self.last_lookahead = []
        if not cands:
            predicted = self.cost_model.predict(num_tokens, num_segments, num_decodes) if self.cost_model else 0.0
            self.last_decision = Decision([], num_tokens, num_segments, num_yield, predicted, num_decodes)
            return 0
        if isinstance(self.policy, AdaptivePolicy):
            self.policy.extra_cost_scale = self.lookahead_cost.scale
        decision = self.policy.choose([c[2] for c in cands], num_tokens, num_segments, num_yield, budget, num_decodes)
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
            if self.kv.allocate_slots(req.request_id, req.num_computed_tokens + reserve) is None:
                continue  # decodes plainly after all
            scheduled[k] = self._segment(req, 1, (layout, tokens))
            req.lookahead_step = params
            self.last_lookahead.append(params)
            added += layout.num_tokens - 1
        # The step as it will run (a segment whose blocks were short went plain).
        n_la = len(self.last_lookahead)
        decision.num_tokens = num_tokens + added
        decision.num_segments = num_segments + n_la
        decision.num_decodes = num_decodes - n_la
        if self.cost_model is not None:
            decision.predicted_seconds = self.cost_model.predict(
                decision.num_tokens, decision.num_segments, decision.num_decodes)
            if n_la:
                decision.plain_seconds = self.cost_model.predict(num_tokens, num_segments, num_decodes)
        self.last_decision = decision
        return added

    def _token_values(self, num_tokens: int, num_segments: int, num_decodes: int) -> dict[str, float] | None:
        """What an output token of each running request is worth this step, relative to the most valuable
        (1.0); None: every token alike -- the "throughput" objective, or requests are waiting (ending any
        sooner admits the next). The "makespan" objective: ``scheduler.objective``."""
        if self.config.lookahead_objective != "makespan" or self.waiting or self.cost_model is None:
            return None
        left = {r.request_id: min(r.sampling_params.max_tokens - r.num_output_tokens,
                                  self.config.max_model_len - r.num_tokens) for r in self.running}
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
        room = self.config.max_model_len - req.num_computed_tokens
        return [Option(p, num_tokens, expected * gain * value, optimistic * gain * value)
                for p, num_tokens, gain, reach in _rungs(top, found, len(state.levels))
                if reach < room]  # else the segment would reach past the model's positions

    def observe_step(self, seconds: float) -> float | None:
        """The last scheduled step took ``seconds`` to run: correct the cost model; return its prediction."""
        d = self.last_decision
        if self.cost_model is None or d is None:
            return None
        d.observed_seconds = seconds
        predicted = self.cost_model.observe(d.num_tokens, d.num_segments, seconds, d.num_decodes)
        # The check corrects the adaptive policy's own picks: a fixed policy's steps are not picked by cost.
        if d.plain_seconds is not None and d.adaptive and self.cost_model.learning_rate > 0:  # a frozen model stays
            self.lookahead_cost.observe(seconds, predicted, d.plain_seconds)
        return predicted

    def _segment(
        self, req: Request, num_new: int, plan: tuple[LookaheadLayout, list[int]] | None = None
    ) -> ScheduledRequest:
        start = req.num_computed_tokens
        p = req.sampling_params
        return ScheduledRequest(
            req_id=req.request_id,
            token_ids=plan[1] if plan else req.all_token_ids[start : start + num_new],
            start_pos=start,
            block_ids=self.kv.block_ids(req.request_id),
            sample=start + num_new == req.num_tokens,
            lookahead=plan[0] if plan else None,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            seed=p.seed,
        )

    def _check_stop(self, req: Request, token_id: int) -> RequestStatus | None:
        p = req.sampling_params
        if req.num_output_tokens > p.min_tokens:
            if token_id in p.stop_token_ids:
                req.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
            if not p.ignore_eos and token_id in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            self.early_stops.observe(status == RequestStatus.FINISHED_STOPPED)
        req.status = status
        req.timing.finished = time.monotonic()
        self.kv.free(req.request_id)
        del self.requests[req.request_id]
        self._acceptance.pop(req.request_id, None)
        self._finished_since_step.append(req.request_id)
