"""Per-request lookahead state: the 2D Jacobi window, the n-gram pool, and the layout of one step.

Pure Python. The window is a grid of guessed tokens: level ``l`` column ``c`` stands at offset ``l + c``
from the request's newest token ``x`` (offset 0). Level 0 holds columns 1..C-1 (column 0 is ``x``);
levels 1..L-1 hold columns 0..C-1. In steady state there are L = N-1 levels of C = W columns, so a step
carries 1 + (W-1) + (N-2)W window tokens plus G candidates of N-1 tokens.

Worked example, W=3, N=3 (x = newest token, a..e guesses)::

    level 1:    c0=c  c1=d  c2=e      offsets 1 2 3
    level 0: x  c1=a  c2=b            offsets 0 1 2

Token ``d`` (level 1, column 1, offset 2) attends to x, a (row 0 up to column 1) and itself; the model's
output at ``d`` guesses offset 3. After the step the pool gains, per column, the n-gram
(row-0 token, levels 1.., output at the last level): here (x, c, out_c), (a, d, out_d), (b, e, out_e).
Then the levels move down: row 0 becomes (d, e) (level 1 without column 0) and the outputs become level 1.

Warm-up: level 0 starts with W+N-3 tokens drawn from the prompt (C = W+N-2). Each of the first N-2
steps drops every level's first column (all offsets move one closer to x) and appends the outputs of
the newest level as a new level, so C shrinks by one per step until there are N-1 levels of W. The
window adds nothing to the pool during warm-up, but candidates already in the pool (the prompt's and the
output's n-grams) are verified from the first step: verification is lossless whatever the candidates.

A verification-only step (window size 0) carries x and the candidates alone: its layout has no levels,
and the window, if the request has one, stays as it is until the next step that runs it.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LookaheadLayout:
    """Shape of one request's lookahead segment: what the runner needs to build positions and mask.

    Token order: x, level 0 columns 1..C-1, level 1 columns 0..C-1, ..., level L-1, then each candidate's
    ``candidate_len`` tokens. A verification-only step has L = 0 (and C = 1): x, then the candidates.
    """

    num_levels: int  # L >= 1, or 0 for verification only
    num_cols: int  # C >= 2 (1 when L = 0)
    num_candidates: int  # g >= 0
    candidate_len: int  # N - 1

    @property
    def num_window_tokens(self) -> int:
        if self.num_levels == 0:
            return 1
        return 1 + (self.num_cols - 1) + (self.num_levels - 1) * self.num_cols

    @property
    def num_tokens(self) -> int:
        return self.num_window_tokens + self.num_candidates * self.candidate_len

    @property
    def num_last_level(self) -> int:
        """Tokens of the newest level, whose outputs advance the window (0 without a window)."""
        if self.num_levels == 0:
            return 0
        return self.num_cols - 1 if self.num_levels == 1 else self.num_cols

    def level_start(self, level: int) -> int:
        """Index in the segment of the level's first token (column 1 for level 0, column 0 above)."""
        return 1 if level == 0 else self.num_cols + (level - 1) * self.num_cols

    def candidate_start(self, j: int) -> int:
        return self.num_window_tokens + j * self.candidate_len

    def tree(self) -> tuple[list[int], list[int]]:
        """Offset from x and parent index of every token of the segment (x's parent is -1).

        A token's parent is the one token it sees at the offset just before its own; what it attends to is
        its chain of ancestors, so it sees exactly one token at each earlier offset.
        """
        offsets, parents = [0], [-1]
        for c in range(1, self.num_cols if self.num_levels else 1):  # level 0: row 0 is causal within itself
            offsets.append(c)
            parents.append(c - 1)
        for level in range(1, self.num_levels):
            for c in range(self.num_cols):
                offsets.append(level + c)
                if level == 1:
                    parents.append(c)  # row 0 at column c (x for c = 0, level 0 index c otherwise)
                else:
                    parents.append(self.level_start(level - 1) + c)
        for j in range(self.num_candidates):
            for d in range(self.candidate_len):
                offsets.append(1 + d)
                parents.append(0 if d == 0 else self.candidate_start(j) + d - 1)
        return offsets, parents


def step_tokens(window_size: int, ngram_size: int, num_candidates: int) -> int:
    """Tokens of one steady-state step: 1 + (W-1) + (N-2)W + g(N-1); 1 + g(N-1) for verification only."""
    if window_size == 0:
        return 1 + num_candidates * (ngram_size - 1)
    return LookaheadLayout(ngram_size - 1, window_size, num_candidates, ngram_size - 1).num_tokens


