"""``--kv-sparse oasis`` on both nodes of SGLang's PD disaggregation, behind sglang-router (issue 19).

Real SGLang (CPU engine), SmolLM2, NIXL over UCX loopback, the real router. At admission only
the dense layers' KV, the key summaries (bf16), the prefill node's page numbers and the first
step's planned slots cross (SGLang's own transfer of the regions
``OasisKVPool.get_contiguous_buf_infos`` advertises), and with a predictor that plans ahead the
first step's blocks; the decode node reads the other blocks from the prefill node's host tier
on demand (``disagg/serving.py``).

One deployment (budget 512, block 8) for all four:

- greedy output through the router equals one dense server when the budget covers the context
  (prompts up to 464 tokens + 24 new, decoded together while SGLang's retraction test mode
  retracts one of them every few steps: its prefill node recomputes it); the admission lines
  report what crossed;
- more requests than the prefill node has request rows: its pages are leased and freed when the
  decode node releases them (else the later requests would wait for the lease to expire);
- scripts/pd_gpu.py's request sent to both nodes itself: the decode node's answer streamed,
  its time to the first token measured;
- a needle at budget 512 through the router (6000 tokens), >= 4x less at admission;
- the prefill process stopped (SIGSTOP) for a lease length mid-decode: its requests end with an
  error and the decode node's host tier goes back to what it held before, also after a further
  round;
- the prefill process killed mid-decode: the request ends with an error, the decode node's
  /health stays 200 and it serves a request from a new prefill node;
- then the decode process killed mid-decode: the prefill node frees the request's lease within
  ``pd_lease_s`` (no renewals come any more), its memory check finds no leak, it stays healthy.

Then a second deployment with ``predictor: previous`` and prompts prefilled in chunks: the first
decode step's working set planned on the prefill node crosses with the transfer and is installed
at admission (no synchronous first step), and greedy output equals the dense server's.

Then (opt-in, ``OASIS_E2E_EXTRA=1``: about 6 min, and once two of its three requests stalled in
the prefill node's bootstrap queue until SGLang's transfer timeout, not investigated) a second deployment with
EAGLE-3 on both nodes (the draft model's KV crosses whole): greedy output equals the dense server's.
"""

import concurrent.futures as cf
import os
import re
import threading
import time
from pathlib import Path

import pytest
import requests

pytest.importorskip("nixl")
pytest.importorskip("sglang_router")

from oasis_sglang import needle  # noqa: E402
from oasis_sglang.testing.launch import (base_args, wait_port_free, extra_e2e, free_port, has_cuda, launch,  # noqa: E402
                                         oasis_args)
from oasis_sglang.models import essay_texts  # noqa: E402
from test_e2e import NEEDLE_CASES, NEEDLE_CFG, OUT, chat, dense_reference, generate_ids, short_prompts  # noqa: E402
from test_e2e_pd import PD, start_router  # noqa: E402

pytestmark = pytest.mark.e2e
# leases of 15 s (renewed every 3.75 s by the decode node's renewal thread): the requests here
# decode for longer than that, and the decode-killed test waits for one to expire
CFG = {**NEEDLE_CFG, "pd_read_timeout_s": 5.0, "pd_lease_s": 15.0}
RETRACT_EVERY = 16
RELEASED = re.compile(r"OasisKV PD: released request \S+: its sparse layers' KV in this node's host tier ([\d.]+) MiB "
                      r".* vs ([\d.]+) MiB allocated whole \((?:([\d.]+)x less|none held|all of it)\); host tier resident "
                      r"([\d.]+ MiB|-), requests from prefill nodes held: (\d+)")
PLANNED = re.compile(r"OasisKV PD: admitted request \S+ from \S+: (\d+) prompt tokens, .* first step's working set: "
                     r"its (\d+) prompt block pieces \(sparse layer x KV head x block\) planned on the prefill node")
ADMITTED = re.compile(r"OasisKV PD: admitted request \S+ from \S+: (\d+) prompt tokens, ([\d.]+) MiB at admission "
                      r".* vs ([\d.]+) MiB for a full transfer \(([\d.]+)x less\)")


