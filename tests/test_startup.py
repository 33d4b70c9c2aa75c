"""Start-up: the on-disk compile cache, the precompiled step shapes, and no compilation
after start-up whatever features a request uses."""

import os

import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.runner import compile_cache
from jaxpaged.runner import buckets
from jaxpaged.runner.buckets import ShapeBuckets, bucket_sizes, padding_budget_tokens

LIMITS = dict(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32)


def test_cache_dir_default_override_and_off(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_cache.CACHE_ROOT_ENV, raising=False)
    monkeypatch.delenv(compile_cache.DISABLE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.resolve_cache_dir(None) == str(tmp_path / "xdg" / "jaxpaged"
                                                        / "compile_cache")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert compile_cache.resolve_cache_dir(None) == os.path.expanduser(
        "~/.cache/jaxpaged/compile_cache")
    monkeypatch.setenv(compile_cache.CACHE_ROOT_ENV, str(tmp_path / "root"))
    assert compile_cache.resolve_cache_dir(None) == str(tmp_path / "root" / "compile_cache")
    assert compile_cache.resolve_cache_dir(str(tmp_path / "mine")) == str(tmp_path / "mine")
    assert compile_cache.resolve_cache_dir("") is None
    monkeypatch.setenv(compile_cache.DISABLE_ENV, "1")
    assert compile_cache.resolve_cache_dir(str(tmp_path / "mine")) is None


def test_engine_fills_the_cache_and_a_second_engine_reuses_it(tmp_path):
    """Every precompiled step lands in the cache directory given (JAX's compile cache and
    the executable store); a second engine of the same configuration loads them all (the
    benchmark's start-up figures say so) and runs them; another configuration adds its own
    entries."""
    import jax

    from jaxpaged.benchmarks.throughput import start_engine
    from jaxpaged.arg_utils import EngineArgs

    cache = str(tmp_path / "cache")
    try:
        _, cold = start_engine(EngineArgs(compilation_cache_dir=cache, **LIMITS))
        # forward: decode B 8, mixed T 16 and 32 (B 8); for the row bucket 8 one sampler
        assert (cold["num_step_shapes"], cold["num_compiled"]) == (4, 4)
        assert compile_cache.num_step_entries(cache) == 4
        llm, warm = start_engine(EngineArgs(compilation_cache_dir=cache, **LIMITS))
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        eager = LLM(enforce_eager=True, compilation_cache_dir="", **LIMITS)
        prompts = [[1, 403, 407], [1] + list(range(300, 320))]
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] \
            == [o.outputs[0].token_ids for o in eager.generate(prompts, greedy, use_tqdm=False)]
        assert llm.engine.stats().num_compilations == 4
        assert (warm["num_compiled"], warm["num_loaded_from_cache"]) == (0, 4)
        assert warm["compile_cache_dir"] == cache
        # ... whole, from the executable store: nothing was lowered or compiled again.
        assert len(os.listdir(os.path.join(cache, "steps"))) == 4
        start_engine(EngineArgs(compilation_cache_dir=cache, dtype="bfloat16", **LIMITS))
        # Three new forward programs; the sampler, on float32 logits either way, is the same
        # program, which JAX's cache serves (and the store keeps only fresh compilations).
        assert compile_cache.num_step_entries(cache) == 7
        assert len(os.listdir(os.path.join(cache, "steps"))) == 7
    finally:    # back to the suite's cache for the tests that follow
        compile_cache.configure_compilation_cache(compile_cache.resolve_cache_dir(None))
    assert jax.config.jax_compilation_cache_dir == compile_cache.resolve_cache_dir(None)


