"""A PD decode node whose compact host tier (``pd_host_slots``) runs full, behind sglang-router
(issue 19; a breaker's finding, 2026-12-07). The pool evicts nothing while a request runs, so at
the start-up floor (one request's working set: 28 sparse layers x 3 KV heads x 64 budget blocks)
a ~2,000-token request soon needs a block the pool cannot take. It used to decode on without it
and answer other text with HTTP 200; now it ends with an error naming ``pd_host_slots``
(``DecodeSide.starved_rows``), the decode node keeps serving, and its slots all come back.
Real SGLang (CPU engine), SmolLM2, NIXL over UCX loopback, the real router."""

import pytest

pytest.importorskip("nixl")
pytest.importorskip("sglang_router")

import requests  # noqa: E402

from oasis_sglang import needle  # noqa: E402
from test_e2e_pd_compact import RELEASED  # noqa: E402
from test_e2e_pd_oasis import CFG, Deployment  # noqa: E402

pytestmark = pytest.mark.e2e
FLOOR = 28 * 3 * (CFG["budget_tokens"] // CFG["block_size"])


@pytest.fixture(scope="module")
def pd_full(model):
    d = Deployment(model, {**CFG, "pd_host_slots": FLOOR}, "pd_compact_full", retract=False)
    yield d
    d.stop()


def test_a_request_whose_blocks_a_full_compact_tier_cannot_take_ends_naming_pd_host_slots(tok, pd_full):
    p = needle.build(tok, 2048, 0.5)
    mark = len(pd_full.dc.log())
    r = requests.post(pd_full.url + "/v1/chat/completions", json={
        "model": "m", "messages": p.messages, "max_tokens": 100, "temperature": 0}, timeout=600)
    log = pd_full.dc.log()[mark:]
    assert "compact host tier is full" in log, "the pool did not run full: the test shows nothing"
    assert r.status_code != 200 or "error" in r.text.lower() or r.json()["choices"][0]["finish_reason"] == "abort", \
        r.text[:2000]
    assert "'pd_host_slots' %d" % FLOOR in r.text or "'pd_host_slots' %d" % FLOOR in log, r.text[:2000]
    assert requests.get(pd_full.dc.url + "/health", timeout=60).status_code == 200
    r = requests.post(pd_full.url + "/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 4}},
                      timeout=300)
    assert r.status_code == 200, r.text
    rel = RELEASED.findall(pd_full.dc.log()[mark:])
    assert rel and rel[-1][2] == "0" and rel[-1][-1] == "0", rel          # no slot in use, none held
    assert "leak" not in pd_full.dc.log().lower()
