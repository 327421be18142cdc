"""The decode step's launch budget: scripts/count_launches.py on the Triton kernels (interpreter on CPU).

Inside SGLang's decode CUDA graph every kernel costs the GPU a few microseconds however small, and a
host read of a device value would break the capture (and stall eager steps), so both are guarded:
a decode step of a sparse layer launches at most 13 kernels (10 per layer plus 5 per step shared by
the layers since the fused plan / append / key-decode kernels, 141 before them; plus 2 per layer
for the step transfer budget: its candidates and its share) and reads nothing back to the host,
in graph mode and in eager steps that bring the batch's rows on the host. (The device check of each
replay's host decision, ``OasisSparseKV.check_replays``, adds 6 launches per captured step; it is on
only where host lengths come from the prediction record and is not counted here.)
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts ATen dispatches under the Triton interpreter; on a "
                    "GPU run the script itself (it reports the profiler's exact CUDA kernel count)")
@pytest.mark.parametrize("mode", [[], ["--eager"]], ids=["graph", "eager"])
def test_decode_step_launches_and_host_syncs(tmp_path, mode):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "count_launches.py"), "--layers", "3", "--steps", "2",
                        "--out", str(tmp_path), *mode], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "launches.json").read_text())
    assert res["steady"], "every counted step launches the same kernels"
    assert res["syncs"] == {}, f"host reads on the decode path: {res['syncs']}"
    assert res["per_sparse_layer"] <= 12, res["ops"]
    for k in ("triton._plan_transfer_kernel", "triton._append_tokens_kernel", "triton._copy_rows_kernel",
              "triton._budget_candidates_kernel", "triton._share_budget_kernel"):
        assert res["ops"][k] == 3, (k, res["ops"])
    # the decode token's summary fold runs in the append's launch (kernel 7 with ``fold``)
    assert "triton._write_kv_kernel" not in res["ops"], res["ops"]
    assert (tmp_path / "launches.md").read_text().startswith("# Kernel launches")


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts ATen dispatches under the Triton interpreter")
def test_prefill_forward_launches_and_host_syncs(tmp_path):
    """``--prefill`` counts a prefill forward as SGLang's glue makes it (host lengths given): on
    CPU its only host reads are kernel 1's ``nonzero`` (one per sparse layer; on CUDA the scan
    path replaces it), none from the lengths or the first step's prediction."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "count_launches.py"), "--prefill", "--layers", "3",
                        "--steps", "2", "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "launches.json").read_text())
    assert res["mode"] == "prefill" and res["steady"]
    assert res["syncs"] == {"nonzero": 3}, res["syncs"]
    assert res["ops"]["triton._write_kv_kernel"] == 3 and res["ops"]["triton._plan_transfer_kernel"] == 3, res["ops"]
    assert "prefill forward" in (tmp_path / "launches.md").read_text()


def test_host_copies_are_counted_as_syncs():
    """The counter's copy rule on ``meta`` tensors (a device other than the host's): a blocking
    copy from pageable memory and a copy back to the host are syncs; work on one device is not."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import count_launches as cl

    c = cl._Count()
    with c:
        torch.zeros(3).to("meta")                       # pageable host -> device, blocking
        torch.zeros(3) + 1                              # host only
        torch.empty(2, device="meta") * 2               # device only
    assert dict(c.syncs) == {"h2d_pageable": 1}, dict(c.syncs)
    dev, host = torch.empty(2, device="meta"), torch.empty(2)
    assert cl.host_copy("_to_copy", (dev,), {"device": "cpu"}, host) == "d2h"          # .cpu(): meta has no data
    assert cl.host_copy("copy_", (host, dev), {}, host) == "d2h"
    assert cl.host_copy("copy_", (dev, host), {}, dev) == "h2d_pageable"
    assert cl.host_copy("_to_copy", (dev,), {}, torch.empty(2, device="meta")) is None
    ev = lambda *names: [type("E", (), {"name": n}) for n in names]  # noqa: E731
    # PyTorch's blocking copy: a memcpy and its cudaStreamSynchronize count once
    assert cl.cuda_syncs(ev("Memcpy HtoD (Pageable -> Device)", "cudaStreamSynchronize",
                            "Memcpy HtoD (Pinned -> Device)", "triton_kernel")) == {"cudaStreamSynchronize": 1}
    # a pageable copy without a synchronize call of its own still counts
    assert cl.cuda_syncs(ev("Memcpy HtoD (Pageable -> Device)", "Memcpy DtoH (Device -> Pageable)",
                            "cudaStreamSynchronize")) == {"cudaStreamSynchronize": 1, "h2d_pageable": 1}