def test_no_request_feature_compiles_after_start_up():
    """After ``LLM()`` returns, logprobs, prompt logprobs, every logit adjustment and n > 1
    run in the precompiled executables, with the features' effects visible."""
    llm = LLM(**LIMITS)
    engine = llm.engine
    assert engine.wait_until_compiled()
    compiled = engine.stats().num_compilations
    assert len(engine.runner.step_shapes()) == 3
    assert compiled == 4        # the three forward shapes and the sampler of rows 8
    prompt = [1, 403, 407, 261, 322]
    greedy = dict(temperature=0, max_tokens=6, ignore_eos=True)
    cases = {
        "logprobs": SamplingParams(logprobs=3, **greedy),
        "prompt_logprobs": SamplingParams(prompt_logprobs=2, **greedy),
        "logit_bias": SamplingParams(logit_bias={77: 100.0}, **greedy),
        "allowed": SamplingParams(allowed_token_ids=[40, 41], **greedy),
        "penalties": SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0,
                                    presence_penalty=1.0, **greedy),
        "bad_words_min_tokens": SamplingParams(bad_words=["the"], min_tokens=3, **greedy),
        "n": SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=6, ignore_eos=True),
    }
    outs = dict(zip(cases, llm.generate([prompt] * len(cases), list(cases.values()),
                                        use_tqdm=False)))
    assert engine.stats().num_compilations == compiled
    lp = outs["logprobs"].outputs[0]
    assert len(lp.logprobs) == 6 and all(len(d) >= 3 for d in lp.logprobs)
    # Greedy: the sampled token is the raw distribution's best (rank 1).
    assert all(d[t].rank == 1 for d, t in zip(lp.logprobs, lp.token_ids))
    plp = outs["prompt_logprobs"].prompt_logprobs
    assert plp[0] is None and len(plp) == len(prompt)
    assert all(prompt[i] in plp[i] for i in range(1, len(prompt)))
    assert outs["logit_bias"].outputs[0].token_ids == [77] * 6
    assert set(outs["allowed"].outputs[0].token_ids) <= {40, 41}
    assert len(outs["n"].outputs) == 3
    plain = llm.generate([prompt], SamplingParams(**greedy), use_tqdm=False)[0]
    assert outs["penalties"].outputs[0].token_ids != plain.outputs[0].token_ids
    assert engine.stats().num_compilations == compiled


def test_mixed_step_with_more_rows_than_its_token_bucket_reuses_a_precompiled_shape(
        monkeypatch):
    """n > 1 on a short prompt samples more rows than a 16-token step has sequences: the
    step takes a wider token bucket, one of the shapes the precompile makes (ladders of
    every power of two, as a large model has)."""
    monkeypatch.setattr(buckets, "PADDING_BUDGET_FLOPS", 0)
    llm = LLM(enforce_eager=True, max_num_seqs=32, max_model_len=64, max_num_batched_tokens=64)
    runner = llm.engine.runner
    assert runner._pad_sizes(10, 1, 20, 1, False) == (32, 32, 4)
    assert runner._pad_sizes(10, 1, 2, 1, False) == (16, 16, 4)
    outs = llm.generate([[1, 403, 407]], SamplingParams(n=20, seed=1, max_tokens=3),
                        use_tqdm=False)
    assert len(outs[0].outputs) == 20
    assert {key[1:] for key in runner._executables if key[0] == "forward"} \
        <= set(runner.step_shapes())


def test_page_buckets_follow_the_backend():
    """xla: one page bucket, the widest (its work follows the real lengths); pallas keeps
    one per power of two (its decode grid follows the page table's width)."""
    for backend, want in (("xla", [16]), ("pallas", [4, 8, 16])):
        llm = LLM(enforce_eager=True, attention_backend=backend, max_num_seqs=4,
                  max_model_len=256, max_num_batched_tokens=32)
        assert llm.engine.runner._page_buckets == want


