"""Lookahead scheduling: step-cost model, window resize, ladder, acceptance model and the policy.

Pure Python with fake cost models: memory-bound steps get full lookahead, compute-bound steps plain
decoding, low-acceptance requests lose their share first, and the budget is never exceeded.
"""

from __future__ import annotations

import copy
import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead_serve.kv_cache import KVCacheManager
from lookahead_serve.scheduler import LookaheadParams, LookaheadState, NGramPool, Request, SamplingParams, Scheduler, SchedulerConfig
from lookahead_serve.scheduler.batch import ModelRunnerOutput
from lookahead_serve.scheduler.config import LookaheadConfig
from lookahead_serve.scheduler.cost import StepCostModel
from lookahead_serve.scheduler.lookahead import LookaheadLayout, step_tokens
from lookahead_serve.scheduler.objective import makespan_values
from lookahead_serve.scheduler.policy import (
    PRIOR_HIT_RATE,
    WINDOW_VALUE,
    AcceptanceModel,
    AdaptivePolicy,
    FixedPolicy,
    LookaheadCostCheck,
    Option,
    ladder,
    prior_gain,
)

MAX = LookaheadParams(15, 5, 15)


def flat_cost(seconds: float = 0.01) -> StepCostModel:
    """Memory bound: a step costs the same whatever its tokens (up to 4096)."""
    return StepCostModel([1, 4096], [seconds, seconds], learning_rate=0.0)


def linear_cost(per_token: float = 0.001) -> StepCostModel:
    """Compute bound: a step costs in proportion to its tokens."""
    return StepCostModel([1, 4096], [per_token, 4096 * per_token], learning_rate=0.0)


# ---- step-cost model -----------------------------------------------------------------------------


def test_cost_model_interpolates_and_extrapolates():
    m = StepCostModel([1, 16, 32], [0.010, 0.012, 0.020], per_segment=0.001, learning_rate=0.0)
    assert m.predict(1) == pytest.approx(0.010)
    assert m.predict(16) == pytest.approx(0.012)
    assert m.predict(24) == pytest.approx(0.016)
    assert m.predict(48) == pytest.approx(0.028)  # the last slope, extended
    assert m.predict(16, num_segments=3) == pytest.approx(0.015)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0.0, 0.1), min_size=1, max_size=5), st.tuples(*[st.floats(0.0, 0.01)] * 3),
       st.integers(1, 5000), st.integers(0, 40), st.integers(0, 40))
def test_cost_model_predicts_its_features_times_its_parameters(seconds, per, tokens, segments, decodes):
    # ``predict`` sums the features without building them; the live fit updates along the features.
    knots = [1, 16, 64, 512, 4096][: len(seconds)]
    m = StepCostModel(knots, seconds, per_segment=per[0], per_decode=per[1], decode_overhead=per[2])
    by_features = max(sum(m._theta[i] * w for i, w in m._features(tokens, segments, decodes)), 0.0)
    assert m.predict(tokens, segments, decodes) == pytest.approx(by_features, rel=1e-12, abs=1e-15)


def test_cost_model_follows_observed_steps_and_reports_its_error():
    m = StepCostModel([1, 64], [0.010, 0.050], per_decode=0.001, learning_rate=0.2)
    for _ in range(60):
        m.observe(64, 0, 0.100)  # the machine got twice as slow
    assert m.predict(64) == pytest.approx(0.100, rel=0.02)
    assert m.num_observed == 60 and 0 < m.mean_abs_rel_error < 0.5
    frozen = StepCostModel([1, 64], [0.010, 0.050], learning_rate=0.0)
    assert frozen.observe(64, 0, 0.080) == pytest.approx(0.050)
    assert frozen.predict(64) == pytest.approx(0.050)


KNOTS = [1, 2, 4, 8, 16, 32, 64]
# (tokens, looped segments, plain decodes): a plain step, lookahead steps at c=1, 16 plain decodes, a mix.
SHAPES = [(1, 0, 1), (12, 1, 0), (16, 1, 0), (16, 0, 16), (40, 4, 0), (20, 2, 14)]


def _truth(slowdown: float = 1.0) -> StepCostModel:
    seconds = [slowdown * s for s in (0.030, 0.032, 0.033, 0.035, 0.040, 0.050, 0.080)]
    return StepCostModel(KNOTS, seconds, per_segment=0.005 * slowdown, per_decode=0.001 * slowdown,
                         decode_overhead=0.012 * slowdown, learning_rate=0.0)


def test_cost_model_fits_decode_heavy_and_lookahead_steps_apart():
    # Profiled wrong in shape: no decode overhead, segments three times too dear, knots off by 30%.
    m = StepCostModel(KNOTS, [0.020, 0.040, 0.040, 0.040, 0.050, 0.060, 0.090], per_segment=0.016, per_decode=0.001)
    truth, rng = _truth(), random.Random(0)
    for _ in range(300):
        shape = rng.choice(SHAPES)
        m.observe(shape[0], shape[1], truth.predict(*shape) * rng.gauss(1.0, 0.05), shape[2])
    for shape in SHAPES:  # 16 decodes and a 16-token segment share a knot; each is predicted within 5%
        assert m.predict(*shape) == pytest.approx(truth.predict(*shape), rel=0.05), shape
    slow, before = _truth(1.25), m.predict(64, 2, 0)
    for _ in range(300):  # the whole machine slows by 25%; the model follows
        shape = rng.choice(SHAPES[:3])
        m.observe(shape[0], shape[1], slow.predict(*shape) * rng.gauss(1.0, 0.05), shape[2])
    for shape in SHAPES[:3]:
        assert m.predict(*shape) == pytest.approx(slow.predict(*shape), rel=0.05), shape
    assert m.predict(64, 2, 0) > 1.1 * before  # a shape it no longer sees moves with the machine


