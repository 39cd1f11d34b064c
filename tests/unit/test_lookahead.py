"""Lookahead bookkeeping: n-gram pool, window warm-up and shift, segment layout. No torch."""

from __future__ import annotations

import pytest

from lookahead_serve.scheduler import LookaheadLayout, LookaheadParams, LookaheadState, NGramPool
from lookahead_serve.scheduler.lookahead import step_tokens


def test_pool_lru_cap_and_recency():
    pool = NGramPool(ngram_size=3, cap=2)
    pool.add([1, 2, 3])
    pool.add([1, 4, 5])
    assert pool.lookup(1, 5) == [(4, 5), (2, 3)]  # most recent first
    pool.add([1, 2, 3])  # seen again: moves to the recent end
    assert pool.lookup(1, 5) == [(2, 3), (4, 5)]
    pool.add([1, 6, 7])  # over the cap: the least recent (4, 5) goes
    assert pool.lookup(1, 5) == [(6, 7), (2, 3)]
    assert pool.lookup(1, 1) == [(6, 7)]
    assert pool.lookup(9, 5) == []
    pool.add([1, 2, 3, 4])  # longer than the pool's n: ignored
    assert len(pool) == 2


def test_pool_seeded_from_sequence():
    pool = NGramPool(ngram_size=3, cap=4)
    pool.add_sequence([5, 6, 7, 5, 6, 8])
    assert pool.lookup(5, 4) == [(6, 8), (6, 7)]
    assert pool.lookup(6, 4) == [(7, 5)]
    assert pool.lookup(7, 4) == [(5, 6)]


@pytest.mark.parametrize(
    ("w", "n", "g", "expected"),
    [(15, 5, 15, 120), (7, 5, 7, 56), (5, 3, 5, 20), (4, 3, 4, 16)],
)
def test_step_token_count_matches_primer(w, n, g, expected):
    assert step_tokens(w, n, g) == (n - 1) * (w + g) == expected


def _primer_visible(lay: LookaheadLayout) -> list[set[int]]:
    """What each token may attend to, written from the primer's rules (not from the tree)."""
    tokens = [("x", 0, 0)]
    tokens += [("w", 0, c) for c in range(1, lay.num_cols)]
    tokens += [("w", lvl, c) for lvl in range(1, lay.num_levels) for c in range(lay.num_cols)]
    tokens += [("c", j, d) for j in range(lay.num_candidates) for d in range(lay.candidate_len)]
    visible = []
    for kind, a, b in tokens:
        seen = set()
        for idx, (k2, a2, b2) in enumerate(tokens):
            if kind == "x":
                ok = k2 == "x"
            elif kind == "w":
                lvl, col = a, b
                row0 = k2 == "x" or (k2 == "w" and a2 == 0 and b2 <= col)  # row 0 up to column col
                upper = k2 == "w" and 1 <= a2 <= lvl and b2 == col  # column col of levels 1..lvl
                ok = row0 or upper
            else:
                ok = k2 == "x" or (k2 == "c" and a2 == a and b2 <= b)
            if ok:
                seen.add(idx)
        visible.append(seen)
    return visible


@pytest.mark.parametrize(
    "lay",
    [
        LookaheadLayout(num_levels=4, num_cols=5, num_candidates=3, candidate_len=4),  # steady (5, 5, 3)
        LookaheadLayout(num_levels=2, num_cols=4, num_candidates=2, candidate_len=2),  # steady (4, 3, 2)
        LookaheadLayout(num_levels=1, num_cols=7, num_candidates=0, candidate_len=4),  # first warm-up step
        LookaheadLayout(num_levels=2, num_cols=6, num_candidates=0, candidate_len=4),  # later warm-up step
        LookaheadLayout(num_levels=0, num_cols=1, num_candidates=3, candidate_len=2),  # verification only
    ],
)
def test_tree_matches_primer_rules(lay):
    offsets, parents = lay.tree()
    assert len(offsets) == lay.num_tokens
    ancestors: list[set[int]] = []
    for i, parent in enumerate(parents):
        ancestors.append((ancestors[parent] if parent >= 0 else set()) | {i})
    assert ancestors == _primer_visible(lay)
    for i, seen in enumerate(ancestors):
        # exactly one token at each earlier offset, and the token itself at its own
        assert sorted(offsets[j] for j in seen) == list(range(offsets[i] + 1))


