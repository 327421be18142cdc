"""Kernel 5: split-KV causal attention of a few new tokens per request over SGLang's token-major
KV pool (the paired forward's dense layers and the draft layer).

Math: request ``b`` has ``NQ`` (1-2) new tokens, the last at position ``kv_lens[b] - 1``; row
``i`` sees the first ``n_i = kv_lens[b] - (NQ - 1 - i)`` tokens (a causal chain, EAGLE topk 1)::

    o[b, i, g] = softmax(scale * q K[:n_i]^T) V[:n_i],   K[t] = k_buf[req_to_token[row, t], h]

Stage 1: one program per (request, KV head, split of the context) gathers each KV tile once
through ``req_to_token`` for all ``NQ * G`` query rows of the GQA group (one ``tl.dot``), masks
each row causally, keeps an online softmax and writes a partial output and LSE. The grid is
``(B * H, num_splits)`` with the split length derived per request on the device, so the launch
depends only on ``B`` and the ``max_kv_len`` hint (CUDA-graph friendly). Stage 2 is
``sparse_decode._stage2``: the LSE merge of the splits.
Bytes: the context's K and V once (``B * H * n * (D + Dv) * e``), the same as one decode step,
whatever ``NQ``; SGLang's verify runs the prefill kernel instead, which walks the whole prefix
serially per (request, head). FLOPs: ``4 * B * NQ * Hq * n * D``.
Sources: Flash-Decoding (Dao et al., 2023); GQA-grouped tiles follow SGLang's
``kernels/ops/attention/decode_attention.py`` (``_fwd_grouped_kernel_stage1``); a split-KV verify
for causal chains also exists, per query head and AMD-only, in SGLang's
``kernels/ops/attention/verify_splitkv.py``.
Reference: ``oasis_sglang.core.ops.TorchKVOps.paged_attention``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from oasis_sglang.core.ops import TorchKVOps

from ._common import check_range, checks_enabled, interpreting, next_pow2, num_sms
from .sparse_decode import LOG2E, _group_queries, _softmax_finish, _softmax_tile, _stage2, _store_partial

reference = TorchKVOps().paged_attention


@triton.jit
def _paged_stage1(Q, KBuf, VBuf, ReqToToken, Rows, KvLens, MidO, MidL,
                  stride_qb, stride_qi, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_rt,
                  stride_mo_b, stride_mo_i, stride_mo_h, stride_mo_s, stride_ml_b, stride_ml_i, stride_ml_h,
                  H, NSPLIT, qk_scale,
                  NQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                  UPCAST: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // H
    h = pid % H
    row = tl.load(Rows + b).to(tl.int64)
    kv = tl.load(KvLens + b).to(tl.int64)
    q, qi, hq, mm = _group_queries(Q, b, h, stride_qb, stride_qi, stride_qh, NQ, G, D, BLOCK_M, BLOCK_D, UPCAST)
    lim = kv - (NQ - 1 - qi)                     # tokens row qi sees
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    split_len = tl.cdiv(tl.cdiv(kv, NSPLIT), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, kv)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nm = n < hi
        loc = tl.load(ReqToToken + row * stride_rt + n, mask=nm, other=0).to(tl.int64)
        k = tl.load(KBuf + loc[:, None] * stride_kn + h * stride_kh + d[None, :],
                    mask=nm[:, None] & (d < D)[None, :], other=0.0)
        p, alpha, m_new, l_i = _softmax_tile(q, k, nm[None, :] & (n[None, :] < lim[:, None]), m_i, l_i, qk_scale)
        v = tl.load(VBuf + loc[:, None] * stride_vn + h * stride_vh + dv[None, :],
                    mask=nm[:, None] & (dv < DV)[None, :], other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        elif v.dtype.is_fp8():      # an fp8 KV cache: the product in the query's dtype
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    o, lse2 = _softmax_finish(acc, m_i, l_i)
    _store_partial(MidO, MidL, b, qi, hq, mm, split, o, lse2, stride_mo_b, stride_mo_i, stride_mo_h, stride_mo_s,
                   stride_ml_b, stride_ml_i, stride_ml_h, DV, BLOCK_DV)


def choose_paged_splits(B: int, H: int, max_kv_len: int, block_n: int, device: torch.device) -> int:
    """Splits of the context so that about 4 programs per SM run, at least one tile per split."""
    tiles = triton.cdiv(max(1, max_kv_len), block_n)
    return max(1, min(tiles, triton.cdiv(4 * num_sms(device), max(1, B * H))))


def paged_attention(q, k_buf, v_buf, req_to_token, rows, kv_lens, scale: float | None,
                    max_kv_len: int | None = None, num_splits: int | None = None, block_n: int = 64):
    """Triton version of :meth:`TorchKVOps.paged_attention` (same arguments and result).

    ``num_splits``: splits of the context (default ``choose_paged_splits`` from ``max_kv_len``;
    without ``max_kv_len`` one device read of ``kv_lens.max()``; a wrong hint costs speed, never
    correctness: each split's length is derived per request on the device); ``block_n``: tokens
    per tile.
    Undefined without ``OASIS_KERNEL_CHECKS=1`` (as in SGLang's kernels): rows or slots out of
    range (an illegal memory access) and ``kv_lens < NQ`` (NaN rows). A non-finite V of the last
    token also turns the rows that do not see it into NaN (masked scores still meet ``0 * inf``
    in the ``p @ V`` product); real K/V are finite.
    Raises:
        AssertionError: shapes, strides, dtypes or devices do not match.
        IndexError: with ``OASIS_KERNEL_CHECKS=1``, a row out of range or ``kv_lens < NQ``.
    """
    assert q.dim() == 4 and k_buf.dim() == 3 and v_buf.dim() == 3 and req_to_token.dim() == 2, \
        f"q [B, NQ, Hq, D], k_buf / v_buf [N, H, D], req_to_token [R, L] expected, got {tuple(q.shape)}, " \
        f"{tuple(k_buf.shape)}, {tuple(v_buf.shape)}, {tuple(req_to_token.shape)}"
    B, NQ, Hq, D = q.shape
    N, H, Dk = k_buf.shape
    Dv = v_buf.shape[-1]
    assert Dk == D and v_buf.shape[:2] == (N, H), (q.shape, k_buf.shape, v_buf.shape)
    assert NQ in (1, 2) and Hq % H == 0, f"q must be [B, 1 or 2, Hq, D] with Hq a multiple of H={H}, got {tuple(q.shape)}"
    assert q.stride(3) == 1 and k_buf.stride(2) == 1 and v_buf.stride(2) == 1, "q, k_buf and v_buf need a unit last stride"
    assert req_to_token.stride(1) == 1, "req_to_token needs a unit last stride"
    assert k_buf.dtype == v_buf.dtype, f"k_buf {k_buf.dtype} and v_buf {v_buf.dtype} must share a dtype"
    assert rows.shape == kv_lens.shape == (B,), f"rows {tuple(rows.shape)} and kv_lens {tuple(kv_lens.shape)} must be [{B}]"
    assert rows.is_contiguous() and kv_lens.is_contiguous(), "rows and kv_lens must be contiguous"
    assert rows.device == kv_lens.device == k_buf.device == q.device == req_to_token.device, \
        "q, k_buf, v_buf, req_to_token, rows and kv_lens must be on one device"
    G = Hq // H
    o = torch.empty((B, NQ, Hq, Dv), dtype=q.dtype, device=q.device)
    if B == 0:
        return o
    if checks_enabled():
        check_range(rows, 0, req_to_token.shape[0], "rows")
        check_range(kv_lens, NQ, req_to_token.shape[1] + 1, "kv_lens")
        for r, n in zip(rows.tolist(), kv_lens.tolist()):
            check_range(req_to_token[r, :n], 0, N, "req_to_token (token slots)")
    if num_splits is None:
        mx = int(kv_lens.max()) if max_kv_len is None else int(max_kv_len)
        num_splits = choose_paged_splits(B, H, mx, block_n, q.device)
    mid_o = torch.empty((B, NQ, Hq, num_splits, Dv), dtype=torch.float32, device=q.device)
    mid_l = torch.empty((B, NQ, Hq, num_splits), dtype=torch.float32, device=q.device)
    lse = torch.empty((B, NQ, Hq), dtype=torch.float32, device=q.device)
    sc = (scale if scale is not None else 1.0 / math.sqrt(D)) * LOG2E
    _paged_stage1[(B * H, num_splits)](
        q, k_buf, v_buf, req_to_token, rows, kv_lens, mid_o, mid_l,
        q.stride(0), q.stride(1), q.stride(2), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        req_to_token.stride(0), *mid_o.stride()[:4], *mid_l.stride()[:3], H, num_splits, sc,
        NQ=NQ, G=G, D=D, DV=Dv, BLOCK_M=max(16, next_pow2(NQ * G)), BLOCK_N=block_n,
        BLOCK_D=next_pow2(D), BLOCK_DV=next_pow2(Dv), UPCAST=interpreting(), num_warps=4, num_stages=2)
    _stage2[(B * NQ * Hq,)](
        q, q, q, mid_o, mid_l, o, lse,
        q.stride(0), q.stride(1), q.stride(2), 0, 0, 0, 0,
        *mid_o.stride()[:4], *mid_l.stride()[:3], o.stride(0), o.stride(1), o.stride(2),
        Hq, NQ, num_splits, sc, G=G, D=D, DV=Dv, HAS_EXTRA=False,
        BLOCK_S=next_pow2(num_splits), BLOCK_D=next_pow2(D), BLOCK_DV=next_pow2(Dv), num_warps=4)
    return o
