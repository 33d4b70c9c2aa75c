"""Pallas kernels for paged attention on NVIDIA GPUs, each beside its pure-jnp reference.

- ``paged_attention``: ragged paged attention (prefill chunks + decodes in one launch, GQA,
  sliding window, soft-cap, split-K) — ``pallas_kernels.paged_attention``.
- ``write_kv``: new K/V rows into the pool by slot mapping, in place — ``pallas_kernels.kv_write``.
- References: ``pallas_kernels.reference``. Lowering choices: ``pallas_kernels.lowering``.
"""
