"""disagg/transport.py over real NIXL (UCX loopback): pieces of one host tier READ into another."""

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("nixl")

from oasis_sglang.core.host_tier import HostTier  # noqa: E402
from oasis_sglang.disagg.transport import NixlTier, PeerLostError, RemoteBlockFetcher, TierLayout  # noqa: E402

L, P, BS, H, D = 3, 40, 8, 3, 64


def tier(name, dtype=torch.float32, fill=True):
    t = HostTier(L, P, BS, H, D, D, dtype)
    if fill:
        for x in t.k + t.v:
            x.copy_(torch.randn(x.shape).to(dtype))
    return t, NixlTier(t.k, t.v, name)


@pytest.fixture
def pair(seed):
    src, ns = tier(f"pf-{seed}")
    dst, nd = tier(f"dc-{seed}", fill=False)
    f = RemoteBlockFetcher(nd, timeout_s=5)
    f.add_peer(TierLayout.from_bytes(ns.layout().to_bytes()))
    yield src, dst, ns, f
    f.close()
    nd.close()
    ns.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_fetch_copies_exactly_the_asked_pieces(seed, dtype):
    src, ns = tier(f"pf-{dtype}-{seed}", dtype)
    dst, nd = tier(f"dc-{dtype}-{seed}", dtype, fill=False)
    f = RemoteBlockFetcher(nd)
    peer = f.add_peer(ns.layout())
    n = 25
    heads = torch.randint(0, H, (n,))
    srcp = torch.randperm(P)[:n]
    dstp = torch.randperm(P)[:n]
    got = f.fetch(peer, 1, heads, srcp, dstp)
    assert got == n * 2 * BS * D * src.k[0].element_size() == f.stats.bytes
    want_k = torch.zeros_like(dst.k[1]).view(torch.uint8)
    want_v = torch.zeros_like(dst.v[1]).view(torch.uint8)
    want_k[heads, dstp] = src.k[1].view(torch.uint8)[heads, srcp]
    want_v[heads, dstp] = src.v[1].view(torch.uint8)[heads, srcp]
    assert torch.equal(dst.k[1].view(torch.uint8), want_k) and torch.equal(dst.v[1].view(torch.uint8), want_v)
    for li in (0, 2):                                      # other layers untouched
        assert not dst.k[li].view(torch.uint8).any() and not dst.v[li].view(torch.uint8).any()
    f.close()
    nd.close()
    ns.close()


def test_bad_requests_are_refused_by_name(pair):
    src, dst, ns, f = pair
    peer = ns.name
    with pytest.raises(KeyError):
        f.fetch("nobody", 0, [0], [0], [0])
    with pytest.raises(ValueError, match="heads"):
        f.fetch(peer, 0, [0, 1], [0], [0])
    with pytest.raises(ValueError, match="layer 3"):
        f.fetch(peer, 3, [0], [0], [0])
    with pytest.raises(ValueError, match="out of range"):
        f.fetch(peer, 0, [H], [0], [0])
    with pytest.raises(ValueError, match="out of range"):
        f.fetch(peer, 0, [0], [P], [0])
    assert f.fetch(peer, 0, [], [], []) == 0 and f.stats.transfers == 0
    assert not dst.k[0].any()


def test_incompatible_peer_is_refused_naming_the_field(seed):
    a, na = tier(f"a-{seed}")
    b = HostTier(L, P, BS * 2, H, D, D, torch.float32)
    nb = NixlTier(b.k, b.v, f"b-{seed}")
    with pytest.raises(ValueError, match="block_size"):
        RemoteBlockFetcher(na).add_peer(nb.layout())
    with pytest.raises(ValueError, match="malformed"):
        TierLayout.from_bytes(b'{"agent": "x"}')
    na.close()
    nb.close()


