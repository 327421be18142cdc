"""Kernel 6c: one layer's step budget shared by score rank, in one program.

``core.budget.share_budget`` (the reference, about 20 small torch ops) as a single Triton
program: a ``tl.histogram`` of the candidates' positions (``budget_candidates``: each (request,
KV head)'s candidates, by position in its top-K list), its cumulative sum gives the last
position whose candidates all fit and what is left for the heads with a candidate there; two
passes over the heads count those heads in the order rotated by the LRU clock (the tie-break)
and write each head's share. One launch per layer instead of ~20, recordable in a CUDA graph (no
host read). Exactly the reference's result (compared exactly). An unlimited budget (``< 0``)
writes ``C`` for every head without reading the lists (``budget_candidates`` lists none then).
Reference: ``oasis_sglang.core.budget.share_budget``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from oasis_sglang.core.budget import share_budget as reference

from ._common import next_pow2

__all__ = ["share_budget", "reference"]


@triton.jit
def _share_budget_kernel(Cand, Budget, Clock, Out, N, C, K,
                         BLOCK_E: tl.constexpr, NBINS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    if tl.load(Budget) < 0:           # unlimited: every head its whole list width, the lists unread
        i = tl.arange(0, BLOCK_N)
        for s in range(0, N, BLOCK_N):
            tl.store(Out + s + i, tl.full((BLOCK_N,), C, tl.int32), mask=s + i < N)
    else:
        _share_finite(Cand, Budget, Clock, Out, N, C, K, BLOCK_E, NBINS, BLOCK_N, BLOCK_C)


@triton.jit
def _share_finite(Cand, Budget, Clock, Out, N, C, K,
                  BLOCK_E: tl.constexpr, NBINS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    # histogram of candidate positions (bin NBINS - 1 > K - 1 collects the padding)
    hist = tl.zeros((NBINS,), dtype=tl.int32)
    total = N * C
    e = tl.arange(0, BLOCK_E)
    for s in range(0, total, BLOCK_E):
        x = tl.load(Cand + s + e, mask=s + e < total, other=-1)
        x = tl.where(x >= 0, x, NBINS - 1)
        hist += tl.histogram(x, NBINS)
    p = tl.arange(0, NBINS)
    hist = tl.where(p < K, hist, 0)
    cum = tl.cumsum(hist, axis=0).to(tl.int64)                          # candidates at positions <= p
    b = tl.load(Budget)
    full = tl.sum(((cum <= b) & (p < K)).to(tl.int64), axis=0)           # positions 0 .. full-1 fit whole
    below = tl.sum(tl.where(p == full - 1, cum, 0), axis=0)
    rest = b - below
    start = ((tl.load(Clock) % N) + N) % N                              # Python's modulo (the reference's)
    i = tl.arange(0, BLOCK_N)
    c = tl.arange(0, BLOCK_C)
    # pass 1: heads with a candidate at `full`, in all and before `start`
    n_at = tl.zeros((), dtype=tl.int64)
    n_at_before = tl.zeros((), dtype=tl.int64)
    for s in range(0, N, BLOCK_N):
        h = s + i
        x = tl.load(Cand + h[:, None] * C + c[None, :], mask=(h[:, None] < N) & (c[None, :] < C), other=-1)
        at = tl.max(((x >= 0) & (x == full)).to(tl.int32), axis=1) > 0
        n_at += tl.sum(at.to(tl.int64), axis=0)
        n_at_before += tl.sum((at & (h < start)).to(tl.int64), axis=0)
    # pass 2: each head's rank among them in rotated order, and its share
    run = tl.zeros((), dtype=tl.int64)
    for s in range(0, N, BLOCK_N):
        h = s + i
        x = tl.load(Cand + h[:, None] * C + c[None, :], mask=(h[:, None] < N) & (c[None, :] < C), other=-1)
        valid = x >= 0
        allow = tl.sum((valid & (x < full)).to(tl.int32), axis=1)
        at = tl.max((valid & (x == full)).to(tl.int32), axis=1) > 0
        ex = run + tl.cumsum(at.to(tl.int64), axis=0) - at.to(tl.int64)  # heads at `full` before h
        rank = tl.where(h >= start, ex - n_at_before, (n_at - n_at_before) + ex)
        allow += (at & (rank < rest)).to(tl.int32)
        tl.store(Out + h, allow, mask=h < N)
        run += tl.sum(at.to(tl.int64), axis=0)


def share_budget(cand_pos: torch.Tensor, budget: torch.Tensor, clock: torch.Tensor, K: int,
                 num_warps: int = 4) -> torch.Tensor:
    """Triton version of :func:`core.budget.share_budget` (same arguments and result).

    Raises:
        AssertionError: shapes, dtypes or devices do not match (before the launch).
    """
    N, C = cand_pos.shape
    dev = cand_pos.device
    assert cand_pos.dtype == torch.int32 and cand_pos.is_contiguous()
    assert budget.numel() == 1 and clock.numel() == 1 and budget.dtype == clock.dtype == torch.int64
    assert budget.device == clock.device == dev and 1 <= K
    out = torch.empty(N, dtype=torch.int32, device=dev)
    if N == 0 or C == 0:
        return out.zero_()
    _share_budget_kernel[(1,)](cand_pos, budget, clock, out, N, C, K, BLOCK_E=1024, NBINS=next_pow2(K + 1),
                               BLOCK_N=64, BLOCK_C=next_pow2(C), num_warps=num_warps)
    return out
