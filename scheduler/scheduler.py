"""Continuous batching with one token budget per step, chunked prefill, FCFS and preemption.

There are no prefill or decode phases. Each request has ``num_computed_tokens`` and a target (all its
known tokens); every step tops the running requests up from the budget first, oldest first, then admits
waiting requests in arrival order. When the KV pool cannot hold a running request's next tokens, the
newest running request is preempted (its blocks freed, to be recomputed later) and the allocation is
retried.

Lookahead comes last: once prefill chunks and plain decodes hold their place in the budget, the planner
(scheduler.planner) picks which decoding requests run a lookahead segment this step and at what (w, n, g),
from the budget left. A segment's extra KV slots are reserved only from free blocks: when they are short
the request decodes plainly; lookahead never preempts. Each step: ``schedule`` -> the engine runs it ->
``update_from_output`` with the step's ``StepStats`` (observed seconds filled in).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import replace

from lookahead_serve.kv_cache import KVCacheManager, cdiv
from lookahead_serve.scheduler.batch import ModelRunnerOutput, ScheduledRequest, SchedulerOutput, StepStats
from lookahead_serve.scheduler.config import SchedulerConfig
from lookahead_serve.scheduler.cost import StepCostModel
from lookahead_serve.scheduler.lookahead import LookaheadLayout, LookaheadState
from lookahead_serve.scheduler.planner import LookaheadPlanner
from lookahead_serve.scheduler.request import DraftCounts, Request, RequestStatus, describe_error

logger = logging.getLogger(__name__)


class Scheduler:
    """cost_model: the step-cost model the adaptive lookahead policy plans with (required for it; the
    engine reads or measures one at start-up); with either policy, observed step times keep it current."""

    def __init__(
        self, config: SchedulerConfig, kv_manager: KVCacheManager, cost_model: StepCostModel | None = None
    ) -> None:
        if config.max_model_len is None:
            raise ValueError("SchedulerConfig.max_model_len must be set before building a Scheduler")
        self.config = config
        self.kv = kv_manager
        self.planner = LookaheadPlanner(config.lookahead, config.max_model_len, cost_model)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_since_step: list[str] = []
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # of requests that reached their first token
        self.num_generation_tokens = 0  # output tokens, as they are produced
        self.drafts = DraftCounts()  # every request's lookahead drafts, summed

    def reconfigure(self, config: SchedulerConfig) -> None:
        """Take ``config``'s limits and lookahead settings from the next step on (between runs; the model's
        max_model_len stays). The planner keeps what it has learnt (``LookaheadPlanner.reconfigure``)."""
        self.config = replace(config, max_model_len=self.config.max_model_len)
        self.planner.reconfigure(self.config.lookahead)

    # ---- requests in and out -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens; max_model_len is "
                f"{self.config.max_model_len}, which must leave room for at least one output token"
            )
        blocks_needed = cdiv(request.num_prompt_tokens + 1, self.kv.block_size)
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
            self.planner.add_request(request)
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
            self.kv.record_prefix_lookup(req.num_tokens, num_hit)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            if req.timing.first_scheduled is None:
                req.timing.first_scheduled = now
            self.running.append(req)
            scheduled.append(self._segment(req, num_new))
            budget -= num_new

        stats = self.planner.plan(scheduled, budget, self.requests, self.running, bool(self.waiting), self.kv,
                                  self._segment)
        finished, self._finished_since_step = self._finished_since_step, []
        return SchedulerOutput(
            scheduled=scheduled,
            num_scheduled_tokens=stats.num_tokens,
            preempted_req_ids=preempted,
            finished_req_ids=finished,
            stats=stats,
        )

    def update_from_output(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput,
                           stats: StepStats | None = None) -> list[Request]:
        """Advance every scheduled request by what the runner computed; return those given new tokens.
        ``stats``: the step's record with its observed seconds, for the planner to learn from."""
        now = time.monotonic()
        updated = []
        if stats is not None:
            self.planner.observe(stats, sum(len(sampled) for sampled in runner_out.sampled_token_ids))
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
                req.drafts.add(seg.lookahead.candidate_len, len(sampled))
                self.drafts.add(seg.lookahead.candidate_len, len(sampled))
            self.planner.observe_request(req, seg, sampled)
        else:
            req.num_computed_tokens += len(seg.token_ids)
            if sampled and req.lookahead is not None:
                req.lookahead.add_output(sampled)
                self.planner.observe_request(req, seg, sampled)
        status = None
        if sampled:
            req.num_steps += 1
            if req.timing.first_token is None:
                self.num_prompt_tokens += req.num_prompt_tokens
            req.timing.record_tokens(now)
            num_before = req.num_output_tokens
            for token_id in sampled:
                req.append_output(token_id)
                if (status := self._check_stop(req, token_id)) is not None:
                    break
            self.num_generation_tokens += req.num_output_tokens - num_before
        # Full blocks of committed tokens join the prefix cache, also when the request ends now (before its
        # blocks are freed: a request that ends at its first token still leaves its prompt cached)
        self.kv.cache_blocks(req.request_id, req.all_token_ids, min(req.num_computed_tokens, req.num_tokens))
        if status is not None:
            self._finish(req, status)
        return bool(sampled)

    # ---- internals -----------------------------------------------------------------------------
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
        self.planner.finish_request(req, status)
        req.status = status
        req.timing.finished = time.monotonic()
        self.kv.free(req.request_id)
        del self.requests[req.request_id]
        self._finished_since_step.append(req.request_id)
