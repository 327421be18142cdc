"""Unit tests of the OasisKV core (torch only, CPU): host tier, summaries, selection,
working set and the per-layer engine. Random inputs are fresh every run (see conftest)."""

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from oasis_sglang.config import OasisConfig
from oasis_sglang.core import OasisSparseKV
from oasis_sglang.core.attention import decode_attention
from oasis_sglang.core.host_tier import HostTier
from oasis_sglang.core.selection import quest_scores, select_blocks
from oasis_sglang.core.ops import TorchKVOps
from oasis_sglang.core.working_set import WorkingSet


def test_host_tier_layout_and_roundtrip(seed):
    H, D, Dv, bs, P = 3, 8, 6, 4, 10
    ht = HostTier(2, P, bs, H, D, Dv, torch.float32)
    loc = torch.randperm(P * bs)[:17]
    k, v = torch.randn(17, H, D), torch.randn(17, H, Dv)
    kmin, kmax = torch.zeros(P, H, D), torch.zeros(P, H, D)
    TorchKVOps().write_kv(ht.k[1], ht.v[1], kmin, kmax, loc, k, v, bs)
    # layout: k[layer][head, block, offset, :]
    for i, l in enumerate(loc.tolist()):
        for h in range(H):
            assert torch.equal(ht.k[1][h, l // bs, l % bs], k[i, h])
            assert torch.equal(ht.v[1][h, l // bs, l % bs], v[i, h])
    k2, v2 = ht.read_tokens(1, loc)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    assert ht.k[0].abs().sum() == 0  # other layer untouched


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_host_tier_rejects_bad_pin_threads(bad):
    with pytest.raises(ValueError, match="pin_threads"):
        HostTier(1, 2, 4, 1, 8, 8, torch.float32, pin_threads=bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the host tier is page-locked only with CUDA")
@pytest.mark.parametrize("threads", [1, 4])
def test_host_tier_pinned_by_threads_is_zeroed_pinned_and_in_order(threads):
    H, D, Dv, bs, P, L = 2, 16, 8, 4, 64, 5
    ht = HostTier(L, P, bs, H, D, Dv, torch.bfloat16, pin_memory=True, pin_threads=threads)
    assert len(ht.k) == len(ht.v) == L
    assert all(t.shape == (H, P, bs, D) for t in ht.k) and all(t.shape == (H, P, bs, Dv) for t in ht.v)
    assert len({t.data_ptr() for t in ht.k + ht.v}) == 2 * L
    for t in ht.k + ht.v:
        assert t.is_pinned() and t.abs().sum() == 0
    # a non-blocking copy from a registered buffer reads it (flag 0: registered with this device)
    ht.v[L - 1][1, P - 1].fill_(2.0)
    got = ht.v[L - 1][1, P - 1].to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert float(got.float().sum()) == 2.0 * bs * Dv


def test_quest_bound_is_an_upper_bound(seed):
    B, H, G, D, NB, bs = 2, 3, 3, 8, 5, 4
    keys = torch.randn(B, NB, H, bs, D)
    q = torch.randn(B, H * G, D)
    kmin, kmax = keys.amin(3), keys.amax(3)
    u = quest_scores(q, kmin, kmax)                                   # [B, H, NB]
    dots = torch.einsum("bhgd,bnhtd->bhgnt", q.view(B, H, G, D), keys)  # exact scores
    assert (u[:, :, None, :, None] >= dots - 1e-5).all()
    # GQA: the KV head's score is the max of its group's bounds
    per_head = torch.maximum(q.view(B, H, G, 1, D) * kmin.permute(0, 2, 1, 3)[:, :, None],
                             q.view(B, H, G, 1, D) * kmax.permute(0, 2, 1, 3)[:, :, None]).sum(-1)
    assert torch.allclose(u, per_head.amax(2))


def _ref_select(scores, nb, nc, k, sink, recent):
    forced = [j for j in range(nb) if j < sink or j >= nb - recent]
    cand = sorted((j for j in range(nc) if j not in forced), key=lambda j: (-scores[j], j))
    return forced + cand[: max(0, k - len(forced))]


@pytest.mark.parametrize("k,sink,recent", [(6, 1, 2), (4, 0, 1), (10, 2, 3)])
def test_select_blocks_matches_reference(seed, k, sink, recent):
    B, H, NB = 4, 3, 12
    scores = torch.randint(0, 5, (B, H, NB)).float()   # many ties: tie-break must be deterministic
    nb = torch.tensor([12, 7, 3, 1])
    nc = nb - torch.tensor([0, 1, 1, 1])               # last block partial for rows 1..3
    wanted, forced = select_blocks(scores, nb, nc, k, sink, recent)
    assert wanted.shape == (B, H, k)
    for b in range(B):
        for h in range(H):
            ref = _ref_select(scores[b, h].tolist(), int(nb[b]), int(nc[b]), k, sink, recent)
            got = [x for x in wanted[b, h].tolist() if x >= 0]
            assert sorted(got) == sorted(ref), (b, h, got, ref)
            assert len(set(got)) == len(got) == min(k, int(nb[b]))
            nf = int(forced[b, h].sum())
            assert set(wanted[b, h, :nf].tolist()) == {j for j in ref if j < sink or j >= int(nb[b]) - recent}


def _check_table(ws, layer, rows):
    ids = ws.ids[layer][rows]
    for row in ids.reshape(-1, ws.K).tolist():
        held = [x for x in row if x >= 0]
        assert len(held) == len(set(held)), f"slot table holds a block twice: {row}"


@pytest.mark.parametrize("cap", [None, 1, 3])
def test_working_set_plan_invariants(seed, cap):
    R, H, K, NB = 5, 2, 6, 20
    ws = WorkingSet(1, R, H, K, 4, 8, 8, torch.float32, "cpu")
    rows = torch.tensor([1, 3])
    sink, recent = 1, 2
    nb = 8
    for step in range(1, 40):
        nb = min(NB, nb + (step % 3 == 0))
        scores = torch.randn(2, H, NB)
        wanted, forced = select_blocks(scores, torch.tensor([nb, nb]), torch.tensor([nb - 1, nb - 1]), K, sink, recent)
        before = ws.ids[0][rows].clone()
        lru_before = ws.last_used[0][rows].clone()
        adm = ws.plan(0, rows, wanted, forced, step, cap)
        a_batch, a_head, a_entry, a_block = adm.sparse()
        assert int(adm.mask.sum()) == a_block.numel() and int(adm.evicted) <= a_block.numel()
        after = ws.ids[0][rows]
        _check_table(ws, 0, rows)
        for b in range(2):
            for h in range(H):
                w = set(wanted[b, h].tolist()) - {-1}
                f = set(wanted[b, h][forced[b, h]].tolist())
                held = set(after[b, h].tolist()) - {-1}
                assert f <= held, "sink/recent blocks must be resident"
                assert len(held) <= K
                sel = (a_batch == b) & (a_head == h)
                admitted = a_block[sel].tolist()
                assert set(admitted) <= w and not (set(admitted) & set(before[b, h].tolist()))
                evicting = [e for e in a_entry[sel].tolist() if before[b, h, e] >= 0]
                victims = [int(before[b, h, e]) for e in evicting]
                assert not (set(victims) & w), "only blocks outside the prediction are evicted"
                n_forced_adm = len(set(admitted) & f)
                if cap is not None:
                    assert len(evicting) <= max(cap, n_forced_adm), "fetch_cap exceeded"
                # LRU: every victim is no more recently used than any evictable block kept
                kept_evictable = [e for e in range(K) if before[b, h, e] >= 0 and int(before[b, h, e]) not in w
                                  and e not in evicting]
                if evicting and kept_evictable:
                    assert max(lru_before[b, h, e] for e in evicting) <= min(lru_before[b, h, e] for e in kept_evictable)
                if cap is None:
                    assert held == w
    ws.reset_rows([1, 3])
    assert (ws.ids == -1).all(), "everything freed when the requests end"


def _engine(budget, bs=4, layers=3, H=2, D=8, rows=4, tokens=512, dense=(0,), fetch_cap=None, dtype=torch.float32,
            predictor="current"):
    cfg = OasisConfig(budget_tokens=budget, block_size=bs, sink_blocks=1, recent_blocks=2,
                      dense_layers=dense, fetch_cap=fetch_cap, predictor=predictor)
    return OasisSparseKV(cfg, layers, tokens, rows, H, D, D, dtype, "cpu")


def _paged_locs(n, bs=4, pages=125):
    """Token locations as SGLang's paged allocator gives them: random pages, in-page order."""
    p = torch.randperm(pages)[: -(-n // bs)]
    return (p[:, None] * bs + torch.arange(bs)).reshape(-1)[:n]


def _run_request(eng, layer, row, n_prompt, n_decode, Hq, rt, free_locs, dtype=torch.float32):
    """Prefill n_prompt tokens then decode n_decode; returns per-step outputs and the full K/V."""
    H, D = eng.head_num, eng.head_dim
    n = n_prompt + n_decode
    locs = free_locs[:n]
    rt[row, :n] = locs
    K, V = torch.randn(n, H, D).to(dtype), torch.randn(n, H, D).to(dtype)
    Q = torch.randn(n, Hq, D).to(dtype)
    eng.write_kv(layer, locs[:n_prompt], K[:n_prompt], V[:n_prompt])
    pre = eng.extend_attention(layer, Q[:n_prompt], torch.tensor([row]), torch.tensor([0]),
                               torch.tensor([n_prompt]), rt, None)
    outs = []
    for t in range(n_prompt, n):
        eng.write_kv(layer, locs[t:t + 1], K[t:t + 1], V[t:t + 1])
        eng.begin_decode_step(torch.tensor([row]), torch.tensor([t + 1]), rt)
        o = eng.decode_attention(layer, Q[t:t + 1], K[t:t + 1], V[t:t + 1], None)
        outs.append(o[0])
    return pre, outs, Q, K, V


def test_prefill_equals_dense_causal_attention(seed):
    eng = _engine(budget=64)
    rt = torch.zeros(4, 256, dtype=torch.int32)
    pre, _, Q, K, V = _run_request(eng, 1, 2, 37, 0, 6, rt, _paged_locs(37))
    ref = scaled_dot_product_attention(Q.movedim(0, 1)[None], K.movedim(0, 1)[None], V.movedim(0, 1)[None],
                                       is_causal=True, enable_gqa=True)[0].movedim(1, 0)
    torch.testing.assert_close(pre, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("predictor", ["current", "previous"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_equals_dense_when_working_set_covers_context(seed, dtype, predictor):
    """budget >= context: every decode output is bitwise the dense attention over all tokens."""
    eng = _engine(budget=128, dtype=dtype, predictor=predictor)
    rt = torch.zeros(4, 256, dtype=torch.int32)
    _, outs, Q, K, V = _run_request(eng, 2, 1, 45, 30, 6, rt, _paged_locs(75), dtype)
    for i, o in enumerate(outs):
        t = 45 + i
        ref = decode_attention(Q[t], K[: t + 1], V[: t + 1], None)
        assert torch.equal(o, ref), f"step {i}"
    assert eng.residency()["evicted_blocks"] == 0


def test_engine_refuses_bad_calls_naming_the_argument(seed):
    """A dense or unknown layer, extend lengths that do not add up to the queries, and decode
    lengths below 1 are refused with a ValueError naming them, before any state changes: the
    state then serves a valid request exactly as a fresh engine does."""
    eng = _engine(budget=64)
    rt = torch.zeros(4, 256, dtype=torch.int32)
    q, k = torch.randn(5, 6, 8), torch.randn(5, 2, 8)
    with pytest.raises(ValueError, match=r"layer 0 is dense .*serves layers \[1, 2\]"):
        eng.write_kv(0, torch.arange(5), k, k)
    with pytest.raises(ValueError, match="layer 7 is not a layer of this model"):
        eng.decode_attention(7, q[:1], k[:1], k[:1], None)
    with pytest.raises(ValueError, match=r"want loc \[N\]"):
        eng.write_kv(1, torch.arange(4), k, k)
    with pytest.raises(ValueError, match=r"extend_lens \[3\] \(sum 3\).*q of 5 tokens"):
        eng.extend_attention(1, q, torch.tensor([1]), torch.tensor([0]), torch.tensor([3]), rt, None)
    with pytest.raises(ValueError, match="1 rows, 2 prefix_lens"):
        eng.extend_attention(1, q, torch.tensor([1]), torch.tensor([0, 0]), torch.tensor([5]), rt, None)
    for bad in ({"max_seq_len": 0}, {"rows_host": [1], "seq_lens_host": [0]}, {"rows_host": [-1], "seq_lens_host": [5]}):
        with pytest.raises(ValueError, match="want"):
            eng.begin_decode_step(torch.tensor([1]), torch.tensor([5]), rt, **bad)
    with pytest.raises(ValueError, match="unknown|not a valid"):
        eng.begin_decode_step(torch.tensor([1]), torch.tensor([5]), rt, mode="graph")
    with pytest.raises(RuntimeError, match="without begin_decode_step"):
        eng.decode_attention(1, q[:1], k[:1], k[:1], None)
    torch.manual_seed(0)
    got = _run_request(eng, 1, 2, 37, 3, 6, rt, _paged_locs(37 + 3))[1]
    torch.manual_seed(0)
    ref = _run_request(_engine(budget=64), 1, 2, 37, 3, 6, rt.clone(), _paged_locs(37 + 3))[1]
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    eng.begin_decode_step(torch.tensor([1, 2]), torch.tensor([5, 5]), rt)
    with pytest.raises(ValueError, match="q has 1 rows but the step's batch has 2"):
        eng.decode_attention(1, q[:1], k[:1], k[:1], None)


def test_sparse_attends_exactly_the_resident_blocks(seed):
    """budget < context: output = attention over the resident blocks; the budget is respected."""
    eng = _engine(budget=16, fetch_cap=2)   # 4 blocks of 4
    rt = torch.zeros(4, 256, dtype=torch.int32)
    free_locs = _paged_locs(90)
    _, outs, Q, K, V = _run_request(eng, 1, 3, 60, 30, 6, rt, free_locs)
    li = eng.index[1]
    ids = eng.ws.ids[li][3]                                     # state after the last step
    n = 90
    ks, vs = [], []
    for h in range(eng.head_num):
        pos = sorted(p for b in ids[h].tolist() if b >= 0 for p in range(b * 4, min(n, b * 4 + 4)))
        assert len(pos) <= 16
        assert (n - 1) in pos and 0 in pos, "recent and sink blocks are resident"
        ks.append(K[pos, h])
        vs.append(V[pos, h])
    kk, vv = torch.stack(ks, 1), torch.stack(vs, 1)
    ref = decode_attention(Q[n - 1], kk, vv, None)
    torch.testing.assert_close(outs[-1], ref, rtol=1e-5, atol=1e-5)
    # and the working-set copy equals the host tier (write-through kept them in sync)
    for h in range(eng.head_num):
        for e, b in enumerate(ids[h].tolist()):
            if b >= 0:
                page = int(rt[3, b * 4]) // 4
                valid = min(4, n - b * 4)
                assert torch.equal(eng.ws.k[li][3, h, e, :valid], eng.host.k[li][h, page, :valid])
    assert eng.residency()["evicted_blocks"] > 0


def test_reset_rows_frees_everything(seed):
    eng = _engine(budget=16)
    rt = torch.zeros(4, 256, dtype=torch.int32)
    _run_request(eng, 1, 2, 30, 3, 6, rt, _paged_locs(33))
    assert (eng.ws.ids[:, 2] >= 0).any()
    eng.reset_rows([2])
    assert (eng.ws.ids == -1).all()


def test_first_decode_step_after_a_prefill_is_flagged(seed):
    eng = _engine(budget=16)
    rt = torch.zeros(4, 256, dtype=torch.int32)
    _run_request(eng, 1, 2, 20, 1, 6, rt, _paged_locs(21))
    assert eng.stats.new_request_started        # first decode of row 2
    H, D = eng.head_num, eng.head_dim
    eng.begin_decode_step(torch.tensor([2]), torch.tensor([22]), rt)
    eng.decode_attention(1, torch.randn(1, 6, D), torch.randn(1, H, D), torch.randn(1, H, D), None)
    assert not eng.stats.new_request_started    # no prefill since: the request goes on


def test_memory_plan_matches_allocation(seed):
    cfg = OasisConfig(budget_tokens=16, block_size=4, dense_layers=(0,))
    plan = OasisSparseKV.memory_plan(cfg, 3, 512, 4, 2, 8, 8, 4)
    eng = OasisSparseKV(cfg, 3, 512, 4, 2, 8, 8, torch.float32, "cpu")
    assert plan == {"working_set": eng.ws.nbytes, "summaries": eng.summaries.nbytes, "host_tier": eng.host.nbytes}


def test_append_tokens_never_writes_a_block_that_is_not_resident(seed):
    ws = WorkingSet(1, 2, 2, 4, 4, 8, 8, torch.float32, "cpu")
    host_k, host_v = torch.zeros(2, 8, 4, 8), torch.zeros(2, 8, 4, 8)
    rtt = torch.arange(64, dtype=torch.int32).view(2, 32)
    ctr = torch.zeros(4, dtype=torch.int64)
    ops = TorchKVOps()
    ws.ids[0, 1] = torch.tensor([[0, 5, -1, -1], [5, 0, -1, -1]])
    rows, pos = torch.tensor([1]), torch.tensor([21])                # block 5: resident on both heads
    ops.append_tokens(ws.k[0], ws.v[0], ws.ids[0], rows, pos, torch.ones(1, 2, 8), torch.ones(1, 2, 8),
                      host_k, host_v, rtt, ws.violations, ctr)
    ws.check()
    assert ws.k[0][1, 0, 1, 1].eq(1).all() and ws.k[0][1, 1, 0, 1].eq(1).all()
    ops.append_tokens(ws.k[0], ws.v[0], ws.ids[0], rows, torch.tensor([11]), torch.full((1, 2, 8), 7.0),
                      torch.ones(1, 2, 8), host_k, host_v, rtt, ws.violations, ctr)    # block 2 (ends it): absent
    assert not (ws.k[0] == 7).any(), "a token whose block is not resident must not be written"
    assert not host_k.any() and int(ctr[3]) == 0, "nor written back to the host tier"
    with pytest.raises(RuntimeError, match="not resident"):
        ws.check()
