"""Lookahead scheduling: each step, choose every decoding request's (w, n, g) for the most accepted
tokens per second of step time.

Pure Python. Three parts:

* the **ladder** of a request: the (w, n, g) it may run, from its own maximum down, keeping only rungs that
  the prior says buy more accepted tokens than every smaller rung (plain decoding is the rung below all),
  and verification-only rungs (w = 0: the pool's candidates without a window) beside them;
* the **acceptance model** of a request: expected extra tokens per step (beyond the one every step
  gives), from the prior for verifying the candidates the pool has now plus the window's n-grams for
  later steps, times a per-request multiplier learnt from its own lookahead steps;
* the **policy**: given the step's committed part (prefill chunks and plain decodes, which keep their place
  in the budget) and the step-cost model, upgrade requests one at a time, each time taking the upgrade that
  gives the highest expected tokens per second for the whole step, while any upgrade raises it and the
  token budget allows.

``FixedPolicy`` is the other choice: every request runs its own (W, N, G) when the budget has room.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from lookahead_serve.scheduler.cost import StepCostModel
from lookahead_serve.scheduler.lookahead import step_tokens
from lookahead_serve.scheduler.params import LookaheadParams

# Expected extra accepted tokens per steady-state step, by (w, n, g): PRIOR_SCALE * (1 - exp(-min(w, g) / 4))
# * (1 - 2^-(n-1)), fitted to the default model's compression ratios on chat prompts; texts that accept
# more (code) are learnt by the per-request multiplier. Where this and the constants below come from:
# docs/scheduling.md.
PRIOR_SCALE = 0.9
# Share of lookahead steps whose pool lookup finds candidates (chat prompts).
PRIOR_HIT_RATE = 0.55
# What a step without candidates is worth, as a share of the prior: its window's n-grams, for later steps
# (benchmarks/lookahead.py --window-value measures it).
WINDOW_VALUE = 0.3
# What verifying the candidates a step found is worth, by how many (k) it verifies: a saturating curve,
# (1 - exp(-k / FOUND_SCALE)), steeper than the prior's own (1 - exp(-k / 4)) because the pool offers its
# most recent n-grams first and they are its best. NOW_SCALE makes the two curves agree at k = 4.
FOUND_SCALE = 1.0
NOW_SCALE = (PRIOR_SCALE * (1 - WINDOW_VALUE * PRIOR_HIT_RATE) / PRIOR_HIT_RATE
             * (1 - math.exp(-1.0)) / (1 - math.exp(-4.0 / FOUND_SCALE)))
_WINDOWS = (2, 3, 4, 5, 7, 10, 15, 20, 30)


@functools.lru_cache(maxsize=4096)
def prior_gain(window_size: int, ngram_size: int, verification_set_size: int) -> float:
    """Expected extra tokens per step, over all steps (with candidates or not). A verification-only step
    (w = 0) verifies what the window (g, n, g) would, but adds no n-grams for later steps: the window's part,
    ``WINDOW_VALUE`` of the prior per step, comes off the steps that find candidates."""
    w, n, g = window_size, ngram_size, verification_set_size
    if n < 3 or g < 1 or w == 1 or w < 0:
        return 0.0
    gain = PRIOR_SCALE * (1 - math.exp(-(min(w, g) if w else g) / 4)) * (1 - 0.5 ** (n - 1))
    return gain if w else gain * (1 - WINDOW_VALUE * PRIOR_HIT_RATE)


@functools.lru_cache(maxsize=1024)
def ladder(maximum: LookaheadParams) -> tuple[LookaheadParams, ...]:
    """The (w, n, g) a request whose maximum is ``maximum`` may run, fewest tokens first. Two kinds of rung,
    each keeping only rungs whose prior gain exceeds every cheaper rung's of its kind: with a window
    (always including ``maximum`` itself), and verification only, (0, n, g) up to (0, N, G). A request whose
    maximum has no window has only the latter."""
    if maximum.is_plain:
        return ()
    W, N, G = maximum.window_size, maximum.ngram_size, maximum.verification_set_size
    if W:
        windows = sorted({*(x for x in _WINDOWS if x < W), W})
        grid = {LookaheadParams(w, n, max(1, round(w * G / W)) if G else 0) for w in windows for n in range(3, N + 1)}
        grid.add(maximum)
        sizes = {p.verification_set_size for p in grid if p.verification_set_size}
        rungs = _monotone(grid, maximum)
    else:
        sizes, rungs = {*(x for x in _WINDOWS if x < G), G}, []
    verify = {LookaheadParams(0, n, g) for g in sizes for n in range(3, N + 1)} | ({maximum} if not W else set())
    return tuple(sorted(rungs + _monotone(verify, None if W else maximum), key=_tokens))


def _tokens(p: LookaheadParams) -> int:
    return step_tokens(p.window_size, p.ngram_size, p.verification_set_size)


def _monotone(grid: set[LookaheadParams], keep: LookaheadParams | None) -> list[LookaheadParams]:
    """The rungs of ``grid``, fewest tokens first, whose prior gain beats every cheaper one's (and ``keep``)."""
    out: list[LookaheadParams] = []
    best = 0.0
    for p in sorted(grid, key=lambda p: (_tokens(p), -prior_gain(p.window_size, p.ngram_size, p.verification_set_size))):
        gain = prior_gain(p.window_size, p.ngram_size, p.verification_set_size)
        if gain > best or p == keep:
            out.append(p)
            best = max(best, gain)
    return out


