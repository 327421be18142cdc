"""disagg/admission.py + core/remote.py over real NIXL (UCX loopback), on the torch engine.

A request is prefilled on one engine (the prefill node), admitted on another with only its
summaries and first-step working set (the decode node), and decoded there while the blocks it
lacks are READ from the prefill engine's host tier. Its outputs must equal decoding on the
prefill engine itself (colocated), bit for bit, at a budget far below the context, when each
layer waits for its reads (``pd_read_mode: wait``); with the default ``deferred`` the reads are
made between steps only, and a block is never copied into the working set before it was read."""

import dataclasses

import pytest
import torch

pytest.importorskip("nixl")

from oasis_sglang.config import OasisConfig  # noqa: E402
from oasis_sglang.core import OasisSparseKV  # noqa: E402
from oasis_sglang.core.remote import RemoteBlocks  # noqa: E402
from oasis_sglang.disagg.admission import (apply_admission, build_admission, full_transfer_bytes,  # noqa: E402
                                           round_outward)
from oasis_sglang.disagg.transport import NixlTier, RemoteBlockFetcher  # noqa: E402

LAYERS, H, HQ, D, BS, ROWS, TOKENS = 4, 3, 9, 16, 4, 4, 1024


def engine(budget=24, predictor="previous", pd_read_mode="deferred"):
    cfg = OasisConfig(budget_tokens=budget, block_size=BS, sink_blocks=1, recent_blocks=2, dense_layers=(0,),
                      fetch_cap=2, predictor=predictor, pd_read_mode=pd_read_mode)
    return OasisSparseKV(cfg, LAYERS, TOKENS, ROWS, H, D, D, torch.float32, "cpu")


