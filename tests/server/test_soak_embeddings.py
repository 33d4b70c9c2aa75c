"""The embeddings part of the soak (``benchmarks/soak_embeddings.py``) against the pooling
server: concurrent clients, hang-ups, outputs equal to offline ``LLM.embed`` (and rerank
scores to offline ``LLM.score``), no leaked page."""

from jaxpaged import LLM
from jaxpaged.benchmarks.soak_embeddings import run_embeddings_soak
from tests.server.conftest import MAX_MODEL_LEN


def test_embeddings_soak_ci(pooling_server):
    reference = LLM(runner="pooling", enforce_eager=True, max_model_len=MAX_MODEL_LEN)
    summary = run_embeddings_soak(pooling_server.url, reference, num_requests=60,
                                  concurrency=16, seed=0, disconnect_fraction=0.1,
                                  engine=pooling_server.engine)
    assert summary["problems"] == [], "\n".join(summary["problems"][:10])
    assert summary["leaked_pages"] == 0
    assert 0 < summary["hung_up"] < 0.25 * 60
    assert summary["answered"] + summary["hung_up"] == 60
    # every answered request's every input was compared (1 to 4 a request), and a share of
    # the requests were reranks whose scores were compared too
    assert summary["compared_embeddings"] + summary["compared_scores"] >= summary["answered"]
    assert summary["compared_scores"] > 0
    assert summary["max_abs_diff"] <= 1e-5