class AcceptanceModel:
    """What a request's lookahead steps accept, given the candidates the pool has for them.

    The scheduler looks the pool up before it decides, so a step's gain is planned on the candidates it
    would verify: a step that finds none can accept nothing now, and one that finds two verifies two,
    whatever its g. A step's expected extra tokens (beyond the one every step gives) have two parts:

    * **now**: verifying k = min(g, found) candidates of n - 1 tokens, ``NOW_SCALE * (1 - exp(-k /
      FOUND_SCALE)) * (1 - 2^-(n-1))``: the first candidates the pool offers are worth the most (see
      ``FOUND_SCALE``);
    * **later**, for a step with a window: its n-grams for later steps, ``WINDOW_VALUE`` of the window's
      prior (see ``WINDOW_VALUE``). With k = g = 4 the two add up to the prior over
      ``PRIOR_HIT_RATE`` (the prior is fitted to all lookahead steps, and about that share of them find
      candidates).

    Both are scaled by a per-request **multiplier** learnt from the request's own steps that verified
    candidates: (k0 * m0 + observed extra tokens) / (k0 + predicted "now" extra tokens), older steps
    discounted by ``decay``; ``m0`` (``prior_multiplier``) is where it starts, ``k0`` (``prior_weight``,
    in predicted extra tokens) how much evidence it takes to move it. Plain steps discount the evidence
    too, so a request that dropped to plain decoding drifts back to ``m0`` and gets tried again. The
    scheduler keeps one model per request, whose ``m0`` is an engine-wide model's multiplier at the
    request's arrival.

    ``num_found`` below is the number of candidates the pool has for the step; None: as many as g."""

    def __init__(self, prior_multiplier: float = 1.0, prior_weight: float = 4.0, decay: float = 0.99) -> None:
        self.prior_multiplier = prior_multiplier
        self.prior_weight = prior_weight
        self.decay = decay
        self.observed = 0.0
        self.predicted = 0.0

    @property
    def multiplier(self) -> float:
        k0 = self.prior_weight
        return (k0 * self.prior_multiplier + self.observed) / (k0 + self.predicted)

    def expected_extra(self, params: LookaheadParams, num_found: int | None = None) -> float:
        return self.multiplier * planned_gain(params, num_found)

    def optimistic_extra(self, params: LookaheadParams, num_found: int | None = None, beta: float = 1.0) -> float:
        """``expected_extra`` with the multiplier raised by ``beta`` standard errors (an upper confidence
        bound: accepted tokens are roughly Poisson, so the error is about sqrt(m / evidence)). What the
        adaptive policy's exploration ranks requests by: the one it knows least about, or whose text suits
        lookahead (code), gets tried, where the bare estimate -- the engine-wide prior, from other requests
        -- would keep it plain for good. The policy plans with the bare estimate: planning with this one
        over-values lookahead and runs it where it does not pay (docs/scheduling.md)."""
        return self.multipliers(beta)[1] * planned_gain(params, num_found)

    def multipliers(self, beta: float = 1.0) -> tuple[float, float]:
        """The multiplier, and it raised by ``beta`` standard errors (``optimistic_extra``'s)."""
        m = self.multiplier
        return m, m + beta * math.sqrt(max(m, 0.25) / (self.prior_weight + self.predicted))

    def observe(self, params: LookaheadParams | None, num_accepted: int, num_found: int | None = None) -> None:
        """One step of the request: ``params`` None for a plain step; ``num_accepted`` output tokens;
        ``num_found``: the candidates it verified."""
        self.observed *= self.decay
        self.predicted *= self.decay
        if params is not None:
            now = _gain_now(params, num_found)
            if now:
                self.observed += max(num_accepted - 1, 0)
                self.predicted += now


