"""Token sampling: greedy, temperature, top-k, top-p, with randomness keyed by request and position.

The token at position t of a request is drawn with a generator seeded from (the request's seed, t): the
same draw whether the token comes from a plain step or a lookahead verification, alone or in any batch, so
a seeded request's output does not depend on lookahead or the server's load. Requests without a seed get
one from the engine's generator when they first sample.

``processed_probs`` is the distribution a token is really drawn from (temperature, top-k and top-p
applied); lossless speculative verification must accept or reject against exactly this distribution.
"""

from __future__ import annotations

import torch

from lookahead_serve.scheduler import ScheduledRequest
from lookahead_serve.scheduler.request import describe_error


def processed_probs(
    logits: torch.Tensor,  # [n, vocab] float
    temperature: torch.Tensor,  # [n] (> 0)
    top_k: torch.Tensor,  # [n] int; <= 0 disables
    top_p: torch.Tensor,  # [n] in (0, 1]
) -> torch.Tensor:  # [n, vocab] float32 probabilities
    logits = logits.float() / temperature.float().unsqueeze(1)
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
    remove = ranks >= k
    sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    # Drop a token once the mass strictly before it already reaches top_p (the top token always stays).
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    remove |= mass_before >= top_p.float().unsqueeze(1)
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)
    return torch.softmax(filtered, dim=-1)


_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: (seed, position) -> distinct generator seeds


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._default = torch.Generator().manual_seed(seed)
        self._seeds: dict[str, int] = {}  # requests without a seed: the one drawn for them

    def _seed(self, seg: ScheduledRequest) -> int:
        if seg.seed is not None:
            return seg.seed
        seed = self._seeds.get(seg.req_id)
        if seed is None:
            seed = self._seeds[seg.req_id] = int(torch.randint(0, 2**62, (), generator=self._default))
        return seed

    def forget(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self._seeds.pop(req_id, None)

    def draw_at(self, probs: torch.Tensor, seg: ScheduledRequest, position: int) -> int:
        """The token at ``position`` of ``seg``'s request, from ``probs`` ([vocab])."""
        key = (self._seed(seg) * _MIX + position) % 2**63
        return int(torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(key)))

    def sample(self, logits: torch.Tensor, segs: list[ScheduledRequest]) -> tuple[list[int], dict[str, str]]:
        """One token per row of ``logits`` ([n, vocab]), row i for ``segs[i]``; and the requests whose draw
        raised (a row of NaNs, say), with what was raised. Their rows hold -1; no other row is touched:
        each row is drawn from its own distribution with its own generator."""
        tokens = logits.argmax(dim=-1).tolist()
        failed: dict[str, str] = {}
        rows = [i for i, s in enumerate(segs) if s.temperature >= 1e-5]
        if not rows:
            return tokens, failed
        sub = [segs[i] for i in rows]
        try:
            probs = self._probs(logits[rows], sub)
        except Exception:  # find the culprit row by row; nothing has been drawn yet
            probs = None
        for k, (row, seg) in enumerate(zip(rows, sub, strict=True)):
            try:
                p = probs[k] if probs is not None else self._probs(logits[row : row + 1], [seg])[0]
                tokens[row] = self.draw_at(p, seg, seg.start_pos + len(seg.token_ids))
            except Exception as e:
                tokens[row] = -1
                failed[seg.req_id] = describe_error(e)
        return tokens, failed

    @staticmethod
    def _probs(logits: torch.Tensor, segs: list[ScheduledRequest]) -> torch.Tensor:
        return processed_probs(
            logits,
            torch.tensor([s.temperature for s in segs]),
            torch.tensor([s.top_k for s in segs]),
            torch.tensor([s.top_p for s in segs]),
        ).cpu()