def test_window_warm_up_then_steady_shift():
    w, n = 3, 4
    prompt = [10, 11, 12, 13, 14]
    st = LookaheadState(w, n, pool_cap=3, prompt=prompt, eos_ids=frozenset())
    assert [len(level) for level in st.levels] == [w + n - 3]  # one level of W+N-3 prompt tokens
    assert all(t in prompt for t in st.levels[0])
    lay, toks = st.plan(x=99, max_candidates=3)
    assert (lay.num_levels, lay.num_cols, lay.num_candidates) == (1, w + n - 2, 0)  # no verification yet
    assert toks == [99] + st.levels[0]

    level0 = list(st.levels[0])
    st.update(99, [20, 21, 22, 23], accepted=[50])  # outputs at level-0 columns 1..4
    assert st.levels == [level0[1:], [20, 21, 22, 23]]
    assert not st.warm
    st.update(50, [30, 31, 32, 33], accepted=[51])  # outputs at level-1 columns 0..3
    assert st.levels == [level0[2:], [21, 22, 23], [31, 32, 33]]
    assert st.warm and st.num_cols == w

    lay, toks = st.plan(x=51, max_candidates=3)
    assert (lay.num_levels, lay.num_cols) == (n - 1, w)
    x = 51
    row0 = [x] + st.levels[0]
    st.update(x, [40, 41, 42], accepted=[52, 53])
    # one n-gram per column: row 0, levels 1.., then the output at the last level
    for c, out in enumerate([40, 41, 42]):
        gram = (row0[c], [21, 22, 23][c], [31, 32, 33][c], out)
        assert gram[1:] in st.pool.lookup(gram[0], 10)
    assert st.levels == [[22, 23], [31, 32, 33], [40, 41, 42]]


def test_accepted_output_feeds_pool_and_eos_never_enters_window():
    st = LookaheadState(2, 3, pool_cap=4, prompt=[1, 2, 3], eos_ids=frozenset({0}))
    st.add_output([4, 5])
    assert (3, 4) in st.pool.lookup(2, 4) and (4, 5) in st.pool.lookup(3, 4)
    st.update(5, [0, 0], accepted=[6])  # EOS guesses are replaced by prompt tokens
    assert 0 not in st.levels[-1]


def test_lookahead_params_validation():
    assert LookaheadParams(enabled=False).is_plain
    assert LookaheadParams(1, 1, 0).is_plain
    with pytest.raises(ValueError, match="ngram_size"):
        LookaheadParams(4, 2, 4)
    with pytest.raises(ValueError, match="window_size"):
        LookaheadParams(1, 3, 4)
    with pytest.raises(ValueError, match="verification_set_size"):
        LookaheadParams(4, 3, -1)


def test_verification_only_step_leaves_the_window_and_learns_from_the_output():
    st = LookaheadState(3, 3, pool_cap=4, prompt=[1, 2, 3, 1, 2, 4], eos_ids=frozenset())
    levels = [list(level) for level in st.levels]
    lay, toks = st.plan_verify(x=1, ngram_size=3, max_candidates=4)
    assert (lay.num_levels, lay.num_window_tokens, lay.num_last_level, lay.num_candidates) == (0, 1, 0, 2)
    assert lay.num_tokens == 5 == step_tokens(0, 3, 2) and toks == [1, 2, 4, 2, 3]  # x, then (2, 4), (2, 3)
    assert lay.tree() == ([0, 1, 2, 1, 2], [-1, 0, 1, 0, 3])
    st.update(1, [], accepted=[2, 3, 9])  # no window outputs: a verification-only step
    assert st.levels == levels and (3, 9) in st.pool.lookup(2, 4)
    with pytest.raises(ValueError, match="ngram_size"):
        st.plan_verify(x=1, ngram_size=4, max_candidates=4)  # longer than the pool keeps


def test_a_request_without_a_window_only_verifies():
    st = LookaheadState(0, 4, pool_cap=4, prompt=[5, 6, 7, 8, 5, 6], eos_ids=frozenset())
    assert st.levels == []
    lay, toks = st.plan(x=5, max_candidates=4)
    assert lay.num_levels == 0 and toks == [5, 6, 7, 8]
    with pytest.raises(ValueError, match="window"):
        st.resize(4, 3)
    assert not LookaheadParams(0, 3, 4).is_plain and LookaheadParams(0, 3, 4).verify_only
    with pytest.raises(ValueError, match="window_size"):
        LookaheadParams(0, 3, 0)  # nothing to verify
