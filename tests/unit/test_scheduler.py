"""Scheduler driven by a fake model runner: budgets, chunked prefill, FCFS, preemption, aborts, stops.

Pure Python: no torch, no engine. The "runner" returns a chosen token for every segment that samples.
"""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from lookahead_serve.kv_cache import KVCacheManager
from lookahead_serve.scheduler import (
    LookaheadConfig,
    LookaheadParams,
    ModelRunnerOutput,
    Request,
    RequestStatus,
    SamplingParams,
    ScheduledRequest,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

Token = int | Callable[[ScheduledRequest], int]
PLAIN_ONLY = LookaheadConfig(default=LookaheadParams(enabled=False), policy="fixed")


# ---- helpers -----------------------------------------------------------------------------------


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 512,
    max_seqs: int = 64,
    max_model_len: int = 256,
    caching: bool = True,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=max_model_len,
                             lookahead=PLAIN_ONLY)
    return Scheduler(config, kv)


_next_base = [1000]


def make_request(
    rid: str,
    prompt: int | list[int],
    max_tokens: int = 16,
    eos: frozenset[int] = frozenset(),
    **params,
) -> Request:
    """A request whose prompt is ``prompt`` or, for an int, that many tokens no other request shares."""
    if isinstance(prompt, int):
        base = _next_base[0]
        _next_base[0] += prompt + 1
        prompt = list(range(base, base + prompt))
    params.setdefault("temperature", 0.0)
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=eos)


def fake_run(so: SchedulerOutput, token: Token = 7) -> ModelRunnerOutput:
    """'Run' a step: one token for every segment with sample=True, nothing for a prefill chunk."""
    pick = token if callable(token) else (lambda seg: token)
    return ModelRunnerOutput(
        req_ids=[seg.req_id for seg in so.scheduled],
        sampled_token_ids=[[pick(seg)] if seg.sample else [] for seg in so.scheduled],
    )


def step(s: Scheduler, token: Token = 7) -> tuple[SchedulerOutput, list[Request]]:
    was_running = [r.request_id for r in s.running]
    so = s.schedule()
    check_step(s, so)
    if so.preempted_req_ids:
        # A step that preempts admits nothing: it only runs requests that were already running.
        assert all(seg.req_id in was_running for seg in so.scheduled)
        assert not set(so.preempted_req_ids) & {seg.req_id for seg in so.scheduled}
    updated = s.update_from_output(so, fake_run(so, token))
    return so, updated


def check_step(s: Scheduler, so: SchedulerOutput) -> None:
    """Invariants of every step."""
    n = sum(len(seg.token_ids) for seg in so.scheduled)
    assert n == so.num_scheduled_tokens
    assert n <= s.config.max_num_batched_tokens
    assert len(so.scheduled) <= s.config.max_num_seqs
    assert s.num_running <= s.config.max_num_seqs
    assert len({seg.req_id for seg in so.scheduled}) == len(so.scheduled)
    bs = s.kv.block_size
    for seg in so.scheduled:
        assert seg.token_ids, seg
        # Enough blocks for every token of the segment, and the table is the request's whole table.
        assert len(seg.block_ids) * bs >= seg.start_pos + len(seg.token_ids)
        assert seg.block_ids == s.kv.block_ids(seg.req_id)
        req = s.requests[seg.req_id]
        assert seg.token_ids == req.all_token_ids[seg.start_pos : seg.start_pos + len(seg.token_ids)]
        assert seg.sample == (seg.start_pos + len(seg.token_ids) == req.num_tokens)


def run_all(s: Scheduler, token: Token = 7, max_steps: int = 2000) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return outs
        so, _ = step(s, token)
        assert not so.is_empty, "no progress"
        outs.append(so)
    raise AssertionError("did not finish")


def segs(so: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(seg.req_id, seg.start_pos, len(seg.token_ids), seg.sample) for seg in so.scheduled]


# ---- construction and add_request --------------------------------------------------------------