def test_a_layout_with_a_field_of_the_wrong_type_is_refused_naming_it(seed):
    """Each size, pointer and name of a peer's layout is checked when it is read: a string, a
    bool, a float or a negative value is refused naming the field, not met later as a TypeError."""
    import json

    a, na = tier(f"a-{seed}")
    try:
        good = json.loads(na.layout().to_bytes())
        assert TierLayout.from_bytes(json.dumps(good).encode()) == na.layout()
        for field, bad in [("num_pages", "64"), ("num_pages", 0), ("head_num", True), ("block_size", 2.0),
                           ("k_piece_bytes", -4), ("v_piece_bytes", None), ("num_layers", "30"),
                           ("num_layers", -1), ("k_ptrs", ["0x10"] * len(good["k_ptrs"])),
                           ("v_ptrs", [-1] * len(good["v_ptrs"])), ("sparse_layers", ["1"] * len(good["k_ptrs"])),
                           ("agent", 7), ("dtype", 16)]:
            with pytest.raises(ValueError, match=f"tier layout: {field}"):
                TierLayout.from_bytes(json.dumps({**good, field: bad}).encode())
    finally:
        na.close()


def test_dense_layers_in_other_positions_or_another_dtype_are_refused(seed):
    """Two nodes whose dense_layers differ in position but not in number have tiers of the same
    sizes, so SGLang's transfer would copy one layer's KV and summaries into another's places:
    the layout names the model layers, and the peer is refused naming dense_layers. A bf16 tier
    against an fp32 one is refused naming the dtype. A layout that does not say its layers (an
    older node) is still taken on sizes, and it crosses the network with its fields."""
    from oasis_sglang.disagg.transport import RemoteBlockFetcher as F

    a, b = HostTier(L, P, BS, H, D, D, torch.float32), HostTier(L, P, BS, H, D, D, torch.float32)
    c = HostTier(L, P, BS, H, D, D, torch.bfloat16)
    tiers = [NixlTier(a.k, a.v, f"a-{seed}", sparse_layers=(2, 3, 4), num_layers=5),    # dense_layers [0, 1]
             NixlTier(b.k, b.v, f"b-{seed}", sparse_layers=(1, 3, 4), num_layers=5),    # dense_layers [0, 2]
             NixlTier(c.k, c.v, f"c-{seed}", sparse_layers=(2, 3, 4), num_layers=5),
             NixlTier(b.k, b.v, f"d-{seed}", sparse_layers=(2, 3, 4), num_layers=6)]
    na, nb, nc, nd = tiers
    fa = F(na)
    try:
        lb = TierLayout.from_bytes(nb.layout().to_bytes())
        assert lb.sparse_layers == (1, 3, 4) and lb.num_layers == 5 and lb.dtype == "torch.float32"
        with pytest.raises(ValueError, match=r"dense_layers \[0, 2\] \(peer\) != \[0, 1\] \(here\)"):
            fa.add_peer(lb)
        with pytest.raises(ValueError, match="KV cache dtype torch.bfloat16"):
            fa.add_peer(nc.layout())
        with pytest.raises(ValueError, match="6 model layers"):
            fa.add_peer(nd.layout())
        old = TierLayout.from_bytes(nb.layout().to_bytes().replace(b'"sparse_layers": [1, 3, 4]', b'"x": 1'))
        assert old.sparse_layers == () and fa.add_peer(old) == f"b-{seed}"      # sizes alone: taken
        with pytest.raises(ValueError, match="sparse_layers"):
            NixlTier(b.k, b.v, f"e-{seed}", sparse_layers=(1, 2))
    finally:
        fa.close()
        for n in tiers:
            n.close()