def test_a_scaled_cost_model_makes_the_same_decisions():
    def model(f: float) -> StepCostModel:
        return StepCostModel([1, 64, 4096], [f * 0.010, f * 0.012, f * 40.0], per_segment=f * 0.001,
                             per_decode=f * 0.0002, decode_overhead=f * 0.003, learning_rate=0.0)

    opts = [_options(m) for m in (0.1, 3.0, 0.2, 2.5, 1.0)]
    assert AdaptivePolicy(model(1.0)).choose(opts, 5, 0, 5, 4096).choices == AdaptivePolicy(model(3.7)).choose(
        opts, 5, 0, 5, 4096).choices


@pytest.mark.parametrize(
    ("knots", "seconds", "kw"),
    [([], [], {}), ([1, 2], [0.1], {}), ([2, 1], [0.1, 0.2], {}), ([0, 4], [0.1, 0.2], {}),
     ([1, 4], [-0.1, 0.2], {}), ([1, 4], [0.1, 0.2], {"learning_rate": 2.0}),
     ([1, 4], [0.1, 0.2], {"decode_overhead": -0.01})],
)
def test_cost_model_rejects_bad_shapes(knots, seconds, kw):
    with pytest.raises(ValueError):
        StepCostModel(knots, seconds, **kw)


# ---- pool and window resize ----------------------------------------------------------------------


def test_pool_keeps_shorter_ngrams_and_cuts_longer_ones_to_the_asked_length():
    pool = NGramPool(ngram_size=5, cap=8)
    pool.add([1, 2, 3, 4, 5])
    pool.add([1, 2, 3, 9])  # from a window run at n = 4
    pool.add([1, 7, 8])
    pool.add([1])  # nothing to continue: ignored
    pool.add([1, 2, 3, 4, 5, 6])  # longer than the pool's n: ignored
    assert len(pool) == 3
    assert pool.lookup(1, 8) == [(2, 3, 4, 5)]  # default length N-1 = 4
    assert pool.lookup(1, 8, 3) == [(2, 3, 9), (2, 3, 4)]
    assert pool.lookup(1, 8, 2) == [(7, 8), (2, 3)]  # (2, 3) once, though two n-grams give it
    assert pool.lookup(1, 1, 2) == [(7, 8)]


def _state(w: int = 5, n: int = 4, max_n: int = 5) -> LookaheadState:
    return LookaheadState(w, n, 5, list(range(100, 140)), frozenset(), seed=1, max_ngram_size=max_n)


def _advance(state: LookaheadState, x: int, rng: random.Random) -> None:
    layout, tokens = state.plan(x, 5)
    assert layout.num_levels == len(state.levels) and layout.num_cols == state.num_cols
    assert layout.num_window_tokens == layout.num_levels * layout.num_cols
    assert len(tokens) == layout.num_tokens
    state.update(x, [rng.randrange(100, 140) for _ in range(layout.num_last_level)], [x + 1])


def test_resize_keeps_the_window_consistent_and_warms_back_up():
    rng = random.Random(0)
    s = _state()
    for x in range(3):  # warm at (5, 4): 3 levels of 5 columns
        _advance(s, x, rng)
    assert s.warm and (len(s.levels), s.num_cols) == (3, 5)
    s.resize(3, 4)  # narrower: every level cut to 3 columns
    assert s.warm and (len(s.levels), s.num_cols) == (3, 3)
    assert len(s.levels[0]) == 2 and all(len(lvl) == 3 for lvl in s.levels[1:])
    s.resize(3, 3)  # fewer levels: the top one goes
    assert s.warm and (len(s.levels), s.num_cols) == (2, 3)
    s.resize(6, 5)  # more levels than it has: warm-up again, one column more per level still to come
    assert not s.warm and s.shape_after_resize(6, 5) == (2, 8) and (len(s.levels), s.num_cols) == (2, 8)
    for x in range(2):
        _advance(s, x, rng)
    assert s.warm and (len(s.levels), s.num_cols) == (4, 6)
    layout, _ = s.plan(0, 5)
    assert layout.num_tokens == step_tokens(6, 5, layout.num_candidates)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(2, 9), st.integers(3, 6)), min_size=1, max_size=12), st.integers(0, 99))
def test_any_resize_sequence_gives_valid_segments(shapes, seed):
    rng = random.Random(seed)
    s = _state(4, 3, max_n=6)
    for w, n in shapes:
        levels, cols = s.shape_after_resize(w, n)
        s.resize(w, n)
        assert (len(s.levels), s.num_cols) == (levels, cols)
        assert len(s.levels[0]) == cols - 1 and all(len(lvl) == cols for lvl in s.levels[1:])
        assert cols == w + (n - 1) - levels >= w  # columns reach W exactly when the levels reach N-1
        _advance(s, rng.randrange(100, 140), rng)


def test_resize_rejects_sizes_beyond_the_pool():
    with pytest.raises(ValueError, match="ngram_size"):
        _state(max_n=5).resize(4, 6)
    with pytest.raises(ValueError, match="window_size"):
        _state().resize(1, 3)


# ---- ladder and acceptance -------------------------------------------------------------------------


