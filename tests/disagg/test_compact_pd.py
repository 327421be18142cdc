"""A PD decode node with a compact host tier (``OasisSparseKV(host_slots=S)``) over real NIXL
(UCX loopback), on the torch engine, without SGLang: it decodes exactly as one with the whole
tier while its pool holds only the pieces read or decoded there; a pool too small defers reads
(counted) without failing; a release gives every slot back."""

import base64

import pytest
import torch

pytest.importorskip("nixl")

from oasis_sglang.config import OasisConfig  # noqa: E402
from oasis_sglang.core import OasisSparseKV  # noqa: E402
from oasis_sglang.disagg.serving import DecodeSide, PrefillSide  # noqa: E402
from oasis_sglang.disagg.transport import TierLayout  # noqa: E402
from test_admission import BS, H, LAYERS, ROWS, TOKENS, D, decode, engine, prefilled  # noqa: E402
from test_serving import pool_of, sglang_transfer  # noqa: E402


def compact_engine(budget, pd_read_mode, slots):
    cfg = OasisConfig(budget_tokens=budget, block_size=BS, sink_blocks=1, recent_blocks=2, dense_layers=(0,),
                      fetch_cap=2, predictor="previous", pd_read_mode=pd_read_mode)
    return OasisSparseKV(cfg, LAYERS, TOKENS, ROWS, H, D, D, torch.float32, "cpu", host_slots=slots)


def decode_side(dc, ps):
    dpool = pool_of(dc)
    ds = DecodeSide(dc, dpool, read_timeout_s=5, lease_s=600)
    ds.add_peer(("prefill-host", 1), TierLayout.from_bytes(base64.b64decode(ps.layout_b64())))
    return ds, dpool


def pages_of(rt, row, n):
    return torch.div(rt[row, :n:BS].long(), BS, rounding_mode="floor")


@pytest.mark.parametrize("mode", ["wait", "deferred"])
@pytest.mark.parametrize("prompt", [61, 200])
def test_a_compact_decode_node_decodes_as_the_whole_tier(seed, mode, prompt):
    """Same outputs, working sets and counters as the whole tier, step by step, with far fewer
    host bytes; no write or copy dropped; after the release every slot is free."""
    budget, steps, S = 24, 12, 700
    pf, dw, dc = engine(budget), engine(budget, pd_read_mode=mode), compact_engine(budget, mode, S)
    ps = PrefillSide(pf, lease_s=600)
    (dsw, pw), (dsc, pc) = decode_side(dw, ps), decode_side(dc, ps)
    try:
        n = prompt + steps
        K, V, Q, rt_p, rt_d = prefilled(pf, prompt, steps)
        npg = -(-prompt // BS)
        src, dst = pages_of(rt_p, 1, prompt), pages_of(rt_d, 2, prompt)
        assert src.numel() == dst.numel() == npg
        sglang_transfer(pf, dw, pw, src, dst)
        sglang_transfer(pf, dc, pc, src, dst)
        dsw.admit(2, rt_d[2], prompt, "prefill-host", 1, 3, "req-w")
        dsc.admit(2, rt_d[2], prompt, "prefill-host", 1, 4, "req-c")
        assert dc.host.free_slots == S                       # nothing read yet
        for t in range(prompt, n):
            want = decode(dw, 2, rt_d, K, V, Q, t)
            got = decode(dc, 2, rt_d, K, V, Q, t)
            assert torch.equal(got, want), f"step {t - prompt}"
            assert torch.equal(dc.ws.ids, dw.ws.ids), f"step {t - prompt}"
        assert torch.equal(dc.counters, dw.counters)
        assert not bool(dc.host_dropped.any()), dc.host_dropped
        assert dsc.remote.slot_misses == 0 and dc.host_write_misses == 0
        assert torch.equal(dsc.remote.present, dsw.remote.present)
        assert dsc.remote.bytes_read == dsw.remote.bytes_read > 0
        used = S - dc.host.free_slots
        read = int(dsc.remote.present[:, :, dst].sum())
        assert read <= used <= read + (n // BS + 1 - npg + 1) * dc.host.num_layers * H
        assert dc.host.nbytes * 3 < dw.host.nbytes, (dc.host.nbytes, dw.host.nbytes)
        # the pieces' bytes in the pool equal the whole tier's
        sl = dc.host.slots.to(torch.int64)
        for li in range(dc.host.num_layers):
            m = sl[li] >= 0
            hp = torch.nonzero(m).reshape(-1)
            whole_k = dw.host.k[li].view(H * dw.host.num_pages, -1)[hp]
            assert torch.equal(dc.host.k_pool.view(S, -1)[sl[li][m]], whole_k), li
        pages = pages_of(rt_d, 2, n)
        dsw.release(2, pages, n)
        dsc.release(2, pages, n)
        assert dc.host.free_slots == S and bool((dc.host.slots < 0).all())
        assert not dsc.rows and bool(dsc.remote.present.all())
    finally:
        dsc.close()
        dsw.close()
        ps.close()


@pytest.mark.parametrize("mode", ["wait", "deferred"])
def test_a_pool_too_small_defers_reads_counts_them_and_the_requests_go_on(seed, mode, caplog):
    """Two requests on a pool of 20 pieces (of ~450 they would read or write): reads that do not
    fit are not made (counted, warned about), write-backs without a slot are counted, no read lands
    outside the pool, both requests decode every step at the engine level and are named for the
    glue to end (``starved_rows``, naming pd_host_slots); the releases give every slot back."""
    budget, steps, S, prompt = 24, 10, 20, 120
    pf, dc = engine(budget), compact_engine(budget, mode, S)
    ps = PrefillSide(pf, lease_s=600)
    ds, dpool = decode_side(dc, ps)
    try:
        n = prompt + steps
        K, V, Q, rt_p, rt_d = prefilled(pf, prompt, steps)
        rt_d[3, :n] = rt_d[2, :n] + 0          # (row 3: another request on other pages)
        free = torch.tensor(sorted(set(range(TOKENS // BS)) - set(pages_of(rt_d, 2, n).tolist())))[:-(-n // BS)]
        rt_d[3, :n] = (free[:, None] * BS + torch.arange(BS)).reshape(-1)[:n].to(torch.int32)
        src = pages_of(rt_p, 1, prompt)
        for row, room in ((2, 5), (3, 6)):
            sglang_transfer(pf, dc, dpool, src, pages_of(rt_d, row, prompt))
            ds.admit(row, rt_d[row], prompt, "prefill-host", 1, room, f"req-{room}")
        for t in range(prompt, n):
            out = decode(dc, [2, 3], rt_d, K, V, Q, t)
            assert bool(torch.isfinite(out).all()), f"step {t - prompt}"
            assert dc.host.free_slots >= 0
        assert ds.remote.slot_misses > 0 and not ds.remote.lost
        assert "compact host tier is full" in caplog.text
        assert S - dc.host.free_slots <= S
        # the glue ends them (sglang_hooks.abort_lost) instead of answering without those blocks
        starved = ds.starved_rows()
        assert set(starved) == {2, 3}, starved
        assert all("'pd_host_slots' 20" in why for why in starved.values()), starved
        for row in (2, 3):
            ds.release(row, pages_of(rt_d, row, n), n)
        assert dc.host.free_slots == S and bool((dc.host.slots < 0).all())
        assert ds.starved_rows() == {} and not bool(ds.remote.starved.any()) and not dc.write_starved
        assert not ds.remote.pending and bool(ds.remote.present.all())
    finally:
        ds.close()
        ps.close()
