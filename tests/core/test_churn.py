"""core/churn.py: replaying a measured admission rate (benchmarks on random weights): the rewritten
prediction misses the asked number of resident blocks, keeps sink / recent blocks, repeats no
block, and goes through the real plan; profiles load from measure_agreement's results and
stretch to another model's depth; BenchHooks reads OASIS_CHURN."""

import json

import pytest
import torch

from oasis_sglang.config import OasisConfigError
from oasis_sglang.core import OasisSparseKV
from oasis_sglang.core.bench_hooks import BenchHooks
from oasis_sglang.core.churn import in_set_bitmap, in_set_pairwise, load_profile, replay_churn, resample
from oasis_sglang.core.selection import select_blocks
from oasis_sglang.core.working_set import plan_admissions


def _full_layer(seed, B=4, H=3, K=16, nb=60, shared=4):
    """A full working set per (request, KV head), and a fresh random prediction against it that
    holds exactly ``shared`` of its resident blocks (besides sink / recent ones), so every list has
    ``K - forced - shared`` non-resident blocks to miss (replay_churn takes them from the list)."""
    g = torch.Generator().manual_seed(seed)
    n = torch.full((B,), nb)
    wanted, forced = select_blocks(torch.randn(B, H, nb, generator=g), n, n - 1, K, 1, 2)
    held = torch.empty(B, H, K, dtype=torch.int64)
    for b in range(B):
        for h in range(H):
            free = wanted[b, h][~forced[b, h]]
            inside = free[torch.randperm(len(free), generator=g)[:shared]]
            outside = torch.tensor([x for x in torch.randperm(nb, generator=g).tolist()
                                    if x not in set(wanted[b, h].tolist())][:K - shared])
            held[b, h] = torch.cat([inside, outside])[torch.randperm(K, generator=g)]
    return held, wanted, forced


def test_odd_means_are_clamped_to_the_list(seed):
    held, wanted, forced = _full_layer(seed)
    seq = torch.full((wanted.shape[0],), 9)
    for mean, want in ((1e19, "all"), (float("inf"), "all"), (float("nan"), 0), (-3.0, 0)):
        w, f = replay_churn(wanted, forced, held, mean, seq)
        res = [set(held[b, h].tolist()) | set(wanted[b, h][forced[b, h]].tolist())
               for b in range(w.shape[0]) for h in range(w.shape[1])]
        miss = [sum(1 for x in w[b, h].tolist() if x >= 0 and x not in res[b * w.shape[1] + h])
                for b in range(w.shape[0]) for h in range(w.shape[1])]
        if want == 0:
            assert miss == [0] * len(miss), mean
        else:
            assert min(miss) > 0 and torch.equal((w >= 0).sum(-1), torch.full_like(miss and (w >= 0).sum(-1), 16)), mean


@pytest.mark.parametrize("mean", [0.0, 1.0, 2.5, 7.0])
def test_replay_misses_the_asked_number_of_resident_blocks(seed, mean):
    held, wanted, forced = _full_layer(seed)
    B, H, K = wanted.shape
    missing_total, heads = 0, 0
    for step in range(8):
        seq = torch.full((B,), 1000 + step)
        w, f = replay_churn(wanted, forced, held, mean, seq, salt=3)
        assert w.shape == wanted.shape and w.dtype == torch.int64 and f.dtype == torch.bool
        for b in range(B):
            for h in range(H):
                blocks = [x for x in w[b, h].tolist() if x >= 0]
                assert len(blocks) == len(set(blocks)) == K, "a full list, no block twice"
                must = set(wanted[b, h][forced[b, h]].tolist())
                assert must <= set(blocks) and set(w[b, h][f[b, h]].tolist()) == must, "forced blocks kept, marked"
                assert f[b, h, :len(must)].all(), "forced first (the plan admits in list order)"
                res = set(held[b, h].tolist())
                m = sum(1 for x in blocks if x not in res and x not in must)
                assert m in (int(mean), int(mean) + 1)
                missing_total += m
                heads += 1
    assert abs(missing_total / heads - mean) <= 0.35, "the dither averages to the mean"


