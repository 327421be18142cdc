"""Kernel 6: capped-eviction plan of one layer fused with the copy lists of its admissions.

Stage (b) of the pipeline and the index work of stage (c) (paper: Methodology, Delta Selection
and Capped Eviction) in one launch: one program per (request, KV head) holds the ``K`` wanted
blocks (priority order) and the ``K`` resident slots in registers and decides everything with
``[K, K]`` comparisons instead of the reference's sorts, gathers and scatters (about 60 launches):

* ``match[i, s]``: wanted block ``i`` is held by slot ``s``; hits and kept slots are its row and
  column reductions; the ``missing`` blocks are admitted in priority order, at most
  ``n_free + fetch_cap`` of them unless forced (sink / recent);
* slot ``s``'s place in the destination order (free slots by index, then evictable slots by
  last use, then kept slots) is its stable rank ``#{t: key_t < key_s or (key_t == key_s and
  t < s)}``; the first ``n_admit`` places receive the admitted blocks in priority order, so a
  slot receives the admitted block whose admission rank equals its place;
* the table, the LRU clock and the counters (atomics) are updated in place, and the slots that
  need a copy (the block has a token before the step's new one, the row is not CUDA-graph
  padding) are listed first in the row's output, with their host piece ``h * P + page``.

With a step budget (``allow``: each head's share, ``core.budget.share_budget``) the admission
limit is also at most ``max(n_free, n_forced_missing) + allow``; ``budget_candidates`` (kernel
6b, same match) lists the candidates the share is computed over.

Exactly the reference's result (indices: compared exactly). Registers: ``[BLOCK_K, BLOCK_K]``
int32 / int64 tiles, ``BLOCK_K = next_pow2(K)`` (K = 128 for a 2,048-token budget of 16-token
blocks).
Reference: ``oasis_sglang.core.ops.TorchKVOps.plan_transfer``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from oasis_sglang.core.ops import TorchKVOps, check_slots

from ._common import check_range, checks_enabled, next_pow2, pair_tile_warps

reference = TorchKVOps().plan_transfer
reference_candidates = TorchKVOps().budget_candidates

_UNTOUCHABLE = 1 << 62          # destination key of a kept slot (after every LRU value)


@triton.jit
def _plan_transfer_kernel(Ids, LastUsed, Rows, Wanted, Forced, Step, Seq, ReqToToken,
                          Dst, Src, Counts, Counters, Allow, Slots, Dropped,
                          stride_ir, stride_ih, stride_wb, stride_wh, stride_rt,
                          H, K, P, W, cap, skip_row,
                          HAS_CAP: tl.constexpr, HAS_ALLOW: tl.constexpr, BS: tl.constexpr, BLOCK_K: tl.constexpr,
                          HAS_SLOTS: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    row = tl.load(Rows + b).to(tl.int64)
    seq = tl.load(Seq + b).to(tl.int64)
    step = tl.load(Step)
    idx = tl.arange(0, BLOCK_K)                 # used as wanted entry i (rows) and slot s (columns)
    inr = idx < K
    tbase = row * stride_ir + h * stride_ih
    held = tl.load(Ids + tbase + idx, mask=inr, other=-1)
    lru = tl.load(LastUsed + tbase + idx, mask=inr, other=0)
    wbase = b.to(tl.int64) * stride_wb + h * stride_wh
    w = tl.load(Wanted + wbase + idx, mask=inr, other=-1)
    f = tl.load(Forced + wbase + idx, mask=inr, other=0) != 0
    valid_w = w >= 0
    w32, held32 = w.to(tl.int32), held.to(tl.int32)        # block ids < 2**31: halves the [K, K] tiles
    match = (w32[:, None] == held32[None, :]) & valid_w[:, None] & (held >= 0)[None, :]   # [i, s]
    m32 = match.to(tl.int32)
    in_held = tl.max(m32, axis=1) > 0           # [i] a hit
    keep = tl.max(m32, axis=0) > 0              # [s] resident block still wanted
    missing = valid_w & ~in_held
    free = (held < 0) & inr
    evictable = (held >= 0) & ~keep
    n_free = tl.sum(free.to(tl.int32), axis=0)
    n_forced_missing = tl.sum((missing & f).to(tl.int32), axis=0)
    rank = tl.cumsum(missing.to(tl.int32), axis=0) - 1
    if HAS_CAP:
        limit = tl.maximum(n_free + cap, n_forced_missing)
    else:
        limit = K
    if HAS_ALLOW:       # the step budget's share of the candidates (ranks from max(n_free, forced))
        limit = tl.minimum(limit, tl.maximum(n_free, n_forced_missing) + tl.load(Allow + pid))
    admitted = missing & (rank < limit)
    n_admit = tl.sum(admitted.to(tl.int32), axis=0)
    arank = tl.cumsum(admitted.to(tl.int32), axis=0) - 1
    # destination order: stable rank of key (free -1, evictable its last use, kept / padding last)
    dkey = tl.where(free, -1, tl.where(evictable, lru, 4611686018427387904))
    before = (dkey[:, None] < dkey[None, :]) | ((dkey[:, None] == dkey[None, :]) & (idx[:, None] < idx[None, :]))
    place = tl.sum((before & inr[:, None]).to(tl.int32), axis=0)                          # [s]
    filled = (place < n_admit) & inr
    sel = admitted[:, None] & (arank[:, None] == place[None, :])                           # [i, s]
    new_blk = tl.sum(tl.where(sel, w32[:, None], 0), axis=0).to(tl.int64)                 # [s]
    new_held = tl.where(filled, new_blk, held)
    tl.store(Ids + tbase + idx, new_held, mask=inr)
    tl.store(LastUsed + tbase + idx, tl.where(keep | filled, step, lru), mask=inr)
    # copies: admitted blocks that already hold tokens, for rows other than the padding row
    real = row != skip_row
    live = filled & (new_blk * BS < seq - 1) & real
    loc = tl.load(ReqToToken + row * stride_rt + tl.minimum(new_blk * BS, W - 1), mask=live, other=0)
    page = (loc // BS).to(tl.int64)
    if HAS_SLOTS:
        # compact tier: the piece's pool row; none (-1): no copy, counted in Dropped
        piece = tl.load(Slots + h * P + page, mask=live, other=0).to(tl.int64)
        lost = live & (piece < 0)
        n_lost = tl.sum(lost.to(tl.int64), axis=0)
        tl.atomic_add(Dropped, n_lost, mask=n_lost > 0)
        live = live & (piece >= 0)
    else:
        piece = h * P + page
    pos = tl.cumsum(live.to(tl.int32), axis=0) - 1
    n_live = tl.sum(live.to(tl.int32), axis=0)
    obase = pid.to(tl.int64) * K
    tl.store(Dst + obase + idx, tl.full((BLOCK_K,), -1, tl.int64), mask=inr & (idx >= n_live))
    tl.store(Src + obase + idx, tl.full((BLOCK_K,), -1, tl.int64), mask=inr & (idx >= n_live))
    tl.store(Dst + obase + pos, (row * H + h) * K + idx, mask=live)
    tl.store(Src + obase + pos, piece, mask=live)
    tl.store(Counts + pid, n_live)
    hits = tl.sum(in_held.to(tl.int64), axis=0)
    evicted = tl.sum((filled & ~free).to(tl.int64), axis=0)
    r64 = real.to(tl.int64)
    tl.atomic_add(Counters + 0, hits * r64)
    tl.atomic_add(Counters + 1, n_live.to(tl.int64))
    tl.atomic_add(Counters + 2, evicted * r64)


@triton.jit
def _budget_candidates_kernel(Ids, Rows, Wanted, Forced, Out, Budget, stride_ir, stride_ih, stride_wb, stride_wh,
                              H, K, C, cap, HAS_CAP: tl.constexpr, HAS_BUDGET: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program per (request, KV head): the match of the plan kernel, then the positions of
    the evicting, non-forced admissions the cap allows (``working_set.budget_candidates``).
    An unlimited budget (``Budget < 0``) lists none and skips the match."""
    pid = tl.program_id(0)
    idx = tl.arange(0, BLOCK_K)
    obase = pid.to(tl.int64) * C
    unlimited = False
    if HAS_BUDGET:
        unlimited = tl.load(Budget) < 0
    if unlimited:
        tl.store(Out + obase + idx, tl.full((BLOCK_K,), -1, tl.int32), mask=idx < C)
    else:
        _list_candidates(Ids, Rows, Wanted, Forced, Out, stride_ir, stride_ih, stride_wb, stride_wh,
                         H, K, C, cap, pid, obase, HAS_CAP, BLOCK_K)