class NGramPool:
    """N-grams keyed by their first token, at most ``cap`` per key, least recently seen dropped first.

    ``ngram_size`` is the longest n-gram kept; shorter ones (from a window run at a smaller n) are kept
    too, and a lookup asks for continuations of one length: longer ones are cut to it.
    """

    def __init__(self, ngram_size: int, cap: int) -> None:
        self.ngram_size = ngram_size
        self.cap = cap
        self._pool: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, ngram: Sequence[int]) -> None:
        if not 2 <= len(ngram) <= self.ngram_size or self.cap <= 0:
            return
        entries = self._pool.setdefault(ngram[0], OrderedDict())
        tail = tuple(ngram[1:])
        if tail in entries:
            entries.move_to_end(tail)
        else:
            entries[tail] = None
            if len(entries) > self.cap:
                entries.popitem(last=False)

    def add_sequence(self, tokens: Sequence[int]) -> None:
        """Add every n-gram of ``tokens`` (prompt lookup comes free)."""
        n = self.ngram_size
        for i in range(len(tokens) - n + 1):
            self.add(tokens[i : i + n])

    def lookup(self, key: int, limit: int, length: int | None = None) -> list[tuple[int, ...]]:
        """Up to ``limit`` distinct continuations of ``key``, ``length`` tokens each (default N-1), most
        recent first."""
        entries = self._pool.get(key)
        if not entries or limit <= 0:
            return []
        length = self.ngram_size - 1 if length is None else length
        out: list[tuple[int, ...]] = []
        for tail in reversed(entries):
            if len(tail) < length:
                continue
            cut = tail[:length]
            if cut not in out:
                out.append(cut)
                if len(out) == limit:
                    break
        return out

    def __len__(self) -> int:
        return sum(len(v) for v in self._pool.values())


def shape_after_resize(num_levels: int, window_size: int, ngram_size: int) -> tuple[int, int]:
    """(levels, columns) a window of ``num_levels`` levels has after resizing to (window_size, ngram_size):
    levels above n-1 are dropped, and W + n-1 - levels columns make up the levels still warming up."""
    levels = min(num_levels, ngram_size - 1)
    return levels, window_size + (ngram_size - 1) - levels


