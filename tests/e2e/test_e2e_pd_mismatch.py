"""End to end, PD on the CPU engine through the router: a decode node whose ``block_size``
differs from its prefill node's. SGLang's own check (``try_ensure_parallel_info``: "Page size
mismatch") raised inside the decode scheduler's loop, which stopped the decode node and left the
request unanswered (a new user's review, 2026-12-07); ``disagg.sglang_hooks.ensure_prefill_info_hook``
now refuses that request with an error naming ``block_size``, and both nodes keep serving."""

import time

import pytest
import requests

from oasis_sglang.testing.launch import free_port, launch
from test_e2e import OUT
from test_e2e_pd import start_router
from test_e2e_pd_oasis import CFG, Deployment

pytestmark = pytest.mark.e2e
REFUSED = []     # the first answer through the router that was not its "no workers yet" 503


class Mismatched(Deployment):
    """The prefill node with ``CFG`` (block 8), the decode node with block 16; the router is
    ready when its first request is answered by the decode node (every request is refused)."""

    def __init__(self, model, name):
        self.model, self.cfg, self.name, self.spec, self.extra = model, CFG, name, [], []
        self.bootstrap = free_port()
        self.prefill_rows = 2
        self.pf = self.dc = self.router = None
        self.pf = self.start_prefill()
        self.cfg = {**CFG, "block_size": 16}
        self.dc = launch(model, 0, self.args() + ["--disaggregation-mode", "decode"], OUT / f"{name}_decode.log")

        def ready(r):
            if r.status_code == 503 and "No available" in r.text:
                return False
            REFUSED.append((r.status_code, r.text))
            return True

        self.url, self.router = start_router(self.pf.url, self.bootstrap, self.dc.url, retries=False, ready=ready)


@pytest.fixture(scope="module")
def pdm(model):
    assert CFG["block_size"] != 16
    d = Mismatched(model, "pd_mismatch")
    yield d
    d.stop()


def test_another_block_size_on_the_decode_node_refuses_the_request_naming_it(pdm):
    status, text = REFUSED[0]
    assert status != 200 and "block_size" in text, (status, text)
    assert requests.get(pdm.dc.url + "/health", timeout=60).status_code == 200, "the decode node stopped"
    assert requests.get(pdm.pf.url + "/health", timeout=60).status_code == 200
    t = time.time()             # and the next request is refused at once too (the info is not cached)
    r = requests.post(pdm.url + "/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 4}},
                      timeout=300)
    assert r.status_code != 200 and time.time() - t < 60, (r.status_code, r.text, time.time() - t)
    assert "OasisKV PD: block_size: the prefill node at" in pdm.dc.log()


def _decode_on(pdm, model, port: int, cfg: dict, suffix: str) -> None:
    """Restart the decode node on ``port`` (the router's) with ``cfg``."""
    from oasis_sglang.testing.launch import wait_port_free

    pdm.dc.stop()
    wait_port_free(port)
    pdm.cfg = cfg
    pdm.dc = launch(model, port, pdm.args() + ["--disaggregation-mode", "decode"], OUT / f"pd_mismatch_decode{suffix}.log")


def _answer(pdm):
    t0 = time.time()
    while True:         # the router sends nothing to the restarted node until its health check passes
        r = requests.post(pdm.url + "/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 4}},
                          timeout=300)
        if r.status_code != 503 or "No available" not in r.text or time.time() - t0 > 300:
            return r
        time.sleep(2)


def test_other_dense_layers_on_the_decode_node_refuse_the_request_and_the_prefill_node_keeps_serving(pdm, model):
    """Another ``dense_layers`` sizes the KV regions SGLang's NIXL transfer registers differently:
    the prefill node's bootstrap thread raised on it and that node served nobody after (a
    breaker's finding). The decode node now checks the prefill node's host tier layout first and
    refuses the request naming ``dense_layers``; the same prefill node then serves a decode node
    of its own config."""
    port = int(pdm.dc.url.rsplit(":", 1)[1])
    _decode_on(pdm, model, port, {**CFG, "dense_layers": [0, 1, 2]}, "_dense")
    r = _answer(pdm)
    assert r.status_code != 200 and "dense_layers" in r.text, (r.status_code, r.text)
    assert "dense_layers" in pdm.dc.log() and "cannot serve this decode node" in pdm.dc.log()
    assert "Exception in thread" not in pdm.pf.log(), pdm.pf.log()[-3000:]
    _decode_on(pdm, model, port, dict(CFG), "_same")
    r = _answer(pdm)
    assert r.status_code == 200, (r.status_code, r.text)
    assert "Exception in thread" not in pdm.pf.log()
