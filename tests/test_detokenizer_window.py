"""The windowed (fast-tokenizer) incremental detokenizer against whole-output decodes.

The reference is the rule the detokenizer documents, computed with ``tokenizer.decode`` on
everything generated so far: after each token, the text is the decode of (prompt context +
generated ids up to any open byte-fallback run, which skipped special tokens do not close)
after the context's own decode, trailing U+FFFD held back; after ``flush``, exactly the whole
decode.
"""

import os

import numpy as np
import pytest
from transformers import AutoTokenizer, ByT5Tokenizer

from jaxpaged.core.detokenizer import (INITIAL_OFFSET, IncrementalDetokenizer,
                                         byte_fallback_ids, fast_backend, special_ids)
from tests.conftest import LLAMA2_TOKENIZER, STORIES, TOKENIZERS

PATHS = [STORIES, LLAMA2_TOKENIZER] + [os.path.join(TOKENIZERS, n)
                                       for n in ("mistral", "gpt2", "qwen2")]
STORY = ("Once upon a time, there was a little girl named Lily. She liked to play outside "
         "in the sun with her dog, and every day they ran to the big tree by the river.")
TEXT = "汉字 🤗 café. It works — naïve  spaces\tand\nlines 日本語 Ünïcödé ✓ 😀😀"
_tokenizers: dict[str, object] = {}


def _load(path):
    if path not in _tokenizers:
        _tokenizers[path] = AutoTokenizer.from_pretrained(path)
    return _tokenizers[path]


def reference_texts(tok, prompt, ids, **kw):
    """``text`` after each of ``ids`` and after ``flush``, from whole-output decodes."""
    context = prompt[-INITIAL_OFFSET:]
    context_text = tok.decode(context, **kw)

    def text_of(out):
        full = tok.decode(context + out, **kw)
        return full[len(context_text):] if full.startswith(context_text) else tok.decode(out, **kw)

    byte_ids = byte_fallback_ids(tok)
    open_run = byte_ids | special_ids(tok) if kw["skip_special_tokens"] and byte_ids else byte_ids
    closed, text, texts = 0, "", []
    for k, t in enumerate(ids):
        closed = closed if t in open_run else k + 1
        stable = text_of(ids[:closed]).rstrip("\ufffd")
        text += stable[len(text):]
        texts.append(text)
    return texts, text + text_of(ids)[len(text):]


