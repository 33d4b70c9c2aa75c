"""Build, cache and register the C++ CPU kernels (``csrc/``) as XLA FFI targets.

The library holds the paged attention kernel (``csrc/paged_attention_cpu.cc``, used by
:mod:`jaxpaged.layers.attention.cpu`), the small-rows matmul
(``csrc/small_rows_matmul.cc``, used by :mod:`jaxpaged.layers.cpu_matmul`) and the matmul
with packed 4/8-bit weights (``csrc/packed_matmul.cc``, used by
:mod:`jaxpaged.layers.packed_linear`) and the lazily committed zeros of the KV pool
(``csrc/lazy_zeros.cc``, used by :func:`jaxpaged.layers.attention.base.allocate_kv_pool`)
and the argmax of a greedy step's real rows (``csrc/argmax_rows.cc``, used by
:mod:`jaxpaged.sampling.cpu_argmax`).
On first use the ``.cc`` sources (with the headers beside them) are compiled with the C++
compiler (``$JAXPAGED_CXX``, default ``g++``) against the XLA FFI headers jaxlib ships
(``jax.ffi.include_dir()``) into one library in ``$JAXPAGED_CACHE_ROOT/kernels``
(``~/.cache/jaxpaged/kernels`` by default, the root of :mod:`jaxpaged.runner.compile_cache`),
named by a hash of the sources, the compiler command,
its version, the jaxlib version and this CPU's feature flags (``-march=native`` code is only
valid on such a CPU). The library is written under a temporary name and renamed, so two
processes building at once both end with a whole file. It is loaded with ``ctypes`` and its
handlers registered with ``jax.ffi.register_ffi_target(..., platform="cpu")``, once per process.

A missing compiler or a failed build logs one warning and reports the kernels unavailable; the
callers then use XLA's own ops (the ``xla`` attention backend,
:mod:`jaxpaged.layers.attention.selection`, and XLA's dot).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile

import jax

from jaxpaged.constants import cache_root

logger = logging.getLogger(__name__)

#: Environment variable naming the C++ compiler.
CXX_ENV = "JAXPAGED_CXX"
#: The XLA FFI target of the paged attention kernel.
PAGED_ATTENTION_TARGET = "jaxpaged_paged_attention"
#: The XLA FFI target of the KV write followed by the paged attention kernel.
PAGED_ATTENTION_WRITE_TARGET = "jaxpaged_paged_attention_write"
#: The XLA FFI target of the small-rows float32 matmul.
SMALL_ROWS_MATMUL_TARGET = "jaxpaged_small_rows_matmul"
#: The XLA FFI target of the matmul with packed 4/8-bit weights (GGUF projections).
PACKED_MATMUL_TARGET = "jaxpaged_packed_matmul"
#: The XLA FFI target of a zero-filled buffer committed only as it is written (the KV pool).
LAZY_ZEROS_TARGET = "jaxpaged_lazy_zeros"
#: The XLA FFI target of the argmax of a step's real logit rows (greedy tokens).
ARGMAX_ROWS_TARGET = "jaxpaged_argmax_rows"

_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
_SOURCES = ("paged_attention_cpu.cc", "small_rows_matmul.cc", "packed_matmul.cc",
            "lazy_zeros.cc", "argmax_rows.cc")
# FFI target -> the handler symbol the library exports.
_TARGETS = {PAGED_ATTENTION_TARGET: "JaxpagedPagedAttention",
            PAGED_ATTENTION_WRITE_TARGET: "JaxpagedPagedAttentionWrite",
            SMALL_ROWS_MATMUL_TARGET: "JaxpagedSmallRowsMatmul",
            PACKED_MATMUL_TARGET: "JaxpagedPackedMatmul",
            LAZY_ZEROS_TARGET: "JaxpagedLazyZeros",
            ARGMAX_ROWS_TARGET: "JaxpagedArgmaxRows"}
# OpenMP only for its `simd` pragmas (no runtime): threads come from XLA:CPU's pool.
_COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-fPIC")
_LINK_FLAGS = ("-shared",)


def cpu_flags() -> str:
    """This CPU's feature flags line from ``/proc/cpuinfo`` ("" where there is none)."""
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
    for part in (cxx, version, " ".join(_COMPILE_FLAGS + _LINK_FLAGS), jaxlib.__version__,
                 cpu_flags()):
        digest.update(part.encode())
    return os.path.join(cache_root(), "kernels", f"jaxpaged_cpu-{digest.hexdigest()[:20]}.so")


def _build(cxx: str, path: str) -> None:
    """Compile the sources (one compiler process each, at once) and link them into ``path``
    atomically (temporary name, then rename).

    Raises:
        OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired: the build failed.
    """
    folder = os.path.dirname(path)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so.tmp", dir=folder)
    os.close(fd)

    def run(args):
        subprocess.run([cxx, *args], capture_output=True, text=True, check=True, timeout=600)

    try:
        with tempfile.TemporaryDirectory(dir=folder) as objects:
            pairs = [(os.path.join(_CSRC, name), os.path.join(objects, f"{name}.o"))
                     for name in _SOURCES]
            with concurrent.futures.ThreadPoolExecutor(len(pairs)) as pool:
                for done in [pool.submit(run, [*_COMPILE_FLAGS, "-isystem",
                                               jax.ffi.include_dir(), "-c", src, "-o", obj])
                             for src, obj in pairs]:
                    done.result()
            run([*_LINK_FLAGS, *(obj for _, obj in pairs), "-o", tmp])
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@functools.lru_cache(maxsize=None)
def _load(cxx: str) -> ctypes.CDLL | None:
    try:
        path = library_path(cxx)
        if not os.path.exists(path):
            logger.info("building the CPU kernels with %s into %s", cxx, path)
            _build(cxx, path)
        library = ctypes.CDLL(path)
        for target, symbol in _TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                        platform="cpu")
    except Exception as e:  # noqa: BLE001 - any failure means: use the xla paths
        detail = getattr(e, "stderr", "") or ""
        logger.warning("CPU kernels unavailable (%s: %s%s); using the xla backend",
                       type(e).__name__, e, f"\n{detail[-2000:]}" if detail else "")
        return None
    return library


def load_cpu_kernels() -> bool:
    """Build (or find in the cache) and register the CPU kernels; True when the FFI targets
    :data:`PAGED_ATTENTION_TARGET`, :data:`SMALL_ROWS_MATMUL_TARGET`,
    :data:`PACKED_MATMUL_TARGET`, :data:`LAZY_ZEROS_TARGET` and :data:`ARGMAX_ROWS_TARGET`
    are registered for the CPU. Never raises: a failure is logged once (per compiler) and
    returns False."""
    return _load(os.environ.get(CXX_ENV) or "g++") is not None


def packed_int8_dots() -> bool:
    """True when the library's packed matmul multiplies in int8 dot products with the
    activations split into two bytes per group (``csrc/packed_vnni.h``: built for a CPU with
    AVX-512 VNNI, VBMI and BW), False when it multiplies in float32 or is unavailable."""
    library = _load(os.environ.get(CXX_ENV) or "g++")
    return library is not None and bool(library.jaxpaged_packed_int8_dots())
