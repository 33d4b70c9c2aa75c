"""The RL control routes (issue 44): behind the API key, off without --enable-rl-endpoints,
and weight_version on every completion."""

import json
import os
import shutil
import threading
import time

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxpaged.server.serving import ServerConfig
from tests.conftest import STORIES
from tests.server.conftest import MODEL, PLAIN_TEMPLATE, LiveServer, engine_args

KEY = {"Authorization": "Bearer sekret"}
BODY = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def rl_server():
    config = ServerConfig([MODEL], PLAIN_TEMPLATE, api_key="sekret", enable_rl_endpoints=True)
    server = LiveServer(engine_args(enable_prefix_caching=True), config).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(rl_server):
    with httpx.Client(base_url=rl_server.url, timeout=60, headers=KEY) as c:
        yield c


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory):
    """The bundled model with its MLP down projections scaled by 3 (another policy)."""
    path = tmp_path_factory.mktemp("stories_x3")
    tensors = load_file(os.path.join(STORIES, "model.safetensors"))
    save_file({n: t * 3 if "down_proj" in n else t for n, t in tensors.items()},
              str(path / "model.safetensors"))
    shutil.copy(os.path.join(STORIES, "config.json"), path)
    return str(path)


def complete(http) -> tuple[str, int]:
    data = http.post("/v1/completions", json=BODY).json()
    return data["choices"][0]["text"], data["weight_version"]


def test_routes_need_the_key_and_the_flag(rl_server, live_server):
    assert httpx.post(rl_server.url + "/pause").status_code == 401
    assert httpx.get(rl_server.url + "/weight_version").status_code == 401
    off = httpx.post(live_server.url + "/pause")
    assert off.status_code == 404 and off.json()["error"]["code"] == 404


def test_update_weights_from_disk_tags_outputs(http, other_weights):
    text0, version = complete(http)
    base = http.get("/weight_version").json()["weight_version"]
    assert version == base
    answer = http.post("/update_weights_from_disk", json={"model_path": other_weights})
    assert answer.json() == {"success": True, "weight_version": base + 1}
    text1, version = complete(http)
    assert text1 != text0 and version == base + 1
    chat = http.post("/v1/chat/completions", json={
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["weight_version"] == base + 1
    with http.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as chunks:
        lines = [json.loads(line[6:]) for line in chunks.iter_lines()
                 if line.startswith("data: {")]
    assert lines and all(c["weight_version"] == base + 1 for c in lines)
    assert "".join(c["choices"][0]["text"] for c in lines) == text1
    with http.stream("POST", "/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 4, "stream": True,
            "messages": [{"role": "user", "content": "Hi"}]}) as chunks:
        lines = [json.loads(line[6:]) for line in chunks.iter_lines()
                 if line.startswith("data: {")]
    assert lines[0]["choices"][0]["delta"]["role"] == "assistant"
    assert lines[0]["weight_version"] is None           # sent before any token
    assert len(lines) > 1 and all(c["weight_version"] == base + 1 for c in lines[1:])
    assert http.post("/update_weights_from_disk", json={"model_path": STORIES}).json()[
        "weight_version"] == base + 2
    assert complete(http) == (text0, base + 2)
    bad = http.post("/update_weights_from_disk", json={"model_path": "/nonexistent"})
    assert bad.status_code == 400 and "nonexistent" in bad.json()["error"]["message"]
    assert bad.json()["error"]["param"] == "model_path"
    assert http.post("/update_weights_from_disk", json={}).status_code == 400


def test_pause_keep_holds_requests_until_resume(http, rl_server):
    text0, _ = complete(http)
    for bogus in ("bogus", ""):          # (an empty mode is refused, not taken as abort)
        assert http.post("/pause", params={"mode": bogus}).json()["error"]["param"] == "mode"
    assert http.post("/pause", params={"mode": "keep"}).json() == {"status": "paused",
                                                                   "mode": "keep"}
    assert http.get("/is_paused").json() == {"is_paused": True}
    result = {}
    worker = threading.Thread(target=lambda: result.update(text=complete(http)[0]))
    worker.start()
    time.sleep(0.5)
    assert worker.is_alive() and not result        # queued, not lost, not run
    assert http.post("/resume").json() == {"status": "resumed"}
    worker.join(30)
    assert result["text"] == text0
    assert http.post("/pause", params={"mode": "wait"}).json()["mode"] == "wait"
    http.post("/resume")
    with rl_server.slow_steps(0.05):      # a request running when an abort pause comes
        worker = threading.Thread(target=lambda: result.update(
            aborted=http.post("/v1/completions", json={**BODY, "max_tokens": 100,
                                                       "ignore_eos": True}).json()))
        worker.start()
        time.sleep(0.5)
        assert http.post("/pause", params={"mode": "abort"}).json()["mode"] == "abort"
        worker.join(30)
    assert result["aborted"]["choices"][0]["finish_reason"] == "abort"
    assert len(result["aborted"]["choices"][0]["text"]) > 0
    http.post("/resume")
    assert complete(http)[0] == text0


def test_sleep_and_wake(http, rl_server):
    text0, _ = complete(http)
    assert http.post("/sleep", params={"level": "3"}).status_code == 400
    assert http.post("/sleep", params={"level": "1"}).json()["level"] == 1
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    assert http.post("/wake_up", params={"tags": "kv"}).status_code == 400
    assert http.post("/wake_up").json() == {"status": "awake"}
    assert complete(http)[0] == text0
    http.post("/sleep", params={"level": "2"})
    refused = http.post("/wake_up", params={"tags": "weights"})
    assert refused.status_code == 400 and "update_weights" in refused.json()["error"]["message"]
    http.post("/update_weights_from_disk", json={"model_path": STORIES})
    assert http.post("/wake_up", params={"tags": "weights"}).json() == {"status": "sleeping"}
    assert http.post("/wake_up", params={"tags": "kv_cache"}).json() == {"status": "awake"}
    assert complete(http)[0] == text0
    assert http.post("/reset_prefix_cache").json() == {"success": True}
    assert np.isfinite(http.get("/weight_version").json()["weight_version"])
