"""Security defaults: the API key on every /v1/*, /tokenize and /detokenize route (401),
the body limit (413, before the body is read), --trust-remote-code off, chat templates in
transformers' sandbox and per-request templates refused, prompts never logged unless
--enable-log-requests, 127.0.0.1 as the default bind (the bind itself: test_lifecycle.py)."""

import json
import logging
import os
import shutil
import socket
import subprocess
import sys

import pytest
from starlette.testclient import TestClient

from jaxpaged import LLM
from jaxpaged.cli import build_parser
from jaxpaged.arg_utils import EngineArgs
from jaxpaged.server.launcher import make_server
from jaxpaged.server.server_args import server_config
from jaxpaged.server.serving import ServerConfig
from jaxpaged.tokenizer import load_tokenizer
from tests.conftest import STORIES
from tests.server.conftest import MAX_BODY_BYTES, MODEL, engine_args, wait_until

KEY = "s3cret"
PROTECTED = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
             ("GET", "/v1/models"), ("GET", f"/v1/models/{MODEL}"), ("GET", "/v1/nope"),
             ("POST", "/tokenize"), ("POST", "/detokenize")]


# ---- --api-key ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed():
    """The app with an API key; the engine is never started (auth comes before it)."""
    _, app = make_server(engine_args(), ServerConfig([MODEL], api_key=KEY))
    return TestClient(app)


@pytest.mark.parametrize("method, path", PROTECTED)
@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Basic {KEY}", "Bearer",
                                           f"Bearer {KEY}x"])
def test_protected_routes_need_the_key(keyed, method, path, authorization):
    headers = {} if authorization is None else {"Authorization": authorization}
    r = keyed.request(method, path, headers=headers, json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 401
    assert r.json()["error"]["code"] == 401


@pytest.mark.parametrize("method, path", PROTECTED)
def test_protected_routes_pass_with_the_key(keyed, method, path):
    r = keyed.request(method, path, headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": MODEL, "prompt": "x"})
    expected = {"/v1/models": 200, f"/v1/models/{MODEL}": 200, "/v1/nope": 404}
    assert r.status_code == expected.get(path, 503)     # 503: the engine is not loaded


@pytest.mark.parametrize("path, status", [("/health", 503), ("/metrics", 200),
                                          ("/version", 200), ("/openapi.json", 200)])
def test_operational_routes_stay_open(keyed, path, status):
    assert keyed.get(path).status_code == status


# ---- body limit ---------------------------------------------------------------------------


def test_declared_oversized_body_is_refused_before_it_is_read(live_server):
    host, port = live_server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 10000000000\r\n\r\n")
        head = sock.recv(65536).decode()          # answered although no body byte was sent
    assert head.startswith("HTTP/1.1 413") and '"code":413' in head


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
def test_chunked_oversized_body_gets_413(http, path):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_BYTES // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    r = http.post(path, content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    assert f"{MAX_BODY_BYTES} bytes" in r.json()["error"]["message"]
    assert http.post("/tokenize", json={"prompt": "x"}).status_code == 200


# ---- --trust-remote-code -----------------------------------------------------------------


@pytest.fixture
def code_tokenizer(tmp_path):
    """A tokenizer directory whose class is Python code that leaves a marker file when run."""
    directory = tmp_path / "tokenizer"
    directory.mkdir()
    shutil.copy(os.path.join(STORIES, "tokenizer.json"), directory)
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "tokenizer_class": "CodeTokenizer",
        "auto_map": {"AutoTokenizer": [None, "code_tokenizer.CodeTokenizer"]}}))
    marker = tmp_path / "code_ran"
    (directory / "code_tokenizer.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class CodeTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    return directory, marker


def test_tokenizer_code_never_runs_without_trust_remote_code(code_tokenizer):
    directory, marker = code_tokenizer
    assert EngineArgs().trust_remote_code is False
    parser = build_parser()
    assert EngineArgs.from_cli_args(parser.parse_args(["serve"])).trust_remote_code is False
    assert EngineArgs.from_cli_args(
        parser.parse_args(["serve", "--trust-remote-code"])).trust_remote_code is True
    with pytest.raises(FileNotFoundError, match="Pass --trust-remote-code to run it"):
        load_tokenizer(str(directory))
    with pytest.raises(FileNotFoundError, match="--trust-remote-code"):
        LLM(tokenizer=str(directory), enforce_eager=True)
    assert not marker.exists()
    with pytest.raises(ValueError, match="EngineArgs.trust_remote_code must be True or False"):
        EngineArgs(trust_remote_code="yes")


def test_trust_remote_code_runs_the_tokenizer_code(code_tokenizer, tmp_path):
    directory, marker = code_tokenizer
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")}
    out = subprocess.run([sys.executable, "-c", "import sys; from jaxpaged.tokenizer import "
                          "load_tokenizer; print(type(load_tokenizer(sys.argv[1], True)).__name__)",
                          str(directory)], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "CodeTokenizer", out.stderr
    assert marker.exists()


# ---- chat templates ----------------------------------------------------------------------


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}", "{{ cycler.__init__.__globals__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}", "{{ messages.append(1) }}"])
def test_templates_cannot_reach_python_internals(live_server, http, template):
    messages = [{"role": "user", "content": "hi"}]
    with live_server.configured(chat_template=template):
        for path, body in (("/v1/chat/completions", {"messages": messages, "max_tokens": 2}),
                           ("/tokenize", {"messages": messages})):
            r = http.post(path, json={"model": MODEL, **body})
            assert r.status_code == 400, r.text
            assert "unsafe" in r.json()["error"]["message"]
    with live_server.configured(trust_request_chat_template=True):
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                   "chat_template": template})
        assert r.status_code == 400 and "unsafe" in r.json()["error"]["message"]


