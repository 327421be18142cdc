"""Kernel 4: copy (KV head, block) pieces between the host tier and the working set.

H2D gather (admissions) and D2H write-back in one launch per layer for K and V: program ``i``
copies piece ``src[src_idx[i]]`` to ``dst[dst_idx[i]]`` unless ``dst_idx[i] < 0`` (``bs * D`` contiguous elements,
4 KiB for bs=16, D=128, bf16). On CUDA the host side is mapped pinned memory read or written by
the kernel itself (zero-copy), so thousands of 4 KiB pieces move at link speed in one launch
instead of one ``cudaMemcpyAsync`` each. Bytes: ``M * bs * (D + Dv) * e`` each way.
Why a kernel and not copies: ../shared/gpu-host/README.md measured 0.3 GB/s for one
``cudaMemcpyAsync`` per 4 KiB piece and 49.4 GB/s for a kernel reading mapped pinned memory.
Reference: ``oasis_sglang.core.ops.TorchKVOps.copy_blocks``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from oasis_sglang.core.ops import TorchKVOps

from ._common import check_range, checks_enabled, kernel_arg, next_pow2, num_sms

reference = TorchKVOps().copy_blocks
# a row-list program loads up to ROW_TILE_PIECES pieces at once, at most ROW_TILE_ELEMENTS elements
# (8 pieces of 16 tokens x 128 dims: 32 KiB of bf16 in flight per program)
ROW_TILE_PIECES = 8
ROW_TILE_ELEMENTS = 16384


@triton.jit
def _copy_blocks_kernel(DstK, DstV, SrcK, SrcV, DstIdx, SrcIdx, M, PK: tl.constexpr, PV: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    # grid-stride loop: a grid smaller than M keeps the copy to a few SMs (see ``programs``)
    for i in range(tl.program_id(0), M, tl.num_programs(0)):
        di = tl.load(DstIdx + i).to(tl.int64)
        si = tl.load(SrcIdx + i).to(tl.int64)
        live = di >= 0              # dead entries of a fixed-size admission list move nothing
        for o in tl.static_range(0, PK, BLOCK_K):
            offs = o + tl.arange(0, BLOCK_K)
            m = (offs < PK) & live
            x = tl.load(SrcK + si * PK + offs, mask=m)
            tl.store(DstK + di * PK + offs, x.to(DstK.dtype.element_ty), mask=m)
        for o in tl.static_range(0, PV, BLOCK_V):
            offs = o + tl.arange(0, BLOCK_V)
            m = (offs < PV) & live
            x = tl.load(SrcV + si * PV + offs, mask=m)
            tl.store(DstV + di * PV + offs, x.to(DstV.dtype.element_ty), mask=m)


@triton.jit
def _copy_rows_kernel(DstK, DstV, SrcK, SrcV, DstIdx, SrcIdx, Counts, N, C, PK: tl.constexpr, PV: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, P: tl.constexpr):
    # lists of N rows of C entries, live entries first: only the first Counts[r] of row r are read.
    # P pieces per load (a [P, BLOCK] tile): P * 4 KiB of zero-copy reads in flight per program,
    # so a small grid (few SMs taken from the compute stream) still keeps the host link busy
    for r in range(tl.program_id(0), N, tl.num_programs(0)):
        n = tl.minimum(tl.load(Counts + r), C)   # a count past the row's length stays in the row
        base = r * C                 # N * C = B * H * K entries: far below 2**31
        for j in range(0, n, P):
            e = j + tl.arange(0, P)
            em = e < n
            di = tl.load(DstIdx + base + e, mask=em, other=-1).to(tl.int64)
            si = tl.load(SrcIdx + base + e, mask=em, other=0).to(tl.int64)
            live = (di >= 0)[:, None]
            for o in tl.static_range(0, PK, BLOCK_K):
                offs = o + tl.arange(0, BLOCK_K)
                m = live & (offs < PK)[None, :]
                x = tl.load(SrcK + si[:, None] * PK + offs[None, :], mask=m)
                tl.store(DstK + di[:, None] * PK + offs[None, :], x.to(DstK.dtype.element_ty), mask=m)
            for o in tl.static_range(0, PV, BLOCK_V):
                offs = o + tl.arange(0, BLOCK_V)
                m = live & (offs < PV)[None, :]
                x = tl.load(SrcV + si[:, None] * PV + offs[None, :], mask=m)
                tl.store(DstV + di[:, None] * PV + offs[None, :], x.to(DstV.dtype.element_ty), mask=m)


def copy_blocks(dst_k, dst_v, dst_idx, src_k, src_v, src_idx, programs: int = -1, counts=None) -> None:
    """Triton version of :meth:`TorchKVOps.copy_blocks` (same arguments; see there).

    ``programs``: grid size; ``0`` launches one program per piece (row with ``counts``), a
    smaller grid loops over them so a copy that overlaps compute on another stream holds fewer
    SMs (a zero-copy kernel keeps its SM while it waits on the link, and Hopper's GEMMs take a
    whole SM per CTA, so each SM a copy holds is one the decode step's GEMMs lose); ``-1``
    (default): one program per two SMs for the flat list (66 on the H200; prefill's prefix read,
    which overlaps nothing), one per eight SMs for row lists (16 on the H200: the admissions,
    which overlap the decode step). A row program moves up to ``ROW_TILE_PIECES`` (8) pieces per
    load, so 16 programs keep ~0.5 MB of reads in flight, enough for the ~50 GB/s host link.

    ``counts``: ``[N]`` int32, the lists are ``N`` rows (``plan_transfer``'s output): only the
    first ``counts[n]`` entries of row ``n`` are read, so the dead tail of a row costs nothing;
    the grid then loops over rows.

    The launch runs on the device of whichever side is on CUDA (the index tensors' device).
    Raises:
        AssertionError: pieces differ in size, views are not contiguous, or index shapes differ.
        IndexError: with ``OASIS_KERNEL_CHECKS=1``, an index outside its side's pieces.
    """
    M = dst_idx.numel()
    assert src_idx.numel() == M and dst_idx.dim() == src_idx.dim() == 1
    assert dst_k.dim() == src_k.dim() == 2 and dst_k.shape[1] == src_k.shape[1], (dst_k.shape, src_k.shape)
    assert dst_v.dim() == src_v.dim() == 2 and dst_v.shape[1] == src_v.shape[1], (dst_v.shape, src_v.shape)
    assert dst_k.shape[0] == dst_v.shape[0] and src_k.shape[0] == src_v.shape[0]
    for t in (dst_k, dst_v, src_k, src_v):
        assert t.is_contiguous(), "piece views must be contiguous"
    if M == 0:
        return
    dev = dst_idx.device
    assert src_idx.device == dev, "dst_idx and src_idx must be on the same device"
    if checks_enabled():
        live = dst_idx >= 0
        check_range(dst_idx[live], 0, dst_k.shape[0], "dst_idx")
        check_range(src_idx[live], 0, src_k.shape[0], "src_idx")
    PK, PV = dst_k.shape[1], dst_v.shape[1]
    if counts is not None:
        N = counts.numel()
        assert N > 0 and M % N == 0 and counts.dtype == torch.int32 and counts.device == dev, \
            (M, counts.shape, counts.dtype)
        if programs < 0:
            programs = max(1, num_sms(dev) // 8)
        grid = N if programs == 0 else min(N, programs)
        bk, bv = min(2048, next_pow2(PK)), min(2048, next_pow2(PV))
        _copy_rows_kernel[(grid,)](
            kernel_arg(dst_k, dev), kernel_arg(dst_v, dev), kernel_arg(src_k, dev), kernel_arg(src_v, dev),
            dst_idx, src_idx, counts, N, M // N, PK=PK, PV=PV, BLOCK_K=bk, BLOCK_V=bv,
            P=max(1, min(ROW_TILE_PIECES, ROW_TILE_ELEMENTS // max(bk, bv))), num_warps=8)
        return
    if programs < 0:
        programs = max(1, num_sms(dev) // 2)
    grid = M if programs == 0 else min(M, programs)
    _copy_blocks_kernel[(grid,)](
        kernel_arg(dst_k, dev), kernel_arg(dst_v, dev), kernel_arg(src_k, dev), kernel_arg(src_v, dev),
        dst_idx, src_idx, M, PK=PK, PV=PV, BLOCK_K=min(2048, next_pow2(PK)), BLOCK_V=min(2048, next_pow2(PV)),
        num_warps=4)
