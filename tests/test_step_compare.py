"""``benchmarks/step_compare.py``: interleaved step timing and the float32/bfloat16 A/B."""

import itertools

import numpy as np
import pytest

from jaxpaged.benchmarks.step_compare import compare_dtypes, interleave
from tests.conftest import STORIES


def fake_call(seconds, tokens):
    """A step call that takes ``seconds`` in turn (cycling) and returns ``tokens``."""
    times = itertools.cycle(seconds)
    return lambda: (next(times), np.asarray(tokens))


def test_interleave_ratios_medians_and_token_agreement():
    calls = {"a": fake_call([0.2, 0.1, 0.3], [1, 2]), "b": fake_call([0.05], [1, 2]),
             "c": fake_call([0.4], [1, 3])}
    rounds = interleave(calls, repeats=3, rounds=2)
    assert len(rounds) == 2
    for r in rounds:   # the reference call takes the first time of each cycle, so rounds shift
        assert r["a"]["ratio"] == 1.0
        assert r["b"] == {"best_ms": 50.0, "median_ms": 50.0,
                          "ratio": round(0.05 / r["a"]["best_ms"] * 1e3, 3), "same_tokens": True}
        assert r["c"]["same_tokens"] is False and r["c"]["best_ms"] == 400.0
    assert rounds[0]["a"] == {"best_ms": 100.0, "median_ms": 200.0, "ratio": 1.0,
                              "same_tokens": True}


@pytest.mark.slow     # compiles two 64-sequence steps of the bundled model
def test_compare_dtypes_on_the_bundled_model():
    out = compare_dtypes("decode", STORIES, ["float32", "bfloat16"], repeats=2, rounds=1)
    (r,) = out["rounds"]
    assert out["kind"] == "decode" and set(r) == {"float32", "bfloat16"}
    assert r["float32"]["ratio"] == 1.0 and r["float32"]["same_tokens"] is True
    assert 0 < r["bfloat16"]["best_ms"] <= r["bfloat16"]["median_ms"]