def test_ladders_skip_buckets_only_where_padding_is_cheap():
    """The bundled model (0.26 M parameters) pads within the budget from the smallest bucket
    to the largest; W1's 110 M-parameter model keeps every power of two, and its token
    ladder the 1.5x steps from 1024 on."""
    bundled = LLM(enforce_eager=True).engine.runner
    assert bundled._buckets.seq_buckets == [8, 256]
    assert bundled._token_buckets == [16, 2048]
    assert bundled.step_shapes() == [(8, 8, 32, True), (16, 256, 32, False),
                                     (256, 256, 32, True), (2048, 256, 32, False)]
    assert padding_budget_tokens(110_000_000) == 9
    assert bucket_sizes(16, 2048, 9) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert bucket_sizes(16, 2048, 100) == [16, 64, 128, 256, 512, 1024, 2048]
    assert bucket_sizes(8, 100, 1000) == [8, 100]
    w1 = ShapeBuckets(max_num_tokens=2048, max_num_seqs=64, max_pages_per_seq=64,
                      page_buckets_by_width=False, max_padding=9)
    assert w1.token_buckets == [16, 32, 64, 128, 256, 512, 1024, 1536, 2048]
    assert w1.seq_buckets == [8, 16, 32, 64]
    assert w1.pad_sizes(1220, 58, 58, 12, False) == (1536, 64, 64)
    assert bucket_sizes(16, 8192, 9, 1024)[-6:] == [1536, 2048, 3072, 4096, 6144, 8192]


@pytest.mark.parametrize("tokens, seqs, pages", [(64, 32, 4), (16, 64, 8), (2048, 256, 32)])
@pytest.mark.parametrize("by_width", [False, True])
@pytest.mark.parametrize("max_padding", [0, 100])
def test_every_padded_shape_is_one_the_precompile_makes(tokens, seqs, pages, by_width,
                                                        max_padding):
    """Whatever a step holds (up to the limits), its padded shape is in ``step_shapes``,
    including mixed steps with up to ``max_num_seqs`` sampling rows when the widest token
    bucket is narrower than that (16 tokens, 64 sequences)."""
    b = ShapeBuckets(max_num_tokens=tokens, max_num_seqs=seqs, max_pages_per_seq=pages,
                     page_buckets_by_width=by_width, max_padding=max_padding)
    shapes = set(b.step_shapes())
    met = {(*b.pad_sizes(rows, rows, rows, p, True), True) for rows in range(1, seqs + 1)
           for p in range(1, pages + 1)}
    met |= {(*b.pad_sizes(t, 1, rows, p, False), False) for t in range(2, tokens + 1, 7)
            for rows in range(1, seqs + 1, 5) for p in (1, pages)}
    assert met <= shapes
    with pytest.raises(ValueError):
        b.pad_sizes(tokens + 1, 1, 1, 1, False)


def test_store_keeps_only_executables_compiled_afresh(tmp_path):
    """A step that JAX's persistent cache served is not stored (jax 0.12's XLA:CPU
    executables loaded from that cache serialize without their kernels, and fail when a
    later start-up runs them); one compiled afresh is, and loads back and runs."""
    import jax
    import jax.numpy as jnp

    from jaxpaged.runner.executable_store import ExecutableStore

    cache = str(tmp_path / "cache")
    store = ExecutableStore(str(tmp_path / "steps"))
    f = jax.jit(lambda x: jnp.sin(x) * 3.0 + x[::-1])
    x = jnp.arange(8, dtype=jnp.float32)
    try:
        compile_cache.configure_compilation_cache(cache)
        store.compile("fresh", lambda: f.lower(x))
        assert os.listdir(tmp_path / "steps") == ["fresh.pkl"]
        jax.clear_caches()    # (else the in-memory cache serves the same executable)
        served = store.compile("served", lambda: f.lower(x))    # a JAX cache hit now
        assert os.listdir(tmp_path / "steps") == ["fresh.pkl"]
        loaded = store.load("fresh", jax.devices()[:1])
        assert jnp.array_equal(loaded(x), f(x)) and jnp.array_equal(served(x), f(x))
    finally:
        compile_cache.configure_compilation_cache(compile_cache.resolve_cache_dir(None))



