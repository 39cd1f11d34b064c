"""A linear layer over block-quantized weights (the kernel in blockq.c)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from lookahead_serve.engine.quant.kernel import library

QK = 32  # values per block along K
TILE = 4  # rows per packed tile


@dataclass
class BlockWeight:
    """An [N, K] weight as blocks of 32 along K: w = d * q + m (4-bit q, ``m`` given) or w = d * q (int8 q)."""

    q: np.ndarray  # [N, K] int8: 0..15 when m is given
    d: np.ndarray  # [N, K / 32] float32
    m: np.ndarray | None  # [N, K / 32] float32

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        """The float32 weight, computed as GGUF's own dequantization does (d * q + m)."""
        n, k = self.q.shape
        w = self.q.reshape(n, k // QK, QK).astype(np.float32) * self.d[..., None]
        if self.m is not None:
            w = w + self.m[..., None]
        return torch.from_numpy(w.reshape(n, k))

    @staticmethod
    def concat(parts: list[BlockWeight]) -> BlockWeight:
        """Rows of several weights stacked (a fused projection); all 4-bit or all int8."""
        if len({p.m is None for p in parts}) != 1:
            raise ValueError("cannot fuse 4-bit and 8-bit block weights")
        m = None if parts[0].m is None else np.concatenate([p.m for p in parts])
        return BlockWeight(np.concatenate([p.q for p in parts]), np.concatenate([p.d for p in parts]), m)


def pack(w: BlockWeight) -> torch.Tensor:
    """The kernel's packed bytes of ``w`` (tiles of 4 rows, one record per tile and block)."""
    n, k = w.shape
    if n % TILE or k % QK:
        raise ValueError(f"block-quantized weights need rows in multiples of {TILE} and columns of {QK}, got {n}x{k}")
    lib = library()
    q4 = w.m is not None
    out = torch.empty(lib.blockq_packed_bytes(n, k, int(q4)), dtype=torch.uint8)
    q, d = np.ascontiguousarray(w.q, np.int8), np.ascontiguousarray(w.d, np.float32)
    m = np.ascontiguousarray(w.m, np.float32) if q4 else np.zeros(1, np.float32)
    lib.blockq_pack(n, k, int(q4), q.ctypes.data, d.ctypes.data, m.ctypes.data, out.data_ptr())
    return out


def scratch_bytes(m: int, k: int) -> int:
    """Bytes of scratch the kernel needs for ``m`` rows of ``k`` inputs (its quantized copy of x)."""
    return max(1, library().blockq_scratch_bytes(m, k))


class BlockQuantLinear(nn.Module):
    """y = x @ W^T (+ bias) with W block-quantized. x is quantized per row, per block of 32, to int8 (as
    llama.cpp does), so a row's output has the same bits whatever else is in the call. Output: x's dtype,
    or ``out_dtype``. CPU only."""

    def __init__(self, packed: torch.Tensor, out_features: int, in_features: int, q4: bool,
                 bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, lib=None) -> None:
        """``lib``: another build of the kernel with the same packed layout (``kernel.declare``d); default the
        engine's."""
        super().__init__()
        self.in_features, self.out_features, self.q4 = in_features, out_features, q4
        self.register_buffer("packed", packed, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_dtype = out_dtype
        self._lib = library() if lib is None else lib

    @classmethod
    def from_weight(cls, w: BlockWeight, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None):
        n, k = w.shape
        return cls(pack(w), n, k, w.m is not None, bias, out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"block-quantized linears take bfloat16 or float32 inputs, got {x.dtype}")
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features).contiguous()
        m = x.shape[0]
        out_dtype = self.out_dtype or x.dtype
        y = torch.empty(m, self.out_features, dtype=out_dtype)
        scratch = torch.empty(scratch_bytes(m, self.in_features), dtype=torch.uint8)
        if m:
            self._lib.blockq_linear(m, self.out_features, self.in_features, x.data_ptr(), int(x.dtype == torch.bfloat16),
                                    self.packed.data_ptr(), int(self.q4), y.data_ptr(), int(out_dtype == torch.bfloat16),
                                    scratch.data_ptr(), torch.get_num_threads())
        if self.bias is not None:
            y = y + self.bias.to(out_dtype)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={4 if self.q4 else 8}"
