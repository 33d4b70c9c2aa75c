"""Each sampling transform against an independent numpy implementation of vLLM's semantics,
and sampling frequencies against the transformed distribution (chi-square bound)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import SamplingParams
from jaxpaged.sampling import logits_adjust
from jaxpaged.sampling.sampler import SamplingMetadata, processed_logits, sample

V = 12
RNG = np.random.default_rng(0)
LOGITS = RNG.normal(scale=2.0, size=V).astype(np.float32)


def meta(n=1, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0):
    rows = [(temperature, top_k, top_p, min_p, temperature < 1e-5, seed + i, 7) for i in range(n)]
    return SamplingMetadata.from_host(rows, n)


def np_softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def np_reference(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """vLLM's order: temperature, min-p, top-k, top-p; returns the sampling distribution."""
    x = logits.astype(np.float64) / temperature
    p = np_softmax(x)
    keep = np.ones(len(x), bool)
    if min_p > 0:
        keep &= p >= min_p * p.max()
    if top_k > 0:
        keep &= x >= np.sort(x)[::-1][top_k - 1]
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    if top_p < 1:
        order = np.argsort(-q, kind="stable")
        cum = np.cumsum(q[order])
        k = int(np.searchsorted(cum, top_p) + 1)       # smallest prefix with mass >= top_p
        mask = np.zeros(len(x), bool)
        mask[order[:k]] = True
        q = np.where(mask, q, 0.0)
    return q / q.sum()


CASES = [dict(), dict(temperature=0.5), dict(temperature=1.7), dict(top_k=3), dict(top_p=0.6),
         dict(min_p=0.2), dict(top_k=5, top_p=0.8, temperature=0.8),
         dict(min_p=0.05, top_p=0.9, temperature=1.3)]


@pytest.mark.parametrize("case", CASES)
def test_processed_distribution_matches_numpy(case):
    got = np.asarray(processed_logits(jnp.asarray(LOGITS[None]), meta(**case)))[0]
    got = np.exp(got - got.max())
    got /= got.sum()
    np.testing.assert_allclose(got, np_reference(LOGITS, **case), atol=1e-6)


# A 4000-token row (values spread as a small LM's): where each case's cut is found
# (sampler.CANDIDATES = 128, DEEP_CANDIDATES = 1024 largest logits, else the sorted row).
WIDE = (np.random.default_rng(5).standard_normal(4000) * 2.5).astype(np.float32)
WIDE_CASES = [
    (dict(top_p=0.5), "candidates"), (dict(temperature=0.7, top_k=40, top_p=0.95), "candidates"),
    (dict(min_p=0.1), "candidates"), (dict(top_p=0.9), "deep"),
    (dict(top_k=300, top_p=0.99), "deep"), (dict(min_p=0.02), "deep"),
    (dict(min_p=0.01, temperature=2.0), "sorted"),
    (dict(top_p=0.999, temperature=3.0), "sorted"), (dict(top_k=2000), "sorted"),
    (dict(temperature=1.0), "no filter")]


def wide_depth(case):
    """How deep the case's cut lies in WIDE: its kept count, as numpy finds it."""
    return int((np_reference(WIDE, **case) > 0).sum())


@pytest.mark.parametrize("case,where", WIDE_CASES)
def test_wide_vocabulary_cuts_match_numpy(case, where):
    kept = wide_depth(case)
    depth = {"candidates": (1, 127), "deep": (129, 1023), "sorted": (1025, 3999),
             "no filter": (4000, 4000)}[where]
    assert depth[0] <= kept <= depth[1]
    got = np.asarray(processed_logits(jnp.asarray(WIDE[None]), meta(**case)))[0]
    assert (got > -np.inf).sum() == kept
    got = np.exp(got - got.max())
    np.testing.assert_allclose(got / got.sum(), np_reference(WIDE, **case), atol=1e-6)


def test_wide_rows_cut_alone_whatever_the_batch():
    """Rows cut at every depth in one step (and a greedy row) each keep what they keep alone,
    and draw the token they draw alone."""
    cases = [c for c, _ in WIDE_CASES] + [dict(temperature=0.0)]
    rows = [(c.get("temperature", 1.0), c.get("top_k", 0), c.get("top_p", 1.0),
             c.get("min_p", 0.0), c.get("temperature", 1.0) < 1e-5, 11 + i, 3)
            for i, c in enumerate(cases)]
    batch = jnp.asarray(np.tile(WIDE, (len(rows), 1)))
    together = np.asarray(processed_logits(batch, SamplingMetadata.from_host(rows, len(rows))))
    tokens = np.asarray(sample(batch, SamplingMetadata.from_host(rows, len(rows))).token_ids)
    for i, r in enumerate(rows):
        one = SamplingMetadata.from_host([r], 1)
        alone = np.asarray(processed_logits(batch[:1], one))[0]
        if not r[4]:
            np.testing.assert_array_equal(together[i], alone)
        assert tokens[i] == np.asarray(sample(batch[:1], one).token_ids)[0]
    assert tokens[-1] == WIDE.argmax()


