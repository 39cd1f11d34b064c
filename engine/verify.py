"""Lossless verification of lookahead candidates: the longest candidate prefix the model itself would emit.

Candidates are one-hot drafts of ``m`` tokens that all follow the newest token x. The result is the
list of output tokens (matched candidate tokens, then one token from the model) and which candidate's
tokens were accepted, so their keys and values can be committed.

Greedy, worked example (m = 2): the model's argmax after x is 7; candidates (7, 3) and (7, 5); the
argmax after (x, 7) is 5. Candidate 0 matches one token, candidate 1 both, so the output is
(7, 5, b) with b the argmax after (x, 7, 5), candidate 1, num_matched 2: x, 7 and 5 are committed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Verdict:
    tokens: list[int]  # output tokens: the matched candidate tokens, then the model's next token
    candidate: int  # index of the accepted candidate (-1 when none matched)
    num_matched: int  # candidate tokens accepted; their K/V (with x's) are committed


def verify_greedy(x_argmax: int, candidates: list[list[int]], cand_argmax: list[list[int]]) -> Verdict:
    """Longest candidate prefix equal to the model's own greedy choices, plus the bonus token.

    cand_argmax[j][d]: the model's argmax at candidate j's d-th token (its guess for the next one).
    """
    best = Verdict([x_argmax], -1, 0)
    for j, cand in enumerate(candidates):
        k, expected = 0, x_argmax
        while k < len(cand) and cand[k] == expected:
            expected = cand_argmax[j][k]
            k += 1
        if k > best.num_matched:
            best = Verdict(list(cand[:k]) + [expected], j, k)
    return best


def verify_sampling(
    x_probs: torch.Tensor,  # [vocab] processed distribution after x
    candidates: list[list[int]],
    cand_probs: torch.Tensor,  # [g, m, vocab] processed distribution after each candidate token
    draw: Callable[[torch.Tensor, int], int],
) -> Verdict:
    """Match verification: the token at each depth is drawn as plain decoding would draw it, and a
    candidate token is accepted when it equals that draw.

    ``draw(probs, depth)`` samples the token ``depth`` places after x's successor with the randomness plain
    decoding uses for that position (engine.sampler: keyed by the request's seed and the position), so the
    output is the one plain sampling gives, whatever lookahead ran. With one-hot drafts this accepts as
    often as multi-candidate rejection sampling: at each depth, with the probability of the set of tokens
    the live candidates propose. Candidates sharing a prefix share its draws.
    """
    first = draw(x_probs, 0)
    drawn: dict[tuple[int, ...], int] = {(): first}
    best = Verdict([first], -1, 0)
    for j, cand in enumerate(candidates):
        k, expected = 0, first
        while k < len(cand) and cand[k] == expected:
            prefix = tuple(cand[: k + 1])
            if prefix not in drawn:
                drawn[prefix] = draw(cand_probs[j, k], k + 1)
            expected = drawn[prefix]
            k += 1
        if k > best.num_matched:
            best = Verdict(list(cand[:k]) + [expected], j, k)
    return best
