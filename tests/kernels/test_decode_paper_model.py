"""``jaxpaged.benchmarks.kernels.decode_paper_model``: SM cycles a KV tile needs of HBM,
issue and shared memory, and the speed ratio of two loops, on hand-made loop facts."""

import pytest

from jaxpaged.benchmarks.kernels.decode_paper_model import (H200, report, speed_ratio,
                                                             tile_cycles)
from jaxpaged.benchmarks.kernels.schedule_check import ScheduleFacts


def facts(loop, kv_bytes, opcodes, warps=4):
    return ScheduleFacts(tile_buffers=2, async_waits=(2,), registers=64, stack=0, shared=0,
                         num_warps=warps, loop_instructions=loop, tile_kv_bytes=kv_bytes,
                         loop_opcodes=tuple(opcodes.items()))


BF16 = facts(280, 16384, {"LDSM.16.M88.4": 20, "LDGSTS.E.BYPASS.128": 8})     # 112 wavefronts
FP8 = facts(270, 8192, {"LDSM.16.M88.4": 30, "STS.128": 8, "LDS.128": 4})     # 168


def test_tile_cycles_take_each_resource_at_its_peak():
    bytes_per_cycle = 4.8e12 / (132 * 1.98e9)
    c = tile_cycles(BF16)
    assert c.hbm == pytest.approx(16384 / bytes_per_cycle)       # ~892
    assert c.issue == 280 * 4 / 4
    assert c.shared == 112 * 4
    assert c.bound() == (pytest.approx(c.hbm), "HBM")
    assert c.bound(issue_efficiency=0.25) == (280 * 4, "issue")


def test_speed_ratio_follows_the_limiting_resource():
    fp8 = tile_cycles(FP8)
    assert fp8.bound() == (168 * 4, "shared")
    assert speed_ratio(FP8, BF16, fast_keys=32, base_keys=32) == pytest.approx(
        tile_cycles(BF16).hbm / (168 * 4))
    # at a quarter of the issue peak both are issue-bound: 280 and 270 x 4 / 4 / 0.25 cycles
    assert speed_ratio(FP8, BF16, fast_keys=32, base_keys=32, issue_efficiency=0.25) == \
        pytest.approx(1120 / 1080)
    # twice the keys a tile in the same cycles is twice the speed
    assert speed_ratio(FP8, BF16, fast_keys=64, base_keys=32) == pytest.approx(
        2 * speed_ratio(FP8, BF16, fast_keys=32, base_keys=32))
    lines = report(FP8, BF16, keys=32)
    assert lines[-2].startswith("issue at 100% of peak: bf16 HBM-bound, fp8 shared-bound")
    assert H200["sms"] == 132