class Deployment:
    """A prefill node and a decode node with ``--kv-sparse oasis`` and the router in front."""

    def __init__(self, model, cfg, name, prefill_rows=2, spec=(), retract=True, extra=()):
        self.model, self.cfg, self.name, self.spec, self.extra = model, cfg, name, list(spec), list(extra)
        self.bootstrap = free_port()
        self.prefill_rows = prefill_rows
        self.pf = self.dc = self.router = None
        self.pf = self.start_prefill()
        # SGLang's retraction test mode: every RETRACT_EVERY forward passes with two or more
        # requests running, one is retracted (as when decode KV slots run out)
        if retract:
            os.environ.update(SGLANG_TEST_RETRACT="1", SGLANG_TEST_RETRACT_INTERVAL=str(RETRACT_EVERY))
        try:
            self.dc = launch(model, 0, self.args() + ["--disaggregation-mode", "decode"], OUT / f"{name}_decode.log")
        finally:
            for k in ("SGLANG_TEST_RETRACT", "SGLANG_TEST_RETRACT_INTERVAL"):
                os.environ.pop(k, None)
        # no router retries: these tests stop and kill nodes and check that the requests fail. A
        # retry sent to a stopped prefill node waited out SGLang's 300 s WaitingForInput timeout on
        # the decode node (disagg/README.md, "Not built yet")
        self.url, self.router = start_router(self.pf.url, self.bootstrap, self.dc.url, retries=False)

    def args(self, **base):
        a = base_args(**base)
        if self.spec:               # SGLang's speculative workers on CPU run on intel_amx, not torch_native
            a = [("intel_amx" if x == "torch_native" else x) for x in a]
        return a + self.spec + self.extra + oasis_args(**self.cfg) + PD

    def start_prefill(self, port=0, suffix=""):
        return launch(self.model, port, self.args(max_running_requests=self.prefill_rows)
                      + ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(self.bootstrap)],
                      OUT / f"{self.name}_prefill{suffix}.log")

    def stop(self):
        if self.router is not None:
            self.router.kill()
            self.router = None
        for name in ("dc", "pf"):
            if getattr(self, name) is not None:
                getattr(self, name).stop()
                setattr(self, name, None)


@pytest.fixture(scope="module")
def pd(model):
    d = Deployment(model, CFG, "pd_oasis")
    yield d
    d.stop()


def test_greedy_through_router_equals_dense(model, tok, pd):
    prompts = short_prompts(tok)
    n_new = 24
    ref = [r[0] for r in dense_reference(model, prompts, n_new)]
    with cf.ThreadPoolExecutor(len(prompts)) as ex:        # together: the decode node runs them batched
        got = list(ex.map(lambda p: generate_ids(pd.url, p, n_new), prompts))
    for p, r, g in zip(prompts, ref, got):
        assert len(p) + n_new <= CFG["budget_tokens"]
        assert g == r, f"prompt of {len(p)} tokens: PD oasis {g} != dense {r}"
    dlog = pd.dc.log()
    assert "OasisKV decode:" in dlog, "the decode node's OasisKV decode path did not run"
    assert "OasisKV PD: host tier registered" in pd.pf.log()
    admitted = {int(m[0]): float(m[3]) for m in ADMITTED.findall(dlog)}
    assert set(admitted) >= {len(p) for p in prompts}, admitted
    # retracted mid-decode (the test mode above): recomputed by the prefill node and admitted
    # again with prompt + output so far, and still the dense server's tokens
    assert "Testing retraction" in dlog and "OasisKV PD: request" in dlog and " retracted " in dlog, \
        "no request was retracted"
    assert len(admitted) > len(prompts), admitted


@pytest.mark.skipif(has_cuda(), reason="on a GPU host NIXL keeps its busy progress thread unless "
                                        "OASIS_NIXL_PROGRESS_DELAY_US is set")
