"""``python -m jaxpaged.benchmarks.step_profile``: where one W1 decode step and one W1 prefill
step spend their time on this machine, per phase, from a ``jax.profiler`` trace.

W1 (``configs/workloads/w1.json``): the stories110M-shaped float32 Llama with dummy weights
(``--load-format dummy``), batch 64, ``max_model_len`` 1024, page size 16, the ``xla``
attention backend. Two steps are built on the host the way the model runner pads them
(:mod:`jaxpaged.runner.model_runner`: token and sequence buckets, page-table bucket):

* ``decode``: the 64 W1 sequences half-way through their 128 output tokens (each at
  ``prompt_len + 64``), one token each (T = B = 64);
* ``prefill``: the first 2048-token step of W1 (whole prompts in order, the last one chunked,
  T = 2048, B = 64).

Each step is one jitted function shaped like the runner's step (forward, ``lm_head`` on the
sampling rows, :func:`jaxpaged.sampling.sampler.sample`, all greedy). It is timed (best and
median of ``--repeats`` calls) and traced; every XLA:CPU thunk's self time (its time minus
the thunks nested in it, e.g. a ``while`` loop's body; the least over ``--trace-steps``
steps) is attributed to a phase from the
source line of its HLO instruction (the compiled module's stack frames: ``q_proj``,
``gate_proj``, attention, KV write, ``lm_head``, sampling, ...). Thunks run on several
threads at once, so phase shares are of the summed thread time; the step's wall time is
printed beside them. Each matmul's achieved GFLOP/s is measured alone (one jitted ``x @ W``
of the step's shape) against a 4096 x 4096 float32 ``jnp.dot`` in the same process.

``--xla-flags A --xla-flags B ...`` compares flag sets instead: each set (the first being
``""``, the defaults, unless given) runs in its own process (XLA reads ``XLA_FLAGS`` once),
in the order base, A, B, base, A, B (``--rounds`` times), so every ratio is within one run.

Prints one JSON line with everything at the end.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import glob
import os
import re
import tempfile
import time

import numpy as np

from jaxpaged.benchmarks.datasets import ROOT, w1_requests
from jaxpaged.benchmarks.results import machine, write_outputs

PAGE_SIZE = 16
MAX_MODEL_LEN = 1024
MAX_NUM_SEQS = 64
MAX_TOKENS = 2048
#: (phase, regex on the source line or function) in match order; first match wins.
PHASES = [
    ("q/k/v_proj", r"self\.[qkv]_proj\(|qkv_proj"),
    ("o_proj", r"self\.o_proj\("),
    ("mlp (gate/up/down, silu)", r"gate_proj|up_proj|down_proj"),
    ("lm_head", r"compute_logits|lm_head"),
    ("sampling", r"sampler\.py"),
    ("kv write", r"write_kv"),
    ("attention", r"attention/"),
    ("rmsnorm", r"normalization\.py"),
    ("rope", r"rotary\.py"),
]


def w1_layout(kind: str):
    """The W1 ``decode`` or ``prefill`` step as a padded :class:`BatchLayout` (see the module
    docstring), with pages given to sequences in order."""
    from jaxpaged.layers.attention.base import BatchLayout
    reqs = w1_requests()
    p_pad = MAX_MODEL_LEN // PAGE_SIZE
    if kind == "decode":
        starts = [r.prompt_len + 63 for r in reqs]       # position of the token run now
        counts = [1] * len(reqs)
        t_pad = MAX_NUM_SEQS
    else:
        starts, counts, left = [], [], MAX_TOKENS
        for r in reqs:
            n = min(r.prompt_len, left)
            starts.append(0)
            counts.append(n)
            left -= n
            if not left:
                break
        t_pad = MAX_TOKENS
    b = len(counts)
    page_table = np.zeros((MAX_NUM_SEQS, p_pad), np.int32)
    seq_lens = np.zeros(MAX_NUM_SEQS, np.int32)
    qsl = np.zeros(MAX_NUM_SEQS + 1, np.int32)
    positions = np.zeros(t_pad, np.int32)
    slots = np.zeros(t_pad, np.int32)
    next_page = 1
    for i, (s, n) in enumerate(zip(starts, counts)):
        num_pages = -(-(s + n) // PAGE_SIZE)
        page_table[i, :num_pages] = np.arange(next_page, next_page + num_pages)
        next_page += num_pages
        seq_lens[i] = s + n
        qsl[i + 1] = qsl[i] + n
        pos = np.arange(s, s + n)
        positions[qsl[i]:qsl[i + 1]] = pos
        slots[qsl[i]:qsl[i + 1]] = page_table[i, pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
    qsl[b + 1:] = qsl[b]
    layout = BatchLayout(query_start_loc=qsl, seq_lens=seq_lens, positions=positions,
                         slot_mapping=slots, page_table=page_table, num_seqs=b,
                         num_tokens=int(qsl[b]))
    logits_indices = np.zeros(MAX_NUM_SEQS, np.int32)
    logits_indices[:b] = qsl[1:b + 1] - 1
    return layout, logits_indices, next_page


def build_step(kind: str, model_dir: str, compile_: bool = True, dtype: str = "float32",
               backend: str = "xla", cpu_matmuls: bool | None = None):
    """(compiled step, its argument tuple, [(name, m, k, n)] matmul shapes) for ``kind``,
    weights and KV pool in ``dtype`` (``--dtype``), attention by ``backend``
    (``--attention-backend``), few-row float32 projections by the C++ kernel when
    ``cpu_matmuls`` (None: as the runner decides, with the ``cpu`` backend); the step returns
    (token ids [64] int32, KV pool)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jaxpaged.config import ModelConfig
    from jaxpaged.layers import cpu_matmul
    from jaxpaged.layers.attention.base import allocate_kv_pool
    from jaxpaged.layers.attention.selection import get_attention_backend
    from jaxpaged.models.loader import load_model
    from jaxpaged.runner.input_batch import attention_metadata
    from jaxpaged.sampling.sampler import SamplingMetadata, sample

    cfg = ModelConfig.from_pretrained(model_dir)
    backend = get_attention_backend(backend)
    if cpu_matmuls is None:
        cpu_matmuls = cpu_matmul.wanted(backend.name, 1)
    model = load_model(model_dir, cfg, dtype=jnp.dtype(dtype), backend=backend,
                       load_format="dummy")
    graphdef, state = nnx.split(model)
    layout, logits_indices, num_pages = w1_layout(kind)
    kv = allocate_kv_pool(cfg.num_layers, num_pages, PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim,
                          jnp.dtype(dtype))

    def step(state, kv, input_ids, positions, metadata, logits_indices, sampling):
        m = nnx.merge(graphdef, state)
        with cpu_matmul.small_rows_matmuls(cpu_matmuls):
            hidden, kv = m(input_ids, positions, kv, metadata)
            logits = m.compute_logits(hidden[logits_indices])
        return sample(logits, sampling).token_ids, kv

    t = layout.positions.shape[0]
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, t).astype(np.int32)
    args = (ids, layout.positions, attention_metadata(backend, layout), logits_indices,
            SamplingMetadata.from_host([], MAX_NUM_SEQS))
    fn = jax.jit(step, donate_argnums=(1,)).lower(state, kv, *args)
    if compile_:
        fn = fn.compile()
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes = [("q_proj", t, h, cfg.num_heads * d), ("k_proj", t, h, cfg.num_kv_heads * d),
              ("v_proj", t, h, cfg.num_kv_heads * d), ("o_proj", t, cfg.num_heads * d, h),
              ("gate_proj", t, h, i), ("up_proj", t, h, i), ("down_proj", t, i, h),
              ("lm_head", MAX_NUM_SEQS, h, cfg.vocab_size)]
    return fn, state, kv, args, shapes, cfg


