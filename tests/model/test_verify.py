"""Verification tables (greedy and sampling) and the sampling verifier's distribution."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from lookahead_serve.engine.verify import verify_greedy, verify_sampling


@pytest.mark.parametrize(
    ("x_argmax", "candidates", "cand_argmax", "tokens", "candidate", "matched"),
    [
        (7, [], [], [7], -1, 0),  # no candidates: plain decoding
        (7, [[3, 4]], [[1, 1]], [7], -1, 0),  # first token wrong
        (7, [[7, 4]], [[5, 1]], [7, 5], 0, 1),  # one match, then the model's own token
        (7, [[7, 5]], [[5, 9]], [7, 5, 9], 0, 2),  # full match earns the bonus: N tokens
        (7, [[7, 3], [7, 5]], [[1, 1], [5, 2]], [7, 5, 2], 1, 2),  # the longest wins
        (7, [[7, 5], [7, 5]], [[5, 8], [5, 8]], [7, 5, 8], 0, 2),  # ties: the first
    ],
)
def test_greedy_table(x_argmax, candidates, cand_argmax, tokens, candidate, matched):
    v = verify_greedy(x_argmax, candidates, cand_argmax)
    assert (v.tokens, v.candidate, v.num_matched) == (tokens, candidate, matched)


def _onehot(vocab: int, token: int) -> torch.Tensor:
    p = torch.zeros(vocab)
    p[token] = 1.0
    return p


def _draws(seed: int):
    """Independent draws from one generator, as ``verify_sampling`` takes them."""
    gen = torch.Generator().manual_seed(seed)
    return lambda probs, depth: int(torch.multinomial(probs, 1, generator=gen))


def test_sampling_certain_tokens_accept_whole_candidate():
    vocab = 5
    x_probs = _onehot(vocab, 2)
    cands = [[1, 1], [2, 3]]
    cand_probs = torch.stack([torch.stack([_onehot(vocab, 0)] * 2), torch.stack([_onehot(vocab, 3), _onehot(vocab, 4)])])
    v = verify_sampling(x_probs, cands, cand_probs, _draws(0))
    assert (v.tokens, v.candidate, v.num_matched) == ([2, 3, 4], 1, 2)


def test_sampling_impossible_candidates_are_rejected():
    vocab = 4
    x_probs = torch.tensor([0.0, 0.5, 0.5, 0.0])
    cands = [[0, 1], [3, 1]]  # both first tokens have probability 0
    cand_probs = torch.full((2, 2, vocab), 0.25)
    for seed in range(20):
        v = verify_sampling(x_probs, cands, cand_probs, _draws(seed))
        assert v.num_matched == 0 and v.tokens[0] in (1, 2) and len(v.tokens) == 1


@pytest.mark.parametrize("cands", [[[1, 0]], [[1, 0], [2, 0], [1, 3]], [[0, 0], [0, 1]]])
def test_sampling_first_token_keeps_the_distribution(cands):
    """Whatever the drafts, the first output token is distributed as the model's p (chi-square, alpha 1e-3)."""
    vocab = 4
    p = torch.tensor([0.1, 0.5, 0.3, 0.1])
    cand_probs = torch.full((len(cands), 2, vocab), 0.25)
    draw = _draws(1)
    n = 4000
    counts = torch.zeros(vocab)
    for _ in range(n):
        counts[verify_sampling(p, cands, cand_probs, draw).tokens[0]] += 1
    assert chisquare(counts.numpy(), (p * n).numpy()).pvalue > 1e-3


def test_sampling_second_token_keeps_the_distribution():
    """The token after an accepted draft token follows the model's distribution after that token."""
    vocab = 3
    p0 = torch.tensor([0.6, 0.4, 0.0])
    after = torch.tensor([[0.2, 0.2, 0.6], [0.5, 0.25, 0.25]])  # p(next | first = 0), p(next | first = 1)
    cands = [[0, 2], [1, 0]]
    cand_probs = torch.stack([torch.stack([after[0], after[0]]), torch.stack([after[1], after[1]])])
    draw = _draws(2)
    n = 6000
    joint = torch.zeros(vocab, vocab)
    for _ in range(n):
        t = verify_sampling(p0, cands, cand_probs, draw).tokens
        joint[t[0], t[1]] += 1
    expected = (p0[:, None] * torch.cat([after, torch.full((1, vocab), 1 / 3)])).flatten() * n
    keep = expected > 0
    assert chisquare(joint.flatten()[keep].numpy(), expected[keep].numpy()).pvalue > 1e-3
