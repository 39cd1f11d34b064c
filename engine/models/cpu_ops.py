"""Row-wise decoder operations in C (ops_cpu.c) for bfloat16 / float16 on x86 CPUs with AVX2: the fused
residual add + RMSNorm and the rotary embedding, each one call in place of several torch calls."""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("ops_cpu.c")
_DTYPES = {torch.bfloat16: 1, torch.float16: 2}


@functools.cache
def _library() -> ctypes.CDLL | None:
    from lookahead_serve.engine.native import load, unavailable_reason

    if (reason := unavailable_reason()) is not None:
        logger.info("decoder operations in torch: %s", reason)
        return None
    try:
        lib = load(SOURCE)
    except RuntimeError as e:
        logger.warning("decoder operations in torch: %s", e)
        return None
    i, p = ctypes.c_int, ctypes.c_void_p
    lib.rms_norm.restype = lib.rotary.restype = None
    lib.rms_norm.argtypes = [i, i, p, p, p, ctypes.c_float, p, i]
    lib.rotary.argtypes = [i, i, i, p, ctypes.c_long, p, p, p, i]
    return lib


def runs_on(x: torch.Tensor) -> bool:
    """Whether these operations take ``x`` (float32 stays in torch: its arithmetic matches transformers')."""
    return x.dtype in _DTYPES and x.device.type == "cpu" and _library() is not None


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h += delta (in place, rounded to h's dtype), then RMSNorm(h) * weight. h [M, N] contiguous."""
    m, n = h.shape
    if not h.is_contiguous() or weight.dtype != h.dtype:
        raise ValueError("add_rms_norm needs a contiguous h and a weight in h's dtype")
    if delta is not None:
        delta = delta.contiguous()
    out = torch.empty_like(h)
    _library().rms_norm(m, n, h.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), eps,
                        out.data_ptr(), _DTYPES[h.dtype])
    return out


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate x [T, heads, D] in place (rows may be strided; heads packed) by the tables [max_pos, D] (x's dtype)."""
    t, heads, d = x.shape
    if x.stride(2) != 1 or x.stride(1) != d or cos.dtype != x.dtype or sin.dtype != x.dtype:
        raise ValueError("rotary_ needs heads packed within a row and tables in x's dtype")
    _library().rotary(t, heads, d, x.data_ptr(), x.stride(0), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                      _DTYPES[x.dtype])
