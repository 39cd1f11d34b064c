"""Attention backends behind one interface.

* ``torch``: the reference -- plain torch over the paged cache, lookahead segments by the prefix / tree
  split merged by log-sum-exp (the semantics every backend must match);
* ``sdpa``: the reference with lookahead segments in fused ``scaled_dot_product_attention`` calls, all of a
  step's segments in one padded call.
"""

from engine.attention.backend import AttentionBackend, AttentionMetadata, merge_attention
from engine.attention.sdpa import SDPABackend
from engine.attention.torch_ref import TorchReferenceBackend

BACKENDS = {"torch": TorchReferenceBackend, "sdpa": SDPABackend}


def get_backend(name: str = "auto", device: str = "cpu") -> AttentionBackend:
    if name == "auto":
        # CPU: sdpa, which steps with lookahead segments faster than the reference (benchmarks/RESULTS.md)
        name = "sdpa"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: auto, {', '.join(BACKENDS)}")
    return BACKENDS[name]()


__all__ = ["AttentionBackend", "AttentionMetadata", "SDPABackend", "TorchReferenceBackend", "get_backend",
           "merge_attention"]
