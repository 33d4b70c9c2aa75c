"""Constants shared by the host side (engine/) and the device side (layers/, runner/).

A leaf module: it imports nothing of jaxpaged and nothing of JAX, so the JAX-free host
modules (scheduler, KV cache manager, requests, output processor, detokenizer) and the layers
can both depend on it without ``layers/`` importing ``engine/`` or the host importing JAX.
"""

#: Index of the page reserved for padding writes; never allocated to a request (vLLM v1
#: reserves its block 0 the same way; the pool layout is in ``jaxpaged.layers.attention.base``).
NULL_PAGE = 0

#: ``--dtype`` choices.
DTYPES = ("auto", "float32", "bfloat16")
#: ``--attention-backend`` choices (see ``jaxpaged.layers.attention.selection``).
ATTENTION_BACKENDS = ("auto", "xla", "pallas", "cpu")
#: ``--kv-cache-dtype`` choices: ``auto`` (the model's dtype) or float8_e4m3fn under either of
#: vLLM's names (``jaxpaged.layers.attention.base`` defines the pool).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
#: ``--scheduling-policy`` choices.
SCHEDULING_POLICIES = ("fcfs", "priority", "sjf")
