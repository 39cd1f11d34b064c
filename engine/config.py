"""The engine's configuration tree: model, cache and scheduler, each checked on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.config import LookaheadConfig, SchedulerConfig
from scheduler.params import LookaheadParams

# Engine-wide default for requests that do not choose. Measured on the default model (benchmarks/RESULTS.md,
# 2026-12-02): among (15,5,15), (7,5,7), (5,3,5) and (4,3,4), (5,3,5) costs the least wall-clock at batch 1
# on a 2-core CPU in float32 (0.66x / 0.85x of lookahead off on MT-bench / HumanEval, against 0.64x /
# 0.81x for (4,3,4) and 0.41x / 0.63x for (15,5,15)) while compressing more than (4,3,4) (1.48 / 2.13
# tokens per step). Every setting is slower than plain decoding on that CPU; choosing per step whether
# lookahead pays is the scheduler's job (the lookahead-scheduling issue).
DEFAULT_LOOKAHEAD = LookaheadParams(window_size=5, ngram_size=3, verification_set_size=5)

_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelConfig:
    """model: None for the embedded default (SmolLM2-135M-Instruct), a Hugging Face folder, or a .gguf file.
    dtype: "auto" is bfloat16 where the hardware computes it natively (any CUDA GPU; a CPU with
    avx512_bf16 or AMX) and float32 elsewhere (resolve_dtype). max_model_len: None takes the model's own limit.
    attention_backend: "auto" picks by device (engine.attention), or name one.
    """

    model: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    device: str = "cpu"
    seed: int = 0
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len!r}")
        from engine.attention import BACKENDS

        if self.attention_backend != "auto" and self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be auto or one of {sorted(BACKENDS)}, got {self.attention_backend!r}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")


@dataclass(frozen=True)
class CacheConfig:
    """block_size: tokens per KV block. num_blocks: None sizes the pool from kv_cache_memory_gib.
    enable_prefix_caching: reuse full blocks of identical prefixes across requests.
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_gib: float = 1.0
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 1):
            raise ValueError(f"num_blocks must be a positive int, got {self.num_blocks!r}")
        if self.kv_cache_memory_gib <= 0:
            raise ValueError(f"kv_cache_memory_gib must be positive, got {self.kv_cache_memory_gib!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    # None: defaults with lookahead on (DEFAULT_LOOKAHEAD), and max_model_len from the model
    scheduler: SchedulerConfig | None = None


def default_scheduler_config(**overrides) -> SchedulerConfig:
    overrides.setdefault("lookahead", LookaheadConfig(default=DEFAULT_LOOKAHEAD))
    overrides.setdefault("lookahead_policy", "adaptive")
    return SchedulerConfig(**overrides)


def resolve_dtype(dtype: str, device: str) -> str:
    """"auto" -> "bfloat16" on CUDA and on CPUs with native bf16 arithmetic (oneDNN's check: avx512_bf16 or
    AMX), else "float32": without it, CPU bf16 GEMMs run a scalar-ish fallback several times slower."""
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return "bfloat16"
    import torch

    return "bfloat16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32"
