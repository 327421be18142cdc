"""scripts/measure_agreement.py end to end at tiny sizes (real SmolLM2 on CPU, the essays): both
modes write their tables and JSON, and --summary-dtype adds the 8-bit summaries' agreement."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "measure_agreement.py"


def _run(tmp_path, *args):
    r = subprocess.run([sys.executable, str(SCRIPT), "--prefix", "96", "--decode-steps", "16", "--docs", "1",
                        "--block-size", "8", "--out", str(tmp_path), *args], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((tmp_path / "results.json").read_text())


@pytest.mark.parametrize("sdt", ["auto", "int8"])
def test_perplexity_mode_writes_its_results(tmp_path, sdt):
    res = _run(tmp_path, "--budgets", "32", "--predictors", "previous", "--summary-dtype", sdt)
    assert [r["budget"] for r in res["runs"]] == [32] and res["runs"][0]["ratio"] > 0
    assert res["summary_dtype"] == sdt
    per = res.get("agreement_summary_vs_exact", {}).get("32", {})
    assert (len(per) > 0 and all(0 <= v <= 1 for v in per.values())) == (sdt == "int8")
    assert (tmp_path / "results.md").read_text().count("| 32 |") >= 2


def test_agreement_only_mode_writes_its_results(tmp_path):
    res = _run(tmp_path, "--agreement-only", "--budgets", "32")
    per = next(iter(res["agreement"].values()))            # budget -> predictor -> layer -> agreement
    assert per and all(0 <= v <= 1 for layers in per.values() for v in layers.values())
    assert 0 <= res["ngram_hit_rate"] <= 1 and (tmp_path / "results.md").exists()


def test_summary_dtype_with_agreement_only_is_refused(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--agreement-only", "--summary-dtype", "int8"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--summary-dtype applies to the perplexity runs" in r.stderr
