"""LLM.chat through transformers' chat templates; generation_config defaults."""

import json

import pytest

from jaxpaged import LLM, SamplingParams
from tests.helpers.qwen_random import write_qwen_random

CONVERSATION = [{"role": "system", "content": "You tell short stories."},
                {"role": "user", "content": "Tell me about Lily."}]


def test_model_without_template_needs_one(stories_llm):
    with pytest.raises(ValueError, match="no chat template"):
        stories_llm.chat(CONVERSATION)
    template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    params = SamplingParams(temperature=0, max_tokens=8)
    out = stories_llm.chat(CONVERSATION, params, chat_template=template, use_tqdm=False)[0]
    text = "You tell short stories.\nTell me about Lily.\n"
    tok = stories_llm.get_tokenizer()
    assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    direct = stories_llm.generate({"prompt_token_ids": out.prompt_token_ids}, params,
                                  use_tqdm=False)[0]
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids
    with pytest.raises(ValueError, match="exclusive"):
        stories_llm.chat(CONVERSATION, chat_template=template, continue_final_message=True)
    with pytest.raises(ValueError, match="'role' and 'content'"):
        stories_llm.chat([{"content": "hi"}], chat_template=template)


@pytest.fixture(scope="module")
def qwen_like(tmp_path_factory):
    """A tiny random model with Qwen2's real tokenizer and chat template."""
    d = tmp_path_factory.mktemp("qwen_like")
    write_qwen_random(d, 151646)
    (d / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}))
    return LLM(model=str(d), load_format="dummy", enforce_eager=True, max_num_seqs=4,
               max_model_len=256)


def test_qwen2_template_renders_and_runs(qwen_like):
    tok = qwen_like.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = qwen_like.chat([CONVERSATION, CONVERSATION[1:]], params, use_tqdm=False)
    expected = tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert expected.endswith("<|im_start|>assistant\n")
    assert outs[0].prompt_token_ids == tok.encode(expected, add_special_tokens=False)
    assert len(outs) == 2 and all(len(o.outputs[0].token_ids) == 4 for o in outs)
    cont = qwen_like.chat(CONVERSATION + [{"role": "assistant", "content": "Once"}], params,
                          add_generation_prompt=False, continue_final_message=True,
                          use_tqdm=False)[0]
    assert tok.decode(cont.prompt_token_ids).endswith("<|im_start|>assistant\nOnce")


def test_generation_config_supplies_default_sampling_params(qwen_like, stories_llm):
    p = qwen_like.get_default_sampling_params()
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.7, 0.8, 20, 1.05)
    assert qwen_like.engine.output_processor.eos_token_ids >= {151645}
    assert stories_llm.get_default_sampling_params() == SamplingParams()
