"""scripts/plot_profile.py on a recorded H200 profile (docs/runs/json): the table adds up, the PNG
is written, and malformed results are refused with a message naming the file."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "docs" / "runs" / "json" / "pipeline_e_dot.json"


def _run(*args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "plot_profile.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def test_groups_sum_to_the_profiled_kernel_time(tmp_path):
    r = _run(f"{RUN}=dot scoring", "--out", tmp_path / "p")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "p.png").stat().st_size > 10_000
    res = json.loads(RUN.read_text())
    layers = res["args"]["layers"]
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| dot scoring")]
    graph = [g for g in res["graph"] if g["variant"] == "previous" and g.get("kernels")]
    assert len(rows) == len(graph) == 2
    for ln, g in zip(rows, graph):
        cells = [float(c) for c in ln.strip("| ").split(" | ")[1:]]
        assert abs(cells[0] - 1e3 * g["gpu_ms"] / layers) < 1                      # step time per layer
        assert abs(sum(cells[1:]) - sum(k[1] for k in g["kernels"]) / layers) < len(cells)   # rounding only


def test_malformed_results_are_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    r = _run(bad)
    assert r.returncode != 0 and "not a bench_pipeline.py" in r.stderr and "bad.json" in r.stderr
    r = _run(tmp_path / "missing.json")
    assert r.returncode != 0 and "missing.json" in r.stderr
