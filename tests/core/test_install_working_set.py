"""A first decode step planned by one engine and installed in another from its host tier
(``OasisSparseKV.planned_working_set`` / ``install_working_set_from_host``: a PD prefill node and
decode node, ``disagg/serving.py``), on CPU and, on the GPU smoke, on CUDA with the Triton ops."""

import pytest
import torch

from oasis_sglang.kernels import get_kv_ops
from test_prefetch import BS, DEVICES, Run, _engine


@pytest.mark.parametrize("device", DEVICES)
def test_a_plan_installed_from_the_host_tier_decodes_like_the_engine_that_planned_it(seed, device):
    a, b = (_engine(16, "previous", device=device, ops=get_kv_ops("triton" if device == "cuda" else "torch"))
            for _ in range(2))
    prompt, total = 32, 44                        # the first step's new token opens block 8
    ra, rb = Run(a, [1], prompt, total, device), Run(b, [2], prompt, total, device)
    rb.K, rb.V, rb.Q, rb.Qd = ra.K, ra.V, ra.Q, ra.Qd
    ra.prefill()
    ids = a.planned_working_set(1)
    assert ids.device.type == "cpu" and torch.equal(ids, a.ws.ids[:, 1].cpu())
    assert bool((ids == prompt // BS).any(-1).all())                  # the new token's block, admitted empty
    for l in b.sparse_layers:                     # the prompt's K/V reached b's host tier (read over NIXL in PD)
        b.write_kv(l, rb.rt[2, :prompt].long(), ra.K[l][0, :prompt].to(device), ra.V[l][0, :prompt].to(device))
    pages = torch.div(rb.rt[2, :prompt:BS].long().cpu(), BS, rounding_mode="floor")
    b.install_working_set_from_host(2, ids, pages, prompt + 1)
    assert torch.equal(b.ws.ids[:, 2].cpu(), ids)
    live = (ids >= 0) & (ids < pages.numel())
    assert torch.equal(b.counters[:, 1].cpu(), live.sum((1, 2)))        # counted as admitted (H2D) blocks
    for li in range(len(a.sparse_layers)):
        assert torch.equal(b.ws.k[li][2][live[li]], a.ws.k[li][1][live[li]])
        assert torch.equal(b.ws.v[li][2][live[li]], a.ws.v[li][1][live[li]])
    for t in range(prompt, total):
        oa, ob = ra.step(), rb.step()
        for l in a.sparse_layers:
            assert torch.equal(ob[l], oa[l]), (t, l)
    assert b.stats.sync_steps == 0 and a.stats.sync_steps == 0


@pytest.mark.parametrize("hole", [False, True])
def test_install_from_a_compact_host_tier_reads_through_the_slot_table(seed, hole):
    """A compact host tier (every piece of the request's pages given a slot, in a shuffled order):
    the installed working set and the decode outputs are the whole tier's. ``hole``: one
    piece has no slot: its copies are not made and counted as dropped, not as admitted."""
    a = _engine(16, "previous")
    L, H = len(a.sparse_layers), a.head_num
    prompt, total = 32, 44
    b = _engine(16, "previous", host_slots=L * H * (-(-total // BS)) + 3)
    ra, rb = Run(a, [1], prompt, total, "cpu"), Run(b, [2], prompt, total, "cpu")
    rb.K, rb.V, rb.Q, rb.Qd = ra.K, ra.V, ra.Q, ra.Qd
    ra.prefill()
    ids = a.planned_working_set(1)
    pages = torch.div(rb.rt[2, :prompt:BS].long(), BS, rounding_mode="floor")
    every = torch.div(rb.rt[2, :total:BS].long(), BS, rounding_mode="floor")      # the decode steps' blocks too
    lay, hh, pp = (t.reshape(-1) for t in torch.meshgrid(torch.arange(L), torch.arange(H), every, indexing="ij"))
    order = torch.randperm(lay.numel())
    lay, hh, pp = lay[order], hh[order], pp[order]
    if hole:                                      # layer 0, KV head 1: the sink block's piece
        keep = ~((lay == 0) & (hh == 1) & (pp == pages[0]))
        lay, hh, pp = lay[keep], hh[keep], pp[keep]
    b.assign_host_pieces(lay, hh, pp)
    for l in b.sparse_layers:
        b.write_kv(l, rb.rt[2, :prompt].long(), ra.K[l][0, :prompt], ra.V[l][0, :prompt])
    b.install_working_set_from_host(2, ids, pages, prompt + 1)
    assert torch.equal(b.ws.ids[:, 2], ids)
    live = (ids >= 0) & (ids < pages.numel())
    lost = torch.zeros_like(live)
    if hole:
        lost[0, 1] = live[0, 1] & (ids[0, 1] == 0)
        assert int(lost.sum()) == 1, "the sink block is resident"
        assert int(b.host_dropped[0, 0]) == BS and int(b.host_dropped[0, 1]) == 1
    else:
        assert not b.host_dropped.any()
    assert torch.equal(b.counters[:, 1], (live & ~lost).sum((1, 2)))
    for li in range(L):
        ok = live[li] & ~lost[li]
        assert torch.equal(b.ws.k[li][2][ok], a.ws.k[li][1][ok]) and torch.equal(b.ws.v[li][2][ok], a.ws.v[li][1][ok])
    if not hole:
        for t in range(prompt, total):
            oa, ob = ra.step(), rb.step()
            for l in a.sparse_layers:
                assert torch.equal(ob[l], oa[l]), (t, l)


def test_install_from_host_refuses_bad_arguments_before_changing_anything():
    eng = _engine(16, "previous")
    L, K = len(eng.sparse_layers), eng.ws.K
    ok = torch.full((L, 2, K), -1, dtype=torch.int64)
    for bad in (dict(row=9), dict(row=True), dict(ids=torch.zeros((L, 2, K + 1), dtype=torch.int64)),
                dict(pages=torch.tensor([], dtype=torch.int64)), dict(pages=torch.tensor([10 ** 6])),
                dict(pages=torch.tensor([-1])), dict(seq_next=0)):
        args = dict(row=1, ids=ok, pages=torch.tensor([3]), seq_next=5) | bad
        with pytest.raises(ValueError, match="install_working_set_from_host"):
            eng.install_working_set_from_host(**args)
        assert not bool((eng.ws.ids >= 0).any())
    with pytest.raises(ValueError, match="planned_working_set"):
        eng.planned_working_set(99)
