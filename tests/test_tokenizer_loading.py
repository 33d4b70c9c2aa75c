"""Loading tokenizers: one per model while it is in use (a server's HTTP layer and its engine,
loading on two threads at start-up, get the same object; a dropped or changed one loads
again), and without transformers' notice about PyTorch."""

from __future__ import annotations

import gc
import os
import shutil
import threading
import weakref

import pytest

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


def test_no_pytorch_notice_when_jaxpaged_loads_transformers():
    """transformers' "PyTorch was not found" notice (jaxpaged never needs torch) is not
    printed when jaxpaged loads a tokenizer; importing transformers alone still prints it."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is installed here: transformers prints no notice to drop")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSFORMERS_")}
    run = lambda code: subprocess.run([sys.executable, "-c", code], env=env, text=True,
                                      capture_output=True, timeout=300, check=True).stderr
    assert "PyTorch was not found" in run("import transformers")
    stderr = run("from jaxpaged.tokenizer import load_tokenizer; import sys; "
                 f"print(load_tokenizer({STORIES!r}).encode('Once upon a time'))")
    assert "PyTorch was not found" not in stderr
