"""The C++ small-rows matmul (``jaxpaged.layers.cpu_matmul``): values against float64 numpy
over every register-block shape and remainder, where ``Linear`` sends it work, and which
runners turn it on."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpaged import LLM, SamplingParams
from jaxpaged.layers import cpu_matmul
from jaxpaged.layers.cpu_build import SMALL_ROWS_MATMUL_TARGET, cpu_flags, load_cpu_kernels
from jaxpaged.layers.linear import Linear

pytestmark = pytest.mark.skipif(not load_cpu_kernels(), reason="needs g++ on the CPU")


@pytest.mark.parametrize("rows,k,n", [
    (1, 5, 3),            # one padded vector of rows, fewer features than a block
    (16, 768, 768),       # W1's widths: whole blocks of 12 features
    (37, 45, 53),         # three vectors (blocks of 8), 5 features left over
    (64, 2048, 768),      # four vectors (blocks of 6), W1's down_proj
    (100, 33, 50),        # seven vectors: a group of four, then three
    (130, 17, 49),        # nine vectors: two groups of four and one of one
])
def test_kernel_matches_float64(rows, k, n):
    rng = np.random.default_rng(rows)
    x = rng.normal(size=(rows, k)).astype(np.float32)
    w = rng.normal(size=(n, k)).astype(np.float32)
    got = np.asarray(jax.jit(cpu_matmul.small_rows_matmul)(jnp.asarray(x), jnp.asarray(w)))
    want = x.astype(np.float64) @ w.astype(np.float64).T
    assert got.shape == (rows, n) and got.dtype == np.float32
    # float32 sums of k terms: |error| <= k * eps * sum |x w| (a loose bound, ~1e-6 here)
    bound = k * 2.0 ** -24 * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T)
    assert np.all(np.abs(got - want) <= bound)


def _lowered(fn, *args) -> str:
    return jax.jit(fn).lower(*args).as_text()


def test_linear_uses_the_kernel_only_inside_the_context_and_for_its_rows():
    layer = Linear(24, 40, bias=True, dtype=jnp.float32, rngs=nnx.Rngs(0))
    layer.bias[...] = jnp.arange(40, dtype=jnp.float32)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 16, 24)), jnp.float32)

    def call(x, enabled=True):
        with cpu_matmul.small_rows_matmuls(enabled):
            return layer(x)

    assert SMALL_ROWS_MATMUL_TARGET in _lowered(call, x)            # 32 rows
    assert SMALL_ROWS_MATMUL_TARGET not in _lowered(lambda x: call(x, False), x)
    assert SMALL_ROWS_MATMUL_TARGET not in _lowered(layer, x)       # outside the context
    assert SMALL_ROWS_MATMUL_TARGET not in _lowered(call, x[:, :4])           # 8 rows
    assert SMALL_ROWS_MATMUL_TARGET not in _lowered(call, jnp.tile(x, (5, 1, 1)))  # 160 rows
    half = Linear(24, 40, bias=False, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    with cpu_matmul.small_rows_matmuls(True):
        assert SMALL_ROWS_MATMUL_TARGET not in _lowered(half, x)
    want = np.einsum("btk,nk->btn", np.asarray(x, np.float64),
                     np.asarray(layer.weight[...], np.float64)) + np.arange(40)
    np.testing.assert_allclose(np.asarray(jax.jit(call)(x)), want, rtol=1e-5, atol=1e-5)


def _forward_texts(llm) -> list[str]:
    runner = llm.engine.runner
    return [fn.as_text() for key, fn in runner._executables.items() if key[0] == "forward"]


def test_the_kernel_is_offered_exactly_on_avx512_cpus():
    assert cpu_matmul.available() == ("avx512f" in cpu_flags().split())


def test_cpu_backend_runner_sends_its_decode_projections_to_the_kernel():
    """One CPU device with the cpu attention backend (and AVX-512): the decode step's
    projections (16 rows) are custom calls and greedy tokens equal the xla backend's (no
    kernels at all)."""
    prompts = [[1, 403, 407, 412], [1, 17, 29]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for backend in ("cpu", "xla"):
        llm = LLM(enforce_eager=True, attention_backend=backend, max_num_seqs=16,
                  max_num_batched_tokens=64, max_model_len=64)
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(
            prompts, params, use_tqdm=False)]
        used = any(SMALL_ROWS_MATMUL_TARGET in text for text in _forward_texts(llm))
        assert used == (backend == "cpu" and cpu_matmul.available())
    assert tokens["cpu"] == tokens["xla"]
    assert all(len(t) == 12 for t in tokens["cpu"])


def test_sharded_weights_stay_with_xla():
    """Under tensor parallelism (weights sharded over the mesh) XLA partitions every dot."""
    assert jax.device_count() >= 2        # tests/conftest.py forces 8 host devices
    llm = LLM(enforce_eager=True, attention_backend="cpu", tensor_parallel_size=2,
              max_num_seqs=16, max_num_batched_tokens=64, max_model_len=64)
    out = llm.generate([[1, 403, 407]], SamplingParams(temperature=0, max_tokens=4),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert not any(SMALL_ROWS_MATMUL_TARGET in text for text in _forward_texts(llm))
