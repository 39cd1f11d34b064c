"""The engine's configuration tree: model, cache and scheduler, each checked on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from lookahead_serve.scheduler.config import SchedulerConfig

_DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("auto", "gguf", "none")  # engine.quant imports it


def _help(text: str, choices: tuple[str, ...] | None = None, **kw):
    """A config field with its help text (and choices): what the CLI shows for its flag."""
    return field(metadata={"help": text, "choices": choices}, **kw)


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = _help("a Hugging Face folder, a .gguf file or a Hub id (org/name[@revision]) in the local "
                              "Hugging Face cache (default: the embedded SmolLM2-135M-Instruct)", default=None)
    dtype: str = _help("weights and KV cache dtype: auto = bfloat16 on CUDA and on CPUs with native bf16 "
                       "(avx512_bf16 or AMX), else float32", choices=_DTYPES, default="auto")
    max_model_len: int | None = _help("prompt + output token cap (default: the model's)", default=None)
    quantization: str = _help("auto = a GGUF file's Q4_0/Q4_1/Q8_0 linear weights kept as shipped and run by the "
                              "block-quantized CPU kernel (x86-64 with AVX2), activations in bfloat16; none = "
                              "weights dequantized (equal to Hugging Face in float32)",
                              choices=QUANTIZATIONS, default="auto")
    device: str = _help("cpu or cuda[:N]", default="cpu")
    seed: int = _help("seed of the engine's sampler for requests without one", default=0)
    attention_backend: str = _help("auto = invariant in bfloat16/float16 (a token's bits never depend on what "
                                   "shares its step), sdpa in float32", choices=("auto", "torch", "sdpa", "invariant"),
                                   default="auto")

    def __post_init__(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len!r}")
        from lookahead_serve.engine.attention import BACKENDS

        if self.attention_backend != "auto" and self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be auto or one of {sorted(BACKENDS)}, got {self.attention_backend!r}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = _help("tokens per KV block", default=16)
    num_blocks: int | None = _help("KV blocks in the pool (default: as many as kv_cache_memory_gib holds)",
                                   default=None)
    kv_cache_memory_gib: float = _help("KV cache size in GiB", default=1.0)
    enable_prefix_caching: bool = _help("reuse full KV blocks of identical prefixes across requests", default=True)

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
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)  # max_model_len None: the model's


def resolve_dtype(dtype: str, device: str, quantization: str = "none") -> str:
    """"auto" -> "bfloat16" on CUDA, with block-quantized weights (their kernel takes bfloat16 activations and
    the bf16 attention is shape-invariant) and on CPUs with native bf16 arithmetic (oneDNN's check:
    avx512_bf16 or AMX), else "float32": without it, CPU bf16 GEMMs run a scalar-ish fallback several times
    slower."""
    if dtype != "auto":
        return dtype
    if device.startswith("cuda") or quantization == "gguf":
        return "bfloat16"
    import torch

    return "bfloat16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32"