def test_ladder_climbs_to_the_maximum_with_rising_gain():
    rungs = ladder(MAX)
    assert rungs[-1] == MAX and len(rungs) >= 4
    tokens = [step_tokens(p.window_size, p.ngram_size, p.verification_set_size) for p in rungs]
    assert tokens == sorted(tokens)
    for kind in ([p for p in rungs if p.window_size], [p for p in rungs if p.verify_only]):
        gains = [prior_gain(p.window_size, p.ngram_size, p.verification_set_size) for p in kind]
        assert len(kind) >= 4 and gains == sorted(gains) and len(set(gains)) == len(gains)
    assert all(p.window_size <= 15 and p.ngram_size <= 5 and p.verification_set_size <= 15 for p in rungs)
    assert ladder(LookaheadParams(enabled=False)) == ()
    assert ladder(LookaheadParams(2, 3, 1)) == (LookaheadParams(0, 3, 1), LookaheadParams(2, 3, 1))


def test_verification_only_rungs():
    # Beside every window size's candidate count, verification alone (no window tokens): fewer tokens, and
    # less gain than the window of the same g, whose n-grams also serve later steps.
    rungs = ladder(LookaheadParams(4, 3, 4))
    assert LookaheadParams(0, 3, 4) in rungs and LookaheadParams(4, 3, 4) in rungs
    assert step_tokens(0, 3, 4) == 9 < step_tokens(4, 3, 4) == 16
    assert 0 < prior_gain(0, 3, 4) < prior_gain(4, 3, 4)
    # A maximum without a window climbs verification-only rungs to itself.
    only = ladder(LookaheadParams(0, 4, 7))
    assert only[-1] == LookaheadParams(0, 4, 7) and all(p.verify_only for p in only) and len(only) >= 3
    # Without candidates a verification-only step is worth nothing; a window step still its window.
    model = AcceptanceModel()
    assert model.expected_extra(LookaheadParams(0, 3, 4), num_found=0) == 0.0
    assert model.expected_extra(LookaheadParams(4, 3, 4), num_found=0) > 0.0


def test_acceptance_learns_from_the_request_and_returns_to_the_prior_when_plain():
    a = AcceptanceModel()
    p = LookaheadParams(7, 5, 7)
    assert a.multiplier == 1.0
    for _ in range(30):
        a.observe(p, 1)  # never accepts anything
    low = a.multiplier
    assert low < 0.25
    for _ in range(500):
        a.observe(None, 1)
    assert 0.9 < a.multiplier <= 1.0  # plain steps fade the evidence: the request gets tried again
    b = AcceptanceModel()
    for _ in range(30):
        b.observe(p, 4)  # code-like: 3 extra tokens a step
    assert 2.5 < b.expected_extra(LookaheadParams(0, 5, 7)) < 3.1  # verifying as many candidates again
    assert b.expected_extra(p) > b.expected_extra(LookaheadParams(0, 5, 7))  # and the window's n-grams too


def test_acceptance_starts_from_the_given_prior_and_a_few_dry_steps_do_not_end_lookahead():
    p = LookaheadParams(4, 3, 4)
    a = AcceptanceModel(prior_multiplier=2.0)
    assert a.multiplier == 2.0 and a.expected_extra(p) == pytest.approx(2 * prior_gain(4, 3, 4) / PRIOR_HIT_RATE)
    for _ in range(5):
        a.observe(p, 1)  # a dry spell: candidates found, none accepted
    assert a.multiplier > 1.0  # still above the prior's 1x: bursts do not flip the decision


def test_a_step_without_candidates_is_worth_its_window_only():
    p = LookaheadParams(4, 3, 4)
    a = AcceptanceModel()
    for _ in range(20):
        a.observe(p, 2)  # one extra token a step with candidates
    m = a.multiplier
    for _ in range(20):
        a.observe(p, 1, num_found=0)  # nothing to verify: says nothing about acceptance
    assert a.multiplier == pytest.approx(m, rel=0.1)
    with_candidates, window_only = a.expected_extra(p), a.expected_extra(p, num_found=0)
    assert 0.8 < with_candidates < 1.1
    assert window_only == pytest.approx(with_candidates * WINDOW_VALUE * PRIOR_HIT_RATE)


# ---- the policy ----------------------------------------------------------------------------------------


def _options(multiplier: float = 1.0, maximum: LookaheadParams = MAX) -> list[Option]:
    return [Option(p, step_tokens(p.window_size, p.ngram_size, p.verification_set_size),
                   multiplier * prior_gain(p.window_size, p.ngram_size, p.verification_set_size)) for p in ladder(maximum)]


def test_memory_bound_steps_get_full_lookahead():
    opts = [_options() for _ in range(8)]
    d = AdaptivePolicy(flat_cost()).choose(opts, base_tokens=8, base_segments=0, base_yield=8, budget=4096)
    assert d.choices == [len(o) - 1 for o in opts]
    assert d.num_tokens == 8 + 8 * (step_tokens(15, 5, 15) - 1)


def test_compute_bound_steps_decode_plainly():
    d = AdaptivePolicy(linear_cost()).choose([_options() for _ in range(8)], 8, 0, 8, 4096)
    assert d.choices == [None] * 8 and d.num_tokens == 8