@triton.jit
def _list_candidates(Ids, Rows, Wanted, Forced, Out, stride_ir, stride_ih, stride_wb, stride_wh,
                     H, K, C, cap, pid, obase, HAS_CAP: tl.constexpr, BLOCK_K: tl.constexpr):
    b = pid // H
    h = pid % H
    row = tl.load(Rows + b).to(tl.int64)
    idx = tl.arange(0, BLOCK_K)
    inr = idx < K
    held = tl.load(Ids + row * stride_ir + h * stride_ih + idx, mask=inr, other=-1)
    wbase = b.to(tl.int64) * stride_wb + h * stride_wh
    w = tl.load(Wanted + wbase + idx, mask=inr, other=-1)
    f = tl.load(Forced + wbase + idx, mask=inr, other=0) != 0
    valid_w = w >= 0
    match = (w.to(tl.int32)[:, None] == held.to(tl.int32)[None, :]) & valid_w[:, None] & (held >= 0)[None, :]
    missing = valid_w & ~(tl.max(match.to(tl.int32), axis=1) > 0)
    n_free = tl.sum(((held < 0) & inr).to(tl.int32), axis=0)
    n_forced_missing = tl.sum((missing & f).to(tl.int32), axis=0)
    rank = tl.cumsum(missing.to(tl.int32), axis=0) - 1
    if HAS_CAP:
        hi = n_free + cap
    else:
        hi = n_free + K
    cand = missing & (rank >= tl.maximum(n_free, n_forced_missing)) & (rank < hi)
    j = tl.cumsum(cand.to(tl.int32), axis=0) - 1
    n = tl.sum(cand.to(tl.int32), axis=0)
    tl.store(Out + obase + idx, tl.full((BLOCK_K,), -1, tl.int32), mask=(idx < C) & (idx >= n))
    tl.store(Out + obase + j, idx.to(tl.int32), mask=cand)


