"""core/host_tier.py: the host-memory KV store of the sparse layers (layout, reads, pinning)."""

from pathlib import Path

import pytest
import torch

from oasis_sglang.core.host_tier import HostTier
from oasis_sglang.core.ops import TorchKVOps


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


def test_unpinned_tier_is_committed_on_demand_and_discard_gives_back_only_whole_blocks(seed):
    """Off CUDA the tier takes host memory only where blocks were written (a PD decode node holds
    the blocks it read), and ``discard`` gives freed blocks back without touching other blocks."""
    from oasis_sglang.core.host_tier import OS_PAGE

    H, D, bs, P, L = 2, 64, 16, 256, 3                       # a (head, block) piece: 4 KiB in fp32
    ht = HostTier(L, P, bs, H, D, D, torch.float32)
    piece = bs * D * 4
    assert piece % OS_PAGE == 0
    assert ht.on_demand and ht.resident_bytes() == 0 and ht.nbytes == 2 * L * H * P * piece
    keep = {}
    for p in (10, 11, 12, 200):                           # every layer and head of 4 blocks
        for li in range(L):
            for h in range(H):
                keep[li, h, p] = (torch.randn(bs, D), torch.randn(bs, D))
                ht.k[li][h, p], ht.v[li][h, p] = keep[li, h, p]
    assert ht.resident_bytes() == 4 * 2 * L * H * piece
    assert ht.discard(torch.tensor([11, 200])) == 2 * 2 * L * H * piece
    assert ht.resident_bytes() == 2 * 2 * L * H * piece
    for (li, h, p), (k, v) in keep.items():
        if p in (11, 200):                                # given back: zeros until written again
            assert ht.k[li][h, p].abs().sum() == 0 and ht.v[li][h, p].abs().sum() == 0
        else:                                             # its neighbours keep their data
            assert torch.equal(ht.k[li][h, p], k) and torch.equal(ht.v[li][h, p], v)
    ht.k[0][1, 11] = 1.0                                  # writable again
    assert float(ht.k[0][1, 11].sum()) == bs * D
    with pytest.raises(ValueError, match="pages must be in 0..255"):
        ht.discard(torch.tensor([256]))


def test_discard_with_written_skips_only_runs_without_a_written_piece(seed):
    """``written`` (a PD decode node's ``present``): a run of consecutive pieces none of which is
    marked written costs no ``madvise``, and its memory stays (here it was written behind the
    mask's back, so that the skip shows); a run with one written piece goes back whole, the
    unmarked pieces in it included. Pages 5-7 are one run per (layer, KV head); 20 and 40 are
    runs of their own."""
    from oasis_sglang.core.host_tier import OS_PAGE

    H, D, bs, P, L = 2, 64, 16, 64, 2                     # 4 KiB pieces: one OS page each
    ht = HostTier(L, P, bs, H, D, D, torch.float32)
    piece = bs * D * 4
    assert piece % OS_PAGE == 0
    pages = torch.tensor([5, 6, 7, 20, 40])
    for li in range(L):
        ht.k[li][:, pages] = 1.0
        ht.v[li][:, pages] = 1.0
    written = torch.zeros(L, H, pages.numel(), dtype=torch.bool)
    written[0, 0, 1] = True                               # layer 0, head 0: page 6 of the run 5-7
    written[1, 1, 3] = True                               # layer 1, head 1: page 20
    given = ht.discard(pages, written=written)
    assert given == (3 + 1) * 2 * piece                   # K and V of the two runs
    assert ht.resident_bytes() == (2 * L * H * 5 - 2 * 4) * piece    # (before reading: a read maps the zero page)
    left = {(li, h, int(p)) for li in range(L) for h in range(H) for p in pages
            if ht.k[li][h, p].abs().sum() > 0}
    gone = {(0, 0, 5), (0, 0, 6), (0, 0, 7), (1, 1, 20)}
    assert left == {(li, h, int(p)) for li in range(L) for h in range(H) for p in pages} - gone
    # all marked: the same as no mask
    assert ht.discard(pages, written=torch.ones(L, H, pages.numel(), dtype=torch.bool)) == 2 * L * H * 5 * piece
    assert ht.resident_bytes() == 0