@functools.lru_cache(maxsize=8192)
def _gain_now(params: LookaheadParams, num_found: int | None) -> float:
    """The prior's extra tokens from verifying this step's candidates: k = min(g, found) of them."""
    n = params.ngram_size
    k = params.verification_set_size if num_found is None else min(params.verification_set_size, num_found)
    if not k or n < 3:
        return 0.0
    return NOW_SCALE * (1 - math.exp(-k / FOUND_SCALE)) * (1 - 0.5 ** (n - 1))


@functools.lru_cache(maxsize=8192)
def planned_gain(params: LookaheadParams, num_found: int | None) -> float:
    """The prior's extra tokens of one step at ``params``: verifying now, and the window's n-grams later."""
    later = WINDOW_VALUE * prior_gain(params.window_size, params.ngram_size, params.verification_set_size)
    return _gain_now(params, num_found) + (0.0 if params.verify_only else later)


@dataclass(slots=True)
class Option:
    """One rung a request could run this step: its parameters, step tokens, expected extra tokens (what
    the policy plans with) and an optimistic figure for them (an upper confidence bound: what exploration
    ranks requests by; by default the expected figure)."""

    params: LookaheadParams
    num_tokens: int
    expected_extra: float
    optimistic_extra: float | None = None

    def __post_init__(self) -> None:
        if self.optimistic_extra is None:
            self.optimistic_extra = self.expected_extra


@dataclass(slots=True)
class Decision:
    """What the policy chose for one step: per candidate the index of its option, or None for plain."""

    choices: list[int | None]
    num_tokens: int
    num_segments: int
    expected_tokens: float
    predicted_seconds: float
    num_decodes: int = 0
    plain_seconds: float | None = None  # the same step with every request decoding plainly, predicted
    explored: bool = False  # the policy's exploration chose this step
    adaptive: bool = False  # the adaptive policy chose it (what the lookahead cost check learns from)
    observed_seconds: float | None = None  # what the step took, once it ran


