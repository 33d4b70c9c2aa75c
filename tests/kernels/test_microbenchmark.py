"""The kernel microbenchmark script runs end to end (tiny shapes, interpret mode)."""

import json

from jaxpaged.benchmarks.kernels import paged_attention as bench


def test_microbenchmark_smoke(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert bench.main(["--smoke", "--output-json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "speedup" in printed
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["batch"], r["context"]) for r in rows] == [("decode", 2, 64), ("mixed", 2, 64)]
    # 2 sequences * 64 tokens * 2 KV heads * 16 dims * 2 (K and V) * 2 bytes (bf16)
    assert rows[0]["kv_bytes"] == 2 * 64 * 2 * 16 * 2 * 2
    assert all(r["pallas"]["ms"] > 0 and r["xla"]["ms"] > 0 for r in rows)