def test_scheduler_needs_max_model_len():
    with pytest.raises(ValueError, match="max_model_len"):
        Scheduler(SchedulerConfig(), KVCacheManager(8, 4))


@pytest.mark.parametrize(
    "field, value",
    [("max_num_batched_tokens", 0), ("max_num_seqs", 0), ("max_model_len", 0), ("max_num_seqs", -3)],
)
def test_config_rejects_bad_limits(field, value):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: value})


@pytest.mark.parametrize(
    "field, value",
    [("min_gain", -0.1), ("min_gain", 1.0), ("min_gain", "5%"), ("explore_every", -1), ("policy", "greedy"),
     ("objective", "latency"), ("max_window_size", -1)],
)
def test_lookahead_config_rejects_bad_settings(field, value):
    with pytest.raises(ValueError, match=field.split("_")[-1]):
        LookaheadConfig(**{field: value})


def test_duplicate_request_id_raises():
    s = make_scheduler()
    s.add_request(make_request("a", 4))
    with pytest.raises(ValueError, match="'a'"):
        s.add_request(make_request("a", 4))
    assert s.num_waiting == 1
    # Still a duplicate once running.
    step(s)
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(make_request("a", 4))


def test_request_id_reusable_after_finish():
    s = make_scheduler()
    s.add_request(make_request("a", 4, max_tokens=1))
    run_all(s)
    s.add_request(make_request("a", 4, max_tokens=1))
    assert s.num_waiting == 1


@pytest.mark.parametrize(
    "max_model_len, prompt_len, accepted",
    [(10, 9, True), (10, 1, True), (10, 10, False), (10, 11, False), (10, 50, False), (2, 1, True), (1, 1, False)],
)
def test_prompt_must_leave_room_for_one_token(max_model_len, prompt_len, accepted):
    s = make_scheduler(max_model_len=max_model_len)
    r = make_request("a", prompt_len)
    if accepted:
        s.add_request(r)
        assert s.num_waiting == 1
    else:
        with pytest.raises(ValueError, match="max_model_len"):
            s.add_request(r)
        assert s.num_waiting == 0
        assert "a" not in s.requests


@pytest.mark.parametrize("prompt_len, accepted", [(15, True), (16, False), (40, False)])
def test_prompt_larger_than_the_cache_rejected(prompt_len, accepted):
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=100)  # room for 16 tokens
    r = make_request("a", prompt_len)
    if accepted:
        s.add_request(r)
    else:
        with pytest.raises(ValueError, match="KV blocks"):
            s.add_request(r)


# ---- budget and chunked prefill ----------------------------------------------------------------


def test_chunked_prefill_of_a_long_prompt():
    s = make_scheduler(budget=16, block_size=4)
    r = make_request("a", 40, max_tokens=3)
    s.add_request(r)
    expected = [
        # (start_pos, num tokens, sample, block ids, outputs after the step)
        (0, 16, False, [0, 1, 2, 3], 0),
        (16, 16, False, list(range(8)), 0),
        (32, 8, True, list(range(10)), 1),
        (40, 1, True, list(range(11)), 2),  # position 40 is the first slot of block 10
        (41, 1, True, list(range(11)), 3),
    ]
    for start, n, sample, block_ids, num_out in expected:
        so, updated = step(s)
        [seg] = so.scheduled
        assert (seg.start_pos, len(seg.token_ids), seg.sample, seg.block_ids) == (start, n, sample, block_ids)
        assert seg.token_ids == r.all_token_ids[start : start + n]
        assert r.num_output_tokens == num_out
        assert updated == ([r] if sample else [])
        if r.status == RequestStatus.RUNNING:
            assert r.num_computed_tokens == start + n
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert r.output_token_ids == [7, 7, 7]
    assert not s.has_unfinished_requests()
    assert s.kv.num_free_blocks == s.kv.pool.num_blocks


