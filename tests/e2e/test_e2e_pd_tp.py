"""PD with TP: ``--tp 3`` on both nodes with ``--kv-sparse oasis``, behind sglang-router (issue 19).

Real SGLang (CPU engine, gloo collectives), SmolLM2 (3 KV heads: one per rank), NIXL over UCX
loopback, the real router. Decode rank ``r`` reads its KV heads from prefill rank ``r`` (each
rank PUTs its own tier layout to the bootstrap server); what one rank's NIXL agent sees is
acted on by every rank at the same loop iteration (``disagg/serving.py tp_agree``).

- greedy output through the router equals one ``--tp 1`` dense server where the budget covers
  the context (or leaves it only at a near tie: TP sums partial products in another order), four
  requests one after the other through a prefill node with two request rows: each needs the
  leases of the earlier ones freed on all three prefill ranks (released, not expired);
- the prefill node killed mid-decode: the request ends with an error on every decode rank in
  bounded time, the decode node stays healthy and every rank holds no request from a prefill
  node afterwards;
- a ``--tp 1`` prefill node restarted in its place: each request ends at once with an error
  naming ``--tp-size`` (``sglang_hooks.ensure_prefill_info_hook``), before SGLang's NIXL
  transfer would stop that prefill node's bootstrap thread; both nodes stay healthy.
"""

import re
import time

import pytest
import requests

pytest.importorskip("nixl")
pytest.importorskip("sglang_router")

from test_e2e import NEEDLE_CFG, assert_dense_or_near_tie, dense_reference, generate_ids, short_prompts  # noqa: E402
from oasis_sglang.testing.launch import check_port_free  # noqa: E402
from test_e2e_pd_oasis import RELEASED, Deployment, kill_prefill_mid_decode  # noqa: E402

pytestmark = pytest.mark.e2e
CFG = {**NEEDLE_CFG, "pd_read_timeout_s": 5.0, "pd_lease_s": 15.0}
TP = ["--tp", "3"]
RANK_ADMITTED = re.compile(r"\[[^\]]* TP(\d)\] OasisKV PD: admitted request \S+ from oasis-prefill-[0-9a-f]+-tp(\d)")
FREED = re.compile(r"\[[^\]]* TP(\d)\] OasisKV PD: freed \d+ lease\(s\); released by decode nodes: (\d+), "
                   r"expired: (\d+)")


@pytest.fixture(scope="module")
def pd_tp(model):
    with pytest.MonkeyPatch.context() as mp:
        # the plugin sets SGLang's CPU TP environment itself (server_args._cpu_tp_env)
        for var in ("SGLANG_NCCL_SO_PATH", "SGLANG_CPU_OMP_THREADS_BIND"):
            mp.delenv(var, raising=False)
        d = Deployment(model, CFG, "pd_tp3", prefill_rows=2, retract=False, extra=TP)
        try:
            yield d
        finally:
            d.stop()


def test_pd_tp3_greedy_equals_tp1_dense_and_every_rank_frees_its_leases(model, tok, pd_tp):
    prompts = short_prompts(tok)
    prompts = prompts + prompts[:1]              # four requests through two prefill request rows
    n_new = 24
    ref = dense_reference(model, prompts, n_new)
    got = [generate_ids(pd_tp.url, p, n_new) for p in prompts]
    assert all(len(p) + n_new <= CFG["budget_tokens"] for p in prompts)
    assert_dense_or_near_tie(prompts, ref, got, "pd_tp3_vs_tp1_dense")
    dlog, plog = pd_tp.dc.log(), pd_tp.pf.log()
    pairs = RANK_ADMITTED.findall(dlog)
    assert len(pairs) >= 3 * len(prompts), pairs
    assert all(a == b for a, b in pairs), f"a decode rank read from another prefill rank: {pairs}"
    last = {}
    for rank, released, expired in FREED.findall(plog):
        last[rank] = (int(released), int(expired))
    # the leases are freed at the same iteration on all ranks: the same counts everywhere
    assert set(last) == {"0", "1", "2"} and len(set(last.values())) == 1, last
    assert last["0"][0] >= len(prompts) - 1 and last["0"][1] == 0, last
    assert "leak" not in dlog.lower() and "leak" not in plog.lower()
    agreed = re.compile(r"\[[^\]]* TP(\d)\] OasisKV PD: 3 TP ranks: lease frees, request ends and first-step plans "
                        r"are agreed")
    for log in (dlog, plog):
        assert set(agreed.findall(log)) == {"0", "1", "2"}, "every rank of both nodes agrees over SGLang's TP group"