def test_low_acceptance_requests_lose_their_share_first():
    # Cheap up to 64 tokens, then a token costs what a whole small step does: room for a few segments only.
    cost = StepCostModel([1, 64, 4096], [0.010, 0.012, 0.012 + 4032 * 0.010], learning_rate=0.0)
    mults = [0.1, 3.0, 0.2, 2.5, 0.1, 2.0]
    d = AdaptivePolicy(cost).choose([_options(m) for m in mults], 6, 0, 6, 4096)
    got = [c is not None for c in d.choices]
    assert got == [False, True, False, True, False, True]
    assert d.num_tokens <= 64 + 20


def test_per_segment_cost_counts_against_lookahead():
    cheap = AdaptivePolicy(StepCostModel([1, 4096], [0.010, 0.010], per_segment=0.0, learning_rate=0.0))
    dear = AdaptivePolicy(StepCostModel([1, 4096], [0.010, 0.010], per_segment=0.050, learning_rate=0.0))
    opts = [_options() for _ in range(4)]
    assert all(c is not None for c in cheap.choose(opts, 4, 0, 4, 4096).choices)
    assert all(c is None for c in dear.choose(opts, 4, 0, 4, 4096).choices)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0.0005, 0.05), min_size=3, max_size=3),
    st.lists(st.floats(0.0, 5.0), min_size=1, max_size=12),
    st.integers(0, 400),
    st.integers(1, 40),
)
def test_budget_is_never_exceeded_and_the_rate_never_falls(increments, mults, budget, base):
    seconds = [increments[0], increments[0] + increments[1], increments[0] + increments[1] + increments[2]]
    cost = StepCostModel([1, 32, 512], seconds, learning_rate=0.0)
    opts = [_options(m, LookaheadParams(7, 5, 7)) for m in mults]
    d = AdaptivePolicy(cost).choose(opts, base + len(mults), 0, base, budget)
    assert d.num_tokens - (base + len(mults)) <= budget
    chosen = [opts[r][c] for r, c in enumerate(d.choices) if c is not None]
    assert d.num_tokens == base + len(mults) + sum(o.num_tokens - 1 for o in chosen)
    assert d.predicted_seconds == pytest.approx(cost.predict(d.num_tokens, len(chosen)))
    plain_rate = base / cost.predict(base + len(mults))
    assert d.expected_tokens / d.predicted_seconds >= plain_rate * (1 - 1e-9)


def test_exploration_tries_the_cheapest_rung_of_the_most_promising_request_now_and_then():
    policy = AdaptivePolicy(linear_cost(), explore_every=4)
    opts = [_options(0.5), _options(2.0)]
    picks = [policy.choose(opts, 2, 0, 2, 4096).choices for _ in range(8)]
    assert picks[0] == picks[1] == picks[2] == picks[4] == [None, None]
    assert picks[3] == picks[7] == [None, 0]  # the request with the better acceptance, its cheapest rung
    assert AdaptivePolicy(linear_cost(), explore_every=1).choose(opts, 2, 0, 2, budget=2).choices == [None, None]


def test_exploration_backs_off_while_it_does_not_pay():
    policy = AdaptivePolicy(linear_cost(), explore_every=4)
    opts = [_options(0.5), _options(2.0)]

    def explored_at() -> list[int]:
        return [i for i in range(200) if policy.choose(opts, 2, 0, 2, 4096).explored]

    assert explored_at()[:3] == [3, 7, 11]
    policy.exploration_paid(False)
    policy.exploration_paid(False)
    assert policy.explore_interval == 16
    gaps = explored_at()
    assert gaps[1] - gaps[0] == 16
    for _ in range(10):
        policy.exploration_paid(False)
    assert policy.explore_interval == 4 * AdaptivePolicy.MAX_EXPLORE_BACKOFF  # it never stops altogether
    policy.exploration_paid(True)
    assert policy.explore_interval == 4


def test_the_scheduler_reports_whether_an_explored_step_paid():
    # Compute bound: exploration is the only lookahead. The fake model accepts nothing beyond x, so no
    # explored step pays, and exploration backs off; one that accepts a whole candidate pays.
    s = _adaptive_scheduler(StepCostModel([1, 4096], [0.01, 0.01 + 4095 * 0.002], learning_rate=0.1))
    s.planner.policy = AdaptivePolicy(s.planner.cost_model, explore_every=2)
    for i in range(2):
        s.add_request(_request(f"r{i}"))

    def run(steps: int, accepted: list[int]) -> int:
        explored = 0
        for _ in range(steps):
            so = s.schedule()
            stats = replace(so.stats, seconds=so.stats.predicted_seconds)
            sampled = [(accepted if seg.lookahead else [5]) if seg.sample else [] for seg in so.scheduled]
            window = [[5] * (seg.lookahead.num_last_level if seg.lookahead else 0) for seg in so.scheduled]
            s.update_from_output(so, ModelRunnerOutput([g.req_id for g in so.scheduled], sampled, window), stats)
            explored += stats.explored
        return explored

    assert run(12, [5]) >= 2 and s.planner.policy.explore_interval > 2
    run(s.planner.policy.explore_interval + 1, [5, 6, 7])  # two extra tokens for a few more tokens' time
    assert s.planner.policy.explore_interval == 2


