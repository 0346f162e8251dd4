"""The README's main job and the CPU benchmark run end to end (small sizes; no timing asserted)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_runs_and_agrees_with_dense_attention():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "quickstart.py"), "--n", "512", "--heads", "2", "--head-dim", "16"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "All masks agree with dense attention: yes" in proc.stdout
    assert "packed docs (seed)" in proc.stdout and "274.9 GB" in proc.stdout


def test_cpu_benchmark_writes_json_table_and_plot(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "bench" / "cpu_attention.py"), "--n", "256", "--quick", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "cpu_attention.json").read_text())
    assert len(data["rows"]) == 12 and not [r for r in data["rows"] if "error" in r]
    assert all(r["time_ms"] > 0 and "peak_mib" in r for r in data["rows"])
    assert (tmp_path / "cpu_attention.png").stat().st_size > 0
    assert "| docs512 | 256 | fwd |" in (tmp_path / "cpu_attention.md").read_text()


def test_ring_planner_report(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "bench" / "ring_cpu.py"), "--skip-run", "--n", "4096",
         "--worlds", "4", "8", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads((tmp_path / "ring_cpu.json").read_text())
    assert len(data["planner"]) == 6 * 2 * 3
    docs = [r for r in data["planner"] if r["mask"] == "docs" and r["balance"] == "contiguous" and r["world"] == 8][0]
    assert docs["transfers"] < docs["plain_transfers"]


def test_max_context_search_doubles_then_bisects():
    sys.path.insert(0, str(ROOT / "launch" / "bench"))
    from max_context import search_longest

    longest, tried = search_longest(lambda n: n <= 300_000, 8192, 1 << 21, 16384)
    assert tried[:7] == [8192, 16384, 32768, 65536, 131072, 262144, 524288]
    assert 300_000 - 16384 < longest <= 300_000
    assert search_longest(lambda n: False, 8192, 1 << 21, 16384) == (0, [8192])
    assert search_longest(lambda n: True, 8192, 32768, 16384)[0] == 32768


def test_max_context_runs_a_real_step_on_the_cpu(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "bench" / "max_context.py"), "--models", "tiny", "--impls", "flashmask",
         "sdpa_dense", "--device", "cpu", "--start", "256", "--max", "512", "--granularity", "128", "--loss-chunk", "128",
         "--tile-chunk", "128", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "max_context.json").read_text())
    assert [r["longest"] for r in data["results"]] == [512, 512]
    assert all(t["fits"] and "error" not in t for r in data["results"] for t in r["tried"])
