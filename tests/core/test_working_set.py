"""core/working_set.py: the slot pool and head-wise block table (admission plan, LRU, capped eviction)."""

import pytest
import torch

from oasis_sglang.core.selection import select_blocks
from oasis_sglang.core.working_set import WorkingSet


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
