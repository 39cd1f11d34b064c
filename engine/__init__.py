"""lookahead-serve's engine: offline API, config tree, model runner and attention backends."""

from lookahead_serve.engine.config import CacheConfig, EngineConfig, ModelConfig
from lookahead_serve.engine.llm import LLM
from lookahead_serve.engine.llm_engine import EngineStats, LLMEngine, ModelInfo
from lookahead_serve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from lookahead_serve.scheduler import LookaheadConfig, LookaheadParams, SamplingParams, SchedulerConfig

__all__ = [
    "LLM",
    "CacheConfig",
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "LLMEngine",
    "LookaheadConfig",
    "LookaheadParams",
    "ModelConfig",
    "ModelInfo",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
]
