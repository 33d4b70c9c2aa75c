"""Shared fixtures: paths of the bundled model and the committed reference checkpoints."""

import os

# Eight CPU devices for the tensor-parallel tests (read when JAX starts its backend, which
# no test has done yet); everything else runs on the first device as before.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

# Compiled steps go to a cache of this session (subprocesses inherit it), never to the
# user's ~/.cache/jaxpaged; tests that build the same step shapes load them from it.
if "JAXPAGED_CACHE_ROOT" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["JAXPAGED_CACHE_ROOT"] = tempfile.mkdtemp(prefix="jaxpaged-test-cache-")
    atexit.register(shutil.rmtree, os.environ["JAXPAGED_CACHE_ROOT"], True)

import pytest  # noqa: E402

from jaxpaged.arg_utils import DEFAULT_MODEL  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
STORIES = DEFAULT_MODEL
STORIES_REFERENCE = os.path.join(STORIES, "reference")
TOKENIZERS = os.path.join(FIXTURES, "tokenizers")
LLAMA2_TOKENIZER = os.path.join(os.path.dirname(__file__), "..", "configs", "tokenizers", "llama2")


def read_reference_ids(name: str) -> list[int]:
    """Token ids of a whitespace-separated reference file of the bundled model."""
    with open(os.path.join(STORIES_REFERENCE, name)) as f:
        return [int(x) for x in f.read().split()]


@pytest.fixture(scope="session")
def stories_llm():
    """One engine on the bundled model, shared by tests that do not depend on engine limits."""
    from jaxpaged import LLM

    return LLM(enforce_eager=True, max_num_seqs=32, max_num_batched_tokens=512)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test module, drop what its engines compiled: XLA:CPU maps every compiled
    program's code apart, and a whole suite's programs held to the end passed the kernel's
    65 530 mappings a process (vm.max_map_count), after which allocations fail."""
    yield
    import gc
    import sys

    gc.collect()
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
