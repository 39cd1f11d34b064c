"""lookahead-serve: an LLM serving engine with paged KV cache, continuous batching and lookahead decoding.

The public API::

    from lookahead_serve import LLM, SamplingParams, LookaheadParams

The packages below it: ``engine`` (offline API, model runner, attention), ``scheduler`` (continuous
batching and lookahead planning), ``kv_cache`` (paged KV bookkeeping), ``proto`` (the gRPC service) and
``deploy`` (command line, Ray Serve, load tests).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = [
    "LLM",
    "CacheConfig",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "LookaheadConfig",
    "LookaheadParams",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
]

if TYPE_CHECKING:
    from lookahead_serve.engine import (
        LLM,
        CacheConfig,
        CompletionOutput,
        EngineConfig,
        LLMEngine,
        LookaheadConfig,
        LookaheadParams,
        ModelConfig,
        RequestOutput,
        SamplingParams,
        SchedulerConfig,
    )


def __getattr__(name: str):
    """The public API, imported on first use: ``import lookahead_serve.scheduler`` stays free of torch."""
    if name in __all__:
        return getattr(importlib.import_module("lookahead_serve.engine"), name)
    raise AttributeError(f"module 'lookahead_serve' has no attribute {name!r}")
