"""`sobrio bench serve` against a real `sobrio serve`: JSON fields and valid PNG plots."""

import json
import subprocess
import sys

from PIL import Image


def test_bench_serve_twenty_requests(server, tmp_path):
    result, plot = tmp_path / "result.json", tmp_path / "plot.png"
    cmd = [sys.executable, "-m", "sobrio.cli", "bench", "serve", "--base-url", server.base_url,
           "--model", "smollm2-135m", "--num-prompts", "20", "--input-len", "32", "--output-len", "8",
           "--request-rate", "20", "--ignore-eos", "--goodput", "ttft:60000", "--result-json", str(result),
           "--plot", str(plot), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(result.read_text())
    assert data["completed"] == 20 and data["failed"] == 0
    assert data["total_output_tokens"] == 160 and data["total_input_tokens"] == 20 * 32
    for key in ["duration", "request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
                "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms",
                "mean_e2el_ms", "p99_e2el_ms", "request_goodput"]:
        assert key in data and data[key] >= 0, key
    assert data["request_goodput"] > 0
    with Image.open(plot) as image:
        image.verify()
        assert image.format == "PNG"
    assert "Output token throughput" in proc.stdout


def test_bench_sweep_two_rates(server, tmp_path):
    result, plot = tmp_path / "sweep.json", tmp_path / "sweep.png"
    cmd = [sys.executable, "-m", "sobrio.cli", "bench", "sweep", "--base-url", server.base_url,
           "--model", "smollm2-135m", "--num-prompts", "6", "--input-len", "16", "--output-len", "4",
           "--request-rates", "4,inf", "--ignore-eos", "--result-json", str(result), "--plot", str(plot),
           "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(result.read_text())
    assert [r["request_rate"] for r in rows] == [4.0, float("inf")]
    assert all(r["completed"] == 6 and r["p99_ttft_ms"] > 0 for r in rows)
    with Image.open(plot) as image:
        image.verify()
