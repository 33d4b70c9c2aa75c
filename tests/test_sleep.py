"""sleep(level) / wake_up(tags) (issue 44): device memory freed and restored, same outputs,
no compilation; a level-2 wake without new weights is an error."""

import jax
import pytest

from jaxpaged import GenerationPausedError, WeightsNotLoadedError
from tests.helpers.rl import backend_compiles
from tests.test_pause_resume import PARAMS, add_all, dirs, run_to_end, w1  # noqa: F401
from tests.test_weight_update import PROMPTS, greedy, make_llm


def used(llm) -> int:
    return sum(llm.engine.device_memory_used().values())


#: Bytes of small per-step arrays (sampled ids, masks) that may come and go meanwhile.
SLACK = 1024


def held(arrays, devices) -> int:
    """Bytes on ``devices`` of the ``arrays`` still alive (other tests' engines allocate on
    the same host devices meanwhile: only the arrays live at a snapshot are counted)."""
    return sum(s.data.nbytes for a in arrays if not a.is_deleted()
               for s in a.addressable_shards if s.device in devices)


def test_level1_frees_and_restores_memory(dirs):
    llm = make_llm(dirs[0])
    ids = greedy(llm)[0]
    engine = llm.engine
    devices = set(engine.runner.devices)
    weights = engine.runner.weight_bytes
    pool = sum(k.nbytes + v.nbytes for k, v in engine.runner.kv_pool)
    snapshot, compiles = list(jax.live_arrays()), backend_compiles()
    awake = held(snapshot, devices)
    assert awake >= weights + pool
    llm.sleep(level=1)
    asleep = held(snapshot, devices)
    assert llm.is_sleeping() and asleep <= awake - weights - pool + SLACK
    with pytest.raises(GenerationPausedError):
        llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)
    llm.wake_up(tags=["kv_cache"])
    mine = lambda: [a for pair in engine.runner.kv_pool for a in pair] + \
        jax.tree.leaves(engine.runner.state[1])
    assert llm.is_sleeping() and held(mine(), devices) == pool
    llm.wake_up(tags=["weights"])
    assert not llm.is_sleeping()
    assert abs(asleep + held(mine(), devices) - awake) <= SLACK
    assert backend_compiles() == compiles
    assert greedy(llm) == (ids, {0})
    print(f"device bytes: awake {awake}, level-1 asleep {asleep}, weights {weights}, "
          f"KV pool {pool}; the engine's device_memory_used() now {used(llm)}")


def test_level2_needs_new_weights_before_waking(dirs, w1):
    fresh = greedy(make_llm(dirs[1]))[0]
    llm = make_llm(dirs[0])
    greedy(llm)
    devices, runner = set(llm.engine.runner.devices), llm.engine.runner
    weights = runner.weight_bytes
    pool = sum(k.nbytes + v.nbytes for k, v in runner.kv_pool)
    snapshot = list(jax.live_arrays())
    awake = held(snapshot, devices)
    llm.sleep(level=2)
    assert held(snapshot, devices) <= awake - weights - pool + SLACK
    with pytest.raises(WeightsNotLoadedError, match="lm_head.weight', 'model.embed_tokens"):
        llm.wake_up()
    assert llm.is_sleeping()
    llm.update_weights({n: w1[n] for n in w1 if n != "lm_head.weight"})
    with pytest.raises(WeightsNotLoadedError, match=r"\['lm_head.weight'\]"):
        llm.wake_up(tags=["weights"])
    assert llm.update_weights({"lm_head.weight": w1["lm_head.weight"]}) == 2
    llm.wake_up(tags=["weights"])
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    mine = [a for pair in runner.kv_pool for a in pair] + jax.tree.leaves(runner.state[1])
    assert held(mine, devices) == weights + pool
    assert greedy(llm) == (fresh, {2})


def test_update_while_asleep_at_level1_wins_over_the_host_copy(dirs, w1):
    fresh = greedy(make_llm(dirs[1]))[0]
    llm = make_llm(dirs[0])
    llm.sleep(1)
    llm.update_weights(w1)
    llm.wake_up()
    assert greedy(llm) == (fresh, {1})


def test_running_requests_sleep_and_finish_as_uninterrupted(dirs):
    llm = make_llm(dirs[0])
    ids = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    engine = llm.engine
    add_all(engine, PROMPTS)
    for _ in range(4):
        engine.step()
    engine.sleep(1)
    final = {o.request_id: o for o in engine.step() if o.finished}
    assert engine.is_frozen and engine.step() == []
    engine.wake_up()
    run_to_end(engine, final)
    assert [final[f"r{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == ids
    assert engine.kv_cache_manager.num_used_pages == 0


def test_bad_levels_and_tags(dirs):
    llm = make_llm(dirs[0])
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="unknown wake_up tags"):
        llm.wake_up(tags=["kv"])
    llm.sleep(1)
    with pytest.raises(RuntimeError, match="already asleep"):
        llm.sleep(2)
    llm.wake_up()
    assert not llm.is_sleeping()
