"""docs/rl.md's GRPO example runs as written: each step samples from the version the
previous step's update made, the policy's logprobs equal jaxpaged's within 1e-5, and the
mean reward rises."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = (Path(__file__).resolve().parent.parent / "docs" / "rl.md").read_text()


@pytest.mark.slow      # ~30 s on 2 shared CPU cores: a second JAX process, 6 train steps
def test_grpo_example_runs_and_improves():
    code = re.search(r"## A GRPO example.*?```python\n(.*?)```", DOC, re.S).group(1)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = re.findall(r"step (\d): mean reward ([\d.]+)  \|logprob gap\| ([\d.e+-]+)  "
                      r"now serving version (\d+)", done.stdout)
    assert [(int(s), int(v)) for s, _, _, v in rows] == [(i, i + 1) for i in range(6)]
    assert all(float(g) < 1e-5 for _, _, g, _ in rows)
    assert float(rows[-1][1]) > float(rows[0][1]) + 0.1
