"""Kernel 8 (benchmarks only): the churn replay of one layer in one launch.

``core.churn.replay_churn`` (the reference) rewrites each (request, KV head)'s predicted top-K
list so that it misses a measured number of resident blocks (``bench_oasis --churn``). In torch it
is about 25 small kernels per sparse layer; inside a CUDA graph their launches alone cost the
H200 about 4.7 ms per step at 1K with 8 requests (34 sparse layers), where the replay changes
nothing (the context fits the budget), so the replayed runs understated OasisKV.

One program per (request, KV head) row, ``K`` up to a few hundred blocks:
  1. membership of the list in the row's resident blocks (``K x K`` compares in registers);
  2. ``m`` = the layer's mean dithered by (context length, request, KV head), as the reference;
  3. the output list is the reference's stable sort by key written as ranks: forced blocks,
     then the ``m`` best non-resident ones, then resident non-forced blocks (slot order), then
     the other non-resident ones, each in list order, cut at ``K``; ``-1`` after.
Exactly the reference's lists and flags (``tests/kernels/test_kernels.py``, compared exactly).
Reference: ``oasis_sglang.core.churn.replay_churn``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from oasis_sglang.core.churn import replay_churn as reference

from ._common import next_pow2, pair_tile_warps

__all__ = ["replay_churn", "reference"]


@triton.jit
def _excl_cumsum(x):
    return tl.cumsum(x, axis=0) - x


@triton.jit
def _replay_churn_kernel(Wanted, Forced, Ids, Rows, Seed, OutW, OutF, H, K, m_floor, m_frac, salt_term,
                         BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    i = tl.arange(0, BLOCK_K)
    j = tl.arange(0, BLOCK_K)
    inb = i < K
    base = pid.to(tl.int64) * K
    w = tl.load(Wanted + base + i, mask=inb, other=-1)
    f = tl.load(Forced + base + i, mask=inb, other=0) != 0
    row = tl.load(Rows + b).to(tl.int64)
    held = tl.load(Ids + (row * H + h) * K + i, mask=inb, other=-1)
    held_j = tl.load(Ids + (row * H + h) * K + j, mask=j < K, other=-1)
    valid = w >= 0
    # 1. wanted blocks resident in the row (pairwise; -1 never matches). Block ids < 2**31: the
    # [K, K] tiles compare int32 (half the registers of int64 tiles, as the plan kernel)
    w32, held32, held_j32 = w.to(tl.int32), held.to(tl.int32), held_j.to(tl.int32)
    in_held = tl.max(((w32[:, None] == held_j32[None, :]) & (held_j32[None, :] >= 0)).to(tl.int32), axis=1) > 0
    in_held = in_held & valid
    nonres = valid & (f == 0) & (in_held == 0)
    # 2. m: the mean dithered as the reference (int64 arithmetic, then / 1024 in fp32)
    seed = tl.load(Seed + b).to(tl.int64)
    d = (seed * 1103515245 + pid.to(tl.int64) * 12345 + salt_term) % 1024
    dither = d.to(tl.float32) / 1024.0
    m = m_floor + (dither < m_frac).to(tl.int64)
    nr = nonres.to(tl.int64)
    take = nonres & ((tl.cumsum(nr, axis=0) - 1) < m)
    rest = nonres & (take == 0)
    fv = f & valid
    # resident blocks that are not forced blocks of the list
    fb_j = tl.load(Wanted + base + j, mask=j < K, other=-1)
    ff_j = tl.load(Forced + base + j, mask=j < K, other=0) != 0
    fb_j = tl.where(ff_j & (fb_j >= 0), fb_j, -2).to(tl.int32)
    held_forced = tl.max(((held32[:, None] == fb_j[None, :]) & (fb_j[None, :] >= 0)).to(tl.int32), axis=1) > 0
    held_free = (held >= 0) & (held_forced == 0) & inb
    # 3. ranks: forced, taken, resident (slot order), the rest of the list
    c0 = fv.to(tl.int64)
    c1 = take.to(tl.int64)
    c2 = held_free.to(tl.int64)
    c3 = rest.to(tl.int64)
    n0 = tl.sum(c0, axis=0)
    n1 = tl.sum(c1, axis=0)
    n2 = tl.sum(c2, axis=0)
    n3 = tl.sum(c3, axis=0)
    r_w = tl.where(fv, _excl_cumsum(c0), tl.where(take, n0 + _excl_cumsum(c1), n0 + n1 + n2 + _excl_cumsum(c3)))
    sel_w = fv | take | rest
    tl.store(OutW + base + r_w, w, mask=sel_w & (r_w < K))
    tl.store(OutF + base + r_w, fv.to(tl.int8), mask=sel_w & (r_w < K))
    r_h = n0 + n1 + _excl_cumsum(c2)
    tl.store(OutW + base + r_h, held, mask=held_free & (r_h < K))
    tl.store(OutF + base + r_h, tl.zeros_like(r_h).to(tl.int8), mask=held_free & (r_h < K))
    total = n0 + n1 + n2 + n3
    pad = inb & (i >= total)
    tl.store(OutW + base + i, tl.full((BLOCK_K,), -1, tl.int64), mask=pad)
    tl.store(OutF + base + i, tl.zeros((BLOCK_K,), tl.int8), mask=pad)


def replay_churn(wanted: torch.Tensor, forced: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor, mean: float,
                 seed: torch.Tensor, salt: int = 0, num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`core.churn.replay_churn` with the rows' resident blocks read in
    the kernel (``held = ids[rows]``).

    Args:
        wanted, forced: ``[B, H, K]`` int64 / bool from ``select_topk`` (``-1`` padded).
        ids: ``[R, H, K]`` int64 one layer's resident blocks per working-set row (``-1`` free).
        rows: ``[B]`` int32 / int64 working-set rows of the batch.
        mean: wanted blocks not resident per step and KV head to replay (NaN or ``<= 0``: none;
            at most ``K``).
        seed: ``[B]`` int64 the rows' context lengths (tokens), with ``salt`` (the layer) seeds
            the dither.
    Returns:
        ``(wanted, forced)``: new ``[B, H, K]`` int64 and bool tensors, equal to the reference's.
        Every block id below ``nb_max`` makes the reference's bitmap path agree too.
    Raises:
        AssertionError: shapes, dtypes, devices or contiguity do not match (before the launch).
    """
    B, H, K = wanted.shape
    dev = wanted.device
    assert wanted.dtype == torch.int64 and forced.dtype == torch.bool and forced.shape == wanted.shape
    assert ids.dtype == torch.int64 and ids.dim() == 3 and ids.shape[1:] == (H, K), (ids.shape, wanted.shape)
    assert rows.shape == (B,) and rows.dtype in (torch.int32, torch.int64) and seed.shape == (B,)
    assert wanted.is_contiguous() and forced.is_contiguous() and ids.is_contiguous()
    assert ids.device == rows.device == seed.device == forced.device == dev
    mean = float(mean)
    mean = min(mean, float(K)) if mean > 0 else 0.0            # the reference's clamp (NaN: no churn)
    out_w = torch.empty_like(wanted)
    out_f = torch.empty(B, H, K, dtype=torch.int8, device=dev)
    if B * H * K == 0:
        return out_w.fill_(-1), out_f.bool()
    fl = math.floor(mean)
    _replay_churn_kernel[(B * H,)](wanted, forced.view(torch.int8), ids, rows, seed.to(torch.int64).contiguous(),
                                   out_w, out_f, H, K, fl, mean - fl, int(salt) * 2654435761, BLOCK_K=next_pow2(K),
                                   num_warps=num_warps or pair_tile_warps(K))
    return out_w, out_f.view(torch.bool)
