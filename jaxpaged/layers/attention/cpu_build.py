"""Build, cache and register the C++ CPU attention kernel (``csrc/``) as an XLA FFI target.

On first use ``csrc/paged_attention_cpu.cc`` (with the headers beside it) is compiled with the C++ compiler (``$JAXPAGED_CXX``, default
``g++``) against the XLA FFI headers jaxlib ships (``jax.ffi.include_dir()``) into
``$JAXPAGED_CACHE_ROOT/kernels`` (``~/.cache/jaxpaged/kernels`` by default, the root of
:mod:`jaxpaged.runner.compile_cache`), named by a hash of the sources, the compiler command,
its version, the jaxlib version and this CPU's feature flags (``-march=native`` code is only
valid on such a CPU). The library is written under a temporary name and renamed, so two
processes building at once both end with a whole file. It is loaded with ``ctypes`` and its
handler registered with ``jax.ffi.register_ffi_target(..., platform="cpu")``, once per process.

A missing compiler or a failed build logs one warning and reports the kernel unavailable; the
callers then use the ``xla`` backend (:mod:`jaxpaged.layers.attention.selection`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile

import jax

from jaxpaged.runner.compile_cache import cache_root

logger = logging.getLogger(__name__)

#: Environment variable naming the C++ compiler.
CXX_ENV = "JAXPAGED_CXX"
#: The XLA FFI target of the paged attention kernel.
PAGED_ATTENTION_TARGET = "jaxpaged_paged_attention"

_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
_SOURCE = os.path.join(_CSRC, "paged_attention_cpu.cc")
_SYMBOL = "JaxpagedPagedAttention"
# OpenMP only for its `simd` pragmas (no runtime): threads come from XLA:CPU's pool.
_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def library_path(cxx: str) -> str:
    """Where the library built by ``cxx`` is cached (a hash of everything it depends on).

    Raises:
        OSError: ``cxx`` cannot be run (e.g. it does not exist).
    """
    import jaxlib

    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True,
                             timeout=60).stdout
    digest = hashlib.sha256()
    for name in sorted(os.listdir(_CSRC)):
        with open(os.path.join(_CSRC, name), "rb") as f:
            digest.update(name.encode() + f.read())
    for part in (cxx, version, " ".join(_FLAGS), jaxlib.__version__, _cpu_flags()):
        digest.update(part.encode())
    return os.path.join(cache_root(), "kernels", f"paged_attention_cpu-{digest.hexdigest()[:20]}.so")


def _build(cxx: str, path: str) -> None:
    """Compile the source into ``path`` atomically (temporary name, then rename).

    Raises:
        OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired: the build failed.
    """
    folder = os.path.dirname(path)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so.tmp", dir=folder)
    os.close(fd)
    try:
        subprocess.run([cxx, *_FLAGS, "-isystem", jax.ffi.include_dir(), _SOURCE, "-o", tmp],
                       capture_output=True, text=True, check=True, timeout=600)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@functools.lru_cache(maxsize=None)
def _load(cxx: str) -> bool:
    try:
        path = library_path(cxx)
        if not os.path.exists(path):
            logger.info("building the CPU attention kernel with %s into %s", cxx, path)
            _build(cxx, path)
        library = ctypes.CDLL(path)
        jax.ffi.register_ffi_target(PAGED_ATTENTION_TARGET,
                                    jax.ffi.pycapsule(getattr(library, _SYMBOL)),
                                    platform="cpu")
    except Exception as e:  # noqa: BLE001 - any failure means: attend with the xla backend
        detail = getattr(e, "stderr", "") or ""
        logger.warning("CPU attention kernel unavailable (%s: %s%s); using the xla backend",
                       type(e).__name__, e, f"\n{detail[-2000:]}" if detail else "")
        return False
    return True


def load_paged_attention() -> bool:
    """Build (or find in the cache) and register the paged attention kernel; True when the FFI
    target :data:`PAGED_ATTENTION_TARGET` is registered for the CPU. Never raises: a failure is
    logged once (per compiler) and returns False."""
    return _load(os.environ.get(CXX_ENV) or "g++")