class AdaptivePolicy:
    """Greedy upgrades from two starts: every request plain, and every request at the same rung of its
    ladder (the rung with the best expected rate; this second run is made only when that start alone
    already beats the first run's result, which bounds the work per step). The uniform starts matter
    because a step's cost is not additive: a step of lookahead segments alone skips the plain-decode path
    altogether (``StepCostModel.decode_overhead``), so upgrading the last plain request can pay where
    upgrading the first does not, and greedy moves from all-plain never see that. The decision is
    whichever of the two ends with the higher expected tokens per second.

    explore_every: every so many steps that have candidates, one request -- the one with the best
    optimistic gain per token -- runs its cheapest rung even if the models say it does not pay, so that the
    cost model sees lookahead-sized steps and the acceptance model sees the request, and a wrong prior
    cannot lock lookahead out for good (0: never). Exploring costs a step's worth of lookahead where it
    may not pay, so the interval backs off: each explored step that did not pay in hindsight (the
    scheduler reports it, ``exploration_paid``) doubles it, up to ``MAX_EXPLORE_BACKOFF`` times
    ``explore_every``, and one that paid brings it back, so that exploring costs little where no lookahead
    pays.

    min_gain: outside exploration, a step runs lookahead only if its expected rate beats the all-plain
    step's by this share. The policy picks the steps the step-time model flatters, so a predicted gain
    within the model's error (about 5% a step) is mostly the winner's curse (docs/scheduling.md)."""

    MAX_EXPLORE_BACKOFF = 16

    name = "adaptive"

    def __init__(self, cost_model: StepCostModel, explore_every: int = 0, min_gain: float = 0.0) -> None:
        self.cost = cost_model
        self.explore_every = explore_every
        self.min_gain = min_gain
        self.explore_interval = explore_every
        self._since_explore = 0

    def choose(
        self,
        options: Sequence[Sequence[Option]],
        base_tokens: int,
        base_segments: int,
        base_yield: float,
        budget: int,
        base_decodes: int | None = None,
        cost_scale: float = 1.0,
    ) -> Decision:
        """``options[r]``: request r's rungs (plain, costing 1 token and yielding 1, is implicit);
        ``base_*``: the step without any lookahead (tokens, looped segments, output tokens expected, plain
        decodes -- by default one per candidate); ``budget``: most extra tokens lookahead may add;
        ``cost_scale``: what lookahead adds to a step, observed over predicted (``LookaheadCostCheck``):
        the cost beyond the all-plain step is planned at this times the model's figure."""
        decodes = len(options) if base_decodes is None else base_decodes
        # The model is fixed within a step: each step shape is predicted once.
        cost = _Memo(self.cost, (base_tokens, base_segments, decodes), cost_scale)
        start = Decision([None] * len(options), base_tokens, base_segments, base_yield, 0.0, decodes)
        self._since_explore += 1
        if self.explore_every and self._since_explore >= self.explore_interval and options:
            # Explore: the request with the best optimistic gain per token runs its cheapest rung.
            self._since_explore = 0
            r = max(range(len(options)), key=lambda i: options[i][0].optimistic_extra / options[i][0].num_tokens
                    if options[i] else -1.0)
            if options[r] and options[r][0].num_tokens - 1 <= budget:
                _set_rung(start, options, r, 0)
            start.predicted_seconds = cost.predict(start.num_tokens, start.num_segments, start.num_decodes)
            decision = self._upgrade(start, options, base_tokens, budget, cost)
            decision.explored = decision.adaptive = True
            return decision
        start.predicted_seconds = cost.predict(start.num_tokens, start.num_segments, start.num_decodes)
        plain = Decision(list(start.choices), base_tokens, base_segments, base_yield, start.predicted_seconds, decodes)
        best_uniform = self._best_uniform(start, options, base_tokens, budget, cost)
        best = self._upgrade(start, options, base_tokens, budget, cost)
        if best_uniform is not None and _rate(best_uniform) > _rate(start):
            # ``start`` is now the first run's result: greedy upgrades from the best uniform start too, when
            # that start alone beats it (at most two greedy runs a step).
            other = self._upgrade(best_uniform, options, base_tokens, budget, cost)
            if _rate(other) > _rate(best) * (1 + 1e-9):
                best = other
        if self.min_gain and _rate(best) < _rate(plain) * (1 + self.min_gain):
            best = plain  # a gain inside the model's error: plain
        best.adaptive = True
        return best

    def continue_exploration(self, previous: AdaptivePolicy) -> None:
        """Take over where ``previous`` stands in its exploration (interval backed off, steps since the
        last explored one), if it explored at the same base interval."""
        if previous.explore_every == self.explore_every:
            self.explore_interval, self._since_explore = previous.explore_interval, previous._since_explore

    def exploration_paid(self, paid: bool) -> None:
        """How an explored step turned out: more tokens per second than the step decoded plainly, or not."""
        cap = self.explore_every * self.MAX_EXPLORE_BACKOFF
        self.explore_interval = self.explore_every if paid else min(self.explore_interval * 2, cap)

    @staticmethod
    def _best_uniform(start: Decision, options: Sequence[Sequence[Option]], base_tokens: int, budget: int,
                      cost: _Memo) -> Decision | None:
        """The best of the steps with every request at the same rung j of its ladder (its last if it has
        fewer), from ``start`` (every request plain), within the budget; None if none fits. The sums run
        in request order, as ``_set_rung`` would add them, so the figures are the same to the bit."""
        sizes = [len(opts) for opts in options]
        num_segments = start.num_segments + sum(n > 0 for n in sizes)
        num_decodes = start.num_decodes - sum(n > 0 for n in sizes)
        best: tuple[int, int, float, float] | None = None  # (j, tokens, expected tokens, seconds)
        best_rate = 0.0
        for j in range(max(sizes, default=0)):
            num_tokens, expected = start.num_tokens, start.expected_tokens
            for opts, n in zip(options, sizes):
                if n:
                    o = opts[min(j, n - 1)]
                    num_tokens += o.num_tokens - 1
                    expected += o.expected_extra
            if num_tokens - base_tokens > budget:
                continue  # a later rung may be smaller: a verification-only rung's tokens follow the candidates found
            seconds = cost.predict(num_tokens, num_segments, num_decodes)
            rate = expected / seconds if seconds > 0 else math.inf
            if best is None or rate > best_rate:
                best, best_rate = (j, num_tokens, expected, seconds), rate
        if best is None:
            return None
        j, num_tokens, expected, seconds = best
        choices = [min(j, n - 1) if n else None for n in sizes]
        return Decision(choices, num_tokens, num_segments, expected, seconds, num_decodes)

    def _upgrade(self, d: Decision, options: Sequence[Sequence[Option]], base_tokens: int, budget: int,
                 cost: _Memo) -> Decision:
        """Greedy: take the single upgrade that most raises the step's expected rate, while one does."""
        choices = d.choices
        seen, predict = cost.seen, cost.predict
        while True:
            best = None
            bar = _rate(d) * (1 + 1e-9)  # an upgrade must beat the step's rate so far
            room = budget + base_tokens - d.num_tokens  # tokens an upgrade may add
            num_tokens, expected = d.num_tokens, d.expected_tokens
            for r, opts in enumerate(options):
                cur = choices[r]
                if cur is None:
                    cur_tokens, cur_extra, first = 1, 0.0, 0
                    new_segments, new_decodes = d.num_segments + 1, d.num_decodes - 1
                else:
                    cur_tokens, cur_extra, first = opts[cur].num_tokens, opts[cur].expected_extra, cur + 1
                    new_segments, new_decodes = d.num_segments, d.num_decodes
                for j in range(first, len(opts)):
                    o = opts[j]
                    d_tokens = o.num_tokens - cur_tokens
                    if d_tokens > room or o.expected_extra <= cur_extra:
                        continue
                    shape = (num_tokens + d_tokens, new_segments, new_decodes)
                    s = seen.get(shape)
                    if s is None:
                        s = predict(*shape)
                    rate = (expected + o.expected_extra - cur_extra) / s if s > 0 else math.inf
                    if rate > bar:
                        best, bar = (r, j, s), rate * (1 + 1e-9)
            if best is None:
                return d
            r, j, seconds = best
            _set_rung(d, options, r, j)
            d.predicted_seconds = seconds


