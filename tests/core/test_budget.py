"""core/budget.py and the budgeted plan: a step's admissions shared by score rank, never over the
budget, sink / recent blocks and free-slot fills never refused, contexts that fit the working set
exact against dense attention; the Triton kernels equal the torch references exactly."""

import pytest
import torch

from oasis_sglang.config import OasisConfig, OasisConfigError
from oasis_sglang.core import OasisSparseKV
from oasis_sglang.core.budget import AUTO_LINK_FRACTION, TransferBudget, share_budget
from oasis_sglang.core.selection import select_blocks
from oasis_sglang.core.working_set import budget_candidates, plan_admissions


def _cand(rows):
    """``[N, C]`` int32 candidate positions from Python lists (``-1`` padded)."""
    C = max(len(r) for r in rows)
    return torch.tensor([r + [-1] * (C - len(r)) for r in rows], dtype=torch.int32)


def _share(cand, budget, clock=0, K=16):
    return share_budget(cand, torch.tensor(budget), torch.tensor(clock), K).tolist()


def test_the_budget_goes_to_the_best_ranks_of_every_head_first():
    cand = _cand([[2, 3, 4], [0, 1], [5], []])
    assert _share(cand, -1) == [3, 3, 3, 3], "unlimited: every head its list's width (the plan's cap decides)"
    assert _share(cand, 100) == [3, 2, 1, 0]
    assert _share(cand, 0) == [0, 0, 0, 0]
    assert _share(cand, 1) == [0, 1, 0, 0], "position 0 first"
    assert _share(cand, 2) == [0, 2, 0, 0]
    assert _share(cand, 3) == [1, 2, 0, 0]
    assert _share(cand, 5) == [3, 2, 0, 0]
    assert _share(cand, 6) == [3, 2, 1, 0]


def test_ties_at_the_last_rank_rotate_with_the_clock():
    cand = _cand([[0, 1], [0, 1], [0, 1]])
    got = {tuple(_share(cand, 4, clock=c)) for c in range(3)}
    assert got == {(2, 1, 1), (1, 2, 1), (1, 1, 2)}, "each head is the one that gets the extra block once"
    assert _share(cand, 4, clock=7) == _share(cand, 4, clock=1)


