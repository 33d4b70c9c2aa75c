"""``python -m jaxpaged.benchmarks.report``: docs/benchmarks.md's generated tables from the
results JSON (benchmarks/report.py)."""

import json

import pytest

from jaxpaged.benchmarks import report

COMPARE = {
    "workload": "W1", "date": "2026-12-01 20:00 UTC",
    "cpu": "AMD EPYC (family 25 model 17, 2 cores, avx512f avx512_bf16)",
    "load_average_before_after": [4.0, 6.5], "matmul_peak_gflops": 190.0,
    "model_tflops": 3.94, "roofline_seconds": 20.7,
    "rows": [{"backend": "jaxpaged", "elapsed_time": 44.0, "output_tokens_per_second": 186.2,
              "ratio_jaxpaged_over_this": 1.0, "mfu": 0.471},
             {"backend": "llama.cpp w1-f32.gguf", "elapsed_time": 61.234,
              "output_tokens_per_second": 133.78, "ratio_jaxpaged_over_this": 1.3918,
              "mfu": 0.3386}]}
PROFILE = {"date": "2026-12-01 20:10 UTC", "cpu": "X", "load_average_before_after": [1, 2],
           "peak_gflops": 85.0,
           "decode": {"best_ms": 400.0, "median_ms": 410.0,
                      "thread_share": {"attention": 0.7, "lm_head": 0.3}},
           "prefill": {"best_ms": 4000.0, "median_ms": 4100.0,
                       "thread_share": {"mlp": 0.9, "attention": 0.1}}}


def write_doc(tmp_path, block: str, name: str, result: dict):
    (tmp_path / "results").mkdir(exist_ok=True)
    (tmp_path / "results" / name).write_text(json.dumps(result))
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# B\n\nprose\n\n<!-- generated: {block} results/{name} -->\nstale\n"
                   "<!-- end generated -->\n\nmore prose\n")
    return doc


def test_repository_doc_matches_its_results_json():
    assert report.main(["--check"]) == 0


def test_compare_block(tmp_path):
    doc = write_doc(tmp_path, "compare", "compare-W1.json", COMPARE)
    assert report.main(["--doc", str(doc), "--check"]) == 1          # "stale" inside
    assert report.main(["--doc", str(doc), "--no-plots"]) == 0
    text = doc.read_text()
    assert text.startswith("# B\n\nprose\n\n<!-- generated: compare results/compare-W1.json -->\n"
                           "Run 2026-12-01 20:00 UTC on **AMD EPYC (family 25 model 17, 2 cores, "
                           "avx512f avx512_bf16)**, load average 4.0 at the start and 6.5 at "
                           "the end.\n\n| engine | wall s | out tok/s | jaxpaged x | MFU |\n")
    assert "| jaxpaged | 44.00 | 186.2 | 1.00 | 47.1% |\n" in text
    assert "| llama.cpp w1-f32.gguf | 61.23 | 133.8 | 1.39 | 33.9% |\n" in text
    assert "roofline 20.7 s" in text and "![W1 throughput by engine](results/compare-W1.png)" in text
    assert text.endswith("<!-- end generated -->\n\nmore prose\n") and "stale" not in text
    assert report.main(["--doc", str(doc), "--check"]) == 0


def test_step_profile_block_lists_every_phase_of_both_steps(tmp_path):
    doc = write_doc(tmp_path, "step-profile", "step-profile-W1.json", PROFILE)
    report.main(["--doc", str(doc), "--no-plots"])
    text = doc.read_text()
    assert "| phase | decode | prefill |\n" in text
    assert "| attention | 70.0% (280.0) | 10.0% (400.0) |\n" in text
    assert "| lm_head | 30.0% (120.0) |  |\n" in text
    assert "| mlp |  | 90.0% (3600.0) |\n" in text
    assert "| **step, best (median) ms** | 400 (410) | 4000 (4100) |\n" in text


def test_bad_blocks_are_reported(tmp_path):
    doc = write_doc(tmp_path, "latency", "x.json", {})
    with pytest.raises(ValueError, match="unknown generated block kind 'latency'"):
        report.main(["--doc", str(doc)])
    doc.write_text("<!-- generated: compare results/none.json -->\n<!-- end generated -->\n")
    with pytest.raises(ValueError, match="none.json, which does not exist"):
        report.main(["--doc", str(doc)])


def test_plots_are_written_next_to_the_json(tmp_path):
    doc = write_doc(tmp_path, "compare", "compare-W1.json", COMPARE)
    (tmp_path / "results" / "step-profile-W1.json").write_text(json.dumps(PROFILE))
    doc.write_text(doc.read_text() + "<!-- generated: step-profile results/step-profile-W1.json"
                   " -->\n<!-- end generated -->\n")
    report.main(["--doc", str(doc)])
    for name in ("compare-W1.png", "step-profile-W1.png"):
        assert (tmp_path / "results" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