def test_fingerprint_covers_the_shape_of_every_argument():
    """A stored step is named by the shapes of all the arguments it was lowered for, not
    only the model's: two engines whose steps differ only in the previous step's sampled ids
    (padded to the largest row count, which follows ``max_num_seqs``) once shared an entry,
    and the second failed every step ("prev_tokens compiled with int32[8] and called with
    int32[16]")."""
    import numpy as np

    from jaxpaged.runner.executable_store import fingerprint, model_digest

    def name(*args):
        model = model_digest("graph", [np.zeros((4, 4), np.float32)])
        return fingerprint(model, [], args, ("step", 16))

    ids8, ids16 = np.zeros(8, np.int32), np.zeros(16, np.int32)
    assert name(ids8) == name(np.ones(8, np.int32))     # values do not matter
    assert len({name(ids8), name(ids16), name(ids8.astype(np.int64)), name(ids8, ids8)}) == 4


def test_engines_of_other_row_counts_do_not_share_stored_samplers(tmp_path):
    """The sampler pads its sampled ids to the engine's largest row count (16 at
    ``max_num_seqs=16``, 8 at 8), a constant no argument shows: an engine of 8 rows must
    not load the sampler stored by one of 16 (it then handed its forward, compiled for
    int32[8], an int32[16] buffer, and every step after failed)."""
    cache = str(tmp_path / "cache")
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    rows, tokens = [], []
    try:
        for n in (16, 8):
            llm = LLM(enforce_eager=True, compilation_cache_dir=cache, max_num_seqs=n,
                      max_model_len=64, max_num_batched_tokens=32, num_gpu_blocks_override=64)
            tokens.append(llm.generate([[1, 403, 407, 261]], greedy,
                                       use_tqdm=False)[0].outputs[0].token_ids)
            rows.append(llm.engine.runner._prev_tokens.shape)
    finally:
        compile_cache.configure_compilation_cache(compile_cache.resolve_cache_dir(None))
    assert rows == [(16,), (8,)]
    assert len(tokens[0]) == 4 and tokens[0] == tokens[1]


def test_server_start_up_compiles_a_short_requests_shapes_first():
    """``jaxpaged serve`` compiles the decode step of the smallest sequence bucket and the
    prompt step of 64 tokens before /health, the rest on a background thread, smallest
    first (``jaxpaged.runner.background_compile``)."""
    from jaxpaged.runner.background_compile import split_shapes
    from jaxpaged.runner.buckets import ShapeBuckets

    shapes = ShapeBuckets(max_num_tokens=2048, max_num_seqs=256, max_pages_per_seq=512,
                          page_buckets_by_width=False).step_shapes()
    first, rest = split_shapes(shapes)
    assert first == [(8, 8, 512, True), (64, 64, 512, False)]
    assert sorted(first + rest) == sorted(shapes) and not set(first) & set(rest)
    assert rest[0] == (16, 16, 512, True) and rest[-1][0] == 2048
    assert [s[0] for s in rest] == sorted(s[0] for s in rest)
    # pages by width (pallas): the widest page bucket, which holds every narrower one
    shapes = ShapeBuckets(max_num_tokens=32, max_num_seqs=8, max_pages_per_seq=16,
                          page_buckets_by_width=True).step_shapes()
    assert split_shapes(shapes)[0] == [(8, 8, 16, True), (32, 8, 16, False)]


