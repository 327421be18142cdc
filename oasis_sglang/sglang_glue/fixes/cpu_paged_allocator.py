"""Torch implementation of SGLang's paged allocation on CPU hosts.

``PagedTokenToKVPoolAllocator.alloc_extend/alloc_decode`` launch Triton kernels
(``sglang/kernels/ops/memory/allocator.py``), which have no CPU backend. OasisKV needs
``page_size == block_size`` (a block is a page), so on CPU these hooks compute the same
indices with SGLang's own ``alloc_extend_naive`` and an equivalent decode rule. On other
devices they call the original.
"""

from __future__ import annotations

import torch


def _on_cpu(alloc) -> bool:
    return torch.device(alloc.device).type == "cpu"


def alloc_extend_hook(original, self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu,
                      last_loc, extend_num_tokens, num_new_pages=None):
    """AROUND ``PagedTokenToKVPoolAllocator.alloc_extend``: same contract (``[extend_num_tokens]``
    int64 locations, or ``None`` when out of pages, taking nothing), computed in torch on CPU."""
    if not _on_cpu(self):
        return original(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                        extend_num_tokens, num_new_pages)
    from sglang.srt.mem_cache.allocator.paged import alloc_extend_naive
    from sglang.srt.utils import get_num_new_pages

    if num_new_pages is None:
        num_new_pages = get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size,
                                          prefix_lens=prefix_lens_cpu)
    if self.need_sort and num_new_pages > len(self.free_pages):
        self.merge_and_sort_free()
    if num_new_pages > len(self.free_pages):
        return None
    out = torch.empty((extend_num_tokens,), dtype=torch.int64, device=self.device)
    alloc_extend_naive(prefix_lens, seq_lens, last_loc, self.free_pages, out, self.page_size, self.device)
    self.free_pages = self.free_pages[num_new_pages:]
    return out


def alloc_decode_torch(seq_lens: torch.Tensor, last_loc: torch.Tensor, free_pages: torch.Tensor,
                       page_size: int) -> tuple[torch.Tensor, int]:
    """Locations of one new token per request (``seq_lens`` already include it).

    A request whose last location ends a page takes the next free page, in batch order;
    the others continue their page. Returns ``(out [B] int64, pages_taken)``.
    """
    need = ((seq_lens - 1) % page_size) == 0
    rank = need.long().cumsum(0) - 1
    n = int(need.sum())
    new_loc = free_pages[rank.clamp(min=0)].to(torch.int64) * page_size if n else last_loc
    out = torch.where(need, new_loc, last_loc.to(torch.int64) + 1)
    return out, n


def alloc_decode_hook(original, self, seq_lens, seq_lens_cpu, last_loc):
    """AROUND ``PagedTokenToKVPoolAllocator.alloc_decode``: ``[B]`` int64 locations or ``None``."""
    if not _on_cpu(self):
        return original(self, seq_lens, seq_lens_cpu, last_loc)
    need = int((((seq_lens_cpu - 1) % self.page_size) == 0).sum())
    if self.need_sort and need > len(self.free_pages):
        self.merge_and_sort_free()
    if need > len(self.free_pages):
        return None
    out, n = alloc_decode_torch(seq_lens, last_loc, self.free_pages, self.page_size)
    self.free_pages = self.free_pages[n:]
    return out


def get_last_loc_hook(original, req_to_token, req_pool_indices_tensor, prefix_lens_tensor, *args, **kwargs):
    """AROUND ``mem_cache.allocation.get_last_loc``: SGLang picks the Triton kernel for every
    attention backend but torch_native/ascend; on CPU (EAGLE runs on intel_amx there) use
    SGLang's own torch version, ``get_last_loc_torch``."""
    if req_to_token.device.type != "cpu":
        return original(req_to_token, req_pool_indices_tensor, prefix_lens_tensor, *args, **kwargs)
    from sglang.srt.mem_cache.allocation import get_last_loc_torch

    return get_last_loc_torch(req_to_token, req_pool_indices_tensor, prefix_lens_tensor)
