"""lookahead-serve's engine: offline API, config tree, model runner and attention backends."""

from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from scheduler import LookaheadConfig, LookaheadParams, SamplingParams, SchedulerConfig

__all__ = [
    "LLM",
    "CacheConfig",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "LookaheadConfig",
    "LookaheadParams",
    "ModelConfig",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
]