def test_budget_shared_oldest_first():
    s = make_scheduler(budget=4)
    s.add_request(make_request("A", 10, max_tokens=10))
    s.add_request(make_request("B", 10, max_tokens=10))
    expected = [
        [("A", 0, 4, False)],  # B gets no budget, so is not even admitted
        [("A", 4, 4, False)],
        [("A", 8, 2, True), ("B", 0, 2, False)],
        [("A", 10, 1, True), ("B", 2, 3, False)],
        [("A", 11, 1, True), ("B", 5, 3, False)],
        [("A", 12, 1, True), ("B", 8, 2, True)],
        [("A", 13, 1, True), ("B", 10, 1, True)],
    ]
    for want in expected:
        so, _ = step(s)
        assert segs(so) == want
        assert so.num_scheduled_tokens == sum(n for _, _, n, _ in want)
    assert s.requests["A"].num_output_tokens == 5
    assert s.requests["B"].num_output_tokens == 2


@pytest.mark.parametrize("budget", [1, 3, 8, 17, 64])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_token_budget_never_exceeded(budget, block_size):
    s = make_scheduler(num_blocks=256, block_size=block_size, budget=budget, max_model_len=128)
    lens = [1, 5, 33, 12, 70, 2]
    reqs = [make_request(f"r{i}", n, max_tokens=4) for i, n in enumerate(lens)]
    for r in reqs:
        s.add_request(r)
    outs = run_all(s)
    assert all(so.num_scheduled_tokens <= budget for so in outs)
    assert any(so.num_scheduled_tokens == min(budget, sum(lens)) for so in outs)
    # Every prompt token was run exactly once, and every decode token once.
    assert sum(so.num_scheduled_tokens for so in outs) == sum(lens) + 3 * len(lens)
    assert [r.num_output_tokens for r in reqs] == [4] * len(lens)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)
    assert s.kv.num_free_blocks == 256


# ---- FCFS and max_num_seqs ---------------------------------------------------------------------


def test_decodes_of_running_requests_come_before_new_prefills():
    s = make_scheduler(budget=6)
    s.add_request(make_request("A", 4, max_tokens=10))
    so, _ = step(s)
    assert segs(so) == [("A", 0, 4, True)]
    s.add_request(make_request("B", 8))
    s.add_request(make_request("C", 8))
    so, _ = step(s)
    assert segs(so) == [("A", 4, 1, True), ("B", 0, 5, False)]
    assert [r.request_id for r in s.waiting] == ["C"]
    so, _ = step(s)
    assert segs(so) == [("A", 5, 1, True), ("B", 5, 3, True), ("C", 0, 2, False)]
    so, _ = step(s)
    assert segs(so) == [("A", 6, 1, True), ("B", 8, 1, True), ("C", 2, 4, False)]


@pytest.mark.parametrize("max_seqs", [1, 2, 3])
def test_max_num_seqs_respected_and_admission_in_arrival_order(max_seqs):
    s = make_scheduler(max_seqs=max_seqs)
    reqs = [make_request(f"r{i}", 5, max_tokens=3) for i in range(5)]
    for r in reqs:
        s.add_request(r)
    so, _ = step(s)
    assert [seg.req_id for seg in so.scheduled] == [f"r{i}" for i in range(max_seqs)]
    assert s.num_running == max_seqs
    assert [r.request_id for r in s.waiting] == [f"r{i}" for i in range(max_seqs, 5)]
    assert all(r.status == RequestStatus.WAITING for r in s.waiting)
    outs = run_all(s)
    assert max(len(so.scheduled) for so in outs) <= max_seqs
    first = [r.timing.first_scheduled for r in reqs]
    assert first == sorted(first)
    assert all(r.num_output_tokens == 3 for r in reqs)


