"""Kernel 3: decode attention over head-wise working sets (split-K, GQA-grouped, with LSE).

Math: for request ``b``, query row ``i`` (0 normal, 1 draft), query head ``g`` of KV head ``h``::

    o = softmax(scale * q K^T) V,   lse = log sum exp(scale * q K^T)

over the tokens of ``h``'s resident slots (``ids[r, h, e] >= 0``, position
``ids * bs + t < seq_len``), plus, for the draft row, the draft token's own K/V.
Stage 1: one program per (request, KV head, split of the ``K`` slots) loads each KV tile once
for all ``NQ * G`` query rows of the group (one ``tl.dot``), keeps an online softmax, and writes
a partial output and LSE. Stage 2: one program per (request, row, query head) merges the splits
(and the draft token) by their LSE. The slots of one (request, KV head) are contiguous
(``[K * bs, D]``), so tiles are coalesced; free slots are masked and never read.
Bytes: the resident tokens' K and V (``<= B * H * K * bs * (D + Dv) * e``). FLOPs:
``4 * B * NQ * Hq * n * D`` for ``n`` resident tokens.
Sources: split-K decoding with an LSE merge is Flash-Decoding (Dao et al., 2023); loading a KV
tile once for a GQA group follows SGLang's ``kernels/ops/attention/decode_attention.py``
(``_fwd_grouped_kernel_stage1``); head-wise working sets are the paper's Methodology.
Reference: ``oasis_sglang.core.ops.TorchKVOps.sparse_decode_attention``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from oasis_sglang.core.ops import TorchKVOps

from ._common import check_range, checks_enabled, interpreting, next_pow2, num_sms

reference = TorchKVOps().sparse_decode_attention

LOG2E = 1.4426950408889634


@triton.jit
def _softmax_tile(q, k, mask, m_i, l_i, qk_scale):
    """One KV tile of an online softmax (log2 domain): scores of ``q [M, D]`` against
    ``k [N, D]`` where ``mask [M, N]``; returns ``(p, alpha, m_new, l_new)`` (the caller adds
    ``p @ V`` to its accumulator scaled by ``alpha``). Shared by kernels 3 and 5."""
    s = tl.dot(q, tl.trans(k).to(q.dtype)) * qk_scale
    s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _softmax_finish(acc, m_i, l_i):
    """Normalised partial output and its log2-domain LSE (``-inf`` for rows that saw nothing)."""
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse2 = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    return o, lse2


@triton.jit
def _group_queries(Q, b, h, stride_qb, stride_qi, stride_qh, NQ: tl.constexpr, G: tl.constexpr,
                   D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    """The ``NQ * G`` query rows of request ``b``'s GQA group ``h`` as one ``[BLOCK_M, BLOCK_D]``
    tile (row ``m`` = query row ``qi = m // G`` of query head ``hq = h * G + m % G``); returns
    ``(q, qi, hq, row_mask)``. Shared by kernels 3 and 5."""
    m_offs = tl.arange(0, BLOCK_M)
    qi = m_offs // G
    hq = h * G + m_offs % G
    mm = m_offs < NQ * G
    d = tl.arange(0, BLOCK_D)
    q = tl.load(Q + b.to(tl.int64) * stride_qb + qi[:, None] * stride_qi + hq[:, None] * stride_qh + d[None, :],
                mask=mm[:, None] & (d < D)[None, :], other=0.0)
    if UPCAST:      # the Triton 3.6 interpreter computes bf16 tl.dot wrongly: dot in fp32 there
        q = q.to(tl.float32)
    return q, qi, hq, mm


@triton.jit
def _store_partial(MidO, MidL, b, qi, hq, mm, split, o, lse2, stride_mo_b, stride_mo_i, stride_mo_h, stride_mo_s,
                   stride_ml_b, stride_ml_i, stride_ml_h, DV: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Write one split's partial output ``o [BLOCK_M, BLOCK_DV]`` and its LSE ``lse2 [BLOCK_M]``."""
    dv = tl.arange(0, BLOCK_DV)
    mo = MidO + b.to(tl.int64) * stride_mo_b + qi[:, None] * stride_mo_i + hq[:, None] * stride_mo_h + split * stride_mo_s + dv[None, :]
    tl.store(mo, o, mask=mm[:, None] & (dv < DV)[None, :])
    tl.store(MidL + b.to(tl.int64) * stride_ml_b + qi * stride_ml_i + hq * stride_ml_h + split, lse2, mask=mm)


@triton.jit
def _stage1(Q, WsK, WsV, Ids, Rows, SeqLens, MidO, MidL,
            stride_qb, stride_qi, stride_qh, stride_mo_b, stride_mo_i, stride_mo_h, stride_mo_s,
            stride_ml_b, stride_ml_i, stride_ml_h,
            H, KS, SPLIT_E, qk_scale,
            NQ: tl.constexpr, G: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
            UPCAST: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // H
    h = pid % H
    row = tl.load(Rows + b).to(tl.int64)
    seq = tl.load(SeqLens + b).to(tl.int64)
    q, qi, hq, mm = _group_queries(Q, b, h, stride_qb, stride_qi, stride_qh, NQ, G, D, BLOCK_M, BLOCK_D, UPCAST)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    rh = row * H + h
    base = rh * KS * BS
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    e_lo = split * SPLIT_E
    e_hi = tl.minimum(e_lo + SPLIT_E, KS)
    for e0 in range(e_lo, e_hi, BLOCK_E):
        n = e0 * BS + tl.arange(0, BLOCK_E * BS)
        e = n // BS
        em = e < e_hi
        blk = tl.load(Ids + rh * KS + e, mask=em, other=-1)
        valid = em & (blk >= 0) & (blk * BS + n % BS < seq)
        k = tl.load(WsK + (base + n)[:, None] * D + d[None, :], mask=valid[:, None] & (d < D)[None, :], other=0.0)
        p, alpha, m_new, l_i = _softmax_tile(q, k, valid[None, :], m_i, l_i, qk_scale)
        v = tl.load(WsV + (base + n)[:, None] * DV + dv[None, :], mask=valid[:, None] & (dv < DV)[None, :], other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        elif v.dtype.is_fp8():      # an fp8 KV cache: the product in the query's dtype
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    o, lse2 = _softmax_finish(acc, m_i, l_i)
    _store_partial(MidO, MidL, b, qi, hq, mm, split, o, lse2, stride_mo_b, stride_mo_i, stride_mo_h, stride_mo_s,
                   stride_ml_b, stride_ml_i, stride_ml_h, DV, BLOCK_DV)


@triton.jit
def _stage2(Q, KExtra, VExtra, MidO, MidL, O, Lse,
            stride_qb, stride_qi, stride_qh, stride_xb, stride_xh, stride_vxb, stride_vxh,
            stride_mo_b, stride_mo_i, stride_mo_h, stride_mo_s, stride_ml_b, stride_ml_i, stride_ml_h,
            stride_ob, stride_oi, stride_oh, Hq, NQ, NSPLIT, qk_scale,
            G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, HAS_EXTRA: tl.constexpr,
            BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // (NQ * Hq)).to(tl.int64)
    i = (pid // Hq) % NQ
    hq = pid % Hq
    s = tl.arange(0, BLOCK_S)
    sm = s < NSPLIT
    dv = tl.arange(0, BLOCK_DV)
    dvm = dv < DV
    lse = tl.load(MidL + b * stride_ml_b + i * stride_ml_i + hq * stride_ml_h + s, mask=sm, other=float("-inf"))
    o = tl.load(MidO + b * stride_mo_b + i * stride_mo_i + hq * stride_mo_h + s[:, None] * stride_mo_s + dv[None, :],
                mask=sm[:, None] & dvm[None, :], other=0.0)
    mx = tl.max(lse, 0)
    if HAS_EXTRA:
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        use = i == 1
        q = tl.load(Q + b * stride_qb + i * stride_qi + hq * stride_qh + d, mask=dm, other=0.0).to(tl.float32)
        kx = tl.load(KExtra + b * stride_xb + (hq // G) * stride_xh + d, mask=dm, other=0.0).to(tl.float32)
        sx = tl.sum(q * kx, 0) * qk_scale
        sx = tl.where(use, sx, float("-inf"))
        mx = tl.maximum(mx, sx)
    w = tl.exp2(lse - mx)
    num = tl.sum(w[:, None] * o, 0)
    den = tl.sum(w, 0)
    if HAS_EXTRA:
        wx = tl.exp2(sx - mx)
        vx = tl.load(VExtra + b * stride_vxb + (hq // G) * stride_vxh + dv, mask=dvm, other=0.0).to(tl.float32)
        num += wx * vx
        den += wx
    tl.store(O + b * stride_ob + i * stride_oi + hq * stride_oh + dv, (num / den).to(O.dtype.element_ty), mask=dvm)
    tl.store(Lse + (b * NQ + i) * Hq + hq, (mx + tl.log2(den)) / 1.4426950408889634)


def choose_splits(B: int, H: int, KS: int, block_e: int, device: torch.device) -> int:
    """Splits of the ``KS`` slots so that about 4 programs per SM run (small batches still fill the GPU)."""
    tiles = triton.cdiv(KS, block_e)
    return max(1, min(tiles, triton.cdiv(4 * num_sms(device), max(1, B * H))))


def default_block_n(capability: tuple[int, int] | None, D: int, Dv: int, elt: int) -> int:
    """Tokens per stage-1 tile: 128 on Hopper (compute capability 9.x: the H100 / H200) for head
    sizes up to 128 in 16- or 8-bit KV, else 64 (other GPUs, larger heads, fp32, CPU and the
    interpreter: ``capability`` ``None``), where 128 has not been timed.

    On the H100 at 2,048-token working sets (D = Dv = 128, bf16) 128 took 119.1 / 125.0 us per
    call against 64's 133.0 / 136.5 at 40 / 43 requests, within 1.5% at 8 and 120
    (``scripts/bench_kernels.py --only attention``, docs/benchmarks/2026-12-06_h100-spec-overlap.md).
    Shared memory is no limit: Triton 3.6 compiles that tile to about 41 KiB (bf16, D 128)."""
    if capability is None or capability[0] != 9 or max(D, Dv) > 128 or elt > 2:
        return 64
    return 128


def _capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA device's compute capability; ``None`` on CPU / under the interpreter."""
    if device.type != "cuda" or interpreting():
        return None
    return tuple(torch.cuda.get_device_capability(device))


def sparse_decode_attention(q, ws_k, ws_v, ids, rows, seq_lens, scale: float | None, k_extra=None,
                            v_extra=None, return_lse: bool = False, num_splits: int | None = None,
                            block_n: int | None = None, num_warps: int = 4, num_stages: int = 2):
    """Triton version of :meth:`TorchKVOps.sparse_decode_attention` (same arguments and result).

    ``num_splits``: splits of the working set (default: ``choose_splits``); ``block_n``: tokens
    per tile, a power of two (a tile is ``max(block_n, bs)`` tokens; default ``default_block_n``:
    128 on Hopper, else 64); ``num_warps`` / ``num_stages``: stage 1's launch
    (``scripts/bench_kernels.py --only attention`` sweeps all four).
    Raises:
        AssertionError: shapes, strides or dtypes do not match; ``block_n`` is not a power of two.
        IndexError: with ``OASIS_KERNEL_CHECKS=1``, a row out of range or an empty context.
    """
    B, NQ, Hq, D = q.shape
    R, H, KS, bs, Dk = ws_k.shape
    Dv = ws_v.shape[-1]
    assert Dk == D and ws_v.shape[:4] == (R, H, KS, bs) and ids.shape == (R, H, KS), (ws_k.shape, ws_v.shape, ids.shape)
    assert NQ in (1, 2) and Hq % H == 0, f"q must be [B, 1 or 2, Hq, D] with Hq a multiple of H={H}, got {tuple(q.shape)}"
    assert q.stride(3) == 1, "q needs a unit stride in its last dimension"
    assert ws_k.is_contiguous() and ws_v.is_contiguous() and ids.is_contiguous() and ws_k.dtype == ws_v.dtype
    assert rows.shape == seq_lens.shape == (B,) and rows.device == seq_lens.device == ws_k.device == q.device
    has_extra = k_extra is not None
    if has_extra:
        assert NQ == 2, "k_extra / v_extra (the draft token's K/V) need NQ == 2 query rows"
        assert k_extra.shape == (B, H, D) and v_extra.shape == (B, H, Dv), (k_extra.shape, v_extra.shape)
        assert k_extra.stride(2) == 1 and v_extra.stride(2) == 1, "k_extra / v_extra need a unit last stride"
    G = Hq // H
    o = torch.empty((B, NQ, Hq, Dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, NQ, Hq), dtype=torch.float32, device=q.device)
    if B == 0:
        return o, (lse if return_lse else None)
    if checks_enabled():
        check_range(rows, 0, R, "rows")
        check_range(seq_lens, 1, 1 << 62, "seq_lens")
    if block_n is None:
        block_n = default_block_n(_capability(q.device), D, Dv, ws_k.element_size())
    assert isinstance(block_n, int) and block_n >= 1 and block_n & (block_n - 1) == 0, \
        f"block_n must be a power of two (tokens per tile), got {block_n!r}"
    block_e = max(1, block_n // bs)
    nsplit = num_splits or choose_splits(B, H, KS, block_e, q.device)
    split_e = triton.cdiv(triton.cdiv(KS, nsplit), block_e) * block_e
    nsplit = triton.cdiv(KS, split_e)
    mid_o = torch.empty((B, NQ, Hq, nsplit, Dv), dtype=torch.float32, device=q.device)
    mid_l = torch.empty((B, NQ, Hq, nsplit), dtype=torch.float32, device=q.device)
    sc = (scale if scale is not None else 1.0 / math.sqrt(D)) * LOG2E
    BLOCK_M = max(16, next_pow2(NQ * G))
    _stage1[(B * H, nsplit)](
        q, ws_k, ws_v, ids, rows, seq_lens, mid_o, mid_l,
        q.stride(0), q.stride(1), q.stride(2), *mid_o.stride()[:4], *mid_l.stride()[:3],
        H, KS, split_e, sc, NQ=NQ, G=G, BS=bs, D=D, DV=Dv, BLOCK_M=BLOCK_M, BLOCK_E=block_e,
        BLOCK_D=next_pow2(D), BLOCK_DV=next_pow2(Dv), UPCAST=interpreting(), num_warps=num_warps,
        num_stages=num_stages)
    kx = k_extra if has_extra else q
    vx = v_extra if has_extra else q
    _stage2[(B * NQ * Hq,)](
        q, kx, vx, mid_o, mid_l, o, lse,
        q.stride(0), q.stride(1), q.stride(2), kx.stride(0), kx.stride(1), vx.stride(0), vx.stride(1),
        *mid_o.stride()[:4], *mid_l.stride()[:3], o.stride(0), o.stride(1), o.stride(2),
        Hq, NQ, nsplit, sc, G=G, D=D, DV=Dv, HAS_EXTRA=has_extra,
        BLOCK_S=next_pow2(nsplit), BLOCK_D=next_pow2(D), BLOCK_DV=next_pow2(Dv), num_warps=4)
    return o, (lse if return_lse else None)
