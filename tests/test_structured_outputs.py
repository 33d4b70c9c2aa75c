"""Structured outputs: grammar validation, the device bitmask, and the engine end to end on
the bundled model and on a random-weight model with Qwen2's real tokenizer."""

import json
import os
import re

import jax.numpy as jnp
import jsonschema
import llguidance.numpy
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.core.input_processor import InputProcessor
from jaxpaged.sampling.sampler import SamplingMetadata, apply_token_bitmask, sample
from jaxpaged.sampling_params import (RequestOutputKind, SamplingParamsError,
                                      StructuredOutputsParams)
from tests.conftest import TOKENIZERS
from tests.helpers.qwen_random import write_qwen_random

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 99},
    "pet": {"enum": ["cat", "dog"]}}, "required": ["name", "age", "pet"],
    "additionalProperties": False}
CHOICES = ["yes", "no", "maybe"]
REGEX = "[0-9]{3}-[a-z]{2}"
#: Checks parameters as an engine does when a request is added (no tokenizer needed).
PROCESSOR = InputProcessor(None, vocab_size=512, max_model_len=64, max_num_seqs=8)


def constrained(**kwargs) -> StructuredOutputsParams:
    return StructuredOutputsParams(disable_any_whitespace=True, **kwargs)


# ---- parameters -----------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, param, needle", [
    ({}, "structured_outputs", "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs", "['regex', 'choice']"),
    ({"regex": "[0-9"}, "structured_outputs.regex", "unclosed character class"),
    ({"json": "{not json"}, "structured_outputs.json", "not valid JSON"),
    ({"json": {"type": "foo"}}, "structured_outputs.json", "Invalid type: foo"),
    ({"grammar": "start: foo"}, "structured_outputs.grammar", 'unknown name: "foo"'),
    ({"choice": []}, "structured_outputs.choice", "non-empty list"),
    ({"json_object": "yes"}, "structured_outputs.json_object", "bool")])
def test_invalid_grammars_raise_naming_the_field(kwargs, param, needle):
    # The fields' types are checked on construction, the grammar when the request is added
    # (the input processor, where vLLM validates structured outputs).
    with pytest.raises(SamplingParamsError) as e:
        PROCESSOR.check_params(SamplingParams(
            structured_outputs=StructuredOutputsParams(**kwargs)))
    assert e.value.param == param and needle in str(e.value)


def test_valid_grammars_of_every_kind_are_accepted():
    for kwargs in ({"json": SCHEMA}, {"json": json.dumps(SCHEMA)}, {"regex": REGEX},
                   {"choice": CHOICES}, {"grammar": 'start: "a" | "b"'},
                   {"json_object": True}):
        params = PROCESSOR.check_params(SamplingParams(
            structured_outputs=StructuredOutputsParams(**kwargs)))
        assert params.structured_outputs.kind == next(iter(kwargs))


def test_an_invalid_grammar_is_refused_when_the_request_is_added(stories_llm):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9"))
    with pytest.raises(SamplingParamsError, match="unclosed character class") as e:
        stories_llm.generate(["Once"], params, use_tqdm=False)
    assert e.value.param == "structured_outputs.regex"
    assert not stories_llm.engine.has_unfinished_requests()


# ---- the device mask ------------------------------------------------------------------------