def test_max_num_seqs_admits_when_a_slot_frees():
    s = make_scheduler(max_seqs=2)
    s.add_request(make_request("A", 4, max_tokens=1))
    s.add_request(make_request("B", 4, max_tokens=3))
    s.add_request(make_request("C", 4, max_tokens=3))
    so, _ = step(s)  # A finishes at once
    assert [seg.req_id for seg in so.scheduled] == ["A", "B"]
    so, _ = step(s)
    assert segs(so)[0] == ("B", 4, 1, True)
    assert [seg.req_id for seg in so.scheduled] == ["B", "C"]
    assert so.finished_req_ids == ["A"]


# ---- preemption --------------------------------------------------------------------------------


@pytest.mark.parametrize("caching, resume_start, resume_blocks", [(True, 4, [2, 3, 1]), (False, 0, [2, 3, 1])])
def test_preemption_frees_the_newest_and_resumes_it(caching, resume_start, resume_blocks):
    s = make_scheduler(num_blocks=4, block_size=4, caching=caching, max_model_len=64)
    a = make_request("A", 6, max_tokens=6)
    b = make_request("B", 6, max_tokens=6)
    s.add_request(a)
    s.add_request(b)
    for _ in range(3):  # both fit in two blocks each for 8 tokens
        so, _ = step(s)
        assert [seg.req_id for seg in so.scheduled] == ["A", "B"]
        assert so.preempted_req_ids == []
    assert s.kv.block_ids("A") == [0, 1] and s.kv.block_ids("B") == [2, 3]
    assert s.kv.num_free_blocks == 0

    first_scheduled = b.timing.first_scheduled
    # A's 9th token needs a third block: B (the newest) is preempted to make room.
    so, _ = step(s)
    assert so.preempted_req_ids == ["B"]
    assert segs(so) == [("A", 8, 1, True)]
    assert so.scheduled[0].block_ids == [0, 1, 3]  # B's blocks were freed tail first
    assert b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and s.num_preemptions == 1
    assert s.kv.block_ids("B") == []
    assert list(s.waiting) == [b]
    assert b not in s.running
    assert b.output_token_ids == [7, 7, 7]  # kept: they are recomputed, not regenerated

    # B cannot come back until A is done with its blocks.
    while a.status == RequestStatus.RUNNING:
        so, _ = step(s)
        assert [seg.req_id for seg in so.scheduled] == ["A"]
    assert a.status == RequestStatus.FINISHED_LENGTH and a.num_output_tokens == 6

    so, _ = step(s)
    assert so.finished_req_ids == ["A"]
    [seg] = so.scheduled
    # Resumed: it recomputes prompt and output (minus what the prefix cache still holds).
    assert (seg.req_id, seg.start_pos, len(seg.token_ids), seg.sample) == ("B", resume_start, 9 - resume_start, True)
    assert seg.block_ids == resume_blocks
    assert b.status == RequestStatus.RUNNING
    assert b.timing.first_scheduled == first_scheduled  # first admission, not the readmission
    run_all(s)
    assert b.status == RequestStatus.FINISHED_LENGTH
    assert b.output_token_ids == [7] * 6
    assert b.num_steps == 6
    assert s.kv.num_free_blocks == 4


def test_preemption_picks_the_newest_running_and_puts_it_first_in_line():
    s = make_scheduler(num_blocks=6, block_size=4, max_seqs=3, max_model_len=64)
    for rid in "ABC":
        s.add_request(make_request(rid, 8, max_tokens=5))
    s.add_request(make_request("D", 4, max_tokens=5))  # waits: max_num_seqs
    so, _ = step(s)
    assert [seg.req_id for seg in so.scheduled] == ["A", "B", "C"]
    assert s.kv.num_free_blocks == 0
    c = s.requests["C"]
    so, _ = step(s)
    # A needs a third block: C goes (not B), which frees two blocks, one for A and one for B.
    assert so.preempted_req_ids == ["C"]
    assert [seg.req_id for seg in so.scheduled] == ["A", "B"]
    assert [r.request_id for r in s.waiting] == ["C", "D"]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert s.kv.block_ids("C") == []
    reqs = [s.requests[rid] for rid in "ABCD"]
    outs = run_all(s)
    # C is readmitted ahead of D once A and B finish, and recomputes its 8 prompt + 1 output tokens.
    resumed = next(so for so in outs if any(seg.req_id == "C" for seg in so.scheduled))
    assert resumed.finished_req_ids == ["A", "B"]
    assert segs(resumed) == [("C", 0, 9, True), ("D", 0, 4, True)]
    assert [r.num_output_tokens for r in reqs] == [5] * 4
    assert [r.num_preemptions for r in reqs] == [0, 0, 1, 0]
    assert s.num_preemptions == 1
    assert s.kv.num_free_blocks == 6


