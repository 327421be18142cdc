"""Kernel 2: Quest block scoring (GQA max) fused with the selection key, then top-K.

Math (Quest Sec. 3; paper: Methodology, Look-ahead Attention): for query row ``b``, KV head
``h`` with query heads ``g`` of its group and block ``j`` (page ``p`` from SGLang's
``req_to_token``)::

    u[b, h, j] = max_g sum_d max(q[b, g, d] * kmin[p, h, d], q[b, g, d] * kmax[p, h, d])
               = max_g (q+[b, g] . kmax[p, h] + q-[b, g] . kmin[p, h])     (kmin <= kmax)

with ``q+ = q`` where ``q >= 0`` else 0 and ``q- = q`` where ``q <= 0`` else 0 (NaN kept in both), so
each tile is two small matrix products ``[BLOCK_N, D] x [D, G]`` on the tensor cores instead of
``4 G`` elementwise passes (the elementwise form was compute-bound on the H200 at ~40% of HBM).

Sink blocks (``j < sink``) and recent blocks (``j >= nblocks - recent``) score ``+inf``; other
complete blocks their bound (NaN as ``-3e38``, infinities clamped to the largest finite float, so
a forced block always ranks first); the partial block and blocks past the context ``-inf``.
The kernel writes one int64 key per block: the score's order-preserving 32-bit image in the
high half and ``2**32 - 1 - j`` in the low half, so all keys are distinct, a larger key means a
higher score or, on a tie, a lower block id, and ``torch.topk`` on the keys returns exactly the
reference's stable order. One program per (query row, KV head, tile of blocks) reads each
candidate block's min and max rows once (contiguous ``D`` elements) for all ``G`` query heads
(tiles past a row's complete blocks read nothing);
only candidate blocks' summaries are read: ``2 * H * D * e`` bytes per complete block (``2 / bs`` of its KV).
Reference: ``oasis_sglang.core.ops.TorchKVOps.select_topk``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from oasis_sglang.core.ops import TorchKVOps

from ._common import check_range, checks_enabled, interpreting, next_pow2

reference = TorchKVOps().select_topk

POS_INF_KEY32 = 0x7F800000                      # image of +inf
NEG_INF_KEY32 = -0x00800000 ^ 0x7FFFFFFF          # image of -inf (bits 0xFF800000 as int32, flipped)


@triton.jit
def _score_kernel(Q, Kmin, Kmax, Scale, ReqToToken, Rows, SeqLens, Keys,
                  stride_qb, stride_qh, stride_sp, stride_scp, stride_rt, stride_kb, stride_kh,
                  H, NB, sink, recent,
                  G: tl.constexpr, GP: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_F32: tl.constexpr, QUANT: tl.constexpr):
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
    score = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    if tl.program_id(1) * BLOCK_N < ncomp:
        # a tile past the complete blocks (a CUDA-graph grid spans req_to_token's width, often
        # 2-3x the longest context) reads and computes nothing: its keys are forced / absent
        tok = tl.load(ReqToToken + row * stride_rt + j.to(tl.int64) * BS, mask=cand, other=0)
        page = (tok // BS).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        srow = page[:, None] * stride_sp + h * D + d[None, :]      # one contiguous D-row per block
        sm = cand[:, None] & dm[None, :]
        lo = tl.load(Kmin + srow, mask=sm, other=0.0)               # [BLOCK_N, BLOCK_D]
        hi = tl.load(Kmax + srow, mask=sm, other=0.0)
        g = tl.arange(0, GP)
        gm = g < G
        qt = tl.load(Q + b.to(tl.int64) * stride_qb + (h * G + g[:, None]) * stride_qh + d[None, :],
                     mask=gm[:, None] & dm[None, :], other=0.0)     # [GP, BLOCK_D], the group's rows
        # sign split: sum_d max(q m, q M) = q+ . M + q- . m (m <= M); NaN stays in both halves
        qp = tl.where(qt < 0, 0.0, qt)
        qn = tl.where(qt > 0, 0.0, qt)
        if DOT_F32:
            u = tl.dot(hi.to(tl.float32), tl.trans(qp.to(tl.float32)), input_precision="ieee")
            u = tl.dot(lo.to(tl.float32), tl.trans(qn.to(tl.float32)), u, input_precision="ieee")
        elif QUANT:
            # int8 levels are exact in bf16 / fp16: the products run in the query's dtype
            u = tl.dot(hi.to(qt.dtype), tl.trans(qp.to(qt.dtype)))
            u = tl.dot(lo.to(qt.dtype), tl.trans(qn.to(qt.dtype)), u)
        else:
            u = tl.dot(hi, tl.trans(qp.to(hi.dtype)))
            u = tl.dot(lo, tl.trans(qn.to(lo.dtype)), u)             # [BLOCK_N, GP] fp32
        if QUANT:
            # one scale per (block, KV head) multiplies both halves: u = scale * (q+ . M8 + q- . m8)
            u = u * tl.load(Scale + page * stride_scp + h, mask=cand, other=0.0)[:, None]
        u = tl.where(gm[None, :], u, float("-inf"))
        # GQA: max over the group; NaN propagates as in the torch reference (compiled tl.max drops it)
        isnan = tl.max((u != u).to(tl.int32), axis=1) > 0
        score = tl.where(isnan, float("nan"), tl.max(u, axis=1))
    score = score + 0.0                                          # -0.0 -> +0.0
    score = tl.where(score != score, -3.0e38, score)             # NaN -> -3e38, +-inf -> +-FLT_MAX:
    score = tl.minimum(tl.maximum(score, -3.4028234663852886e38), 3.4028234663852886e38)  # forced stay first
    score = tl.where(forced, float("inf"), tl.where(cand, score, float("-inf")))
    k32 = score.to(tl.int32, bitcast=True)
    k32 = tl.where(k32 < 0, k32 ^ 0x7FFFFFFF, k32)
    key = k32.to(tl.int64) * 4294967296 + (4294967295 - j.to(tl.int64))
    tl.store(Keys + b.to(tl.int64) * stride_kb + h * stride_kh + j, key, mask=j < NB)


def block_keys(q, kmin, kmax, req_to_token, rows, seq_lens, block_size: int, sink_blocks: int,
               recent_blocks: int, nb_max: int, block_n: int = 32, num_warps: int = 4,
               kscale: torch.Tensor | None = None) -> torch.Tensor:
    """Selection keys ``[B, H, nb_max]`` int64 (see module docstring). Arguments as ``select_topk``;
    ``block_n`` (>= 16) blocks per program and ``num_warps`` are launch parameters
    (scripts/bench_kernels.py; 32 / 4 measured best of 7 on the H100 on 2026-12-06: 63.8 vs 75.8 us
    per layer for 64 / 4 at 40 x 16K, 76.2 vs 82.3 us with a CUDA-graph table 3x the context).
    The two products run on the tensor cores in the summaries' dtype (bf16 / fp16, fp32
    accumulation) or, for fp32 summaries or a query of another dtype, in IEEE fp32.

    ``kscale [P, H]`` float32 (an experiment, issue 17; not used in serving): the summaries are
    ``torch.int8`` levels of ``core.summaries.quantize_outward`` and block ``p``'s bound at KV
    head ``h`` is ``kscale[p, h]`` times the bound over the levels (half the bytes read); the
    products run in the query's dtype (bf16 / fp16; levels are exact there) or IEEE fp32.
    Reference: ``select_topk`` of ``dequantize(kmin, kscale)`` / ``dequantize(kmax, kscale)``.

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
    quant = kscale is not None
    if quant:
        assert kmin.dtype == kmax.dtype == torch.int8 and kscale.dtype == torch.float32, (kmin.dtype, kscale.dtype)
        assert kscale.shape == (P, H) and kscale.stride(1) == 1 and kscale.device == kmin.device, kscale.shape
    G = Hq // H
    rows, seq_lens = rows.contiguous(), seq_lens.contiguous()   # read with unit stride (no-ops when they are)
    assert block_n >= 16 and block_n & (block_n - 1) == 0, f"block_n must be a power of two >= 16, got {block_n}"
    keys = torch.empty((B, H, nb_max), dtype=torch.int64, device=q.device)
    if B == 0 or nb_max == 0:
        return keys
    if checks_enabled():
        check_range(rows, 0, req_to_token.shape[0], "rows")
        check_range(seq_lens, 0, min(req_to_token.shape[1], nb_max * block_size) + 1, "seq_lens")
        check_range(req_to_token[rows.long(), :int(seq_lens.max())], 0, P * block_size,
                    "req_to_token entries of these rows")
    grid = (B * H, triton.cdiv(nb_max, block_n))
    _score_kernel[grid](q, kmin, kmax, kscale if quant else kmin, req_to_token, rows, seq_lens, keys,
                        q.stride(0), q.stride(1), kmin.stride(0), kscale.stride(0) if quant else 0,
                        req_to_token.stride(0),
                        keys.stride(0), keys.stride(1), H, nb_max, sink_blocks, recent_blocks,
                        G=G, GP=max(16, next_pow2(G)), BS=block_size, D=D, BLOCK_N=block_n,
                        BLOCK_D=max(16, next_pow2(D)),
                        # the Triton 3.6 interpreter multiplies bf16 tiles' raw bits: fp32 there
                        DOT_F32=interpreting() or (q.dtype not in (torch.bfloat16, torch.float16) if quant
                                                   else not (kmin.dtype in (torch.bfloat16, torch.float16)
                                                             and q.dtype == kmin.dtype)),
                        QUANT=quant, num_warps=num_warps)
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


