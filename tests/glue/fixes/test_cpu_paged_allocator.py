"""Torch paged allocation on CPU (page_size = block_size) against the allocation rule."""

import torch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

from oasis_sglang.sglang_glue.fixes.cpu_paged_allocator import alloc_decode_hook, alloc_decode_torch, alloc_extend_hook


def _alloc(page=4, size=64):
    return PagedTokenToKVPoolAllocator(size, page, torch.int64, "cpu", kvcache=None, need_sort=False)


def _unhooked(*a, **k):
    raise AssertionError("the original (Triton) path must not run on CPU")


def test_alloc_decode_rule():
    page = 4
    seq = torch.tensor([5, 6, 9, 13])          # new token positions 4, 5, 8, 12
    last = torch.tensor([11, 20, 31, 47])       # locations of the previous token
    free = torch.tensor([7, 2, 9])
    out, n = alloc_decode_torch(seq, last, free, page)
    # positions 4, 8, 12 start a page -> free pages in batch order; position 5 continues
    assert n == 3 and out.tolist() == [7 * 4, 21, 2 * 4, 9 * 4]


def test_alloc_extend_and_decode_hooks_give_page_aligned_unique_locations():
    a = _alloc()
    pre = torch.tensor([0, 0]); seq = torch.tensor([6, 8])
    out = alloc_extend_hook(_unhooked, a, pre, pre, seq, seq, torch.tensor([-1, -1]), 14)
    assert out is not None and len(set(out.tolist())) == 14
    r0, r1 = out[:6], out[6:]
    for r in (r0, r1):  # each page-sized run of a request stays inside one page, in order
        for i in range(len(r)):
            assert int(r[i]) // 4 == int(r[i - i % 4]) // 4 and int(r[i]) % 4 == i % 4
    free_before = len(a.free_pages)
    d = alloc_decode_hook(_unhooked, a, torch.tensor([7, 9]), torch.tensor([7, 9]), torch.stack([r0[-1], r1[-1]]))
    assert d.tolist()[0] == int(r0[-1]) + 1                # position 6 continues its page
    assert int(d[1]) % 4 == 0 and int(d[1]) // 4 not in {int(x) // 4 for x in out}   # position 8 opens a page
    assert len(a.free_pages) == free_before - 1


def test_alloc_returns_none_when_out_of_pages():
    a = _alloc(size=8)   # 2 pages
    pre = torch.tensor([0]); seq = torch.tensor([12])
    assert alloc_extend_hook(_unhooked, a, pre, pre, seq, seq, torch.tensor([-1]), 12) is None
    assert len(a.free_pages) == 2   # nothing leaked
