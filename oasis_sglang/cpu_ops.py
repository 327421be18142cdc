"""Torch implementations of the ``sgl_kernel`` CPU ops SGLang 0.5.17 calls on the CPU engine.

PyPI ships ``sgl_kernel`` (package ``sglang-kernel``) for CUDA only; on a host without CUDA
``import sgl_kernel`` fails (``libcuda.so.1``), yet ``sglang/kernels/ops/kvcache/cache_move.py``
imports ``copy_all_layer_kv_cache_cpu`` from it when the CPU engine is on. The module
``oasis_sglang_cpu_shim`` (a top-level module run from ``oasis_sglang_cpu.pth`` at interpreter start)
serves this module as ``sgl_kernel`` only when ``libcuda.so.1`` cannot be loaded, so the real
``sgl_kernel`` is never shadowed on a GPU host.

Ops (exactly those the torch_native CPU path imports and calls):
  assign_req_to_token_pool_cpu   (sglang/srt/mem_cache/allocation.py)
  copy_all_layer_kv_cache_cpu    (sglang/kernels/ops/kvcache/cache_move.py)
"""

from __future__ import annotations

import ctypes

import torch

__all__ = ["assign_req_to_token_pool_cpu", "copy_all_layer_kv_cache_cpu"]

# Imported at module level by SGLang's speculative-decoding modules, which the server imports
# even without speculative decoding; never called on the plain decode path. They raise until
# the EAGLE-3 milestone implements them.
IMPORT_ONLY = ("assign_extend_cache_locs_cpu", "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu",
               "build_tree_kernel_efficient_cpu", "rotate_input_ids_cpu", "assign_draft_cache_locs_contiguous_cpu", "verify_tree_greedy_cpu")


def _not_implemented(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name}: speculative decoding on the CPU engine is not supported by oasis-sglang yet")
    op.__name__ = name
    return op


for _n in IMPORT_ONLY:
    globals()[_n] = _not_implemented(_n)
__all__ += list(IMPORT_ONLY)


def _bytes_view(ptr: int, nbytes: int) -> torch.Tensor:
    buf = (ctypes.c_char * nbytes).from_address(ptr)
    return torch.frombuffer(buf, dtype=torch.uint8)


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor,
                                tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
    """Copy KV rows ``src_loc[i] -> tgt_loc[i]`` in every buffer (all layers, K and V).

    Formula: for each buffer ``b`` with base address ``data_ptrs[b]`` and row size
    ``strides[b]`` bytes, ``row(b, tgt_loc[i]) := row(b, src_loc[i])`` for all ``i``, reading
    every source before writing (as SGLang's ``copy_all_layer_kv_cache_tiled`` Triton kernel).

    Args:
        data_ptrs: ``[nbuf]`` uint64/int64 buffer base addresses (host memory).
        strides: ``[nbuf]`` int64 bytes per token row.
        tgt_loc, src_loc: ``[n]`` int64 token locations.
    Raises:
        ValueError: mismatched lengths.
    """
    if tgt_loc.numel() != src_loc.numel() or data_ptrs.numel() != strides.numel():
        raise ValueError("copy_all_layer_kv_cache_cpu: mismatched tgt/src or ptr/stride lengths")
    if tgt_loc.numel() == 0:
        return
    tgt, src = tgt_loc.to(torch.int64), src_loc.to(torch.int64)
    rows = int(torch.maximum(tgt.max(), src.max())) + 1
    for ptr, stride in zip(data_ptrs.to(torch.int64).tolist(), strides.to(torch.int64).tolist()):
        view = _bytes_view(int(ptr), rows * int(stride)).view(rows, int(stride))
        view[tgt] = view[src].clone()


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """Write newly allocated token locations into the request table.

    Formula (SGLang's ``assign_req_to_token_pool`` Triton kernel): with
    ``o_i = sum_{j<i} (end_offset[j] - start_offset[j])``,
    ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] =
    out_cache_loc[o_i : o_i + end_offset[i] - start_offset[i]]`` for every request ``i``.

    Args:
        req_pool_indices, start_offset, end_offset: ``[B]`` int. req_to_token: ``[R, pool_len]``
        int32. out_cache_loc: ``[sum(end - start)]`` int64.
    Raises:
        ValueError: an ``end_offset`` exceeds ``pool_len`` or lengths disagree.
    """
    starts, ends = start_offset.tolist(), end_offset.tolist()
    rows = req_pool_indices.tolist()
    if len(starts) != len(ends) or len(rows) != len(starts):
        raise ValueError("assign_req_to_token_pool_cpu: batch lengths disagree")
    o = 0
    for r, s, e in zip(rows, starts, ends):
        if e > pool_len or s < 0 or e < s:
            raise ValueError(f"assign_req_to_token_pool_cpu: bad range [{s}, {e}) for pool_len {pool_len}")
        req_to_token[r, s:e] = out_cache_loc[o:o + e - s].to(req_to_token.dtype)
        o += e - s