def test_bitmap_membership_equals_the_pairwise_reference(seed):
    """in_set_bitmap (what the benchmarks' replay runs, O(K) per row) is exactly in_set_pairwise
    (K * K compares) for ids below nb_max, with -1 / -2 padding and ids of the set at or past
    nb_max; and replay_churn gives the same lists either way."""
    g = torch.Generator().manual_seed(seed)
    nb = 50
    for _ in range(20):
        x = torch.randint(-2, nb, (3, 4, 16), generator=g)
        t = torch.randint(-2, nb + 8, (3, 4, 16), generator=g)        # a held id may lie past nb_max
        assert torch.equal(in_set_bitmap(x, t, nb), in_set_pairwise(x, t))
    for mean in (0.0, 2.5, 9.0):
        held, wanted, forced = _full_layer(seed, nb=60)
        held[0, 0, :3] = -1                                             # a filling working set
        seq = torch.arange(wanted.shape[0]) + 300
        ref = replay_churn(wanted, forced, held, mean, seq, salt=5)
        got = replay_churn(wanted, forced, held, mean, seq, salt=5, nb_max=60)
        assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1]), mean


def test_replayed_predictions_go_through_the_real_plan(seed):
    held, wanted, forced = _full_layer(seed, B=2, H=2, K=16)
    ids = torch.cat([torch.full((1, 2, 16), -1), held])            # row 0 unused, rows 1-2 hold the sets
    last = torch.zeros_like(ids)
    rows = torch.tensor([1, 2])
    w, f = replay_churn(wanted, forced, ids[rows], 3.0, torch.tensor([77, 78]))
    forced_missing = sum(len(set(w[b, h][f[b, h]].tolist()) - set(held[b, h].tolist())) for b in range(2) for h in range(2))
    adm = plan_admissions(ids, last, rows, w, f, 5, None)
    assert int(adm.mask.sum()) == 3 * 4 + forced_missing, "3 per head, plus the forced blocks not resident"


def test_profiles_load_and_stretch(tmp_path):
    p = tmp_path / "results.json"
    p.write_text(json.dumps({"runs": [{"fetch_cap": 2, "missing_by_layer": {"2": 9.0}},
                                      {"fetch_cap": "unbounded", "missing_by_layer": {"10": 3.0, "2": 1.0, "3": 2.0}}]}))
    assert load_profile(p) == (1.0, 2.0, 3.0), "by layer index, numerically"
    q = tmp_path / "list.json"
    q.write_text("[4, 5.5]")
    assert load_profile(q) == (4.0, 5.5)
    for bad in ('{"runs": []}', "[]", '[1, -2]', '["x"]', '{"runs": [{"fetch_cap": "unbounded"}]}', '{"runs": 5}',
                '{"runs": [1, 2]}', '{"runs": [{"fetch_cap": "unbounded", "missing_by_layer": [1, 2]}]}',
                '{"runs": [{"fetch_cap": "unbounded", "missing_by_layer": {"a": 1}}]}', "[1e308]", "{not json"):
        q.write_text(bad)
        with pytest.raises(ValueError, match="list.json"):
            load_profile(q)
    assert resample((1.0, 3.0), 3) == (1.0, 2.0, 3.0)
    assert resample((2.0,), 4) == (2.0,) * 4
    assert resample((1.0, 2.0, 3.0), 3) == (1.0, 2.0, 3.0)
    assert len(resample(tuple(range(28)), 34)) == 34 and resample(tuple(range(28)), 34)[-1] == 27.0


