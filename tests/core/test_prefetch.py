"""The asynchronous prefetch pipeline and its predictors (``core.prefetch``, ``core.engine``).

CPU runs the stages inline; on CUDA (the GPU smoke) the same tests run the three streams, and
``test_streams_equal_inline`` compares them with the inline CPU result.
"""

import logging

import pytest
import torch

from oasis_sglang.config import OasisConfig, OasisConfigError
from oasis_sglang.core import OasisSparseKV
from oasis_sglang.core.bench_hooks import BenchHooks
from oasis_sglang.core.attention import decode_attention
from oasis_sglang.core.ops import TorchKVOps
from oasis_sglang.core.prefetch import PREDICTORS, get_predictor
from oasis_sglang.core.report import finish, snapshot

BS, H, HQ, D = 4, 2, 6, 16          # D >= 16: the Triton kernels (CUDA-graph test) need it
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _engine(budget, predictor, fetch_cap=None, rows=4, device="cpu", measure=False, layers=3, padding_row=None,
            ops=None, pd_read_mode="deferred", host_slots=None):
    cfg = OasisConfig(budget_tokens=budget, block_size=BS, sink_blocks=1, recent_blocks=2, dense_layers=(0,),
                      fetch_cap=fetch_cap, predictor=predictor, measure_agreement=measure, pd_read_mode=pd_read_mode)
    return OasisSparseKV(cfg, layers, 1024, rows, H, D, D, torch.float32, device, ops=ops, padding_row=padding_row,
                         host_slots=host_slots)


