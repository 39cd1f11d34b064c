"""Attention backends behind one interface.

* ``torch``: the reference -- plain torch over the paged cache, lookahead segments by the prefix / tree
  split merged by log-sum-exp (the semantics every backend must match);
* ``sdpa``: the reference with lookahead segments in fused ``scaled_dot_product_attention`` calls, all of a
  step's segments in one padded call;
* ``invariant``: every segment kind through one arithmetic, so a query's output does not depend on what
  else shares its step (bfloat16 / float16: greedy lookahead equals plain decoding bit for bit).

The runner describes each step once (``CommonAttentionMetadata``); a backend's ``build`` makes the metadata
its ``forward`` reads from it, once per step.
"""

import torch

from lookahead_serve.engine.attention.backend import (AttentionBackend, AttentionMetadata, CommonAttentionMetadata, SegmentKind,
                                      merge_attention)
from lookahead_serve.engine.attention.invariant import InvariantBackend
from lookahead_serve.engine.attention.sdpa import SDPABackend
from lookahead_serve.engine.attention.torch_ref import TorchReferenceBackend

BACKENDS = {"torch": TorchReferenceBackend, "sdpa": SDPABackend, "invariant": InvariantBackend}


def get_backend(name: str = "auto", device: str = "cpu", dtype: torch.dtype = torch.float32,
                head_dim: int | None = None) -> AttentionBackend:
    if name == "auto":
        # bfloat16 / float16: invariant, so lookahead never changes a greedy token. float32: sdpa, the fastest
        # CPU backend (docs/attention.md); float32 is exact against Hugging Face, not bitwise shape-invariant.
        name = "sdpa" if dtype == torch.float32 else "invariant"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: auto, {', '.join(BACKENDS)}")
    if name == "invariant":
        return InvariantBackend(device, head_dim)  # its C kernel on CPUs that run it
    return BACKENDS[name]()


__all__ = ["AttentionBackend", "AttentionMetadata", "CommonAttentionMetadata", "InvariantBackend", "SDPABackend",
           "SegmentKind", "TorchReferenceBackend", "get_backend", "merge_attention"]
