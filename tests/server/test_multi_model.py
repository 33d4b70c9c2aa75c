"""Several models in one server (``--models-config``): routing by ``model``, one listing,
merged metrics labelled per model, and the config file's errors."""

import argparse
import dataclasses
import json
import logging

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxpaged import LLM, SamplingParams
from jaxpaged.arg_utils import DEFAULT_MODEL, EngineArgs, cli_error_message
from jaxpaged.runner import kv_sizing
from jaxpaged.server.launcher import serving_lines
from jaxpaged.server.multi_model import entry_engine_args, load_models_config
from jaxpaged.server.serving import ServerConfig
from tests.conftest import FIXTURES
from tests.server.conftest import LiveServer, engine_args

TINY = f"{FIXTURES}/llama3_rope_scaling"
PROMPT = [1, 15, 27, 99, 4]
#: The messages' text alone: "a b c" has ids below the fixture Llama's 288-token vocabulary.
CONTENT_ONLY = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def write_config(tmp_path, models) -> str:
    path = tmp_path / "models.json"
    path.write_text(json.dumps({"models": models}))
    return str(path)


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    path = write_config(tmp_path_factory.mktemp("cfg"), [
        {"model": DEFAULT_MODEL, "served_model_name": ["small", "small-alias"],
         "kv_cache_memory_share": 0.5},
        {"model": TINY, "served_model_name": "tiny", "kv_cache_memory_share": 0.25,
         "engine_args": {"tokenizer": DEFAULT_MODEL, "block_size": 8}}])
    server = LiveServer(engine_args(), ServerConfig(["unused"], CONTENT_ONLY,
                                                    responses_store_size=4),
                        models=load_models_config(path)).start()
    yield server
    server.stop()


