"""Plain generation needs none of the packages only some features use (issue 41: the lent
GPU image lacks them): with llguidance, gguf, pydantic, starlette and uvicorn blocked,
``LLM(...).generate`` of the bundled model gives the same tokens, and a grammar request says
which package it needs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from jaxpaged import LLM, SamplingParams

BLOCKED = ("llguidance", "gguf", "pydantic", "starlette", "uvicorn")

SCRIPT = f"""
import json, sys
for name in {BLOCKED!r}:
    sys.modules[name] = None        # import name -> ImportError
from jaxpaged import LLM, SamplingParams
from jaxpaged.sampling_params import SamplingParamsError, StructuredOutputsParams
llm = LLM(max_num_seqs=8, max_model_len=128)
out = llm.generate([[1, 403, 407]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                   use_tqdm=False)
try:       # (the input processor compiles a request's grammar: llguidance is needed then)
    llm.generate([[1, 403, 407]], SamplingParams(
        max_tokens=2, structured_outputs=StructuredOutputsParams(regex="[0-9]+")),
        use_tqdm=False)
    error = None
except SamplingParamsError as e:
    error = [e.param, str(e)]
print(json.dumps({{"tokens": list(out[0].outputs[0].token_ids), "error": error,
                  "loaded": sorted(m for m in {BLOCKED!r} if sys.modules.get(m) is not None)}}))
"""


def test_plain_generation_runs_without_the_optional_packages():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    want = LLM(max_num_seqs=8, max_model_len=128).generate(
        [[1, 403, 407]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].token_ids
    assert got["tokens"] == list(want) and len(want) == 6
    assert got["loaded"] == []
    assert got["error"][0] == "structured_outputs" and "llguidance" in got["error"][1]