def test_discard_ignores_written_when_pieces_share_os_pages(seed):
    """Pieces smaller than an OS page: an unmarked piece may share an OS page with a written
    one, so ``written`` is not used and every run is given back as without it."""
    H, D, bs, P = 1, 8, 4, 512                            # 128 B pieces, 32 per OS page
    ht = HostTier(1, P, bs, H, D, D, torch.float32)
    ht.k[0][0, 32:64] = 1.0
    assert ht.discard(torch.arange(32, 64), written=torch.zeros(1, 1, 32, dtype=torch.bool)) > 0
    assert ht.resident_bytes() == 0 and ht.k[0][0, 32:64].abs().sum() == 0


def test_discard_refuses_a_written_mask_of_the_wrong_shape_or_dtype():
    ht = HostTier(2, 64, 16, 2, 64, 64, torch.float32)
    for bad in (torch.ones(2, 2, 3, dtype=torch.bool), torch.ones(2, 2, 2, dtype=torch.int64),
                torch.ones(1, 2, 2, dtype=torch.bool)):
        with pytest.raises(ValueError, match="written must be a bool tensor of shape \\[2, 2, 2\\]"):
            ht.discard(torch.tensor([3, 4]), written=bad)


def test_an_on_demand_tier_asks_for_no_transparent_huge_pages():
    """With THP set to "always" one written 4 KiB piece would commit 2 MiB: the mapping carries
    ``MADV_NOHUGEPAGE`` (the kernel's ``nh`` flag in /proc/self/smaps)."""
    smaps = Path("/proc/self/smaps")
    if not smaps.exists():
        pytest.skip("no /proc/self/smaps")
    ht = HostTier(1, 64, 16, 2, 64, 64, torch.float32)
    for t in (ht.k[0], ht.v[0]):
        addr, flags, inside = t.data_ptr(), None, False
        for line in smaps.read_text().splitlines():
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                flags = line.split()[1:]
                break
        assert flags is not None and "nh" in flags, flags


def test_discard_keeps_a_neighbour_sharing_an_os_page(seed):
    """Pieces smaller than an OS page: a freed block next to a live one is kept (its OS page is
    shared), so the live block's data survives."""
    H, D, bs, P = 1, 8, 4, 512                            # 128 B pieces, 32 per OS page
    ht = HostTier(1, P, bs, H, D, D, torch.float32)
    ht.k[0][0, :] = torch.randn(P, bs, D)
    before = ht.k[0].clone()
    ht.discard(torch.arange(1, 64))                      # block 0 lives: the first OS page stays
    assert torch.equal(ht.k[0][0, 0], before[0, 0])
    assert torch.equal(ht.k[0][0, 64:], before[0, 64:])
    assert ht.k[0][0, 32:64].abs().sum() == 0            # the second OS page was wholly freed


def test_resident_pages_names_the_blocks_holding_memory(seed):
    """``resident_pages`` maps resident OS pages back to blocks: the blocks written, and a
    neighbour sharing an OS page with one (pieces smaller than an OS page)."""
    H, D, bs, P, L = 2, 64, 16, 256, 2                    # 4 KiB pieces: one OS page each
    ht = HostTier(L, P, bs, H, D, D, torch.float32)
    assert ht.resident_pages().numel() == 0
    ht.k[1][1, 7] = 1.0                                   # one piece of one layer's K
    ht.v[0][0, 200] = 2.0
    assert ht.resident_pages().tolist() == [7, 200]
    ht.discard(torch.tensor([7]))
    assert ht.resident_pages().tolist() == [200]
    small = HostTier(1, 512, 4, 1, 8, 8, torch.float32)   # 128 B pieces, 32 per OS page
    small.k[0][0, 40] = 1.0
    assert small.resident_pages().tolist() == list(range(32, 64))


# ---- compact tier: a pool of pieces and a page -> slot table ----------------------------------------
def _compact(S=10, L=2, H=3, P=5, bs=4, D=8, Dv=6):
    return HostTier(L, P, bs, H, D, Dv, torch.float32, num_slots=S)


