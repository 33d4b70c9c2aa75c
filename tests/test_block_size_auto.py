"""``--block-size auto``: the choice logic, the shipped table, and ``auto`` through LLM, the
CLI and ``jaxpaged bench block-size``."""

import json
import logging

import jax
import numpy as np
import pytest

from jaxpaged import LLM
from jaxpaged.cli import build_parser
from jaxpaged.arg_utils import EngineArgs
from jaxpaged.runner.page_size import (CANDIDATES, DEFAULT_PAGE_SIZE, choose_page_size,
                                       find_entry, load_table)

TIMES = {"16": 1.0, "32": 0.8, "64": 0.78, "128": 0.77}


def entry(**kw):
    e = {"platform": "cpu", "device_kind": "cpu", "backend": "cpu", "dtype": "float32",
         "head_dim": 64, "ms": TIMES}
    return {**e, **kw}


def choose(max_model_len, entries, **kw):
    args = dict(platform="cpu", device_kind="cpu", backend="cpu", head_dim=64,
                dtype="float32", max_model_len=max_model_len, entries=entries)
    return choose_page_size(**{**args, **kw})


@pytest.mark.parametrize("max_model_len, expected", [(128, 32), (1024, 32), (4096, 64),
                                                     (1 << 16, 128)])
def test_choice_weighs_step_time_against_internal_waste(max_model_len, expected):
    choice = choose(max_model_len, [entry()])
    assert choice.page_size == expected
    best = min(TIMES.values())
    assert choice.scores == pytest.approx(
        {int(p): t / best * (1 + int(p) / max_model_len) for p, t in TIMES.items()})
    assert f"(1 + {expected}/{max_model_len})" in choice.reason


def test_reason_says_when_the_entry_is_for_another_head_dim():
    assert "nearest" not in choose(1024, [entry()]).reason
    reason = choose(1024, [entry()], head_dim=8).reason
    assert "head_dim 64, the nearest measured to this model's head_dim 8" in reason


def test_pages_longer_than_max_model_len_are_not_considered():
    choice = choose(40, [entry(ms={"16": 1.0, "32": 0.9, "64": 0.1, "128": 0.1})])
    assert set(choice.scores) == {16, 32} and choice.page_size == 16


def test_no_entry_keeps_the_default_and_says_why():
    choice = choose(1024, [entry(backend="xla")])
    assert choice.page_size == DEFAULT_PAGE_SIZE == 16 and choice.scores == {}
    assert choice.reason.startswith("no tuning entry for cpu attention on cpu")


def test_entry_lookup_prefers_the_device_kind_then_the_closest_head_dim():
    h200 = entry(platform="gpu", device_kind="NVIDIA H200", backend="pallas", head_dim=128)
    h100 = entry(platform="gpu", device_kind="NVIDIA H100", backend="pallas", head_dim=128)
    small = entry(platform="gpu", device_kind="NVIDIA H100", backend="pallas", head_dim=64)
    kw = dict(platform="gpu", backend="pallas", dtype="float32")
    assert find_entry([h100, h200], device_kind="NVIDIA H200", head_dim=128, **kw) is h200
    assert find_entry([h100, small], device_kind="NVIDIA H200", head_dim=96, **kw) is small
    assert find_entry([h100, small], device_kind="NVIDIA H100", head_dim=120, **kw) is h100
    assert find_entry([h100], device_kind="NVIDIA H100", head_dim=128, platform="gpu",
                      backend="pallas", dtype="bfloat16") is None


def test_shipped_table_has_cpu_entries_for_every_candidate():
    entries = [e for e in load_table() if e["platform"] == "cpu" and e["backend"] == "cpu"]
    assert {e["head_dim"] for e in entries} >= {64, 128}
    for e in entries:
        assert sorted(map(int, e["ms"])) == list(CANDIDATES)
        assert all(v > 0 for v in e["ms"].values())
        assert e["ms"] == {p: pytest.approx(sum(c[p] for c in e["ms_by_case"].values()),
                                            abs=1e-3) for p in e["ms"]}


def test_auto_flows_through_llm_and_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="jaxpaged.runner.worker"):
        llm = LLM(block_size="auto", max_model_len=128, enforce_eager=True)
    engine = llm.engine
    device = jax.devices()[0]
    cfg = engine.model_config
    expected = choose_page_size(platform=device.platform, device_kind=device.device_kind,
                                backend=engine.runner.backend.name, head_dim=cfg.head_dim,
                                dtype=np.dtype(engine.kv_cache_dtype).name,
                                max_model_len=128)
    assert engine.kv_cache_manager.page_size == expected.page_size
    assert engine.runner._page_size == expected.page_size
    assert engine.runner._kv_caches[0][0].shape[1] == expected.page_size
    assert f"block_size auto: {expected.page_size} tokens per page" in caplog.text
    out = llm.generate([[1, 403, 407]], None, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) > 0


def test_cli_takes_auto_for_generate_and_serve():
    for command in (["generate", "--block-size", "auto", "x"], ["serve", "--block-size", "auto"]):
        args = build_parser().parse_args(command)
        assert EngineArgs.from_cli_args(args).block_size == "auto"
    assert build_parser().parse_args(["serve", "--block-size", "32"]).block_size == 32
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--block-size", "big"])
    with pytest.raises(ValueError, match="block_size must be a positive integer or 'auto', "
                                         "got 'big'"):
        EngineArgs(block_size="big")


def test_bench_block_size_small(tmp_path, capsys):
    from jaxpaged.cli import main
    out = tmp_path / "bs.json"
    assert main(["bench", "block-size", "--small", "--rounds", "2", "--sizes", "16,auto",
                 "--kv-cache-memory-bytes", str(8 << 20), "--cost-per-hour", "3.6",
                 "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["block_size"]: r for r in result["rows"]}
    assert set(rows) == {16, "auto"} and rows[16]["ratio_to_best_fixed"] == 1.0
    assert result["auto_over_best_fixed"] == rows["auto"]["ratio_to_best_fixed"] > 0
    assert result["auto_page_size"] in CANDIDATES
    # Each round's figure is kept; the row's is the best of them.
    for r in rows.values():
        assert len(r["rounds_output_tokens_per_second"]) == 2
        assert r["output_tokens_per_second"] == max(r["rounds_output_tokens_per_second"])
    assert rows[16]["cost_per_million_output_tokens"] == pytest.approx(
        3.6 * rows[16]["elapsed_time"] / 3600 / 64 * 1e6)
    assert "auto (" in capsys.readouterr().out
