"""The block-quantized linear kernel (blockq.c), in the library ``engine.native`` builds."""

from __future__ import annotations

import ctypes
import functools

from lookahead_serve.engine.native import unavailable_reason

_c_int, _c_long, _ptr = ctypes.c_int, ctypes.c_long, ctypes.c_void_p

__all__ = ["declare", "library", "unavailable_reason"]


@functools.cache
def library() -> ctypes.CDLL:
    """The compiled kernel, with its functions' signatures."""
    from lookahead_serve.engine import native

    return declare(native.library())


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` (a build of blockq.c) with the kernel functions' signatures declared."""
    lib.blockq_linear.restype = None
    lib.blockq_linear.argtypes = [_c_int, _c_int, _c_int, _ptr, _c_int, _ptr, _c_int, _ptr, _c_int, _ptr, _c_int]
    lib.blockq_packed_bytes.restype = _c_long
    lib.blockq_packed_bytes.argtypes = [_c_int, _c_int, _c_int]
    lib.blockq_scratch_bytes.restype = _c_long
    lib.blockq_scratch_bytes.argtypes = [_c_int, _c_int]
    lib.blockq_pack.restype = None
    lib.blockq_pack.argtypes = [_c_int, _c_int, _c_int, _ptr, _ptr, _ptr, _ptr]
    return lib