def test_bitmask_unpacks_as_llguidance_reference():
    """Random masks over V = 70 (3 words, the last one partly past V), bit 31 included,
    against llguidance's numpy reference; an all-set mask leaves logits untouched."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 70)).astype(np.float32)
    mask = rng.integers(-2**31, 2**31, size=(4, 3), dtype=np.int64).astype(np.int32)
    mask[1] = -1
    expected = logits.copy()
    llguidance.numpy.apply_token_bitmask_inplace(expected, mask)
    got = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(mask)))
    np.testing.assert_array_equal(got, expected)
    free = np.full((4, 3), -1, np.int32)
    np.testing.assert_array_equal(np.asarray(apply_token_bitmask(jnp.asarray(logits), free)),
                                  logits)


def test_masked_tokens_are_never_sampled_and_get_minus_inf_logprobs():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(3, 40)).astype(np.float32))
    mask = np.zeros((3, 2), np.int32)
    mask[0, 0] = 1 << 5                      # only token 5
    mask[1, 1] = (1 << 3) | (1 << 7)         # tokens 35 and 39
    mask[2] = -1                             # free row
    meta = SamplingMetadata.from_host([(1.0, 0, 1.0, 0.0, False, 7, 3)] * 3, 3)
    out = sample(logits, meta, True, token_bitmask=jnp.asarray(mask))
    tokens = np.asarray(out.token_ids)
    assert tokens[0] == 5 and tokens[1] in (35, 39)
    top = np.asarray(out.logprobs.top_logprobs)
    assert top[0, 0] == 0.0 and np.all(np.isneginf(top[0, 1:]))
    assert np.isfinite(top[1, :2]).all() and np.all(np.isneginf(top[1, 2:]))
    free = sample(logits, meta, True, token_bitmask=jnp.asarray(np.full((3, 2), -1, np.int32)))
    assert int(free.token_ids[2]) == int(tokens[2])
    np.testing.assert_array_equal(np.asarray(free.logprobs.top_logprobs)[2], top[2])


# ---- the engine -----------------------------------------------------------------------------


def check_outputs(outputs, kinds) -> None:
    """Each constrained output matches its grammar: ``kinds`` gives, per request, "choice",
    "regex", "json" or None (free)."""
    for out, kind in zip(outputs, kinds, strict=True):
        for c in out.outputs:
            if kind is None:
                continue
            assert c.finish_reason == "stop", (kind, c.text, c.finish_reason)
            if kind == "choice":
                assert c.text in CHOICES
            elif kind == "regex":
                assert re.fullmatch(REGEX, c.text), c.text
            else:
                jsonschema.validate(json.loads(c.text), SCHEMA)


def batch(prompt, seed=0):
    """A free greedy request beside constrained ones (n = 4 for the JSON schema)."""
    return ([prompt] * 4, [
        SamplingParams(temperature=0, max_tokens=12),
        SamplingParams(temperature=1.0, seed=seed, max_tokens=8,
                       structured_outputs=constrained(choice=CHOICES)),
        SamplingParams(temperature=1.0, seed=seed + 1, max_tokens=12,
                       structured_outputs=constrained(regex=REGEX)),
        SamplingParams(temperature=1.0, seed=seed + 2, n=4, max_tokens=48,
                       structured_outputs=constrained(json=SCHEMA))],
        [None, "choice", "regex", "json"])


@pytest.fixture(scope="module")
def stories():
    """The bundled model, precompiled (compilations are counted)."""
    return LLM(max_num_seqs=8, max_model_len=128, max_num_batched_tokens=64)


def test_bundled_model_outputs_match_their_grammars_without_compiling(stories):
    assert stories.engine.wait_until_compiled()
    compiled = stories.engine.stats().num_compilations
    prompts, params, kinds = batch("Once upon a time")
    outs = stories.generate(prompts, params, use_tqdm=False)
    check_outputs(outs, kinds)
    assert [len(o.outputs) for o in outs] == [1, 1, 1, 4]
    assert len({c.text for c in outs[3].outputs}) > 1          # four sequences of their own
    alone = stories.generate(prompts[:1], params[:1], use_tqdm=False)[0]
    assert outs[0].outputs[0].token_ids == alone.outputs[0].token_ids
    # Logprobs of a constrained choice: the sampled token is among the allowed ones, and
    # the top entries after the allowed continuations are -inf.
    lp = stories.generate(["Once"], SamplingParams(
        temperature=0, logprobs=5, max_tokens=4,
        structured_outputs=constrained(choice=["cat", "dog"])), use_tqdm=False)[0].outputs[0]
    assert lp.text in ("cat", "dog")
    assert all(d[t].rank == 1 for d, t in zip(lp.logprobs, lp.token_ids))
    assert any(np.isneginf(e.logprob) for e in lp.logprobs[-1].values())
    assert stories.engine.stats().num_compilations == compiled


def test_lark_grammar_and_json_object(stories):
    outs = stories.generate(["Lily", "Tom"], [
        SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(
            grammar='start: "The " ANIMAL " is " COLOR\nANIMAL: "cat" | "dog"\n'
                    'COLOR: "red" | "blue"')),
        # Any object (compact by default): the bundled model starts one long key.
        SamplingParams(temperature=0, max_tokens=6, structured_outputs=StructuredOutputsParams(
            json_object=True))], use_tqdm=False)
    assert re.fullmatch("The (cat|dog) is (red|blue)", outs[0].outputs[0].text)
    assert outs[0].outputs[0].finish_reason == "stop"
    assert re.fullmatch(r'\{\s*"[^"]*', outs[1].outputs[0].text), outs[1].outputs[0].text


def test_json_whitespace_is_compact_unless_flexible_is_asked_for(stories):
    # Issue 43: with whitespace flexible by default, 4 of 4 samples were '{ \n"age" \n\n\n'
    # until max_tokens. Compact (the default) they close their object and stop.
    schema = {"type": "object", "properties": {"age": {"type": "integer"},
                                               "name": {"type": "string", "maxLength": 8}},
              "required": ["age", "name"], "additionalProperties": False}
    outs = stories.generate(["Once upon a time"] * 2, [
        SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=40,
                       structured_outputs=StructuredOutputsParams(json=schema, **kw))
        for kw in ({}, {"disable_any_whitespace": False})], use_tqdm=False)
    compact, flexible = ([(c.text, c.finish_reason) for c in o.outputs] for o in outs)
    for text, finish in compact:
        value = json.loads(text)
        jsonschema.validate(value, schema)
        assert (text, finish) == (json.dumps(value, separators=(",", ":")), "stop")
    assert len({text for text, _ in compact}) == 4
    assert all(re.match(r'\{\s+"age"\s*\n\s*\n', t) and f == "length" for t, f in flexible), \
        flexible


PREEMPTION_KW = dict(enforce_eager=True, max_num_seqs=16, max_model_len=128, block_size=8)


def preemption_batch():
    prompt = "Once upon a time, there was a little girl named Lily. She liked to play"
    requests = [batch(prompt, seed) for seed in (0, 10)]
    return ([p for r in requests for p in r[0]], [p for r in requests for p in r[1]],
            [k for r in requests for k in r[2]])


def token_ids(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def tiny_kv_run():
    """The preemption batch on a pool too small for it: (engine, outputs)."""
    small = LLM(num_gpu_blocks_override=24, **PREEMPTION_KW)
    prompts, params, _ = preemption_batch()
    return small, small.generate(prompts, params, use_tqdm=False)


def test_grammars_survive_preemption_and_prefix_cache_hits(tiny_kv_run):
    """Sequences are preempted (recompute) and resume with their matcher as it was; a
    second run of the same batch hits the prefix cache and gives the same tokens."""
    small, outs = tiny_kv_run
    prompts, params, kinds = preemption_batch()
    assert small.engine.num_preemptions > 0
    check_outputs(outs, kinds)
    hits = small.engine.stats().prefix_cache_hits
    again = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.stats().prefix_cache_hits > hits
    check_outputs(again, kinds)
    assert token_ids(again) == token_ids(outs)


@pytest.mark.slow
def test_preempted_grammars_give_the_tokens_of_a_large_pool(tiny_kv_run):
    prompts, params, _ = preemption_batch()
    large = LLM(**PREEMPTION_KW).generate(prompts, params, use_tqdm=False)
    assert large and token_ids(large) == token_ids(tiny_kv_run[1])


def test_streamed_deltas_join_to_valid_json(stories):
    engine = stories.engine
    engine.add_request("s", "Once", SamplingParams(
        temperature=1.0, seed=3, n=4, max_tokens=48, output_kind=RequestOutputKind.DELTA,
        structured_outputs=constrained(json=SCHEMA)))
    texts = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                texts[c.index] = texts.get(c.index, "") + c.text
    assert sorted(texts) == [0, 1, 2, 3]
    for text in texts.values():
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.fixture(scope="module")
def qwen_random(tmp_path_factory):
    """A random-weight model with Qwen2's real tokenizer (151646 tokens; its vocabulary
    padded to 151680 logits: the tail must stay masked)."""
    d = write_qwen_random(tmp_path_factory.mktemp("qwen_random"), 151680)
    return LLM(model=d, load_format="dummy", enforce_eager=True, max_num_seqs=8,
               max_model_len=256)


def test_random_model_on_a_real_tokenizer_matches_its_grammars(qwen_random):
    prompts, params, kinds = batch("Give me a record:")
    outs = qwen_random.generate(prompts, params, use_tqdm=False)
    check_outputs(outs, kinds)
    alone = qwen_random.generate(prompts[:1], params[:1], use_tqdm=False)[0]
    assert outs[0].outputs[0].token_ids == alone.outputs[0].token_ids
    vocab = len(qwen_random.get_tokenizer())
    for o in outs[1:]:
        for c in o.outputs:        # no id of the padded tail, EOS last
            assert max(c.token_ids) < vocab
            assert c.token_ids[-1] in qwen_random.engine.output_processor.eos_token_ids


def test_a_slow_tokenizer_is_refused_at_add_request():
    from transformers import ByT5Tokenizer

    from jaxpaged.structured_output.manager import StructuredOutputManager

    manager = StructuredOutputManager(ByT5Tokenizer(), 384, frozenset({1}))
    with pytest.raises(SamplingParamsError, match="fast tokenizer"):
        manager.request(constrained(choice=CHOICES))


def test_a_step_with_a_constrained_sequence_is_finished_synchronously(stories):
    """Async scheduling keeps a free step in flight, never one with a grammar (its next
    mask needs the token)."""
    engine = stories.engine
    engine.add_request("free", "Once", SamplingParams(temperature=0, max_tokens=3))
    engine.step()
    assert engine._in_flight is not None
    engine.add_request("json", "Once", SamplingParams(
        temperature=0, max_tokens=3, structured_outputs=constrained(json=SCHEMA)))
    while engine.has_unfinished_requests():
        engine.step()
        grammar_running = any(r.structured_output_request for r in engine.scheduler.running)
        assert not (grammar_running and engine._in_flight is not None)


def test_a_grammar_that_fails_to_compile_ends_its_sequence_only(stories, monkeypatch):
    """A compilation that raises in the pool (e.g. a tokenizer llguidance cannot read) leaves
    the engine serving: that sequence may only emit EOS; its neighbour is untouched."""
    def broken(params):
        raise RuntimeError("no tokenizer for you")

    monkeypatch.setattr(stories.engine.structured_outputs, "_compile", broken)
    free = SamplingParams(temperature=0, max_tokens=5)
    outs = stories.generate(["Once", "Once"], [
        SamplingParams(temperature=0, max_tokens=5, structured_outputs=constrained(
            regex="q{7}")), free], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == [2] and outs[0].outputs[0].finish_reason == "stop"
    alone = stories.generate(["Once"], free, use_tqdm=False)[0]
    assert outs[1].outputs[0].token_ids == alone.outputs[0].token_ids


@pytest.mark.parametrize("opening, expected", [
    # (think block, body), (body alone), (no opening tag, then body), (an open block),
    # (blank space, then body: no block, so the constraint holds from the first token)
    ("inside", [True, False, True, False, False]),
    ("optional", [True, True, False, False, False]),
    ("untagged_reasoning", [True, False, True, False, False]),
])
def test_after_reasoning_puts_the_grammar_behind_the_think_block(opening, expected):
    import llguidance.hf
    from transformers import AutoTokenizer

    from jaxpaged.structured_output.grammar import after_reasoning, serialize

    tok = AutoTokenizer.from_pretrained(os.path.join(TOKENIZERS, "qwen2"))
    ll = llguidance.hf.from_tokenizer(tok)
    specs = {'{"a":1}': StructuredOutputsParams(json={"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"]}, disable_any_whitespace=True),
             "123-ab": StructuredOutputsParams(regex="[0-9]{3}-[a-z]{2}"),
             "a/b": StructuredOutputsParams(regex=r"a\/b"),     # an escaped slash stays one
             "no way": StructuredOutputsParams(choice=["yes", "no way"])}
    for body, params in specs.items():
        grammar = serialize(after_reasoning(params, "<think>", "</think>", opening))
        got = []
        for pieces in (["<think>\nhm, x</think>\n\n", body], [body], ["hm</think>", body],
                       ["<think>hm"], [" \n", body]):
            matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
            ids = [t for p in pieces for t in tok.encode(p, add_special_tokens=False)]
            got.append(all(matcher.consume_token(t) for t in ids) and matcher.is_accepting())
        assert got == expected, (body, opening)
        assert not all(llguidance.LLMatcher(ll, serialize(params), log_level=0).consume_token(t)
                       for t in tok.encode("hm</think>", add_special_tokens=False))
    grammar_kind = StructuredOutputsParams(grammar='start: "x"')
    assert after_reasoning(grammar_kind, "<think>", "</think>", "inside") is grammar_kind
    with pytest.raises(ValueError, match="opening"):
        after_reasoning(specs["123-ab"], "<think>", "</think>", "sometimes")