def test_idle_nodes_do_not_spin_the_cpu(pd):
    """Between requests neither node's processes use a core: nixl's Python API makes each NIXL
    agent's progress thread spin (``pthrDelay = 0``), four agents on a PD pair (SGLang's and
    OasisKV's on each node); on the CPU engine they pause 100 us between polls
    (``disagg.transport.set_progress_delay``, via ``fixes/pd_cpu.py`` for SGLang's)."""
    import psutil

    def tree_cpu(pid):
        ps = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
        total = 0.0
        for p in ps:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    time.sleep(2)                          # let the last request's work end
    before = {n: tree_cpu(getattr(pd, n).proc.pid) for n in ("pf", "dc")}
    time.sleep(4)
    used = {n: tree_cpu(getattr(pd, n).proc.pid) - before[n] for n in ("pf", "dc")}
    assert all(u < 1.0 for u in used.values()), f"CPU seconds in 4 s of idle: {used} (a spinning agent: 4 each)"


def test_prefill_pages_are_released_by_the_decode_node(tok, pd):
    """The prefill node has ``prefill_rows`` request rows; each transferred request holds one
    under its lease until the decode node releases it. More than twice as many requests in a row
    finish only if the releases arrive (the leases would hold them until ``pd_lease_s``)."""
    ids = tok.encode("The history of the printing press", add_special_tokens=False)

    def released():
        return max([0] + [int(m) for m in re.findall(
            r"OasisKV PD: freed \d+ lease\(s\); released by decode nodes: (\d+)", pd.pf.log())])

    before, n = released(), 2 * pd.prefill_rows + 1
    t0 = time.time()
    for i in range(n):
        generate_ids(pd.url, ids + [100 + i], 4)
    assert time.time() - t0 < 300
    for _ in range(60):                 # the last release may still be on its way
        if released() - before >= n:
            break
        time.sleep(1)
    assert released() - before == n, (before, released())
    last = re.findall(r"OasisKV PD: freed \d+ lease\(s\);.* held now: (\d+)", pd.pf.log())[-1]
    assert last == "0", "every lease was freed"


def test_pd_gpu_streams_the_decode_nodes_answer_and_times_its_first_token(tok, pd):
    """scripts/pd_gpu.py's request (both nodes at once, one bootstrap room, as the router sends
    it) against this deployment: the decode node's answer streamed, every token counted, the
    time to its first token measured and below the request's wall time."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pd_gpu", Path(__file__).resolve().parents[2] / "scripts" / "pd_gpu.py")
    pd_gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pd_gpu)
    ids = tok.encode("A short history of the telescope, from Lippershey to Hubble.", add_special_tokens=False)
    r = pd_gpu.pd_generate(pd.pf.url, pd.dc.url, pd.bootstrap, ids, 6, room=int(time.time() * 1000) % 2**62)
    assert r["prefill_status"] == 200 and r["decode_status"] == 200 and r["error"] is None, r
    assert r["output_tokens"] == 6, r
    assert r["ttft_s"] is not None and 0 < r["ttft_s"] < r["wall_s"], r


@pytest.mark.parametrize("tokens,depth", NEEDLE_CASES[-1:])       # the longest (the colocated tests run all)
def test_needles_through_router_at_budget_512(tok, pd, tokens, depth):
    p = needle.build(tok, tokens, depth)
    n = len(needle.chat_ids(tok, p.messages))
    assert n >= 4 * 512
    o = chat(pd.url, p.messages)
    assert p.answer in o, f"PD oasis (budget 512) lost the needle: {o!r}"
    lines = [l for l in pd.dc.log().splitlines() if "OasisKV decode:" in l]
    assert lines, "the decode node's OasisKV decode path did not run"
    assert "(budget 512)" in lines[-1]
    # what crossed at admission: dense layers' KV, summaries (bf16: 1 / 8 of the sparse layers'
    # fp32 keys), page numbers; the target is >= 4x less than a full transfer at block 8
    ratio = {int(m[0]): float(m[3]) for m in ADMITTED.findall(pd.dc.log())}
    assert ratio.get(n, 0) >= 4.0, (n, ratio)
    # what the decode node held of it in its host tier: the blocks it read, and those it decoded
    whole_min = n * 28 * 3 * 64 * 2 * 4 / 2**20        # its tokens' K/V: 28 sparse layers, 3 KV heads, fp32
    rel = []
    for _ in range(30):                                 # logged when the request's pages are freed
        rel = [m for m in RELEASED.findall(pd.dc.log()) if float(m[1]) >= whole_min]
        if rel:
            break
        time.sleep(1)
    assert rel, "no release line for the needle request"
    held, whole, less = float(rel[-1][0]), float(rel[-1][1]), float(rel[-1][2])
    assert less >= 2.0 and held < whole / 2, rel[-1]


def _idle_resident(log: str) -> list[str]:
    """The host tier's resident memory logged at each release that left no request held."""
    return [m[3] for m in RELEASED.findall(log) if m[4] == "0" and m[3] != "-"]