def test_compact_tier_layout_and_its_whole_tier_api():
    """One pool of S pieces for every layer, a table all -1; the per-layer buffers raise naming
    compact mode, sizes count the pools; the whole tier keeps its buffers and has no slots."""
    ht = _compact()
    assert ht.compact and ht.k_pool.shape == (10, 4, 8) and ht.v_pool.shape == (10, 4, 6)
    assert ht.slots.shape == (2, 15) and ht.slots.dtype == torch.int32 and (ht.slots == -1).all()
    assert ht.free_slots == 10 and ht.nbytes == 10 * 4 * (8 + 6) * 4 and ht.capacity_tokens == 20
    assert ht.piece_bytes == 4 * 6 * 4 and ht.resident_bytes() == 0
    for what in ("k", "v"):
        with pytest.raises(RuntimeError, match=r"compact tier \(num_slots=10\)"):
            getattr(ht, what)
    with pytest.raises(RuntimeError, match="compact tier.*unassign"):
        ht.discard(torch.tensor([1]))
    whole = HostTier(2, 5, 4, 3, 8, 6, torch.float32)
    assert not whole.compact and whole.slots is None and whole.k_pool is None and len(whole.k) == 2
    assert whole.buffers(1) == (whole.k[1], whole.v[1])
    for call in (lambda: whole.free_slots, lambda: whole.assign([0], [0], [0]), lambda: whole.unassign([0])):
        with pytest.raises(RuntimeError, match="only a compact tier"):
            call()


def test_assign_gives_lowest_free_slots_keeps_existing_and_merges_duplicates():
    ht = _compact(S=10, L=2, H=3, P=5)
    got = ht.assign(torch.tensor([1, 0, 0, 1]), torch.tensor([2, 0, 0, 0]), torch.tensor([4, 3, 3, 1]))
    # new pieces in increasing (layer, h * P + page) order: (0, 3) -> 0, (1, 1) -> 1, (1, 14) -> 2
    assert got.dtype == torch.int64 and got.tolist() == [2, 0, 0, 1] and ht.free_slots == 7
    assert ht.slots[0, 3] == 0 and ht.slots[1, 1] == 1 and ht.slots[1, 14] == 2
    assert int((ht.slots >= 0).sum()) == 3
    again = ht.assign([1, 0], [2, 1], [4, 0])                     # one kept, one new
    assert again.tolist() == [2, 3] and ht.free_slots == 6
    assert ht.assign([], [], []).numel() == 0 and ht.free_slots == 6


def test_unassign_frees_every_layer_and_head_and_reuses_them_first():
    ht = _compact(S=12, L=2, H=3, P=5)
    L_, H_, P_ = torch.meshgrid(torch.arange(2), torch.arange(3), torch.tensor([1, 3]), indexing="ij")
    ht.assign(L_.reshape(-1), H_.reshape(-1), P_.reshape(-1))            # 12 pieces: full
    assert ht.free_slots == 0
    held3 = sorted(ht.slots[:, torch.arange(3) * 5 + 3].reshape(-1).tolist())
    assert ht.unassign(torch.tensor([3, 3, 0])) == 6 and ht.free_slots == 6      # page 0 had none
    assert (ht.slots[:, torch.arange(3) * 5 + 3] == -1).all() and (ht.slots[:, torch.arange(3) * 5 + 1] >= 0).all()
    assert ht.unassign([3]) == 0
    got = ht.assign([0, 1, 1], [0, 0, 2], [4, 4, 0])
    assert got.tolist() == held3[:3], "the freed slots come back first, lowest first"
    assert ht.slots_peak == 12 and ht.free_slots == 3      # the peak stays at the most ever held
    assert ht.unassign(torch.tensor([], dtype=torch.int64)) == 0


def test_assign_when_full_raises_and_changes_nothing():
    from oasis_sglang.core.host_tier import HostTierFull

    ht = _compact(S=4, L=2, H=3, P=5)
    ht.assign([0, 0], [0, 1], [0, 0])
    table = ht.slots.clone()
    with pytest.raises(HostTierFull, match="2 free slots of 4; 3 new pieces") as ei:
        ht.assign([0, 1, 1, 1, 0], [0, 0, 1, 1, 2], [0, 2, 2, 2, 4])     # 1 kept, 3 new (one twice)
    assert isinstance(ei.value, RuntimeError)
    assert torch.equal(ht.slots, table) and ht.free_slots == 2
    assert ht.assign([1, 1], [0, 1], [2, 2]).tolist() == [2, 3] and ht.free_slots == 0


@pytest.mark.parametrize("bad", [0, -3, 2.0, True, "4", 2**31])
def test_compact_tier_rejects_bad_num_slots(bad):
    with pytest.raises(ValueError, match="num_slots"):
        HostTier(1, 2, 4, 1, 8, 8, torch.float32, num_slots=bad)