def best_time(f, repeats: int) -> tuple[float, float]:
    """(best, median) seconds of ``repeats`` calls of ``f`` (which blocks)."""
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return min(ts), float(np.median(ts))


def matmul_gflops(m: int, k: int, n: int, repeats: int) -> float:
    """Best achieved GFLOP/s of a jitted float32 [m, k] @ [k, n]."""
    import jax
    import jax.numpy as jnp
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((m, k), np.float32))
    w = jnp.asarray(rng.standard_normal((k, n), np.float32))
    f = jax.jit(jnp.dot)
    f(a, w).block_until_ready()
    best, _ = best_time(lambda: f(a, w).block_until_ready(), repeats)
    return 2 * m * k * n / best / 1e9


def _frames(hlo: str) -> dict[int, str]:
    """stack_frame_id -> 'file:function: source line' of the innermost frame in jaxpaged or
    this file's caller, from the compiled module's FileNames/FunctionNames/FileLocations/
    StackFrames tables."""
    def table(name):
        m = re.search(rf"^{name}\n((?:\d+ .*\n)+)", hlo, re.M)
        return {int(l.split(" ", 1)[0]): l.split(" ", 1)[1] for l in m.group(1).splitlines()}
    files = {k: v.strip('"') for k, v in table("FileNames").items()}
    funcs = {k: v.strip('"') for k, v in table("FunctionNames").items()}
    locs = {}
    for k, v in table("FileLocations").items():
        f = dict(re.findall(r"(\w+)=(\d+)", v))
        locs[k] = (files[int(f["file_name_id"])], funcs[int(f["function_name_id"])],
                   int(f["line"]))
    frames = {k: dict(re.findall(r"(\w+)=(\d+)", v)) for k, v in table("StackFrames").items()}
    out, lines = {}, {}
    for fid in frames:
        chain, cur = [], fid
        while cur and cur not in chain:
            chain.append(cur)
            # The text prints a frame's parent id plus one (0 + 1 = no parent).
            cur = int(frames[cur]["parent_frame_id"]) - 1
        texts = []
        for c in chain:
            path, func, line = locs[int(frames[c]["file_location_id"])]
            if path not in lines:
                try:
                    with open(path) as fh:
                        lines[path] = fh.read().splitlines()
                except OSError:
                    lines[path] = []
            src = lines[path][line - 1].strip() if line <= len(lines[path]) else ""
            texts.append(f"{path}:{func}: {src}")
        out[fid] = " | ".join(texts)
    return out