def _two_at_once(url, base, n_new, out):
    """Two 1600-token requests sent together (same length: they end in the same step)."""
    def one(i):
        body = {"input_ids": [base + i + j % 50 for j in range(1600)],
                "sampling_params": {"max_new_tokens": n_new, "ignore_eos": True}}
        out[i] = _post_quietly(url + "/generate", body)
    ts = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    return ts


def test_a_stopped_prefill_node_leaves_no_host_memory_behind(pd):
    """SIGSTOP the prefill node for 15 s (its lease length) while two requests decode from it:
    both end with an error (a READ did not end within ``pd_read_timeout_s``), the decode node
    stays healthy, and once it holds no request again its host tier holds what it held before,
    also after a further round of two requests ending in one step (SGLang frees them in one
    free group; their blocks share OS pages once its free list is shuffled: the tier had grown
    by 3-28 MiB per round before the group's pages counted as free)."""
    import psutil

    mark = len(pd.dc.log())
    generate_ids(pd.url, [300 + j % 40 for j in range(100)], 2)
    for _ in range(30):
        before = _idle_resident(pd.dc.log()[mark:])
        if before:
            break
        time.sleep(1)
    assert before, "no idle release line"
    n0, out = len(ADMITTED.findall(pd.dc.log())), {}
    ts = _two_at_once(pd.url, 400, 160, out)
    t0 = time.time()
    while len(ADMITTED.findall(pd.dc.log())) < n0 + 2:
        assert time.time() - t0 < 300, "the two requests were not admitted"
        time.sleep(0.5)
    time.sleep(2)
    procs = [psutil.Process(pd.pf.proc.pid)]
    procs += procs[0].children(recursive=True)
    for p in procs:
        p.suspend()
    try:
        time.sleep(CFG["pd_lease_s"] - 1)
        assert requests.get(pd.dc.url + "/health", timeout=30).status_code == 200
    finally:
        for p in procs:
            p.resume()
    for t in ts:
        t.join(600)
    log = pd.dc.log()[mark:]
    assert "its prefill node was lost" in log, out
    assert any(v != 200 for v in out.values()), ("the router retries nothing here: the error reaches the client", out)
    ts = _two_at_once(pd.url, 500, 40, out)
    for t in ts:
        t.join(600)
    assert out == {0: 200, 1: 200}, out
    for _ in range(30):
        after = _idle_resident(pd.dc.log()[mark:])
        if len(after) > len(before):
            break
        time.sleep(1)
    assert after[-1] == before[0], (before, after)
    assert requests.get(pd.dc.url + "/health", timeout=30).status_code == 200


def kill_prefill_mid_decode(tok, pd) -> int:
    """Send a 2048-token request through the router, kill the prefill process once the decode
    node admitted it (it then reads blocks every few steps) and check that the request ends
    with an error within 120 s. Returns the length of the decode node's log before the request."""
    p = needle.build(tok, 2048, 0.3)
    body = {"model": "m", "messages": p.messages, "max_tokens": 300, "temperature": 0,
            "ignore_eos": True}
    mark = len(pd.dc.log())
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(lambda: requests.post(pd.url + "/v1/chat/completions", json=body, timeout=600))
        n = len(needle.chat_ids(tok, p.messages))
        t0 = time.time()
        while time.time() - t0 < 600 and n not in [int(m[0]) for m in ADMITTED.findall(pd.dc.log()[mark:])]:
            assert not fut.done(), fut.result().text
            time.sleep(0.5)
        pd.pf.stop()
        t_kill = time.time()
        r = fut.result(timeout=300)
    assert r.status_code != 200 or "error" in r.text.lower() or r.json()["choices"][0]["finish_reason"] == "abort", r.text
    assert time.time() - t_kill < 120
    return mark


