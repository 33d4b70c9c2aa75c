"""Regression tests for shared/BUGCASES.md cases B01, B03-B07, B14-B16 and B26 (offline API;
"streaming" is ``output_kind=DELTA``; FORCE is ``tests/helpers/force.py``)."""

import os

import numpy as np
import pytest
from transformers import AutoTokenizer

from jaxpaged import LLM, SamplingParams
from jaxpaged.core.detokenizer import IncrementalDetokenizer
from jaxpaged.sampling_params import RequestOutputKind
from tests.conftest import LLAMA2_TOKENIZER, STORIES, STORIES_REFERENCE, TOKENIZERS
from tests.helpers.force import force_tokens, run_engine

DELTA = RequestOutputKind.DELTA
with open(os.path.join(STORIES_REFERENCE, "expected_greedy_t0_n256.txt")) as f:
    STORY = f.read()
NEWLINE_PROMPT = STORY[:STORY.index("\n")]          # greedy continues with "\n" at once


@pytest.fixture(scope="module")
def llm():
    return LLM(enforce_eager=True, max_num_seqs=64, max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def forced_llm():
    """The same engine, scheduling synchronously: FORCE replaces sampled tokens on the host."""
    return LLM(enforce_eager=True, max_num_seqs=64, max_num_batched_tokens=512,
               async_scheduling=False)


def ref(llm, prompt, k):
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=k, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]


def stream(llm, rid, prompt, **kw):
    """Delta outputs of one request: (concatenated text, list of deltas, last output)."""
    outs = run_engine(llm.engine, rid, prompt, SamplingParams(output_kind=DELTA, **kw))
    deltas = [c.text for o in outs for c in o.outputs]
    return "".join(deltas), deltas, outs[-1]


def test_a_stop_string_spanning_tokens_may_start_inside_a_token(llm):
    r = ref(llm, "Once upon a time", 64)
    s = r.text[r.text.index("little girl") + 1:][:9]      # "ittle gir": starts inside a token
    i = r.text.index(s)
    kw = dict(temperature=0, max_tokens=64, ignore_eos=True, stop=[s])
    full = llm.generate(["Once upon a time"], SamplingParams(**kw), use_tqdm=False)[0].outputs[0]
    assert (full.text, full.finish_reason, full.stop_reason) == (r.text[:i], "stop", s)
    concat, deltas, last = stream(llm, "b01", "Once upon a time", **kw)
    assert concat == full.text and last.outputs[0].finish_reason == "stop"
    assert not any(ch in d for d in deltas for ch in set(s) - set(r.text[:i]))


def test_a_stop_at_the_very_first_token_ends_with_empty_text(llm, forced_llm, monkeypatch):
    r = ref(llm, "Once upon a time", 8)
    s = r.text[:2]
    for kind in (RequestOutputKind.CUMULATIVE, DELTA):
        out = run_engine(llm.engine, f"b03-{kind}", "Once upon a time",
                         SamplingParams(temperature=0, max_tokens=8, stop=[s], output_kind=kind))
        assert out[-1].outputs[0].text == "" and out[-1].outputs[0].finish_reason == "stop"
        assert out[-1].finished
    force_tokens(monkeypatch, forced_llm.engine, {"eos-first": [2]})
    out = run_engine(forced_llm.engine, "eos-first", "Once upon a time",
                     SamplingParams(max_tokens=8, output_kind=DELTA))
    c = out[-1].outputs[0]
    assert (c.text, c.finish_reason, c.token_ids) == ("", "stop", [2])


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_ids_stop_on_special_and_plain_tokens(forced_llm, monkeypatch, include):
    tok = forced_llm.get_tokenizer()
    hello = tok.encode("hello world", add_special_tokens=False)
    newline = tok.encode("\n", add_special_tokens=False)[-1]
    force_tokens(monkeypatch, forced_llm.engine, {"special": hello + [2], "plain": hello + [newline]})
    words = tok.decode([5] + hello)[len(tok.decode([5])):]      # " hello world" after the prompt
    assert words.strip() == "hello world"
    common = dict(max_tokens=20, skip_special_tokens=True, include_stop_str_in_output=include)
    c = run_engine(forced_llm.engine, "special", [1, 5], SamplingParams(stop_token_ids=[2], ignore_eos=True,
                                                                 **common))[-1].outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == (words, "stop", 2)
    c = run_engine(forced_llm.engine, "plain", [1, 5], SamplingParams(stop_token_ids=[newline],
                                                               **common))[-1].outputs[0]
    assert c.text == (words + "\n" if include else words)
    assert (c.finish_reason, c.stop_reason) == ("stop", newline)