def test_no_admission_in_a_step_that_preempted():
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    s.add_request(make_request("A", 8, max_tokens=4))
    s.add_request(make_request("B", 8, max_tokens=4))
    step(s)  # A and B take all four blocks
    s.add_request(make_request("C", 1))
    so, _ = step(s)
    assert so.preempted_req_ids == ["B"]
    assert [seg.req_id for seg in so.scheduled] == ["A"]
    assert [r.request_id for r in s.waiting] == ["B", "C"]


def test_preempted_request_not_readmitted_in_the_same_step():
    """Freed blocks would fit a budget-limited chunk of the victim, but it waits for the next step."""
    s = make_scheduler(num_blocks=4, block_size=4, budget=5, caching=False, max_model_len=64)
    s.add_request(make_request("A", 8, max_tokens=4))
    s.add_request(make_request("B", 8, max_tokens=4))
    so, _ = step(s)
    assert segs(so) == [("A", 0, 5, False)]
    so, _ = step(s)
    assert segs(so) == [("A", 5, 3, True), ("B", 0, 2, False)]
    so, _ = step(s)  # A takes the last free block; B cannot grow and preempts itself
    assert so.preempted_req_ids == ["B"]
    assert segs(so) == [("A", 8, 1, True)]
    assert s.kv.num_free_blocks == 1
    so, _ = step(s)  # now B is readmitted, from scratch, as far as the budget goes
    assert so.preempted_req_ids == []
    assert segs(so) == [("A", 9, 1, True), ("B", 0, 4, False)]


def test_request_that_outgrows_the_whole_cache_finishes_with_length():
    """The only running request cannot grow: rather than preempt itself forever, it ends as 'length'."""
    s = make_scheduler(num_blocks=2, block_size=4, max_model_len=64)
    r = make_request("A", 7, max_tokens=10)
    s.add_request(r)
    step(s)  # 7 prompt tokens + 1 sampled fit 2 blocks
    step(s)
    so, _ = step(s)  # the 9th token needs a third block
    assert so.preempted_req_ids == []
    assert so.scheduled == []
    assert so.finished_req_ids == ["A"]
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 2
    assert s.kv.num_free_blocks == 2
    assert not s.has_unfinished_requests()


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_keep_invariants_and_finish(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    num_blocks = rng.randrange(8, 40)
    max_model_len = rng.randrange(8, num_blocks * block_size + 1)
    s = make_scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        budget=rng.randrange(1, 40),
        max_seqs=rng.randrange(1, 6),
        max_model_len=max_model_len,
        caching=rng.random() < 0.8,
    )
    shared = [[rng.randrange(50) for _ in range(rng.randrange(1, 20))] for _ in range(3)]
    reqs = []
    for i in range(16):
        p = (rng.choice(shared) + [rng.randrange(50) for _ in range(rng.randrange(4))])[: max_model_len - 1]
        r = make_request(f"r{i}", p, max_tokens=rng.randrange(1, 12))
        try:
            s.add_request(r)
        except ValueError:
            continue
        reqs.append(r)
    run_all(s, token=lambda seg: rng.randrange(50))
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.num_output_tokens == min(r.sampling_params.max_tokens, max_model_len - r.num_prompt_tokens)
        assert r.num_steps == r.num_output_tokens
    assert s.kv.num_free_blocks == num_blocks
    assert all(b.ref_cnt == 0 for b in s.kv.pool.blocks)