def test_the_policy_plans_with_the_expected_gain_and_explores_by_the_optimistic_one():
    # Request 0's optimistic 3 extra tokens would pay for its 16-token rung (5 tokens in 21 ms against 2 in
    # 11 ms), its expected 0.5 does not; request 1 expects more (0.6) but has less upside (0.8).
    cost = StepCostModel([1, 16, 32, 4096], [0.010, 0.020, 0.040, 1.0], learning_rate=0.0)
    p = LookaheadParams(4, 3, 4)
    opts = [[Option(p, 16, 0.5, 3.0)], [Option(p, 16, 0.6, 0.8)]]
    assert AdaptivePolicy(cost).choose(opts, 2, 0, 2.0, 4096).choices == [None, None]
    as_expected = [[Option(p, 16, 3.0)], [Option(p, 16, 0.8)]]  # the optimistic figures, planned with
    assert AdaptivePolicy(cost).choose(as_expected, 2, 0, 2.0, 4096).choices == [0, None]
    assert AdaptivePolicy(cost, explore_every=1).choose(opts, 2, 0, 2.0, 4096).choices == [0, None]


def test_fixed_policy_runs_each_maximum_while_the_budget_lasts():
    opts = [_options() for _ in range(3)]
    d = FixedPolicy().choose(opts, 3, 0, 3, budget=2 * (step_tokens(15, 5, 15) - 1))
    assert d.choices == [len(opts[0]) - 1, len(opts[1]) - 1, None]


# ---- the scheduler with the adaptive policy -------------------------------------------------------------


def _adaptive_scheduler(cost: StepCostModel, budget: int = 2048, num_blocks: int = 256) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_model_len=512,
                          lookahead=LookaheadConfig(default=MAX, policy="adaptive", explore_every=0))
    return Scheduler(cfg, KVCacheManager(num_blocks, 4), cost)


def _request(rid: str, n: int = 12) -> Request:
    return Request(rid, [sum(map(ord, rid)) % 50 + i for i in range(n)], SamplingParams(temperature=0, max_tokens=64))


def _run(s: Scheduler, steps: int) -> list:
    outs = []
    for _ in range(steps):
        so = s.schedule()
        assert so.num_scheduled_tokens <= s.config.max_num_batched_tokens
        assert so.num_scheduled_tokens == sum(len(seg.token_ids) for seg in so.scheduled)
        sampled = [[5] if seg.sample else [] for seg in so.scheduled]
        window = [[5] * (seg.lookahead.num_last_level if seg.lookahead else 0) for seg in so.scheduled]
        s.update_from_output(so, ModelRunnerOutput([g.req_id for g in so.scheduled], sampled, window))
        outs.append(so)
    return outs


def test_adaptive_scheduler_follows_the_cost_model():
    s = _adaptive_scheduler(flat_cost())
    for i in range(4):
        s.add_request(_request(f"r{i}"))
    outs = _run(s, 3)
    assert all(seg.lookahead is not None for seg in outs[-1].scheduled)
    s = _adaptive_scheduler(linear_cost())
    for i in range(4):
        s.add_request(_request(f"r{i}"))
    outs = _run(s, 3)
    assert all(seg.lookahead is None for so in outs for seg in so.scheduled)


def test_a_request_with_candidates_runs_lookahead_and_one_without_decodes_plainly():
    # 5% of a decode per token beyond the first: a window alone (nothing to verify) does not pay for itself,
    # a window with candidates does.
    s = _adaptive_scheduler(StepCostModel([1, 512], [1.0, 1.0 + 0.05 * 511], learning_rate=0.0))
    params = SamplingParams(temperature=0, max_tokens=64)
    s.add_request(Request("hit", [9, 5, 6, 7, 8, 1, 2, 3], params))  # 5 is followed by 6 7 8 1 in the prompt
    s.add_request(Request("miss", [20 + i for i in range(8)], params))
    step = _run(s, 2)[-1]  # the prefill samples 5 for both, then the first decode step
    hit, miss = step.scheduled
    assert hit.lookahead is not None and hit.lookahead.num_candidates > 0
    assert miss.lookahead is None


def test_verification_only_where_a_window_costs_more_than_it_buys():
    # Two requests whose pools hold candidates: when a step's tokens are dear, verifying them alone (9
    # tokens) beats carrying a window too (16); when tokens are free, the window's n-grams are worth having.
    opts = [[Option(p, step_tokens(p.window_size, p.ngram_size, p.verification_set_size), AcceptanceModel().expected_extra(p))
             for p in (LookaheadParams(0, 3, 4), LookaheadParams(4, 3, 4))] for _ in range(2)]
    dear = StepCostModel([1, 512], [1.0, 1.0 + 0.02 * 511], learning_rate=0.0)
    assert AdaptivePolicy(dear).choose(opts, 2, 0, 2, 4096).choices == [0, 0]
    assert AdaptivePolicy(flat_cost()).choose(opts, 2, 0, 2, 4096).choices == [1, 1]


