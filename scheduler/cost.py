"""What one engine step costs: seconds as a function of its tokens, looped segments and plain decodes.

Pure Python. A step's time is modelled as ``f(T) + s * K + d * D``: ``f`` is piecewise linear in the
step's token count ``T`` between measured knots (a matmul over 16 tokens can cost what one over 1 costs
on a CPU in bfloat16, and twice as much in float32, so no single slope fits), ``K`` is the number of
segments the attention backend handles one by one (prefill chunks and lookahead segments) at ``s`` each,
and ``D`` the number of plain decodes at ``d`` each beyond their token (each reads its own context: 16
decodes cost more than one 16-token lookahead segment over one context). The engine fits the knots from a short profile at
start-up (``engine.step_profile``); every observed step moves one scale factor on the whole model
toward observed / predicted, so predicted times follow the machine (a VM whose speed drifts, other load).
The shape stays as profiled: an earlier version corrected each knot from the steps around it, and
plain-decode steps (many contexts) and lookahead steps (one context, many tokens) at the same token
count pull the same knots in different directions; that version ran 31% slower than plain decoding at
concurrency 16 in the scheduling benchmark, where the profiled shape alone does not. A scale factor cannot change a decision -- the policy compares
rates -- so decisions rest on the profile. Tests inject a model.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class StepCostModel:
    """knots: increasing token counts (the first >= 1); seconds: f at each knot; per_segment: s.

    ``learning_rate`` in [0, 1]: the weight of one observation in the scale factor, geometrically
    (0 freezes the model: what tests use for determinism).
    """

    knots: Sequence[int]
    seconds: Sequence[float]
    per_segment: float = 0.0
    learning_rate: float = 0.1
    per_decode: float = 0.0

    def __post_init__(self) -> None:
        self.knots = [int(k) for k in self.knots]
        self.seconds = [float(s) for s in self.seconds]
        if not self.knots or len(self.knots) != len(self.seconds):
            raise ValueError("knots and seconds must be non-empty and of the same length")
        if self.knots[0] < 1 or any(b <= a for a, b in zip(self.knots, self.knots[1:])):
            raise ValueError(f"knots must be increasing token counts >= 1, got {self.knots}")
        if any(s < 0 for s in self.seconds) or self.per_segment < 0 or self.per_decode < 0:
            raise ValueError("step costs must be non-negative")
        if not 0.0 <= self.learning_rate <= 1.0:
            raise ValueError(f"learning_rate must be in [0, 1], got {self.learning_rate}")
        self.num_observed = 0
        self.sum_abs_rel_error = 0.0
        self.scale = 1.0  # live correction: observed / profiled, smoothed

    def _weights(self, num_tokens: int) -> tuple[int, float]:
        """Index i and weight of knot i (knot i+1 takes 1 - weight); beyond the last knot, extrapolate."""
        k = self.knots
        if len(k) == 1:
            return 0, 1.0
        i = min(max(bisect.bisect_right(k, num_tokens) - 1, 0), len(k) - 2)
        return i, (k[i + 1] - num_tokens) / (k[i + 1] - k[i])

    def tokens_cost(self, num_tokens: int) -> float:
        if len(self.knots) == 1:
            return self.seconds[0] * num_tokens / self.knots[0]
        i, w = self._weights(num_tokens)
        return max(w * self.seconds[i] + (1 - w) * self.seconds[i + 1], 0.0)

    def predict(self, num_tokens: int, num_segments: int = 0, num_decodes: int = 0) -> float:
        raw = self.tokens_cost(num_tokens) + self.per_segment * num_segments + self.per_decode * num_decodes
        return self.scale * raw

    def observe(self, num_tokens: int, num_segments: int, seconds: float, num_decodes: int = 0) -> float:
        """Correct the model toward one measured step; return the prediction it had made."""
        predicted = self.predict(num_tokens, num_segments, num_decodes)
        self.num_observed += 1
        if seconds > 0:
            self.sum_abs_rel_error += abs(predicted - seconds) / seconds
        lr = self.learning_rate
        if lr and predicted > 0 and seconds > 0:
            # One factor for the whole curve, moved geometrically toward observed / predicted.
            self.scale *= (seconds / predicted) ** lr
        return predicted

    @property
    def mean_abs_rel_error(self) -> float:
        """Mean |predicted - observed| / observed over the steps observed so far."""
        return self.sum_abs_rel_error / self.num_observed if self.num_observed else 0.0