# ---- aborts ------------------------------------------------------------------------------------


def test_abort_waiting_request():
    s = make_scheduler(max_seqs=1)
    s.add_request(make_request("A", 4))
    s.add_request(make_request("B", 4))
    step(s)
    free_before = s.kv.num_free_blocks
    aborted = s.abort_requests(["B"])
    assert [r.request_id for r in aborted] == ["B"]
    assert aborted[0].status == RequestStatus.FINISHED_ABORTED
    assert aborted[0].status.finish_reason == "abort"
    assert s.num_waiting == 0
    assert "B" not in s.requests
    assert s.kv.block_ids("B") == []
    assert s.kv.num_free_blocks == free_before
    so, _ = step(s)
    assert so.finished_req_ids == ["B"]
    assert [seg.req_id for seg in so.scheduled] == ["A"]
    so, _ = step(s)
    assert so.finished_req_ids == []  # reported once


def test_abort_preempted_request_in_waiting():
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    s.add_request(make_request("A", 8, max_tokens=4))
    s.add_request(make_request("B", 8, max_tokens=4))
    step(s)
    so, _ = step(s)
    assert so.preempted_req_ids == ["B"]
    s.abort_requests(["B"])
    assert s.num_waiting == 0
    so, _ = step(s)
    assert so.finished_req_ids == ["B"]
    run_all(s)
    assert s.kv.num_free_blocks == 4


def test_abort_running_request_frees_its_blocks():
    s = make_scheduler(num_blocks=16)
    s.add_request(make_request("A", 10))
    s.add_request(make_request("B", 5))
    step(s)
    assert s.kv.block_ids("A") == [0, 1, 2]
    assert s.kv.num_free_blocks == 16 - 5
    aborted = s.abort_requests(["A", "nope"])
    assert [r.request_id for r in aborted] == ["A"]
    assert s.kv.block_ids("A") == []
    assert s.kv.num_free_blocks == 16 - 2
    assert s.num_running == 1
    assert s.abort_requests(["A"]) == []  # already gone
    so, _ = step(s)
    assert so.finished_req_ids == ["A"]
    assert [seg.req_id for seg in so.scheduled] == ["B"]


def test_output_of_request_aborted_mid_step_is_dropped():
    s = make_scheduler(num_blocks=16)
    a = make_request("A", 6)
    b = make_request("B", 6)
    s.add_request(a)
    s.add_request(b)
    so = s.schedule()
    assert [seg.req_id for seg in so.scheduled] == ["A", "B"]
    s.abort_requests(["A"])  # while the model runs
    updated = s.update_from_output(so, fake_run(so))
    assert updated == [b]
    assert a.output_token_ids == []
    assert a.num_computed_tokens == 0
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert s.kv.block_ids("A") == []
    assert b.output_token_ids == [7]
    assert s.kv.num_free_blocks == 16 - 2
    so, _ = step(s)
    assert so.finished_req_ids == ["A"]


def test_finish_request_from_outside():
    s = make_scheduler()
    r = make_request("A", 4)
    s.add_request(r)
    step(s)
    s.finish_request("A", RequestStatus.FINISHED_STOPPED, "stop-string")
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert r.stop_reason == "stop-string"
    assert not s.has_unfinished_requests()
    assert s.kv.num_free_blocks == s.kv.pool.num_blocks
    s.finish_request("A", RequestStatus.FINISHED_LENGTH)  # ignored: already finished
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert s.schedule().finished_req_ids == ["A"]


# ---- stopping ----------------------------------------------------------------------------------


def sequence_runner(r: Request, tokens: list[int]) -> Callable[[ScheduledRequest], int]:
    """Emit tokens[k] as the request's k-th output token."""
    return lambda seg: tokens[r.num_output_tokens]