class _Memo:
    """``StepCostModel.predict`` remembered by step shape, for one decision: the greedy upgrades ask for the
    same few shapes for every request (about a thousand calls a step at concurrency 32). What a shape costs
    beyond the all-plain step ``plain`` is scaled by ``extra_scale`` (when it costs more, not less)."""

    def __init__(self, cost: StepCostModel, plain: tuple[int, int, int] | None = None, extra_scale: float = 1.0) -> None:
        self._cost = cost
        self.seen: dict[tuple[int, int, int], float] = {}  # read directly by the greedy upgrades
        self._plain = cost.predict(*plain) if plain is not None and extra_scale != 1.0 else None
        self._scale = extra_scale

    def predict(self, num_tokens: int, num_segments: int, num_decodes: int) -> float:
        key = (num_tokens, num_segments, num_decodes)
        seconds = self.seen.get(key)
        if seconds is None:
            seconds = self._cost.predict(num_tokens, num_segments, num_decodes)
            if self._plain is not None and seconds > self._plain:
                seconds = self._plain + self._scale * (seconds - self._plain)
            self.seen[key] = seconds
        return seconds


class LookaheadCostCheck:
    """How much lookahead really adds to a step, against what the step-cost model predicted it would add.

    The policy runs lookahead where the model says it costs little, so the model's errors on the steps it
    picks are not even: it under-predicts them (the winner's curse), and the live fit, which learns from
    all steps alike, does not take that out. Over the steps that ran lookahead, this keeps the discounted
    sums of (observed - predicted all-plain step) and (predicted - predicted all-plain step); their
    ratio, ``scale``, is what the policy multiplies the model's lookahead cost by. 1.0 until it has
    ``min_steps`` of evidence; clamped to [0.5, 2]."""

    def __init__(self, decay: float = 0.98, min_steps: float = 5.0) -> None:
        self.decay = decay
        self.min_steps = min_steps
        self.observed = self.predicted = self.weight = 0.0

    def observe(self, seconds: float, predicted: float, plain_predicted: float) -> None:
        if predicted <= plain_predicted:
            return  # a step that drops the decode path may cost less than plain: nothing to scale
        self.observed = self.observed * self.decay + (seconds - plain_predicted)
        self.predicted = self.predicted * self.decay + (predicted - plain_predicted)
        self.weight = self.weight * self.decay + 1.0

    @property
    def scale(self) -> float:
        if self.weight < self.min_steps or self.predicted <= 0:
            return 1.0
        return min(max(self.observed / self.predicted, 0.5), 2.0)