def locs(n, pages=TOKENS // BS):
    p = torch.randperm(pages)[: -(-n // BS)]
    return (p[:, None] * BS + torch.arange(BS)).reshape(-1)[:n]


def prefill(eng, row, rt, K, V, Q, n):
    for li in eng.sparse_layers:
        eng.write_kv(li, rt[row, :n].long(), K[li, :n], V[li, :n])
        eng.extend_attention(li, Q[li, :n], torch.tensor([row]), torch.tensor([0]), torch.tensor([n]), rt, None)


def prefilled(pf, prompt, steps):
    """K/V/Q of a request of ``prompt + steps`` tokens, its request tables (row 1 on the prefill
    engine, row 2 on the decode engine, other pages on each) and its prompt prefilled on ``pf``:
    ``(K, V, Q, rt_p, rt_d)``."""
    n = prompt + steps
    K, V, Q = torch.randn(LAYERS, n, H, D), torch.randn(LAYERS, n, H, D), torch.randn(LAYERS, n, HQ, D)
    rt_p = torch.zeros(ROWS, 256, dtype=torch.int32)
    rt_d = torch.zeros(ROWS, 256, dtype=torch.int32)
    rt_p[1, :n], rt_d[2, :n] = locs(n), locs(n)
    prefill(pf, 1, rt_p, K, V, Q, prompt)
    return K, V, Q, rt_p, rt_d


def decode(eng, rows, rt, K, V, Q, t):
    """One decode step of ``rows`` (each at position ``t`` of its own K/V/Q): ``[L-1, B, HQ, D]``."""
    rows = [rows] if isinstance(rows, int) else rows
    B = len(rows)
    eng.begin_decode_step(torch.tensor(rows), torch.tensor([t + 1] * B), rt)
    out = []
    for li in eng.sparse_layers:
        loc = rt[rows, t].long()
        k, v, q = (x[li, t:t + 1].expand(B, *x.shape[2:]).contiguous() for x in (K, V, Q))
        eng.write_kv(li, loc, k, v, decode=True)
        out.append(eng.decode_attention(li, q, k, v, None))
    return torch.stack(out)


@pytest.fixture
def nodes(seed, request):
    mode, budget, start_only = (tuple(getattr(request, "param", ())) + ("deferred", 24, False)[len(getattr(request, "param", ())):])
    pf, dc = engine(budget), engine(budget, pd_read_mode=mode)
    npf = NixlTier(pf.host.k, pf.host.v, f"prefill-{seed}")
    ndc = NixlTier(dc.host.k, dc.host.v, f"decode-{seed}")
    fetcher = RemoteBlockFetcher(ndc, timeout_s=10)
    peer = fetcher.add_peer(npf.layout())
    remote = RemoteBlocks(len(dc.sparse_layers), H, dc.host.num_pages, fetcher.fetch,
                          **(dict(post=fetcher.post, poll=fetcher.poll) if start_only else {}))
    dc.attach_remote(remote)
    yield pf, dc, remote, fetcher, peer, npf
    fetcher.close()
    ndc.close()
    npf.close()


@pytest.mark.parametrize("nodes", [("wait", 24)], indirect=True)
@pytest.mark.parametrize("prompt", [61, 64])
def test_pd_decode_equals_colocated_decode(nodes, prompt):
    """Summaries sent exact (``summary_dtype=None``): the same blocks are selected on both nodes."""
    pf, dc, remote, fetcher, peer, _ = nodes
    n, steps = prompt + 24, 24
    K, V, Q, rt_p, rt_d = prefilled(pf, prompt, steps)
    packet = build_admission(pf, 1, rt_p[1], prompt, summary_dtype=None)
    apply_admission(dc, remote, packet, peer, 2, rt_d[2])
    N, L, S = -(-prompt // BS), LAYERS - 1, 24 // BS     # pages, sparse layers, slots
    assert packet.nbytes == 8 * N + 2 * L * N * H * D * 4 + 8 * L * H * S + 2 * L * H * S * BS * D * 4
    assert packet.nbytes < full_transfer_bytes(prompt, L, H, D, D, 4)
    assert remote.missing(0) > 0                        # most blocks stayed on the prefill node
    for t in range(prompt, n):
        want = decode(pf, 1, rt_p, K, V, Q, t)          # colocated: the prefill engine decodes on
        got = decode(dc, 2, rt_d, K, V, Q, t)
        assert torch.equal(got, want), f"step {t - prompt}"
    assert fetcher.stats.transfers > 0 and remote.bytes_read == fetcher.stats.bytes > 0
    assert not remote.lost and not remote.failed_pages().numel()


def _resident_is_true_kv(eng, row, K, V, t):
    """Every block in ``row``'s working set holds the request's true K/V (tokens before ``t``)."""
    for i, layer in enumerate(eng.sparse_layers):
        ids = eng.ws.ids[i][row]                                   # [H, slots]
        for h, slot in torch.nonzero(ids >= 0).tolist():
            b = int(ids[h, slot])
            n = min(BS, t - b * BS)
            if n <= 0:
                continue
            assert torch.equal(eng.ws.k[i][row, h, slot, :n], K[layer, b * BS:b * BS + n, h]), (layer, h, b)
            assert torch.equal(eng.ws.v[i][row, h, slot, :n], V[layer, b * BS:b * BS + n, h]), (layer, h, b)


@pytest.mark.parametrize("nodes,covers", [(("deferred", 24), False), (("deferred", 96), True),
                                          (("deferred", 24, True), False), (("deferred", 96, True), True)],
                         indirect=["nodes"], ids=["waited", "waited-covering", "started", "started-covering"])
def test_deferred_reads_are_made_between_steps(nodes, covers):
    """``pd_read_mode: deferred``: after the first step (synchronous: it reads what it selects),
    NIXL reads happen only at a step's start (``RemoteBlocks.service``), never inside a layer; a
    block a plan left out is never copied before it was read (the working set holds only true
    K/V); each left-out piece is read. "started" (the serving set-up: ``post`` / ``poll``): the
    reads are started at a step's start and not waited for; their pieces become present at a
    later step's start. With a budget covering the context nothing is left out and the outputs
    equal colocated decoding."""
    pf, dc, remote, fetcher, peer, _ = nodes
    prompt, steps = 61, 24
    n = prompt + steps
    K, V, Q, rt_p, rt_d = prefilled(pf, prompt, steps)
    apply_admission(dc, remote, build_admission(pf, 1, rt_p[1], prompt, summary_dtype=None), peer, 2, rt_d[2])
    phase, calls = ["admitted"], []
    fetch, post = remote.fetch, remote.post
    remote.fetch = lambda *a: (calls.append(phase[0]), fetch(*a))[1]
    in_flight_after_start = []
    if post is not None:
        def post_marked(*a):
            calls.append(phase[0])
            read = post(*a)
            in_flight_after_start.append(not bool(remote.present[a[1], a[2], a[4]].any()))
            return read
        remote.post = post_marked
    begin = dc.begin_decode_step

    def begin_marked(*a, **k):
        phase[0] = "start"
        out = begin(*a, **k)
        phase[0] = "layers"
        return out

    dc.begin_decode_step = begin_marked
    equal, pending = [], []
    for t in range(prompt, n):
        want = decode(pf, 1, rt_p, K, V, Q, t)
        got = decode(dc, 2, rt_d, K, V, Q, t)
        equal.append(torch.equal(got, want))
        pending.append(len(remote.pending))
        _resident_is_true_kv(dc, 2, K, V, t + 1)
        if t == prompt:
            assert equal[0], "the first step waits for its reads"
            calls.clear()
    assert "layers" not in calls, "a NIXL read inside a predicted step"
    if covers:
        assert all(equal) and remote.deferred_pieces == 0
    else:
        assert calls, "no block was left out of a plan at budget 24"
        remote.service()                                 # the last plan's, read at the next step's start
        assert int(remote.deferred.sum()) == 0
        if post is not None:
            assert in_flight_after_start and all(in_flight_after_start), "a started read was waited for"
            assert max(pending) > 0, "no read was still in flight after its step's start"
            remote.wait_reads()
            assert not remote.pending and not bool(remote.inflight.any())
        assert remote.deferred_pieces > 0 and remote.deferred_bytes > 0
    assert not remote.lost


@pytest.mark.parametrize("nodes", [("deferred", 24, False), ("deferred", 24, True), ("wait", 24, False)],
                         indirect=True, ids=["waited", "started", "wait"])
def test_lost_peer_fails_its_pages_and_the_step_goes_on(nodes):
    """The prefill node disappears from NIXL mid-decode: the step completes, the admitted
    request's pages are reported failed (the glue ends it), and a request of the decode node's
    own in the same batch decodes exactly as it would alone."""
    pf, dc, remote, fetcher, peer, npf = nodes
    prompt, n = 61, 80
    K, V, Q = torch.randn(LAYERS, n, H, D), torch.randn(LAYERS, n, H, D), torch.randn(LAYERS, n, HQ, D)
    rt_p = torch.zeros(ROWS, 256, dtype=torch.int32)
    rt_d = torch.zeros(ROWS, 256, dtype=torch.int32)
    pages = torch.randperm(TOKENS // BS)
    rt_p[1, :n] = locs(n)
    rt_d[2, :n] = (pages[:20, None] * BS + torch.arange(BS)).reshape(-1)[:n]
    rt_d[3, :n] = (pages[20:40, None] * BS + torch.arange(BS)).reshape(-1)[:n]
    prefill(pf, 1, rt_p, K, V, Q, prompt)
    apply_admission(dc, remote, build_admission(pf, 1, rt_p[1], prompt), peer, 2, rt_d[2])
    alone = engine()                                    # row 3 prefilled here, and on an engine of its own
    prefill(dc, 3, rt_d, K, V, Q, prompt)
    prefill(alone, 3, rt_d, K, V, Q, prompt)
    fetcher.local.agent.remove_remote_agent(peer)       # NIXL forgets the peer: every READ fails
    for t in range(prompt, n):
        both = decode(dc, [2, 3], rt_d, K, V, Q, t)
        assert torch.equal(both[:, 1], decode(alone, 3, rt_d, K, V, Q, t)[:, 0]), f"step {t - prompt}"
    assert list(remote.lost) == [peer] and "PeerLostError" in remote.lost[peer]
    assert sorted(remote.failed_pages().tolist()) == sorted(pages[:-(-prompt // BS)].tolist())   # the prompt's
    remote.release(remote.failed_pages())               # the glue frees the failed request's pages
    assert not remote.failed_pages().numel() and bool(remote.present.all())


def test_round_outward_bounds_and_is_tight(seed):
    x = torch.randn(1000) * 10
    y = x + torch.rand(1000)
    lo, hi = round_outward(x, y, torch.bfloat16)
    assert lo.dtype == hi.dtype == torch.bfloat16
    assert bool((lo.float() <= x).all()) and bool((hi.float() >= y).all())
    # at most one bf16 step away
    assert bool((torch.nextafter(lo, torch.full_like(lo, float("inf"))).float() >= x).all())
    assert bool((torch.nextafter(hi, torch.full_like(hi, float("-inf"))).float() <= y).all())


def test_admission_refuses_a_misfit_and_current_predictor(nodes):
    pf, dc, remote, fetcher, peer, _ = nodes
    cur = engine(predictor="current")
    rt = torch.zeros(ROWS, 256, dtype=torch.int32)
    rt[0, :40] = locs(40)
    K, V, Q = torch.randn(LAYERS, 40, H, D), torch.randn(LAYERS, 40, H, D), torch.randn(LAYERS, 40, HQ, D)
    prefill(cur, 0, rt, K, V, Q, 40)
    with pytest.raises(ValueError, match="needs 'previous' or 'lookahead'"):
        build_admission(cur, 0, rt[0], 40)
    prefill(pf, 0, rt, K, V, Q, 40)
    packet = build_admission(pf, 0, rt[0], 40)
    before = (dc.summaries.kmin[0].clone(), remote.present.clone())
    short = rt[0].clone()
    with pytest.raises(ValueError, match="pages for the request"):      # a 40-token prompt in 9 pages, not 10
        apply_admission(dc, remote, dataclasses.replace(packet, prompt_len=36), peer, 0, short)
    assert torch.equal(dc.summaries.kmin[0], before[0]) and torch.equal(remote.present, before[1])