STOP, LENGTH = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH


@pytest.mark.parametrize(
    "params, eos, tokens, status, outputs, stop_reason",
    [
        # EOS
        (dict(max_tokens=10), {2}, [5, 5, 2, 5, 5], STOP, [5, 5, 2], None),
        (dict(max_tokens=10), {2, 3}, [3, 2], STOP, [3], None),
        (dict(max_tokens=10), set(), [2, 2, 5, 5, 5, 5, 5, 5, 5, 5], LENGTH, [2, 2] + [5] * 8, None),
        # stop_token_ids: stop_reason is the id
        (dict(max_tokens=10, stop_token_ids=[9]), set(), [5, 9, 5], STOP, [5, 9], 9),
        (dict(max_tokens=10, stop_token_ids=[8, 9]), {2}, [8, 2], STOP, [8], 8),
        # max_tokens
        (dict(max_tokens=3), {2}, [5, 5, 5, 5], LENGTH, [5, 5, 5], None),
        (dict(max_tokens=1), set(), [5], LENGTH, [5], None),
        # a stop token on the last allowed token still counts as a stop
        (dict(max_tokens=2, stop_token_ids=[9]), set(), [5, 9], STOP, [5, 9], 9),
        (dict(max_tokens=2), {2}, [5, 2], STOP, [5, 2], None),
        # ignore_eos: EOS does not stop, but stop_token_ids still do
        (dict(max_tokens=4, ignore_eos=True), {2}, [2, 2, 2, 2, 2], LENGTH, [2] * 4, None),
        (dict(max_tokens=4, ignore_eos=True, stop_token_ids=[2]), {2}, [5, 2], STOP, [5, 2], 2),
        # min_tokens: EOS and stop ids are ignored for the first min_tokens tokens
        (dict(max_tokens=10, min_tokens=2), {2}, [2, 2, 2, 2], STOP, [2, 2, 2], None),
        (dict(max_tokens=10, min_tokens=1), {2}, [2, 5, 2], STOP, [2, 5, 2], None),
        (dict(max_tokens=10, min_tokens=3, stop_token_ids=[9]), set(), [9, 9, 9, 9], STOP, [9] * 4, 9),
        # min_tokens never extends past max_tokens
        (dict(max_tokens=3, min_tokens=3), {2}, [2, 2, 2, 2], LENGTH, [2, 2, 2], None),
    ],
)
def test_stop_conditions(params, eos, tokens, status, outputs, stop_reason):
    s = make_scheduler()
    r = make_request("A", 5, eos=frozenset(eos), **params)
    s.add_request(r)
    run_all(s, token=sequence_runner(r, tokens))
    assert r.status == status
    assert r.output_token_ids == outputs
    assert r.stop_reason == stop_reason
    assert r.all_token_ids == r.prompt_token_ids + outputs
    assert s.kv.num_free_blocks == s.kv.pool.num_blocks
    assert s.schedule().finished_req_ids == ["A"]


@pytest.mark.parametrize(
    "params, eos, sampled, status, outputs",
    [
        (dict(max_tokens=10), {2}, [5, 2, 6, 7], RequestStatus.FINISHED_STOPPED, [5, 2]),
        (dict(max_tokens=2), set(), [5, 6, 7], RequestStatus.FINISHED_LENGTH, [5, 6]),
        (dict(max_tokens=10, stop_token_ids=[6]), set(), [5, 6, 6], RequestStatus.FINISHED_STOPPED, [5, 6]),
        (dict(max_tokens=10), {2}, [5, 6, 7], RequestStatus.RUNNING, [5, 6, 7]),
    ],
)
def test_tokens_after_a_stop_in_one_output_are_dropped(params, eos, sampled, status, outputs):
    """A runner may return several tokens for a segment (lookahead): the first stop ends the request."""
    s = make_scheduler()
    r = make_request("A", 4, eos=frozenset(eos), **params)
    s.add_request(r)
    so = s.schedule()
    updated = s.update_from_output(so, ModelRunnerOutput(req_ids=["A"], sampled_token_ids=[sampled]))
    assert updated == [r]
    assert r.status == status
    assert r.output_token_ids == outputs
    assert r.num_steps == 1


