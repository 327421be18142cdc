"""Kernel 1: write new K/V into the host tier and fold them into the block key summaries.

Math (Quest Sec. 3; paper: Methodology, compressed keys): for block ``p`` and KV head ``h``,
``kmin[p, h, d] = min_t k[t, h, d]`` and ``kmax[p, h, d] = max_t k[t, h, d]`` over the block's
tokens. Tokens arrive as segments (consecutive tokens of one block); a segment starting at
block offset 0 starts the summary, any other is folded into the current one. Min and max are
exact in every dtype, so the result equals the reference bit for bit.

One program per (segment, KV head) (a prefill on CUDA: one per token and KV head, and the
programs that start a segment find its end themselves, ``SCAN``, so no host sync splits the
locations first): reads the segment's ``<= bs`` tokens once from the device and writes them to
the host tier (zero-copy stores into mapped pinned memory on CUDA: one
``len * D`` contiguous piece per head), then updates the summary row on the device.
Bytes: ``N * H * (D + Dv) * e`` read and written to the host, ``2 * segments * H * D * e``
summaries written (``e`` element bytes).
Reference: ``oasis_sglang.core.ops.TorchKVOps.write_kv``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from oasis_sglang.core.ops import TorchKVOps, check_slots

from ._common import check_range, checks_enabled, kernel_arg, next_pow2

reference = TorchKVOps().write_kv


@triton.jit
def _write_kv_kernel(HostK, HostV, Kmin, Kmax, K, V, SegPage, SegOff, SegSrc, SegLen, Slots, Dropped,
                     stride_hk_h, stride_hv_h, stride_s_p, stride_k_n, stride_k_h, stride_v_n, stride_v_h,
                     P, N, BS: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                     WRITE_HOST: tl.constexpr, ONE_EACH: tl.constexpr, SCAN: tl.constexpr,
                     HAS_SLOTS: tl.constexpr):
    seg = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    if ONE_EACH:                    # decode: SegPage holds the token locations, one token per segment
        loc = tl.load(SegPage + seg).to(tl.int64)
        page = loc // BS
        off0 = loc % BS
        src = seg.to(tl.int64)
        n = 1
    elif SCAN:
        # prefill without a host sync: SegPage holds the N token locations, one program per token;
        # a token that starts a run (``segments``: offset 0 in its block, or not the previous
        # location + 1) writes the run, up to its block's end; every other program writes nothing
        src = seg.to(tl.int64)
        loc = tl.load(SegPage + src).to(tl.int64)
        prev = tl.load(SegPage + src - 1, mask=src > 0, other=-2).to(tl.int64)
        first = (src == 0) | (loc % BS == 0) | (loc != prev + 1)
        tt = tl.arange(0, BLOCK_T)
        nxt = tl.load(SegPage + src + tt, mask=src + tt < N, other=-1).to(tl.int64)
        run = (src + tt < N) & (nxt == loc + tt) & ((loc % BS) + tt < BS)
        n = tl.where(first, tl.min(tl.where(run, BLOCK_T, tt), axis=0), 0)   # the first token not in the run
        page = loc // BS
        off0 = loc % BS
    else:
        page = tl.load(SegPage + seg).to(tl.int64)
        off0 = tl.load(SegOff + seg).to(tl.int64)
        src = tl.load(SegSrc + seg).to(tl.int64)
        n = tl.load(SegLen + seg)
    t = tl.arange(0, BLOCK_T)
    tm = t < n
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    m = tm[:, None] & dm[None, :]
    k = tl.load(K + (src + t)[:, None] * stride_k_n + h * stride_k_h + d[None, :], mask=m, other=0.0)
    if WRITE_HOST:
        dv = tl.arange(0, BLOCK_DV)
        mv = tm[:, None] & (dv < DV)[None, :]
        if HAS_SLOTS:
            # compact tier: the piece's pool row, or none (-1: the write is dropped and counted)
            nt = (n + tl.zeros((), tl.int32)).to(tl.int64)        # (a Python 1 in the decode launch)
            prow = tl.load(Slots + h * P + page, mask=nt > 0, other=0).to(tl.int64)
            has = prow >= 0
            tl.atomic_add(Dropped, nt, mask=(~has) & (nt > 0))
            tl.store(HostK + prow * (BS * D) + (off0 + t)[:, None] * D + d[None, :], k.to(HostK.dtype.element_ty),
                     mask=m & has)
            v = tl.load(V + (src + t)[:, None] * stride_v_n + h * stride_v_h + dv[None, :], mask=mv & has, other=0.0)
            tl.store(HostV + prow * (BS * DV) + (off0 + t)[:, None] * DV + dv[None, :], v.to(HostV.dtype.element_ty),
                     mask=mv & has)
        else:
            host_tok = h * stride_hk_h + (page * BS + off0 + t)[:, None] * D
            tl.store(HostK + host_tok + d[None, :], k.to(HostK.dtype.element_ty), mask=m)
            v = tl.load(V + (src + t)[:, None] * stride_v_n + h * stride_v_h + dv[None, :], mask=mv, other=0.0)
            tl.store(HostV + h * stride_hv_h + (page * BS + off0 + t)[:, None] * DV + dv[None, :],
                     v.to(HostV.dtype.element_ty), mask=mv)
    kc = k.to(HostK.dtype.element_ty).to(Kmin.dtype.element_ty).to(tl.float32)   # as the tier holds it (fp8)
    lo = tl.min(tl.where(m, kc, float("inf")), axis=0)
    hi = tl.max(tl.where(m, kc, float("-inf")), axis=0)
    nan = tl.max(tl.where(m & (kc != kc), 1, 0), axis=0) > 0     # NaN propagates, as torch.amin does
    lo = tl.where(nan, float("nan"), lo)
    hi = tl.where(nan, float("nan"), hi)
    # continuing a block (offset > 0): fold into its current summary (a scan program off a run's
    # start stores nothing)
    live = dm & (n > 0)
    fold_summary_row(Kmin, Kmax, page * stride_s_p + h * D + d, lo, hi, live, live & (off0 > 0))


@triton.jit
def fold_summary_row(Kmin, Kmax, srow, lo, hi, dm, cont):
    """Store one (block, KV head) summary row at offsets ``srow`` (mask ``dm``): ``lo`` / ``hi``
    (fp32 ``[BLOCK_D]``), first folded into the stored row where ``cont`` (the block already has
    tokens); NaN propagates. Shared by kernel 1 and kernel 7's decode fold."""
    lo = tl.minimum(lo, tl.load(Kmin + srow, mask=cont, other=float("inf")).to(tl.float32),
                    propagate_nan=tl.PropagateNan.ALL)
    hi = tl.maximum(hi, tl.load(Kmax + srow, mask=cont, other=float("-inf")).to(tl.float32),
                    propagate_nan=tl.PropagateNan.ALL)
    tl.store(Kmin + srow, lo.to(Kmin.dtype.element_ty), mask=dm)
    tl.store(Kmax + srow, hi.to(Kmax.dtype.element_ty), mask=dm)


