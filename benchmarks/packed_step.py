"""``python -m jaxpaged.benchmarks.packed_step GGUF``: a packed GGUF model's decode step on
this CPU, the kernel's two paths side by side (issue 40 items 1-2).

Three measurements, each printed as it finishes and all as one JSON line at the end:

* ``kernel_ms``: the model's packed projections alone, every decoder layer's four fused
  kernel calls (norm and q/k/v with RoPE, o and the residual, norm and gate/up/SiLU, down and
  the residual) and the LM head, one jitted function of ``M`` rows (best of ``--repeats``),
  with the kernel's int8 dot products allowed (``int8``) and with its float paths only
  (``float``; :func:`jaxpaged.layers.packed_linear.packed_projections`'s ``int8=False``),
  in the same process. The weights are the file's own.
* ``engine_ms_per_token``: ``LLM.chat`` of 1 and of 16 requests at once (the first questions
  of ``configs/workloads/chat.json``), 128 greedy tokens each, wall time over 128: one
  decode step with its host work, prefill included.
* ``step_ops``: the compiled decode step's XLA fusions and custom calls (its entry
  computation's instructions).

Run it alone: another process on a 2-core machine changes every figure.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import time

import numpy as np

from jaxpaged.benchmarks.datasets import ROOT
from jaxpaged.benchmarks.results import machine


def _best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def kernel_times(llm, rows: list[int], repeats: int) -> dict:
    """{path: {M: ms}} of the model's packed projections (module docstring)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jaxpaged.layers.packed_linear import packed_projections

    runner = llm.engine.runner
    model = nnx.merge(runner._graphdef, runner._state)
    layers = model.model.layers
    params = lambda p: (p.blocks[...], p.block_scale[...], p.block_min[...])
    embed = model.model.embed_tokens
    weights = [dict(qkv=[params(l.self_attn.q_proj), params(l.self_attn.k_proj),
                         params(l.self_attn.v_proj)], o=[params(l.self_attn.o_proj)],
                    gate_up=[params(l.mlp.gate_proj), params(l.mlp.up_proj)],
                    down=[params(l.mlp.down_proj)], norm1=l.input_layernorm.weight[...],
                    norm2=l.post_attention_layernorm.weight[...],
                    inv_freq=jnp.asarray(l.self_attn.inv_freq, jnp.float32),
                    heads=l.self_attn.num_heads * l.self_attn.head_dim) for l in layers]
    head = [params(embed if model.lm_head is None else model.lm_head)]

    def forward(x, positions, int8):
        for w in weights:
            q, k, v = packed_projections(x, w["qkv"], norm=w["norm1"], eps=1e-5, int8=int8,
                                         rope=(positions, w["inv_freq"]))
            (x,) = packed_projections(q[:, :w["heads"]], w["o"], residual=x, int8=int8)
            (h,) = packed_projections(x, w["gate_up"], gated=True, norm=w["norm2"], eps=1e-5,
                                      int8=int8)
            (x,) = packed_projections(h, w["down"], residual=x, int8=int8)
        return packed_projections(x, head, int8=int8)[0]

    rng = np.random.default_rng(0)
    width = weights[0]["norm1"].shape[0]
    out = {"int8": {}, "float": {}}
    for m in rows:
        x = jnp.asarray(rng.normal(size=(m, width)).astype(np.float32))
        positions = jnp.arange(m, dtype=jnp.int32) + 60
        for path, int8 in (("int8", True), ("float", False)):
            fn = jax.jit(forward, static_argnums=2)
            out[path][m] = round(_best_ms(
                lambda: jax.block_until_ready(fn(x, positions, int8)), repeats), 2)
        print(f"M={m}: int8 {out['int8'][m]} ms, float {out['float'][m]} ms", flush=True)
    return out


def engine_times(llm, users: list[int]) -> dict:
    """{n: ms a token} of ``LLM.chat`` of n requests of 128 greedy tokens."""
    from jaxpaged import SamplingParams
    with open(os.path.join(ROOT, "configs", "workloads", "chat.json")) as f:
        questions = json.load(f)["questions"]
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    out = {}
    for n in users:
        chats = [[{"role": "user", "content": q}] for q in questions[:n]]
        llm.chat(chats, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        t = time.perf_counter()
        llm.chat(chats, params, use_tqdm=False)
        out[n] = round((time.perf_counter() - t) / 128 * 1e3, 2)
        print(f"{n} users: {out[n]} ms a token ({n * 1e3 / out[n]:.1f} tok/s)", flush=True)
    return out


def step_ops(llm) -> dict:
    """XLA fusions and custom calls of the compiled 1-sequence decode step's entry."""
    runner = llm.engine.runner
    key = min((k for k in runner._executables if k[0] == "forward" and k[-1] is True),
              key=lambda k: k[1])
    text = runner._executables[key].as_text()
    ops = collections.Counter(re.findall(r"= \S+ (\w[\w-]*)\(", text[text.index("ENTRY"):]))
    return {"shape": list(key[1:]), "fusions": ops["fusion"],
            "custom_calls": ops["custom-call"]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a GGUF file whose projections stay packed")
    p.add_argument("--rows", default="1,2,4,8,16,64,128")
    p.add_argument("--users", default="1,16")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    from jaxpaged import LLM
    llm = LLM(model=args.model, max_num_seqs=16)
    llm.engine.wait_until_compiled()
    result = {"benchmark": "packed_step", "model": os.path.basename(args.model),
              "machine": machine(os.getloadavg()[0]),
              "kernel_ms": kernel_times(llm, [int(r) for r in args.rows.split(",")],
                                        args.repeats),
              "engine_ms_per_token": engine_times(llm, [int(u) for u in args.users.split(",")]),
              "step_ops": step_ops(llm)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
