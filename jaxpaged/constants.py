"""Constants shared by the host side (core/, engine/) and the device side (layers/, runner/),
and the cache root.

A leaf module: it imports nothing of jaxpaged and nothing of JAX, so the JAX-free host
modules (``jaxpaged.core``) and the layers can both depend on it without ``layers/`` importing
``engine/`` or the host importing JAX.
"""

import os

#: Index of the page reserved for padding writes; never allocated to a request (vLLM v1
#: reserves its block 0 the same way; the pool layout is in ``jaxpaged.layers.attention.base``).
NULL_PAGE = 0

#: ``--dtype`` choices.
DTYPES = ("auto", "float32", "bfloat16")
#: ``--attention-backend`` choices (see ``jaxpaged.layers.attention.selection``).
ATTENTION_BACKENDS = ("auto", "xla", "pallas", "cpu")
#: ``--kv-cache-dtype`` choices: ``auto`` (the model's dtype) or float8_e4m3fn under either of
#: vLLM's names (``jaxpaged.layers.attention.base`` defines the pool).
KV_CACHE_DTYPES = ("auto", "float16", "fp8", "fp8_e4m3")
#: ``--scheduling-policy`` choices.
SCHEDULING_POLICIES = ("fcfs", "priority", "sjf")

#: Set to 1 (or true/yes) to turn the compile cache off whatever ``--compilation-cache-dir`` says.
DISABLE_ENV = "JAXPAGED_DISABLE_COMPILE_CACHE"
#: Overrides the cache root (vLLM's ``VLLM_CACHE_ROOT``).
CACHE_ROOT_ENV = "JAXPAGED_CACHE_ROOT"


def cache_root() -> str:
    """``$JAXPAGED_CACHE_ROOT``, defaulting to ``$XDG_CACHE_HOME/jaxpaged`` or
    ``~/.cache/jaxpaged`` (also where the CPU kernels are built,
    ``jaxpaged.layers.cpu_build``, and the compile cache lives,
    ``jaxpaged.runner.compile_cache``)."""
    root = os.environ.get(CACHE_ROOT_ENV)
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "jaxpaged")
    return root