def budget_candidates(ids, rows, wanted, forced, fetch_cap, budget=None, num_warps: int | None = None):
    """Triton version of :meth:`TorchKVOps.budget_candidates` (same arguments and result).

    Raises:
        AssertionError: shapes, strides, dtypes or devices do not match (before the launch).
    """
    B, H, K = wanted.shape
    assert ids.shape[1:] == (H, K) and forced.shape == wanted.shape, (ids.shape, wanted.shape, forced.shape)
    assert ids.dtype == wanted.dtype == torch.int64 and forced.dtype == torch.bool
    assert ids.stride(2) == 1 and wanted.is_contiguous() and forced.is_contiguous() and rows.shape == (B,)
    assert rows.device == wanted.device == forced.device == ids.device
    if budget is not None:
        assert budget.numel() == 1 and budget.dtype == torch.int64 and budget.device == ids.device, budget
    C = K if fetch_cap is None else min(int(fetch_cap), K)
    out = torch.empty((B * H, C), dtype=torch.int32, device=ids.device)
    if B == 0 or H == 0:
        return out
    _budget_candidates_kernel[(B * H,)](
        ids, rows.contiguous(), wanted, forced, out, out if budget is None else budget,
        ids.stride(0), ids.stride(1), wanted.stride(0), wanted.stride(1),
        H, K, C, C, HAS_CAP=fetch_cap is not None, HAS_BUDGET=budget is not None, BLOCK_K=next_pow2(K),
        num_warps=num_warps or pair_tile_warps(K))
    return out


