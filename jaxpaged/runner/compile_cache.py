"""The on-disk cache of compiled model steps (JAX's persistent compilation cache).

On by default, as vLLM keeps its compile cache under ``~/.cache/vllm``: compiled executables
go to ``$JAXPAGED_CACHE_ROOT/compile_cache``, where ``$JAXPAGED_CACHE_ROOT`` defaults to
``$XDG_CACHE_HOME/jaxpaged`` (``~/.cache/jaxpaged``). ``--compilation-cache-dir DIR``
(``EngineArgs.compilation_cache_dir``) puts it elsewhere; an empty string, or
``JAXPAGED_DISABLE_COMPILE_CACHE=1`` in the environment, turns it off.

JAX keys every entry on the lowered module (shapes, dtypes, shardings and every constant baked
into the program, e.g. fp8 KV scales), the compile options, the XLA flags, the device kind and
the jax/jaxlib versions (``jax/_src/cache_key.py``), so models and engine settings never share
an entry; the weights are arguments of the step, not part of it. Loading a step from the
cache is several times faster than compiling it, while tracing and lowering it is paid either
way (``docs/measurements.md``, "Compile cache").

The directory is trusted: whoever can write to it can make this process run code (JAX's
warning in ``jax.experimental.compilation_cache``), so it is created private to the user.
"""

from __future__ import annotations

import logging
import os

import jax

from jaxpaged.constants import CACHE_ROOT_ENV, DISABLE_ENV, cache_root  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)


def default_cache_dir() -> str:
    """``<cache_root()>/compile_cache``."""
    return os.path.join(cache_root(), "compile_cache")


def resolve_cache_dir(flag: str | None) -> str | None:
    """The directory to use for ``--compilation-cache-dir`` = ``flag``: None picks
    :func:`default_cache_dir`, ``""`` or ``$JAXPAGED_DISABLE_COMPILE_CACHE`` set turn the cache
    off (None returned)."""
    if os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes"):
        return None
    if flag is None:
        return default_cache_dir()
    return os.path.expanduser(flag) or None


def configure_compilation_cache(path: str | None) -> None:
    """Point JAX's persistent compilation cache at ``path`` (None: off) for this process.

    Every compilation is cached whatever its size or compile time. JAX decides once per
    process whether it uses a cache, so a change of directory resets its state (an engine
    built later in the same process with another directory gets that one). A directory that
    cannot be created turns the cache off with a warning instead of failing the start-up.
    """
    if path is not None:
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError as e:
            logger.warning("compilation cache off: cannot create %s (%s)", path, e)
            path = None
    if path == jax_cache_dir():
        return
    from jax.experimental.compilation_cache import compilation_cache
    compilation_cache.reset_cache()
    config = jax.config
    config.update("jax_enable_compilation_cache", path is not None)
    config.update("jax_compilation_cache_dir", path)
    if path is not None:
        config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        logger.info("compilation cache: %s", path)


def num_step_entries(path: str | None) -> int:
    """Compiled model-step programs stored under ``path`` (JAX names them
    ``jit_forward-<key>-cache`` and ``jit_sample_rows-<key>-cache``,
    ``jaxpaged.runner.step_programs``); 0 for None or a missing directory. Entries added
    across a start-up = programs compiled afresh, the rest were loaded."""
    if path is None or not os.path.isdir(path):
        return 0
    return sum(name.startswith(("jit_forward-", "jit_sample_rows-"))
               for name in os.listdir(path))


def jax_cache_dir() -> str | None:
    """The directory JAX's persistent compilation cache uses now (None: off)."""
    config = jax.config
    return config.jax_compilation_cache_dir if config.jax_enable_compilation_cache else None
