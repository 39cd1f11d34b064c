"""Token sampling: greedy, temperature, top-k, top-p, with per-request seeded generators.

``processed_probs`` is the distribution a token is really drawn from (temperature, top-k and top-p
applied); lossless speculative verification must accept or reject against exactly this distribution.
"""

from __future__ import annotations

import torch

from scheduler import ScheduledRequest
from scheduler.request import describe_error


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


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._default = torch.Generator().manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def generator(self, seg: ScheduledRequest) -> torch.Generator:
        if seg.seed is None:
            return self._default
        gen = self._generators.get(seg.req_id)
        if gen is None:
            gen = self._generators[seg.req_id] = torch.Generator().manual_seed(seg.seed)
        return gen

    def forget(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self._generators.pop(req_id, None)

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
                tokens[row] = self.draw(p, seg)
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

    def draw(self, probs: torch.Tensor, seg: ScheduledRequest) -> int:
        """One token from ``probs`` ([vocab]) with the request's generator."""
        return int(torch.multinomial(probs, 1, generator=self.generator(seg)))