@triton.jit
def _count_ge(x, m, t):
    """``#{i: m[i] and x[i] >= t}`` (int32 scalar)."""
    return tl.sum((m & (x >= t)).to(tl.int32), axis=0)


@triton.jit
def _kth_largest_i32(x, m, kk):
    """The ``kk``-th largest value of the int32 ``x`` where ``m`` (``1 <= kk <= #m``), bit by bit
    from the top: the sign first, then bits 30 .. 0 set greedily while ``kk`` values stay at or
    above the trial (32 counting passes)."""
    t = tl.where(_count_ge(x, m, 0) >= kk, 0, -2147483647 - 1).to(tl.int32)
    for bit in range(30, -1, -1):
        trial = t + (1 << bit)
        t = tl.where(_count_ge(x, m, trial) >= kk, trial, t)
    return t


@triton.jit
def _select_kernel(Keys, Scratch, Wanted, Forced, NB, K, KK, BLOCK_N: tl.constexpr, KP: tl.constexpr,
                   POS: tl.constexpr, NEG: tl.constexpr):
    # one program per (row, KV head): the KK largest of NB distinct int64 keys, in descending order
    r = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, BLOCK_N)
    nm = n < NB
    keys = tl.load(Keys + r * NB + n, mask=nm, other=-9223372036854775807 - 1)
    # radix select in two int32 halves (half the registers and instructions of int64 compares,
    # 32 passes instead of 64): the KK-th largest high half T (the score image), then, only when
    # several keys share T (ties: equal scores, or absent blocks of a row shorter than KK), the
    # keys with high half T ranked by their low half (unsigned: shifted into int32's order).
    # Each pass costs a reduction across the program's warps, so passes, not bytes, set the time
    # (two bits per pass with three counts packed in one sum ran slower on the H200: 45.5 vs 38.8
    # us per layer at 32 x 8 rows of 1,037 keys, 2026-11-29).
    hi = (keys >> 32).to(tl.int32)
    lo = ((keys & 4294967295) - 2147483648).to(tl.int32)
    t_hi = _kth_largest_i32(hi, nm, KK)
    eq = nm & (hi == t_hi)
    need = KK - tl.sum((nm & (hi > t_hi)).to(tl.int32), axis=0)      # >= 1 of the keys with high half T
    t_lo = tl.full((), -2147483647 - 1, tl.int32)
    if tl.sum(eq.to(tl.int32), axis=0) != need:       # ties at T: rare outside short rows
        t_lo = _kth_largest_i32(lo, eq, need)
    sel = nm & ((hi > t_hi) | (eq & (lo >= t_lo)))
    # compact the KK chosen keys (any order) into this row's scratch, then rank them: key i goes to
    # place #{chosen keys > key i}
    pos = tl.cumsum(sel.to(tl.int32), axis=0) - 1
    tl.store(Scratch + r * KP + pos, keys, mask=sel & (pos < KP))    # (duplicate keys: never out of the row)
    tl.debug_barrier()
    i = tl.arange(0, KP)
    im = i < KK
    kv = tl.load(Scratch + r * KP + i, mask=im, other=-9223372036854775807 - 1, cache_modifier=".cg")
    rank = tl.sum((kv[None, :] > kv[:, None]).to(tl.int32), axis=1)
    hk = kv >> 32
    j = 4294967295 - (kv & 4294967295)
    wanted = tl.where(hk > NEG, j, -1)
    tl.store(Wanted + r * K + rank, wanted, mask=im)
    tl.store(Forced + r * K + rank, (hk == POS).to(tl.int8), mask=im)
    pad = (i >= KK) & (i < K)
    tl.store(Wanted + r * K + i, tl.full((KP,), -1, tl.int64), mask=pad)
    tl.store(Forced + r * K + i, tl.zeros((KP,), tl.int8), mask=pad)