def instruction_phases(hlo: str) -> dict[str, str]:
    """HLO instruction name -> phase (see :data:`PHASES`; 'other' when none matches)."""
    frames = _frames(hlo)
    phases = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.-]+) = .*?stack_frame_id=(\d+)", hlo, re.M):
        stack = frames.get(int(m.group(2)), "")
        phase = "other"
        for name, pattern in PHASES:
            if re.search(pattern, stack):
                phase = name
                break
        if "while" in m.group(0).split("=", 1)[1][:200] and phase == "other":
            phase = "attention"
        phases[m.group(1)] = phase
    return phases


_CONTAINERS = ("ThunkExecutor::Execute",)
_WAIT = "ThunkExecutor::Execute (wait for completion)"
_SKIP = ("ThreadpoolListener", "end: ", "SlinkyThreadPool::Await", _WAIT)


def thunk_self_times(xplane: str, num_steps: int) -> dict[str, float]:
    """Self time (seconds) of every thunk name in one step, summed over all XLA threads, as
    the least over the traced steps (a step ends with its ``ThunkExecutor::Execute (wait
    for completion)``): on a shared machine a preempted thread inflates whichever thunk
    it was running, the least of several steps filters that out. Without such waits: the
    mean over ``num_steps`` steps."""
    from jax.profiler import ProfileData
    lines = [line for plane in ProfileData.from_file(xplane).planes for line in plane.lines
             if "XLA" in line.name]
    # A step ends with its wait, which spans the step when the caller thread runs no thunk.
    ends = sorted(e.start_ns + e.duration_ns for line in lines for e in line.events
                  if e.name == _WAIT)
    totals = collections.defaultdict(collections.Counter)     # step -> name -> seconds
    for line in lines:
        evs = sorted((e for e in line.events if not e.name.startswith(_SKIP)),
                     key=lambda e: (e.start_ns, -e.duration_ns))
        stack = []          # [name, end_ns, duration_ns, children_ns, step]

        def pop():
            name, _, dur, child, step = stack.pop()
            totals[step][name] += (dur - child) / 1e9
            if stack:
                stack[-1][3] += dur

        for e in evs:
            while stack and e.start_ns >= stack[-1][1]:
                pop()
            step = bisect.bisect_left(ends, e.start_ns)
            stack.append([e.name, e.start_ns + e.duration_ns, e.duration_ns, 0, step])
        while stack:
            pop()
    steps = [totals[i] for i in range(len(ends)) if totals[i]]
    if not steps:
        return {n: t / num_steps for n, t in sum(totals.values(), collections.Counter()).items()}
    names = set().union(*steps)
    return {n: min(t.get(n, 0.0) for t in steps) for n in names}