def test_min_tokens_delays_every_stop(llm, monkeypatch):
    r = ref(llm, NEWLINE_PROMPT, 50)
    assert "\n" in r.text[:10]
    c = llm.generate([NEWLINE_PROMPT], SamplingParams(temperature=0, max_tokens=50, min_tokens=20,
                                                      stop=["\n"]), use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) >= 20
    assert c.finish_reason == "length" or c.stop_reason == "\n"
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)
    # EOS is masked until min_tokens: make the greedy first token an EOS id.
    first = ref(llm, "Once upon a time", 1).token_ids[0]
    processor = llm.engine.output_processor
    monkeypatch.setattr(processor, "eos_token_ids", frozenset({first}))
    monkeypatch.setattr(llm.engine.runner, "eos_token_ids", frozenset({first}))
    c = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=12,
                                                          min_tokens=5), use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) >= 5 and first not in c.token_ids[:5]


def test_ignore_eos_ignores_every_eos_id(llm, monkeypatch):
    r = ref(llm, "Once upon a time", 16)
    e2 = r.token_ids[0]
    monkeypatch.setattr(llm.engine.output_processor, "eos_token_ids", frozenset({2, e2}))
    c = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=16,
                                                          ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) == 16 and c.finish_reason == "length"
    c = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=16),
                     use_tqdm=False)[0].outputs[0]
    assert c.token_ids == [e2] and c.finish_reason == "stop"
    c = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=16,
                                                          ignore_eos=True, stop_token_ids=[e2]),
                     use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == e2


def test_streamed_deltas_concatenate_to_the_full_decode(forced_llm, monkeypatch):
    tok = forced_llm.get_tokenizer()
    rng = np.random.default_rng(7)
    special = set(tok.all_special_ids)
    random_ids = [int(t) for t in rng.integers(3, 512, 400) if int(t) not in special][:200]
    for rid, ids in [("utf8", tok.encode("汉字 🤗 café. It works", add_special_tokens=False)),
                     ("random", random_ids), ("cut", tok.encode("汉字", add_special_tokens=False)[:-1])]:
        force_tokens(monkeypatch, forced_llm.engine, {rid: ids, rid + "-full": ids})
        concat, deltas, last = stream(forced_llm, rid, [1, 5], max_tokens=len(ids), ignore_eos=True)
        # The decode of the ids as they follow the prompt (sentencepiece keeps the space).
        full = tok.decode([5] + ids, skip_special_tokens=True)[len(tok.decode([5])):]
        nonstream = run_engine(forced_llm.engine, rid + "-full", [1, 5], SamplingParams(
            max_tokens=len(ids), ignore_eos=True))[-1].outputs[0].text
        assert concat == full == nonstream, rid
        assert all("\ufffd" not in d for d in deltas[:-1]) or "\ufffd" in full
        monkeypatch.undo()


@pytest.mark.parametrize("path", [STORIES, LLAMA2_TOKENIZER] +
                         [os.path.join(TOKENIZERS, n) for n in ("mistral", "gpt2", "qwen2")])
