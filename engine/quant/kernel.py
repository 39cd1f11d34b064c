"""The block-quantized linear kernel (blockq.c), built and loaded by ``engine.native``."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from lookahead_serve.engine.native import unavailable_reason

SOURCE = Path(__file__).with_name("blockq.c")
_c_int, _c_long, _ptr = ctypes.c_int, ctypes.c_long, ctypes.c_void_p

__all__ = ["SOURCE", "library", "unavailable_reason"]


@functools.cache
def library() -> ctypes.CDLL:
    """The compiled kernel, with its functions' signatures."""
    from lookahead_serve.engine.native import load

    lib = load(SOURCE)
    lib.blockq_linear.restype = None
    lib.blockq_linear.argtypes = [_c_int, _c_int, _c_int, _ptr, _c_int, _ptr, _c_int, _ptr, _c_int, _ptr, _c_int]
    lib.blockq_packed_bytes.restype = _c_long
    lib.blockq_packed_bytes.argtypes = [_c_int, _c_int, _c_int]
    lib.blockq_pack.restype = None
    lib.blockq_pack.argtypes = [_c_int, _c_int, _c_int, _ptr, _ptr, _ptr, _ptr]
    return lib
