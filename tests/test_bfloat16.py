"""``--dtype bfloat16`` end to end on the bundled model: the float32 reference's top-1 choices
and greedy text survive bfloat16 weights, KV pool and the xla backend's bf16 decode dots
(``jaxpaged.layers.attention.xla._DecodeDotProducts``)."""

from jaxpaged import LLM
from tests.test_kv_cache_fp8 import pool_of, reference_figures


def test_bfloat16_engine_keeps_top1_and_greedy_text():
    llm = LLM(enforce_eager=True, max_num_seqs=8, dtype="bfloat16")
    assert all(str(k.dtype) == str(v.dtype) == "bfloat16" for k, v in pool_of(llm))
    figures = reference_figures(llm)
    assert figures["top1"] == 64                                 # measured 64/64
    assert 0.05 < figures["max_diff"] < 0.5                      # measured 0.28
    assert figures["mean_diff"] < 0.1                            # measured 0.042
    assert figures["greedy_match"], figures["text"]
