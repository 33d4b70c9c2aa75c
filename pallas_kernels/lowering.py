"""The one place that decides how Pallas kernels are lowered.

Every kernel in this package builds its ``pallas_call`` arguments through
:func:`pallas_call_options`, so switching a kernel from the Triton lowering to Mosaic GPU (or
tuning it) changes this module, not the callers.

Lowering used today: **Triton** (``jax.experimental.pallas.triton.CompilerParams``) for every
kernel. Why: on jax 0.11.2 and 0.12 a ``pl.pallas_call`` with Mosaic GPU compiler parameters
has no lowering rule (``shared/JAX_FACTS.md`` section 3), Mosaic GPU is reachable only through
``plgpu.kernel`` with warpgroup semantics, and its Hopper (wgmma) kernels cannot run in
interpret mode, so they could not be tested on CPU. The Triton lowering is deprecated in
jax 0.12 (a DeprecationWarning at lowering time) but compiles for sm_90 and runs in interpret
mode everywhere. On CPU (or when asked) kernels run in interpret mode.
"""

from __future__ import annotations

import contextlib

import jax

#: Lowering name reported by :func:`describe`.
LOWERING = "triton"


def default_interpret() -> bool:
    """Interpret mode unless a GPU is the default backend."""
    return jax.default_backend() != "gpu"


def pallas_call_options(*, num_warps: int, num_stages: int,
                        interpret: bool | None) -> dict:
    """Keyword arguments for ``pl.pallas_call``: compiler parameters and interpret flag.

    Args:
        num_warps: warps per program (Triton).
        num_stages: software-pipelining depth of loops with loads (Triton).
        interpret: run in the Pallas interpreter; None = :func:`default_interpret`.
    """
    from jax.experimental.pallas import triton as plt   # (slow import: docs/measurements.md)
    if interpret is None:
        interpret = default_interpret()
    return {"compiler_params": plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
            "interpret": interpret}


def cuda_lowering_context(device_kind: str = "NVIDIA H200"):
    """A context in which ``lower(lowering_platforms=("cuda",))`` works without a GPU.

    Declares an abstract CUDA device (``shared/JAX_FACTS.md`` section 2); a no-op when a GPU
    is attached.
    """
    if jax.default_backend() == "gpu":
        return contextlib.nullcontext()
    s = jax.sharding
    dev = s.AbstractDevice(device_kind=device_kind, platform="cuda", num_cores=None)
    return s.use_abstract_mesh(s.AbstractMesh((1,), ("_aot",), abstract_device=dev))


def lower_for_cuda(fn, *args, device_kind: str = "NVIDIA H200", **kwargs):
    """Lower ``jax.jit(fn)(*args, **kwargs)`` for an NVIDIA GPU of ``device_kind``; returns
    the ``Lowered`` object (its ``as_text()`` holds the Triton custom calls).

    Raises:
        Whatever the Pallas GPU lowering raises for a kernel that cannot compile there.
    """
    with cuda_lowering_context(device_kind):
        return jax.jit(fn).trace(*args, **kwargs).lower(lowering_platforms=("cuda",))
