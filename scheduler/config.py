"""Scheduler limits, checked on construction."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    """max_num_batched_tokens: token budget of one step (prefill chunks and decodes together).
    max_num_seqs: most requests running at once. max_model_len: prompt + output length cap
    (None until the engine fills in the model's limit).
    """

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the engine fills in the model's limit

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            if value is None and name == "max_model_len":
                continue
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
