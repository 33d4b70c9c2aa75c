"""Pallas kernels for paged attention on NVIDIA GPUs, each beside its pure-jnp reference.

- v2 paged attention (the default): decodes with split-K (``pallas_kernels.paged_attention``)
  and prefill query blocks (``pallas_kernels.prefill_attention``) in separate launches, both on
  the prefetching KV-tile loop of ``pallas_kernels.attention_tiles``; GQA, sliding window,
  soft-cap, fp8 pools.
- v1 paged attention: prefill chunks and decodes in query blocks of one launch
  (``pallas_kernels.paged_attention_v1``), kept for an A/B.
- ``write_kv``: new K/V rows into the pool by slot mapping, in place — ``pallas_kernels.kv_write``.
- References: ``pallas_kernels.reference``. Lowering choices: ``pallas_kernels.lowering``.
  What the kernels compile to on Hopper, checked on CPU (a dev tool outside this package):
  ``jaxpaged.benchmarks.kernels.schedule_check``.
"""