@pytest.mark.parametrize("case", [dict(temperature=0.8), dict(top_k=4, top_p=0.9)])
def test_sampling_frequencies_follow_the_distribution(case):
    n = 4000
    tokens = np.asarray(jax.jit(sample)(jnp.asarray(np.tile(LOGITS, (n, 1))),
                                        meta(n, **case)).token_ids)
    expected = np_reference(LOGITS, **case) * n
    observed = np.bincount(tokens, minlength=V)
    support = expected > 0
    assert observed[~support].sum() == 0
    chi2 = (((observed - expected) ** 2)[support] / expected[support]).sum()
    dof = support.sum() - 1
    assert chi2 < dof + 5 * np.sqrt(2 * dof)          # far beyond the 99.9th percentile


def np_adjust(logits, p: SamplingParams, prompt, output, eos=(), bad_words_ids=()):
    """Independent numpy version of vLLM's logits processors and penalties."""
    x = logits.astype(np.float64).copy()
    if p.allowed_token_ids:
        mask = np.full(V, -np.inf)
        mask[p.allowed_token_ids] = 0
        x += mask
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    if len(output) < p.min_tokens:
        for t in list(p.stop_token_ids or []) + list(eos):
            x[t] = -np.inf
    for w in bad_words_ids:
        if len(w) == 1 or list(output[-(len(w) - 1):]) == list(w[:-1]):
            x[w[-1]] = -np.inf
    if p.repetition_penalty != 1:
        for t in set(prompt) | set(output):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    counts = np.bincount(np.asarray(output, int), minlength=V) if output else np.zeros(V)
    x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return x


def device_adjust(p, prompt, output, eos=frozenset(), bad_words_ids=()):
    row = logits_adjust.row_adjustment(p, prompt, output, eos, list(bad_words_ids))
    if row is None:
        return LOGITS.astype(np.float64)
    packed = logits_adjust.pack([row], 1)
    return np.asarray(logits_adjust.apply(jnp.asarray(LOGITS[None]), packed))[0]


def test_penalties_apply_to_exactly_their_token_sets():
    prompt, output = [5, 5, 7], [9, 9, 5]
    logits = np.zeros(V, np.float32)
    logits[[5, 7, 9, 3]] = [2.0, -1.0, 4.0, 1.5]
    packed = lambda p: logits_adjust.pack(
        [logits_adjust.row_adjustment(p, prompt, output, frozenset(), [])], 1)
    rep = np.asarray(logits_adjust.apply(jnp.asarray(logits[None]), packed(
        SamplingParams(repetition_penalty=2.0))))[0]
    np.testing.assert_allclose(rep[[5, 7, 9, 3]], [1.0, -2.0, 2.0, 1.5])   # 3 is untouched
    freq = np.asarray(logits_adjust.apply(jnp.asarray(logits[None]), packed(
        SamplingParams(frequency_penalty=0.5))))[0]
    np.testing.assert_allclose(freq[[5, 7, 9, 3]], [2.0 - 0.5, -1.0, 4.0 - 1.0, 1.5])
    pres = np.asarray(logits_adjust.apply(jnp.asarray(logits[None]), packed(
        SamplingParams(presence_penalty=0.25))))[0]
    np.testing.assert_allclose(pres[[5, 7, 9, 3]], [1.75, -1.0, 3.75, 1.5])
    # Neutral values are exact no-ops: no adjustment at all is sent to the device.
    neutral = SamplingParams(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
    assert logits_adjust.row_adjustment(neutral, prompt, output, frozenset(), []) is None


@pytest.mark.parametrize("p, bad_words_ids", [
    (SamplingParams(logit_bias={3: 5.0, 4: -2.5}), ()),
    (SamplingParams(allowed_token_ids=[1, 4, 8]), ()),
    (SamplingParams(allowed_token_ids=[1, 4, 8], logit_bias={4: -1.0}), ()),
    (SamplingParams(repetition_penalty=1.7, presence_penalty=0.3, frequency_penalty=-0.4), ()),
    (SamplingParams(min_tokens=8, stop_token_ids=[6]), ()),
    (SamplingParams(), ([2], [10, 11], [9, 5, 0])),     # bad words: single token, 2- and 3-token
])
def test_adjustments_match_numpy(p, bad_words_ids):
    prompt, output = [1, 2, 2, 10], [10, 9, 5, 9, 5]
    eos = frozenset({0})
    want = np_adjust(LOGITS, p, prompt, output, eos, bad_words_ids)
    got = device_adjust(p, prompt, output, eos, bad_words_ids)
    np.testing.assert_allclose(got, want, rtol=1e-6)