def test_deltas_of_real_tokenizers_concatenate_to_the_full_decode(path):
    tok = AutoTokenizer.from_pretrained(path)
    text = "汉字 🤗 café. It works — naïve  spaces\tand\nlines 日本語"
    ids = tok.encode(text, add_special_tokens=False)
    rng = np.random.default_rng(1)
    special = set(tok.all_special_ids)
    ids += [int(t) for t in rng.integers(0, len(tok), 300) if int(t) not in special][:150]
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    deltas, shown = [], ""
    for t in ids:
        detok.add_token(t)
        deltas.append(detok.text[len(shown):])
        shown = detok.text
    detok.flush()
    deltas.append(detok.text[len(shown):])
    full = tok.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas)


def test_n_choices_streamed_equal_the_non_streamed_ones(llm):
    p = dict(n=4, temperature=1.0, seed=7, max_tokens=32)
    full = llm.generate(["Once upon a time"], SamplingParams(**p), use_tqdm=False)[0]
    assert [c.index for c in full.outputs] == [0, 1, 2, 3]
    outs = run_engine(llm.engine, "b14", "Once upon a time", SamplingParams(output_kind=DELTA, **p))
    texts, finishes = {}, {}
    for o in outs:
        for c in o.outputs:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finishes[c.index] = finishes.get(c.index, 0) + 1
    assert texts == {c.index: c.text for c in full.outputs}
    assert finishes == {0: 1, 1: 1, 2: 1, 3: 1}
    greedy = llm.generate(["Once upon a time"], SamplingParams(n=4, temperature=0, max_tokens=16),
                          use_tqdm=False)[0]
    assert len({c.text for c in greedy.outputs}) == 1 and len(greedy.outputs) == 4


def test_seeded_sampling_is_per_request(llm):
    x = SamplingParams(temperature=0.9, top_p=1, seed=1234, max_tokens=32)
    alone = llm.generate(["Once upon a time"], x, use_tqdm=False)[0].outputs[0].token_ids
    rng = np.random.default_rng(3)
    others = [[1] + rng.integers(3, 512, int(n)).tolist() for n in rng.integers(1, 60, 7)]
    for order in range(3):
        prompts = others[:order * 2] + ["Once upon a time"] + others[order * 2:]
        params = [SamplingParams(temperature=0.7, max_tokens=20)] * len(prompts)
        params[order * 2] = x
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert outs[order * 2].outputs[0].token_ids == alone
    distinct = {tuple(llm.generate(["Once upon a time"], SamplingParams(
        temperature=0.9, seed=s, max_tokens=32), use_tqdm=False)[0].outputs[0].token_ids)
        for s in range(1235, 1245)}
    assert len(distinct) >= 2


def test_greedy_equivalents_agree_and_stay_deterministic_under_load(llm):
    r = ref(llm, "Once upon a time", 64)
    for p in (SamplingParams(temperature=1.0, top_k=1, max_tokens=64, ignore_eos=True),
              SamplingParams(temperature=0.5, top_p=1e-9, max_tokens=64, ignore_eos=True)):
        assert llm.generate(["Once upon a time"], p, use_tqdm=False)[0].outputs[0].token_ids == \
            r.token_ids
    rng = np.random.default_rng(4)
    others = [[1] + rng.integers(3, 512, int(n)).tolist() for n in rng.integers(1, 100, 32)]
    prompts = ["Once upon a time"] * 32 + others
    order = rng.permutation(len(prompts))
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    outs = llm.generate([prompts[i] for i in order], params, use_tqdm=False)
    same = [o.outputs[0].token_ids for o, i in zip(outs, order) if i < 32]
    assert len(same) == 32 and all(t == r.token_ids for t in same)


def test_repetition_penalty_covers_the_prompt_presence_and_frequency_only_the_output(llm):
    prompt = "She wanted to play with it, but it was too high."
    t = ref(llm, prompt, 1).token_ids[0]
    assert t in llm.get_tokenizer().encode(prompt)
    moved = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, repetition_penalty=5),
                         use_tqdm=False)[0].outputs[0].token_ids[0]
    kept = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, presence_penalty=2,
                                                 frequency_penalty=2),
                        use_tqdm=False)[0].outputs[0].token_ids[0]
    assert moved != t and kept == t
