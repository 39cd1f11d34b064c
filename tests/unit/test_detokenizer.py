"""Incremental detokenization: the streamed text equals one full decode, in linear time (each token is
decoded once while the request runs), for the real model's tokenizer and a byte-level one."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from lookahead_serve.engine.detokenizer import IncrementalDetokenizer
from lookahead_serve.engine.loader import load_tokenizer
from tests.conftest import _byte_tokenizer

TEXT = ("def merge(a, b):\n    \"\"\"Merge two sorted lists.\"\"\"\n    out = []\n"
        "Grüße aus Köln — naïve café, 東京と大阪, emoji 🚀🧪 and math ∑ x² ≤ ∞.\n"
        "The quick brown fox jumps over the lazy dog; numbers 1234567890, 3.14159!\n")


class CountingTokenizer:
    """The tokenizer, counting full decodes."""

    def __init__(self, tokenizer) -> None:
        self.inner = tokenizer
        self.backend_tokenizer = tokenizer.backend_tokenizer
        self.full_decodes = 0

    def decode(self, ids, skip_special_tokens=False):
        self.full_decodes += 1
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def _stream(tokenizer, ids, chunks, stop=(), include_stop=False, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens, stop, include_stop)
    text, n = "", 0
    for size in chunks:
        n = min(len(ids), n + size)
        text += detok.update(ids[:n], finished=n == len(ids))
        if detok.stopped_by is not None or n == len(ids):
            break
    return text, detok


@pytest.fixture(scope="module", params=["default model", "byte-level"])
def tokenizer(request, default_model_path):
    if request.param == "byte-level":
        return _byte_tokenizer()
    return load_tokenizer(Path(default_model_path))


@pytest.mark.parametrize("step", [1, 3, 7])  # one token a step, or several (accepted lookahead tokens)
def test_long_output_streams_in_linear_time_and_equals_a_full_decode(tokenizer, step):
    ids = tokenizer(TEXT * 40, add_special_tokens=False).input_ids  # thousands of tokens, multi-byte characters
    assert len(ids) > 2000
    counting = CountingTokenizer(tokenizer)
    text, _ = _stream(counting, ids, [step] * len(ids))
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert counting.full_decodes == 1  # the final one only: no re-decoding of the whole output per step


def test_stop_string_and_held_back_text(tokenizer):
    ids = tokenizer(TEXT * 3, add_special_tokens=False).input_ids
    rng = random.Random(0)
    chunks = [rng.randint(1, 4) for _ in ids]
    full = tokenizer.decode(ids, skip_special_tokens=True)
    stop = "lazy dog"
    text, detok = _stream(tokenizer, ids, chunks, stop=(stop,))
    assert detok.stopped_by == stop and text == full[: full.index(stop)]
    text, _ = _stream(tokenizer, ids, chunks, stop=(stop,), include_stop=True)
    assert text == full[: full.index(stop) + len(stop)]