class LookaheadState:
    """The window and pool of one request, advanced once per lookahead step.

    ``window_size`` and ``ngram_size`` are what the window runs now; ``resize`` changes them between
    steps (the lookahead scheduler does, up to the request's maximum), and the pool keeps n-grams up to
    the largest n the request may use. ``window_size`` 0 makes a state without a window, whose steps only
    verify (``plan_verify``); a state with a window may skip it for a step the same way.
    """

    def __init__(
        self, window_size: int, ngram_size: int, pool_cap: int, prompt: Sequence[int], eos_ids: frozenset[int],
        seed: int = 0, max_ngram_size: int | None = None,
    ) -> None:
        if window_size == 1 or window_size < 0 or ngram_size < 3:
            raise ValueError(
                f"lookahead needs window_size >= 2 (or 0: verification only) and ngram_size >= 3, got ({window_size}, {ngram_size})"
            )
        max_ngram_size = max(ngram_size, max_ngram_size or 0)
        self.window_size = window_size
        self.ngram_size = ngram_size
        self.pool = NGramPool(max_ngram_size, pool_cap)
        self.pool.add_sequence(prompt)
        self._rng = random.Random(seed)
        self._filler = [t for t in prompt if t not in eos_ids] or list(prompt)
        self._eos_ids = eos_ids
        first = [self._rng.choice(self._filler) for _ in range(window_size + ngram_size - 3)]
        # level 0 holds columns 1..C-1; no levels at all without a window
        self.levels: list[list[int]] = [first] if window_size else []
        self.num_pool_hits = 0
        self._tail = list(prompt[-(max_ngram_size - 1) :])

    def shape_after_resize(self, window_size: int, ngram_size: int) -> tuple[int, int]:
        """(levels, columns) the window would have after ``resize(window_size, ngram_size)``."""
        return shape_after_resize(len(self.levels), window_size, ngram_size)

    def resize(self, window_size: int, ngram_size: int) -> None:
        """Run the window at (window_size, ngram_size) from the next step on.

        Levels above n-1 are dropped; every level is cut to, or padded with prompt tokens to, the columns
        it needs (W columns once warm; during warm-up one more per level still to come, as at the start).
        A window with fewer levels than n-1 grows them by warming up again. Every token of the window is
        a guess, so any reshaping is lossless: it only changes what the window finds next.
        """
        if not self.levels:
            raise ValueError("resize needs a window: this request verifies only")
        if window_size < 2 or not 3 <= ngram_size <= self.pool.ngram_size:
            raise ValueError(
                f"resize needs window_size >= 2 and 3 <= ngram_size <= {self.pool.ngram_size}, got ({window_size}, {ngram_size})"
            )
        if (window_size, ngram_size) == (self.window_size, self.ngram_size):
            return
        num_levels, cols = self.shape_after_resize(window_size, ngram_size)
        self.levels = [self._fit(lvl, cols - 1 if i == 0 else cols) for i, lvl in enumerate(self.levels[:num_levels])]
        self.window_size, self.ngram_size = window_size, ngram_size

    def _fit(self, level: list[int], width: int) -> list[int]:
        return level[:width] + [self._rng.choice(self._filler) for _ in range(width - len(level))]

    @property
    def num_cols(self) -> int:
        return len(self.levels[0]) + 1

    @property
    def warm(self) -> bool:
        return len(self.levels) == self.ngram_size - 1

    def plan(self, x: int, max_candidates: int) -> tuple[LookaheadLayout, list[int]]:
        """Layout and token ids of this step's segment (x, window levels, candidates)."""
        if not self.levels:
            return self.plan_verify(x, self.ngram_size, max_candidates)
        candidates = self.pool.lookup(x, max_candidates, self.ngram_size - 1)
        tokens = [x]
        for level in self.levels:
            tokens.extend(level)
        for cand in candidates:
            tokens.extend(cand)
        layout = LookaheadLayout(len(self.levels), self.num_cols, len(candidates), self.ngram_size - 1)
        return layout, tokens

    def plan_verify(self, x: int, ngram_size: int, max_candidates: int) -> tuple[LookaheadLayout, list[int]]:
        """Layout and token ids of a verification-only segment: x, then up to ``max_candidates`` of the
        pool's continuations of x, ``ngram_size - 1`` tokens each (the window is left as it is)."""
        if not 3 <= ngram_size <= self.pool.ngram_size:
            raise ValueError(f"plan_verify needs 3 <= ngram_size <= {self.pool.ngram_size}, got {ngram_size}")
        candidates = self.pool.lookup(x, max_candidates, ngram_size - 1)
        tokens = [x]
        for cand in candidates:
            tokens.extend(cand)
        return LookaheadLayout(0, 1, len(candidates), ngram_size - 1), tokens

    def update(self, x: int, last_level_outputs: Sequence[int], accepted: Sequence[int]) -> None:
        """Advance the window given the model's outputs at the newest level, and learn from ``accepted``.

        ``last_level_outputs``: the model's argmax at each token of the newest level (columns 1..C-1 for
        level 0, 0..C-1 for higher levels). ``accepted``: the output tokens this step produced. A
        verification-only step (no outputs) only learns from ``accepted``.
        """
        if not last_level_outputs:
            self.add_output(accepted)
            return
        outs = [self._no_eos(t) for t in last_level_outputs]
        if not self.warm:
            # Each level drops its first column (its offsets move one closer to x); the outputs, which guess
            # one offset further than the newest level, become a new level on the same columns.
            new_level = outs if len(self.levels) == 1 else outs[1:]
            self.levels = [self.levels[0][1:]] + [lvl[1:] for lvl in self.levels[1:]] + [new_level]
        else:
            row0 = [x] + self.levels[0]
            for c in range(self.num_cols):
                self.pool.add([row0[c]] + [lvl[c] for lvl in self.levels[1:]] + [outs[c]])
            # Levels move down one (row 0 takes level 1 without its column 0); the outputs are the new top.
            self.levels = [self.levels[1][1:]] + self.levels[2:] + [outs]
        self.add_output(accepted)

    def add_output(self, accepted: Sequence[int]) -> None:
        """Add the n-grams that end in newly accepted output tokens to the pool."""
        seq = self._tail + list(accepted)
        self.pool.add_sequence(seq)
        self._tail = seq[-(self.pool.ngram_size - 1) :]

    def _no_eos(self, token: int) -> int:
        return self._rng.choice(self._filler) if token in self._eos_ids else token