def test_a_decode_rank_reads_only_from_the_prefill_rank_of_its_kv_heads(seed):
    """TP with PD: the layout says its TP rank and size; a peer of another rank or TP size is
    refused naming --tp-size (its KV heads are not this rank's), one of the same rank and size
    is taken, and bad rank fields are refused when the layout is read."""
    a, b = HostTier(L, P, BS, H, D, D, torch.float32), HostTier(L, P, BS, H, D, D, torch.float32)
    here = NixlTier(a.k, a.v, f"dc1-{seed}", tp=(1, 3))
    peers = {tp: NixlTier(b.k, b.v, f"pf{tp[0]}{tp[1]}-{seed}", tp=tp) for tp in [(0, 3), (1, 2), (1, 3)]}
    f = RemoteBlockFetcher(here)
    try:
        lay = TierLayout.from_bytes(peers[(1, 3)].layout().to_bytes())
        assert (lay.tp_rank, lay.tp_size) == (1, 3)
        with pytest.raises(ValueError, match=r"TP rank 0 of 3 \(peer\) != rank 1 of 3 \(here\).*another rank"):
            f.add_peer(peers[(0, 3)].layout())
        with pytest.raises(ValueError, match=r"TP rank 1 of 2 \(peer\).*same --tp-size"):
            f.add_peer(peers[(1, 2)].layout())
        assert f.add_peer(lay) == f"pf13-{seed}"
        for bad in (b'"tp_rank": 3', b'"tp_rank": -1', b'"tp_rank": true'):
            with pytest.raises(ValueError, match="tp_rank"):
                TierLayout.from_bytes(lay.to_bytes().replace(b'"tp_rank": 1', bad))
        with pytest.raises(ValueError, match="tp_size"):
            TierLayout.from_bytes(lay.to_bytes().replace(b'"tp_size": 3', b'"tp_size": "3"'))
        with pytest.raises(ValueError, match="tp_rank"):          # a rank with no size said
            TierLayout.from_bytes(lay.to_bytes().replace(b'"tp_size": 3', b'"tp_size": 0'))
        with pytest.raises(ValueError, match="another rank's layout"):
            f.add_peer(TierLayout.from_bytes(lay.to_bytes().replace(b'"tp_rank": 1', b'"tp_rank": 2')))
    finally:
        f.close()
        here.close()
        for n in peers.values():
            n.close()


PEER = r"""
import sys, time, torch
from oasis_sglang.core.host_tier import HostTier
from oasis_sglang.disagg.transport import NixlTier
t = HostTier(%d, %d, %d, %d, %d, %d, torch.float32)
for x in t.k + t.v:
    x.fill_(7.0)
n = NixlTier(t.k, t.v, "peer-proc")
open(sys.argv[1], "wb").write(n.layout().to_bytes())
while True:
    time.sleep(1)
""" % (L, P, BS, H, D, D)


def test_a_killed_peer_is_reported_within_the_deadline(tmp_path, seed):
    """The prefill process dies: the next READ raises PeerLostError naming it, in bounded time."""
    path = tmp_path / "layout.json"
    proc = subprocess.Popen([sys.executable, "-c", PEER, str(path)], env=dict(os.environ))
    try:
        t0 = time.time()
        while not path.exists() or not path.stat().st_size:
            assert proc.poll() is None and time.time() - t0 < 120, "peer process did not start"
            time.sleep(0.2)
        time.sleep(0.2)
        dst, nd = tier(f"dc-{seed}", fill=False)
        f = RemoteBlockFetcher(nd, timeout_s=5)
        peer = f.add_peer(TierLayout.from_bytes(path.read_bytes()))
        f.fetch(peer, 0, [1, 2], [3, 4], [5, 6])
        assert torch.all(dst.k[0][1, 5] == 7.0) and torch.all(dst.v[0][2, 6] == 7.0)
        proc.kill()
        proc.wait()
        t0 = time.time()
        with pytest.raises(PeerLostError, match="peer-proc"):
            for _ in range(20):                  # UCX may finish one READ from a dying peer's pages
                f.fetch(peer, 0, [0], [0], [0])
                time.sleep(0.1)
        assert time.time() - t0 < 5 * 20 + 10
        f.close()
        nd.close()
    finally:
        proc.kill()