def _set_rung(d: Decision, options: Sequence[Sequence[Option]], r: int, j: int) -> None:
    """Set request r to its rung j in ``d`` (tokens, segments, decodes and yield follow)."""
    cur = d.choices[r]
    old = options[r][cur] if cur is not None else None
    o = options[r][j]
    d.num_tokens += o.num_tokens - (old.num_tokens if old else 1)
    d.expected_tokens += o.expected_extra - (old.expected_extra if old else 0.0)
    d.num_segments += cur is None
    d.num_decodes -= cur is None
    d.choices[r] = j


def _rate(d: Decision) -> float:
    return d.expected_tokens / d.predicted_seconds if d.predicted_seconds > 0 else math.inf


class FixedPolicy:
    """Every request runs its own (W, N, G) -- the last option of its ladder -- while the budget has room."""

    name = "fixed"

    def choose(self, options, base_tokens, base_segments, base_yield, budget, base_decodes=None,
               cost_scale: float = 1.0) -> Decision:
        decodes = len(options) if base_decodes is None else base_decodes
        d = Decision([None] * len(options), base_tokens, base_segments, base_yield, 0.0, decodes)
        for r, opts in enumerate(options):
            if opts and d.num_tokens + opts[-1].num_tokens - 1 - base_tokens <= budget:
                _set_rung(d, options, r, len(opts) - 1)
        return d
