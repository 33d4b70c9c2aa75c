"""One tokenizer per model while it is in use: a server's HTTP layer and its engine, loading
on two threads at start-up, get the same object; a dropped or changed one loads again."""

from __future__ import annotations

import gc
import os
import shutil
import threading
import weakref

from jaxpaged.tokenizer import load_tokenizer
from tests.conftest import STORIES


def test_two_threads_share_one_load():
    got = []
    threads = [threading.Thread(target=lambda: got.append(load_tokenizer(STORIES)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 2 and got[0] is got[1]
    assert got[0] is load_tokenizer(STORIES + "/")          # the same directory
    assert got[0].encode("Once upon a time") == [1, 403, 407, 261, 378]


def test_a_dropped_or_changed_tokenizer_loads_again(tmp_path):
    directory = str(tmp_path / "tok")
    shutil.copytree(STORIES, directory)
    first = weakref.ref(load_tokenizer(directory))
    gc.collect()
    assert first() is None                                   # the cache keeps none alive
    second = load_tokenizer(directory)
    assert second.encode("Once upon a time") == [1, 403, 407, 261, 378]
    os.utime(directory, ns=(0, 10**9))                       # the directory changed
    assert load_tokenizer(directory) is not second
