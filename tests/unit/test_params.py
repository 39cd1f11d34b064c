"""SamplingParams validation and normalisation. Pure Python: no torch, no engine."""

from __future__ import annotations

import pytest

from lookahead_serve.scheduler import SamplingParams


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.01), "temperature"),
        (dict(temperature=-1), "temperature"),
        (dict(temperature="hot"), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=-0.5), "top_p"),
        (dict(top_p=1.0001), "top_p"),
        (dict(top_p=2), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=-100), "top_k"),
        (dict(top_k=1.5), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-1), "max_tokens"),
        (dict(max_tokens=2.0), "max_tokens"),
        (dict(max_tokens=4, min_tokens=5), "min_tokens"),
        (dict(min_tokens=17), "min_tokens"),  # default max_tokens is 16
        (dict(min_tokens=-1), "min_tokens"),
        (dict(seed=1.5), "seed"),
        (dict(stop=""), "stop"),
        (dict(stop=[""]), "stop"),
        (dict(stop=["ok", ""]), "stop"),
        (dict(stop=[3]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(stop_token_ids=[5, -7]), "stop_token_ids"),
        (dict(stop_token_ids=[1.0]), "stop_token_ids"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=True), "temperature"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(top_p=float("-inf")), "top_p"),
        (dict(top_k=True), "top_k"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(seed=1 << 64), "seed"),
        (dict(seed=-(1 << 63) - 1), "seed"),
        (dict(stop=5), "stop"),
        (dict(stop=["x"] * 17), "stop"),
        (dict(stop=["x" * 257]), "stop"),
        (dict(stop_token_ids=5), "stop_token_ids"),
        (dict(stop_token_ids=list(range(257))), "stop_token_ids"),
        (dict(stop_token_ids=[True]), "stop_token_ids"),
    ],
)
def test_invalid_values_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(temperature=0),
        dict(temperature=0.0),
        dict(temperature=2.5),
        dict(top_p=1.0),
        dict(top_p=1e-6),
        dict(top_k=-1),
        dict(top_k=0),
        dict(top_k=50),
        dict(max_tokens=1),
        dict(max_tokens=4, min_tokens=4),
        dict(max_tokens=4, min_tokens=0),
        dict(seed=0),
        dict(seed=None),
        dict(seed=-(1 << 63)),
        dict(seed=(1 << 64) - 1),
        dict(stop=["x"] * 16),
        dict(stop="y" * 256),
        dict(stop_token_ids=list(range(256))),
        dict(stop=[]),
        dict(stop=None),
        dict(stop_token_ids=[]),
        dict(stop_token_ids=[0, 2]),
    ],
)
def test_valid_values_accepted(kwargs):
    p = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        if name not in ("stop", "stop_token_ids"):
            assert getattr(p, name) == value


def test_defaults():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.seed) == (1.0, 1.0, 0, None)
    assert (p.max_tokens, p.min_tokens) == (16, 0)
    assert p.stop_strs == ()
    assert p.stop_token_ids == []
    assert p.ignore_eos is False
    assert p.greedy is False


@pytest.mark.parametrize(
    "stop, expected",
    [
        ("###", ("###",)),
        ("\n", ("\n",)),
        (["a", "bc"], ("a", "bc")),
        (("x",), ("x",)),
        (None, ()),
        ([], ()),
    ],
)
def test_stop_normalised_to_a_tuple_of_strings(stop, expected):
    p = SamplingParams(stop=stop)
    assert p.stop_strs == expected
    assert isinstance(p.stop_strs, tuple)


def test_stop_string_is_not_split_into_characters():
    assert SamplingParams(stop="END").stop_strs == ("END",)


@pytest.mark.parametrize(
    "stop_token_ids, expected",
    [(None, []), ([], []), ([3, 1], [3, 1]), ((4, 5), [4, 5])],
)
def test_stop_token_ids_normalised_to_a_list(stop_token_ids, expected):
    p = SamplingParams(stop_token_ids=stop_token_ids)
    assert p.stop_token_ids == expected
    assert isinstance(p.stop_token_ids, list)


def test_stop_token_ids_copied():
    ids = [1, 2]
    p = SamplingParams(stop_token_ids=ids)
    ids.append(3)
    assert p.stop_token_ids == [1, 2]


@pytest.mark.parametrize(
    "temperature, greedy",
    [(0, True), (0.0, True), (1e-6, True), (1e-5, False), (0.01, False), (0.7, False), (1.0, False), (3.0, False)],
)
def test_greedy_property(temperature, greedy):
    assert SamplingParams(temperature=temperature).greedy is greedy
