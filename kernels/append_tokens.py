"""Kernel 7: decoded tokens into their resident slots, completed blocks back to the host tier.

Decode step 5 of a sparse layer (paper: Methodology; the full KV cache lives in host memory, the
working set holds a bounded copy) in one launch instead of the reference's match, masked scatters
and a separate write-back copy: one program per (request, KV head) scans the row's ``K`` slots for
the token's block (``pos // bs``), stores the token's K/V at offset ``pos % bs`` and, when the
token is the block's last (``pos % bs == bs - 1``), stores the whole block (the resident tokens
with the new one merged in registers, so no barrier between the two stores) to its host page
``req_to_token[row, pos] // bs``: one ``bs * (D + Dv)``-element piece, a zero-copy store into
mapped pinned memory on CUDA. A token whose block is not resident is written nowhere and counted
in ``violations`` (atomics; no host sync). With ``fold`` the same program also folds the token's
key into its block's min/max summary (kernel 1's decode launch, ``write_kv(one_token_each=True,
write_host=False)``, which it replaces: a sparse layer's decode step launches the append, the
two attention stages and nothing else on the compute stream).
Bytes per token and KV head: ``(D + Dv) * e`` written to the device, and ``bs * (D + Dv) * e``
read and written to the host once per completed block.
Reference: ``oasis_sglang.core.ops.TorchKVOps.append_tokens``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from oasis_sglang.core.ops import TorchKVOps, check_slots

from ._common import check_range, checks_enabled, kernel_arg, next_pow2
from .write_kv import fold_summary_row

reference = TorchKVOps().append_tokens


@triton.jit
def _append_tokens_kernel(WsK, WsV, Ids, Rows, Pos, Kn, Vn, HostK, HostV, ReqToToken, Violations, Counters,
                          Kmin, Kmax, FoldLoc, FoldK, Slots, Dropped, P,
                          stride_wk_r, stride_wk_h, stride_wv_r, stride_wv_h, stride_ir, stride_ih,
                          stride_kn_b, stride_kn_h, stride_vn_b, stride_vn_h, stride_hk_h, stride_hv_h,
                          stride_rt, stride_s_p, stride_fk_b, stride_fk_h, H, K, skip_row,
                          BS: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr,
                          BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, FOLD: tl.constexpr,
                          HAS_SLOTS: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // H
    h = (pid % H).to(tl.int64)
    row = tl.load(Rows + b).to(tl.int64)
    pos = tl.load(Pos + b).to(tl.int64)
    blk = pos // BS
    off = pos % BS
    e = tl.arange(0, BLOCK_K)
    held = tl.load(Ids + row * stride_ir + h * stride_ih + e, mask=e < K, other=-1)
    slot = tl.min(tl.where(held == blk, e, BLOCK_K), axis=0)          # first slot holding the block
    ok = slot < BLOCK_K
    real = row != skip_row
    bad = (~ok) & real
    tl.atomic_add(Violations, bad.to(tl.int64), mask=bad)     # masked: no atomic traffic when 0
    slot64 = tl.minimum(slot, K - 1).to(tl.int64)
    t = tl.arange(0, BS)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    kn = tl.load(Kn + b.to(tl.int64) * stride_kn_b + h * stride_kn_h + d, mask=dm, other=0.0).to(WsK.dtype.element_ty)
    kbase = WsK + row * stride_wk_r + h * stride_wk_h + slot64 * (BS * D)
    tl.store(kbase + off * D + d, kn, mask=dm & ok)
    dv = tl.arange(0, BLOCK_DV)
    dvm = dv < DV
    vn = tl.load(Vn + b.to(tl.int64) * stride_vn_b + h * stride_vn_h + dv, mask=dvm, other=0.0).to(WsV.dtype.element_ty)
    vbase = WsV + row * stride_wv_r + h * stride_wv_h + slot64 * (BS * DV)
    tl.store(vbase + off * DV + dv, vn, mask=dvm & ok)
    done = ok & real & (off == BS - 1)
    # the completed block, from the slot (tokens before the new one) and the new token itself
    mk = done & (t < off)[:, None] & dm[None, :]
    kb = tl.load(kbase + t[:, None] * D + d[None, :], mask=mk, other=0.0)
    kb = tl.where((t == off)[:, None], kn[None, :], kb)
    mv = done & (t < off)[:, None] & dvm[None, :]
    vb = tl.load(vbase + t[:, None] * DV + dv[None, :], mask=mv, other=0.0)
    vb = tl.where((t == off)[:, None], vn[None, :], vb)
    page = (tl.load(ReqToToken + row * stride_rt + pos, mask=done, other=0) // BS).to(tl.int64)
    if HAS_SLOTS:
        # compact tier: the piece's pool row; none (-1): not written back, BS tokens dropped
        prow = tl.load(Slots + h * P + page, mask=done, other=0).to(tl.int64)
        lost = done & (prow < 0)
        tl.atomic_add(Dropped, lost.to(tl.int64) * BS, mask=lost)
        done = done & (prow >= 0)
        kdst = HostK + prow * (BS * D)
        vdst = HostV + prow * (BS * DV)
    else:
        kdst = HostK + h * stride_hk_h + page * (BS * D)
        vdst = HostV + h * stride_hv_h + page * (BS * DV)
    tl.store(kdst + t[:, None] * D + d[None, :], kb.to(HostK.dtype.element_ty), mask=done & dm[None, :])
    tl.store(vdst + t[:, None] * DV + dv[None, :], vb.to(HostV.dtype.element_ty), mask=done & dvm[None, :])
    tl.atomic_add(Counters + 3, done.to(tl.int64), mask=done)
    if FOLD:
        # kernel 1's decode fold (``write_kv(one_token_each=True, write_host=False)``) of this
        # (request, KV head), every row as there: the key as the tier holds it (fp8: rounded)
        # starts its block's summary at block offset 0, else is folded into it; NaN propagates
        loc = tl.load(FoldLoc + b).to(tl.int64)
        kf = tl.load(FoldK + b.to(tl.int64) * stride_fk_b + h * stride_fk_h + d, mask=dm, other=0.0)
        kc = kf.to(HostK.dtype.element_ty).to(Kmin.dtype.element_ty).to(tl.float32)
        fold_summary_row(Kmin, Kmax, (loc // BS) * stride_s_p + h * D + d, kc, kc, dm, dm & (loc % BS > 0))


def append_tokens(ws_k, ws_v, ids, rows, pos, k, v, host_k, host_v, req_to_token, violations, counters,
                  skip_row: int | None = None, fold=None, num_warps: int = 4, slots=None, dropped=None) -> None:
    """Triton version of :meth:`TorchKVOps.append_tokens` (same arguments and effect).

    ``fold = (kmin, kmax, loc, k)``: the same launch also folds each row's key into its block's
    summary as ``write_kv(..., loc, k, v, one_token_each=True, write_host=False)`` does (kernel
    1's decode launch, which it replaces: one launch per sparse layer and step fewer).
    ``slots`` / ``dropped``: a compact host tier (``host_k`` / ``host_v`` the pool ``[S, bs,
    D/Dv]``): a completed block goes to pool row ``slots[h * P + page]``, or at ``-1`` nowhere
    (``dropped`` += ``bs``, an atomic; not counted in ``counters[3]``).

    Raises:
        AssertionError: shapes, strides, dtypes or devices do not match (before the launch).
        IndexError: with ``OASIS_KERNEL_CHECKS=1``, a row or position out of range, or a slot
            outside the pool.
    """
    R, H, K, BS, D = ws_k.shape
    DV = ws_v.shape[-1]
    B = rows.shape[0]
    assert ws_v.shape[:4] == (R, H, K, BS) and ids.shape == (R, H, K), (ws_k.shape, ws_v.shape, ids.shape)
    assert k.shape == (B, H, D) and v.shape == (B, H, DV) and pos.shape == (B,), (k.shape, v.shape, pos.shape)
    if slots is None:
        assert host_k.shape[0] == H and host_k.shape[2:] == (BS, D) and host_v.shape[2:] == (BS, DV)
        assert host_k.stride()[1:] == (BS * D, D, 1) and host_v.stride()[1:] == (BS * DV, DV, 1)
        P = host_k.shape[1]
    else:
        assert host_k.shape[1:] == (BS, D) and host_v.shape[1:] == (BS, DV) and host_k.shape[0] == host_v.shape[0], \
            (host_k.shape, host_v.shape)
        assert host_k.is_contiguous() and host_v.is_contiguous()
        P = slots.numel() // max(H, 1)
        check_slots(slots, dropped, H, P, "append_tokens")
        assert slots.device == ids.device, "append_tokens: slots must be on the working set's device"
    assert ws_k.stride()[2:] == (BS * D, D, 1) and ws_v.stride()[2:] == (BS * DV, DV, 1) and ids.stride(2) == 1
    assert k.stride(2) == 1 and v.stride(2) == 1 and req_to_token.stride(1) == 1
    assert BS & (BS - 1) == 0, "block size must be a power of two"
    dev = ids.device
    rows, pos = rows.contiguous(), pos.contiguous()          # read with unit stride (no-ops when they are)
    for t in (ws_k, ws_v, rows, pos, k, v, req_to_token, violations, counters):
        assert t.device == dev, "append_tokens: every device tensor must be on the working set's device"
    assert violations.dtype == counters.dtype == torch.int64 and counters.numel() >= 4
    if fold is not None:
        kmin, kmax, floc, fk = fold
        assert kmin.shape == kmax.shape == (P, H, D) and kmin.dtype == kmax.dtype, (kmin.shape, kmax.shape)
        assert kmin.is_contiguous() and kmax.is_contiguous() and kmin.device == kmax.device == dev
        assert floc.shape == (B,) and fk.shape == (B, H, D) and fk.stride(2) == 1, (floc.shape, fk.shape)
        assert floc.device == fk.device == dev
        floc = floc.contiguous()
    else:
        kmin = kmax = floc = fk = None
    if B == 0:
        return
    if checks_enabled():
        check_range(rows, 0, R, "rows")
        check_range(pos, 0, req_to_token.shape[1], "pos")
        if fold is not None:
            check_range(floc, 0, P * BS, "fold loc (token locations)")
        if slots is not None:
            check_range(slots, -1, host_k.shape[0], "slots (pool rows)")
    _append_tokens_kernel[(B * H,)](
        ws_k, ws_v, ids, rows, pos, k, v, kernel_arg(host_k, dev), kernel_arg(host_v, dev), req_to_token,
        violations, counters,
        ws_k if kmin is None else kmin, ws_k if kmax is None else kmax, rows if floc is None else floc,
        k if fk is None else fk, counters if slots is None else slots, counters if dropped is None else dropped, P,
        ws_k.stride(0), ws_k.stride(1), ws_v.stride(0), ws_v.stride(1), ids.stride(0), ids.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), host_k.stride(0), host_v.stride(0),
        req_to_token.stride(0), 0 if kmin is None else kmin.stride(0), 0 if fk is None else fk.stride(0),
        0 if fk is None else fk.stride(1), H, K, -1 if skip_row is None else int(skip_row),
        BS=BS, D=D, DV=DV, BLOCK_K=next_pow2(K), BLOCK_D=next_pow2(D), BLOCK_DV=next_pow2(DV),
        FOLD=fold is not None, HAS_SLOTS=slots is not None, num_warps=num_warps)
