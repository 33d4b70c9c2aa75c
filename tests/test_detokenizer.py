"""Incremental detokenization on real tokenizers, and stop handling in the engine."""

import os

import pytest
from transformers import AutoTokenizer

from jaxpaged import SamplingParams
from jaxpaged.core.detokenizer import IncrementalDetokenizer
from tests.conftest import LLAMA2_TOKENIZER, STORIES, TOKENIZERS

TEXTS = [
    "Hello world!  Two  spaces, tabs\tand\nnewlines.",
    "Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e co\u00fbte 5\u20ac \u2014 na\u00efve",
    "\u4f60\u597d\uff0c\u4e16\u754c\u3002\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8",
    "Emoji \U0001F600\U0001F680 and flags \U0001F1EB\U0001F1F7 mixed with text",
    " leading space and trailing space ",
]


@pytest.mark.parametrize("path", [STORIES, LLAMA2_TOKENIZER, os.path.join(TOKENIZERS, "gpt2")])
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode_and_never_emits_broken_chars(path, text):
    tok = AutoTokenizer.from_pretrained(path)
    prompt = tok.encode("Prompt:")
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True)
    pieces = []
    for t in ids:
        before = detok.text
        detok.add_token(t)
        pieces.append(detok.text[len(before):])
        assert "\ufffd" not in detok.text
    detok.flush()                     # generation ends: release any held-back byte run
    pieces.append(detok.text[len("".join(pieces)):])
    full = tok.decode(prompt + ids, skip_special_tokens=True)
    prompt_text = tok.decode(prompt, skip_special_tokens=True)
    assert full.startswith(prompt_text)
    assert detok.text == full[len(prompt_text):]
    assert "".join(pieces) == detok.text


def test_byte_fallback_character_split_across_tokens_is_held_back():
    tok = AutoTokenizer.from_pretrained(STORIES)  # 512 pieces: CJK falls back to bytes
    ids = tok.encode("\u4f60", add_special_tokens=False)
    assert len(ids) >= 3  # one character, several byte tokens
    detok = IncrementalDetokenizer(tok, [1], skip_special_tokens=True)
    for t in ids[:-1]:
        detok.add_token(t)
        assert detok.text == ""
    detok.add_token(ids[-1])
    assert detok.text == ""           # the run of byte tokens is still open
    detok.add_token(tok.encode(" dog", add_special_tokens=False)[0])
    assert detok.text.startswith("\u4f60")


def test_stop_string_across_token_boundary():
    tok = AutoTokenizer.from_pretrained(STORIES)
    ids = tok.encode("Once upon a time, there was a dog.", add_special_tokens=False)
    for include, expected in [(False, "Once upon a tim"), (True, "Once upon a time, th")]:
        detok = IncrementalDetokenizer(tok, [1], True, stop=("e, th",),
                                       include_stop_str_in_output=include)
        matched = None
        for t in ids:
            matched = detok.add_token(t)
            if matched:
                break
        assert (matched, detok.text) == ("e, th", expected)


def test_engine_stop_string_stop_token_and_eos(stories_llm):
    greedy = dict(temperature=0, max_tokens=60)
    ref = stories_llm.generate(["Once upon a time"], SamplingParams(**greedy), use_tqdm=False)[0]
    ref_text, ref_ids = ref.outputs[0].text, ref.outputs[0].token_ids
    assert ref_text.startswith(", there was a little girl named Lily.")

    out = stories_llm.generate(["Once upon a time"], SamplingParams(stop=["little girl"], **greedy),
                               use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (", there was a ", "stop", "little girl")

    stop_id = ref_ids[5]
    out = stories_llm.generate(["Once upon a time"],
                               SamplingParams(stop_token_ids=[stop_id], **greedy),
                               use_tqdm=False)[0].outputs[0]
    first = ref_ids.index(stop_id)
    assert out.token_ids == ref_ids[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    assert out.text == stories_llm.get_tokenizer().decode(ref_ids[:first])

    engine = stories_llm.engine
    saved = engine.output_processor.eos_token_ids
    try:
        engine.output_processor.eos_token_ids = frozenset({stop_id})
        out = stories_llm.generate(["Once upon a time"], SamplingParams(**greedy),
                                   use_tqdm=False)[0].outputs[0]
        assert out.token_ids == ref_ids[:first + 1]
        assert (out.finish_reason, out.stop_reason) == ("stop", None)
        out = stories_llm.generate(["Once upon a time"], SamplingParams(ignore_eos=True, **greedy),
                                   use_tqdm=False)[0].outputs[0]
        assert out.token_ids == ref_ids and out.finish_reason == "length"
    finally:
        engine.output_processor.eos_token_ids = saved


def test_eos_ids_from_config_generation_config_and_tokenizer(stories_llm):
    assert stories_llm.engine.output_processor.eos_token_ids == frozenset({2})


def test_streamed_text_never_shrinks_when_a_stop_string_completes(stories_llm):
    engine = stories_llm.engine
    engine.add_request("hold", "Once upon a time",
                       SamplingParams(temperature=0, max_tokens=60, stop="e was a lit"))
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.outputs[0].text for o in engine.step()]
    assert texts[-1] == ", ther"
    for before, after in zip(texts, texts[1:]):
        assert after.startswith(before)
