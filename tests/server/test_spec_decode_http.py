"""Speculative decoding through the server (n-gram and draft-model proposals): streamed text
equal to plain decoding and to the non-streamed text, and the acceptance counters on
/metrics."""

import httpx
import openai
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.server.serving import ServerConfig
from tests.server.conftest import MODEL, PLAIN_TEMPLATE, LiveServer, engine_args
from tests.server.test_abort_and_load import metrics
from tests.test_spec_decode import COPY_PROMPTS, NGRAM
from tests.test_spec_decode_draft import K, layer_skipped_stories


@pytest.fixture(scope="module")
def spec_server():
    server = LiveServer(engine_args(speculative_config=NGRAM),
                        ServerConfig([MODEL], PLAIN_TEMPLATE)).start()
    yield server
    server.stop()


@pytest.mark.slow
def test_streamed_completions_equal_plain_decoding_and_metrics_count(spec_server):
    plain = LLM(**vars(engine_args()))
    want = [o.outputs[0].text for o in plain.generate(
        COPY_PROMPTS, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
        use_tqdm=False)]
    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="unused", max_retries=0)
    for prompt, text in zip(COPY_PROMPTS, want):
        chunks = [c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=60, temperature=0, stream=True,
            extra_body={"ignore_eos": True})]
        assert "".join(chunks) == text
        assert len(chunks) < 60       # accepted runs arrive several tokens to a chunk
    with httpx.Client(base_url=spec_server.url) as http:
        m = metrics(http)
    accepted = m[("jaxpaged:spec_decode_num_accepted_tokens_total", ())]
    assert m[("jaxpaged:spec_decode_num_drafts_total", ())] > 0 and accepted > 0
    assert sum(m[("jaxpaged:spec_decode_num_accepted_tokens_per_pos_total",
                  (("position", str(i)),))] for i in range(4)) == accepted
    kv = spec_server.kv
    spec_server.wait_idle()
    assert kv.num_free_pages == kv.num_usable_pages


@pytest.fixture(scope="module")
def draft_server(tmp_path_factory):
    draft = {"method": "draft_model", "num_speculative_tokens": K,
             "model": layer_skipped_stories(tmp_path_factory.mktemp("draft")),
             "disable_by_batch_size": 64}
    server = LiveServer(engine_args(speculative_config=draft),
                        ServerConfig([MODEL], PLAIN_TEMPLATE)).start()
    yield server
    server.stop()


def test_draft_model_streamed_text_equals_non_streamed_and_plain(draft_server):
    plain = LLM(**vars(engine_args()))
    want = [o.outputs[0].text for o in plain.generate(
        COPY_PROMPTS, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
        use_tqdm=False)]
    client = openai.OpenAI(base_url=draft_server.url + "/v1", api_key="unused",
                           max_retries=0)
    args = dict(model=MODEL, max_tokens=60, temperature=0, extra_body={"ignore_eos": True})
    for prompt, text in zip(COPY_PROMPTS, want):
        chunks = [c.choices[0].text
                  for c in client.completions.create(prompt=prompt, stream=True, **args)]
        assert "".join(chunks) == text
        assert client.completions.create(prompt=prompt, **args).choices[0].text == text
        assert len(chunks) < 60       # accepted runs arrive several tokens to a chunk
    with httpx.Client(base_url=draft_server.url) as http:
        m = metrics(http)
    accepted = m[("jaxpaged:spec_decode_num_accepted_tokens_total", ())]
    assert 0 < accepted < m[("jaxpaged:spec_decode_num_draft_tokens_total", ())]
    kv = draft_server.kv
    draft_server.wait_idle()
    assert kv.num_free_pages == kv.num_usable_pages