def test_assign_and_unassign_name_the_bad_argument():
    ht = _compact(S=10, L=2, H=3, P=5)
    table = ht.slots.clone()
    cases = [(([2], [0], [0]), "layers must be in 0..1"), (([0], [3], [0]), "heads must be in 0..2"),
             (([0], [0], [5]), "pages must be in 0..4"), (([0], [-1], [0]), "heads must be in 0..2"),
             (([0.0], [0], [0]), "layers must be integers"), (([0], [0], torch.tensor([True])), "pages must be integers"),
             (([0, 1], [0], [0, 1]), "one length")]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            ht.assign(*args)
    for bad, msg in (([5], "pages must be in 0..4"), (torch.tensor([0.5]), "pages must be integers")):
        with pytest.raises(ValueError, match=msg):
            ht.unassign(bad)
    assert torch.equal(ht.slots, table) and ht.free_slots == 10


def test_compact_reads_go_through_the_table_and_missing_pieces_read_zeros(seed):
    """``write_kv`` through the table, then ``read_tokens`` / ``read_prefix`` give what the
    whole tier gives, except pieces without a slot (zeros, as a never-written piece)."""
    H, D, Dv, bs, P, L = 3, 8, 6, 4, 10, 2
    whole = HostTier(L, P, bs, H, D, Dv, torch.float32)
    ht = HostTier(L, P, bs, H, D, Dv, torch.float32, num_slots=L * H * P)
    perm = torch.randperm(L * H * P)
    li, hh, pp = perm // (H * P), perm // P % H, perm % P
    ht.assign(li, hh, pp)
    assert ht.free_slots == 0
    ht.unassign([7])
    loc = torch.randperm(P * bs)[:23]
    k, v = torch.randn(23, H, D), torch.randn(23, H, Dv)
    kmin, kmax = torch.zeros(P, H, D), torch.zeros(P, H, D)
    drop = torch.zeros((), dtype=torch.int64)
    ops = TorchKVOps()
    ops.write_kv(whole.k[1], whole.v[1], kmin.clone(), kmax.clone(), loc, k, v, bs)
    ops.write_kv(*ht.buffers(1), kmin, kmax, loc, k, v, bs, slots=ht.slots[1], dropped=drop)
    assert int(drop) == H * int((loc // bs == 7).sum())
    wk, wv = whole.read_tokens(1, loc)
    gk, gv = ht.read_tokens(1, loc)
    miss = (loc // bs == 7)
    wk[miss], wv[miss] = 0, 0
    assert torch.equal(gk, wk) and torch.equal(gv, wv)
    row = torch.arange(P * bs, dtype=torch.int32)
    for n in (0, 13, 28):
        a, b = whole.read_prefix(1, row, n, "cpu", ops.copy_blocks), ht.read_prefix(1, row, n, "cpu", ops.copy_blocks)
        ak, av = a
        ak[torch.arange(n) // bs == 7], av[torch.arange(n) // bs == 7] = 0, 0
        assert torch.equal(b[0], ak) and torch.equal(b[1], av)


def test_compact_on_demand_pool_resident_pages_follow_the_table(seed):
    H, D, bs, P, L = 2, 64, 16, 8, 2                     # 4 KiB fp32 pieces: whole OS pages
    ht = HostTier(L, P, bs, H, D, D, torch.float32, num_slots=6)
    assert ht.on_demand and ht.resident_pages().numel() == 0
    ht.assign([0, 1, 1], [1, 0, 1], [3, 5, 5])
    assert ht.resident_pages().numel() == 0, "a slot never written holds no memory"
    ht.k_pool[int(ht.slots[1, 0 * P + 5])] = 1.0
    assert ht.resident_pages().tolist() == [5] and ht.resident_bytes() == bs * D * 4


def test_a_compact_pool_too_large_to_map_names_num_slots():
    """32 TiB of pool: the mmap fails (unless the kernel overcommits without limit) and the error
    names ``num_slots`` and the bytes, not only ENOMEM."""
    from pathlib import Path

    mode = Path("/proc/sys/vm/overcommit_memory")
    if not mode.exists() or mode.read_text().strip() == "1":
        pytest.skip("the kernel overcommits any mapping (vm.overcommit_memory=1)")
    with pytest.raises(OSError, match=r"num_slots=2147483647 pieces \(32768.00 GiB\)"):
        HostTier(1, 4, 16, 8, 128, 128, torch.float32, num_slots=2**31 - 1)