class Run:
    """Prefill then decode several requests through every sparse layer, with truth kept on the host."""

    def __init__(self, eng, rows, n_prompt, n_total, device="cpu"):
        self.eng, self.rows, self.dev = eng, torch.tensor(rows), device
        B = len(rows)
        self.rt = torch.zeros(eng.ws.R, 512, dtype=torch.int32, device=device)
        pages = torch.randperm(1024 // BS - 1) + 1       # page 0 reserved, as SGLang's allocator does (padding)
        self.K = {l: torch.randn(B, n_total, H, D) for l in eng.sparse_layers}
        self.V = {l: torch.randn(B, n_total, H, D) for l in eng.sparse_layers}
        self.Q = {l: torch.randn(B, n_total, HQ, D) for l in eng.sparse_layers}   # fresh each step: worst drift
        self.Qd = {l: torch.randn(B, n_total, HQ, D) for l in eng.sparse_layers}
        per = -(-n_total // BS)
        for b, r in enumerate(rows):
            p = pages[b * per:(b + 1) * per]
            self.rt[r, :n_total] = (p[:, None] * BS + torch.arange(BS)).reshape(-1)[:n_total].to(device, torch.int32)
        self.n_prompt, self.t = n_prompt, n_prompt

    def loc(self, t):
        return self.rt[self.rows.to(self.dev), t].long()

    def prefill(self):
        e, n, B = self.eng, self.n_prompt, len(self.rows)
        for l in e.sparse_layers:
            locs = self.rt[self.rows.to(self.dev), :n].reshape(-1).long()
            k = self.K[l][:, :n].reshape(-1, H, D).to(self.dev)
            v = self.V[l][:, :n].reshape(-1, H, D).to(self.dev)
            e.write_kv(l, locs, k, v)
            e.extend_attention(l, self.Q[l][:, :n].reshape(-1, HQ, D).to(self.dev), self.rows.to(self.dev),
                               torch.zeros(B, dtype=torch.long), torch.full((B,), n), self.rt, None, k, v)

    def step(self, draft=False, hook=None, host=False):
        """One decode step (token ``self.t``) through every sparse layer; returns {layer: out}.
        ``host``: pass the rows and lengths as host integers too (what the SGLang glue does)."""
        e, t, outs = self.eng, self.t, {}
        seq = torch.full((len(self.rows),), t + 1)
        hk = dict(rows_host=self.rows.tolist(), seq_lens_host=seq.tolist()) if host else {}
        e.begin_decode_step(self.rows.to(self.dev), seq.to(self.dev), self.rt, max_seq_len=t + 1, **hk)
        for l in e.sparse_layers:
            if hook:
                hook(l)
            k, v = self.K[l][:, t].to(self.dev), self.V[l][:, t].to(self.dev)
            e.write_kv(l, self.loc(t), k, v, decode=True)
            kw = dict(hk)
            if draft:
                kw.update(q_draft=self.Qd[l][:, t].to(self.dev), k_draft=torch.randn(len(self.rows), H, D).to(self.dev),
                          v_draft=torch.randn(len(self.rows), H, D).to(self.dev))
            outs[l] = e.decode_attention(l, self.Q[l][:, t].to(self.dev), k, v, None,
                                         **{a: b for a, b in kw.items() if a not in hk})
            if draft:
                outs[l] = (outs[l], kw)
        self.t += 1
        return outs


def _resident_positions(ids_row_head, n):
    return sorted(p for b in ids_row_head.tolist() if b >= 0 for p in range(b * BS, min(n, b * BS + BS)))


@pytest.mark.parametrize("device", DEVICES)
def test_previous_predictor_attends_the_blocks_predicted_one_step_ahead(seed, device):
    """Each step attends exactly over the top-K predicted at the previous step (or at the end of
    the prefill) from that step's query, with the summaries as they were then."""
    eng = _engine(16, "previous", device=device)                      # 4 blocks of 4: 1 sink + 2 recent + 1
    run = Run(eng, [1, 3], 30, 60, device)
    run.prefill()
    ref = TorchKVOps()
    prev_q = {l: run.Q[l][:, run.n_prompt - 1] for l in eng.sparse_layers}
    for _ in range(30):
        li = {l: eng.index[l] for l in eng.sparse_layers}
        snap = {l: eng.ws.ids[li[l]][run.rows.to(device)].cpu().clone() for l in eng.sparse_layers}
        summ = {l: (eng.summaries.kmin[li[l]].clone(), eng.summaries.kmax[li[l]].clone()) for l in eng.sparse_layers}
        t = run.t
        outs = run.step()
        for l in eng.sparse_layers:
            kmin, kmax = summ[l]
            wanted, _ = ref.select_topk(prev_q[l].to(device), kmin, kmax, run.rt, run.rows.to(device),
                                        torch.full((2,), t + 1, device=device), BS, 1, 2, -(-(t + 1) // BS), 4)
            for b in range(2):
                for h in range(H):
                    assert set(snap[l][b, h].tolist()) - {-1} == set(wanted[b, h].cpu().tolist()) - {-1}, (t, l, b, h)
                    pos = _resident_positions(snap[l][b, h], t + 1)
                    assert t in pos and 0 in pos
                k = torch.stack([run.K[l][b, _resident_positions(snap[l][b, h], t + 1), h] for h in range(H)], 1)
                v = torch.stack([run.V[l][b, _resident_positions(snap[l][b, h], t + 1), h] for h in range(H)], 1)
                torch.testing.assert_close(outs[l][b].cpu(), decode_attention(run.Q[l][b, t], k, v, None),
                                           rtol=1e-5, atol=1e-5)
            prev_q[l] = run.Q[l][:, t]
    assert eng.stats.sync_steps == 0, "every step was predicted"
    assert eng.residency()["evicted_blocks"] > 0


def test_lookahead_predicts_from_the_draft_query_and_never_writes_draft_kv(seed):
    eng = _engine(16, "lookahead")
    run = Run(eng, [0, 2], 30, 50)
    run.prefill()
    for _ in range(12):
        t = run.t
        host_k = [x.clone() for x in eng.host.k]
        kmin = [x.clone() for x in eng.summaries.kmin]
        outs = run.step(draft=True)
        for l in eng.sparse_layers:
            o, kw = outs[l]
            li = eng.index[l]
            assert o.shape == (2, 2, HQ, D)
            # the prediction for step t+1 is the draft query's top-K
            wanted, _ = TorchKVOps().select_topk(kw["q_draft"], eng.summaries.kmin[li], eng.summaries.kmax[li], run.rt,
                                                 run.rows, torch.full((2,), t + 2), BS, 1, 2, -(-(t + 2) // BS), 4)
            ids = eng.ws.ids[li][run.rows]
            for b in range(2):
                for h in range(H):
                    assert set(ids[b, h].tolist()) - {-1} == set(wanted[b, h].tolist()) - {-1}
        # the draft row's K/V reached neither the host tier nor the summaries: only token t did
        for li in range(len(eng.sparse_layers)):
            assert torch.equal(eng.host.k[li], host_k[li]) or (t + 1) % BS == 0
        pages_t = set((run.rt[run.rows, t].long() // BS).tolist())
        for li in range(len(eng.sparse_layers)):
            changed = (eng.summaries.kmin[li] != kmin[li]).any(-1).any(-1).nonzero().flatten().tolist()
            assert set(changed) <= pages_t


def test_draft_row_attends_working_set_new_token_and_itself(seed):
    eng = _engine(64, "lookahead")                                   # budget >= context: dense
    run = Run(eng, [1], 20, 30)
    run.prefill()
    t = run.t
    outs = run.step(draft=True)
    for l in eng.sparse_layers:
        o, kw = outs[l]
        k = torch.cat([run.K[l][0, :t + 1], kw["k_draft"]])
        v = torch.cat([run.V[l][0, :t + 1], kw["v_draft"]])
        torch.testing.assert_close(o[0, 1], decode_attention(kw["q_draft"][0], k, v, None), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(o[0, 0], decode_attention(run.Q[l][0, t], k[:-1], v[:-1], None), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cap", [1, 2, 3])
@pytest.mark.parametrize("predictor", ["previous", "lookahead"])
def test_capped_eviction_bounds_traffic_under_prediction_drift(seed, cap, predictor):
    """Fresh random queries every step (worst drift): after the first step, at most ``fetch_cap``
    blocks are copied per step, request, layer and KV head, and the budget always holds."""
    eng = _engine(32, predictor, fetch_cap=cap)                       # 8 blocks
    run = Run(eng, [0, 1, 3], 40, 120)
    run.prefill()
    run.step(draft=predictor == "lookahead")
    L = len(eng.sparse_layers)
    copied = eng.counters[:, 1].sum().item()
    for _ in range(60):
        run.step(draft=predictor == "lookahead")
        now = eng.counters[:, 1].sum().item()
        assert now - copied <= cap * 3 * H * L, "fetch_cap exceeded"
        copied = now
        held = (eng.ws.ids[:, run.rows] >= 0).sum(-1)
        assert (held <= 8).all()
        ids = eng.ws.ids[:, run.rows]
        nb = -(-(run.t + 1) // BS)
        for blk in (0, nb - 1, nb - 2):                                # sink and recent: always resident
            assert (ids == blk).any(-1).all(), blk
    r = eng.residency()
    assert r["evicted_blocks"] > 0 and r["sync_steps"] == 0


@pytest.mark.parametrize("host", [False, True])
def test_unpredicted_context_falls_back_to_synchronous_selection(seed, host):
    """A request whose context differs from the predicted one (e.g. resumed after a skipped
    step) is served by the current query, exactly as the ``current`` predictor would. With
    ``host`` the decision comes from the host mirror (no device read), confirmed on the device
    at every step here."""
    a, b = _engine(16, "previous"), _engine(16, "current")
    a.bench.host_check_interval = 1
    torch.manual_seed(7)
    ra = Run(a, [2], 20, 40)
    torch.manual_seed(7)
    rb = Run(b, [2], 20, 40)
    for r in (ra, rb):
        r.prefill()
        r.t += 1                                                       # the context jumps by one token
    oa, ob = ra.step(host=host), rb.step()
    assert a.stats.sync_steps == 1
    for l in a.sparse_layers:
        assert torch.equal(oa[l], ob[l])
    ra.step(host=host)
    assert a.stats.sync_steps == 1, "predicted again from the next step on"
    assert (a.record.host is not None) == host, "the mirror agreed with the device at every step"
    before = dict(a.record.host or {})
    a.residency()
    if host:
        assert a.record.host == before, "and with the device's whole record"
    else:
        assert a.record.host == {2: ra.t + 1}, "a record dropped for lack of host rows is rebuilt at the report"


def test_host_mirror_follows_resets_and_is_rebuilt_at_reports(seed):
    eng = _engine(16, "previous")
    eng.bench.host_check_interval = 1
    run = Run(eng, [1, 2], 20, 40)
    run.prefill()
    assert eng.record.host == {1: 21, 2: 21}, "the prefill predicts the first decode step"
    run.step(host=True)
    assert eng.stats.sync_steps == 0 and eng.record.host == {1: 22, 2: 22}
    eng.reset_rows([1])
    assert eng.record.host == {2: 22}
    run.step(host=True)                     # row 1 lost its prediction: this step selects synchronously
    assert eng.stats.sync_steps == 1 and eng.record.host is not None
    eng.record.host[2] += 5                  # a corrupted record is caught at the next report ...
    eng.residency()
    assert eng.record.host == {1: run.t + 1, 2: run.t + 1}, "... and rebuilt from the device"
    run.step()                              # a caller without host values: the mirror is dropped ...
    assert eng.record.host is None and not eng.can_replay([1, 2], [run.t + 1] * 2)
    run.t += 1
    run.step(host=True)                     # ... the device record decides meanwhile ...
    assert eng.stats.sync_steps == 2
    eng.residency()                         # ... until the next report rebuilds the host record
    assert eng.record.host == {1: run.t + 1, 2: run.t + 1} and eng.can_replay([1, 2], [run.t + 1] * 2)
    with pytest.raises(ValueError, match="rows_host"):
        eng.begin_decode_step(run.rows, torch.full((2,), run.t + 1), run.rt, rows_host=[1], seq_lens_host=[3])


def test_reset_rows_drops_predictions_and_slots(seed):
    eng = _engine(16, "previous")
    run = Run(eng, [1, 2], 20, 30)
    run.prefill()
    run.step()
    eng.reset_rows([1])
    assert (eng.ws.ids[:, 1] == -1).all() and int(eng.record.seq[1]) == -1
    assert int(eng.record.seq[2]) == run.t + 1


@pytest.mark.parametrize("device", DEVICES)
def test_a_snapshot_reports_the_step_it_was_taken_at(seed, device):
    """``snapshot`` copies the report's device values at its point of the stream; ``finish`` reads
    them later, after more steps ran: the report is the snapshot's, equal to ``residency`` then."""
    eng = _engine(16, "previous", fetch_cap=1, device=device, measure=True)
    run = Run(eng, [1, 2], 20, 40, device)
    run.prefill()
    for _ in range(3):
        run.step(host=True)
    now = eng.residency()
    snap = snapshot(eng, {"draft_match": torch.tensor([3, 4], device=device)})
    for _ in range(4):
        run.step(host=True)                     # admits and evicts more blocks
    later = finish(eng, snap)
    assert later.pop("draft_match") == [3, 4]
    for r in (now, later):
        r.pop("exposed_wait_ms")
    assert later == now
    assert eng.residency()["decode_steps"] == now["decode_steps"] + 4
    assert eng.residency()["admitted_blocks"] > now["admitted_blocks"], "the later steps admitted blocks"
    with pytest.raises(ValueError, match="counters"):
        snapshot(eng, {"counters": torch.zeros(1, device=device)})


def test_a_snapshot_that_finds_the_mirror_wrong_rebuilds_it_and_raises_on_a_miss(seed, caplog):
    """The async report's checks: a host mirror that disagrees with the device record copied with it
    is logged and rebuilt from the device when the report is read; an untrusted mirror (a step came
    without host rows) is rebuilt before the copy; a token that missed its block raises when the
    report is read."""
    eng = _engine(16, "previous")
    run = Run(eng, [1, 2], 20, 40)
    run.prefill()
    run.step(host=True)
    eng.record.host[2] += 5
    snap = snapshot(eng)
    with caplog.at_level(logging.ERROR, logger="oasis_sglang.core.prediction"):
        r = finish(eng, snap)
    assert r["prediction_check"] == "device" and eng.record.host == {1: 22, 2: 22}
    assert "2: (27, 22)" in caplog.text
    eng.record.distrust()
    snap = snapshot(eng)                         # untrusted: rebuilt (a host read) before the copy
    assert eng.record.host == {1: 22, 2: 22} and finish(eng, snap)["prediction_check"] == "host"
    eng.ws.violations += 2
    snap = snapshot(eng)
    with pytest.raises(RuntimeError, match="2 decoded token"):
        finish(eng, snap)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy is asynchronous only on CUDA")
@pytest.mark.gpu
def test_a_snapshot_does_not_wait_for_the_device(seed):
    """With ~0.2 s of work queued, ``snapshot`` returns at once and is not ``ready``; ``finish``
    then waits for it and gives the report of that point (the overlap scheduler's GPU runs a step
    ahead of the host: a report must not make the host wait)."""
    import time

    from oasis_sglang.kernels import get_kv_ops

    eng = _engine(16, "previous", device="cuda", ops=get_kv_ops("triton"))
    run = Run(eng, [1, 2], 20, 40, "cuda")
    run.prefill()
    run.step(host=True)
    now = eng.residency()
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)
    t = time.perf_counter()
    snap = snapshot(eng)
    took = time.perf_counter() - t
    assert not snap.ready() and took < 0.05, took
    r = finish(eng, snap)
    assert snap.ready()
    for x in (now, r):
        x.pop("exposed_wait_ms")
    assert r == now


@pytest.mark.skipif(not torch.cuda.is_available(), reason="streams exist only on CUDA")
@pytest.mark.gpu
def test_reset_from_another_stream_waits_for_the_forward(seed):
    """SGLang's overlap scheduler frees a finished request from its own stream while the forward
    that still decodes it is queued on the forward stream: the reset must land after that
    forward's writes to the row. The forward (Triton kernels: no host sync while it is queued)
    is held back on its stream by a spin, so without the ordering the reset runs first."""
    from oasis_sglang.kernels import get_kv_ops

    cfg = OasisConfig(budget_tokens=16, block_size=BS, sink_blocks=1, recent_blocks=2, dense_layers=(0,),
                      fetch_cap=2, predictor="current")
    eng = OasisSparseKV(cfg, 3, 1024, 4, H, D, D, torch.float32, "cuda", ops=get_kv_ops("triton"))
    run = Run(eng, [1, 2], 20, 30, "cuda")
    run.prefill()
    run.step()
    t = run.t
    rows, seq, loc = run.rows.cuda(), torch.full((2,), t + 1, device="cuda"), run.loc(t)
    x = {l: (run.Q[l][:, t].cuda(), run.K[l][:, t].cuda(), run.V[l][:, t].cuda()) for l in eng.sparse_layers}
    torch.cuda.synchronize()
    fwd, sched = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(fwd):
        torch.cuda._sleep(200_000_000)   # ~0.1 s
        eng.begin_decode_step(rows, seq, run.rt, max_seq_len=t + 1)
        for l in eng.sparse_layers:      # rewrites rows 1 and 2's block tables and slots
            q, k, v = x[l]
            eng.write_kv(l, loc, k, v, decode=True)
            eng.decode_attention(l, q, k, v, None)
    with torch.cuda.stream(sched):
        eng.reset_rows([1])
    torch.cuda.synchronize()
    assert (eng.ws.ids[:, 1] == -1).all(), "the reset ran before the forward that was still writing the row"
    assert (eng.ws.ids[:, 2] >= 0).any() and int(eng.record.seq[1]) == -1


def test_no_transfer_ablation_plans_admissions_but_copies_nothing(seed, monkeypatch):
    """OASIS_ABLATE=no-transfer (bench_oasis --suite stall): the same admissions are planned and
    counted, but the admitted slots keep what they held; an unknown ablation is refused."""
    outs = {}
    for ablate in ("", "no-transfer"):
        monkeypatch.setenv("OASIS_ABLATE", ablate)
        torch.manual_seed(seed)
        eng = _engine(16, "previous", fetch_cap=2)
        eng.bench = BenchHooks.from_env()
        run = Run(eng, [1, 2], 40, 60)
        run.prefill()
        for _ in range(4):
            run.step()
        outs[ablate] = (eng.ws.ids.clone(), eng.counters.clone(), eng.ws.k[0].clone())
    assert torch.equal(outs[""][0], outs["no-transfer"][0]) and torch.equal(outs[""][1], outs["no-transfer"][1])
    assert int(outs[""][1][:, 1].sum()) > 0                      # blocks were admitted
    assert not torch.equal(outs[""][2], outs["no-transfer"][2])  # ... and only the normal run copied them
    monkeypatch.setenv("OASIS_ABLATE", "no-copy")
    with pytest.raises(OasisConfigError, match="OASIS_ABLATE"):
        BenchHooks.from_env()
    with pytest.raises(TypeError, match="BenchHooks"):
        _engine(16, "previous").bench = {"skip_admission_copy": True}


def test_agreement_measurement(seed):
    """budget >= context: the prediction holds the whole true top-K (agreement 1.0); with fresh
    random queries each step and a small budget it cannot (agreement < 1)."""
    full = _engine(256, "previous", measure=True)
    run = Run(full, [0], 40, 60)
    run.prefill()
    for _ in range(10):
        run.step()
    assert full.residency()["agreement"] == [1.0, 1.0]
    small = _engine(24, "previous", measure=True)
    run = Run(small, [0, 1], 60, 100)
    run.prefill()
    for _ in range(20):
        run.step()
    ag = small.residency()["agreement"]
    assert all(0.0 <= x < 1.0 for x in ag), ag


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the stage streams exist only on CUDA")
def test_streams_equal_inline(seed):
    """Three CUDA streams with per-layer events give the same working sets and outputs as the
    inline CPU run (torch references on both: exact for the tables, close for attention)."""
    state = torch.random.get_rng_state()
    outs = {}
    for dev in ("cpu", "cuda"):
        torch.random.set_rng_state(state)
        eng = _engine(32, "lookahead", fetch_cap=2, rows=8, device=dev)
        run = Run(eng, [0, 3, 5, 7], 100, 160, dev)
        run.prefill()
        res = [run.step(draft=True) for _ in range(40)]
        outs[dev] = (eng.ws.ids.cpu(), [{l: o[0].cpu() for l, o in r.items()} for r in res], eng.residency())
    assert torch.equal(outs["cpu"][0], outs["cuda"][0])
    for a, b in zip(outs["cpu"][1], outs["cuda"][1]):
        for l in a:
            torch.testing.assert_close(a[l], b[l], rtol=1e-4, atol=1e-4)
    for key in ("hit_blocks", "admitted_blocks", "evicted_blocks", "bytes_h2d", "bytes_d2h"):
        assert outs["cpu"][2][key] == outs["cuda"][2][key], key
    assert len(outs["cuda"][2]["exposed_wait_ms"]) == 2


def test_predictor_registry_and_config():
    assert set(PREDICTORS) == {"lookahead", "previous", "current"}
    assert get_predictor("current").asynchronous is False
    assert OasisConfig().predictor_for(True) == "lookahead"
    assert OasisConfig().predictor_for(False) == "current"
    # SGLang's n-gram drafter is no draft model: auto stays synchronous, lookahead is asked for
    assert OasisConfig().predictor_for(True, model_free_draft=True) == "current"
    assert OasisConfig(predictor="lookahead").predictor_for(True, model_free_draft=True) == "lookahead"
    with pytest.raises(OasisConfigError, match="'predictor'.*speculative"):
        OasisConfig(predictor="lookahead").predictor_for(False)
    with pytest.raises(OasisConfigError, match="'predictor'"):
        OasisConfig(predictor="oracle")
    with pytest.raises(OasisConfigError, match="'measure_agreement'"):
        OasisConfig(measure_agreement="yes")


@pytest.mark.parametrize("predictor", ["previous", "current"])
def test_chunked_prefill_then_decode_is_exact(seed, predictor):
    """A prefill in two chunks (the second with the first as cached prefix), then decode, with a
    budget covering the context: every output equals dense attention. (Regression: the first
    chunk's prediction admits the next block empty; the second chunk fills it in the host tier
    only, so the resident copy must be dropped.)"""
    eng = _engine(64, predictor)
    run = Run(eng, [2], 20, 40)
    rows = run.rows
    n1, n2 = 20, 29
    for l in eng.sparse_layers:
        for lo, hi in ((0, n1), (n1, n2)):
            locs = run.rt[rows, lo:hi].reshape(-1).long()
            k, v = run.K[l][:, lo:hi].reshape(-1, H, D), run.V[l][:, lo:hi].reshape(-1, H, D)
            eng.write_kv(l, locs, k, v)
            o = eng.extend_attention(l, run.Q[l][:, lo:hi].reshape(-1, HQ, D), rows, torch.tensor([lo]),
                                     torch.tensor([hi - lo]), run.rt, None, k, v)
            ref = torch.stack([decode_attention(run.Q[l][0, t], run.K[l][0, :t + 1], run.V[l][0, :t + 1], None)
                               for t in range(lo, hi)])
            torch.testing.assert_close(o, ref, rtol=1e-5, atol=1e-5)
    run.t = n2
    for _ in range(6):
        t = run.t
        outs = run.step()
        for l in eng.sparse_layers:
            ref = decode_attention(run.Q[l][0, t], run.K[l][0, :t + 1], run.V[l][0, :t + 1], None)
            torch.testing.assert_close(outs[l][0], ref, rtol=1e-5, atol=1e-5)


def test_bad_draft_arguments_are_refused_before_any_state_changes(seed):
    eng = _engine(16, "lookahead")
    run = Run(eng, [0, 1], 20, 30)
    run.prefill()
    ids = eng.ws.ids.clone()
    l, t = eng.sparse_layers[0], run.t
    q, k = run.Q[l][:, t], run.K[l][:, t]
    seq = torch.full((2,), t + 1)
    eng.begin_decode_step(run.rows, seq, run.rt)
    ids = eng.ws.ids.clone()
    with pytest.raises(ValueError, match="go together"):
        eng.decode_attention(l, q, k, k, None, q_draft=q)
    with pytest.raises(ValueError, match="q_draft"):
        eng.decode_attention(l, q, k, k, None, q_draft=torch.randn(3, HQ, D), k_draft=k, v_draft=k)
    assert torch.equal(eng.ws.ids, ids)


def test_prefill_rows_without_new_tokens_get_no_prediction(seed):
    """Only rows with new tokens are predicted, each from its own last token's query."""
    eng = _engine(16, "previous")
    rt = torch.zeros(4, 64, dtype=torch.int32)
    rt[1, :12] = torch.arange(12) + 100
    rt[2, :12] = torch.arange(12) + 200
    l = eng.sparse_layers[0]
    k = torch.randn(12, H, D)
    eng.write_kv(l, rt[1, :12].long(), k, k)
    eng.extend_attention(l, torch.randn(12, HQ, D), torch.tensor([2, 1]), torch.tensor([0, 0]),
                         torch.tensor([0, 12]), rt, None, k, k)
    assert eng.index[l] == 0 and int(eng.record.seq[1]) == 13 and int(eng.record.seq[2]) == -1


def test_measure_agreement_needs_a_predictor_that_predicts_ahead():
    with pytest.raises(OasisConfigError, match="measure_agreement"):
        _engine(16, "current", measure=True)
    with pytest.raises(OasisConfigError, match="measure_agreement"):
        OasisConfig(measure_agreement=True).predictor_for(False)


def _graph_style_step(run, pad_rows=1):
    """One replayed decode step, as SGLang's decode CUDA-graph runner drives the glue: the host
    bookkeeping first (``begin_decode_step`` in ``replay`` mode, real rows only), then the device
    work the graph replays: what a ``capture`` step records (``prepare_step_device`` and every
    sparse layer, the batch padded with request row 0 of context 1, as a captured batch of a
    larger size is)."""
    e, t = run.eng, run.t
    B = len(run.rows)
    seq = torch.full((B,), t + 1)
    rows = torch.cat([run.rows, torch.zeros(pad_rows, dtype=torch.long)])
    seq_p = torch.cat([seq, torch.ones(pad_rows, dtype=torch.long)])
    e.begin_decode_step(rows, seq_p, run.rt, mode="replay", rows_host=run.rows.tolist(), seq_lens_host=seq.tolist())
    assert e.step is None, "a replay's bookkeeping leaves no step for eager layers"
    e.begin_decode_step(rows, seq_p, run.rt, mode="capture")
    e.prepare_step_device()
    outs = {}
    for l in e.sparse_layers:
        k = torch.cat([run.K[l][:, t], torch.randn(pad_rows, H, D)])
        v = torch.cat([run.V[l][:, t], torch.randn(pad_rows, H, D)])
        loc = torch.cat([run.loc(t), torch.zeros(pad_rows, dtype=torch.long)])
        e.write_kv(l, loc, k, v, decode=True)
        q = torch.cat([run.Q[l][:, t], torch.randn(pad_rows, HQ, D)])
        outs[l] = e.decode_attention(l, q, k, v, None)[:B]
    run.t += 1
    return outs


@pytest.mark.parametrize("predictor", ["previous", "current"])
def test_graph_mode_steps_equal_eager_steps(seed, predictor):
    """Replayed steps (host bookkeeping in a ``replay`` step, the captured device work with the context bound taken
    from ``req_to_token``, a padding row that is never counted as a violation) attend exactly as
    eager steps do and leave the same working sets."""
    state = torch.random.get_rng_state()
    res = {}
    for mode in ("eager", "graph"):
        torch.random.set_rng_state(state)
        eng = _engine(16, predictor, fetch_cap=1, rows=4, padding_row=0)
        run = Run(eng, [1, 3], 30, 60)
        run.prefill()
        outs = []
        for i in range(20):
            if mode == "graph" and i % 5 != 0:      # every fifth step eager, as after a refused replay
                assert eng.can_replay(run.rows.tolist(), [run.t + 1] * 2)
                outs.append(_graph_style_step(run))
            else:
                outs.append(run.step(host=True))
        res[mode] = (eng, outs)
    (a, oa), (b, ob) = res["eager"], res["graph"]
    for x, y in zip(oa, ob):
        for l in x:
            assert torch.equal(x[l], y[l]), l
    assert torch.equal(a.ws.ids[:, [1, 3]], b.ws.ids[:, [1, 3]])
    ra, rb = a.residency(), b.residency()             # raises if a real row ever missed its block
    assert rb["decode_steps"] == 20 and rb["graph_steps"] == 16 and rb["sync_steps"] == 0
    for key in ("hit_blocks", "admitted_blocks", "evicted_blocks", "bytes_h2d", "bytes_d2h"):
        assert ra[key] == rb[key], (key, "the padding row is not counted (and moves nothing)")
    assert rb["context_tokens"] == [50, 50] and rb["prediction_check"] == "host"


def test_can_replay_needs_every_row_predicted(seed):
    eng = _engine(16, "previous")
    run = Run(eng, [1, 2], 20, 40)
    assert not eng.can_replay([1, 2], [21, 21]), "nothing predicted yet"
    run.prefill()
    assert eng.can_replay([1, 2], [21, 21])
    assert not eng.can_replay([1, 2], [21, 22]), "a row predicted for another context"
    assert not eng.can_replay([1, 2], [21]), "lengths for another batch"
    assert not eng.can_replay([1, None], [21, 21]) and not eng.can_replay(None, None)
    rt = run.rt
    for bad in (dict(rows_host=[1, 2], seq_lens_host=[21]), dict(rows_host=[1, None], seq_lens_host=[21, 21]),
                dict(rows_host=None, seq_lens_host=None)):
        with pytest.raises(ValueError, match="replay"):
            eng.begin_decode_step(run.rows, torch.tensor([21, 21]), rt, mode="replay", **bad)
    assert eng.stats.decode_steps == 0, "a refused replay step changes nothing"
    eng.reset_rows([2])
    assert not eng.can_replay([1, 2], [21, 21]), "a freed row"
    run.step()                                # no host values: the host record is dropped ...
    assert not eng.can_replay([1, 2], [22, 22]), "... so nothing replays from then on"
    assert _engine(16, "current").can_replay([5], [7]), "current selects inside the step anyway"


@pytest.mark.parametrize("predictor,read_mode,replays", [("previous", "deferred", True), ("previous", "wait", False),
                                                         ("current", "deferred", False), ("current", "wait", False)])
def test_a_pd_decode_step_replays_only_when_no_layer_reads_from_the_peer(seed, predictor, read_mode, replays):
    """A PD decode node (``attach_remote``) may replay a captured step only when its plans leave
    reads between steps (deferred + a predictor planning a step ahead); otherwise the eager step
    reads the plan's missing pieces from the prefill node inside its layers."""
    from oasis_sglang.core.remote import RemoteBlocks

    eng = _engine(16, predictor, pd_read_mode=read_mode)
    run = Run(eng, [1, 2], 20, 40)
    run.prefill()
    assert eng.can_replay([1, 2], [21, 21]), "colocated: predicted rows (previous) or current replay"
    eng.attach_remote(RemoteBlocks(len(eng.sparse_layers), eng.head_num, eng.host.num_pages, fetch=lambda *a: 0))
    assert eng.can_replay([1, 2], [21, 21]) is replays
    eng.attach_remote(None)
    assert eng.can_replay([1, 2], [21, 21]), "detached: as colocated again"


class GraphStep:
    """A decode step of ``Run``'s 3 requests (+ the padding row 0) captured in a real CUDA graph:
    its static input buffers, the step the graph records (``prepare_step_device``, then every
    sparse layer, with a draft row each when ``draft``), the capture and the loading of step ``t``."""

    def __init__(self, eng, draft=False, B=4):
        self.eng, self.draft, self.L = eng, draft, eng.sparse_layers
        self.rows = torch.zeros(B, dtype=torch.long, device="cuda")
        self.seq = torch.ones(B, dtype=torch.long, device="cuda")
        self.loc = torch.zeros(B, dtype=torch.long, device="cuda")
        self.q = {l: torch.zeros(B, HQ, D, device="cuda") for l in self.L}
        self.qd = {l: torch.zeros(B, HQ, D, device="cuda") for l in self.L}
        self.kd = {l: torch.zeros(B, H, D, device="cuda") for l in self.L}
        self.kv = {l: (torch.zeros(B, H, D, device="cuda"), torch.zeros(B, H, D, device="cuda")) for l in self.L}
        self.out = {}

    def step(self):
        e = self.eng
        e.prepare_step_device()
        for l in self.L:
            e.write_kv(l, self.loc, self.kv[l][0], self.kv[l][1], decode=True)
            kw = dict(q_draft=self.qd[l], k_draft=self.kd[l], v_draft=self.kd[l]) if self.draft else {}
            self.out[l] = e.decode_attention(l, self.q[l], self.kv[l][0], self.kv[l][1], None, **kw)

    def capture(self, rt, dense=False):
        """A capture step (the dense path's with ``dense``), a warm-up on the padding row only on
        a side stream, then the graph. Each capture gets its own ``out`` (the graph's static
        outputs, as SGLang keeps one output per graph key): keep it beside the graph."""
        e = self.eng
        self.out = {}
        self.rows.zero_(), self.seq.fill_(1), self.loc.zero_()
        e.begin_decode_step(self.rows, self.seq, rt, mode="capture", dense=dense)
        e.pipe.join()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.step()
            e.pipe.join()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self.step()
        return g

    def load(self, run, t):
        self.rows[:3] = run.rows.cuda()
        self.seq[:3] = t + 1
        self.loc[:3] = run.loc(t)
        for l in self.L:
            self.q[l][:3] = run.Q[l][:, t].cuda()
            self.qd[l][:3] = run.Qd[l][:, t].cuda()
            self.kv[l][0][:3], self.kv[l][1][:3] = run.K[l][:, t].cuda(), run.V[l][:, t].cuda()
            self.kd[l][:3] = torch.randn(3, H, D)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("predictor", ["previous", "lookahead"])
def test_cuda_graph_replay_equals_eager(seed, predictor):
    """A decode step captured in a real CUDA graph (three stage streams forked and joined inside
    it; the Triton kernels) and replayed with new inputs matches eager steps with the same
    kernels: same working sets, outputs within the attention tolerance; no invariant violation."""
    from oasis_sglang.kernels import get_kv_ops

    state = torch.random.get_rng_state()
    res = {}
    for mode in ("eager", "graph"):
        torch.random.set_rng_state(state)
        # the kernels SGLang captures (the references sync)
        eng = _engine(32, predictor, fetch_cap=2, rows=8, device="cuda", padding_row=0, ops=get_kv_ops("triton"))
        run = Run(eng, [3, 5, 7], 100, 160, "cuda")
        run.prefill()
        draft = predictor == "lookahead"
        outs = [run.step(draft=draft, host=True)]
        if mode == "eager":
            outs += [run.step(draft=draft, host=True) for _ in range(12)]
        else:
            gs = GraphStep(eng, draft)
            g = gs.capture(run.rt)
            for _ in range(12):
                t = run.t
                assert eng.can_replay([3, 5, 7], [t + 1] * 3)
                gs.load(run, t)
                eng.begin_decode_step(gs.rows, gs.seq, run.rt, mode="replay", rows_host=[3, 5, 7],
                                      seq_lens_host=[t + 1] * 3)
                g.replay()
                outs.append({l: (o[:3].clone() if not draft else (o[:3].clone(), None)) for l, o in gs.out.items()})
                run.t += 1
        torch.cuda.synchronize()
        res[mode] = (eng, outs)
    (a, oa), (b, ob) = res["eager"], res["graph"]
    assert torch.equal(a.ws.ids[:, [3, 5, 7]], b.ws.ids[:, [3, 5, 7]])
    for x, y in zip(oa[1:], ob[1:]):
        for l in x:
            xa = x[l][0] if isinstance(x[l], tuple) else x[l]
            ya = y[l][0] if isinstance(y[l], tuple) else y[l]
            torch.testing.assert_close(xa[:, 0] if draft else xa, ya[:, 0] if draft else ya, rtol=1e-4, atol=1e-4)
    rb = b.residency()
    assert rb["graph_steps"] == 12 and rb["sync_steps"] == 0


@pytest.mark.parametrize("n", [0, 3, 16, 37])
def test_read_prefix_equals_the_token_gather(seed, n):
    """The block-wise prefix read (copy_blocks) returns exactly what the host-side token gather
    does, for whole blocks and a partial tail."""
    eng = _engine(16, "previous")
    run = Run(eng, [1, 2], 40, 40)
    run.prefill()
    li = 0
    k, v = eng.read_prefix(li, run.rt[2], n, "cpu")
    kt, vt = eng.host.read_tokens(li, run.rt[2, :n])
    assert k.shape == (n, H, D) and torch.equal(k, kt) and torch.equal(v, vt)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_dense_variant_replays_equal_eager(seed):
    """The dense path for short contexts captured as a second real CUDA graph beside the full
    path's (as ``sglang_glue.graph_hooks`` has SGLang capture it): each step's replay
    bookkeeping picks the variant, the dense graph while every context fits, the full one after.
    Working sets equal the eager engine's (dense path on) and outputs stay within the attention
    tolerance; both variants ran and the dense steps were counted."""
    from oasis_sglang.kernels import get_kv_ops

    state = torch.random.get_rng_state()
    res = {}
    for mode in ("eager", "graph"):
        torch.random.set_rng_state(state)
        eng = _engine(64, "previous", fetch_cap=2, rows=8, device="cuda", padding_row=0, ops=get_kv_ops("triton"))
        run = Run(eng, [3, 5, 7], 52, 80, "cuda")      # fits the 64-token working set until token 62
        run.prefill()
        outs, dense = [], []
        if mode == "eager":
            for _ in range(16):
                outs.append(run.step(host=True))
                dense.append(eng.stats.dense_steps)
        else:
            gs = GraphStep(eng)
            graphs = {}
            for v in (False, True):                     # SGLang's, then the dense one; each its own outputs
                graphs[v] = (gs.capture(run.rt, dense=v), gs.out)
            for _ in range(16):
                t = run.t
                assert eng.can_replay([3, 5, 7], [t + 1] * 3)
                gs.load(run, t)
                st = eng.begin_decode_step(gs.rows, gs.seq, run.rt, mode="replay", rows_host=[3, 5, 7],
                                           seq_lens_host=[t + 1] * 3)
                g, out = graphs[st.dense]
                g.replay()
                outs.append({l: o[:3].clone() for l, o in out.items()})
                dense.append(eng.stats.dense_steps)
                run.t += 1
        torch.cuda.synchronize()
        res[mode] = (eng, outs, dense)
    (a, oa, da), (b, ob, db) = res["eager"], res["graph"]
    assert da == db and 0 < db[-1] < 16, "the same steps dense; both variants replayed"
    assert torch.equal(a.ws.ids[:, [3, 5, 7]], b.ws.ids[:, [3, 5, 7]])
    for x, y in zip(oa, ob):
        for l in x:
            torch.testing.assert_close(x[l], y[l], rtol=1e-4, atol=1e-4)
    rb = b.residency()
    assert rb["graph_steps"] == 16 and rb["dense_steps"] == db[-1] and rb["sync_steps"] == 0
    assert torch.equal(a.counters[:, 0], b.counters[:, 0]), "hits: the padding row counts none"
