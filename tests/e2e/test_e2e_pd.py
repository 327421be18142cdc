"""SGLang's own PD disaggregation on the CPU engine, through sglang-router, with NIXL over UCX
loopback, with dense KV (``--kv-sparse oasis`` with PD: ``test_e2e_pd_oasis.py``).

A prefill server (``--disaggregation-mode prefill``), a decode server (``decode``) and the router
(``--pd-disaggregation``) serve SmolLM2 with dense KV; their greedy output equals one dense server's.
This needs the plugin's two CPU fixes (``sglang_glue/fixes/pd_cpu.py``: the pool registered with
NIXL as DRAM, the early send of a cached prefix skipped), set by the plugin, not by environment
variables.
"""

import subprocess
import sys
import time

import pytest
import requests

pytest.importorskip("nixl")
pytest.importorskip("sglang_router")

from oasis_sglang.testing.launch import base_args, free_port, launch  # noqa: E402
from test_e2e import OUT, _exact_prompts, assert_dense_or_near_tie, dense_reference, generate_ids  # noqa: E402

pytestmark = pytest.mark.e2e
PD = ["--disaggregation-transfer-backend", "nixl"]


def start_router(prefill_url: str, bootstrap: int, decode_url: str, timeout: float = 600, retries: bool = True,
                 ready=lambda r: r.status_code == 200):
    """sglang-router in PD mode; returns ``(url, process)`` once a one-token request through it
    gets an answer ``ready`` accepts (default: 200; its ``/health`` is 200 before it has
    registered the workers: "Router ready | workers: []", and requests then get 503).
    ``retries=False``: ``--disable-retries`` (a failed request's error reaches the client
    instead of the router sending it again)."""
    port = free_port()
    log = open(OUT / "pd_router.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                             "--prefill", prefill_url, str(bootstrap), "--decode", decode_url,
                             "--host", "127.0.0.1", "--port", str(port),
                             # a decode step of a 2-core CPU box can keep a worker's /health waiting
                             # past the router's 5 s: do not drop it for that
                             "--health-check-timeout-secs", "120", "--health-failure-threshold", "5",
                             "--health-check-interval-secs", "15",
                             # its metrics take 29000 unless told: another router on the host must not stop it
                             "--prometheus-port", str(free_port())] + ([] if retries else ["--disable-retries"]),
                            stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while time.time() - t0 < timeout:
        assert proc.poll() is None, f"router exited {proc.returncode}: see {OUT / 'pd_router.log'}"
        try:
            r = requests.post(url + "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 1}},
                              timeout=300)
            if ready(r):
                return url, proc
        except requests.RequestException:
            pass
        time.sleep(2)
    proc.kill()
    raise TimeoutError(f"router not healthy in {timeout} s: see {OUT / 'pd_router.log'}")


def test_pd_through_the_router_equals_one_dense_server(model, tok):
    prompts = _exact_prompts(tok)
    n_new = 24
    ref = dense_reference(model, prompts, n_new)          # shared with the --tp 3 test
    bootstrap = free_port()
    pf = launch(model, 0, base_args() + PD + ["--disaggregation-mode", "prefill",
                                              "--disaggregation-bootstrap-port", str(bootstrap)], OUT / "pd_prefill.log")
    dc = router = None
    try:
        dc = launch(model, 0, base_args() + PD + ["--disaggregation-mode", "decode"], OUT / "pd_decode.log")
        url, router = start_router(pf.url, bootstrap, dc.url)
        got = [generate_ids(url, p, n_new) for p in prompts]
    finally:
        if router is not None:
            router.kill()
        for s in (dc, pf):
            if s is not None:
                s.stop()
    assert_dense_or_near_tie(prompts, ref, got, "pd_router_vs_dense")