def plan_transfer(ids, last_used, rows, wanted, forced, step, fetch_cap, seq, req_to_token, block_size: int,
                  num_pages: int, counters, skip_row: int | None = None, allow=None, num_warps: int | None = None,
                  slots=None, dropped=None):
    """Triton version of :meth:`TorchKVOps.plan_transfer` (same arguments and result).

    ``slots`` / ``dropped``: a compact host tier: each live copy's source is pool row
    ``slots[h * P + page]``; at ``-1`` the copy is not listed and ``dropped`` += 1 (one atomic
    per program that dropped any).

    Raises:
        AssertionError: shapes, strides, dtypes or devices do not match (before the launch).
        IndexError: with ``OASIS_KERNEL_CHECKS=1``, a row or context length out of range.
    """
    B, H, K = wanted.shape
    R, Hi, Ki = ids.shape
    assert (Hi, Ki) == (H, K) and last_used.shape == ids.shape and forced.shape == wanted.shape, \
        (ids.shape, wanted.shape, forced.shape)
    assert ids.dtype == last_used.dtype == wanted.dtype == torch.int64 and forced.dtype == torch.bool
    assert ids.stride(2) == 1 and last_used.stride() == ids.stride() and wanted.is_contiguous() and forced.is_contiguous()
    assert rows.shape == seq.shape == (B,) and req_to_token.stride(1) == 1
    dev = ids.device
    rows, seq = rows.contiguous(), seq.contiguous()          # read with unit stride (no-ops when they are)
    for t in (last_used, rows, wanted, forced, seq, req_to_token, counters):
        assert t.device == dev, "plan_transfer: every tensor must be on the working set's device"
    assert counters.dtype == torch.int64 and counters.numel() >= 3 and counters.is_contiguous()
    if not torch.is_tensor(step):
        step = torch.tensor(int(step), dtype=torch.int64, device=dev)
    assert step.dtype == torch.int64 and step.numel() == 1 and step.device == dev
    if slots is not None:
        check_slots(slots, dropped, H, num_pages, "plan_transfer")
        assert slots.device == dev, "plan_transfer: slots must be on the working set's device"
    dst = torch.empty((B * H, K), dtype=torch.int64, device=dev)
    src = torch.empty((B * H, K), dtype=torch.int64, device=dev)
    counts = torch.empty((B * H,), dtype=torch.int32, device=dev)
    if B == 0 or H == 0:
        return dst, src, counts
    if allow is not None:
        assert allow.shape == (B * H,) and allow.dtype == torch.int32 and allow.device == dev and allow.is_contiguous()
    if checks_enabled():
        check_range(rows, 0, R, "rows")
        check_range(seq, 1, req_to_token.shape[1] + 2, "seq")
    _plan_transfer_kernel[(B * H,)](
        ids, last_used, rows, wanted, forced, step, seq, req_to_token, dst, src, counts, counters,
        counts if allow is None else allow, counts if slots is None else slots, counters if dropped is None else dropped,
        ids.stride(0), ids.stride(1), wanted.stride(0), wanted.stride(1), req_to_token.stride(0),
        H, K, num_pages, req_to_token.shape[1], 0 if fetch_cap is None else min(int(fetch_cap), K),   # >= K: unbounded
        -1 if skip_row is None else int(skip_row),
        HAS_CAP=fetch_cap is not None, HAS_ALLOW=allow is not None, BS=block_size, BLOCK_K=next_pow2(K),
        HAS_SLOTS=slots is not None, num_warps=num_warps or pair_tile_warps(K))
    return dst, src, counts