def test_a_step_whose_shape_is_still_compiling_runs_in_a_wider_compiled_one():
    """While the background compilation has not reached a shape, a step of that shape runs
    in the smallest compiled shape that holds it (no compilation, the same tokens as its
    own program gives); a step no compiled shape holds compiles its own; once deferral ends
    every step takes its own shape again."""
    from jaxpaged.runner.background_compile import split_shapes

    llm = LLM(enforce_eager=True, compilation_cache_dir="", max_num_seqs=16, max_model_len=64,
              max_num_batched_tokens=32, num_gpu_blocks_override=64)
    runner = llm.engine.runner
    first, rest = split_shapes(runner.step_shapes())
    assert [s[:2] for s in first] == [(8, 8), (32, 16)]
    runner.precompile(shapes=first)
    runner.defer_shapes(rest)
    pages = first[0][2]
    assert runner.ready_pad_sizes(5, 1, 1, 1, False) == (32, 16, pages)    # not (16, 16)
    assert runner.ready_pad_sizes(3, 3, 3, 1, True) == (8, 8, pages)       # its own
    assert runner.ready_pad_sizes(12, 12, 12, 1, True) == (16, 16, pages)  # none holds it
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    before = runner.num_compilations
    wide = llm.generate([[1, 403, 407, 261]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert runner.num_compilations == before
    runner.defer_shapes([])
    assert runner.ready_pad_sizes(5, 1, 1, 1, False) == (16, 16, pages)
    own = llm.generate([[1, 403, 407, 261]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert runner.num_compilations > before and own == wide and len(own) == 6


def test_compile_plan_of_each_mode():
    """What compiles before the engine is handed out and in what order the background
    compiles the rest (``jaxpaged.runner.background_compile.compile_plan``)."""
    from jaxpaged.runner.background_compile import OFFLINE, SERVE, compile_plan, split_shapes

    shapes = ShapeBuckets(max_num_tokens=2048, max_num_seqs=256, max_pages_per_seq=512,
                          page_buckets_by_width=False).step_shapes()
    first, rest = split_shapes(shapes)
    assert compile_plan(shapes, None) == (shapes, [])
    # a server: the two forwards before /health, their samplers next, then everything else
    assert compile_plan(shapes, SERVE) == (first, [(first, False, True), (rest, True, True)])
    # LLM(): nothing before it returns
    assert compile_plan(shapes, OFFLINE) == (
        [], [(first, True, False), (first, False, True), (rest, True, True)])
    with pytest.raises(ValueError, match="unknown compile mode 'eager'"):
        compile_plan(shapes, "eager")


@pytest.fixture
def held_background(monkeypatch):
    """Background compilations that start only when the returned event is set."""
    import threading

    from jaxpaged.runner.background_compile import BackgroundCompile

    go = threading.Event()
    run = BackgroundCompile._run
    monkeypatch.setattr(BackgroundCompile, "_run",
                        lambda self, *a: go.wait(60) and run(self, *a))
    yield go
    go.set()


def test_llm_returns_before_its_steps_compile_and_a_step_compiles_its_own(held_background):
    """``LLM()`` hands the engine out with no step program compiled; a step whose program
    the background has not reached compiles it itself (never padded into another shape: the
    tokens equal an eager engine's), and once the background is let go every shape is
    ready (the three forward shapes and the sampler of rows 8)."""
    llm = LLM(**LIMITS)
    runner = llm.engine.runner
    assert runner.num_compilations == 0 and not llm.engine.wait_until_compiled(timeout=0)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[1, 403, 407, 261], [1] + list(range(300, 320))]
    ids = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    eager = LLM(enforce_eager=True, **LIMITS)
    assert ids == [o.outputs[0].token_ids for o in eager.generate(prompts, greedy,
                                                                  use_tqdm=False)]
    assert 0 < runner.num_compilations < 4      # only forwards: a greedy step never samples
    held_background.set()
    assert llm.engine.wait_until_compiled(timeout=120)
    assert runner.num_compilations == 4


def test_a_collected_engine_stops_its_background_compilation(held_background):
    """Dropping the last reference to an ``LLM`` stops its background compilation before
    the next shape (nothing is compiled for an engine nobody can use)."""
    import gc

    llm = LLM(**LIMITS)
    job, runner = llm.engine._background[0], llm.engine.runner
    del llm
    gc.collect()
    held_background.set()
    assert job.wait(timeout=60)
    assert runner.num_compilations == 0
