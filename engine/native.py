"""The engine's C kernels for x86 CPUs (the block-quantized linear, the invariant paged attention, the
decoder's row-wise operations and whole step): one library, built once per machine with the system C
compiler into the user's cache and loaded with ctypes. They need an x86-64 CPU with AVX2, FMA and F16C,
and gcc or cc."""

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

_ENGINE = Path(__file__).parent
SOURCES = [_ENGINE / "quant" / "blockq.c", _ENGINE / "attention" / "paged_cpu.c", _ENGINE / "models" / "ops_cpu.c"]
HEADERS = [_ENGINE / "cpu_kernels.h"]
# The kernels' dtype codes (cpu_kernels.h): the one table every caller passes from
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
# Where the CPU has AVX-512 VNNI (with BW and VL), the block kernel's int8 dot products take one instruction
# instead of two; the integers are the same, so the outputs keep their bits (tests/model/test_blockq.py).
VNNI_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"]
_VNNI_CPU_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


@functools.cache
def flags() -> list[str]:
    """The compiler flags for this machine: FLAGS, plus VNNI_FLAGS where the CPU has those features."""
    return FLAGS + VNNI_FLAGS if _VNNI_CPU_FLAGS <= cpu_flags() else FLAGS


def unavailable_reason() -> str | None:
    """Why the C kernels cannot run here, or None if they can."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the engine's C kernels need an x86-64 CPU, this is {platform.machine()}"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return "the engine's C kernels need a CPU with AVX2 and FMA"
    if _compiler() is None:
        return "the engine's C kernels are compiled on first use and no C compiler (gcc, cc) was found"
    return None


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


@functools.cache
def load_error() -> str | None:
    """Why the kernels cannot be used here, found by building and loading them once; None if they load."""
    if (reason := unavailable_reason()) is not None:
        return reason
    try:
        library()
    except (RuntimeError, OSError) as e:
        return str(e)
    return None


@functools.cache
def source_digest() -> str:
    """A hash of the kernels' sources and flags: names the built library, and keys what was measured with it
    (the step-cost profile)."""
    texts = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    return hashlib.sha256(texts + " ".join(flags()).encode()).hexdigest()[:16]


@functools.cache
def library() -> ctypes.CDLL:
    """The kernels compiled (on first use, cached by the hash of the sources and flags) and loaded; callers
    declare the signatures of the functions they use."""
    from lookahead_serve.engine.loader import cache_root

    if (reason := unavailable_reason()) is not None:
        raise RuntimeError(reason)
    path = cache_root() / "kernels" / f"engine-{source_digest()}.so"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so")
        os.close(fd)
        try:
            try:
                compile_shared(SOURCES, Path(tmp))
            except RuntimeError as e:
                if flags() == FLAGS:
                    raise
                # e.g. a compiler older than the CPU (gcc < 8 has no -mavx512vnni): the AVX2 build gives the
                # same bits, a little slower, and beats falling back to dequantized weights
                logger.warning("building the C kernels with %s failed, building them for AVX2: %s",
                               " ".join(VNNI_FLAGS), e)
                compile_shared(SOURCES, Path(tmp), FLAGS)
            os.replace(tmp, path)  # atomic: a concurrent build writes the same bytes
        except RuntimeError:
            os.unlink(tmp)
            raise
        logger.info("built the engine's C kernels into %s", path)
    return ctypes.CDLL(str(path))


def compile_shared(sources: list[Path], out: Path, cflags: list[str] | None = None) -> None:
    """Compile ``sources`` into the shared library ``out`` with the kernels' compiler and ``cflags`` (default:
    this machine's, ``flags()``); RuntimeError with the compiler's message if it fails."""
    cflags = flags() if cflags is None else cflags
    try:
        subprocess.run([_compiler(), *cflags, "-o", str(out), *map(str, sources)], check=True, capture_output=True,
                       text=True)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"building the engine's C kernels failed: {e.stderr.strip()[-2000:]}") from e