def test_unsafe_attribute_renders_as_nothing(live_server, http):
    with live_server.configured(chat_template="x{{ ''.__class__ }}y"):
        ids = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert http.post("/detokenize", json={"tokens": ids.json()["tokens"]}).json()["prompt"] == "xy"


# ---- request logging ---------------------------------------------------------------------


def test_prompts_are_logged_only_with_enable_log_requests(live_server, http, caplog):
    caplog.set_level(logging.DEBUG)
    prompt = "Zebra sapphire umbrella"
    outputs = []
    for stream in (False, True):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt,
                                               "max_tokens": 8, "temperature": 0,
                                               "stream": stream})
        assert r.status_code == 200
        outputs.append(r.text)
    text = json.loads(outputs[0])["choices"][0]["text"]
    assert prompt not in caplog.text and text not in caplog.text
    assert not request_log_lines(caplog)
    with live_server.configured(enable_log_requests=True):
        http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
    [line] = request_log_lines(caplog)
    assert f"prompt {prompt!r} (18 tokens)" in line


def request_log_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "server" and r.getMessage().startswith("request ")]


def test_log_request_flags(caplog):
    parser = build_parser()
    assert server_config(parser.parse_args(["serve"])).enable_log_requests is False
    assert server_config(parser.parse_args(["serve", "--enable-log-requests"])).enable_log_requests
    with caplog.at_level(logging.WARNING, logger="server"):
        config = server_config(parser.parse_args(["serve", "--disable-log-requests"]))
    assert config.enable_log_requests is False
    assert "--disable-log-requests is deprecated and has no effect" in caplog.text


def test_default_bind_is_loopback_only():
    args = build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1"


# ---- found by the fresh-user review of issue 10 ----------------------------------------------


@pytest.mark.parametrize("given", [["--api-key", ""], ["--api-key", "  "]])
def test_an_empty_api_key_is_refused(given, monkeypatch):
    monkeypatch.delenv("JAXPAGED_API_KEY", raising=False)
    with pytest.raises(ValueError, match="--api-key is empty"):
        server_config(build_parser().parse_args(["serve", *given]))
    monkeypatch.setenv("JAXPAGED_API_KEY", "")
    with pytest.raises(ValueError, match=r"\$JAXPAGED_API_KEY is empty"):
        server_config(build_parser().parse_args(["serve"]))


