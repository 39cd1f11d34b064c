"""Attention backends behind one interface; the torch reference backend is the CPU default."""

from engine.attention.backend import AttentionBackend, AttentionMetadata, merge_attention
from engine.attention.torch_ref import TorchReferenceBackend


def get_backend(name: str = "auto", device: str = "cpu") -> AttentionBackend:
    if name in ("auto", "torch"):
        return TorchReferenceBackend()
    raise ValueError(f"unknown attention backend {name!r}; available: torch")


__all__ = ["AttentionBackend", "AttentionMetadata", "TorchReferenceBackend", "get_backend", "merge_attention"]