def test_requests_reach_their_model_and_equal_offline_runs(two_models):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for name, model, extra in (("small", DEFAULT_MODEL, {}),
                               ("tiny", TINY, {"tokenizer": DEFAULT_MODEL, "block_size": 8})):
        offline = LLM(model=model, enforce_eager=True, max_model_len=128, **extra).generate(
            [PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
        r = httpx.post(two_models.url + "/v1/completions", json={
            "model": name, "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True,
            "temperature": 0, "return_token_ids": True}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == name
        assert r.json()["choices"][0]["token_ids"] == offline
    r = httpx.post(two_models.url + "/v1/completions",
                   json={"model": "nope", "prompt": "x"}, timeout=30)
    assert r.status_code == 404
    assert "['small', 'small-alias', 'tiny']" in r.json()["error"]["message"]


def test_one_listing_merged_metrics_and_health(two_models):
    models = httpx.get(two_models.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["small", "small-alias", "tiny"]
    assert {m["root"] for m in models} == {DEFAULT_MODEL, TINY}
    assert httpx.get(two_models.url + "/v1/models/tiny").json()["root"] == TINY
    assert httpx.get(two_models.url + "/health").status_code == 200
    assert httpx.get(two_models.url + "/ready").status_code == 200
    httpx.post(two_models.url + "/v1/completions", json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 2}, timeout=60)
    families = list(text_string_to_metric_families(
        httpx.get(two_models.url + "/metrics").text))
    names = [f.name for f in families]
    assert len(names) == len(set(names))                    # each family once
    success = {s.labels["model_name"]: s.value for f in families for s in f.samples
               if s.name == "jaxpaged:request_success_total"
               and s.labels["finished_reason"] == "length"}
    assert set(success) == {"small", "tiny"} and success["tiny"] >= 1
    tokens = httpx.post(two_models.url + "/tokenize",
                        json={"model": "tiny", "prompt": "Once upon"}).json()
    assert tokens["tokens"] == httpx.post(two_models.url + "/tokenize", json={
        "model": "small", "prompt": "Once upon"}).json()["tokens"]    # one tokenizer


def test_a_stored_response_is_found_in_its_models_store(two_models):
    r = httpx.post(two_models.url + "/v1/responses", json={
        "model": "tiny", "input": "a b c", "max_output_tokens": 4,
        "store": True}, timeout=60)
    assert r.status_code == 200, r.text
    got = httpx.get(two_models.url + f"/v1/responses/{r.json()['id']}")
    assert got.status_code == 200 and got.json()["model"] == "tiny"
    assert got.json()["output"] == r.json()["output"]
    assert httpx.get(two_models.url + "/v1/responses/resp_nope").status_code == 404


def test_memory_shares_and_overrides(tmp_path):
    base = engine_args(gpu_memory_utilization=0.8)
    (small, tiny) = load_models_config(write_config(tmp_path, [
        {"model": DEFAULT_MODEL, "kv_cache_memory_share": 0.5},
        {"model": TINY, "engine_args": {"max_num_seqs": 2}}]))
    assert small.served_model_name == [DEFAULT_MODEL] and tiny.kv_cache_memory_share == 0.5
    args = entry_engine_args(base, tiny)
    assert (args.model, args.max_num_seqs, args.gpu_memory_utilization) == (TINY, 2, 0.4)
    args = entry_engine_args(engine_args(kv_cache_memory_bytes=1000), small)
    assert args.kv_cache_memory_bytes == 500


def test_a_share_caps_the_cpu_default_kv_budget(tmp_path, monkeypatch, caplog):
    """On a CPU without --kv-cache-memory-bytes the share did nothing: every model's pool
    was sized from the whole default budget."""
    per_page = 20480             # stories260K: 5 layers * 2 * 16 tokens * 4 heads * 8 * 4 B
    monkeypatch.setattr(kv_sizing, "DEFAULT_CPU_KV_CACHE_BYTES", 100 * per_page)
    [entry] = load_models_config(write_config(tmp_path, [
        {"model": DEFAULT_MODEL, "kv_cache_memory_share": 0.5}]))
    # 16 requests of 8 pages need 129 pages: above the whole budget's 100, its half's 50
    args = entry_engine_args(engine_args(), entry)
    assert args.kv_cache_memory_share == 0.5
    with caplog.at_level(logging.INFO, logger=kv_sizing.__name__):
        llm = LLM(**dataclasses.asdict(args))
    assert llm.engine.kv_cache_manager.num_pages == 50
    assert caplog.messages[0].startswith(
        "CPU KV budget: kv_cache_memory_share 0.5 of the 0 GiB default cap (0.00 GiB) ")
    # not a flag: its errors keep its name, the command line leaves it at 1
    with pytest.raises(ValueError) as e:
        engine_args(kv_cache_memory_share=0)
    assert cli_error_message(e.value) == ("EngineArgs.kv_cache_memory_share must be in (0, 1], "
                                          "got 0")
    assert EngineArgs.from_cli_args(EngineArgs.add_cli_args(argparse.ArgumentParser())
                                    .parse_args([])).kv_cache_memory_share == 1.0
    [line] = serving_lines(engine_args(), ServerConfig(["x"]), [entry], "h", 1)
    assert line.endswith("(kv_cache_memory_share 0.5: gpu_memory_utilization 0.46 on a GPU; "
                         "on a CPU at most 0.00 GiB of KV (of the 0 GiB default))")


def test_startup_lines_name_each_model_with_its_own_names(tmp_path):
    """The start-up line named the server's positional model (the default one) with the
    server's --served-model-name instead of each --models-config model and its names."""
    entries = load_models_config(write_config(tmp_path, [
        {"model": "/models/a", "served_model_name": ["a", "a-latest"]},
        {"model": "/models/b", "served_model_name": "b"}]))
    lines = serving_lines(engine_args(), ServerConfig([DEFAULT_MODEL]), entries, "0.0.0.0", 8000)
    assert [line.split(" (kv_")[0] for line in lines] == [
        "serving /models/a as ['a', 'a-latest'] on http://0.0.0.0:8000",
        "serving /models/b as ['b'] on http://0.0.0.0:8000"]
    # the share's line says what it applied to
    assert lines[0].endswith("(kv_cache_memory_share 0.5: gpu_memory_utilization 0.46 on a "
                             "GPU; on a CPU at most 2.00 GiB of KV (of the 4 GiB default))")
    lines = serving_lines(engine_args(kv_cache_memory_bytes=1000), ServerConfig(["x"]), entries,
                          "h", 1)
    assert lines[1].endswith("(kv_cache_memory_share 0.5 of --kv-cache-memory-bytes: 500 bytes "
                             "of KV)")
    lines = serving_lines(engine_args(num_gpu_blocks_override=64), ServerConfig(["x"]), entries,
                          "h", 1)
    assert lines[0].endswith("(kv_cache_memory_share 0.5 not applied: num_gpu_blocks_override=64 "
                             "sets the KV pages)")
    assert serving_lines(engine_args(model=TINY), ServerConfig(["t"]), None, "h", 1) == [
        f"serving {TINY} as ['t'] on http://h:1"]


@pytest.mark.parametrize("models, needle", [
    ([], "non-empty 'models' list"),
    ([{"model": "a", "port": 1}], "unknown field 'port'"),
    ([{"model": "a", "kv_cache_memory_share": 0.7}, {"model": "b", "kv_cache_memory_share": 0.7}],
     "add up to more than 1"),
    ([{"model": "a", "served_model_name": "x"}, {"model": "b", "served_model_name": "x"}],
     "used twice"),
    ([{"model": "a", "engine_args": {"max_seqs": 2}}], "'max_seqs' is not an engine argument"),
    ([{"model": "a", "kv_cache_memory_share": 0}], "kv_cache_memory_share must be in (0, 1]"),
])
def test_config_errors_name_the_field(tmp_path, models, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        load_models_config(write_config(tmp_path, models))
