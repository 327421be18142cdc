"""Kernel 2: Quest block scoring (GQA max) fused with the selection key, then top-K.

Math (Quest Sec. 3; paper: Methodology, Look-ahead Attention): for query row ``b``, KV head
``h`` with query heads ``g`` of its group and block ``j`` (page ``p`` from SGLang's
``req_to_token``)::

    u[b, h, j] = max_g sum_d max(q[b, g, d] * kmin[p, h, d], q[b, g, d] * kmax[p, h, d])

Sink blocks (``j < sink``) and recent blocks (``j >= nblocks - recent``) score ``+inf``; other
complete blocks their bound (NaN as ``-3e38``, infinities clamped to the largest finite float, so
a forced block always ranks first); the partial block and blocks past the context ``-inf``.
The kernel writes one int64 key per block: the score's order-preserving 32-bit image in the
high half and ``2**32 - 1 - j`` in the low half, so all keys are distinct, a larger key means a
higher score or, on a tie, a lower block id, and ``torch.topk`` on the keys returns exactly the
reference's stable order. One program per (query row, KV head, tile of blocks) reads each
candidate block's min and max rows once (contiguous ``D`` elements) for all ``G`` query heads;
only candidate blocks' summaries are read: ``2 * H * D * e`` bytes per complete block (``2 / bs`` of its KV).
Reference: ``oasis_sglang.core.ops.TorchKVOps.select_topk``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from oasis_sglang.core.ops import TorchKVOps

from ._common import check_range, checks_enabled, next_pow2

reference = TorchKVOps().select_topk

POS_INF_KEY32 = 0x7F800000                      # image of +inf
NEG_INF_KEY32 = -0x00800000 ^ 0x7FFFFFFF          # image of -inf (bits 0xFF800000 as int32, flipped)


@triton.jit
def _score_kernel(Q, Kmin, Kmax, ReqToToken, Rows, SeqLens, Keys,
                  stride_qb, stride_qh, stride_sp, stride_rt, stride_kb, stride_kh,
                  H, NB, sink, recent,
                  G: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.load(Rows + b).to(tl.int64)
    seq = tl.load(SeqLens + b).to(tl.int64)
    nblk = (seq + BS - 1) // BS
    ncomp = seq // BS
    inctx = j < nblk
    forced = inctx & ((j < sink) | (j >= nblk - recent))
    cand = (j < ncomp) & (~forced)
    tok = tl.load(ReqToToken + row * stride_rt + j.to(tl.int64) * BS, mask=cand, other=0)
    page = (tok // BS).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    srow = page[:, None] * stride_sp + h * D + d[None, :]      # one contiguous D-row per block
    sm = cand[:, None] & dm[None, :]
    lo = tl.load(Kmin + srow, mask=sm, other=0.0).to(tl.float32)
    hi = tl.load(Kmax + srow, mask=sm, other=0.0).to(tl.float32)
    score = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    qbase = Q + b.to(tl.int64) * stride_qb + (h * G) * stride_qh
    for g in tl.static_range(G):                               # GQA: max over the group's bounds
        qv = tl.load(qbase + g * stride_qh + d, mask=dm, other=0.0).to(tl.float32)
        a = qv[None, :] * lo
        c = qv[None, :] * hi
        # NaN propagates as in the torch reference (compiled tl.maximum returns the non-NaN operand)
        m = tl.where((a != a) | (c != c), float("nan"), tl.maximum(a, c))
        u = tl.sum(m, axis=1)
        score = tl.where((u != u) | (score != score), float("nan"), tl.maximum(score, u))
    score = score + 0.0                                          # -0.0 -> +0.0
    score = tl.where(score != score, -3.0e38, score)             # NaN -> -3e38, +-inf -> +-FLT_MAX:
    score = tl.minimum(tl.maximum(score, -3.4028234663852886e38), 3.4028234663852886e38)  # forced stay first
    score = tl.where(forced, float("inf"), tl.where(cand, score, float("-inf")))
    k32 = score.to(tl.int32, bitcast=True)
    k32 = tl.where(k32 < 0, k32 ^ 0x7FFFFFFF, k32)
    key = k32.to(tl.int64) * 4294967296 + (4294967295 - j.to(tl.int64))
    tl.store(Keys + b.to(tl.int64) * stride_kb + h * stride_kh + j, key, mask=j < NB)


def block_keys(q, kmin, kmax, req_to_token, rows, seq_lens, block_size: int, sink_blocks: int,
               recent_blocks: int, nb_max: int, block_n: int = 32, num_warps: int = 8) -> torch.Tensor:
    """Selection keys ``[B, H, nb_max]`` int64 (see module docstring). Arguments as ``select_topk``;
    ``block_n`` blocks per program and ``num_warps`` are launch parameters (scripts/bench_kernels.py).

    Raises:
        AssertionError: shapes, strides or dtypes do not match.
        IndexError: with ``OASIS_KERNEL_CHECKS=1``, a row, context length or page out of range.
    """
    B, Hq, D = q.shape
    P, H, Ds = kmin.shape
    assert Ds == D and Hq % H == 0 and kmax.shape == kmin.shape, (q.shape, kmin.shape)
    assert q.stride(2) == 1 and kmin.is_contiguous() and kmax.is_contiguous() and req_to_token.stride(1) == 1
    assert rows.shape == seq_lens.shape == (B,) and rows.device == seq_lens.device == q.device == kmin.device
    assert req_to_token.device == q.device
    G = Hq // H
    keys = torch.empty((B, H, nb_max), dtype=torch.int64, device=q.device)
    if B == 0 or nb_max == 0:
        return keys
    if checks_enabled():
        check_range(rows, 0, req_to_token.shape[0], "rows")
        check_range(seq_lens, 0, min(req_to_token.shape[1], nb_max * block_size) + 1, "seq_lens")
        check_range(req_to_token[rows.long(), :int(seq_lens.max())], 0, P * block_size,
                    "req_to_token entries of these rows")
    grid = (B * H, triton.cdiv(nb_max, block_n))
    _score_kernel[grid](q, kmin, kmax, req_to_token, rows, seq_lens, keys,
                        q.stride(0), q.stride(1), kmin.stride(0), req_to_token.stride(0),
                        keys.stride(0), keys.stride(1), H, nb_max, sink_blocks, recent_blocks,
                        G=G, BS=block_size, D=D, BLOCK_N=block_n, BLOCK_D=next_pow2(D), num_warps=num_warps)
    return keys


@triton.jit
def _decode_keys_kernel(Vals, Idx, Wanted, Forced, KK, K, BLOCK: tl.constexpr, POS: tl.constexpr,
                        NEG: tl.constexpr):
    # one program per (row, KV head): the top keys' high halves say forced (+inf) / absent (-inf)
    r = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    m = i < KK
    hi = tl.load(Vals + r * KK + i, mask=m, other=0) >> 32
    idx = tl.load(Idx + r * KK + i, mask=m, other=-1)
    wanted = tl.where(m & (hi > NEG), idx, -1)
    tl.store(Wanted + r * K + i, wanted, mask=i < K)
    tl.store(Forced + r * K + i, (m & (hi == POS)).to(tl.int8), mask=i < K)


def topk_from_keys(keys: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(wanted [B, H, k] int64, forced [B, H, k] bool)`` from ``block_keys`` (``-1`` padding):
    ``torch.topk`` on the keys, then one small kernel decodes them (instead of five elementwise ops)."""
    B, H, NB = keys.shape
    kk = min(k, NB)
    vals, idx = torch.topk(keys, kk, dim=-1, largest=True, sorted=True)
    if k > 4096:                    # one program holds a row of k keys: beyond that, elementwise ops
        hi = vals >> 32
        wanted = torch.where(hi > NEG_INF_KEY32, idx, torch.full_like(idx, -1))
        forced = hi == POS_INF_KEY32
        if kk < k:
            wanted = torch.cat([wanted, wanted.new_full((B, H, k - kk), -1)], -1)
            forced = torch.cat([forced, forced.new_zeros((B, H, k - kk))], -1)
        return wanted, forced
    wanted = torch.empty((B, H, k), dtype=torch.int64, device=keys.device)
    forced = torch.empty((B, H, k), dtype=torch.bool, device=keys.device)
    if B * H:
        _decode_keys_kernel[(B * H,)](vals, idx, wanted, forced.view(torch.int8), kk, k, BLOCK=next_pow2(k),
                                          POS=POS_INF_KEY32, NEG=NEG_INF_KEY32, num_warps=4)
    return wanted, forced


def select_topk(q, kmin, kmax, req_to_token, rows, seq_lens, block_size: int, sink_blocks: int,
                recent_blocks: int, nb_max: int, k: int, **launch):
    """Triton version of :meth:`TorchKVOps.select_topk` (same arguments and result).

    ``launch``: ``block_n`` / ``num_warps`` for ``block_keys``.
    """
    keys = block_keys(q, kmin, kmax, req_to_token, rows, seq_lens, block_size, sink_blocks, recent_blocks, nb_max,
                      **launch)
    return topk_from_keys(keys, k)
