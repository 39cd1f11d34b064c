"""Lossless verification of lookahead candidates: greedy longest prefix, and multi-candidate rejection.

Candidates are one-hot drafts of ``m`` tokens that all follow the newest token x. The result is the
list of output tokens (matched candidate tokens, then one token from the model) and which candidate's
tokens were accepted, so their keys and values can be committed.

Greedy, worked example (m = 2): the model's argmax after x is 7; candidates (7, 3) and (7, 5); the
argmax after (x, 7) is 5. Candidate 0 matches one token, candidate 1 both, so the output is
(7, 5, b) with b the argmax after (x, 7, 5), candidate 1, num_matched 2: x, 7 and 5 are committed.
"""

from __future__ import annotations

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
    generator: torch.Generator | None,
) -> Verdict:
    """Multi-candidate rejection sampling with one-hot drafts: the output has the model's distribution.

    At each depth the distinct tokens proposed by the candidates still alive are tried in turn: token t is
    accepted with probability p(t) under the current residual p; on rejection p(t) is set to 0 and p is
    renormalised. If all are rejected, the token is drawn from the residual and the walk ends. A fully
    accepted candidate earns one more token drawn from the distribution after its last token.
    """
    alive = list(range(len(candidates)))
    probs = x_probs.double()
    tokens: list[int] = []
    chosen_j, depth = -1, 0
    m = len(candidates[0]) if candidates else 0
    while depth < m and alive:
        residual = probs.clone()
        accepted = None
        tried: set[int] = set()
        for j in alive:
            t = candidates[j][depth]
            if t in tried:
                continue
            tried.add(t)
            total = float(residual.sum())
            if total <= 0:
                break
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if u < float(residual[t]) / total:
                accepted = t
                break
            residual[t] = 0.0
        if accepted is None:
            tokens.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
            return Verdict(tokens, chosen_j, depth)
        tokens.append(accepted)
        alive = [j for j in alive if candidates[j][depth] == accepted]
        chosen_j = alive[0]
        probs = cand_probs[chosen_j, depth].double()
        depth += 1
    tokens.append(int(torch.multinomial(probs / probs.sum(), 1, generator=generator)))
    return Verdict(tokens, chosen_j, depth)