@pytest.mark.parametrize("trial", range(20))
def test_random_shares_sum_to_the_budget_and_respect_the_rank_order(seed, trial):
    g = torch.Generator().manual_seed(seed + trial)
    N, C, K = 7, 4, 12
    rows = []
    for _ in range(N):
        n = int(torch.randint(0, C + 1, (1,), generator=g))
        rows.append(sorted(torch.randperm(K, generator=g)[:n].tolist()))
    cand = _cand(rows) if any(rows) else torch.full((N, 1), -1, dtype=torch.int32)
    total = sum(len(r) for r in rows)
    for budget in (0, 1, 3, total // 2, total, total + 5):
        allow = _share(cand, budget, clock=int(torch.randint(0, 100, (1,), generator=g)), K=K)
        assert sum(allow) == min(budget, total)
        assert all(0 <= a <= len(r) for a, r in zip(allow, rows))
        taken = [p for r, a in zip(rows, allow) for p in r[:a]]
        left = [p for r, a in zip(rows, allow) for p in r[a:]]
        if taken and left:
            assert max(taken) <= min(left), "no refused candidate ranks above an admitted one"


def _layer(seed, B=3, H=2, K=8, nb=20, fill=True):
    """A block table with some slots held, and a wanted list from random scores."""
    g = torch.Generator().manual_seed(seed)
    R = B + 1
    ids = torch.full((R, H, K), -1, dtype=torch.int64)
    if fill:
        for r in range(R):
            for h in range(H):
                n = int(torch.randint(K // 2, K + 1, (1,), generator=g))
                ids[r, h, :n] = torch.randperm(nb, generator=g)[:n]
    last = torch.randint(0, 50, (R, H, K), generator=g) * (ids >= 0)
    scores = torch.randn(B, H, nb, generator=g)
    n = torch.full((B,), nb)
    wanted, forced = select_blocks(scores, n, n - 1, K, 1, 2)
    rows = torch.arange(1, B + 1)
    return ids, last, rows, wanted, forced


@pytest.mark.parametrize("cap", [None, 1, 3, 8])
@pytest.mark.parametrize("budget", [0, 1, 4, 1000])
def test_the_budgeted_plan_never_exceeds_the_budget_and_keeps_sink_and_recent(seed, cap, budget):
    ids, last, rows, wanted, forced = _layer(seed)
    B, H, K = wanted.shape
    held_before = ids[rows].clone()
    free_before = (held_before < 0).sum(-1)
    cand = budget_candidates(ids, rows, wanted, forced, cap)
    allow = share_budget(cand, torch.tensor(budget), torch.tensor(3), K)
    adm = plan_admissions(ids, last, rows, wanted, forced, 60, cap, allow=allow)
    admitted = adm.mask.sum(-1)                                               # [B, H]
    forced_missing = torch.tensor([[len(set(wanted[b, h][forced[b, h]].tolist()) - set(held_before[b, h].tolist()))
                                    for h in range(H)] for b in range(B)])
    # admissions beyond free-slot fills and forced blocks: the budget's candidates
    beyond = (admitted - torch.maximum(free_before, forced_missing)).clamp(min=0)
    assert int(beyond.sum()) <= budget, "over the step budget"
    assert torch.equal(beyond.view(-1), allow.long()), "each head admits exactly its share"
    if cap is not None:
        assert bool((beyond <= cap).all()), "fetch_cap is the per-head ceiling"
    held = ids[rows]
    for b in range(B):
        for h in range(H):
            must = set(wanted[b, h][forced[b, h]].tolist())
            assert must <= set(held[b, h].tolist()), "sink / recent blocks are always resident"
    unbudgeted = plan_admissions(*[t.clone() for t in _layer(seed)[:2]], rows, wanted, forced, 60, cap)
    if budget >= 1000:
        assert torch.equal(adm.mask, unbudgeted.mask), "a budget above the candidates changes nothing"


@pytest.mark.parametrize("cap", [None, 1, 3, 8])
def test_an_unlimited_budget_plans_exactly_as_no_budget_and_lists_no_candidates(seed, cap):
    """``TransferBudget.blocks < 0`` (unlimited, e.g. before a step time is measured): no
    candidate is listed (the kernel skips its match), every head's share is the list's width,
    and the plan equals the plan without a budget."""
    ids, last, rows, wanted, forced = _layer(seed)
    unlimited = torch.tensor(-1)
    cand = budget_candidates(ids, rows, wanted, forced, cap, unlimited)
    assert bool((cand == -1).all())
    assert torch.equal(budget_candidates(ids, rows, wanted, forced, cap, torch.tensor(5)),
                       budget_candidates(ids, rows, wanted, forced, cap)), "a finite budget lists them"
    allow = share_budget(cand, unlimited, torch.tensor(3), wanted.shape[-1])
    assert allow.tolist() == [cand.shape[1]] * cand.shape[0]
    budgeted = plan_admissions(ids, last, rows, wanted, forced, 60, cap, allow=allow)
    ids2, last2 = _layer(seed)[:2]
    plain = plan_admissions(ids2, last2, rows, wanted, forced, 60, cap)
    assert torch.equal(budgeted.mask, plain.mask) and torch.equal(ids, ids2) and torch.equal(last, last2)


def test_free_slot_fills_are_never_refused(seed):
    ids, last, rows, wanted, forced = _layer(seed, fill=False)
    cand = budget_candidates(ids, rows, wanted, forced, 4)
    assert bool((cand == -1).all()), "an empty working set fills free slots: nothing to refuse"
    allow = share_budget(cand, torch.tensor(0), torch.tensor(0), wanted.shape[-1])
    adm = plan_admissions(ids, last, rows, wanted, forced, 1, 4, allow=allow)
    assert torch.equal(adm.mask.sum(-1), (wanted >= 0).sum(-1)), "every wanted block admitted with a budget of 0"


@pytest.mark.parametrize("predictor", ["current", "previous"])
def test_a_context_that_fits_the_working_set_is_exact_against_dense_under_a_one_byte_budget(seed, predictor):
    """Every block of a context that fits the working set is a free-slot fill: a step budget of
    one byte (0 blocks per layer) refuses none of them, so every decode output is bitwise the
    dense attention over all tokens."""
    from oasis_sglang.core.attention import decode_attention

    cfg = OasisConfig(budget_tokens=128, block_size=4, dense_layers=(0,), fetch_cap=1, predictor=predictor,
                      transfer_budget=1)
    eng = OasisSparseKV(cfg, 3, 512, 4, 2, 8, 8, torch.float32, "cpu")
    assert int(eng.budget.blocks) == 0
    rt = torch.zeros(4, 256, dtype=torch.int32)
    n0, n = 45, 75
    locs = torch.randperm(128)[: -(-n // 4)][:, None] * 4 + torch.arange(4)
    locs = locs.reshape(-1)[:n]
    rt[1, :n] = locs
    K, V, Q = torch.randn(n, 2, 8), torch.randn(n, 2, 8), torch.randn(n, 6, 8)
    eng.write_kv(2, locs[:n0], K[:n0], V[:n0])
    eng.extend_attention(2, Q[:n0], torch.tensor([1]), torch.tensor([0]), torch.tensor([n0]), rt, None)
    for t in range(n0, n):
        eng.write_kv(2, locs[t:t + 1], K[t:t + 1], V[t:t + 1])
        eng.begin_decode_step(torch.tensor([1]), torch.tensor([t + 1]), rt)
        o = eng.decode_attention(2, Q[t:t + 1], K[t:t + 1], V[t:t + 1], None)
        assert torch.equal(o[0], decode_attention(Q[t], K[: t + 1], V[: t + 1], None)), f"step {t}"
    assert eng.residency()["evicted_blocks"] == 0


def test_transfer_budget_settings_and_their_errors():
    assert OasisConfig().transfer_budget == "auto"
    for ok in ("auto", None, 1, 2**30, 0.25, 1.0):
        assert OasisConfig(transfer_budget=ok).transfer_budget == ok
    for bad in (0, -5, 1.5, 0.0, float("nan"), "fast", True, [1], "0.5", 2**62 + 1, 10**30):
        with pytest.raises(OasisConfigError, match="'transfer_budget'"):
            OasisConfig(transfer_budget=bad)
    assert OasisConfig.from_json('{"transfer_budget": 0.5}').transfer_budget == 0.5
    assert OasisConfig.from_json('{"transfer_budget": null}').transfer_budget is None


def test_the_budget_object_sizes_blocks_per_layer():
    tb = TransferBudget(10_000, block_bytes=100, num_layers=4, device="cpu")
    assert int(tb.blocks) == 25 and tb.bytes_per_step == 10_000 and tb.fraction is None
    tb.observe_step(0.01)
    assert int(tb.blocks) == 25, "a fixed budget ignores the step time"
    tb = TransferBudget("auto", block_bytes=100, num_layers=4, device="cpu")
    assert int(tb.blocks) == -1 and tb.bytes_per_step is None and tb.fraction == AUTO_LINK_FRACTION
    tb.observe_step(0.01)
    assert int(tb.blocks) == -1, "no link rate yet: unlimited"
    tb.set_link_rate(1e9)
    tb.observe_step(0.01)
    assert int(tb.blocks) == int(AUTO_LINK_FRACTION * 1e9 * 0.01 // 400), "no copies: the whole step"
    tb.observe_step(0.01, copied_bytes=4e6)                 # 4 ms of the 10 ms step on the link
    assert int(tb.blocks) == int(AUTO_LINK_FRACTION * 1e9 * 0.006 // 400), "sized on the step less its copies"
    tb.observe_step(0.01, copied_bytes=9e6)
    assert int(tb.blocks) == int(AUTO_LINK_FRACTION * 1e9 * 0.0025 // 400), "at least a quarter of the step"
    tb.observe_step(float("nan"))
    assert tb.step_s == 0.01, "a bad step time is ignored"


@pytest.mark.parametrize("exposed", [0.0, 0.4, 1.0])
def test_the_sized_budget_settles_below_the_links_share_of_the_compute(exposed):
    """A step of ``compute + exposed x copies / rate`` fed back into ``observe_step`` converges
    to ``f x rate x compute / (1 + f (1 - exposed))`` < rate x compute, whatever the exposure."""
    rate, compute, bb, L = 50e9, 0.014, 4096, 34
    tb = TransferBudget("auto", block_bytes=bb, num_layers=L, device="cpu")
    tb.set_link_rate(rate)
    copied = 2e9                                             # a first step far over the link
    for _ in range(60):
        step = compute + exposed * copied / rate
        tb.observe_step(step, copied)
        copied = tb.bytes_per_step
    f = AUTO_LINK_FRACTION
    want = f * rate * compute / (1 + f * (1 - exposed))
    assert copied == pytest.approx(want, rel=0.01) and copied < rate * compute
    for bad in (float("inf"), float("nan"), "25e9", True, -1.0):
        t = TransferBudget("auto", block_bytes=100, num_layers=4, device="cpu")
        t.set_link_rate(bad)
        assert t.link_bytes_per_s is None, bad
    t = TransferBudget("auto", block_bytes=100, num_layers=4, device="cpu")
    t.set_link_rate(1e9)
    for bad in (float("inf"), float("-inf"), float("nan")):
        t.observe_step(bad)
    assert int(t.blocks) == -1 and t.step_s is None, "non-finite step times are ignored"
    t.observe_step(1e30, copied_bytes=float("inf"))
    assert int(t.blocks) == 2**62 and t.step_s == 1e30, "a huge one is clamped (and non-finite copies ignored)"
    assert not TransferBudget(None, 100, 4, "cpu").enabled
    assert TransferBudget(1000, 100, 4, "cpu").enabled, "fixed bytes apply on any device"
    for frac in ("auto", 0.5):
        assert not TransferBudget(frac, 100, 4, "cpu").enabled, \
            "no link off CUDA: a fraction would stay unlimited, so the step does not plan through it"
