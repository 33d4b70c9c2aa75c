"""The thinking budget in the engine (issue 43, section 4): ``SamplingParams
.thinking_token_budget`` forces the end-of-think marker after N reasoning tokens, for
``LLM.generate`` as for the server; the tracker's counting rules on a toy vocabulary; the
field's validation.

The bundled model never writes ``</think>``: after a prompt that opens a think block it
"thinks" for ever, which is what a budget is for."""

from __future__ import annotations

import pytest

from jaxpaged import SamplingParams
from jaxpaged.core.thinking_budget import ThinkingBudget, ThinkMarkers, marker_ids
from jaxpaged.sampling_params import SamplingParamsError

#: A prompt that leaves a think block open (as a template that pre-fills ``<think>``).
THINKING = "Once upon a time<think>\n"


def end_ids(tokenizer) -> list[int]:
    """``</think>`` as the model writes it mid-output (no sentencepiece word-start piece)."""
    ids = tokenizer.encode("\n</think>", add_special_tokens=False)[2:]
    assert tokenizer.decode(ids) == "</think>" and len(ids) == 7
    return ids


def find(ids: list[int], sub: list[int]) -> int:
    return next((i for i in range(len(ids) - len(sub) + 1) if ids[i:i + len(sub)] == sub), -1)


def greedy(llm, prompt, max_tokens, **fields):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **fields)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


def test_generate_spends_exactly_the_budget_then_closes_the_block(stories_llm):
    end = end_ids(stories_llm.get_tokenizer())
    free = greedy(stories_llm, THINKING, 30)
    assert find(list(free.token_ids), end) < 0 and len(free.token_ids) == 30   # thinks on
    for n in (0, 5):
        thought = greedy(stories_llm, THINKING, n).text if n else ""
        out = greedy(stories_llm, THINKING, n + len(end) + 6, thinking_token_budget=n)
        ids = list(out.token_ids)
        assert ids[:n] == list(free.token_ids[:n])        # the model's own thought, N tokens
        assert ids[n:n + len(end)] == end                 # then the forced </think>
        assert find(ids[n + len(end):], end) < 0 and len(ids) == n + len(end) + 6
        reasoning, answer = out.text.split("</think>")
        assert reasoning == thought and answer             # then the answer follows
    # a prompt without a think block: the budget changes nothing (the model opens none)
    plain = greedy(stories_llm, "Once upon a time", 12)
    assert greedy(stories_llm, "Once upon a time", 12, thinking_token_budget=0).token_ids == \
        plain.token_ids


def test_each_parallel_sample_gets_its_own_budget(stories_llm):
    end = end_ids(stories_llm.get_tokenizer())
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=4 + len(end) + 3,
                            thinking_token_budget=4)
    outs = stories_llm.generate([THINKING], params, use_tqdm=False)[0].outputs
    assert len({tuple(o.token_ids[:4]) for o in outs}) > 1       # they do differ
    assert all(list(o.token_ids[4:4 + len(end)]) == end for o in outs)


def test_marker_ids_are_the_mid_output_tokens(stories_llm):
    tok = stories_llm.get_tokenizer()
    assert list(marker_ids(tok, "</think>")) == end_ids(tok)
    assert tok.decode(list(marker_ids(tok, "<think>"))) == "<think>"


# ---- the tracker's rules, on a toy vocabulary ----------------------------------------------

MARKERS = ThinkMarkers(start=(7, 8), end=(9, 10, 11))
PROMPT = [1, 2]


def run(budget: ThinkingBudget, output: list[int]) -> list[int | None]:
    """The forced token before each output token and after the last."""
    return [budget.forced(PROMPT + output[:i]) for i in range(len(output) + 1)]


def test_the_budget_counts_from_the_start_marker_and_forces_the_end_in_sequence():
    b = ThinkingBudget(2, MARKERS, len(PROMPT), inside=False)
    # free text, <think> (7 8), two thought tokens, the forced 9 10 11, then free again;
    # a block opened again after the budget is spent is closed at once
    out = [3, 7, 8, 4, 5, 9, 10, 11, 6, 7, 8, 9, 10, 11]
    assert run(b, out) == [None, None, None, None, None, 9, 10, 11, None, None, None, 9, 10,
                           11, None]
    assert b.num_reasoning_tokens == 2


def test_an_open_prompt_counts_from_the_first_token_and_the_model_may_close_itself():
    assert run(ThinkingBudget(0, MARKERS, len(PROMPT), inside=True), [9, 10, 11, 3]) == \
        [9, 10, 11, None, None]
    b = ThinkingBudget(5, MARKERS, len(PROMPT), inside=True)
    assert run(b, [3, 9, 10, 11, 4, 5, 6, 7]) == [None] * 9     # closed before the budget
    assert b.num_reasoning_tokens == 4                          # its own marker counted


def test_drafts_are_looked_ahead_without_changing_the_state():
    b = ThinkingBudget(2, MARKERS, len(PROMPT), inside=True)
    assert b.forced(PROMPT + [3]) is None
    assert b.forced(PROMPT + [3], drafts=[4]) == 9
    assert b.forced(PROMPT + [3], drafts=[4, 9, 10]) == 11
    assert b.forced(PROMPT + [3]) is None and b.num_reasoning_tokens == 1
    assert b.fork().forced(PROMPT) is None and b.fork().num_reasoning_tokens == 0


# ---- validation ----------------------------------------------------------------------------


@pytest.mark.parametrize("value", [-2, -100, 1.5, True, "3"])
def test_a_bad_budget_is_refused_naming_the_field(value):
    with pytest.raises(SamplingParamsError, match="thinking_token_budget") as e:
        SamplingParams(thinking_token_budget=value)
    assert e.value.param == "thinking_token_budget" and isinstance(e.value, ValueError)


def test_minus_one_is_no_limit():
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None
    assert SamplingParams(thinking_token_budget=0).thinking_token_budget == 0
    with pytest.raises(ValueError, match="budget must be >= 0"):
        ThinkingBudget(-1, MARKERS, 0, inside=False)
