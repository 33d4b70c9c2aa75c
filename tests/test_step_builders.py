"""Each builder ``prepare_step`` composes (``jaxpaged.runner.step_builders``), alone, on small
hand-made steps whose arrays are worked out by hand."""

import numpy as np
import pytest

from jaxpaged.core.request import Request
from jaxpaged.core.scheduler_output import ScheduledRequest
from jaxpaged.runner import step_builders as sb
from jaxpaged.sampling_params import SamplingParams

PAGE = 4


def request(rid, prompt, params=None, seed=7, output=()):
    req = Request(rid, None, list(prompt), params or SamplingParams(max_tokens=8), seed, 8)
    req.all_token_ids += list(output)
    return req


def plan(seqs, pads=(8, 4, 4), verify_block_q=0):
    return sb.plan_step(seqs, lambda *_: pads, verify_block_q)


def test_token_layout_places_each_token_in_its_page_slot():
    a = ScheduledRequest(request("a", [10, 11, 12, 13, 14]), 0, 5, [3, 4], True, 1)
    b = ScheduledRequest(request("b", [20] * 6, output=[21]), 6, 1, [7, 8], True, 1)
    p = plan([a, b])
    assert (p.num_tokens, p.num_rows, p.t_pad, p.b_pad, p.r_pad) == (6, 2, 8, 4, 4)
    layout = sb.token_layout(p, PAGE, 0)
    assert layout.positions.tolist() == [0, 1, 2, 3, 4, 6, 0, 0]
    # a: page 3 holds positions 0-3, page 4 position 4; b: position 6 is slot 2 of page 8
    assert layout.slot_mapping.tolist() == [12, 13, 14, 15, 16, 34, 0, 0]
    assert layout.page_table.tolist() == [[3, 4, 0, 0], [7, 8, 0, 0], [0] * 4, [0] * 4]
    assert layout.seq_lens.tolist() == [5, 7, 0, 0]
    assert layout.query_start_loc.tolist() == [0, 5, 6, 6, 6]


def test_token_ids_take_unknown_tokens_from_the_previous_steps_rows():
    known = ScheduledRequest(request("k", [5, 6], output=[9]), 2, 1, [1], True, 1)
    unknown = ScheduledRequest(request("u", [7, 8]), 2, 1, [2], True, 1)   # token 2: in flight
    ids, prev = sb.token_ids(plan([known, unknown]), lambda: {"u": 3})
    assert ids.tolist()[:2] == [9, 0] and prev.tolist() == [-1, 3] + [-1] * 6
    with pytest.raises(RuntimeError, match="'u' decodes a token"):
        sb.token_ids(plan([known, unknown]), lambda: {})


def test_sampling_rows_of_a_parallel_prompt_and_a_speculating_decode():
    fork = ScheduledRequest(request("n", [1, 2, 3], SamplingParams(n=3, temperature=1.0),
                                    seed=100), 0, 3, [1], True, 3)
    spec = ScheduledRequest(request("s", [4, 5], output=[6], seed=200), 2, 3, [2], True, 1,
                            [7, 8])
    p = plan([fork, spec], pads=(8, 8, 4), verify_block_q=4)
    assert p.rows.tolist() == [3, 3] and p.cu_rows.tolist() == [0, 3, 6] and not p.verify
    indices, sampling = sb.sampling_rows(p)
    # the fork's 3 rows read its last token (2); the decode's rows its tokens 3, 4, 5
    assert indices.tolist()[:6] == [2, 2, 2, 3, 4, 5]
    assert np.asarray(sampling.seed_lo)[:6].tolist() == [100, 101, 102, 200, 200, 200]
    assert np.asarray(sampling.position)[:6].tolist() == [3, 3, 3, 3, 4, 5]
    assert sb.verify_rows(p).tolist()[:6] == [-1, -1, -1, 7, 8, -1]
    assert sb.verify_rows(plan([fork])) is None


def test_logit_adjustments_only_for_rows_that_need_them():
    plain = ScheduledRequest(request("p", [1, 2]), 0, 2, [1], True, 1)
    assert not np.asarray(sb.logit_adjustments(plan([plain]), frozenset({2}), 4)
                          .has_allowed).any()
    biased = ScheduledRequest(request("b", [1, 2], SamplingParams(logit_bias={5: -3.0})),
                              0, 2, [2], True, 1)
    adjust = sb.logit_adjustments(plan([plain, biased]), frozenset({2}), 4)
    ids, pre = np.asarray(adjust.ids), np.asarray(adjust.pre)
    assert 5 not in ids[0].tolist()
    assert pre[1][ids[1].tolist().index(5)] == -3.0


def test_prompt_targets_are_the_next_prompt_tokens_when_asked():
    scored = ScheduledRequest(request("p", [1, 2, 3, 4], SamplingParams(prompt_logprobs=1)),
                              0, 2, [1], False, 0)
    assert sb.prompt_targets(plan([scored])).tolist() == [2, 3] + [0] * 6
    plain = ScheduledRequest(request("q", [1, 2, 3, 4]), 0, 2, [1], False, 0)
    assert sb.prompt_targets(plan([plain])).tolist() == [0] * 8


def test_grammar_masks_fall_back_to_the_free_mask():
    seq = ScheduledRequest(request("p", [1, 2]), 0, 2, [1], True, 1)
    assert sb.grammar_masks(plan([seq]), 16, lambda rows: ("free", rows)) == ("free", 4)