def _restart_prefill(pd, suffix: str) -> None:
    """A new prefill node on the same ports (the router knows that URL and bootstrap port)."""
    port = int(pd.pf.url.rsplit(":", 1)[1])
    pd.pf.stop()
    wait_port_free(port)
    pd.pf = pd.start_prefill(port=port, suffix=suffix)


def _first_request_is_served(pd) -> None:
    """The first request after a prefill restart that the router sends on is served (the decode
    node reads from the new process, not from the old one's NIXL agent it knew)."""
    mark = len(pd.dc.log())
    t0 = time.time()
    while True:         # the router sends nothing to the new node until its health check passes
        r = requests.post(pd.url + "/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 4}},
                          timeout=300)
        if r.status_code != 503 or "server_selection_failed" not in r.text or time.time() - t0 > 300:
            break
        time.sleep(2)
    assert r.status_code == 200, r.text
    log = pd.dc.log()[mark:]
    assert "cannot be admitted" not in log and "prefill node was lost" not in log, log[-3000:]


def test_prefill_killed_mid_decode(model, tok, pd):
    """Kill the prefill process while the decode node still reads blocks from it: the request
    ends with an error in bounded time, the decode node stays healthy and serves the next
    request from a restarted prefill node. Then kill that one while its request reads nothing
    more (its context fits the budget): the renewal of its lease finds the process gone (NIXL's
    remote-disconnect error) and ends it, long before the lease would turn stale; and kill the
    next one while it serves nothing: the first request after its restart is served."""
    mark = kill_prefill_mid_decode(tok, pd)
    assert "its prefill node was lost" in pd.dc.log()[mark:]
    assert requests.get(pd.dc.url + "/health", timeout=30).status_code == 200
    # the decode node gave back the lost request's rows and pages (SGLang's idle memory check
    # passes: it stops the server on a leak) and holds no request from a prefill node
    rel = RELEASED.findall(pd.dc.log()[mark:])
    assert rel and rel[-1][4] == "0", rel
    assert "leak" not in pd.dc.log().lower()
    _restart_prefill(pd, "_restarted")
    _first_request_is_served(pd)

    # a request that reads nothing after its first step (a short prompt, budget 512)
    body = {"model": "m", "messages": [{"role": "user", "content": "Count from one to one thousand."}],
            "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
    mark = len(pd.dc.log())
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(lambda: requests.post(pd.url + "/v1/chat/completions", json=body, timeout=600))
        t0 = time.time()
        while "OasisKV PD: admitted request" not in pd.dc.log()[mark:]:
            assert not fut.done(), fut.result().text
            assert time.time() - t0 < 300, "the decode node did not admit the request in 300 s"
            time.sleep(0.5)
        time.sleep(2)                    # decoding, nothing left to read
        pd.pf.stop()
        t_kill = time.time()
        r = fut.result(timeout=300)
        ended = time.time() - t_kill
    assert r.status_code != 200 or "error" in r.text.lower() or r.json()["choices"][0]["finish_reason"] == "abort", \
        r.text[:2000]
    log = pd.dc.log()[mark:]
    assert "lost (renewing a lease:" in log and "its prefill node was lost" in log, log[-3000:]
    assert "last renewed" not in log, "ended by its lease turning stale, not by the failed renewal"
    assert ended < 0.9 * CFG["pd_lease_s"] + 5, ended
    assert requests.get(pd.dc.url + "/health", timeout=30).status_code == 200
    _restart_prefill(pd, "_restarted2")
    _first_request_is_served(pd)

    # an idle prefill node restarted: the decode node read nothing from the old process since
    _restart_prefill(pd, "_restarted3")
    _first_request_is_served(pd)
    assert "is a new process" in pd.dc.log()
    assert "leak" not in pd.dc.log().lower()


def _post_quietly(url, body):
    try:
        return requests.post(url, json=body, timeout=600).status_code
    except requests.RequestException as e:
        return repr(e)


def test_decode_killed_mid_decode(tok, pd):
    """Kill the decode process while it decodes a request: nothing tells the prefill node, but
    the renewals stop, so it frees the request's lease (its pages and request row) within
    ``pd_lease_s``; its idle memory check then passes and it stays healthy. (The last test of
    this deployment: its decode node is not restarted.)"""
    import threading

    assert requests.get(pd.pf.url + "/health", timeout=30).status_code == 200, "the prefill node is not serving"
    p = needle.build(tok, 2048, 0.5)
    # long enough to decode well past 1.5 leases on a fast CPU too (it is killed before the end)
    body = {"model": "m", "messages": p.messages, "max_tokens": 5000, "temperature": 0, "ignore_eos": True}
    mark_d, mark_p = len(pd.dc.log()), len(pd.pf.log())
    answer = []
    # the router keeps the client waiting after the decode node died: the request is left to
    # its own timeout on a daemon thread, not awaited
    threading.Thread(target=lambda: answer.append(_post_quietly(pd.url + "/v1/chat/completions", body)),
                     daemon=True).start()
    n = len(needle.chat_ids(tok, p.messages))
    t0 = time.time()
    while n not in [int(m[0]) for m in ADMITTED.findall(pd.dc.log()[mark_d:])]:
        assert not answer, answer
        assert time.time() - t0 < 600, "the decode node did not admit the request in 600 s"
        time.sleep(0.5)
    time.sleep(1.5 * CFG["pd_lease_s"])               # decoding past its lease: only renewals keep it
    assert "expired: no release or renewal" not in pd.pf.log()[mark_p:], "a live decode node's lease expired"
    assert not answer, answer                         # still decoding
    pd.dc.stop()
    pd.dc = None
    t_kill = time.time()
    freed = None
    while time.time() - t_kill < CFG["pd_lease_s"] + 60:
        log = pd.pf.log()[mark_p:]
        held = re.findall(r"OasisKV PD: freed \d+ lease\(s\);.* held now: (\d+)", log)
        if "expired: no release or renewal from its decode node" in log and held and held[-1] == "0":
            freed = time.time() - t_kill
            break
        time.sleep(1)
    assert freed is not None, pd.pf.log()[mark_p:][-3000:]
    assert freed < CFG["pd_lease_s"] + 30, freed
    time.sleep(3)                                     # an idle loop or two: SGLang's memory check runs
    assert "leak" not in pd.pf.log()[mark_p:].lower()
    assert requests.get(pd.pf.url + "/health", timeout=30).status_code == 200


def test_first_step_planned_on_the_prefill_node(model, tok, pd):
    """``predictor: previous`` on both nodes, prompts prefilled in chunks of 256 tokens: each
    request is sent in one piece with its last chunk, carrying the first decode step's working
    set the prefill node planned with the last prompt token's query (``pd_first_step``); the
    decode node reads those blocks at admission and installs them, so no request's first step
    selects synchronously, and greedy output equals the dense server's when the budget covers
    the context. A 5,000-token prompt (budget 512, block 8): what crossed at admission, the
    first step's blocks included, is >= 4x less than a full transfer (issue 19's target)."""
    pd.stop()                  # one deployment at a time on the CI machine
    d = Deployment(model, {**CFG, "predictor": "previous"}, "pd_oasis_planned", retract=False,
                   extra=["--chunked-prefill-size", "256"])
    try:
        prompts = short_prompts(tok)
        ref = [r[0] for r in dense_reference(model, prompts, 24)]
        got = [generate_ids(d.url, p, 24) for p in prompts]
        for p, r, g in zip(prompts, ref, got):
            assert g == r, f"prompt of {len(p)} tokens: PD oasis (planned first step) {g} != dense {r}"
        long = tok.encode(" ".join(t for _, t in essay_texts()), add_special_tokens=False)[:5000]
        assert len(generate_ids(d.url, long, 8)) == 8
        dlog = d.dc.log()
        planned = {int(m[0]): int(m[1]) for m in PLANNED.findall(dlog)}
        assert set(planned) >= {len(p) for p in prompts} | {len(long)}, planned
        # every (sparse layer, KV head) holds at least one of its blocks; the long prompt's plan
        # is a working set (budget 512 = 64 blocks), not the whole prompt
        assert all(n >= 28 * 3 for n in planned.values()), planned
        assert planned[len(long)] <= 28 * 3 * 64 < 28 * 3 * -(-len(long) // 8)
        ratio = {int(m[0]): float(m[3]) for m in ADMITTED.findall(dlog)}
        assert ratio[len(long)] >= 4.0, ratio
        assert "selected here" not in dlog
        lines = [l for l in dlog.splitlines() if "OasisKV decode:" in l]
        assert lines and "predictor: previous" in lines[-1]
        # one synchronous step at most: SGLang's own warm-up request (no prefill node planned it)
        # decodes before any line is logged; none of the requests above added one
        sync = [int(x) for x in re.findall(r"fallback synchronous steps: (\d+),", "\n".join(lines))]
        assert len(set(sync)) == 1 and sync[0] <= 1, sync
    finally:
        d.stop()


@pytest.mark.skipif(not extra_e2e(), reason="opt-in: OASIS_E2E_EXTRA=1 (a second PD deployment, ~6 min on 2 cores)")
def test_eagle3_drafts_through_router_equal_dense(model, tok, pd):
    """EAGLE-3 on both nodes (random-weight draft head, ``predictor: lookahead``): the draft
    model's KV is sent whole by SGLang's transfer and counted at admission; the decode node's
    paired forward (drafts as look-ahead probes, all rejected) gives the dense server's tokens."""
    from oasis_sglang.models import prepare_smollm2_eagle3

    pd.stop()                  # the last test: free the CPU and memory for this deployment
    spec = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(prepare_smollm2_eagle3()),
            "--speculative-num-steps", "1", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "2",
            "--decode-log-interval", "4"]
    cfg = {**CFG, "predictor": "lookahead", "kernels": "torch"}
    # 4 prefill rows: with 2 (one held by a lease) two of three concurrent requests stayed in the
    # prefill node's bootstrap queue until SGLang's transfer timeout (seen once, not investigated)
    d = Deployment(model, cfg, "pd_oasis_eagle3", prefill_rows=4, spec=spec, retract=False)
    try:
        prompts = short_prompts(tok)
        ref = [r[0] for r in dense_reference(model, prompts, 24)]
        with cf.ThreadPoolExecutor(len(prompts)) as ex:
            got = list(ex.map(lambda p: generate_ids(d.url, p, 24), prompts))
        for p, r, g in zip(prompts, ref, got):
            assert g == r, f"prompt of {len(p)} tokens: PD oasis + EAGLE-3 {g} != dense {r}"
        dlog = d.dc.log()
        lines = [l for l in dlog.splitlines() if "OasisKV decode:" in l]
        assert lines and "predictor: lookahead" in lines[-1] and "draft match: " in lines[-1], lines[-1:]
        adm = [l for l in dlog.splitlines() if "OasisKV PD: admitted request" in l and "draft model's KV" in l]
        assert len(adm) >= len(prompts), "the draft model's KV was not counted at admission"
        # lookahead plans ahead: every first step was planned on the prefill node, none selected here
        assert set(int(m[0]) for m in PLANNED.findall(dlog)) >= {len(p) for p in prompts}
        sync = [int(x) for x in re.findall(r"fallback synchronous steps: (\d+),", "\n".join(lines))]
        assert len(set(sync)) == 1 and sync[0] <= 1, sync
    finally:
        d.stop()