def test_every_rung_offered_plans_the_segment_it_claims():
    """A request's options (a table shared by requests in the same state) take the step tokens their
    segments really take, verify only what the pool holds, stop short of the model's last position, and
    scale with what the request's tokens are worth."""
    s = _adaptive_scheduler(flat_cost())
    params = SamplingParams(temperature=0, max_tokens=64)
    prompt = [9, 5, 6, 7, 8, 5, 6, 2, 3, 4, 11, 12]  # 5 is followed by "6 7 8" and "6 2 3"
    s.add_request(Request("a", prompt, params))
    s.add_request(Request("b", list(prompt), params))
    _run(s, 1)  # the prefill samples 5 for both
    a, b = s.requests["a"], s.requests["b"]
    opts = s.planner._options(a)
    assert [(o.params, o.num_tokens) for o in opts] == [(o.params, o.num_tokens) for o in s.planner._options(b)]
    assert MAX in [o.params for o in opts]
    verify = [o.params for o in opts if o.params.verify_only]
    assert verify and len(set(verify)) == len(verify) and all(p.verification_set_size <= 2 for p in verify)
    for o in opts:
        state = copy.deepcopy(a.lookahead)
        if o.params.verify_only:
            layout, tokens = state.plan_verify(5, o.params.ngram_size, o.params.verification_set_size)
        else:
            state.resize(o.params.window_size, o.params.ngram_size)
            layout, tokens = state.plan(5, o.params.verification_set_size)
        assert layout.num_tokens == len(tokens) == o.num_tokens, o.params
    half = s.planner._options(a, 0.5)
    assert [o.expected_extra for o in half] == [o.expected_extra * 0.5 for o in opts]
    assert [o.optimistic_extra for o in half] == [o.optimistic_extra * 0.5 for o in opts]
    a.num_computed_tokens = s.config.max_model_len - 8  # as if near the end: only short segments fit
    near = s.planner._options(a)
    assert near and MAX not in [o.params for o in near]
    assert {o.params for o in near} < {o.params for o in opts}


def test_a_verification_only_request_runs_the_pool_and_nothing_else():
    cfg = SchedulerConfig(max_num_batched_tokens=256, max_model_len=512,
                          lookahead=LookaheadConfig(default=LookaheadParams(0, 5, 4), policy="fixed"))
    s = Scheduler(cfg, KVCacheManager(64, 4))
    params = SamplingParams(temperature=0, max_tokens=64)
    s.add_request(Request("hit", [9, 5, 6, 7, 8, 1, 2, 3], params))  # 5 is followed by 6 7 8 1 in the prompt
    s.add_request(Request("miss", [20 + i for i in range(8)], params))
    hit, miss = _run(s, 2)[-1].scheduled  # the prefill samples 5 for both, then the first decode step
    assert hit.lookahead == LookaheadLayout(0, 1, 1, 4) and hit.token_ids == [5, 6, 7, 8, 1]
    assert miss.lookahead is None  # nothing to verify: a plain decode
    assert _run(s, 0) == [] and s.planner.policy.name == "fixed"


def test_switching_policy_between_steps_takes_effect_on_the_next_step():
    s = _adaptive_scheduler(linear_cost())  # compute bound: adaptive decodes plainly
    for i in range(2):
        s.add_request(_request(f"r{i}"))
    assert all(seg.lookahead is None for so in _run(s, 2) for seg in so.scheduled)
    s.planner.set_policy("fixed")
    assert s.planner.config.policy == "fixed"
    assert all(seg.lookahead is not None for seg in _run(s, 1)[0].scheduled)
    s.planner.set_policy("adaptive")
    assert all(seg.lookahead is None for seg in _run(s, 1)[0].scheduled)
    with pytest.raises(ValueError, match="lookahead policy"):
        s.planner.set_policy("greedy")
    plain = Scheduler(SchedulerConfig(max_model_len=64, lookahead=LookaheadConfig(policy="fixed")), KVCacheManager(16, 4))
    with pytest.raises(ValueError, match="step-cost model"):
        plain.planner.set_policy("adaptive")
    with pytest.raises(ValueError, match="step-cost model"):
        Scheduler(SchedulerConfig(max_model_len=64), KVCacheManager(16, 4))  # adaptive, the default



def test_exploration_backed_off_carries_over_a_policy_switch():
    cfg = _adaptive_scheduler(linear_cost()).config
    cfg = replace(cfg, lookahead=replace(cfg.lookahead, explore_every=4))
    s = Scheduler(cfg, KVCacheManager(256, 4), linear_cost())
    planner = s.planner
    for _ in range(3):
        planner.policy.exploration_paid(False)
    planner.set_policy("fixed")
    planner.set_policy("adaptive")
    assert planner.policy.explore_interval == 32  # not back to 4, as a server that never switched
    planner.policy.exploration_paid(True)
    planner.config = replace(planner.config, explore_every=8)  # a new base interval starts afresh
    planner.set_policy("adaptive")
    assert planner.policy.explore_every == planner.policy.explore_interval == 8

def test_prefill_keeps_its_place_in_the_budget():
    s = _adaptive_scheduler(flat_cost(), budget=64)
    s.add_request(_request("a"))
    _run(s, 2)  # "a" decodes with lookahead, which could fill the whole budget
    s.add_request(_request("b", n=40))
    so = s.schedule()
    by_id = {seg.req_id: seg for seg in so.scheduled}
    assert len(by_id["b"].token_ids) == 40  # the new prompt's prefill came first
    assert so.num_scheduled_tokens <= 64


def test_lookahead_never_preempts_when_blocks_are_short():
    # 8 blocks of 4: two 12-token prompts, then their next tokens, fill all 8; a lookahead segment would
    # need a fifth block for its accepted tokens, so both decode plainly and nobody is preempted.
    s = _adaptive_scheduler(flat_cost(), num_blocks=8)
    for rid in "ab":  # the fake model outputs 5, and the pool has continuations of 5: candidates to verify
        s.add_request(Request(rid, [5, 6, 7, 8, 9] * 2 + [1, 2], SamplingParams(temperature=0, max_tokens=64)))
    outs = _run(s, 3)
    assert s.num_preemptions == 0
    assert all(seg.lookahead is None for so in outs for seg in so.scheduled)
    assert [len(seg.token_ids) for seg in outs[-1].scheduled] == [1, 1]


