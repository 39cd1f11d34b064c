"""The block-quantized linear kernel (blockq.c): built once per machine with the system C compiler into
the user's cache, loaded with ctypes. Needs an x86-64 CPU with AVX2 and FMA, and gcc or cc."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("blockq.c")
FLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
_c_int, _c_long, _ptr = ctypes.c_int, ctypes.c_long, ctypes.c_void_p


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here, or None if it can."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the block-quantized kernel needs an x86-64 CPU, this is {platform.machine()}"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return "the block-quantized kernel needs a CPU with AVX2 and FMA"
    if _compiler() is None:
        return "the block-quantized kernel is compiled on first use and no C compiler (gcc, cc) was found"
    return None


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


@functools.cache
def library() -> ctypes.CDLL:
    """The compiled kernel, built on first use and cached by the hash of its source and flags."""
    from lookahead_serve.engine.loader import cache_root

    if (reason := unavailable_reason()) is not None:
        raise RuntimeError(reason)
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    path = cache_root() / "kernels" / f"blockq-{digest}.so"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so")
        os.close(fd)
        try:
            subprocess.run([_compiler(), *FLAGS, "-o", tmp, str(SOURCE)], check=True, capture_output=True, text=True)
            os.replace(tmp, path)  # atomic: a concurrent build writes the same bytes
        except subprocess.CalledProcessError as e:
            os.unlink(tmp)
            raise RuntimeError(f"building the block-quantized kernel failed: {e.stderr.strip()[-2000:]}") from e
        logger.info("built the block-quantized kernel into %s", path)
    lib = ctypes.CDLL(str(path))
    lib.blockq_linear.restype = None
    lib.blockq_linear.argtypes = [_c_int, _c_int, _c_int, _ptr, _c_int, _ptr, _c_int, _ptr, _c_int, _ptr, _c_int]
    lib.blockq_packed_bytes.restype = _c_long
    lib.blockq_packed_bytes.argtypes = [_c_int, _c_int, _c_int]
    lib.blockq_pack.restype = None
    lib.blockq_pack.argtypes = [_c_int, _c_int, _c_int, _ptr, _ptr, _ptr, _ptr]
    return lib