def test_post_then_poll_reads_and_a_failed_read_stays_failed(pair, monkeypatch):
    """``post`` starts a READ and returns; ``poll`` says when its pieces are here (then counted).
    A read that failed raises again at every later ``poll`` (it never reads as arrived)."""
    src, dst, ns, f = pair
    peer = next(iter(f.peers))
    heads, srcp, dstp = torch.tensor([0, 2]), torch.tensor([5, 7]), torch.tensor([1, 3])
    p = f.post(peer, 2, heads, srcp, dstp)
    assert f.post(peer, 2, [], [], []) is None
    for _ in range(10000):
        if f.poll(p):
            break
        time.sleep(0.001)
    assert f.poll(p) and f.stats.transfers == 1 and f.stats.bytes == p.nbytes == 2 * 2 * BS * D * 4
    assert torch.equal(dst.k[2][heads, dstp], src.k[2][heads, srcp])
    ag = f.local.agent
    monkeypatch.setattr(ag, "transfer", lambda h: "PROC")          # as if still in flight past its deadline
    monkeypatch.setattr(ag, "check_xfer_state", lambda h: "PROC")
    q = f.post(peer, 2, heads, srcp, dstp, timeout_s=0.05)
    assert not f.poll(q), "a read in flight before its deadline is not done"
    time.sleep(0.06)
    for _ in range(2):
        with pytest.raises(PeerLostError, match="did not end in time"):
            f.poll(q)
    assert q.ended.wait(5), "the reader thread gives a read up past its deadline"
    monkeypatch.undo()
    assert f.stats.transfers == 1
    r = f.post(peer, 2, heads, srcp, dstp)                        # the reader thread reads on
    for _ in range(10000):
        if f.poll(r):
            break
        time.sleep(0.001)
    assert f.stats.transfers == 2
    f.close()


def test_one_post_reads_pieces_of_several_layers(pair):
    """``post`` with a layer per piece: one NIXL transfer holding pieces of every layer (the
    decode node's one read per peer and step), each landing in its own layer, nothing else
    written; a layer out of range or a layer list of another length is refused by name."""
    src, dst, ns, f = pair
    peer = next(iter(f.peers))
    n = 30
    layers = torch.randint(0, L, (n,))
    heads = torch.randint(0, H, (n,))
    srcp = torch.randint(0, P, (n,))
    dstp = torch.randperm(P)[:n]                 # distinct destinations: each piece's bytes are checkable
    p = f.post(peer, layers, heads, srcp, dstp)
    for _ in range(10000):
        if f.poll(p):
            break
        time.sleep(0.001)
    assert f.stats.transfers == 1 and p.pieces == n and p.nbytes == n * 2 * BS * D * 4
    for li in range(L):
        want_k, want_v = torch.zeros_like(dst.k[li]), torch.zeros_like(dst.v[li])
        m = layers == li
        want_k[heads[m], dstp[m]] = src.k[li][heads[m], srcp[m]]
        want_v[heads[m], dstp[m]] = src.v[li][heads[m], srcp[m]]
        assert torch.equal(dst.k[li], want_k) and torch.equal(dst.v[li], want_v), li
    with pytest.raises(ValueError, match="layer 0..3 not in 0..2"):
        f.post(peer, torch.tensor([0, 3]), heads[:2], srcp[:2], dstp[:2])
    with pytest.raises(ValueError, match="1 layers for 2 pieces"):
        f.post(peer, torch.tensor([0]), heads[:2], srcp[:2], dstp[:2])


def _until(f, p, limit=10.0):
    t0 = time.time()
    while not f.poll(p):
        assert time.time() - t0 < limit, "read did not end"
        time.sleep(0.001)