def test_all_lookahead_wins_where_no_single_upgrade_pays():
    # A step of segments alone skips the plain-decode path (10 ms here), so only upgrading every request
    # pays: one upgrade costs a segment and keeps the overhead (4.5 tokens in 24 ms < 4 in 20 ms), all
    # four drop it (6 tokens in 26 ms).
    cost = StepCostModel([1, 64, 4096], [0.010, 0.010, 1.0], per_segment=0.004, decode_overhead=0.010,
                         learning_rate=0.0)
    p = LookaheadParams(4, 3, 4)
    opts = [[Option(p, 16, 0.5)] for _ in range(4)]
    d = AdaptivePolicy(cost).choose(opts, 4, 0, 4.0, 4096, 4)
    assert d.choices == [0, 0, 0, 0] and d.num_decodes == 0 and d.num_tokens == 64
    assert d.predicted_seconds == pytest.approx(0.026)
    dear = StepCostModel([1, 64, 4096], [0.010, 0.030, 1.0], per_segment=0.004, decode_overhead=0.010,
                         learning_rate=0.0)
    assert AdaptivePolicy(dear).choose(opts, 4, 0, 4.0, 4096, 4).choices == [None] * 4


def test_optimism_shrinks_with_evidence():
    p = LookaheadParams(4, 3, 4)
    a = AcceptanceModel(prior_multiplier=0.75)
    first = a.optimistic_extra(p) / a.expected_extra(p)
    for i in range(100):
        a.observe(p, 2 if i % 2 else 1)  # half an extra token a step: about 0.77x the prior's 0.65
    assert 0.6 < a.multiplier < 0.9 and first > 1.4 and 1.0 < a.optimistic_extra(p) / a.expected_extra(p) < first


# ---- the makespan objective and the lookahead cost check -------------------------------------------------


def _closed_batch(objective: str, cost: StepCostModel, max_tokens: dict[str, int]) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=2048, max_model_len=512,
                          lookahead=LookaheadConfig(default=MAX, policy="adaptive", explore_every=0, objective=objective))
    s = Scheduler(cfg, KVCacheManager(256, 4), cost)
    for rid, n in max_tokens.items():  # the fake model outputs 5, and the pool has continuations of 5
        s.add_request(Request(rid, [5, 6, 7, 8, 9] * 2 + [1, 2], SamplingParams(temperature=0, max_tokens=n)))
    return s


def test_makespan_values_of_the_worked_example():
    values = makespan_values({"a": 100, "b": 100, "c": 90, "d": 60}, marginal_share=0.1, early_stop_share=0.0)
    assert values == pytest.approx({"a": 1.0, "b": 1.0, "c": 0.50, "d": 0.22}, abs=0.01)
    assert makespan_values({"a": 7, "b": 7}, 0.1, 0.5) == {"a": 1.0, "b": 1.0}  # alike: the throughput decision
    assert makespan_values({"a": 100, "b": 0}, 1.0, 0.0) == {"a": 1.0, "b": 1.0}  # a decode costs a whole step


def test_makespan_values_follow_the_chance_of_finishing_last():
    cost = StepCostModel([1, 512], [1.0, 1.0], per_decode=0.1 / 0.9 * 1.0, learning_rate=0.0)
    s = _closed_batch("makespan", cost, {"a": 101, "b": 101, "c": 91, "d": 61})
    s.planner.early_stops.early = 0.0  # every request so far ran to its bound
    _run(s, 1)  # the prefill: one token each, so 100, 100, 90 and 60 left
    # A plain decode adds 0.111 to a step of 4 x 0.111 + 1.0 (m / C = 0.077): the docstring's example.
    values = s.planner._token_values(4, 0, 4, s.running, bool(s.waiting))
    assert values["a"] == values["b"] == 1.0
    assert 1.0 > values["c"] > values["d"] > 0.0
    assert values["c"] == pytest.approx(0.49, abs=0.02) and values["d"] == pytest.approx(0.20, abs=0.02)
    s.planner.early_stops.early = s.planner.early_stops.ended  # every request so far stopped early: the bound tells little
    blurred = s.planner._token_values(4, 0, 4, s.running, bool(s.waiting))
    assert blurred["c"] > values["c"] and blurred["d"] > values["d"] + 0.3
    s.add_request(_request("waiting"))  # with a request waiting (max_num_seqs is 64, but it is not admitted
    # until the next step), every token is worth the same
    assert s.planner._token_values(4, 0, 4, s.running, bool(s.waiting)) is None
    t = _closed_batch("throughput", cost, {"a": 101, "b": 61})
    assert t.planner._token_values(2, 0, 2, t.running, False) is None


def test_makespan_gives_lookahead_to_the_request_that_would_finish_last():
    # A token costs 8% of a step: worth it for a request whose tokens count fully, not for one far ahead of
    # the other (it will finish first however fast it goes).
    cost = StepCostModel([1, 512], [1.0, 1.0 + 0.08 * 511], per_decode=0.1, learning_rate=0.0)
    spans = {"long": 64, "short": 16}
    throughput = _run(_closed_batch("throughput", cost, spans), 3)[-1].scheduled
    assert [seg.lookahead is not None for seg in throughput] == [True, True]
    s = _closed_batch("makespan", cost, spans)
    s.planner.early_stops.early = 0.0
    makespan = _run(s, 3)[-1].scheduled
    assert [(seg.req_id, seg.lookahead is not None) for seg in makespan] == [("long", True), ("short", False)]
    # Equally far from the end, the two objectives choose alike.
    for objective in ("throughput", "makespan"):
        s = _closed_batch(objective, cost, {"a": 64, "b": 64})
        assert [seg.lookahead is not None for seg in _run(s, 3)[-1].scheduled] == [True, True]


