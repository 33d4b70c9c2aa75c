"""KV page count: override, byte budget, GPU utilization after profiling, CPU default."""

import logging

import pytest

from jaxpaged.runner import kv_sizing

ARGS = dict(bytes_per_page=1000, pages_per_seq=4, max_num_seqs=10, num_gpu_blocks_override=None,
            kv_cache_memory_bytes=None, gpu_memory_utilization=0.92)


class FakeDevice:
    def memory_stats(self):
        return {"bytes_limit": 1_000_000, "bytes_in_use": 100_000}


def test_override_and_budget_take_precedence():
    never = lambda: pytest.fail("profiling must not run")
    assert kv_sizing.num_kv_pages(**{**ARGS, "num_gpu_blocks_override": 7},
                                  profile_peak_bytes=never) == 7
    assert kv_sizing.num_kv_pages(**{**ARGS, "kv_cache_memory_bytes": 12_345},
                                  profile_peak_bytes=never) == 12


def test_cpu_default_is_capped_by_what_requests_can_use(caplog):
    with caplog.at_level(logging.INFO, logger=kv_sizing.__name__):
        assert kv_sizing.num_kv_pages(**ARGS, profile_peak_bytes=lambda: None) == 10 * 4 + 1
    # the log names the rule that applied: what max_num_seqs requests need (41 pages)
    assert caplog.messages == ["CPU KV budget: what max_num_seqs=10 requests of 4 pages "
                               "need (0.0 MiB)"]


def test_cpu_default_budget_is_shared_by_host_devices(monkeypatch, caplog):
    monkeypatch.setattr(kv_sizing, "DEFAULT_CPU_KV_CACHE_BYTES", 20_000)
    big = {**ARGS, "max_num_seqs": 1000}
    with caplog.at_level(logging.INFO, logger=kv_sizing.__name__):
        assert kv_sizing.num_kv_pages(**big, profile_peak_bytes=lambda: None) == 20
    # the log names the rule that applied: the default cap
    assert caplog.messages[0].startswith("CPU KV budget: the 0 GiB default cap "
                                         "(max_num_seqs=1000 requests of 4 pages would need "
                                         "0.0 GiB; --kv-cache-memory-bytes sets another)")
    # two devices each hold half of a page (500 bytes each), in the same host memory
    assert kv_sizing.num_kv_pages(**{**big, "bytes_per_page": 500}, num_devices=2,
                                  profile_peak_bytes=lambda: None) == 20


def test_cpu_default_budget_takes_the_memory_share(monkeypatch, caplog):
    monkeypatch.setattr(kv_sizing, "DEFAULT_CPU_KV_CACHE_BYTES", 2 << 30)
    big = {**ARGS, "bytes_per_page": 1 << 20, "max_num_seqs": 1000}    # need 4001 pages
    with caplog.at_level(logging.INFO, logger=kv_sizing.__name__):
        assert kv_sizing.num_kv_pages(**big, kv_cache_memory_share=0.25,
                                      profile_peak_bytes=lambda: None) == 512
        # a share larger than the need leaves the need (41 pages)
        assert kv_sizing.num_kv_pages(**{**big, "max_num_seqs": 10}, kv_cache_memory_share=0.5,
                                      profile_peak_bytes=lambda: None) == 41
    # the log says which budget applied, the share named
    assert caplog.messages == [
        "CPU KV budget: kv_cache_memory_share 0.25 of the 2 GiB default cap (0.50 GiB) "
        "(max_num_seqs=1000 requests of 4 pages would need 3.9 GiB; --kv-cache-memory-bytes "
        "sets another); pages take host memory as they are first written",
        "CPU KV budget: what max_num_seqs=10 requests of 4 pages need (41.0 MiB), under "
        "kv_cache_memory_share 0.5 of the 2 GiB default cap (1.00 GiB)"]


def test_gpu_budget_is_utilization_minus_profiled_peak(monkeypatch):
    monkeypatch.setattr(kv_sizing.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(kv_sizing.jax, "local_devices", lambda: [FakeDevice()])
    # 0.92 * 1e6 - 250e3 peak = 670e3 bytes -> 670 pages
    assert kv_sizing.num_kv_pages(**ARGS, profile_peak_bytes=lambda: 250_000) == 670
    with pytest.raises(ValueError, match="no room for the KV cache"):
        kv_sizing.num_kv_pages(**{**ARGS, "gpu_memory_utilization": 0.2},
                               profile_peak_bytes=lambda: 250_000)
