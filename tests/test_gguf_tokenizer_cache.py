"""The GGUF tokenizer's cache (``jaxpaged.models.gguf_tokenizer``): a tokenizer built from the
cached ``tokenizer.json`` and arguments equals the one converted from the file's metadata: the
same ids for text, special tokens and chat prompts, the same decoded text, the same special
tokens and chat template."""

from __future__ import annotations

import os

from jaxpaged.models import gguf_tokenizer
from jaxpaged.runner import compile_cache
from tests.helpers.test_models import smollm2_gguf

TEXTS = ["What is the capital of France?", "  héllo\tworld\n\n123 4567 ✓ 🙂",
         "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x ** 2  # square", ""]


def test_cached_tokenizer_equals_the_converted_one(monkeypatch, tmp_path):
    monkeypatch.setenv(compile_cache.CACHE_ROOT_ENV, str(tmp_path))
    monkeypatch.delenv(compile_cache.DISABLE_ENV, raising=False)
    path = smollm2_gguf()
    converted = gguf_tokenizer.gguf_tokenizer(path)          # converts, then caches
    entries = sorted(os.listdir(tmp_path / "tokenizers"))
    assert len(entries) == 2 and entries[0].startswith("gguf-")
    assert entries[1] == entries[0].removesuffix(".json") + ".tokenizer.json"
    calls, convert = [], gguf_tokenizer._convert
    monkeypatch.setattr(gguf_tokenizer, "_convert", lambda *a: calls.append(a))
    cached = gguf_tokenizer.gguf_tokenizer(path)              # from the cache
    assert calls == [] and type(cached) is type(converted)
    for text in TEXTS:
        ids = converted.encode(text)
        assert cached.encode(text) == ids and (len(ids) >= 1 or not text)
        assert cached.decode(ids) == converted.decode(ids)
        assert cached.decode(ids, skip_special_tokens=True) == converted.decode(
            ids, skip_special_tokens=True)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[0]}]
    render = lambda tok: tok.apply_chat_template(chat, add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
    assert render(cached) == render(converted)
    assert cached.chat_template == converted.chat_template
    assert cached.all_special_tokens == converted.all_special_tokens
    assert (cached.bos_token_id, cached.eos_token_id, len(cached)) == (
        converted.bos_token_id, converted.eos_token_id, len(converted))
    assert cached.get_vocab() == converted.get_vocab()
    monkeypatch.setattr(gguf_tokenizer, "_convert", convert)   # cache off: built in memory
    monkeypatch.setenv(compile_cache.DISABLE_ENV, "1")
    in_memory = gguf_tokenizer.gguf_tokenizer(path)
    assert [in_memory.encode(t) for t in TEXTS] == [cached.encode(t) for t in TEXTS]
    assert render(in_memory) == render(cached)
    assert in_memory.all_special_tokens == cached.all_special_tokens


def test_cache_off_converts_every_time(monkeypatch, tmp_path):
    monkeypatch.setenv(compile_cache.CACHE_ROOT_ENV, str(tmp_path))
    monkeypatch.setenv(compile_cache.DISABLE_ENV, "1")
    gguf_tokenizer.gguf_tokenizer(smollm2_gguf())
    assert not os.path.exists(tmp_path / "tokenizers")


def test_a_cached_tokenizer_does_not_read_the_metadata_again(monkeypatch, tmp_path):
    """A start-up's tokenizer finds its cache entry by the metadata digest the config read
    left, even after the weights' loader dropped the opened file (forget_gguf_files)."""
    from jaxpaged import gguf_config
    monkeypatch.setenv(compile_cache.CACHE_ROOT_ENV, str(tmp_path))
    monkeypatch.delenv(compile_cache.DISABLE_ENV, raising=False)
    path = smollm2_gguf()
    first = gguf_tokenizer.gguf_tokenizer(path)               # converts and caches
    gguf_config.forget_gguf_files()
    reads, read = [], gguf_config.read_gguf
    monkeypatch.setattr(gguf_config, "read_gguf", lambda p: reads.append(p) or read(p))
    again = gguf_tokenizer.gguf_tokenizer(path)
    assert reads == [] and again.encode(TEXTS[1]) == first.encode(TEXTS[1])
    gguf_config._DIGESTS.clear()                   # a digest not known yet: the file is read
    gguf_tokenizer.gguf_tokenizer(path)
    assert reads == [os.path.realpath(path)]
