"""The official openai client against the live server: results equal LLM.generate's."""

import openai
import pytest

from jaxpaged import SamplingParams
from tests.server.conftest import MODEL, PLAIN_TEMPLATE

PROMPTS = ["Once upon a time", "Lily and Ben went to the park", "The little dog"]


def test_completion_greedy_equals_llm_generate(client, stories_llm):
    refs = stories_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24),
                                use_tqdm=False)
    for prompt, ref in zip(PROMPTS, refs):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        assert out.choices[0].text == ref.outputs[0].text
        assert out.choices[0].finish_reason == ref.outputs[0].finish_reason
        assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert out.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert refs[0].outputs[0].text.startswith(", there was a little girl named Lily")


def test_completion_batch_of_prompts_and_token_ids(client, stories_llm):
    tok = stories_llm.get_tokenizer()
    refs = stories_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12),
                                use_tqdm=False)
    out = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [r.outputs[0].text for r in refs]
    ids = [tok.encode(p) for p in PROMPTS]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert [c.text for c in by_ids.choices] == [r.outputs[0].text for r in refs]
    one = client.completions.create(model=MODEL, prompt=ids[1], max_tokens=12, temperature=0)
    assert one.choices[0].text == refs[1].outputs[0].text


@pytest.mark.parametrize("extra", [{}, {"n": 2, "seed": 11, "temperature": 0.9,
                                         "extra_body": {"top_k": 40}}])
def test_completion_stream_equals_non_stream(client, extra):
    args = dict(model=MODEL, prompt=PROMPTS[:2], max_tokens=20, temperature=0)
    args.update(extra)
    full = client.completions.create(**args)
    texts, finish = {}, {}
    for chunk in client.completions.create(stream=True, **args):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                assert c.index not in finish
                finish[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in full.choices}
    assert finish == {c.index: c.finish_reason for c in full.choices}


def test_sampled_completion_matches_llm_with_same_seed(client, stories_llm):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=16)
    ref = stories_llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], temperature=0.8, top_p=0.9,
                                    seed=1234, max_tokens=16)
    assert out.choices[0].text == ref.outputs[0].text


def test_chat_equals_llm_chat(client, stories_llm):
    messages = [{"role": "system", "content": "Stories."}, {"role": "user", "content": "Lily"}]
    ref = stories_llm.chat(messages, SamplingParams(temperature=0, max_tokens=16),
                           chat_template=PLAIN_TEMPLATE, use_tqdm=False)[0]
    out = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                         max_completion_tokens=16)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.outputs[0].text
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    streamed, roles = "", []
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                max_completion_tokens=16, stream=True):
        for c in chunk.choices:
            roles.append(c.delta.role)
            streamed += c.delta.content or ""
    assert streamed == ref.outputs[0].text
    assert roles[0] == "assistant" and set(roles[1:]) == {None}


def test_models_and_alias(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL, "alias"]
    out = client.completions.create(model="alias", prompt="Once", max_tokens=2, temperature=0)
    assert out.model == "alias" and len(out.choices) == 1


def test_sdk_errors_are_readable(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="does-not-exist", prompt="x", max_tokens=2)
    assert "does-not-exist" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, top_p=1.5)
    assert "top_p" in e.value.message and "(0, 1]" in e.value.message
    assert e.value.body["param"] == "top_p"