def test_the_share_of_early_stops_is_learnt_from_finished_requests():
    s = _closed_batch("makespan", flat_cost(), {"a": 2, "b": 2})
    assert s.planner.early_stops.share == pytest.approx(0.5)
    _run(s, 3)  # both run to max_tokens
    assert s.planner.early_stops.share < 0.5


def test_lookahead_cost_check_learns_the_ratio_of_observed_to_predicted_extra_cost():
    check = LookaheadCostCheck(decay=1.0, min_steps=3)
    for _ in range(2):
        check.observe(1.30, 1.20, 1.00)  # lookahead added 0.30 where 0.20 was predicted
    assert check.scale == 1.0  # too little evidence yet
    check.observe(1.30, 1.20, 1.00)
    check.observe(0.9, 0.95, 1.0)  # a step that costs less than plain says nothing here
    assert check.scale == pytest.approx(1.5)
    for _ in range(200):
        check.observe(2.0, 1.1, 1.0)
    assert check.scale == 2.0  # clamped


def test_the_policy_plans_lookahead_at_the_checked_cost():
    # 0.5% of a step per token: 0.2 extra tokens for 15 more tokens pay at the model's figure (2.2 tokens
    # in 1.075 steps' time), not at twice its lookahead cost (2.2 in 1.15).
    cost = StepCostModel([1, 512], [1.0, 1.0 + 0.005 * 511], learning_rate=0.0)
    opts = [[Option(LookaheadParams(4, 3, 4), 16, 0.2)] for _ in range(2)]
    policy = AdaptivePolicy(cost)
    assert policy.choose(opts, 2, 0, 2.0, 4096).choices == [0, 0]
    assert policy.choose(opts, 2, 0, 2.0, 4096, cost_scale=2.0).choices == [None, None]


def test_lookahead_inside_the_min_gain_runs_plain():
    # Two requests decoding plainly: 2 tokens in 1.005 s. Both at (4,3,4), 0.2 extra tokens each: 2.4 in
    # 1.155 s, 4.4% more tokens per second; 0.3 extra each: 13% more.
    cost = StepCostModel([1, 512], [1.0, 1.0 + 0.005 * 511], learning_rate=0.0)
    small = [[Option(LookaheadParams(4, 3, 4), 16, 0.2)] for _ in range(2)]
    large = [[Option(LookaheadParams(4, 3, 4), 16, 0.3)] for _ in range(2)]
    assert AdaptivePolicy(cost).choose(small, 2, 0, 2.0, 4096).choices == [0, 0]
    assert AdaptivePolicy(cost, min_gain=0.05).choose(small, 2, 0, 2.0, 4096).choices == [None, None]
    assert AdaptivePolicy(cost, min_gain=0.05).choose(large, 2, 0, 2.0, 4096).choices == [0, 0]
    # Exploration is not held to it.
    assert AdaptivePolicy(cost, explore_every=1, min_gain=0.5).choose(small, 2, 0, 2.0, 4096).choices != [None, None]


def test_the_scheduler_passes_the_configured_min_gain_to_the_policy():
    s = _adaptive_scheduler(StepCostModel([1, 512], [0.010, 0.0151], learning_rate=0.0))
    assert s.planner.policy.min_gain == LookaheadConfig().min_gain == 0.05
    s.planner.config = replace(s.planner.config, min_gain=0.2)
    s.planner.set_policy("adaptive")
    assert s.planner.policy.min_gain == 0.2


def test_the_cost_check_learns_from_the_adaptive_policys_steps_only():
    s = _adaptive_scheduler(StepCostModel([1, 512], [0.010, 0.0151], learning_rate=0.1))
    s.planner.set_policy("fixed")
    s.add_request(_request("a"))
    _run(s, 1)
    for _ in range(8):
        d = _run(s, 1)[0].stats
        assert d.predicted_seconds > d.plain_seconds > 0 and not d.adaptive
        s.planner.observe(replace(d, seconds=3 * d.predicted_seconds), 1)
    assert s.planner.lookahead_cost.weight == 0


def test_the_scheduler_feeds_the_cost_check_from_its_lookahead_steps():
    s = _adaptive_scheduler(StepCostModel([1, 512], [0.010, 0.0151], learning_rate=0.1))  # 10 us a token
    s.add_request(_request("a"))
    _run(s, 1)
    for _ in range(6):
        d = _run(s, 1)[0].stats
        assert d.predicted_seconds > d.plain_seconds > 0 and d.cost_scale == 1.0
        # it cost three times more
        s.planner.observe(replace(d, seconds=d.plain_seconds + 3 * (d.predicted_seconds - d.plain_seconds)), 1)
    assert s.planner.lookahead_cost.weight > 5
    assert s.schedule().stats.cost_scale == 2.0  # clamped
    frozen = _adaptive_scheduler(StepCostModel([1, 512], [0.010, 0.0151], learning_rate=0.0))
    frozen.add_request(_request("a"))
    d = _run(frozen, 2)[-1].stats
    frozen.planner.observe(replace(d, seconds=1.0), 1)
    assert frozen.planner.lookahead_cost.weight == 0  # a frozen model (tests inject them) is not corrected either