def profile_step(kind: str, model_dir: str, repeats: int, trace_steps: int,
                 dtype: str = "float32", backend: str = "xla") -> dict:
    """Time, trace and attribute one step of ``kind`` (see the module docstring) with the
    attention ``backend``."""
    import jax
    fn, state, kv, args, shapes, cfg = build_step(kind, model_dir, dtype=dtype, backend=backend)
    holder = {"kv": kv}

    def run():
        tok, holder["kv"] = fn(state, holder["kv"], *args)
        tok.block_until_ready()
        return tok

    run()
    best, median = best_time(run, repeats)
    phases = instruction_phases(fn.as_text())
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for _ in range(trace_steps):
            run()
        jax.profiler.stop_trace()
        xplane = sorted(glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True))[-1]
        selfs = thunk_self_times(xplane, trace_steps)
    by_phase = collections.Counter()
    for name, secs in selfs.items():
        phase = phases.get(name, "executor" if name.startswith(_CONTAINERS) else "other")
        by_phase[phase] += secs
    total = sum(by_phase.values())
    matmuls = {name: round(matmul_gflops(m, k, n, max(3, repeats // 2)), 1)
               for name, m, k, n in shapes}
    return {"kind": kind, "best_ms": best * 1e3, "median_ms": median * 1e3,
            "thread_ms": {k: round(v * 1e3, 2) for k, v in by_phase.most_common()},
            "thread_share": {k: round(v / total, 4) for k, v in by_phase.most_common()},
            "top_thunks_ms": {k: round(v * 1e3, 2) for k, v in
                              collections.Counter(selfs).most_common(12)},
            "matmul_gflops": matmuls}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.join(ROOT, "configs", "models", "stories110m-shape"))
    p.add_argument("--steps", nargs="+", default=["decode", "prefill"],
                   choices=["decode", "prefill"])
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--trace-steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weights and KV pool dtype of the profiled steps")
    p.add_argument("--attention-backend", default="xla", choices=["xla", "cpu"],
                   help="attention backend of the profiled steps")
    p.add_argument("--output-json", help="also write the result here")
    args = p.parse_args(argv)
    load_before = os.getloadavg()[0]
    result = {"xla_flags": os.environ.get("XLA_FLAGS", ""), "dtype": args.dtype,
              "attention_backend": args.attention_backend}
    for kind in args.steps:
        result[kind] = profile_step(kind, args.model, args.repeats, args.trace_steps,
                                    args.dtype, args.attention_backend)
    # After the steps, best of several: one slow call on a shared machine says nothing.
    result["peak_gflops"] = round(matmul_gflops(4096, 4096, 4096, 8), 1)
    result.update(machine(load_before))
    write_outputs(result, args.output_json)
    return result


if __name__ == "__main__":
    main()
