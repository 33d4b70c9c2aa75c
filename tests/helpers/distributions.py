"""Two-sample tests that speculative decoding samples as plain decoding does."""

from __future__ import annotations

import collections

import numpy as np
from scipy import stats as scipy_stats

from jaxpaged import SamplingParams


def first_tokens(llm, prompt: str, n: int, seed0: int, batch: int | None = None,
                 **params) -> list[tuple[int, ...]]:
    """The first 3 tokens of ``n`` seeded samples (seeds ``seed0 ..``) of ``prompt``, in
    ``generate`` calls of ``batch`` requests (None: one call). Waves of at most
    ``max_num_seqs`` make most steps after the prefill pure decodes, which speculate
    (a step that also admits a request does not)."""
    batch = batch or n
    tokens = []
    for first in range(0, n, batch):
        outs = llm.generate([prompt] * min(batch, n - first), [
            SamplingParams(max_tokens=4, ignore_eos=True, seed=seed0 + i, **params)
            for i in range(first, min(first + batch, n))], use_tqdm=False)
        tokens += [tuple(o.outputs[0].token_ids[:3]) for o in outs]
    return tokens


def assert_same_first_tokens(spec, plain, prompt: str, n: int, batch: int | None = None,
                             **params) -> None:
    """Chi-square (contingency, p > 0.01) of ``n`` draws each of the first 1, 2 and 3
    tokens, ``spec`` against ``plain`` (other seeds; ``batch`` as for
    :func:`first_tokens`): prefixes seen fewer than 10 times in both together are pooled
    into one cell."""
    a = first_tokens(spec, prompt, n, 0, batch, **params)
    b = first_tokens(plain, prompt, n, 10**6, batch, **params)
    for length in (1, 2, 3):
        ca = collections.Counter(x[:length] for x in a)
        cb = collections.Counter(x[:length] for x in b)
        keys = [k for k in set(ca) | set(cb) if ca[k] + cb[k] >= 10]
        table = np.array([[c[k] for k in keys] + [n - sum(c[k] for k in keys)]
                          for c in (ca, cb)])
        table = table[:, table.sum(0) > 0]
        assert table.shape[1] >= 2
        assert scipy_stats.chi2_contingency(table).pvalue > 0.01, (length, table)