def test_pd_tp3_prefill_killed_mid_decode_ends_the_request_on_every_rank(tok, pd_tp):
    pd_tp.pf_port = int(pd_tp.pf.url.rsplit(":", 1)[1])
    mark = kill_prefill_mid_decode(tok, pd_tp)
    pd_tp.pf = None
    log = pd_tp.dc.log()[mark:]
    ended = set(re.findall(r"\[[^\]]* TP(\d)\] OasisKV PD: request \S+ ends: ", log))
    assert ended == {"0", "1", "2"}, f"the request ended on ranks {ended}: want all three"
    assert requests.get(pd_tp.dc.url + "/health", timeout=30).status_code == 200
    t0 = time.time()
    while time.time() - t0 < 60:
        held = {}
        for ln in pd_tp.dc.log()[mark:].splitlines():
            m = RELEASED.search(ln)
            rank = re.search(r" TP(\d)\] ", ln)
            if m and rank:
                held[rank.group(1)] = m.group(5)
        if held == {"0": "0", "1": "0", "2": "0"}:
            break
        time.sleep(1)
    assert held == {"0": "0", "1": "0", "2": "0"}, f"requests from prefill nodes still held per rank: {held}"
    assert "leak" not in pd_tp.dc.log().lower()


def test_pd_prefill_node_of_another_tp_size_is_refused_naming_tp_size(tok, pd_tp):
    """A ``--tp 1`` prefill node behind the ``--tp 3`` decode node (the router knows its URL and
    bootstrap port): the request ends at once with an error naming ``--tp-size`` on every decode
    rank and on the prefill node (told by the decode node), also the next one (the prefill info
    is not cached), and neither node stops serving."""
    dlog = pd_tp.dc.log
    if pd_tp.pf is not None:              # run alone (-k): stop the --tp 3 prefill node here
        pd_tp.pf_port = int(pd_tp.pf.url.rsplit(":", 1)[1])
        pd_tp.pf.stop()
        pd_tp.pf = None
    t0 = time.time()                      # SGLang's heartbeat forgets the killed node's parallel info
    while time.time() - t0 < 120 and "Lost connection with prefill instance" not in dlog():
        time.sleep(1)
    assert "Lost connection with prefill instance" in dlog()
    for _ in range(60):
        try:
            check_port_free(pd_tp.pf_port)
            break
        except OSError:
            time.sleep(2)
    pd_tp.extra = []
    pd_tp.pf = pd_tp.start_prefill(port=pd_tp.pf_port, suffix="_tp1")
    mark = len(dlog())

    t0 = time.time()
    while True:         # the router's circuit breaker opened on the killed node: 503 at once until it closes
        t = time.time()
        r = requests.post(pd_tp.url + "/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 4}},
                          timeout=120)
        took = time.time() - t
        if "No available prefill workers" not in r.text or time.time() - t0 > 180:
            break
        time.sleep(2)
    assert took < 60, f"the refusal took {took:.0f} s"
    assert r.status_code != 200 and "--tp-size" in r.text, r.text
    # the router's circuit breaker now holds the failing prefill node out (503): the next
    # request goes to the nodes directly, with the fields the router adds (the prefill info is
    # not cached on the decode node, so it is checked again), first to the decode node: its
    # notice reaches the prefill node before the request does, which must still end it at once
    body = {"text": "Hello 1", "sampling_params": {"max_new_tokens": 4}, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": pd_tp.bootstrap, "bootstrap_room": 12345}
    told = len(re.findall(r"OasisKV PD: told 1 prefill rank", dlog()))
    t = time.time()
    rd = requests.post(pd_tp.dc.url + "/generate", json=body, timeout=120)
    while time.time() - t < 30 and len(re.findall(r"OasisKV PD: told 1 prefill rank", dlog())) == told:
        time.sleep(0.5)
    assert len(re.findall(r"OasisKV PD: told 1 prefill rank", dlog())) == told + 1
    rp = requests.post(pd_tp.pf.url + "/generate", json=body, timeout=120)
    assert time.time() - t < 60
    for r in (rd, rp):
        assert r.status_code != 200 or "abort" in r.text.lower(), r.text
        assert "--tp-size" in r.text, r.text
    refused = re.findall(r"\[[^\]]* TP(\d)\] OasisKV PD: --tp-size: the prefill node at \S+ runs 1 attention TP "
                         r"rank\(s\), this decode node 3", dlog()[mark:])
    assert set(refused) == {"0", "1", "2"} and len(refused) >= 6, refused
    assert requests.get(pd_tp.dc.url + "/health", timeout=30).status_code == 200
    assert requests.get(pd_tp.pf.url + "/health", timeout=30).status_code == 200
    plog = pd_tp.pf.log()
    assert "NotImplementedError" not in plog and "Traceback" not in plog, plog[-3000:]
    # the prefill node ended its side at once, told why by the decode node
    assert len(re.findall(r"Prefill bootstrap failed for request .*OasisKV PD: --tp-size", plog)) >= 2, plog[-3000:]