def test_finished_request_is_in_the_updated_list_of_its_last_step():
    s = make_scheduler()
    r = make_request("A", 4, max_tokens=2)
    s.add_request(r)
    _, updated = step(s)
    assert updated == [r] and r.status == RequestStatus.RUNNING
    _, updated = step(s)
    assert updated == [r] and r.status == RequestStatus.FINISHED_LENGTH
    assert r.status.finish_reason == "length"


@pytest.mark.parametrize(
    "max_model_len, prompt_len, max_tokens, expected_outputs",
    [(10, 6, 100, 4), (10, 9, 100, 1), (10, 6, 2, 2), (10, 6, 4, 4), (64, 30, 40, 34)],
)
def test_generation_stops_at_max_model_len(max_model_len, prompt_len, max_tokens, expected_outputs):
    s = make_scheduler(max_model_len=max_model_len)
    r = make_request("A", prompt_len, max_tokens=max_tokens)
    s.add_request(r)
    run_all(s)
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert r.num_output_tokens == expected_outputs
    assert r.num_tokens <= max_model_len


# ---- num_steps ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt_len, budget, max_tokens, num_schedules",
    [(40, 16, 3, 5), (40, 40, 3, 3), (5, 1, 2, 6), (8, 512, 1, 1)],
)
def test_num_steps_counts_only_steps_with_a_token(prompt_len, budget, max_tokens, num_schedules):
    s = make_scheduler(budget=budget)
    r = make_request("A", prompt_len, max_tokens=max_tokens)
    s.add_request(r)
    outs = run_all(s)
    assert len(outs) == num_schedules
    assert r.num_steps == max_tokens
    assert r.timing.first_scheduled is not None and r.timing.first_token is not None
    assert r.timing.first_scheduled <= r.timing.first_token <= r.timing.finished


def test_segments_carry_the_sampling_params():
    s = make_scheduler()
    s.add_request(make_request("A", 4, temperature=0.7, top_p=0.9, top_k=5, seed=42))
    so = s.schedule()
    [seg] = so.scheduled
    assert (seg.temperature, seg.top_p, seg.top_k, seg.seed) == (0.7, 0.9, 5, 42)


def test_empty_schedule_when_idle():
    s = make_scheduler()
    so = s.schedule()
    assert so.is_empty and so.num_scheduled_tokens == 0
    assert s.update_from_output(so, ModelRunnerOutput(req_ids=[], sampled_token_ids=[])) == []


def test_packages_import_without_torch_or_engine():
    code = (
        "import sys, lookahead_serve.kv_cache, lookahead_serve.scheduler.scheduler, lookahead_serve.kv_cache.manager\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith('lookahead_serve.engine'))\n"
        "assert not bad, bad\n"
    )
    repo_root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=repo_root)


@pytest.mark.parametrize("max_tokens", [1, 3])
def test_a_request_that_ends_now_leaves_its_prompt_cached(max_tokens):
    """Its full blocks join the prefix cache before the finish frees them: the same prompt again hits them."""
    s = make_scheduler(block_size=4)
    prompt = list(range(500, 522))  # 22 tokens: 5 full blocks
    s.add_request(make_request("a", prompt, max_tokens=max_tokens))
    run_all(s)
    assert not s.has_unfinished_requests()
    _, num_hit = s.kv.get_computed_blocks(prompt)
    assert num_hit == 20
    s.add_request(make_request("b", prompt, max_tokens=1))
    so, _ = step(s)
    assert so.scheduled[0].start_pos == 20 and len(so.scheduled[0].token_ids) == 2  # only the uncached tail
