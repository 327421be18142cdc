"""Kernel 9: the dense path's working-set update of one decode step, every sparse layer in one launch.

A decode step whose every request's next context fits the working set takes the dense path
(``OasisSparseKV._dense_plan``, issue 17: requests whose context fits the budget go the dense
path with no selection). Its only bookkeeping is this update, done by the reference
(``TorchKVOps.dense_plan``) in about 25 small torch kernels over ``[L, B, H, K]``; at 1K
contexts and 8 requests their launches were a visible share of a 6 ms step. Here one program
per (layer, request, KV head) loads the row's ``K`` slot ids once, counts its hits (atomics into
``counters[l, 0]``), puts the blocks of positions ``seq - 1`` and ``seq`` into the first free
slot where they are not resident, and writes the ids and the LRU clocks back.

Bytes: ``2 * L * B * H * K * 8`` read and written (ids and LRU clocks). No host sync.
Duplicate rows (a CUDA-graph padding row repeated in a captured batch) are updated by several
programs; with the same ``seq`` each computes the same result, so the race is benign, as the
reference's ``ids[:, rows] = held`` with repeated rows.
Reference: ``oasis_sglang.core.ops.TorchKVOps.dense_plan``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from oasis_sglang.core.ops import TorchKVOps

from ._common import check_range, checks_enabled, next_pow2

reference = TorchKVOps().dense_plan

__all__ = ["dense_plan", "reference"]


@triton.jit
def _put_block(held, e, inb, j, ok, BLOCK_K: tl.constexpr):
    """``held`` with block ``j`` in its first free slot when ``ok`` and ``j`` is not resident."""
    present = tl.max((held == j).to(tl.int32), axis=0) > 0
    first = tl.min(tl.where((held < 0) & inb, e, BLOCK_K), axis=0)
    put = ok & (~present) & (first < BLOCK_K)
    return tl.where((e == first) & put, j, held)


@triton.jit
def _dense_plan_kernel(Ids, LastUsed, Rows, Seq, ClockNext, Counters,
                       stride_il, stride_ir, stride_ih, stride_ll, stride_lr, stride_lh, stride_cl,
                       B, H, K, skip_row,
                       BS: tl.constexpr, PIPELINED: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    l = (pid // (B * H)).to(tl.int64)
    rem = pid % (B * H)
    b = rem // H
    h = (rem % H).to(tl.int64)
    row = tl.load(Rows + b).to(tl.int64)
    s = tl.load(Seq + b).to(tl.int64)
    e = tl.arange(0, BLOCK_K)
    inb = e < K
    ibase = Ids + l * stride_il + row * stride_ir + h * stride_ih
    held = tl.load(ibase + e, mask=inb, other=-1)
    nb_next = (s + BS) // BS
    if PIPELINED:
        hit = (held >= 0) & (held < nb_next)
    else:
        hit = (held >= 0) & (held * BS < s - 1)
    n = tl.sum((hit & inb).to(tl.int64), axis=0)
    count = (row != skip_row) & (n > 0)
    tl.atomic_add(Counters + l * stride_cl, n, mask=count)      # masked: no atomic traffic when 0
    # this step's token's block, then the next one's (the reference's floor division: s >= 1 in
    # a decode step; s == 0 would put block -1, i.e. nothing)
    held = _put_block(held, e, inb, (s - 1) // BS, s >= 1, BLOCK_K)
    held = _put_block(held, e, inb, s // BS, s >= 0, BLOCK_K)
    tl.store(ibase + e, held, mask=inb)
    lbase = LastUsed + l * stride_ll + row * stride_lr + h * stride_lh
    lu = tl.load(lbase + e, mask=inb, other=0)
    clk = tl.load(ClockNext)
    tl.store(lbase + e, tl.where((held >= 0) & (held < nb_next), clk, lu), mask=inb)


def dense_plan(ids: torch.Tensor, last_used: torch.Tensor, rows: torch.Tensor, seq: torch.Tensor, block_size: int,
               pipelined: bool, clock_next: torch.Tensor, counters: torch.Tensor, skip_row: int | None = None,
               num_warps: int = 1) -> None:
    """Triton version of :meth:`TorchKVOps.dense_plan` (same arguments and effect; one launch).

    Args:
        ids, last_used: ``[L, R, H, K]`` int64, last dimension contiguous (updated in place).
        rows: ``[B]`` int32 / int64 request rows. seq: ``[B]`` int32 / int64 context tokens, the
            step's new token included. block_size: tokens per block. pipelined: the
            predictor's hit rule (see the reference). clock_next: 0-dim int64 device tensor.
        counters: ``[L, >=1]`` int64 (``counters[:, 0]`` += hits). skip_row: the padding row.
    Raises:
        AssertionError: shapes, strides, dtypes or devices do not match (before the launch).
        IndexError: with ``OASIS_KERNEL_CHECKS=1``, a row out of range.
    """
    L, R, H, K = ids.shape
    B = rows.shape[0]
    dev = ids.device
    assert last_used.shape == ids.shape and ids.dtype == last_used.dtype == torch.int64, (ids.shape, last_used.shape)
    assert ids.stride(3) == 1 and last_used.stride(3) == 1, "dense_plan: slots must be contiguous"
    assert rows.dim() == 1 and seq.shape == (B,), (rows.shape, seq.shape)
    assert rows.dtype in (torch.int32, torch.int64) and seq.dtype in (torch.int32, torch.int64)
    assert counters.dim() == 2 and counters.shape[0] == L and counters.shape[1] >= 1 and counters.dtype == torch.int64
    assert clock_next.numel() == 1 and clock_next.dtype == torch.int64
    for t in (last_used, rows, seq, clock_next, counters):
        assert t.device == dev, "dense_plan: every tensor must be on the block table's device"
    assert block_size >= 1
    if L * B * H * K == 0:
        return
    rows, seq = rows.contiguous(), seq.contiguous()
    if checks_enabled():
        check_range(rows, 0, R, "rows")
    _dense_plan_kernel[(L * B * H,)](
        ids, last_used, rows, seq, clock_next, counters,
        ids.stride(0), ids.stride(1), ids.stride(2), last_used.stride(0), last_used.stride(1), last_used.stride(2),
        counters.stride(0), B, H, K, -1 if skip_row is None else int(skip_row),
        BS=int(block_size), PIPELINED=bool(pipelined), BLOCK_K=next_pow2(K), num_warps=num_warps)