def test_a_read_given_up_while_queued_is_never_started(pair, monkeypatch):
    """A read whose deadline passes while it waits behind another (UCX loopback copies inside
    ``transfer``, simulated by a slow one) fails at ``poll``, is ended without being started,
    and its bytes never land (its pages may change hands at once)."""
    src, dst, ns, f = pair
    peer = next(iter(f.peers))
    ag = f.local.agent
    real = ag.transfer
    slow = threading.Event()

    def transfer(h):
        if not slow.is_set():
            slow.set()
            time.sleep(0.5)
        return real(h)
    monkeypatch.setattr(ag, "transfer", transfer)
    first = f.post(peer, 0, [0], [1], [2])
    while not slow.is_set():
        time.sleep(0.001)
    late = f.post(peer, 1, [1], [5], [7], timeout_s=0.05)
    time.sleep(0.1)
    with pytest.raises(PeerLostError, match="did not end in time"):
        f.poll(late)
    _until(f, first)
    assert late.ended.wait(5) and "before it started" in late.error
    assert not dst.k[1][1, 7].any() and not dst.v[1][1, 7].any(), "a given-up read wrote its page"
    assert torch.equal(dst.k[0][0, 2], src.k[0][0, 1])


def test_a_stalled_peer_does_not_hold_back_another_peers_read(seed, monkeypatch):
    """Two peers; every READ of peer A stays in progress (a stopped host): peer B's read,
    posted after it, still ends well within its deadline, and A's fails at its own."""
    sa, na = tier(f"pa-{seed}")
    sb, nb = tier(f"pb-{seed}")
    dst, nd = tier(f"dc2-{seed}", fill=False)
    f = RemoteBlockFetcher(nd, timeout_s=3)
    a = f.add_peer(TierLayout.from_bytes(na.layout().to_bytes()))
    b = f.add_peer(TierLayout.from_bytes(nb.layout().to_bytes()))
    ag = nd.agent
    real_init, real_transfer, real_state = ag.initialize_xfer, ag.transfer, ag.check_xfer_state
    stalled = set()

    def init(op, loc, rem, peer):
        h = real_init(op, loc, rem, peer)
        if peer == a:
            stalled.add(id(h))
        return h
    monkeypatch.setattr(ag, "initialize_xfer", init)
    monkeypatch.setattr(ag, "transfer", lambda h: "PROC" if id(h) in stalled else real_transfer(h))
    monkeypatch.setattr(ag, "check_xfer_state", lambda h: "PROC" if id(h) in stalled else real_state(h))
    try:
        pa = f.post(a, 0, [0], [1], [2])
        pb = f.post(b, 0, [1], [3], [4])
        t0 = time.time()
        _until(f, pb, limit=2.0)
        assert time.time() - t0 < 2.0 and torch.equal(dst.k[0][1, 4], sb.k[0][1, 3])
        time.sleep(3.1)
        with pytest.raises(PeerLostError, match="did not end in time"):
            f.poll(pa)
        assert pa.ended.wait(10)
    finally:
        monkeypatch.undo()
        f.close()
        for t in (nd, na, nb):
            t.close()


def test_closed_fetcher_refuses_reads_and_bad_inputs_are_named(pair):
    src, dst, ns, f = pair
    peer = next(iter(f.peers))
    for kw, msg in ((dict(layer=[0.5, 2.9]), "layer"), (dict(heads=[0.9, 2.0]), "heads"),
                    (dict(heads=[[0, 1]]), "heads"), (dict(layer="0"), "layer"), (dict(layer=None), "layer"),
                    (dict(timeout_s=0), "timeout_s"), (dict(timeout_s=-1.0), "timeout_s")):
        args = dict(layer=[0, 1], heads=[0, 1], src_pages=[1, 2], dst_pages=[3, 4])
        args.update(kw)
        with pytest.raises(ValueError, match=msg):
            f.post(peer, **args)
    with pytest.raises(ValueError, match="1 layers for 2 pieces"):
        f.post(peer, [0], [0, 1], [1, 2], [3, 4])
    p = f.post(peer, torch.tensor(2), [0, 1], [1, 2], [3, 4])          # a 0-d layer is one layer
    _until(f, p)
    f.close()
    with pytest.raises(RuntimeError, match="closed"):
        f.post(peer, 0, [0], [1], [2])