def cases(tok, rng):
    """(prompt, generated ids) pairs: uniform random ids (specials and byte pieces
    included), runs of byte-fallback pieces, multi-byte text split across tokens, special
    tokens in text, and prompts that are empty, BOS only, text, or end in a byte piece; and
    prompts that end inside a character or byte run the output then continues."""
    vocab = len(tok)
    byte_ids = sorted(byte_fallback_ids(tok))
    special = sorted(set(tok.all_special_ids))
    text_ids = tok.encode(TEXT, add_special_tokens=False)
    prompts = [[], special[:1], tok.encode("Prompt:"), rng.integers(0, vocab, 7).tolist()]
    if byte_ids:
        prompts.append(tok.encode("Prompt:") + [byte_ids[0xE4]])
    out = []
    for i in range(12):
        ids = rng.integers(0, vocab, 60).tolist()
        if i % 3 == 1 and byte_ids:
            ids = [int(rng.choice(byte_ids)) if rng.random() < 0.6 else t for t in ids]
        if i % 3 == 2:
            ids = text_ids + [int(rng.choice(special))] + text_ids[::2] + ids[:20]
        ids[rng.integers(0, len(ids))] = int(rng.choice(special))
        out.append((prompts[i % len(prompts)], ids))
    splits = [k for k in range(1, len(text_ids)) if text_ids[k - 1] in byte_ids
              or tok.decode(text_ids[:k]).endswith("\ufffd")]
    assert len(splits) >= 2
    for k in sorted(set(splits[:3] + splits[-2:])):
        out.append((tok.encode("Prompt:") + text_ids[:k],
                    text_ids[k:] + rng.integers(0, vocab, 20).tolist()))
    return out


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("spaces", [True, False])
def test_every_prefix_equals_whole_output_decode(path, skip, spaces):
    tok = _load(path)
    assert fast_backend(tok) is not None       # these all take the windowed path
    rng = np.random.default_rng([len(tok), skip, spaces])
    for prompt, ids in cases(tok, rng):
        kw = dict(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
        texts, final = reference_texts(tok, prompt, ids, **kw)
        detok = IncrementalDetokenizer(tok, prompt, skip, spaces_between_special_tokens=spaces)
        for k, t in enumerate(ids):
            detok.add_token(t)
            assert detok.text == texts[k], (prompt, ids[:k + 1])
        detok.flush()
        assert detok.text == final
        context = prompt[-INITIAL_OFFSET:]
        whole = tok.decode(context + ids, **kw)
        context_text = tok.decode(context, **kw)
        if whole.startswith(context_text):
            assert final == whole[len(context_text):]


@pytest.mark.parametrize("path", PATHS)
def test_window_stays_short_over_a_long_output(path, monkeypatch):
    tok = _load(path)
    ids = (tok.encode(TEXT * 40, add_special_tokens=False) * 2)[:2000]
    sizes = []
    decode = IncrementalDetokenizer._decode
    monkeypatch.setattr(IncrementalDetokenizer, "_decode",
                        lambda self, window: sizes.append(len(window)) or decode(self, window))
    prompt = tok.encode("Prompt:")
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True)
    detok._pair_texts.clear()
    for t in ids:
        detok.add_token(t)
    # sizes[0] is the context; a window holds a byte-fallback run (8 pieces for two emoji)
    # and the few tokens before it, however long the output grows.
    assert max(sizes[1:]) <= 24
    # At most one decode per token (the window; the lone decode of the token it then
    # starts at is cached per tokenizer, and so is a two-id window): 1.05-1.22 per token
    # here without the pair cache (1.5-1.9 when it decoded both).
    assert len(sizes) <= 1.3 * len(ids)
    detok.flush()
    whole, context_text = (tok.decode(x, skip_special_tokens=True) for x in (prompt + ids, prompt))
    assert detok.text == whole[len(context_text):]


@pytest.mark.parametrize("path", [STORIES, os.path.join(TOKENIZERS, "gpt2")])
def test_pair_cache_decodes_each_two_id_window_once(path, monkeypatch):
    """Plain text decodes mostly through two-id windows (the token before and the new one),
    each looked up in the tokenizer's pair cache first: a text's second copy costs almost
    no backend decode, and the text is the whole decode's, cache or not."""
    tok = _load(path)
    ids = tok.encode(STORY, add_special_tokens=False)
    decodes = []
    decode = IncrementalDetokenizer._decode
    monkeypatch.setattr(IncrementalDetokenizer, "_decode",
                        lambda self, window: decodes.append(len(window)) or decode(self, window))
    prompt = tok.encode("Prompt:")
    texts = []
    for _ in range(2):
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True)
        if not texts:
            detok._pair_texts.clear()
        before = len(decodes)
        for t in ids:
            detok.add_token(t)
        detok.flush()
        texts.append((detok.text, len(decodes) - before))
    (first, first_decodes), (second, second_decodes) = texts
    whole, context_text = (tok.decode(x, skip_special_tokens=True) for x in (prompt + ids, prompt))
    assert first == second == whole[len(context_text):]
    assert first_decodes > 0.5 * len(ids) and second_decodes <= 0.1 * len(ids)
    assert decodes.count(2) >= 0.3 * len(ids)     # (the first copy's pair windows)


