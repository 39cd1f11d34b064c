"""Continuous batching with one token budget per step, chunked prefill, FCFS and preemption.

There are no prefill or decode phases. Each request has ``num_computed_tokens`` and a target (all its
known tokens); every step tops the running requests up from the budget first, oldest first, then admits
waiting requests in arrival order. When the KV pool cannot hold a running request's next tokens, the
newest running request is preempted (its blocks freed, to be recomputed later) and the allocation is
retried.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from kv_cache import KVCacheManager
from scheduler.batch import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from scheduler.config import SchedulerConfig
from scheduler.lookahead import LookaheadLayout, LookaheadState
from scheduler.request import Request, RequestStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        if config.max_model_len is None:
            raise ValueError("SchedulerConfig.max_model_len must be set before building a Scheduler")
        self.config = config
        self.kv = kv_manager
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_since_step: list[str] = []
        self.num_preemptions = 0

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
            plan = self._plan_lookahead(req, budget) if num_new == 1 else None
            # A lookahead step commits x plus at most candidate_len accepted tokens.
            num_reserved = 1 + plan[0].candidate_len if plan and plan[0].num_candidates else num_new
            while self.kv.allocate_slots(req.request_id, req.num_computed_tokens + num_reserved) is None:
                if plan is not None:  # first give up the lookahead reservation, then preempt
                    plan, num_reserved = None, num_new
                    continue
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
                if plan is None:
                    scheduled.append(self._segment(req, num_new))
                    budget -= num_new
                else:
                    scheduled.append(self._segment(req, 1, plan))
                    budget -= plan[0].num_tokens
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
        for i, (seg, sampled) in enumerate(zip(sched_out.scheduled, runner_out.sampled_token_ids, strict=True)):
            req = self.requests.get(seg.req_id)
            if req is None or req.status.finished:
                continue  # aborted while the model ran: its output is dropped
            if seg.lookahead is not None:
                assert req.lookahead is not None and runner_out.lookahead_outputs is not None
                req.num_computed_tokens += len(sampled)  # x and the matched candidate tokens
                req.lookahead.update(seg.token_ids[0], runner_out.lookahead_outputs[i], sampled)
                req.accepted_lengths[len(sampled)] += 1
                if seg.lookahead.num_candidates:
                    req.lookahead.num_pool_hits += 1
            else:
                req.num_computed_tokens += len(seg.token_ids)
                if sampled and req.lookahead is not None:
                    req.lookahead.add_output(sampled)
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
                updated.append(req)
            if not req.status.finished:
                self.kv.cache_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens)
        return updated

    # ---- internals -----------------------------------------------------------------------------
    def _plan_lookahead(self, req: Request, budget: int) -> tuple[LookaheadLayout, list[int]] | None:
        """The request's lookahead segment for this step, or None to decode plainly."""
        state = req.lookahead
        if state is None:
            return None
        max_candidates = state.pool.cap
        layout, tokens = state.plan(req.all_token_ids[-1], max_candidates)
        furthest = req.num_computed_tokens + max(layout.num_levels + layout.num_cols - 2, layout.candidate_len)
        if layout.num_tokens > budget or furthest >= self.config.max_model_len:
            return None
        return layout, tokens

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
        req.status = status
        req.timing.finished = time.monotonic()
        self.kv.free(req.request_id)
        del self.requests[req.request_id]
        self._finished_since_step.append(req.request_id)