def test_an_idle_reader_thread_ends_and_a_closed_tier_lets_go_of_its_agent(pair, monkeypatch):
    """NIXL's progress thread busy-polls a core while an agent lives: the reader thread must not
    keep a fetcher's agent alive once idle (it ends, and the next read starts another), and a
    closed tier drops its agent and refuses to be used."""
    src, dst, ns, f = pair
    monkeypatch.setattr(RemoteBlockFetcher, "IDLE_EXIT_S", 0.2)
    peer = next(iter(f.peers))
    name = f"oasis-nixl-{f.local.name}"
    for _ in range(2):                                   # the second read starts a new reader thread
        assert f.fetch(peer, 1, [0, 2], [3, 4], [5, 6]) > 0
        torch.testing.assert_close(dst.k[1][[0, 2], [5, 6]], src.k[1][[0, 2], [3, 4]], rtol=0, atol=0)
        t_end = time.monotonic() + 10
        while any(t.name == name for t in threading.enumerate()) and time.monotonic() < t_end:
            time.sleep(0.05)
        assert not any(t.name == name for t in threading.enumerate()), "the idle reader thread did not end"
    tasks = len(os.listdir("/proc/self/task"))
    assert f.close() is True
    f.local.close()
    f.local.close()                                      # idempotent
    ns.close()
    assert f.local.closed and f.local.agent is None
    assert len(os.listdir("/proc/self/task")) < tasks, "closing both tiers ended none of NIXL's threads"
    with pytest.raises(RuntimeError, match="closed"):
        f.local.layout()


def test_agents_pause_between_progress_polls_on_the_cpu_engine(monkeypatch, seed):
    """nixl's Python API fixes the progress thread's pause at 0: each live agent spun a core
    (two agents: 5.94 CPU s per 3 s). With the CPU engine's 100 us pause two live agents stay
    far below one core, and a read still ends."""
    monkeypatch.delenv("OASIS_NIXL_PROGRESS_DELAY_US", raising=False)
    if torch.cuda.is_available():
        monkeypatch.setenv("OASIS_NIXL_PROGRESS_DELAY_US", "100")      # a GPU host keeps NIXL's 0 by default
    src, ns = tier(f"pf-delay-{seed}")
    dst, nd = tier(f"dc-delay-{seed}", fill=False)
    f = RemoteBlockFetcher(nd, timeout_s=5)
    try:
        f.add_peer(TierLayout.from_bytes(ns.layout().to_bytes()))
        t0 = time.process_time()
        time.sleep(2.0)
        used = time.process_time() - t0
        assert used < 0.5, f"two idle NIXL agents used {used:.2f} CPU s in 2 s (a spinning progress thread uses 2)"
        f.fetch(ns.name, 1, torch.tensor([0, 2]), torch.tensor([5, 6]), torch.tensor([7, 8]))
        assert torch.equal(dst.k[1][0, 7], src.k[1][0, 5]) and torch.equal(dst.v[1][2, 8], src.v[1][2, 6])
    finally:
        f.close()
        nd.close()
        ns.close()


@pytest.mark.parametrize("raw", ["abc", "-1", "2000000", "1.5", "1_000", "+7", "\u0661\u0660\u0660"])
def test_a_bad_progress_delay_is_refused_naming_the_variable(monkeypatch, raw):
    from oasis_sglang.disagg.transport import progress_delay_us

    monkeypatch.setenv("OASIS_NIXL_PROGRESS_DELAY_US", raw)
    with pytest.raises(ValueError, match="OASIS_NIXL_PROGRESS_DELAY_US"):
        progress_delay_us(cpu=True)
    monkeypatch.setenv("OASIS_NIXL_PROGRESS_DELAY_US", "0")
    assert progress_delay_us(cpu=True) == 0
    monkeypatch.setenv("OASIS_NIXL_PROGRESS_DELAY_US", " 250 ")
    assert progress_delay_us(cpu=False) == 250
    monkeypatch.delenv("OASIS_NIXL_PROGRESS_DELAY_US")
    assert progress_delay_us(cpu=True) == 100 and progress_delay_us(cpu=False) == 0


