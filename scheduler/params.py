"""Per-request generation parameters (vLLM's names), checked on construction.

Pure Python: the scheduler reads the stopping fields, the runner the sampling ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5
# Limits on what one request may ask the detokenizer and the stop check to do each step.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
# torch.Generator.manual_seed takes seeds in [-2**63, 2**64).
_SEED_RANGE = (-(1 << 63), 1 << 64)


def _is_int(value) -> bool:
    """An int that is not a bool (True is an int to Python, never a count or an id here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    """A finite int or float (not a bool): NaN and infinities pass no comparison test reliably."""
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


@dataclass(frozen=True)
class LookaheadParams:
    """Lookahead decoding for one request, named as TensorRT-LLM names them.

    window_size W: future positions worked on per step. ngram_size N: n-gram length (at most N tokens
    accepted per step). verification_set_size G: n-grams verified per step, and the pool's cap per key.
    ``LookaheadParams(enabled=False)`` or (1, 1, 0) is plain decoding. window_size 0 runs no window: each
    step only verifies the pool's n-grams (those of the prompt and the output; n-gram or prompt-lookup
    speculation), at most G of them.
    """

    window_size: int = 4
    ngram_size: int = 3
    verification_set_size: int = 4
    enabled: bool = True

    def __post_init__(self) -> None:
        for name in ("window_size", "ngram_size", "verification_set_size"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise ValueError(f"lookahead.{name} must be a non-negative int, got {value!r}")
        if self.is_plain:
            return
        if self.window_size == 1 or (self.window_size == 0 and self.verification_set_size < 1):
            raise ValueError(
                "lookahead.window_size must be at least 2, or 0 (verification only) with verification_set_size "
                f"at least 1, or 1 with ngram_size 1 (plain), got ({self.window_size}, {self.ngram_size}, "
                f"{self.verification_set_size})"
            )
        if self.ngram_size < 3:
            raise ValueError(f"lookahead.ngram_size must be at least 3 (or 1 for plain decoding), got {self.ngram_size}")

    @classmethod
    def parse(cls, text: str) -> LookaheadParams:
        """"W,N,G" (e.g. "7,5,7") or "off"; ValueError otherwise."""
        if text.strip().lower() == "off":
            return cls(enabled=False)
        try:
            w, n, g = (int(v) for v in text.split(","))
        except ValueError:
            raise ValueError(f"lookahead: expected off or W,N,G (e.g. 7,5,7), got {text!r}") from None
        return cls(w, n, g)

    def label(self) -> str:
        """"W,N,G", or "off" for plain decoding: what ``parse`` reads."""
        return "off" if self.is_plain else f"{self.window_size},{self.ngram_size},{self.verification_set_size}"

    @property
    def is_plain(self) -> bool:
        return not self.enabled or (self.window_size <= 1 and self.ngram_size <= 1)

    @property
    def verify_only(self) -> bool:
        """No window: the step verifies candidates from the pool and nothing else."""
        return not self.is_plain and self.window_size == 0


@dataclass
class SamplingParams:
    """How to sample one request.

    temperature: 0 means greedy; otherwise logits are divided by it.
    top_p: nucleus sampling, in (0, 1]. top_k: keep the k most likely tokens; 0 or -1 disables it.
    seed: per-request seed, so a sampled output is reproducible whatever else is in the batch. It also
        seeds the lookahead window's random start (which changes the steps taken, never the tokens).
    max_tokens: most tokens to generate. min_tokens: EOS and stop token ids are ignored before this many.
    stop: strings that end generation (not included in the text unless include_stop_str_in_output).
    stop_token_ids: token ids that end generation (the token is kept in token_ids).
    ignore_eos: keep generating after the model's end-of-sequence token.
    lookahead: None takes the engine's default; LookaheadParams(enabled=False) decodes plainly.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    lookahead: LookaheadParams | None = None
    stop_strs: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        if not _is_real(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled), 0 (disabled) or positive, got {self.top_k!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}")
        if self.seed is not None and (not _is_int(self.seed) or not _SEED_RANGE[0] <= self.seed < _SEED_RANGE[1]):
            raise ValueError(f"seed must be an int in [-2**63, 2**64) or None, got {self.seed!r}")
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
            raise ValueError(f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters long")
        self.stop_strs = tuple(stop)
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
        ids = list(self.stop_token_ids or [])
        if any(not _is_int(t) or t < 0 for t in ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids holds {len(ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
        self.stop_token_ids = ids
        if self.lookahead is not None and not isinstance(self.lookahead, LookaheadParams):
            raise ValueError(f"lookahead must be a LookaheadParams or None, got {self.lookahead!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS
