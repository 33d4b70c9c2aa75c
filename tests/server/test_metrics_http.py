"""/metrics after a known workload: per-step token counts, the request phase times, the
batch-size gauge and device memory (issue 27's monitoring list)."""

from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL
from tests.server.test_abort_and_load import metrics


def test_step_tokens_phase_times_and_device_memory(live_server, http):
    live_server.wait_idle()
    before = metrics(http)
    prompt = list(range(10, 27))                        # 17 tokens: one prefill step
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 6,
                                           "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
    live_server.wait_idle()
    after = metrics(http)

    def delta(name):
        return after[(name, ())] - before.get((name, ()), 0.0)

    # One step prefills the 17 prompt tokens (and samples the first token); five decode
    # steps of one token each follow: 6 steps, 17 + 5 tokens.
    assert delta("jaxpaged:iteration_tokens_total_count") == 6
    assert delta("jaxpaged:iteration_tokens_total_sum") == 22
    assert after[("jaxpaged:iteration_tokens_total_bucket", (("le", "1.0"),))] - before.get(
        ("jaxpaged:iteration_tokens_total_bucket", (("le", "1.0"),)), 0) == 5
    for phase in ("prefill", "decode", "inference"):
        assert delta(f"jaxpaged:request_{phase}_time_seconds_count") == 1
    inference = delta("jaxpaged:request_inference_time_seconds_sum")
    assert 0 < delta("jaxpaged:request_prefill_time_seconds_sum") < inference
    assert 0 < delta("jaxpaged:request_decode_time_seconds_sum") < inference
    assert after[("jaxpaged:num_batched_tokens", ())] in (0, 1)   # the last step: a decode

    memory = {s.labels["device"]: s.value
              for f in text_string_to_metric_families(http.get("/metrics").text)
              for s in f.samples if s.name == "jaxpaged:device_memory_used_bytes"}
    engine = live_server.engine.engine
    assert set(memory) == {str(d) for d in engine.runner.devices}
    pool_bytes = engine.kv_bytes_per_page * engine.kv_cache_manager.num_usable_pages
    assert all(v >= pool_bytes + engine.runner.weight_bytes for v in memory.values())