def test_the_progress_delay_is_only_raised():
    """OasisKV's tier agent and SGLang's NixlKVManager each set the delay, in either order: a
    later call asking for 0 (a GPU host's default) must not make later agents spin."""
    from oasis_sglang.disagg import transport

    transport.set_progress_delay(100)
    assert transport._progress_delay["us"] >= 100
    before = transport._progress_delay["us"]
    assert transport.set_progress_delay(0) and transport._progress_delay["us"] == before
    assert transport.set_progress_delay(before + 1) and transport._progress_delay["us"] == before + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_compact_decode_tier_reads_into_the_pool_rows_it_is_given(seed, dtype):
    """A compact decode tier (``HostTier(num_slots=S)``, its two pools registered): ``fetch``
    and a per-piece-layer ``post`` land each piece ``(layer, h, src page)`` of the peer's whole
    tier in the pool row asked for, byte for byte; the other rows stay zero; a row past the
    pool is refused by name; the peer's side is unchanged (``h * P + page`` of its tier)."""
    src, ns = tier(f"pf-c-{dtype}-{seed}", dtype)
    S = 17
    dst = HostTier(L, P, BS, H, D, D, dtype, num_slots=S)
    nd = NixlTier.of_host(dst, f"dc-c-{dtype}-{seed}")
    f = RemoteBlockFetcher(nd, timeout_s=5)
    try:
        assert nd.compact and nd.num_slots == S and nd.num_pages == P
        lay = nd.layout()
        assert len(lay.k_ptrs) == L and lay.num_pages == P
        peer = f.add_peer(TierLayout.from_bytes(ns.layout().to_bytes()))
        rows = torch.randperm(S)
        n1 = 6
        heads, srcp = torch.randint(0, H, (n1,)), torch.randint(0, P, (n1,))
        got = f.fetch(peer, 1, heads, srcp, rows[:n1])
        assert got == n1 * 2 * BS * D * src.k[0].element_size()
        n2 = 9
        layers, h2, s2 = torch.randint(0, L, (n2,)), torch.randint(0, H, (n2,)), torch.randint(0, P, (n2,))
        _until(f, f.post(peer, layers, h2, s2, rows[n1:n1 + n2]))
        want_k = torch.zeros_like(dst.k_pool).view(torch.uint8)
        want_v = torch.zeros_like(dst.v_pool).view(torch.uint8)
        for i in range(n1):
            want_k[rows[i]] = src.k[1].view(torch.uint8)[heads[i], srcp[i]]
            want_v[rows[i]] = src.v[1].view(torch.uint8)[heads[i], srcp[i]]
        for i in range(n2):
            want_k[rows[n1 + i]] = src.k[int(layers[i])].view(torch.uint8)[h2[i], s2[i]]
            want_v[rows[n1 + i]] = src.v[int(layers[i])].view(torch.uint8)[h2[i], s2[i]]
        assert torch.equal(dst.k_pool.view(torch.uint8), want_k)
        assert torch.equal(dst.v_pool.view(torch.uint8), want_v)
        with pytest.raises(ValueError, match="pool rows < 17"):
            f.fetch(peer, 0, [0], [0], [S])
    finally:
        f.close()
        nd.close()
        ns.close()


def test_a_bad_compact_registration_is_refused(seed):
    t = HostTier(L, P, BS, H, D, D, torch.float32, num_slots=4)
    with pytest.raises(ValueError, match="compact"):
        NixlTier([t.k_pool], [t.v_pool], f"bad-{seed}", compact=(L, 0, P))
    with pytest.raises(ValueError, match="one K pool"):
        NixlTier([t.k_pool, t.k_pool], [t.v_pool, t.v_pool], f"bad-{seed}", compact=(L, H, P))
    with pytest.raises(ValueError, match="want contiguous CPU"):
        NixlTier([t.k_pool[:, 0]], [t.v_pool[:, 0]], f"bad-{seed}", compact=(L, H, P))