def segments(loc: torch.Tensor, block_size: int, one_token_each: bool = False):
    """Split token locations into runs of consecutive tokens of one block.

    Args:
        loc: ``[N]`` int token locations in write order.
        one_token_each: every token is its own segment (decode: one token per request; no sync).
    Returns:
        ``(page, offset, src, length)``, each ``[S]`` int64: block, block offset of the first
        token, index of the first token in ``loc``, tokens in the run (``<= block_size``).
    """
    loc = loc.to(torch.int64)
    if one_token_each:
        return loc // block_size, loc % block_size, torch.arange(loc.numel(), device=loc.device), torch.ones_like(loc)
    prev = torch.cat([loc.new_full((1,), -2), loc[:-1]])
    start = torch.nonzero((loc % block_size == 0) | (loc != prev + 1)).squeeze(1)
    length = torch.diff(torch.cat([start, start.new_full((1,), loc.numel())]))
    first = loc[start]
    return first // block_size, first % block_size, start, length


def write_kv(host_k, host_v, kmin, kmax, loc, k, v, block_size: int, one_token_each: bool = False,
             write_host: bool = True, scan: bool | None = None, slots=None, dropped=None) -> None:
    """Triton version of :meth:`TorchKVOps.write_kv` (same arguments; see there).

    ``slots`` / ``dropped``: a compact host tier (``host_k [S, bs, D]``, ``host_v [S, bs, Dv]``
    the pool): each (segment, KV head) program reads its piece's pool row once, stores there or,
    at ``-1``, nowhere and adds its tokens to ``dropped`` (an atomic).

    ``one_token_each=True`` when each token is in its own block (decode batches: no sync).
    ``scan``: a prefill's runs are found inside the kernel (one program per token and KV head;
    those that do not start a run return), not by ``segments`` on the host (a ``nonzero``: one
    host sync per sparse layer of every prefill forward). ``None``: on CUDA.
    Raises:
        AssertionError: shapes, strides or dtypes do not match the layouts.
        IndexError: with ``OASIS_KERNEL_CHECKS=1``, a location outside the host tier, or a
            slot outside the pool.
    """
    if slots is None:
        H, P, bs, D = host_k.shape
        assert bs == block_size and host_v.shape[:3] == (H, P, bs), (host_k.shape, host_v.shape)
    else:
        (P, H, _), (S, bs, D) = kmin.shape, host_k.shape
        assert bs == block_size and host_v.shape[:2] == (S, bs), (host_k.shape, host_v.shape)
        check_slots(slots, dropped, H, P, "write_kv")
        assert slots.device == kmin.device, "write_kv: slots must be on the summaries' device"
    Dv = host_v.shape[-1]
    N = loc.numel()
    assert host_k.is_contiguous() and host_v.is_contiguous() and kmin.is_contiguous() and kmax.is_contiguous()
    assert kmin.shape == kmax.shape == (P, H, D) and kmin.dtype == kmax.dtype
    assert k.shape == (N, H, D) and v.shape == (N, H, Dv), (k.shape, v.shape, N)
    assert k.stride(2) == 1 and v.stride(2) == 1, "k and v need a unit stride in their last dimension"
    if N == 0:
        return
    if checks_enabled():
        check_range(loc, 0, P * bs, "loc (token locations)")
        if slots is not None and write_host:
            check_range(slots, -1, host_k.shape[0], "slots (pool rows)")
    dev = kmin.device
    scan = not one_token_each and (dev.type == "cuda" if scan is None else bool(scan))
    if one_token_each or scan:      # the kernel splits the locations itself: no index ops before it
        loc_d = loc.to(dev).contiguous()      # the kernel reads it with unit stride (a verify batch
        page = off = src = length = loc_d   # passes out_cache_loc.view(-1, 2)[:, 0])
    else:
        page, off, src, length = segments(loc.to(dev), bs, one_token_each)
    grid = (page.numel(), H)
    _write_kv_kernel[grid](
        kernel_arg(host_k, dev), kernel_arg(host_v, dev), kmin, kmax, k, v, page, off, src, length,
        page if slots is None else slots, page if dropped is None else dropped,
        host_k.stride(0), host_v.stride(0), kmin.stride(0), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        P, N, BS=bs, D=D, DV=Dv, BLOCK_T=next_pow2(bs), BLOCK_D=next_pow2(D), BLOCK_DV=next_pow2(Dv),
        WRITE_HOST=write_host, ONE_EACH=one_token_each, SCAN=scan, HAS_SLOTS=slots is not None)
