"""Compiled model steps kept on disk whole, so a warm start-up skips tracing and lowering too.

JAX's persistent compilation cache (``jaxpaged.runner.compile_cache``) saves the XLA compile
but keys on the lowered program, so every start-up still traces and lowers each step shape
first, most of a warm start-up (``docs/measurements.md``, "Executable store"). This store saves each compiled step
(``jax.experimental.serialize_executable``) under ``<cache dir>/steps`` and loads it by a
fingerprint of everything the traced program depends on: the model's graph (its modules and
static attributes: dtypes, attention backend, KV scales), the shapes, dtypes and shardings of
the parameters and the KV pool, the step's padded shape, the source of ``jaxpaged`` and
``pallas_kernels``, the jax/jaxlib versions, JAX's configuration, ``XLA_FLAGS`` and the
devices. Any change to one of them misses, and the step is lowered and compiled again (and
JAX's cache may still serve the compile).

A step that JAX's persistent cache served is not stored: jax 0.12's XLA:CPU executable, once
loaded from that cache, serializes without its compiled kernels, and a later start-up that loads
such an entry fails at run time (``NOT_FOUND: Function wrapped_broadcast not found``). Only
steps compiled afresh in this process are stored (:meth:`ExecutableStore.compile`); a shape
that the JAX cache keeps serving pays tracing and lowering at each start-up instead.

The directory is trusted like JAX's: entries are pickles, so whoever can write to it can make
this process run code; it is created private to the user. Multi-process jobs do not use it.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxpaged.atomic_file import digest_files, write_atomically

logger = logging.getLogger(__name__)

_PACKAGES = ("jaxpaged", "pallas_kernels")
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_cache_hits = 0


def _count_cache_hits(event: str, **_kwargs) -> None:
    global _cache_hits
    if event == _CACHE_HIT_EVENT:
        _cache_hits += 1


jax.monitoring.register_event_listener(_count_cache_hits)


def persistent_cache_hits() -> int:
    """Executables JAX's persistent compilation cache served in this process so far."""
    return _cache_hits


@functools.lru_cache(maxsize=1)
def _source_digest() -> str:
    """SHA-256 of every ``.py``, ``.cc`` and ``.h`` file of the packages that build the
    step."""
    def sources(root):
        for folder, dirs, files in sorted(os.walk(root)):
            dirs.sort()
            yield from (os.path.join(folder, f) for f in sorted(files)
                        if f.endswith((".py", ".cc", ".h")))      # .cc, .h: the CPU kernels

    return digest_files(path for name in _PACKAGES
                        for path in sources(os.path.dirname(os.path.realpath(
                            __import__(name).__file__))))


def _avals(tree) -> list:
    return [(np.shape(a), str(getattr(a, "dtype", type(a).__name__)),
             repr(getattr(a, "sharding", None))) for a in jax.tree.leaves(tree)]


def model_digest(graphdef, state) -> str:
    """Hex digest of a model for :func:`fingerprint`: ``graphdef`` (addresses of the
    functions it holds removed) and the avals and shardings of ``state``. (Computed once per
    model: it is not free, and each step program of a start-up paid it before;
    ``docs/measurements.md``, "Executable store".)"""
    parts = (re.sub(r" at 0x[0-9a-f]+", "", repr(graphdef)), _avals(state))
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def fingerprint(model: str, kv_caches, args, extra) -> str:
    """Hex digest naming a step program: the ``model`` (:func:`model_digest`), the avals and
    shardings of ``kv_caches`` and of every argument the program is lowered for (``args``:
    two programs that differ only in one input's shape, e.g. the previous step's sampled ids
    of another ``max_num_seqs``, must not share an entry), ``extra`` (the runner's own
    settings) and this process's code, versions, configuration and devices."""
    import jaxlib

    parts = (model, _avals(kv_caches),
             _avals(args), extra, _source_digest(), jax.__version__, jaxlib.__version__,
             sorted((k, repr(v)) for k, v in jax.config.values.items()
                    if k != "jax_compilation_cache_dir"),
             os.environ.get("XLA_FLAGS", ""),
             [(d.id, d.platform, d.device_kind) for d in jax.devices()])
    return hashlib.sha256(repr(parts).encode()).hexdigest()


class ExecutableStore:
    """Serialized compiled steps in ``directory`` (None: a store that holds nothing)."""

    def __init__(self, directory: str | None):
        self.directory = directory if jax.process_count() == 1 else None
        #: Executables this store compiled afresh (neither loaded nor served by JAX's cache).
        self.num_fresh = 0

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, f"{name}.pkl")

    def load(self, name: str, devices: list):
        """The executable stored as ``name`` (a :func:`fingerprint`) loaded onto ``devices``
        (the step's mesh, in its order), or None; an entry that cannot be read or loaded is
        ignored (logged) and compiled again. On the CPU the C++ kernels' FFI targets are
        registered first (``jaxpaged.layers.cpu_build``)."""
        if self.directory is None or not os.path.exists(self._path(name)):
            return None
        from jax.experimental import serialize_executable
        if {d.platform for d in devices} == {"cpu"}:
            # A step may call the CPU kernels: their FFI targets must be registered
            # before the executable is deserialized (a failure is logged; the load then fails
            # below and the step is compiled again).
            from jaxpaged.layers.cpu_build import load_cpu_kernels
            load_cpu_kernels()
        try:
            with open(self._path(name), "rb") as f:
                return serialize_executable.deserialize_and_load(
                    *pickle.load(f), execution_devices=devices)
        except Exception as e:  # noqa: BLE001 - any broken entry means: compile it again
            logger.warning("ignoring stored step %s: %s", name, e)
            return None

    def compile(self, name: str, lower: Callable[[], Any]):
        """Compile ``lower()`` (a ``jax.stages.Lowered``) and store it as ``name``, unless
        JAX's persistent cache served it (see the module docstring). Returns the compiled
        executable."""
        hits = persistent_cache_hits()
        compiled = lower().compile()
        if persistent_cache_hits() == hits:
            self.num_fresh += 1
            self.store(name, compiled)
        else:
            logger.debug("step %s came from JAX's compilation cache: not stored", name)
        return compiled

    def store(self, name: str, compiled) -> None:
        """Save ``compiled`` (compiled afresh in this process) as ``name`` (atomically:
        written aside, then renamed)."""
        if self.directory is None:
            return
        from jax.experimental import serialize_executable
        try:
            write_atomically(self._path(name), lambda f: pickle.dump(
                serialize_executable.serialize(compiled), f))
        except Exception as e:  # noqa: BLE001 - a step that cannot be stored still runs
            logger.warning("could not store step %s: %s", name, e)
