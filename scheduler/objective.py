"""What an output token is worth to the adaptive lookahead policy (``SchedulerConfig.lookahead_objective``).

Pure Python. Under "throughput" every token is worth the same, and each step maximises expected tokens
per second: to first order the sum of the requests' latencies, what a server wants. Under "makespan" a
closed batch -- nothing waiting, as in an offline ``generate`` call, whose caller waits for its last
request -- should finish soonest, and a token shortens it only if its request would otherwise finish last.

Request i's token then saves about ``p_i * C + (1 - p_i) * m`` seconds, where p_i is the chance that it
finishes last, C the cost of a step and m what one plain decode adds to a step (a request that finishes
early leaves later steps that much cheaper). p_i is a softmax of the tokens it has left at most
(max_tokens and max_model_len bound them) with a temperature of ``sqrt(L) + h * L``, L the most any has
left: requests about as far from their bound are about as likely to be last, and one a few sqrt(L) ahead
rarely is -- if requests run to their bound. End of sequence is unforeseeable, so the more of them end
early (h: the share of recent requests that stopped before their bound, ``EarlyStops``), the less the
bound tells apart, and the more alike the values.

Worked example: four requests with 100, 100, 90 and 60 tokens left, h = 0, m / C = 0.1: the temperature
of 10 gives p = 0.42, 0.42, 0.15, 0.008, and values (relative to the most valuable) 1.0, 1.0, 0.50, 0.22.
"""

from __future__ import annotations

import math


class EarlyStops:
    """The discounted share of finished requests that stopped before their length bound (end of
    sequence or a stop condition), from a 1:1 prior; ``decay`` per finished request."""

    def __init__(self, decay: float = 0.95) -> None:
        self.decay = decay
        self.early, self.ended = 1.0, 2.0

    def observe(self, stopped_early: bool) -> None:
        self.early = self.decay * self.early + stopped_early
        self.ended = self.decay * self.ended + 1.0

    @property
    def share(self) -> float:
        return self.early / self.ended


def makespan_values(left: dict[str, int], marginal_share: float, early_stop_share: float) -> dict[str, float]:
    """Each request's token value relative to the most valuable (1.0), from the tokens each has ``left``
    at most, ``marginal_share`` = m / C and ``early_stop_share`` = h (the module docstring's terms)."""
    most = max(left.values())
    temperature = max(math.sqrt(most) + early_stop_share * most, 1.0)
    weights = {rid: math.exp((n - most) / temperature) for rid, n in left.items()}
    total = sum(weights.values())
    eps = min(max(marginal_share, 0.0), 1.0)
    saved = {rid: w / total + (1 - w / total) * eps for rid, w in weights.items()}
    top = max(saved.values())
    return {rid: v / top for rid, v in saved.items()}
