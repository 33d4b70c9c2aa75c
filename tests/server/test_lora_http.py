"""LoRA adapters over HTTP: ``model`` names an adapter on every route (the official openai
client), ``/v1/models`` lists adapters with ``parent`` and ``root``, unknown names get the
404 model error, and the runtime load / unload routes answer as vLLM's."""

import os

import httpx
import openai
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.lora.request import LoRARequest
from jaxpaged.server.serving import ServerConfig
from jaxpaged.server.serving_models import LoRAModulePath
from tests.conftest import FIXTURES
from tests.server.conftest import MODEL, PLAIN_TEMPLATE, LiveServer, engine_args

LORA = os.path.join(FIXTURES, "lora")
A, B = os.path.join(LORA, "stories_all7_r8"), os.path.join(LORA, "stories_qkvo_r16")
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def lora_server():
    config = ServerConfig([MODEL], PLAIN_TEMPLATE, allow_runtime_lora_updating=True,
                          lora_modules=[LoRAModulePath.parse("story-a=" + A)])
    server = LiveServer(engine_args(enable_lora=True, max_loras=2), config).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def lora_client(lora_server):
    return openai.OpenAI(base_url=lora_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def greedy_text():
    """The greedy continuation of PROMPT by LLM.generate under an adapter directory (None:
    the base model): what the HTTP answers must equal."""
    llm = LLM(enable_lora=True, enforce_eager=True, max_model_len=128, max_num_seqs=4)

    def text(path: str | None) -> str:
        lora = None if path is None else LoRARequest(os.path.basename(path), 1 + (path == B),
                                                     path)
        return llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12),
                            lora_request=lora, use_tqdm=False)[0].outputs[0].text

    return text


def test_openai_client_reaches_an_adapter_on_every_route(lora_server, lora_client,
                                                        greedy_text):
    want, base = greedy_text(A), greedy_text(None)
    assert want != base
    out = lora_client.completions.create(model="story-a", prompt=PROMPT, max_tokens=12,
                                         temperature=0)
    assert out.model == "story-a" and out.choices[0].text == want
    assert lora_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                          temperature=0).choices[0].text == base
    chat = lora_client.chat.completions.create(
        model="story-a", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0)
    assert chat.model == "story-a" and chat.choices[0].message.content
    resp = lora_client.responses.create(model="story-a", input="hi", max_output_tokens=4,
                                        temperature=0)
    assert resp.model == "story-a"
    tok = httpx.post(lora_server.url + "/tokenize", json={"model": "story-a", "prompt": PROMPT})
    assert tok.status_code == 200 and tok.json()["count"] > 0


def test_models_lists_adapters_and_unknown_names_get_404(lora_server, lora_client):
    cards = {m.id: m for m in lora_client.models.list().data}
    assert cards["story-a"].parent == MODEL and cards["story-a"].root == A
    assert cards[MODEL].parent is None
    with pytest.raises(openai.NotFoundError) as e:
        lora_client.completions.create(model="no-such-adapter", prompt=PROMPT, max_tokens=2)
    assert e.value.body["param"] == "model" and "no-such-adapter" in e.value.body["message"]


def test_load_and_unload_routes(lora_server, lora_client, greedy_text):
    url = lora_server.url
    missing = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x"})
    assert missing.status_code == 400
    assert missing.json()["error"]["message"] == \
        "Both 'lora_name' and 'lora_path' must be provided."
    again = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "story-a",
                                                             "lora_path": A})
    assert again.status_code == 400 and "has already been loaded" in again.text
    nowhere = httpx.post(url + "/v1/load_lora_adapter",
                         json={"lora_name": "x", "lora_path": "/nonexistent/adapter"})
    assert nowhere.status_code == 404 and "No adapter found" in nowhere.text
    ok = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "story-b",
                                                          "lora_path": B})
    assert ok.status_code == 200
    assert ok.text == "Success: LoRA adapter 'story-b' added successfully."
    out = lora_client.completions.create(model="story-b", prompt=PROMPT, max_tokens=12,
                                         temperature=0)
    assert out.choices[0].text == greedy_text(B)
    gone = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "story-b"})
    assert gone.status_code == 200
    assert gone.text == "Success: LoRA adapter 'story-b' removed successfully."
    assert httpx.post(url + "/v1/unload_lora_adapter",
                      json={"lora_name": "story-b"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        lora_client.completions.create(model="story-b", prompt=PROMPT, max_tokens=2)


def test_runtime_routes_are_off_by_default(http):
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "a",
                                                    "lora_path": A}).status_code == 404


@pytest.mark.parametrize("text, want", [
    ("a=/x", LoRAModulePath("a", "/x")),
    ('{"name": "a", "path": "/x", "base_model_name": "m"}', LoRAModulePath("a", "/x", "m"))])
def test_lora_modules_forms(text, want):
    assert LoRAModulePath.parse(text) == want
    with pytest.raises(ValueError, match="name=path"):
        LoRAModulePath.parse("no-equals-sign")


def test_lora_modules_are_checked_at_start_up(tmp_path):
    """vLLM loads --lora-modules before serving: a repeated name, the base model's name or
    an adapter that does not load stops the server from starting."""
    from jaxpaged.arg_utils import DEFAULT_MODEL
    from jaxpaged.server.serving_models import check_lora_modules

    good = LoRAModulePath("a", A)
    check_lora_modules([good], ["stories260K"], DEFAULT_MODEL, 16)
    with pytest.raises(ValueError, match="'a' is given 2 times"):
        check_lora_modules([good, LoRAModulePath("a", A)], ["stories260K"], DEFAULT_MODEL, 16)
    with pytest.raises(ValueError, match="'stories260K' is the base model's served name"):
        check_lora_modules([LoRAModulePath("stories260K", A)], ["stories260K"], DEFAULT_MODEL, 16)
    with pytest.raises(ValueError, match="greater than max_lora_rank=4"):
        check_lora_modules([good], ["stories260K"], DEFAULT_MODEL, 4)
    with pytest.raises(ValueError, match="No adapter found"):
        check_lora_modules([LoRAModulePath("m", str(tmp_path))], ["stories260K"], DEFAULT_MODEL, 16)
