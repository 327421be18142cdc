"""Torch implementations of the ``sgl_kernel`` CPU ops SGLang 0.5.17 calls on the CPU engine.

PyPI ships ``sgl_kernel`` (package ``sglang-kernel``) for CUDA only; on a host without CUDA
``import sgl_kernel`` fails (``libcuda.so.1``), yet SGLang's CPU engine imports ops from it
(``copy_all_layer_kv_cache_cpu`` in ``sglang/kernels/ops/kvcache/cache_move.py``, the
speculative-decoding ops below, ...). ``oasis_sglang.cpu.finder`` (imported by
``oasis_sglang_cpu.pth`` at interpreter start) serves this module as ``sgl_kernel``
only when ``libcuda.so.1`` cannot be loaded, so the real ``sgl_kernel`` is never shadowed on a
GPU host.

Ops, as ``sgl_kernel.<name>`` Python functions (SGLang does ``from sgl_kernel import <name>``):
  assign_req_to_token_pool_cpu      sglang/srt/mem_cache/allocation.py
  copy_all_layer_kv_cache_cpu       sglang/kernels/ops/kvcache/cache_move.py
  assign_extend_cache_locs_cpu      sglang/kernels/ops/speculative/cache_locs.py, srt/speculative/spec_utils.py
  assign_draft_cache_locs_contiguous_cpu  srt/speculative/eagle_worker_common.py
  build_tree_kernel_efficient_cpu   srt/speculative/eagle_utils.py (build_tree_kernel_efficient)
  verify_tree_greedy_cpu            srt/speculative/eagle_utils.py (verify_tree_greedy_func)
  fill_bonus_tokens_cpu             sglang/kernels/ops/speculative/eagle.py
  fill_accept_out_cache_loc_cpu     sglang/kernels/ops/speculative/eagle.py
  rotate_input_ids_cpu              sglang/kernels/ops/speculative/multi_layer_eagle.py
  build_draft_decode_metadata_cpu   srt/layers/attention/intel_amx_backend.py (num-steps > 1)

and, as torch operators ``torch.ops.sgl_kernel.<name>`` (the ``intel_amx`` attention backend,
``srt/layers/attention/intel_amx_backend.py``, calls them through ``torch.ops``; registered by
``register_torch_ops`` when this module is imported on a host without the CUDA driver):
  decode_attention_cpu, extend_attention_cpu

Every op mutates its output tensors in place, as the C++/Triton kernels it replaces do.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

__all__ = [
    "assign_req_to_token_pool_cpu", "copy_all_layer_kv_cache_cpu",
    "assign_extend_cache_locs_cpu", "assign_draft_cache_locs_contiguous_cpu",
    "build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu", "fill_bonus_tokens_cpu",
    "fill_accept_out_cache_loc_cpu", "rotate_input_ids_cpu", "build_draft_decode_metadata_cpu",
    "decode_attention_cpu", "extend_attention_cpu", "reconstruct_indices_from_tree_mask",
]

# tree_mask_mode values of sglang.srt.speculative.eagle_utils.TreeMaskMode
FULL_MASK, QLEN_ONLY, QLEN_ONLY_BITPACKING = 0, 1, 2


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


# ---------------------------------------------------------------------------------------------
# speculative decoding: cache locations
# ---------------------------------------------------------------------------------------------

def assign_extend_cache_locs_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """Gather the token locations of a range of every request's row (the inverse of
    ``assign_req_to_token_pool_cpu``).

    Formula (``assign_extend_cache_locs`` Triton kernel in
    ``sglang/kernels/ops/speculative/cache_locs.py``): with
    ``o_i = sum_{j<i} (end_offset[j] - start_offset[j])``,
    ``out_cache_loc[o_i : o_i + end_offset[i] - start_offset[i]] =
    req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]``; entries of
    ``out_cache_loc`` past ``sum(end - start)`` are left untouched.

    Args:
        req_pool_indices: ``[B]`` int64. req_to_token: ``[R, pool_len]`` int32.
        start_offset, end_offset: ``[B]`` int32/int64. out_cache_loc: ``[>= sum(end - start)]``
        int64, written in place.
    Raises:
        ValueError: batch lengths disagree, a range is outside ``[0, pool_len]``, or
            ``out_cache_loc`` is too short.
    """
    rows, starts, ends = req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()
    if not (len(rows) == len(starts) == len(ends)):
        raise ValueError("assign_extend_cache_locs_cpu: batch lengths disagree")
    o = 0
    for r, s, e in zip(rows, starts, ends):
        if s < 0 or e < s or e > pool_len:
            raise ValueError(f"assign_extend_cache_locs_cpu: bad range [{s}, {e}) for pool_len {pool_len}")
        if o + e - s > out_cache_loc.numel():
            raise ValueError("assign_extend_cache_locs_cpu: out_cache_loc is too short")
        out_cache_loc[o:o + e - s] = req_to_token[r, s:e].to(out_cache_loc.dtype)
        o += e - s


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                           seq_lens: torch.Tensor, out_cache_loc: torch.Tensor,
                                           pool_len: int, topk: int, num_steps: int) -> None:
    """Locations of the draft tokens of every request (contiguous layout: page size 1 or topk 1).

    Formula (``assign_draft_cache_locs_contiguous`` Triton kernel,
    ``sglang/kernels/ops/speculative/cache_locs.py``; caller
    ``srt/speculative/eagle_worker_common.py``): with ``n = topk * num_steps``,
    ``out_cache_loc[i*n : (i+1)*n] = req_to_token[req_pool_indices[i], seq_lens[i] : seq_lens[i] + n]``.

    Args:
        req_pool_indices, seq_lens: ``[B]`` int. req_to_token: ``[R, pool_len]`` int32.
        out_cache_loc: ``[B * topk * num_steps]`` int64, written in place.
    Raises:
        ValueError: ``out_cache_loc`` has the wrong size or a range passes ``pool_len``.
    """
    n = int(topk) * int(num_steps)
    rows, lens = req_pool_indices.tolist(), seq_lens.tolist()
    if out_cache_loc.numel() != len(rows) * n:
        raise ValueError(f"assign_draft_cache_locs_contiguous_cpu: out_cache_loc has {out_cache_loc.numel()} "
                         f"entries, expected {len(rows)} * {topk} * {num_steps}")
    for i, (r, s) in enumerate(zip(rows, lens)):
        if s < 0 or s + n > pool_len:
            raise ValueError(f"assign_draft_cache_locs_contiguous_cpu: [{s}, {s + n}) passes pool_len {pool_len}")
        out_cache_loc[i * n:(i + 1) * n] = req_to_token[r, s:s + n].to(out_cache_loc.dtype)


def fill_accept_out_cache_loc_cpu(accept_index: torch.Tensor, out_cache_loc: torch.Tensor,
                                  accept_out_cache_loc: torch.Tensor, size: Optional[int] = None) -> None:
    """Compact the cache locations of the accepted draft tokens.

    Formula (``fill_accept_out_cache_loc`` Triton kernel, ``sglang/kernels/ops/speculative/eagle.py``):
    over the first ``size`` entries of the flattened ``accept_index`` (default: all), the
    ``k``-th entry that is not ``-1``, ``a``, gives ``accept_out_cache_loc[k] = out_cache_loc[a]``;
    the rest of ``accept_out_cache_loc`` is left untouched.

    Args:
        accept_index: ``[B, S]`` int32 (``-1`` = not accepted). out_cache_loc: ``[B * draft]``
        int64. accept_out_cache_loc: ``[>= #accepted]`` int64, written in place.
        size: entries of ``accept_index`` to read (SGLang's 0.5.17 CPU call omits it).
    Raises:
        IndexError: an accepted index is outside ``out_cache_loc``.
    """
    flat = accept_index.reshape(-1)
    if size is not None:
        flat = flat[:size]
    src = flat[flat > -1].to(torch.int64)
    if src.numel():
        if int(src.max()) >= out_cache_loc.numel():
            raise IndexError("fill_accept_out_cache_loc_cpu: accept_index outside out_cache_loc")
        accept_out_cache_loc[:src.numel()] = out_cache_loc[src].to(accept_out_cache_loc.dtype)


def fill_bonus_tokens_cpu(accept_tokens: torch.Tensor, accept_lens: torch.Tensor,
                          bonus_tokens: torch.Tensor, accept_stride: int) -> None:
    """The last accepted token of every request (the bonus token the next draft starts from).

    Formula (``fill_bonus_tokens`` Triton kernel, ``sglang/kernels/ops/speculative/eagle.py``):
    ``bonus_tokens[i] = accept_tokens.flatten()[accept_stride * i + accept_lens[i] - 1]``.

    Args:
        accept_tokens: ``[B, accept_stride]`` int32 (``predict[accept_index]``).
        accept_lens: ``[B]`` int32, accepted tokens including the bonus (>= 1).
        bonus_tokens: ``[B]`` int32, written in place. accept_stride: width of a row.
    Raises:
        ValueError: an ``accept_lens`` entry is outside ``[1, accept_stride]``.
    """
    lens = accept_lens.to(torch.int64)
    if lens.numel() and (int(lens.min()) < 1 or int(lens.max()) > accept_stride):
        raise ValueError(f"fill_bonus_tokens_cpu: accept_lens outside [1, {accept_stride}]")
    idx = torch.arange(lens.numel(), dtype=torch.int64, device=lens.device) * accept_stride + lens - 1
    bonus_tokens.copy_(accept_tokens.reshape(-1)[idx].to(bonus_tokens.dtype))


# ---------------------------------------------------------------------------------------------
# speculative decoding: the draft tree and its greedy verification
# ---------------------------------------------------------------------------------------------

def build_tree_kernel_efficient_cpu(parent_list: torch.Tensor, selected_index: torch.Tensor,
                                    verified_seq_len: torch.Tensor, tree_mask: torch.Tensor,
                                    positions: torch.Tensor, retrive_index: torch.Tensor,
                                    retrive_next_token: torch.Tensor, retrive_next_sibling: torch.Tensor,
                                    topk: int, depth: int, draft_token_num: int, tree_mask_mode: int) -> None:
    """Build the EAGLE draft tree: attention mask, positions and the retrieval links.

    Mirrors ``sgl_build_tree_kernel_efficient_triton`` (``sglang/kernels/ops/speculative/spec_tree.py``;
    caller ``build_tree_kernel_efficient`` in ``srt/speculative/eagle_utils.py``). Per request
    ``b`` with ``n = draft_token_num`` tree nodes (node 0 = the verified bonus token, node
    ``i > 0`` = the draft token ``selected_index[b, i-1]``), ``L = verified_seq_len[b]``:

    * parent of node ``i``: ``t = selected_index[b, i-1] // topk``; ``t == 0`` -> node 0, else
      the node ``p+1`` with ``selected_index[b, p] == parent_list[b, t]`` (no such node: ``i``
      gets no parent link).
    * ``retrive_index[b, i] = b*n + i``; children are linked in reverse order:
      ``retrive_next_token[b, parent] = i`` (the smallest child) and
      ``retrive_next_sibling[b, i] =`` the previous first child (``-1`` otherwise; the caller
      pre-fills both with ``-1``).
    * ``tree_mask`` row of node ``i``: node 0 and every ancestor of ``i`` and ``i`` itself set,
      the other tree columns cleared; FULL_MASK (0) rows are ``L + n`` wide at offset
      ``n*n*b + n*sum_{j<b} L_j`` and leave the prefix columns ``[0, L)`` as they are;
      QLEN_ONLY (1) rows are ``n`` wide at offset ``n*n*b``.
    * ``positions[b*n + i] = L + depth_of(i)`` (node 0 has depth 0; the ancestor walk is
      bounded by ``depth``).

    Args:
        parent_list: ``[B, topk*(depth-1)+1]`` int64 (``[B, 0]`` when depth is 1).
        selected_index: ``[B, n-1]`` int64. verified_seq_len: ``[B]`` int64.
        tree_mask: bool, flat, written in place (size per mode above).
        positions: ``[B*n]`` int64; retrive_index / retrive_next_token / retrive_next_sibling:
        ``[B, n]`` int64, written in place.
    Raises:
        NotImplementedError: ``tree_mask_mode`` 2 (QLEN_ONLY_BITPACKING), as the C++ CPU kernel.
        ValueError: an unknown ``tree_mask_mode`` or a too small ``tree_mask``.
    """
    mode = int(tree_mask_mode)
    if mode == QLEN_ONLY_BITPACKING:
        raise NotImplementedError("build_tree_kernel_efficient_cpu: QLEN_ONLY_BITPACKING is not supported on CPU")
    if mode not in (FULL_MASK, QLEN_ONLY):
        raise ValueError(f"build_tree_kernel_efficient_cpu: unknown tree_mask_mode {tree_mask_mode}")
    n = int(draft_token_num)
    lens = verified_seq_len.tolist()
    bs = len(lens)
    need = n * n * bs + (n * sum(lens) if mode == FULL_MASK else 0)
    if tree_mask.numel() < need:
        raise ValueError(f"build_tree_kernel_efficient_cpu: tree_mask has {tree_mask.numel()} entries, needs {need}")
    sel = selected_index.reshape(bs, -1).tolist()
    par = parent_list.reshape(bs, -1).tolist()
    ri = retrive_index.view(bs, n)
    rnt = retrive_next_token.view(bs, n)
    rns = retrive_next_sibling.view(bs, n)
    mask = tree_mask.view(-1)
    prefix = 0
    for b in range(bs):
        L, s, pl = lens[b], sel[b], par[b]

        def parent_node(i):   # tree node index of the parent of node i (> 0), None when not found
            t = s[i - 1] // topk
            if t == 0:
                return 0
            tok = pl[t]
            for p in range(n - 1):
                if s[p] == tok:
                    return p + 1
            return None

        ri[b] = torch.arange(b * n, (b + 1) * n, dtype=ri.dtype)
        next_tok, next_sib = rnt[b].tolist(), rns[b].tolist()
        for i in range(n - 1, 0, -1):
            p = parent_node(i)
            if p is None:
                continue
            if next_tok[p] != -1:
                next_sib[i] = next_tok[p]
            next_tok[p] = i
        rnt[b] = torch.tensor(next_tok, dtype=rnt.dtype)
        rns[b] = torch.tensor(next_sib, dtype=rns.dtype)

        pos = [L] * n
        rows = torch.zeros(n, n, dtype=torch.bool)
        rows[:, 0] = True
        for i in range(1, n):
            d, cur = 0, i
            for _ in range(depth):
                d += 1
                rows[i, cur] = True
                p = parent_node(cur)
                if p is None or p == 0:
                    break
                cur = p
            pos[i] = L + d
        positions[b * n:(b + 1) * n] = torch.tensor(pos, dtype=positions.dtype)
        if mode == QLEN_ONLY:
            mask[b * n * n:(b + 1) * n * n] = rows.reshape(-1)
        else:
            base = n * n * b + n * prefix
            full = mask[base:base + n * (L + n)].view(n, L + n)
            full[:, L:] = rows
        prefix += L


def verify_tree_greedy_cpu(predicts: torch.Tensor, accept_index: torch.Tensor, accept_token_num: torch.Tensor,
                           candidates: torch.Tensor, retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
                           retrive_next_sibling: torch.Tensor, target_predict: torch.Tensor) -> None:
    """Greedy tree verification: accept the longest root path whose draft tokens equal the
    target model's argmax.

    Mirrors ``verify_tree_greedy_kernel_triton`` (``sglang/kernels/ops/speculative/spec_tree.py``;
    caller ``verify_tree_greedy_func`` in ``srt/speculative/eagle_utils.py``, by keyword). Per
    request ``b`` (``n`` draft slots, ``S = accept_index.shape[1]``): start at node 0 with
    ``last = retrive_index[b, 0]``, ``accept_index[b, 0] = last``; for ``j = 1 .. S-1`` walk the
    children of the current node (``retrive_next_token`` then ``retrive_next_sibling``) and take
    the first child ``c`` with ``candidates[b, c] == target_predict.flatten()[last]``: then
    ``predicts[last] = that token``, ``accept_index[b, j] = retrive_index[b, c]``, ``last`` moves
    there; stop at the first level without a match. Finally ``accept_token_num[b] = #accepted
    drafts`` (bonus excluded) and ``predicts[last] = target_predict.flatten()[last]`` (the bonus).
    Entries not reached are left untouched (the caller pre-fills ``accept_index`` with ``-1``).

    Args:
        predicts: ``[B*n]`` int32; accept_index: ``[B, S]`` int32; accept_token_num: ``[B]``
        int32 (all written in place). candidates, retrive_index, retrive_next_token,
        retrive_next_sibling, target_predict: ``[B, n]`` int64.
    Raises:
        ValueError: ``candidates`` and ``target_predict`` differ in shape.
    """
    if candidates.shape != target_predict.shape:
        raise ValueError("verify_tree_greedy_cpu: candidates and target_predict differ in shape")
    bs, n = candidates.shape
    S = accept_index.shape[1]
    cand = candidates.tolist()
    ri, rnt, rns = retrive_index.tolist(), retrive_next_token.tolist(), retrive_next_sibling.tolist()
    tp = target_predict.reshape(-1).tolist()
    pred_flat = predicts.view(-1)
    acc = accept_index.view(bs, S)
    for b in range(bs):
        last = ri[b][0]
        row = [last]
        cur = 0
        for _ in range(1, S):
            cur = rnt[b][cur]
            target = tp[last]
            while cur != -1 and cand[b][cur] != target:
                cur = rns[b][cur]
            if cur == -1:
                break
            pred_flat[last] = target
            last = ri[b][cur]
            row.append(last)
        acc[b, :len(row)] = torch.tensor(row, dtype=acc.dtype)
        accept_token_num[b] = len(row) - 1
        pred_flat[last] = tp[last]


def rotate_input_ids_cpu(input_ids: torch.Tensor, extend_start_loc: torch.Tensor, extend_seq_lens: torch.Tensor,
                         topk_index: torch.Tensor, select_index: Optional[torch.Tensor] = None) -> None:
    """Shift every request's extend tokens left by one and append its new draft token.

    Mirrors ``rotate_input_ids_kernel`` (``sglang/kernels/ops/speculative/multi_layer_eagle.py``):
    for request ``i`` with ``s = extend_start_loc[i]``, ``l = extend_seq_lens[i] > 0``:
    ``input_ids[s : s+l-1] = input_ids[s+1 : s+l]`` (old values), then
    ``input_ids[select_index[i] if select_index is not None else s+l-1] = topk_index[i]``.

    Args:
        input_ids: ``[T]`` int, modified in place. extend_start_loc, extend_seq_lens: ``[B]`` int.
        topk_index: ``[B]`` or ``[B, 1]`` int. select_index: optional ``[B]`` int.
    Raises:
        ValueError: batch lengths disagree.
    """
    starts, lens = extend_start_loc.tolist(), extend_seq_lens.tolist()
    new = topk_index.reshape(-1).tolist()
    if len(starts) != len(lens) or len(new) < len(lens):
        raise ValueError("rotate_input_ids_cpu: batch lengths disagree")
    sel = select_index.reshape(-1).tolist() if select_index is not None else None
    for i, (s, l) in enumerate(zip(starts, lens)):
        if l <= 0:
            continue
        input_ids[s:s + l - 1] = input_ids[s + 1:s + l].clone()
        input_ids[sel[i] if sel is not None else s + l - 1] = new[i]


def build_draft_decode_metadata_cpu(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                                    seq_lens: torch.Tensor, topk: int, num_steps: int, pool_len: int) -> torch.Tensor:
    """Request table of the multi-step draft decode (``IntelAMXMultiStepDraftBackend``, num-steps > 1).

    Formula (``build_draft_decode_metadata_cpu``, C++ in sgl-kernel; caller
    ``srt/layers/attention/intel_amx_backend.py``): row ``b*topk + t`` of the result holds
    ``req_to_token[r, :L]`` followed by candidate ``t``'s draft slots
    ``req_to_token[r, L + t*num_steps : L + (t+1)*num_steps]``, with ``r = req_pool_indices[b]``,
    ``L = seq_lens[b]``; the rest of the row is 0.

    Args:
        req_to_token: ``[R, pool_len]`` int32. req_pool_indices, seq_lens: ``[B]`` int.
    Returns:
        ``[B * topk, pool_len]`` tensor of ``req_to_token``'s dtype.
    Raises:
        ValueError: a row would pass ``pool_len``.
    """
    rows, lens = req_pool_indices.tolist(), seq_lens.tolist()
    out = torch.zeros((len(rows) * topk, pool_len), dtype=req_to_token.dtype, device=req_to_token.device)
    for b, (r, L) in enumerate(zip(rows, lens)):
        if L + topk * num_steps > pool_len:
            raise ValueError(f"build_draft_decode_metadata_cpu: {L} + {topk}*{num_steps} passes pool_len {pool_len}")
        for t in range(topk):
            out[b * topk + t, :L] = req_to_token[r, :L]
            out[b * topk + t, L:L + num_steps] = req_to_token[r, L + t * num_steps:L + (t + 1) * num_steps]
    return out


def reconstruct_indices_from_tree_mask(tree_mask: torch.Tensor, verified_seq_len: torch.Tensor,
                                       positions: torch.Tensor, retrive_index: torch.Tensor,
                                       retrive_next_token: torch.Tensor, retrive_next_sibling: torch.Tensor,
                                       batch_size: int, draft_token_num: int) -> None:
    """Positions and tree links of SGLang's NGRAM draft trees (in place).

    Mirrors ``reconstruct_indices_from_tree_mask`` (``sgl_kernel.speculative``, CUDA; caller
    ``srt/speculative/ngram_worker.py``, whose host twin ``_derive_tree_links`` gives the same
    links). With ``m[b, i, j]`` = node ``j`` is an ancestor of node ``i`` (``tree_mask`` viewed
    ``[bs, D, D]``) and ``parent(i)`` the largest ancestor ``j < i`` (``-1`` for the root):
    ``positions[b*D + i] = verified_seq_len[b] + #ancestors(i)``; ``retrive_index[b, i] = b*D + i``;
    ``retrive_next_token[b, i]`` = the first child of ``i``; ``retrive_next_sibling[b, i]`` = the
    next node after ``i`` with the same parent (``-1`` when none).

    Args:
        tree_mask: ``[bs * D * D]`` bool. verified_seq_len: ``[bs]`` int64. positions:
            ``[bs * D]`` int64 (out). retrive_*: ``[bs, D]`` int64 (out).
    """
    bs, D = int(batch_size), int(draft_token_num)
    if bs == 0:
        return
    m = tree_mask.reshape(-1)[:bs * D * D].view(bs, D, D).bool()
    node = torch.arange(D, device=m.device)
    anc = m & (node[None, :] < node[:, None])[None]                  # [bs, i, j]: j < i ancestor of i
    positions[:bs * D] = (verified_seq_len[:bs, None].to(torch.int64) + anc.sum(-1)).reshape(-1)
    retrive_index[:bs] = torch.arange(bs * D, device=m.device).view(bs, D)
    parent = torch.where(anc.any(-1), (anc * node).argmax(-1), torch.full_like(node, -1).expand(bs, D))
    big = torch.full((bs, D, D), D, dtype=torch.int64, device=m.device)
    child = parent[:, None, :] == node[None, :, None]               # [bs, i, k]: k is a child of i
    first = torch.where(child, node.expand(bs, D, D), big).amin(-1)
    retrive_next_token[:bs] = torch.where(first < D, first, torch.full_like(first, -1))
    sib = (parent[:, None, :] == parent[:, :, None]) & (node[None, None, :] > node[None, :, None]) \
        & (parent[:, :, None] >= 0)                                   # [bs, i, k]: k > i, same parent
    nxt = torch.where(sib, node.expand(bs, D, D), big).amin(-1)
    retrive_next_sibling[:bs] = torch.where(nxt < D, nxt, torch.full_like(nxt, -1))


# ---------------------------------------------------------------------------------------------
# attention (intel_amx backend): torch.ops.sgl_kernel.decode_attention_cpu / extend_attention_cpu
# ---------------------------------------------------------------------------------------------

def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, sm_scale: float,
            logit_cap: float, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """``softmax(q k^T * sm_scale (capped), masked by visible) v`` in fp32.

    q ``[M, Hq, D]``, k ``[N, Hkv, D]``, v ``[N, Hkv, Dv]``, visible ``[M, N]`` bool; GQA: query
    head ``h`` reads KV head ``h // (Hq // Hkv)``. ``sinks`` ``[Hq]``: an extra logit per head in
    the softmax denominator only. Rows with nothing visible give 0.
    """
    hq, hkv = q.shape[1], k.shape[1]
    g = hq // hkv
    qf = q.float().view(q.shape[0], hkv, g, q.shape[2])
    s = torch.einsum("mhgd,nhd->hgmn", qf, k.float()) * sm_scale
    if logit_cap > 0:
        s = logit_cap * torch.tanh(s / logit_cap)
    s = s.masked_fill(~visible, float("-inf"))
    m = s.amax(-1, keepdim=True)
    if sinks is not None:
        sk = sinks.float().view(hkv, g, 1, 1)
        m = torch.maximum(m, sk)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    den = p.sum(-1, keepdim=True)
    if sinks is not None:
        den = den + torch.exp(sk - m)
    o = torch.einsum("hgmn,nhd->mhgd", p, v.float()) / den.clamp_min(1e-30).permute(2, 0, 1, 3)
    return o.reshape(q.shape[0], hq, v.shape[2])


def decode_attention_cpu(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, output: torch.Tensor,
                         key: Optional[torch.Tensor], value: Optional[torch.Tensor], loc: torch.Tensor,
                         attn_logits: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                         seq_lens: torch.Tensor, sm_scale: float, logit_cap: float, is_cross_attn: bool,
                         sliding_window_size: int, encoder_lens: Optional[torch.Tensor],
                         sinks: Optional[torch.Tensor]) -> None:
    """One query token per request over its KV cache, writing the new K/V first.

    Signature of the 0.5.17 call in ``IntelAMXAttnBackend.forward_decode``
    (``srt/layers/attention/intel_amx_backend.py``; C++ ``decode_attention_cpu`` in sgl-kernel).
    Formula: ``k_cache[loc[b]] = key[b]``, ``v_cache[loc[b]] = value[b]``; then with
    ``idx = req_to_token[req_pool_indices[b], :seq_lens[b]]`` (the new token is the last),
    ``output[b, h] = softmax_j(cap(sm_scale * query[b, h] . k_cache[idx[j], h // G])) @ v_cache[idx, h // G]``
    where ``cap(x) = logit_cap * tanh(x / logit_cap)`` when ``logit_cap > 0``, ``G = Hq / Hkv``,
    keys outside the sliding window (``sliding_window_size > 0``: ``seq_lens[b]-1 - j <
    sliding_window_size``) are masked, and ``sinks[h]`` (if given) is an extra logit in the
    denominator. Computed in fp32, stored in ``output``'s dtype.

    Args:
        query: ``[B, Hq, D]``. k_cache/v_cache: ``[N, Hkv, D]`` / ``[N, Hkv, Dv]``.
        output: ``[B, Hq, Dv]``, written in place. key/value: ``[B, Hkv(*)D]`` new token's K/V.
        loc: ``[B]`` int64. attn_logits: split-K scratch of the C++ kernel, unused.
        req_to_token: ``[R, pool_len]`` int32; req_pool_indices, seq_lens: ``[B]`` int64.
        encoder_lens: only for cross attention.
    Raises:
        NotImplementedError: ``is_cross_attn`` (encoder-decoder models).
        ValueError: Hq not a multiple of Hkv, or batch lengths disagree.
    """
    if is_cross_attn:
        raise NotImplementedError("decode_attention_cpu (oasis-sglang torch op): cross attention is not supported")
    hkv = k_cache.shape[1]
    if query.shape[1] % hkv:
        raise ValueError(f"decode_attention_cpu: {query.shape[1]} query heads not a multiple of {hkv} KV heads")
    if key is not None and value is not None:
        li = loc.to(torch.int64)
        k_cache[li] = key.reshape(li.numel(), hkv, k_cache.shape[2]).to(k_cache.dtype)
        v_cache[li] = value.reshape(li.numel(), hkv, v_cache.shape[2]).to(v_cache.dtype)
    rows, lens = req_pool_indices.tolist(), seq_lens.tolist()
    if not (len(rows) == len(lens) == query.shape[0]):
        raise ValueError(f"decode_attention_cpu: {query.shape[0]} queries, {len(rows)} req_pool_indices, "
                         f"{len(lens)} seq_lens")
    for b, (r, L) in enumerate(zip(rows, lens)):
        idx = req_to_token[r, :L].to(torch.int64)
        vis = torch.ones(1, L, dtype=torch.bool)
        if int(sliding_window_size) > 0:
            vis &= (L - 1 - torch.arange(L))[None, :] < int(sliding_window_size)
        o = _attend(query[b:b + 1], k_cache[idx], v_cache[idx], vis, float(sm_scale), float(logit_cap), sinks)
        output[b] = o[0].to(output.dtype)


def extend_attention_cpu(q_extend: torch.Tensor, k_extend: Optional[torch.Tensor], v_extend: Optional[torch.Tensor],
                         o_extend: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
                         req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                         extend_seq_lens: torch.Tensor, extend_start_loc: torch.Tensor, max_len_extend: int,
                         sm_scale: float, logit_cap: float, is_cross_attn: bool, sliding_window_size: int,
                         encoder_lens: Optional[torch.Tensor], sinks: Optional[torch.Tensor],
                         tree_mask: Optional[torch.Tensor]) -> None:
    """Prefill / verify attention: the new tokens of every request over prefix + themselves.

    Signature of the 0.5.17 call in ``IntelAMXAttnBackend.forward_extend``
    (``srt/layers/attention/intel_amx_backend.py``; C++ ``extend_attention_cpu`` in sgl-kernel).
    Per request ``b``: ``e = extend_seq_lens[b]`` new tokens at rows
    ``s = extend_start_loc[b] .. s+e-1``, total length ``L = seq_lens[b]`` (prefix ``P = L - e``).
    Keys/values: the prefix from the cache, ``k_buffer[req_to_token[req_pool_indices[b], :P]]``,
    then the new tokens' own ``k_extend[s:s+e]`` (the cache is not read for them). New token
    ``i`` sees every prefix key and new token ``j <= i`` (causal), or, with ``tree_mask``, new
    token ``j`` where ``tree_mask[off_b + i*e + j]`` (the QLEN_ONLY layout of
    ``build_tree_kernel_efficient``, ``off_b = sum_{c<b} e_c^2``); a sliding window
    (``sliding_window_size > 0``) further hides keys with ``P+i - pos >= sliding_window_size``.
    ``o_extend[s+i, h] = softmax(cap(sm_scale * q . K)) @ V`` as in ``decode_attention_cpu``
    (GQA, logit cap, sinks), fp32 compute.

    Args:
        q_extend: ``[T, Hq, D]``; k_extend/v_extend: ``[T, Hkv(*)D]``; o_extend: ``[T, Hq, Dv]``
        written in place. k_buffer/v_buffer: ``[N, Hkv, D]`` / ``[N, Hkv, Dv]``.
        req_to_token: ``[R, pool_len]`` int32; req_pool_indices, seq_lens: ``[B]`` int64;
        extend_seq_lens, extend_start_loc: ``[B]`` int. max_len_extend: unused (tiling hint).
        tree_mask: optional flat bool ``[sum_b e_b^2]``.
    Raises:
        NotImplementedError: ``is_cross_attn`` (encoder-decoder models).
        ValueError: ``seq_lens < extend_seq_lens``, batch lengths disagree, or a too small ``tree_mask``.
    """
    if is_cross_attn or k_extend is None or v_extend is None:
        raise NotImplementedError("extend_attention_cpu (oasis-sglang torch op): cross attention is not supported")
    hkv = k_buffer.shape[1]
    if q_extend.shape[1] % hkv:
        raise ValueError(f"extend_attention_cpu: {q_extend.shape[1]} query heads not a multiple of {hkv} KV heads")
    ke = k_extend.reshape(k_extend.shape[0], hkv, -1)
    ve = v_extend.reshape(v_extend.shape[0], hkv, -1)
    rows, lens = req_pool_indices.tolist(), seq_lens.tolist()
    elens, starts = extend_seq_lens.tolist(), extend_start_loc.tolist()
    if not (len(rows) == len(lens) == len(elens) == len(starts)):
        raise ValueError("extend_attention_cpu: req_pool_indices, seq_lens, extend_seq_lens and extend_start_loc "
                         "differ in length")
    tm = tree_mask.reshape(-1) if tree_mask is not None else None
    if tm is not None and tm.numel() < sum(e * e for e in elens):
        raise ValueError("extend_attention_cpu: tree_mask is smaller than sum(extend_seq_lens^2)")
    moff = 0
    for b, (r, L, e, s) in enumerate(zip(rows, lens, elens, starts)):
        if e == 0:
            continue
        P = L - e
        if P < 0:
            raise ValueError(f"extend_attention_cpu: seq_lens[{b}]={L} < extend_seq_lens[{b}]={e}")
        idx = req_to_token[r, :P].to(torch.int64)
        k = torch.cat([k_buffer[idx].to(ke.dtype), ke[s:s + e]])
        v = torch.cat([v_buffer[idx].to(ve.dtype), ve[s:s + e]])
        qpos, kpos = torch.arange(P, L), torch.arange(L)
        vis = kpos[None, :] <= qpos[:, None]
        if tm is not None:
            vis[:, P:] = tm[moff:moff + e * e].view(e, e).to(torch.bool)
            moff += e * e
        if int(sliding_window_size) > 0:
            vis &= (qpos[:, None] - kpos[None, :]) < int(sliding_window_size)
        o = _attend(q_extend[s:s + e], k, v, vis, float(sm_scale), float(logit_cap), sinks)
        o_extend[s:s + e] = o.to(o_extend.dtype)


_TORCH_OP_SCHEMAS = {
    "decode_attention_cpu": (
        decode_attention_cpu,
        "decode_attention_cpu(Tensor query, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) output, "
        "Tensor? key, Tensor? value, Tensor loc, Tensor attn_logits, Tensor req_to_token, "
        "Tensor req_pool_indices, Tensor seq_lens, float sm_scale, float logit_cap, bool is_cross_attn, "
        "int sliding_window_size, Tensor? encoder_lens, Tensor? sinks) -> ()"),
    "extend_attention_cpu": (
        extend_attention_cpu,
        "extend_attention_cpu(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) o_extend, "
        "Tensor k_buffer, Tensor v_buffer, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, "
        "Tensor extend_seq_lens, Tensor extend_start_loc, int max_len_extend, float sm_scale, "
        "float logit_cap, bool is_cross_attn, int sliding_window_size, Tensor? encoder_lens, "
        "Tensor? sinks, Tensor? tree_mask) -> ()"),
}
_lib = None


def register_torch_ops() -> list[str]:
    """Register ``decode_attention_cpu`` / ``extend_attention_cpu`` as ``torch.ops.sgl_kernel.*``
    (CPU dispatch key), skipping any name the namespace already has. Returns the names registered.

    Called at import on hosts without the CUDA driver (where the real ``sgl_kernel`` cannot load
    and would otherwise own the namespace).
    """
    global _lib
    done = []
    for name, (fn, schema) in _TORCH_OP_SCHEMAS.items():
        if hasattr(torch.ops.sgl_kernel, name):
            continue
        if _lib is None:
            _lib = torch.library.Library("sgl_kernel", "FRAGMENT")
        _lib.define(schema)
        _lib.impl(name, fn, "CPU")
        done.append(name)
    return done


def _cuda_driver_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


if not _cuda_driver_present():
    register_torch_ops()
