"""What one engine step costs: seconds as a function of its tokens, looped segments and plain decodes.

Pure Python. A step's time is modelled as ``f(T) + s * K + d * D + o * [D > 0]``:

* ``f`` is piecewise linear in the step's token count ``T`` between knots (a matmul over 16 tokens can
  cost what one over 1 costs on a CPU in bfloat16, and twice as much in float32, so no single slope fits);
* ``K`` is the number of segments the attention backend handles one by one (prefill chunks and lookahead
  segments), at ``s`` each;
* ``D`` is the number of plain decodes, at ``d`` each beyond their token (each reads its own context: 16
  decodes cost more than one 16-token lookahead segment over one context), and ``o`` is the fixed cost of a
  step having any (the batched decode attention and the plain rows' output layer, each a call per layer or
  per step that a step of lookahead segments alone does not make).

The model is linear in its parameters ``theta = (f at each knot, s, d, o)``: ``f(T)`` is a weighted sum of
the two knots around ``T``. The engine measures them in a short profile at start-up
(``engine.step_profile``) and then keeps them current from every step it runs with a Kalman filter
(recursive least squares with a prior): the profile is the prior mean, each observed step updates the
parameters its features touch in proportion to how uncertain they are, and a little process noise per
step -- most of it along ``theta`` itself, which is how a VM's speed drifts -- lets old evidence fade. A
step of 16 plain decodes and a lookahead step of 16 tokens share a knot but not ``d * D + o``, so the joint
fit keeps them apart, where correcting each knot on its own would let the two shapes pull the same knot in
opposite directions (docs/scheduling.md). Tests inject a model (``learning_rate=0`` freezes it).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

# Relative standard deviations of the filter: of the profiled parameters, of one observed step time.
PRIOR_REL_STD = 0.5
OBSERVATION_REL_STD = 0.1


@dataclass
class StepCostModel:
    """knots: increasing token counts (the first >= 1); seconds: f at each knot; per_segment: s;
    per_decode: d; decode_overhead: o.

    ``learning_rate`` in [0, 1]: how fast the live fit follows the machine -- roughly the weight of one
    step on a parameter it has seen many steps of (0 freezes the model: what tests use for determinism).
    """

    knots: Sequence[int]
    seconds: Sequence[float]
    per_segment: float = 0.0
    learning_rate: float = 0.1
    per_decode: float = 0.0
    decode_overhead: float = 0.0

    def __post_init__(self) -> None:
        self.knots = [int(k) for k in self.knots]
        self.seconds = [float(s) for s in self.seconds]
        if not self.knots or len(self.knots) != len(self.seconds):
            raise ValueError("knots and seconds must be non-empty and of the same length")
        if self.knots[0] < 1 or any(b <= a for a, b in zip(self.knots, self.knots[1:])):
            raise ValueError(f"knots must be increasing token counts >= 1, got {self.knots}")
        if any(s < 0 for s in self.seconds) or min(self.per_segment, self.per_decode, self.decode_overhead) < 0:
            raise ValueError("step costs must be non-negative")
        if not 0.0 <= self.learning_rate <= 1.0:
            raise ValueError(f"learning_rate must be in [0, 1], got {self.learning_rate}")
        self.num_observed = 0
        self.sum_abs_rel_error = 0.0
        # theta = (f at each knot, s, d, o) and its covariance P, the filter's state.
        self._theta = [*self.seconds, float(self.per_segment), float(self.per_decode), float(self.decode_overhead)]
        floor = 0.2 * max(self.seconds[0], 1e-6)  # an uncertainty for parameters profiled at 0
        self._prior_var = [(PRIOR_REL_STD * t + floor) ** 2 for t in self._theta]
        n = len(self._theta)
        self._cov = [[self._prior_var[i] if i == j else 0.0 for j in range(n)] for i in range(n)]

    # ---- parameters as fitted so far ------------------------------------------------------------
    def _sync(self) -> None:
        m = len(self.knots)
        self.seconds = self._theta[:m]
        self.per_segment, self.per_decode, self.decode_overhead = self._theta[m:]

    def _between_knots(self, num_tokens: int) -> tuple[int, float]:
        """f(T) = theta[i] * w + theta[i + 1] * (1 - w) (two knots or more): (i, w). Beyond the end knots,
        the nearest two extrapolate."""
        k = self.knots
        i = min(max(bisect.bisect_right(k, num_tokens) - 1, 0), len(k) - 2)
        return i, (k[i + 1] - num_tokens) / (k[i + 1] - k[i])

    def _features(self, num_tokens: int, num_segments: int, num_decodes: int) -> list[tuple[int, float]]:
        """Nonzero features of a step: (parameter index, weight)."""
        m = len(self.knots)
        if m == 1:
            feats = [(0, num_tokens / self.knots[0])]
        else:
            i, w = self._between_knots(num_tokens)
            feats = [(i, w), (i + 1, 1.0 - w)]
        if num_segments:
            feats.append((m, float(num_segments)))
        if num_decodes:
            feats += [(m + 1, float(num_decodes)), (m + 2, 1.0)]
        return feats

    def tokens_cost(self, num_tokens: int) -> float:
        """f(T) alone."""
        return max(sum(self._theta[i] * w for i, w in self._features(num_tokens, 0, 0)), 0.0)

    def predict(self, num_tokens: int, num_segments: int = 0, num_decodes: int = 0) -> float:
        # theta . features, summed in their order without building them: the policy asks for about a
        # thousand step shapes a step at concurrency 32.
        theta, m = self._theta, len(self.knots)
        if m == 1:
            seconds = theta[0] * (num_tokens / self.knots[0])
        else:
            i, w = self._between_knots(num_tokens)
            seconds = theta[i] * w + theta[i + 1] * (1.0 - w)
        if num_segments:
            seconds += theta[m] * num_segments
        if num_decodes:
            seconds += theta[m + 1] * num_decodes
            seconds += theta[m + 2]
        return max(seconds, 0.0)

    def observe(self, num_tokens: int, num_segments: int, seconds: float, num_decodes: int = 0) -> float:
        """Correct the model toward one measured step; return the prediction it had made."""
        predicted = self.predict(num_tokens, num_segments, num_decodes)
        self.num_observed += 1
        if seconds > 0:
            self.sum_abs_rel_error += abs(predicted - seconds) / seconds
        if self.learning_rate and seconds > 0:
            self._update(self._features(num_tokens, num_segments, num_decodes), seconds, predicted)
        return predicted

    def _update(self, feats: list[tuple[int, float]], seconds: float, predicted: float) -> None:
        theta, cov, n = self._theta, self._cov, len(self._theta)
        # Process noise: a random walk mostly along theta (the machine as a whole speeding up or slowing
        # down) and a little per parameter, the latter only while a parameter is surer than its prior.
        q = (0.1 * self.learning_rate) ** 2
        for i in range(n):
            row = cov[i]
            for j in range(n):
                row[j] += q * theta[i] * theta[j]
            if row[i] < self._prior_var[i]:
                row[i] += q * self._prior_var[i]
        ph = [sum(cov[i][j] * w for j, w in feats) for i in range(n)]  # P h
        s = sum(ph[j] * w for j, w in feats) + (OBSERVATION_REL_STD * seconds) ** 2
        gain = [v / s for v in ph]
        err = seconds - predicted
        for i in range(n):
            theta[i] = max(theta[i] + gain[i] * err, 0.0)  # no cost is negative
            row, g = cov[i], gain[i]
            for j in range(n):
                row[j] -= g * ph[j]
        self._sync()

    @property
    def mean_abs_rel_error(self) -> float:
        """Mean |predicted - observed| / observed over the steps observed so far."""
        return self.sum_abs_rel_error / self.num_observed if self.num_observed else 0.0