def test_bench_hooks_read_oasis_churn(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("OASIS_ABLATE", raising=False)
    monkeypatch.delenv("OASIS_CHURN", raising=False)
    assert BenchHooks.from_env().churn is None
    q = tmp_path / "p.json"
    q.write_text("[1, 3]")
    monkeypatch.setenv("OASIS_CHURN", str(q))
    with caplog.at_level("WARNING"):
        h = BenchHooks.from_env()
    assert h.churn == (1.0, 3.0) and "OASIS_CHURN" in caplog.text and "outputs are wrong" in caplog.text
    assert h.churn_mean(0, 3) == 1.0 and h.churn_mean(1, 3) == 2.0 and BenchHooks().churn_mean(0, 3) is None
    monkeypatch.setenv("OASIS_CHURN", str(tmp_path / "missing.json"))
    with pytest.raises(OasisConfigError, match="OASIS_CHURN"):
        BenchHooks.from_env()
    for bad in ((), (1.0, float("nan")), "x", (True,)):
        with pytest.raises(OasisConfigError, match="churn"):
            BenchHooks(churn=bad)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_an_engine_replaying_churn_admits_about_the_profile_per_head(seed, backend):
    """Random queries on a full working set would churn the whole cap; replayed, the counters
    show about the profile's admissions per (request, layer, KV head) and step, with the torch
    ops and with the Triton ops (kernel 8; the interpreter on CPU)."""
    from oasis_sglang.config import OasisConfig
    from oasis_sglang.kernels import get_kv_ops

    cfg = OasisConfig(budget_tokens=64, block_size=4, dense_layers=(0,), fetch_cap=None, predictor="previous",
                      transfer_budget=None)
    eng = OasisSparseKV(cfg, 3, 4096, 4, 2, 8, 8, torch.float32, "cpu", ops=get_kv_ops(backend))
    eng.bench = BenchHooks(churn=(2.0,))
    rt = torch.zeros(4, 1024, dtype=torch.int32)
    rows = [1, 2]
    for r in rows:
        rt[r] = torch.arange(1024, dtype=torch.int32) + 1024 * (r - 1)
    n = 400
    for l in eng.sparse_layers:
        for r in rows:
            k = torch.randn(n, 2, 8)
            eng.write_kv(l, rt[r, :n].long(), k, k)
            eng.extend_attention(l, torch.randn(n, 6, 8), torch.tensor([r]), torch.tensor([0]), torch.tensor([n]), rt,
                                 None, k, k)
    before = None
    for t in range(n, n + 12):
        if t == n + 4:
            before = eng.counters.sum(0).clone()
        eng.begin_decode_step(torch.tensor(rows), torch.tensor([t + 1] * 2), rt, rows_host=rows,
                              seq_lens_host=[t + 1] * 2)
        for l in eng.sparse_layers:
            k = torch.randn(2, 2, 8)
            eng.write_kv(l, rt[torch.tensor(rows), t].long(), k, k, decode=True)
            eng.decode_attention(l, torch.randn(2, 6, 8), k, k, None)
    admitted = int(eng.counters.sum(0)[1] - before[1])
    per_head = admitted / (8 * len(eng.sparse_layers) * 2 * 2)
    assert 1.5 <= per_head <= 3.5, per_head


def test_a_prediction_with_fewer_missing_blocks_gives_all_it_has(seed):
    """replay_churn misses blocks of the prediction only: where its list holds fewer non-resident
    blocks than asked, it misses all of them and fills the rest from the working set."""
    held, wanted, forced = _full_layer(seed, shared=12)          # 16 - 3 forced - 12 shared = 1 to miss
    w, f = replay_churn(wanted, forced, held, 7.0, torch.full((wanted.shape[0],), 5))
    for b in range(w.shape[0]):
        for h in range(w.shape[1]):
            must = set(wanted[b, h][forced[b, h]].tolist())
            res = set(held[b, h].tolist())
            assert sum(1 for x in w[b, h].tolist() if x >= 0 and x not in res and x not in must) == 1