def test_slow_tokenizer_decodes_the_whole_output():
    tok = ByT5Tokenizer()             # a Python tokenizer: no tokenizers backend
    assert fast_backend(tok) is None
    ids = tok.encode(TEXT, add_special_tokens=False)
    ids = ids[:9] + [1, 2, 0] + ids[9:]      # </s> <unk> <pad> between characters
    for skip in (True, False):
        for spaces in (True, False):
            kw = dict(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
            texts, final = reference_texts(tok, [], ids, **kw)
            detok = IncrementalDetokenizer(tok, [], skip, spaces_between_special_tokens=spaces)
            for k, t in enumerate(ids):
                detok.add_token(t)
                assert detok.text == texts[k]
            detok.flush()
            assert detok.text == final == tok.decode(ids, **kw)


def test_stop_string_across_tokens_on_byte_level_bpe():
    tok = _load(os.path.join(TOKENIZERS, "gpt2"))
    ids = tok.encode("Caf\u00e9 cr\u00e8me, then caf\u00e9 again", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], True, stop=("\u00e8me, th",))
    matched = None
    for t in ids:
        matched = matched or detok.add_token(t)
    assert (matched, detok.text) == ("\u00e8me, th", "Caf\u00e9 cr")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_match_where_the_whole_decode_first_holds_them(path, include):
    tok = _load(path)
    rng = np.random.default_rng([len(tok), include, 7])
    for prompt, ids in cases(tok, rng):
        texts, final = reference_texts(tok, prompt, ids, skip_special_tokens=True)
        stops = []
        for n in (3, 1):     # two substrings of the text, 1-4 characters long
            i = int(rng.integers(0, max(len(final) - n, 1)))
            stops.append(final[i:i + n + int(rng.integers(0, 2))] or "x")
        hit = next(((k, t) for k, t in enumerate(texts) if any(s in t for s in stops)), None)
        detok = IncrementalDetokenizer(tok, prompt, True, stop=tuple(stops),
                                       include_stop_str_in_output=include)
        matched = None
        for t in ids[:hit[0] + 1] if hit else ids:
            assert matched is None
            matched = detok.add_token(t)
        if hit is None:
            assert matched is None and detok.text == texts[-1]
            continue
        k, text = hit
        i, s = min((text.find(s), j, s) for j, s in enumerate(stops) if s in text)[::2]
        assert matched == s
        assert detok.text == text[:i + len(s) if include else i]
        assert detok.visible_text(finished=True) == detok.text


def test_token_tables_are_per_tokenizer_and_keep_none_alive():
    """The byte-fallback and special-id tables go with their tokenizer object: they do not
    keep it alive, and another tokenizer (a new object, perhaps at a reused ``id``) gets its
    own."""
    import gc
    import weakref

    llama = AutoTokenizer.from_pretrained(LLAMA2_TOKENIZER)
    assert len(byte_fallback_ids(llama)) == 256              # <0x00> .. <0xFF>
    assert special_ids(llama) == {0, 1, 2}                   # <unk>, <s>, </s>
    detok = IncrementalDetokenizer(llama, [1], skip_special_tokens=True)
    detok.add_token(llama.convert_tokens_to_ids("<0x41>"))
    assert detok.text == ""          # a byte piece: held back until its run closes
    detok.flush()
    assert detok.text == "A"
    alive = weakref.ref(llama)
    del llama, detok
    gc.collect()
    assert alive() is None
    for _ in range(3):      # new objects, which may reuse a dead one's id
        gpt2 = AutoTokenizer.from_pretrained(os.path.join(TOKENIZERS, "gpt2"))
        assert byte_fallback_ids(gpt2) == frozenset()        # byte-level BPE: no <0xNN>
        assert special_ids(gpt2) == {gpt2.eos_token_id}       # <|endoftext|> only
        del gpt2
        gc.collect()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("skip", [True, False])
def test_ids_added_at_once_read_as_added_one_by_one(path, skip):
    # add_tokens (final-only outputs render at the end) against add_token for each, after a
    # prefix added one by one (min_tokens / a stop token's text before the rest), with and
    # without the final flush (an abort does not flush).
    tok = _load(path)
    rng = np.random.default_rng([len(tok), skip, 7])
    for prompt, ids in cases(tok, rng):
        for head in (0, 5):
            for final in (True, False):
                texts, flushed = reference_texts(tok, prompt, ids,
                                                 skip_special_tokens=skip,
                                                 spaces_between_special_tokens=True)
                detok = IncrementalDetokenizer(tok, prompt, skip)
                for t in ids[:head]:
                    detok.add_token(t)
                detok.add_tokens(ids[head:], final=final)
                assert detok.text == (flushed if final else texts[-1]), (prompt, ids, head)