def test_exposed_host_without_a_key_warns(caplog, monkeypatch):
    monkeypatch.delenv("JAXPAGED_API_KEY", raising=False)
    with caplog.at_level(logging.WARNING, logger="server"):
        server_config(build_parser().parse_args(["serve", "--host", "0.0.0.0"]))
    assert "serving on 0.0.0.0 without an API key" in caplog.text


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
def test_a_body_not_declared_as_json_gets_415(http, path, content_type):
    """A browser's cross-site "simple" request cannot reach the engine (FastAPI's rule)."""
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1})
    r = http.post(path, content=body, headers={"Content-Type": content_type})
    assert r.status_code == 415
    assert r.json()["error"]["message"] == (
        "the request body must be JSON (Content-Type: application/json), got Content-Type "
        f"{content_type.split(';')[0]!r}")
    for ok in ("application/json; charset=utf-8", None):
        headers = {} if ok is None else {"Content-Type": ok}
        assert http.post(path, content=body, headers=headers).status_code == 200


def test_a_client_hanging_up_mid_body_is_not_an_error(live_server, http):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    watched = [logging.getLogger(n) for n in ("uvicorn.error", "server")]
    levels = [lg.level for lg in watched]
    for lg in watched:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    try:
        host, port = live_server.url.removeprefix("http://").split(":")
        for _ in range(3):
            with socket.create_connection((host, int(port))) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                             b"application/json\r\nContent-Length: 68\r\n\r\n{\"model\": \"st")
        wait_until(lambda: sum("while sending its request body" in r.getMessage()
                               for r in records) == 3, "three hang-ups logged", timeout=5)
    finally:
        for lg, level in zip(watched, levels):
            lg.removeHandler(handler)
            lg.setLevel(level)
    assert not [r for r in records if r.levelno >= logging.ERROR]
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize("template, named", [
    ("{% for x in range(100001) %}{% endfor %}", "Range too big"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recursion")])
def test_runaway_request_templates_get_400(live_server, http, template, named):
    with live_server.configured(trust_request_chat_template=True):
        r = http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "chat_template": template})
    assert r.status_code == 400, r.text
    assert named in r.json()["error"]["message"]


def test_a_prompt_too_long_for_any_tokenization_is_refused_untokenized(live_server, http):
    """Refused by its length in characters (the tokenizer never sees it), and tokenizing
    happens off the event loop: /health answers meanwhile."""
    engine = live_server.engine.engine
    limit = engine.max_model_len * 4 * max(map(len, engine.tokenizer.get_vocab()))
    long_text = "a" * (limit + 1)
    for path, body, param in (
            ("/v1/completions", {"prompt": long_text}, "prompt"),
            ("/tokenize", {"prompt": long_text}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}]},
             "messages")):
        r = http.post(path, json={"model": MODEL, **body})
        assert r.status_code == 400, path
        error = r.json()["error"]
        assert error["param"] == param
        # a chat's rendered text adds the template's characters to the message's
        count = str(limit + 1) if param == "prompt" else str(limit + 1 + len("user: \nassistant:"))
        assert error["message"] == (
            f"the prompt has {count} characters: more than any {engine.max_model_len} tokens "
            "(the maximum model length) of this tokenizer can hold")
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Once " * 200})
    assert r.status_code == 400        # tokenized (short enough to try), then too long
    assert "maximum context length is 128 tokens" in r.json()["error"]["message"]


def test_chat_template_kwargs_cannot_set_the_renderings_own_arguments(http):
    r = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"tokenize": True, "add_generation_prompt": False, "x": 1}})
    assert r.status_code == 400
    assert r.json()["error"] == {
        "message": "chat_template_kwargs may not set ['add_generation_prompt', 'tokenize']: "
                   "they are arguments of the template rendering itself",
        "type": "invalid_request_error", "param": "chat_template_kwargs", "code": 400}