# largest rows / k the fused selection holds in one program's registers (beyond: torch.topk);
# 16,384 blocks: a 128K-token model's CUDA-graph table (context + 4 tokens) at 16-token blocks
MAX_SELECT_NB = 16384
MAX_SELECT_K = 256


def select_warps(block_n: int) -> int:
    """Warps of one fused selection program for rows padded to ``block_n`` keys: each counting
    pass ends in a reduction across the program's warps, so fewer warps pass faster until the
    row no longer fits their registers. Measured on the H100 (2026-12-06, ``k`` 128, CUDA
    graphs, us per layer; docs/benchmarks/2026-12-06_select-warps-h100.md): 512 keys x 1264
    rows: 1 warp 20.2, 2: 23.1, 4: 38.8; 1,024 x 320: 2 warps 13.9, 4: 14.0, 8: 23.1; 2,048 x
    320: 4 warps 17.6, 8: 25.6; 4,096 x 160 / 328: 4 warps 22.0 / 30.3, 8: 21.1 / 33.8."""
    if block_n <= 512:
        return 1
    if block_n <= 1024:
        return 2
    return 4 if block_n <= 4096 else 16


def topk_from_keys(keys: torch.Tensor, k: int, fused: bool | None = None,
                   num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(wanted [B, H, k] int64, forced [B, H, k] bool)`` from ``block_keys`` (``-1`` padding).

    One launch (``_select_kernel``) for rows of up to ``MAX_SELECT_NB`` keys and ``k`` up to
    ``MAX_SELECT_K``: a radix select of the ``k`` largest keys bit by bit over the row in registers
    (32 counting passes over the keys' high halves, the score images; 32 more over the low halves
    of the keys tied at the threshold, only when there are ties), then their descending order by
    ranking (``[k, k]`` comparisons) and the decode of wanted / forced. ``num_warps``: the fused
    launch's warps per row (default ``select_warps``). The same result as ``torch.topk(keys, k,
    sorted=True)`` followed by the decode (the keys are distinct, so the order is total); on the
    H200 ``torch.topk`` on int64 keys ran a 32-pass radix select per row (``sbtopk``, ~73 us per
    layer at 32 x 8 rows of 2,561) and its own sort. Larger rows or ``k`` take that path
    (``fused=False`` forces it, ``True`` forbids it: ``ValueError`` when the row or ``k`` is too
    large).

    The keys must be ``block_keys`` output: distinct, with the block id in the low half (the
    fused path decodes it from there, the ``torch.topk`` path from the position). Duplicate keys
    give an unspecified selection (never a write outside the outputs).
    Raises:
        AssertionError: ``keys`` is not int64.
        ValueError: ``fused=True`` and the row or ``k`` exceeds the fused limits.
    """
    B, H, NB = keys.shape
    assert keys.dtype == torch.int64, f"topk_from_keys: keys must be block_keys' int64 keys, got {keys.dtype}"
    kk = min(k, NB)
    fits = NB <= MAX_SELECT_NB and k <= MAX_SELECT_K
    if fused and not fits:
        raise ValueError(f"topk_from_keys: the fused selection takes rows of at most {MAX_SELECT_NB} keys and k <= "
                         f"{MAX_SELECT_K}, got {NB} and {k}")
    if fits and fused is not False:
        keys = keys.contiguous()
        wanted = torch.empty((B, H, k), dtype=torch.int64, device=keys.device)
        forced = torch.empty((B, H, k), dtype=torch.bool, device=keys.device)
        if B * H:
            KP = next_pow2(k)
            scratch = torch.empty((B * H, KP), dtype=torch.int64, device=keys.device)
            BLOCK_N = next_pow2(NB)
            _select_kernel[(B * H,)](keys, scratch, wanted, forced.view(torch.int8), NB, k, kk, BLOCK_N=BLOCK_N,
                                     KP=KP, POS=POS_INF_KEY32, NEG=NEG_INF_KEY32,
                                     num_warps=num_warps or select_warps(BLOCK_N))
        return wanted, forced
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

    ``launch``: ``block_n`` / ``num_warps`` / ``kscale`` (int8 summaries) for ``block_keys``.
    """
    keys = block_keys(q, kmin, kmax, req_to_token, rows, seq_lens, block_size, sink_blocks, recent_blocks, nb_max,
                      **launch)
    return topk_from_keys(keys, k)
