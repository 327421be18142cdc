"""PD admission with partial KV on SmolLM2's real K/V/Q (disagg/measure.py, scripts/pd_admission.py),
over real NIXL (UCX loopback): issue 19's admission target at a 5K-token prompt, budget 512, block 8."""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("nixl")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from pd_admission import record  # noqa: E402

from oasis_sglang.config import OasisConfig  # noqa: E402
from oasis_sglang.disagg.measure import measure_admission  # noqa: E402

CFG = OasisConfig(budget_tokens=512, block_size=8, predictor="previous", pd_read_mode="wait")   # bitwise == colocated


@pytest.fixture(scope="module")
def smollm2_5k(model):
    return record(5000, 6, 512, 8)


def test_exact_summaries_decode_bitwise_like_colocated(smollm2_5k):
    kv, q, sim_prefix, layers = smollm2_5k
    r = measure_admission(kv, q, sim_prefix, CFG, layers, summary_dtype=None)
    assert r["steps"] == 6 and r["equal"] and r["max_abs_diff"] == 0 and not r["lost"]
    assert r["remote_reads"] > 0 and r["fetched"] > 0, "decode read blocks it was not sent"
    assert r["decode_host_pieces"] < r["request_pieces"] / 2, "most of the prompt stayed on the prefill node"
    assert 3.4 < r["ratio"] < 4, r                      # fp32 summaries are 1/8 of the KV at 8-token blocks


def test_bf16_summaries_cut_admission_over_4x(smollm2_5k):
    """Summaries rounded outward to bf16 at admission: >= 4x fewer bytes than SGLang's full
    transfer (the issue's target) for a 5K prompt at budget 512, block 8."""
    kv, q, sim_prefix, layers = smollm2_5k
    r = measure_admission(kv, q, sim_prefix, CFG, layers, summary_dtype=torch.bfloat16)
    assert r["ratio"] >= 4.0, r
    assert r["admission"] == r["packet"] + r["dense_layers"] and r["full"] == 5000 * 30 * 3 * 128 * 4
    assert not r["lost"]


@pytest.mark.parametrize("args,msg", [(["--budget", "500"], "budget_tokens"), (["--prompt", "512"], "must exceed"),
                                      (["--decode-steps", "0"], "not a positive integer")])
def test_script_refuses_bad_sizes_before_the_model_runs(args, msg):
    import subprocess

    r = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[2] / "scripts" / "pd_admission.py"), *args],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and msg in r.stderr, r.stderr
