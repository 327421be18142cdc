"""Triton kernels vs their torch references (``core.ops.TorchKVOps``).

On a CPU host the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, set by
conftest.py before anything imports triton); on a CUDA host the same tests run the compiled kernels on the
GPU (marker ``gpu``). Exact for copies, summaries and top-K sets; a tolerance table for
attention. Random inputs are fresh every run (the ``seed`` fixture prints the seed).
The Triton 3.6 interpreter truncates fp32 -> bf16 instead of rounding to nearest, so the CPU runs
keep source and destination dtypes equal where results are compared exactly.
"""

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("no CUDA and TRITON_INTERPRET is not set (conftest.py sets it)", allow_module_level=True)

from oasis_sglang.config import OasisConfig  # noqa: E402
from oasis_sglang.core import OasisSparseKV  # noqa: E402
from oasis_sglang.core.ops import TorchKVOps, block_pages  # noqa: E402
from oasis_sglang.core.selection import quest_scores  # noqa: E402
from oasis_sglang.core.summaries import dequantize, quantize_outward  # noqa: E402
from oasis_sglang.kernels import get_kv_ops  # noqa: E402
from oasis_sglang.core.attention import prefill_attention  # noqa: E402
from oasis_sglang.kernels.copy_blocks import copy_blocks  # noqa: E402
from oasis_sglang.kernels.paged_attention import paged_attention  # noqa: E402
from oasis_sglang.kernels.sparse_decode import sparse_decode_attention  # noqa: E402
from oasis_sglang.kernels.topk import (MAX_SELECT_K, MAX_SELECT_NB, NEG_INF_KEY32, POS_INF_KEY32, block_keys,  # noqa: E402
                                      select_topk, topk_from_keys)
from oasis_sglang.kernels.write_kv import segments, write_kv  # noqa: E402
from oasis_sglang.kernels.append_tokens import append_tokens  # noqa: E402
from oasis_sglang.kernels.plan_transfer import budget_candidates, plan_transfer  # noqa: E402
from oasis_sglang.core.selection import select_blocks  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
pytestmark = [pytest.mark.gpu] if CUDA else []
REF = TorchKVOps()
# attention tolerance: ||out - ref|| / ||ref|| (fp32 dots run as tf32 on the GPU)
ATTN_RTOL = {torch.float32: 3e-3, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def layout(lens, bs, extra_pages=3, max_len=None):
    """Random distinct pages for requests of ``lens`` tokens: ``req_to_token [R, max_len]`` int32."""
    need = [-(-n // bs) for n in lens]
    P = sum(need) + extra_pages
    perm = torch.randperm(P)
    max_len = max_len or max(need) * bs + bs
    rtt = torch.zeros((len(lens), max_len), dtype=torch.int32)
    at = 0
    for r, nb in enumerate(need):
        pages = perm[at:at + nb]
        at += nb
        pos = torch.arange(nb * bs)
        rtt[r, :nb * bs] = (pages[pos // bs] * bs + pos % bs).int()
    return rtt, P


def host_tensor(shape, dtype):
    t = torch.randn(shape).to(dtype)
    return t.pin_memory() if CUDA else t


# ---- 1. write_kv: host tier + summaries --------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs", [8, 16])
@pytest.mark.parametrize("scan", [False, True], ids=["segments", "scan"])
def test_write_kv_matches_reference_exactly(seed, dtype, bs, scan):
    """Prefill chunks (their runs found by ``segments`` on the host, or by the kernel itself
    without a sync: ``scan``) then decode tokens: bit for bit the reference."""
    H, D, Dv = 2, 32, 24
    lens = [int(x) for x in torch.randint(1, 5 * bs, (3,))]
    rtt, P = layout([n + 4 for n in lens], bs)
    hk, hv = host_tensor((H, P, bs, D), dtype), host_tensor((H, P, bs, Dv), dtype)     # poisoned
    kmin, kmax = torch.randn(P, H, D).to(dtype).to(DEV), torch.randn(P, H, D).to(dtype).to(DEV)
    ref = [t.clone().to("cpu" if t.device.type == "cpu" else t.device) for t in (hk, hv, kmin, kmax)]
    # chunked prefill: first chunk, second chunk (continues a partial block), then 4 decode steps
    cut = [int(torch.randint(0, n + 1, ())) for n in lens]
    steps = [[(r, 0, cut[r]) for r in range(3)], [(r, cut[r], lens[r]) for r in range(3)]]
    steps += [[(r, lens[r] + i, lens[r] + i + 1) for r in range(3)] for i in range(4)]
    for si, step in enumerate(steps):
        loc = torch.cat([rtt[r, a:b] for r, a, b in step]).long().to(DEV)
        k, v = torch.randn(loc.numel(), H, D).to(dtype).to(DEV), torch.randn(loc.numel(), H, Dv).to(dtype).to(DEV)
        one = si >= 2
        write_kv(hk, hv, kmin, kmax, loc, k, v, bs, one_token_each=one, scan=scan)
        REF.write_kv(*ref, loc, k, v, bs)
    for got, want in zip((hk, hv, kmin, kmax), ref):
        assert torch.equal(got.cpu(), want.cpu())
    # and the summary of every complete block is its exact min/max
    for r, n in enumerate(lens):
        for j in range((n + 4) // bs):
            p = int(rtt[r, j * bs]) // bs
            assert torch.equal(kmin[p].cpu(), hk[:, p].amin(1).cpu()) and torch.equal(kmax[p].cpu(), hk[:, p].amax(1).cpu())


def test_write_kv_decode_takes_a_strided_location_view(seed):
    """A verify batch writes the normal rows' tokens through ``out_cache_loc.view(-1, 2)[:, 0]``."""
    H, D, bs, B = 2, 16, 8, 5
    P = 4 * B
    loc2 = (torch.randperm(P)[:2 * B] * bs + torch.randint(0, bs, (2 * B,))).view(B, 2).to(DEV)
    k, v = torch.randn(2 * B, H, D).to(DEV).view(B, 2, H, D), torch.randn(2 * B, H, D).to(DEV).view(B, 2, H, D)
    got = [torch.zeros(H, P, bs, D), torch.zeros(H, P, bs, D), torch.zeros(P, H, D).to(DEV), torch.zeros(P, H, D).to(DEV)]
    want = [t.clone() for t in got]
    if CUDA:
        got[0], got[1] = got[0].pin_memory(), got[1].pin_memory()
    write_kv(*got, loc2[:, 0], k[:, 0], v[:, 0], bs, one_token_each=True)
    REF.write_kv(*want, loc2[:, 0].contiguous(), k[:, 0].contiguous(), v[:, 0].contiguous(), bs)
    if CUDA:
        torch.cuda.synchronize()
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b.cpu())


def test_segments_split_runs_at_block_and_request_boundaries():
    loc = torch.tensor([5, 6, 7, 8, 9, 40, 41, 2, 3])
    page, off, src, ln = segments(loc, 4)
    assert page.tolist() == [1, 2, 10, 0] and off.tolist() == [1, 0, 0, 2]
    assert src.tolist() == [0, 3, 5, 7] and ln.tolist() == [3, 2, 2, 2]


@pytest.mark.parametrize("scan", [False, True], ids=["segments", "scan"])
def test_write_kv_runs_that_break_anywhere_equal_the_reference(seed, scan):
    """Runs that start and end mid-block, jump backwards and cross block ends, each block written
    by one run (as SGLang's pages with ``--page-size`` = block size hand them out): host tier and
    summaries bit for bit the reference's."""
    H, D, bs, P = 2, 16, 4, 12
    loc = torch.tensor([5, 6, 7, 8, 9, 40, 41, 2, 3, 13, 14, 15, 16, 17, 30, 31, 44, 45, 46, 47])
    hk, hv = host_tensor((H, P, bs, D), torch.float32), host_tensor((H, P, bs, D), torch.float32)
    kmin, kmax = torch.randn(P, H, D).to(DEV), torch.randn(P, H, D).to(DEV)
    ref = [t.clone() for t in (hk, hv, kmin, kmax)]
    k, v = torch.randn(loc.numel(), H, D).to(DEV), torch.randn(loc.numel(), H, D).to(DEV)
    write_kv(hk, hv, kmin, kmax, loc.to(DEV), k, v, bs, scan=scan)
    REF.write_kv(*ref, loc.to(DEV), k, v, bs)
    if CUDA:
        torch.cuda.synchronize()
    for got, want in zip((hk, hv, kmin, kmax), ref):
        assert torch.equal(got.cpu(), want.cpu())


# ---- 2. scoring + top-K ----------------------------------------------------------------------------
def _topk_case(lens, bs, H, G, D, integer, dtype=torch.float32, nb_pad=2):
    rtt, P = layout(lens, bs)
    if integer:   # small integers: every product and sum is exact, so scores tie often and exactly
        q = torch.randint(-3, 4, (len(lens), H * G, D)).to(dtype)
        a, b = torch.randint(-3, 4, (P, H, D)), torch.randint(-3, 4, (P, H, D))
        kmin, kmax = torch.minimum(a, b).to(dtype), torch.maximum(a, b).to(dtype)
    else:
        q = torch.randn(len(lens), H * G, D).to(dtype)
        a, b = torch.randn(P, H, D), torch.randn(P, H, D)
        kmin, kmax = torch.minimum(a, b).to(dtype), torch.maximum(a, b).to(dtype)
    rows = torch.randperm(len(lens))            # query b uses request row rows[b]
    seq = torch.tensor(lens)[rows]
    nb_max = -(-max(lens) // bs) + nb_pad
    return [t.to(DEV) for t in (q, kmin, kmax, rtt, rows, seq)], nb_max


@pytest.mark.parametrize("sink,recent,k", [(1, 2, 6), (0, 1, 3), (2, 3, 40)])
def test_topk_exact_on_integer_scores(seed, sink, recent, k):
    bs = 8
    lens = [int(x) for x in torch.randint(1, 30 * bs, (4,))] + [bs * 7]   # one exact multiple
    args, nb_max = _topk_case(lens, bs, H=2, G=3, D=16, integer=True)
    got = select_topk(*args, bs, sink, recent, nb_max, k)
    want = REF.select_topk(*args, bs, sink, recent, nb_max, k)
    assert torch.equal(got[0].cpu(), want[0].cpu()) and torch.equal(got[1].cpu(), want[1].cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scores_match_reference_and_topk_is_near_exact(seed, dtype):
    bs, H, G, D, k = 16, 2, 4, 64, 8
    lens = [int(x) for x in torch.randint(bs, 50 * bs, (3,))]
    args, nb_max = _topk_case(lens, bs, H, G, D, integer=False, dtype=dtype)
    q, kmin, kmax, rtt, rows, seq = args
    keys = block_keys(q, kmin, kmax, rtt, rows, seq, bs, 0, 1, nb_max)
    # decode the kernel's scores of complete candidate blocks and compare with quest_scores
    hi = (keys >> 32).cpu()
    bits = torch.where(hi < 0, hi ^ 0x7FFFFFFF, hi).to(torch.int32).view(torch.float32)
    pages = block_pages(rtt, rows, nb_max, bs)
    want = quest_scores(q.cpu(), kmin.cpu()[pages.cpu()], kmax.cpu()[pages.cpu()])
    nc = (seq // bs).cpu()
    j = torch.arange(nb_max)[None, None, :].expand(len(lens), H, nb_max)
    cand = j < nc[:, None, None] - 1                        # the last complete block may be recent
    assert torch.allclose(bits[cand], want[cand], rtol=1e-5, atol=1e-4)
    assert (hi[j >= -(-seq.cpu() // bs)[:, None, None]] == NEG_INF_KEY32).all()   # past the context
    # top-K: every chosen block scores at least the reference's k-th best (up to rounding)
    got, _ = select_topk(q, kmin, kmax, rtt, rows, seq, bs, 0, 1, nb_max, k)
    ref, _ = REF.select_topk(q, kmin, kmax, rtt, rows, seq, bs, 0, 1, nb_max, k)
    agree = (got.cpu()[..., :, None] == ref.cpu()[..., None, :]).any(-1).float().mean()
    assert agree > 0.9, agree


# (1, 1, 8193, 128): a 128K-token model's CUDA-graph table (context + 4 tokens) at 16-token blocks
@pytest.mark.parametrize("B,H,NB,k", [(3, 2, 37, 8), (2, 3, 5, 8), (1, 2, 300, 128), (2, 1, 1037, 125),
                                      (1, 1, 8193, 128)])
def test_fused_selection_equals_torch_topk(seed, B, H, NB, k):
    """The one-launch radix select + rank of ``topk_from_keys`` against ``torch.topk`` + decode,
    exactly: score images with many ties (broken by the block id), forced (+inf) and absent (-inf)
    blocks, negative and positive keys, rows shorter than ``k``."""
    img = torch.randint(-4, 5, (B, H, NB), dtype=torch.int64) * 1000003
    img = torch.where(torch.rand(B, H, NB) < 0.1, torch.full_like(img, POS_INF_KEY32), img)
    img = torch.where(torch.rand(B, H, NB) < 0.2, torch.full_like(img, NEG_INF_KEY32), img)
    keys = (img * 4294967296 + (4294967295 - torch.arange(NB))).to(DEV)
    got = topk_from_keys(keys, k, fused=True)
    want = topk_from_keys(keys, k, fused=False)
    assert torch.equal(got[0].cpu(), want[0].cpu()) and torch.equal(got[1].cpu(), want[1].cpu())
    assert got[0].shape == (B, H, k) and got[1].dtype == torch.bool


@pytest.mark.skipif(not CUDA, reason="launch parameter: the interpreter runs one program as a whole")
@pytest.mark.parametrize("NB", [276, 1044, 3076])
@pytest.mark.parametrize("warps", [1, 2, 4, 8, 16])
def test_fused_selection_is_exact_at_every_warp_count(seed, NB, warps):
    """The launch's warps change the register layout of the row and of the counting reductions,
    never the result: exact against ``torch.topk`` at the serving widths (4K / 16K contexts and a
    CUDA-graph table 3x 16K), ties and forced / absent blocks included."""
    img = torch.randint(-4, 5, (6, 8, NB), dtype=torch.int64) * 1000003
    img = torch.where(torch.rand(6, 8, NB) < 0.05, torch.full_like(img, POS_INF_KEY32), img)
    img = torch.where(torch.rand(6, 8, NB) < 0.3, torch.full_like(img, NEG_INF_KEY32), img)
    keys = (img * 4294967296 + (4294967295 - torch.arange(NB))).to(DEV)
    got = topk_from_keys(keys, 128, fused=True, num_warps=warps)
    want = topk_from_keys(keys, 128, fused=False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_fused_selection_refuses_rows_it_cannot_hold():
    with pytest.raises(ValueError, match="at most"):
        topk_from_keys(torch.zeros((1, 1, MAX_SELECT_NB + 1), dtype=torch.int64, device=DEV), 8, fused=True)
    with pytest.raises(ValueError, match="k <= "):
        topk_from_keys(torch.zeros((1, 1, 64), dtype=torch.int64, device=DEV), MAX_SELECT_K + 1, fused=True)
    with pytest.raises(AssertionError, match="int64"):
        topk_from_keys(torch.zeros((1, 1, 64), dtype=torch.float32, device=DEV), 8)


def test_fused_selection_with_duplicate_keys_stays_in_bounds():
    """Duplicate keys (never produced by ``block_keys``) give an unspecified choice but no write
    outside the outputs: the row's other outputs and the neighbouring rows stay intact."""
    keys = torch.full((2, 3, 10), 5 * 2**32 + 7, dtype=torch.int64, device=DEV)
    wanted, forced = topk_from_keys(keys, 3, fused=True)
    assert wanted.shape == (2, 3, 3) and forced.shape == (2, 3, 3)
    # rows with distinct keys beside a row of duplicates are still exact
    good = (torch.arange(10, dtype=torch.int64) * 4294967296 + (4294967295 - torch.arange(10))).to(DEV)
    keys[0, 1] = good
    w2, _ = topk_from_keys(keys, 3, fused=True)
    assert w2[0, 1].tolist() == [9, 8, 7]


def test_topk_long_context_128k(seed):
    """One request of 128K tokens (8,192 blocks of 16) plus a short one in the same launch."""
    bs = 16
    lens = [128 * 1024 - 5, 100]
    args, nb_max = _topk_case(lens, bs, H=1, G=2, D=16, integer=True, nb_pad=0)
    got = select_topk(*args, bs, 1, 2, nb_max, 64)
    want = REF.select_topk(*args, bs, 1, 2, nb_max, 64)
    assert torch.equal(got[0].cpu(), want[0].cpu()) and torch.equal(got[1].cpu(), want[1].cpu())


# ---- 3. sparse decode attention -----------------------------------------------------------------
def _ws_case(B, H, G, KS, bs, D, Dv, dtype, NQ):
    R = B + 2
    ws_k = torch.randn(R, H, KS, bs, D).to(dtype)
    ws_v = torch.randn(R, H, KS, bs, Dv).to(dtype)
    ids = torch.full((R, H, KS), -1, dtype=torch.int64)
    rows = torch.randperm(R)[:B]
    seq = torch.randint(1, 4 * KS * bs, (B,))
    for b in range(B):
        nb = -(-int(seq[b]) // bs)
        n_res = int(torch.randint(1, min(nb, KS) + 1, ()))
        for h in range(H):     # each KV head holds its own blocks; the current block always
            others = torch.randperm(nb - 1)[:n_res - 1] if nb > 1 else torch.empty(0, dtype=torch.long)
            blocks = torch.cat([torch.tensor([nb - 1]), others])
            slots = torch.randperm(KS)[:n_res]
            ids[rows[b], h, slots] = blocks
    q = torch.randn(B, NQ, H * G, D).to(dtype)
    return [t.to(DEV) for t in (q, ws_k, ws_v, ids, rows, seq)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("NQ", [1, 2])
@pytest.mark.parametrize("block_n", [16, 128])
def test_sparse_decode_attention_matches_reference(seed, dtype, NQ, block_n):
    """Tiles of 2 blocks, and of 16 (the GPU default's 128 tokens: more than the 12 slots, so
    the one tile is partly masked)."""
    B, H, G, KS, bs, D, Dv = 3, 2, 3, 12, 8, 32, 32
    q, ws_k, ws_v, ids, rows, seq = _ws_case(B, H, G, KS, bs, D, Dv, dtype, NQ)
    kx = vx = None
    if NQ == 2:
        kx, vx = torch.randn(B, H, D).to(dtype).to(DEV), torch.randn(B, H, Dv).to(dtype).to(DEV)
    for splits in (1, 2, 5):
        o, lse = sparse_decode_attention(q, ws_k, ws_v, ids, rows, seq, 0.17, kx, vx, return_lse=True,
                                         num_splits=splits, block_n=block_n)
        ro, rl = REF.sparse_decode_attention(q.float(), ws_k.float(), ws_v.float(), ids, rows, seq, 0.17,
                                             None if kx is None else kx.float(),
                                             None if vx is None else vx.float(), return_lse=True)
        assert o.dtype == dtype and not torch.isnan(o).any() and not torch.isnan(lse).any()
        err = ((o.float() - ro).norm() / ro.norm()).item()
        assert err < ATTN_RTOL[dtype], (splits, err)
        assert torch.allclose(lse, rl, atol=5e-2 if dtype == torch.bfloat16 else 1e-2), (lse - rl).abs().max()


def test_the_default_tile_is_128_tokens_only_where_it_was_timed_faster():
    """``default_block_n``: Hopper (9.0: H100 / H200) with bf16 or fp8 at head size <= 128 takes
    128; other GPUs (8.0 A100, 8.9 L4, 10.0), larger heads, fp32 and no device keep 64; a tile
    that is not a power of two is refused before the launch."""
    from oasis_sglang.kernels.sparse_decode import default_block_n

    assert default_block_n((9, 0), 128, 128, 2) == 128 and default_block_n((9, 0), 128, 128, 1) == 128
    assert default_block_n((9, 0), 64, 64, 2) == 128
    for cap, D, elt in (((8, 0), 128, 2), ((8, 9), 128, 2), ((10, 0), 128, 2), ((9, 0), 256, 2), ((9, 0), 128, 4),
                        (None, 128, 2)):
        assert default_block_n(cap, D, D, elt) == 64, (cap, D, elt)
    q, ws_k, ws_v, ids, rows, seq = _ws_case(2, 2, 2, 4, 16, 32, 32, torch.float32, 1)
    with pytest.raises(AssertionError, match="block_n must be a power of two"):
        sparse_decode_attention(q, ws_k, ws_v, ids, rows, seq, None, block_n=48)


def test_sparse_decode_attention_bitwise_engine_path(seed):
    """fp32 on the interpreter / fp32 on GPU: close to SDPA over the gathered tokens for D=64, bs=16."""
    q, ws_k, ws_v, ids, rows, seq = _ws_case(4, 3, 3, 8, 16, 64, 64, torch.float32, 1)
    o, _ = sparse_decode_attention(q, ws_k, ws_v, ids, rows, seq, None)
    ro, _ = REF.sparse_decode_attention(q, ws_k, ws_v, ids, rows, seq, None)
    assert ((o - ro).norm() / ro.norm()).item() < ATTN_RTOL[torch.float32]


# ---- 4. block copies (H2D gather, D2H write-back) ---------------------------------------------
@pytest.mark.parametrize("programs", [0, 3])
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_copy_blocks_exact(seed, direction, programs):
    """One program per piece, or a 3-program grid looping over the 17 pieces."""
    piece_k, piece_v, Ns, Nd, M = 16 * 32, 16 * 24, 40, 30, 17
    host_k, host_v = host_tensor((Ns, piece_k), torch.bfloat16), host_tensor((Ns, piece_v), torch.bfloat16)
    dev_k = torch.randn(Nd, piece_k).to(torch.bfloat16).to(DEV)     # poisoned destination
    dev_v = torch.randn(Nd, piece_v).to(torch.bfloat16).to(DEV)
    if direction == "h2d":
        src, dst = (host_k, host_v), (dev_k, dev_v)
        si, di = torch.randint(0, Ns, (M,)), torch.randperm(Nd)[:M]
    else:
        src, dst = (dev_k, dev_v), (host_k, host_v)
        si, di = torch.randint(0, Nd, (M,)), torch.randperm(Ns)[:M]
    di[torch.rand(M) < 0.25] = -1                                   # dead entries move nothing
    live = di >= 0
    want_k, want_v = dst[0].clone().cpu(), dst[1].clone().cpu()
    want_k[di[live]] = src[0].cpu()[si[live]]
    want_v[di[live]] = src[1].cpu()[si[live]]
    copy_blocks(dst[0], dst[1], di.to(DEV), src[0], src[1], si.to(DEV), programs=programs)
    if CUDA:
        torch.cuda.synchronize()
    assert torch.equal(dst[0].cpu(), want_k) and torch.equal(dst[1].cpu(), want_v)


@pytest.mark.parametrize("programs,C", [(0, 6), (3, 6), (-1, 20)])
def test_copy_blocks_rows_read_only_the_counted_entries(seed, programs, C):
    """Row lists (``plan_transfer``'s output): entries past ``counts[n]`` are never read, even if live.
    C = 20 entries per row: a program moves a row in tiles of up to 8 pieces (three tiles)."""
    piece, Ns, Nd, N = 16 * 8, 50, 120, 5
    src_k, src_v = host_tensor((Ns, piece), torch.float32), host_tensor((Ns, piece), torch.float32)
    dst_k, dst_v = torch.randn(Nd, piece).to(DEV), torch.randn(Nd, piece).to(DEV)
    di = torch.randperm(Nd)[:N * C].view(N, C)
    si = torch.randint(0, Ns, (N, C))
    counts = torch.randint(0, C + 1, (N,), dtype=torch.int32)
    counts[0] = C + 3                 # past the row's length: the row's C entries, nothing of the next row
    want_k, want_v = dst_k.clone().cpu(), dst_v.clone().cpu()
    for n in range(N):
        c = min(int(counts[n]), C)
        want_k[di[n, :c]] = src_k.cpu()[si[n, :c]]
        want_v[di[n, :c]] = src_v.cpu()[si[n, :c]]
    ref_k, ref_v = dst_k.clone(), dst_v.clone()
    REF.copy_blocks(ref_k, ref_v, di.reshape(-1).to(DEV), src_k, src_v, si.reshape(-1).to(DEV), counts=counts.to(DEV))
    copy_blocks(dst_k, dst_v, di.reshape(-1).to(DEV), src_k, src_v, si.reshape(-1).to(DEV), programs=programs,
                counts=counts.to(DEV))
    if CUDA:
        torch.cuda.synchronize()
    for got in ((dst_k, dst_v), (ref_k, ref_v)):
        assert torch.equal(got[0].cpu(), want_k) and torch.equal(got[1].cpu(), want_v)


# ---- 6. capped-eviction plan + copy lists ------------------------------------------------------
@pytest.mark.parametrize("cap", [None, 0, 1, 3])
@pytest.mark.parametrize("K", [6, 8])
def test_plan_transfer_equals_reference_exactly(seed, cap, K):
    """30 steps of random predictions (the sink/recent blocks moving with the context) over a shared
    slot table: block table, LRU clock, copy lists, counts and counters equal the reference's,
    with a CUDA-graph padding row in the batch."""
    R, H, bs, NB = 6, 3, 4, 24
    rows = torch.tensor([2, 0, 5, 3], device=DEV)
    pad = 0
    rtt, P = layout([NB * bs] * R, bs)
    rtt = rtt.to(DEV)
    state = [[torch.full((R, H, K), -1, dtype=torch.int64, device=DEV), torch.zeros((R, H, K), dtype=torch.int64, device=DEV),
              torch.zeros(4, dtype=torch.int64, device=DEV)] for _ in range(2)]
    seq = torch.tensor([9, 14, 3, 30], device=DEV)
    for step in range(1, 31):
        seq = (seq + torch.randint(0, 2, (4,), device=DEV)).clamp(max=NB * bs)
        nb, nc = (seq + bs - 1) // bs, seq // bs
        scores = torch.randint(-3, 4, (4, H, NB), device=DEV).float()
        wanted, forced = select_blocks(scores, nb, nc, K, 1, 2)
        st = torch.tensor(step, dtype=torch.int64, device=DEV)
        out = []
        for (ids, lru, ctr), fn in zip(state, (REF.plan_transfer, plan_transfer)):
            out.append(fn(ids, lru, rows, wanted, forced, st, cap, seq, rtt, bs, P, ctr, skip_row=pad))
        for a, b in zip(*out):
            assert torch.equal(a.cpu(), b.cpu()), step
        for a, b in zip(*state):
            assert torch.equal(a.cpu(), b.cpu()), step
    dst, src, counts = out[1]
    assert int(state[0][2][1]) > 0 and int(state[0][2][0]) > 0
    assert (counts.view(4, H)[1] == 0).all(), "the padding row copies nothing"


@pytest.mark.parametrize("cap", [None, 2])
@pytest.mark.parametrize("budget", [0, 3, -1])
def test_budgeted_plan_and_its_candidates_equal_the_reference_exactly(seed, cap, budget):
    """The step budget (``core.budget``): 12 steps of random predictions over a shared slot table;
    the candidate lists (kernel 6b), the shares, the block table, LRU clock, copy lists and
    counters equal the torch reference's, with a CUDA-graph padding row in the batch."""
    from oasis_sglang.core.budget import share_budget

    R, H, K, bs, NB = 6, 3, 8, 4, 24
    rows = torch.tensor([2, 0, 5, 3], device=DEV)
    rtt, P = layout([NB * bs] * R, bs)
    rtt = rtt.to(DEV)
    state = [[torch.full((R, H, K), -1, dtype=torch.int64, device=DEV), torch.zeros((R, H, K), dtype=torch.int64, device=DEV),
              torch.zeros(4, dtype=torch.int64, device=DEV)] for _ in range(2)]
    seq = torch.tensor([40, 54, 33, 70], device=DEV)
    refused = 0
    for step in range(1, 13):
        seq = (seq + torch.randint(0, 2, (4,), device=DEV)).clamp(max=NB * bs)
        scores = torch.randn(4, H, NB, device=DEV)
        wanted, forced = select_blocks(scores, (seq + bs - 1) // bs, seq // bs, K, 1, 2)
        st = torch.tensor(step, dtype=torch.int64, device=DEV)
        b = torch.tensor(budget, device=DEV)
        cands = [fn(state[i][0], rows, wanted, forced, cap, b) for i, fn in enumerate((REF.budget_candidates, budget_candidates))]
        assert torch.equal(cands[0].cpu(), cands[1].cpu()), step
        if budget < 0:
            assert bool((cands[0] == -1).all()), "an unlimited budget lists none"
        allow = share_budget(cands[0], b, st, K)
        refused += int((cands[0] >= 0).sum()) - int(allow.sum())
        out = [fn(ids, lru, rows, wanted, forced, st, cap, seq, rtt, bs, P, ctr, skip_row=0, allow=allow)
               for (ids, lru, ctr), fn in zip(state, (REF.plan_transfer, plan_transfer))]
        for a, b in zip(*out):
            assert torch.equal(a.cpu(), b.cpu()), step
        for a, b in zip(*state):
            assert torch.equal(a.cpu(), b.cpu()), step
    assert (refused > 0) == (budget >= 0), "a finite budget must refuse candidates here (random scores churn)"


@pytest.mark.parametrize("N,C,K", [(5, 3, 8), (70, 8, 128), (130, 9, 200)])
def test_share_budget_equals_reference_exactly(seed, N, C, K):
    """Kernel 6c against ``core.budget.share_budget``: random candidate lists (some heads empty),
    budgets from none to all, unlimited, and clocks past N (the rotation); N above the kernel's
    64-head tile and N*C above its 1,024-entry histogram tile exercise its loops."""
    from oasis_sglang.core.budget import share_budget as ref
    from oasis_sglang.kernels.share_budget import share_budget

    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(N):
        n = int(torch.randint(0, C + 1, (1,), generator=g))
        rows.append(sorted(torch.randperm(K, generator=g)[:n].tolist()) + [-1] * (C - n))
    cand = torch.tensor(rows, dtype=torch.int32).to(DEV)
    total = int((cand >= 0).sum())
    for budget in sorted({0, 1, total // 3, total // 2, total - 1, total, total + 3, -1}):
        for clock in (0, 3, N + 2, 10**9 + 7, -1, -N - 3):
            b = torch.tensor(max(budget, -1), dtype=torch.int64, device=DEV)
            c = torch.tensor(clock, dtype=torch.int64, device=DEV)
            want, got = ref(cand, b, c, K), share_budget(cand, b, c, K)
            assert got.dtype == torch.int32 and torch.equal(want.cpu(), got.cpu()), (budget, clock)
            assert int(got.sum()) == (N * C if budget < 0 else min(budget, total))


@pytest.mark.parametrize("B,H,K", [(1, 1, 5), (3, 2, 16), (5, 4, 128), (2, 3, 200)])
def test_replay_churn_equals_reference_exactly(seed, B, H, K):
    """Kernel 8 (benchmarks' churn replay) against ``core.churn.replay_churn``: real top-K lists
    (``select_blocks``, sink / recent blocks forced) against resident sets that share some of them,
    rows gathered in the kernel, free slots (-1), means from none to past K, NaN, and layers (salt)
    whose dither term passes 2**31; also equal to the reference's bitmap path (ids below nb_max)."""
    from oasis_sglang.core.churn import replay_churn as ref
    from oasis_sglang.kernels.replay_churn import replay_churn

    g = torch.Generator().manual_seed(seed)
    R, nb = B + 3, 3 * K + 7
    n = torch.randint(K // 2 + 1, nb + 1, (B,), generator=g)
    wanted, forced = select_blocks(torch.randn(B, H, nb, generator=g), n, n - 1, K, 1, 2)
    ids = torch.full((R, H, K), -1, dtype=torch.int64)
    for r in range(R):
        for h in range(H):
            pool = wanted[min(r, B - 1), h]
            pool = pool[pool >= 0][torch.randperm(int((pool >= 0).sum()), generator=g)][:K // 3]
            rest = [x for x in torch.randperm(nb, generator=g).tolist() if x not in set(pool.tolist())]
            row = torch.cat([pool, torch.tensor(rest[:K - len(pool)], dtype=torch.int64)])
            free = torch.rand(K, generator=g) < 0.2                     # some free slots
            ids[r, h] = torch.where(free, -1, row[torch.randperm(K, generator=g)])
    rows = torch.randperm(R, generator=g)[:B]
    seq = torch.randint(0, 200_000, (B,), generator=g)
    w_d, f_d, ids_d, rows_d, seq_d = (t.to(DEV) for t in (wanted, forced, ids, rows, seq))
    for mean in (0.0, 1.0, 2.5, 7.3, float(K + 3), float("nan"), -1.0):
        for salt in (0, 3, 35):
            want_w, want_f = ref(wanted, forced, ids[rows], mean, seq, salt=salt)
            bit_w, _ = ref(wanted, forced, ids[rows], mean, seq, salt=salt, nb_max=nb)
            got_w, got_f = replay_churn(w_d, f_d, ids_d, rows_d, mean, seq_d, salt=salt)
            assert got_w.dtype == torch.int64 and got_f.dtype == torch.bool and got_w.shape == (B, H, K)
            assert torch.equal(want_w, got_w.cpu()) and torch.equal(want_f, got_f.cpu()), (mean, salt)
            assert torch.equal(bit_w, want_w), (mean, salt)


@pytest.mark.parametrize("L,B,H,K,bs", [(1, 1, 1, 1, 16), (2, 3, 2, 8, 4), (3, 5, 4, 128, 16), (2, 4, 3, 200, 1)])
@pytest.mark.parametrize("pipelined", [True, False])
def test_dense_plan_equals_reference_exactly(seed, L, B, H, K, bs, pipelined):
    """Kernel 9 (the dense path's update of every layer) against ``TorchKVOps.dense_plan``: block
    tables with the step's blocks resident, missing, or no free slot for them, contexts at block
    boundaries (``seq - 1`` and ``seq`` in different blocks), a repeated padding row (no hits
    counted), rows gathered from a larger table; ids, LRU clocks and hit counters equal."""
    from oasis_sglang.kernels.dense_plan import dense_plan

    g = torch.Generator().manual_seed(seed)
    R = B + 3
    seq = torch.randint(1, K * bs + 1, (B,), generator=g)
    seq[0] = bs * (1 + int(torch.randint(0, K, (1,), generator=g)))      # the new token opens a block
    if B > 1:
        seq[1] = 1                                                          # the first token of a request
    ids = torch.full((L, R, H, K), -1, dtype=torch.int64)
    for l in range(L):
        for r in range(R):
            for h in range(H):
                nb = int(seq[min(r, B - 1)]) // bs + 2
                blocks = torch.randperm(max(nb, K), generator=g)[:K]
                free = torch.rand(K, generator=g) < float(torch.rand(1, generator=g))   # from none to all free
                ids[l, r, h] = torch.where(free, -1, blocks)
    ids[0, :, 0] = torch.arange(K)                                          # a full row: no free slot
    lu = torch.randint(0, 50, ids.shape, generator=g)
    rows = torch.randperm(R, generator=g)[:B]
    skip = None
    if B > 2:
        rows[-1] = rows[-2]                                                 # a captured batch's padding row, twice
        seq[-1] = seq[-2]
        skip = int(rows[-1])
    clock = torch.tensor(77, dtype=torch.int64)
    counters = torch.randint(0, 9, (L, 4), generator=g)
    i_ref, l_ref, c_ref = ids.clone(), lu.clone(), counters.clone()
    REF.dense_plan(i_ref, l_ref, rows, seq, bs, pipelined, clock, c_ref, skip)
    i_d, l_d, c_d = ids.clone().to(DEV), lu.clone().to(DEV), counters.clone().to(DEV)    # (.to(cpu) aliases)
    dense_plan(i_d, l_d, rows.to(DEV).int(), seq.to(DEV), bs, pipelined, clock.to(DEV), c_d, skip)
    assert torch.equal(i_ref, i_d.cpu()) and torch.equal(l_ref, l_d.cpu()) and torch.equal(c_ref, c_d.cpu())
    assert not torch.equal(c_ref, counters) and (K == 1 or not torch.equal(i_ref, ids)), "the case counts hits and puts blocks"
    for b in range(B):                    # with two free slots, both of the step's blocks are resident after
        for l in range(L):
            for h in range(H):
                if int((ids[l, rows[b], h] < 0).sum()) >= 2:
                    for j in {(int(seq[b]) - 1) // bs, int(seq[b]) // bs}:
                        assert bool((i_ref[l, rows[b], h] == j).any()), (b, l, h, j)


def test_dense_plan_falls_back_to_the_reference_when_its_first_launch_fails(seed, monkeypatch, caplog):
    """``TritonKVOps.dense_plan``: a kernel whose first launch fails (a Triton compile error on a
    GPU it never ran on) is logged once and the torch reference does the update, with the same
    effect, from then on; bad arguments still raise; a kernel that worked once is called directly."""
    import oasis_sglang.kernels.triton_ops as tops

    L, R, H, K, bs = 2, 4, 2, 8, 4
    g = torch.Generator().manual_seed(seed)
    ids = torch.where(torch.rand(L, R, H, K, generator=g) < 0.5, -1, torch.randint(0, 9, (L, R, H, K), generator=g))
    lu, counters = torch.zeros_like(ids), torch.zeros(L, 4, dtype=torch.int64)
    rows, seq, clock = torch.tensor([1, 3]), torch.tensor([9, 13]), torch.tensor(5)
    want = [ids.clone(), lu.clone(), counters.clone()]
    REF.dense_plan(*want[:2], rows, seq, bs, True, clock, want[2], None)
    ids, lu, counters = ids.to(DEV), lu.to(DEV), counters.to(DEV)      # the kernel's device (compiled on CUDA)
    rows, seq, clock = rows.to(DEV).int(), seq.to(DEV), clock.to(DEV)
    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise RuntimeError("triton.compiler.errors.CompilationError: (simulated)")

    ops = tops.TritonKVOps()
    monkeypatch.setattr(tops, "dense_plan", broken)
    with caplog.at_level("ERROR"):
        ops.dense_plan(ids, lu, rows, seq, bs, True, clock, counters, None)
    assert ops.dense_plan_kernel_ok is False and "kernel 9" in caplog.text and len(calls) == 1
    assert torch.equal(ids.cpu(), want[0]) and torch.equal(lu.cpu(), want[1]) and torch.equal(counters.cpu(), want[2])
    ops.dense_plan(ids.clone(), lu.clone(), rows, seq, bs, True, clock, counters.clone(), None)
    assert len(calls) == 1, "the reference from then on"
    ok = tops.TritonKVOps()
    monkeypatch.undo()
    with pytest.raises(AssertionError):
        ok.dense_plan(ids, lu.int(), rows, seq, bs, True, clock, counters, None)       # bad dtype: raised
    assert ok.dense_plan_kernel_ok is None
    ok.dense_plan(ids.clone(), lu.clone(), rows, seq, bs, True, clock, counters.clone(), None)
    assert ok.dense_plan_kernel_ok is True


@pytest.mark.parametrize("fn", ["reference", "kernel"])
def test_plan_transfer_a_huge_cap_is_unbounded(seed, fn):
    """A cap of K or more admits like no cap (n_free + cap must not overflow: 2**63 - 1 did)."""
    R, H, K, bs, NB = 2, 2, 6, 4, 20
    plan = REF.plan_transfer if fn == "reference" else plan_transfer
    rows = torch.tensor([0, 1], device=DEV)
    rtt, P = layout([NB * bs] * R, bs)
    rtt = rtt.to(DEV)
    state = {c: [torch.full((R, H, K), -1, dtype=torch.int64, device=DEV),
                 torch.zeros((R, H, K), dtype=torch.int64, device=DEV),
                 torch.zeros(4, dtype=torch.int64, device=DEV)] for c in (None, K, 2**63 - 1)}
    seq = torch.tensor([40, 60], device=DEV)
    for step in range(1, 8):
        scores = torch.randn(2, H, NB, device=DEV)
        wanted, forced = select_blocks(scores, (seq + bs - 1) // bs, seq // bs, K, 1, 2)
        outs = {c: plan(ids, lru, rows, wanted, forced, step, c, seq, rtt, bs, P, ctr)
                for c, (ids, lru, ctr) in state.items()}
        for c in (K, 2**63 - 1):
            for a, b in zip(outs[None], outs[c]):
                assert torch.equal(a.cpu(), b.cpu()), (c, step)
            for a, b in zip(state[None], state[c]):
                assert torch.equal(a.cpu(), b.cpu()), (c, step)
    assert int(state[None][2][2]) > 0, "random scores must evict (else the cap is never exercised)"


def test_plan_transfer_handles_an_int_step_and_no_cap(seed):
    R, H, K, bs = 3, 2, 4, 8
    rtt, P = layout([64] * R, bs)
    ids = torch.full((R, H, K), -1, dtype=torch.int64, device=DEV)
    lru, ctr = torch.zeros_like(ids), torch.zeros(4, dtype=torch.int64, device=DEV)
    wanted = torch.tensor([[[0, 7, 3, -1], [1, 2, -1, -1]]], device=DEV)
    forced = torch.zeros_like(wanted, dtype=torch.bool)
    dst, src, counts = plan_transfer(ids, lru, torch.tensor([1], device=DEV), wanted, forced, 5, None,
                                     torch.tensor([60], device=DEV), rtt.to(DEV), bs, P, ctr)
    # block 7 starts at token 56 < 59: copied; every wanted block now resident in slot order
    assert ids[1].tolist() == [[0, 7, 3, -1], [1, 2, -1, -1]] and (lru[1][ids[1] >= 0] == 5).all()
    assert counts.tolist() == [3, 2] and dst[0, :3].tolist() == [(1 * H + 0) * K + e for e in range(3)]
    assert src[0, :3].tolist() == [int(rtt[1, b * bs]) // bs for b in (0, 7, 3)] and dst[0, 3] == -1
    assert ctr.tolist() == [0, 5, 0, 0]


def test_large_working_sets_take_the_reference_paths(seed, monkeypatch):
    """Above the fused kernels' limits TritonKVOps runs the torch references (same results); the
    top-K key decode of more than 4,096 blocks runs elementwise ops."""
    import oasis_sglang.kernels.triton_ops as tops

    monkeypatch.setattr(tops, "MAX_FUSED_PLAN_K", 4)
    monkeypatch.setattr(tops, "MAX_FUSED_APPEND_K", 4)
    ops = get_kv_ops("triton")
    R, H, K, bs = 3, 2, 6, 4
    rtt, P = layout([96] * R, bs)
    rtt = rtt.to(DEV)
    rows, seq = torch.tensor([2, 1], device=DEV), torch.tensor([50, 77], device=DEV)
    wanted, forced = select_blocks(torch.randn(2, H, 24, device=DEV), (seq + 3) // 4, seq // 4, K, 1, 2)
    outs = []
    for fn in (REF.plan_transfer, ops.plan_transfer):
        ids = torch.full((R, H, K), -1, dtype=torch.int64, device=DEV)
        ctr = torch.zeros(4, dtype=torch.int64, device=DEV)
        outs.append((*fn(ids, torch.zeros_like(ids), rows, wanted, forced, 3, 1, seq, rtt, bs, P, ctr), ids, ctr))
    for a, b in zip(*outs):
        assert torch.equal(a.cpu(), b.cpu())
    lens = [4100 * 16 + 3]
    args, nb_max = _topk_case(lens, 16, H=1, G=1, D=8, integer=True, nb_pad=0)
    got, want = select_topk(*args, 16, 1, 2, nb_max, 4100), REF.select_topk(*args, 16, 1, 2, nb_max, 4100)
    assert torch.equal(got[0].cpu(), want[0].cpu()) and torch.equal(got[1].cpu(), want[1].cpu())


# ---- 7. decoded tokens into the working set + write-back ------------------------------------------
@pytest.mark.parametrize("fold", [False, True], ids=["append", "append+fold"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_append_tokens_equals_reference_exactly(seed, dtype, fold):
    """Tokens at every block offset (the last ones complete a block and are written back), a token
    whose block is not resident (a violation: written nowhere), and a padding row. ``fold``: the
    same launch folds the keys into their blocks' summaries (kernel 1's decode fold: a token at
    block offset 0 starts its block's summary, the others are folded in), every row included."""
    R, H, K, bs, D, Dv = 5, 2, 4, 8, 16, 8
    rtt, P = layout([K * 2 * bs] * R, bs)
    rtt = rtt.to(DEV)
    ids = torch.stack([torch.randperm(2 * K)[:K] for _ in range(R * H)]).view(R, H, K).to(DEV)
    ids[1, 1, 2] = -1
    rows = torch.tensor([1, 3, 4, 0, 2], device=DEV)
    blk = ids[rows, 0, torch.randint(0, K, (5,))]                       # a resident block of KV head 0
    blk[0] = 0 if int(ids[1, 0, 0]) != 0 else 1
    pos = blk * bs + torch.tensor([bs - 1, 3, bs - 1, bs - 1, 0], device=DEV)
    k, v = torch.randn(5, H, D).to(dtype).to(DEV), torch.randn(5, H, Dv).to(dtype).to(DEV)
    states = []
    for fn in (REF.append_tokens, append_tokens):
        ws_k = torch.randn(R, H, K, bs, D, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEV)
        ws_v = torch.randn(R, H, K, bs, Dv, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEV)
        hk = host_tensor((H, P, bs, D), dtype).zero_()
        hv = host_tensor((H, P, bs, Dv), dtype).zero_()
        viol, ctr = torch.zeros((), dtype=torch.int64, device=DEV), torch.zeros(4, dtype=torch.int64, device=DEV)
        g = torch.Generator().manual_seed(3)
        kmin = torch.randn(P, H, D, generator=g).to(dtype).to(DEV)
        kmax = (kmin.float() + torch.rand(P, H, D, generator=g).to(DEV)).to(dtype)
        floc = rtt[rows, pos].long()
        fn(ws_k, ws_v, ids, rows, pos, k, v, hk, hv, rtt, viol, ctr, skip_row=0,
           fold=(kmin, kmax, floc, k) if fold else None)
        states.append((ws_k, ws_v, hk, hv, viol, ctr, kmin, kmax))
    if CUDA:
        torch.cuda.synchronize()
    for a, b in zip(*states):
        assert torch.equal(a.cpu(), b.cpu())
    ws_k, _, hk, _, viol, ctr, kmin, kmax = states[1]
    page_d = (rtt[rows, pos].long() // bs).cpu()
    start = (pos % bs == 0).cpu()
    if fold:          # the token starting its block (the padding row's) is its block's whole summary
        assert start.any() and torch.equal(kmin.cpu()[page_d[start]], k.cpu()[start])
        assert bool((kmin.cpu()[page_d] <= k.cpu()).all()) and bool((kmax.cpu()[page_d] >= k.cpu()).all())
    else:
        assert not torch.equal(kmin.cpu()[page_d[start]], k.cpu()[start]), "no fold: summaries untouched"
    n_bad = sum(int(not (ids[int(r), h] == int(p) // bs).any()) for r, p in zip(rows.tolist(), pos.tolist())
                for h in range(H) if int(r) != 0)
    assert int(viol) == n_bad
    # batch entries 0 and 2 end their block: written back for each KV head where the block is resident
    done = [(b, h) for b in (0, 2) for h in range(H) if (ids[int(rows[b]), h] == int(pos[b]) // bs).any()]
    assert int(ctr[3]) == len(done) and done
    for b, h in done:
        r, p = int(rows[b]), int(pos[b])
        e = int((ids[r, h] == p // bs).nonzero()[0])
        page = int(rtt[r, p]) // bs
        assert torch.equal(hk[h, page].cpu(), ws_k[r, h, e].cpu()) and torch.equal(ws_k[r, h, e, bs - 1].cpu(), k[b, h].cpu())


# ---- compact host tier: the slot indirection of kernels 1, 6 and 7 ----------------------------------
def slot_table(H, P, extra=3, holes=0.25):
    """``(S, slots [H * P] int32 on DEV)``: a random permutation of pool rows ``0 .. S - 1``
    (``S = H * P + extra``), about ``holes`` of the pieces without a slot (``-1``)."""
    S = H * P + extra
    t = torch.randperm(S)[:H * P].to(torch.int32)
    t[torch.rand(H * P) < holes] = -1
    t[0] = -1
    return S, t.to(DEV)


def pool_tensor(S, bs, D, dtype):
    return host_tensor((S, bs, D), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scan", [False, True], ids=["segments", "scan"])
def test_write_kv_through_slots_equals_reference_exactly(seed, dtype, scan):
    """Prefill chunks then decode tokens into a compact pool (random slot permutation, some
    pieces without a slot): pool, summaries and the dropped count bit for bit the reference's;
    every piece with a slot holds what the whole tier holds, the pool rows of no piece are
    untouched, and ``dropped`` counts the (token, KV head) writes to pieces without one."""
    H, D, Dv, bs = 2, 16, 8, 8
    lens = [int(x) for x in torch.randint(1, 5 * bs, (3,))]
    rtt, P = layout([n + 4 for n in lens], bs)
    S, slots = slot_table(H, P)
    hk, hv = pool_tensor(S, bs, D, dtype), pool_tensor(S, bs, Dv, dtype)          # poisoned
    kmin, kmax = torch.randn(P, H, D).to(dtype).to(DEV), torch.randn(P, H, D).to(dtype).to(DEV)
    drop = torch.zeros((), dtype=torch.int64, device=DEV)
    ref = [t.clone() for t in (hk, hv, kmin, kmax, drop)]
    whole = [torch.zeros((H, P, bs, D)).to(dtype), torch.zeros((H, P, bs, Dv)).to(dtype), kmin.clone(), kmax.clone()]
    before = (hk.clone(), hv.clone())
    sl = slots.cpu().long()
    for h in range(H):                             # the whole tier starts as the pool's poison
        for p in range(P):
            if int(sl[h * P + p]) >= 0:
                whole[0][h, p], whole[1][h, p] = hk[int(sl[h * P + p])].cpu(), hv[int(sl[h * P + p])].cpu()
    cut = [int(torch.randint(0, n + 1, ())) for n in lens]
    steps = [[(r, 0, cut[r]) for r in range(3)], [(r, cut[r], lens[r]) for r in range(3)]]
    steps += [[(r, lens[r] + i, lens[r] + i + 1) for r in range(3)] for i in range(4)]
    want_drop = 0
    for si, step in enumerate(steps):
        loc = torch.cat([rtt[r, a:b] for r, a, b in step]).long().to(DEV)
        k, v = torch.randn(loc.numel(), H, D).to(dtype).to(DEV), torch.randn(loc.numel(), H, Dv).to(dtype).to(DEV)
        one = si >= 2
        write_kv(hk, hv, kmin, kmax, loc, k, v, bs, one_token_each=one, scan=scan, slots=slots, dropped=drop)
        REF.write_kv(*ref[:4], loc, k, v, bs, slots=slots, dropped=ref[4])
        REF.write_kv(*whole, loc, k, v, bs)
        pc = (torch.arange(H)[None, :] * P + (loc.cpu() // bs)[:, None])
        want_drop += int((slots.cpu()[pc] < 0).sum())
    if CUDA:
        torch.cuda.synchronize()
    for got, want in zip((hk, hv, kmin, kmax, drop), ref):
        assert torch.equal(got.cpu(), want.cpu())
    assert int(drop) == want_drop > 0
    assert torch.equal(kmin.cpu(), whole[2].cpu()) and torch.equal(kmax.cpu(), whole[3].cpu()), "summaries: all tokens"
    sl = slots.cpu().long()
    for h in range(H):
        for p in range(P):
            r = int(sl[h * P + p])
            if r >= 0:
                assert torch.equal(hk[r].cpu(), whole[0][h, p]) and torch.equal(hv[r].cpu(), whole[1][h, p])
    unused = torch.ones(S, dtype=torch.bool)
    unused[sl[sl >= 0]] = False
    assert torch.equal(hk.cpu()[unused], before[0].cpu()[unused]) and torch.equal(hv.cpu()[unused], before[1].cpu()[unused])


@pytest.mark.parametrize("cap", [None, 1])
def test_plan_transfer_through_slots_equals_reference_exactly(seed, cap):
    """30 steps of random predictions, with a padding row: the kernel with ``slots`` equals the
    reference with ``slots`` exactly (tables, clock, lists, counts, counters, dropped); both
    equal the whole tier's plan with each source mapped through the table and the copies from
    pieces without a slot left out (and counted in ``dropped``, not as copied)."""
    R, H, bs, NB, K = 6, 3, 4, 24, 8
    rows = torch.tensor([2, 0, 5, 3], device=DEV)
    pad = 0
    rtt, P = layout([NB * bs] * R, bs)
    rtt = rtt.to(DEV)
    S, slots = slot_table(H, P)
    sl = slots.cpu().long()

    def fresh():
        return [torch.full((R, H, K), -1, dtype=torch.int64, device=DEV), torch.zeros((R, H, K), dtype=torch.int64, device=DEV),
                torch.zeros(4, dtype=torch.int64, device=DEV), torch.zeros((), dtype=torch.int64, device=DEV)]
    state = [fresh() for _ in range(3)]           # reference + slots, kernel + slots, whole tier
    seq = torch.tensor([9, 14, 3, 30], device=DEV)
    dropped_total = 0
    for step in range(1, 31):
        seq = (seq + torch.randint(0, 2, (4,), device=DEV)).clamp(max=NB * bs)
        nb, nc = (seq + bs - 1) // bs, seq // bs
        scores = torch.randint(-3, 4, (4, H, NB), device=DEV).float()
        wanted, forced = select_blocks(scores, nb, nc, K, 1, 2)
        st = torch.tensor(step, dtype=torch.int64, device=DEV)
        out = []
        for (ids, lru, ctr, drop), fn in zip(state[:2], (REF.plan_transfer, plan_transfer)):
            out.append(fn(ids, lru, rows, wanted, forced, st, cap, seq, rtt, bs, P, ctr, skip_row=pad,
                          slots=slots, dropped=drop))
        ids, lru, ctr, _ = state[2]
        whole = REF.plan_transfer(ids, lru, rows, wanted, forced, st, cap, seq, rtt, bs, P, ctr, skip_row=pad)
        for a, b in zip(*out):
            assert torch.equal(a.cpu(), b.cpu()), step
        for a, b in zip(*state[:2]):
            assert torch.equal(a.cpu(), b.cpu()), step
        assert torch.equal(state[0][0].cpu(), state[2][0].cpu()) and torch.equal(state[0][1].cpu(), state[2][1].cpu())
        dst, src, counts = (t.cpu() for t in out[1])
        wd, ws, wc = (t.cpu() for t in whole)
        for i in range(wd.shape[0]):
            n = int(wc[i])
            keep = sl[ws[i, :n]] >= 0
            m = int(keep.sum())
            dropped_total += n - m
            assert int(counts[i]) == m
            assert torch.equal(dst[i, :m], wd[i, :n][keep]) and torch.equal(src[i, :m], sl[ws[i, :n][keep]])
            assert (dst[i, m:] == -1).all() and (src[i, m:] == -1).all()
    assert int(state[1][3]) == dropped_total > 0
    c_slots, c_whole = state[1][2].cpu(), state[2][2].cpu()
    assert int(c_whole[1] - c_slots[1]) == dropped_total and torch.equal(c_slots[[0, 2]], c_whole[[0, 2]])


@pytest.mark.parametrize("fold", [False, True], ids=["append", "append+fold"])
def test_append_tokens_through_slots_equals_reference_exactly(seed, fold):
    """Completed blocks written back through the slot table: the kernel equals the reference
    exactly; a block with a slot lands in its pool row as the whole tier's piece does, one
    without is written nowhere (``dropped`` += bs, not counted as written back)."""
    R, H, K, bs, D, Dv = 5, 2, 4, 8, 16, 8
    dtype = torch.float32
    rtt, P = layout([K * 2 * bs] * R, bs)
    rtt = rtt.to(DEV)
    S, slots = slot_table(H, P, holes=0.0)
    ids = torch.stack([torch.randperm(2 * K)[:K] for _ in range(R * H)]).view(R, H, K).to(DEV)
    rows = torch.tensor([1, 3, 4, 0, 2], device=DEV)
    blk = ids[rows, 0, torch.randint(0, K, (5,))]
    pos = blk * bs + torch.tensor([bs - 1, 3, bs - 1, bs - 1, 0], device=DEV)
    page0 = int(rtt[1, int(pos[0])]) // bs
    slots[0 * P + page0] = -1                      # batch entry 0's block of KV head 0: no slot
    k, v = torch.randn(5, H, D).to(DEV), torch.randn(5, H, Dv).to(DEV)
    states = []
    for fn, compact in ((REF.append_tokens, True), (append_tokens, True), (REF.append_tokens, False)):
        ws_k = torch.randn(R, H, K, bs, D, generator=torch.Generator().manual_seed(1)).to(DEV)
        ws_v = torch.randn(R, H, K, bs, Dv, generator=torch.Generator().manual_seed(2)).to(DEV)
        if compact:
            hk, hv = pool_tensor(S, bs, D, dtype).zero_(), pool_tensor(S, bs, Dv, dtype).zero_()
        else:
            hk, hv = host_tensor((H, P, bs, D), dtype).zero_(), host_tensor((H, P, bs, Dv), dtype).zero_()
        viol, ctr = torch.zeros((), dtype=torch.int64, device=DEV), torch.zeros(4, dtype=torch.int64, device=DEV)
        drop = torch.zeros((), dtype=torch.int64, device=DEV)
        g = torch.Generator().manual_seed(3)
        kmin = torch.randn(P, H, D, generator=g).to(DEV)
        kmax = kmin + torch.rand(P, H, D, generator=g).to(DEV)
        floc = rtt[rows, pos].long()
        kw = dict(slots=slots, dropped=drop) if compact else {}
        fn(ws_k, ws_v, ids, rows, pos, k, v, hk, hv, rtt, viol, ctr, skip_row=0,
           fold=(kmin, kmax, floc, k) if fold else None, **kw)
        states.append((ws_k, ws_v, hk, hv, viol, ctr, kmin, kmax, drop))
    if CUDA:
        torch.cuda.synchronize()
    for a, b in zip(*states[:2]):
        assert torch.equal(a.cpu(), b.cpu())
    ws_k, ws_v, hk, hv, viol, ctr, kmin, kmax, drop = (t.cpu() for t in states[1])
    w = [t.cpu() for t in states[2]]
    assert torch.equal(ws_k, w[0]) and torch.equal(kmin, w[6]) and torch.equal(kmax, w[7]) and int(viol) == int(w[4])
    # entries 0 and 2 complete their blocks: written back where resident (KV head 0 always), one dropped
    done = [(b, h) for b in (0, 2) for h in range(H) if (ids[int(rows[b]), h] == int(pos[b]) // bs).any()]
    assert int(w[5][3]) == len(done) >= 2 and int(ctr[3]) == len(done) - 1 and int(drop) == bs
    sl = slots.cpu().long()
    for h in range(H):
        for p in range(P):
            r = int(sl[h * P + p])
            if r >= 0:
                assert torch.equal(hk[r], w[2][h, p]) and torch.equal(hv[r], w[3][h, p])
    assert w[2][0, page0].abs().sum() > 0, "the whole tier wrote the piece the compact one dropped"


def test_slot_kernels_refuse_bad_slot_arguments(seed, monkeypatch):
    """``slots`` of the wrong dtype or length, or without ``dropped``, are refused before the
    launch; with ``OASIS_KERNEL_CHECKS=1`` a slot outside the pool raises IndexError naming it."""
    H, D, bs, P, S = 2, 8, 4, 6, 5
    hk, hv = pool_tensor(S, bs, D, torch.float32), pool_tensor(S, bs, D, torch.float32)
    kmin, kmax = torch.zeros(P, H, D, device=DEV), torch.zeros(P, H, D, device=DEV)
    loc, k = torch.arange(3, device=DEV), torch.randn(3, H, D, device=DEV)
    drop = torch.zeros((), dtype=torch.int64, device=DEV)
    good = torch.full((H * P,), -1, dtype=torch.int32, device=DEV)
    for bad, d in ((good.long(), drop), (good[:-1], drop), (good, None)):
        with pytest.raises(AssertionError, match="slots"):
            write_kv(hk, hv, kmin, kmax, loc, k, k, bs, slots=bad, dropped=d)
        with pytest.raises(AssertionError, match="slots"):
            REF.write_kv(hk, hv, kmin, kmax, loc, k, k, bs, slots=bad, dropped=d)
    monkeypatch.setenv("OASIS_KERNEL_CHECKS", "1")
    out = good.clone()
    out[0] = S
    with pytest.raises(IndexError, match="slots"):
        write_kv(hk, hv, kmin, kmax, loc, k, k, bs, slots=out, dropped=drop)


# ---- the engine with the Triton ops equals the engine with the torch references ---------------------
def test_engine_triton_ops_equal_torch_ops(seed):
    cfg = OasisConfig(budget_tokens=64, block_size=8, fetch_cap=2, sink_blocks=1, recent_blocks=1, dense_layers=(0,))
    H, G, D, R = 2, 2, 16, 4
    engines = [OasisSparseKV(cfg, 2, 4096, R, H, D, D, torch.float32, DEV, ops=ops)
               for ops in (TorchKVOps(), get_kv_ops("triton"))]
    lens = [150, 61, 97]
    rtt, _ = layout([n + 40 for n in lens], 8, max_len=512)
    rtt = rtt.to(DEV)
    rows = torch.arange(3, device=DEV)
    ints = lambda *s: torch.randint(-2, 3, s).float().to(DEV)  # noqa: E731  exact scores, no near-ties
    T = sum(lens)
    loc = torch.cat([rtt[r, :n] for r, n in enumerate(lens)]).long()
    k, v = ints(T, H, D), torch.randn(T, H, D, device=DEV)
    for e in engines:
        e.write_kv(1, loc, k, v)
    truth_k, truth_v = torch.zeros(4096, H, D), torch.zeros(4096, H, D)   # every token ever written
    truth_k[loc.cpu()], truth_v[loc.cpu()] = k.cpu(), v.cpu()
    seq = torch.tensor(lens, device=DEV)
    for step in range(24):
        seq = seq + 1
        loc = rtt[rows, seq - 1].long()
        q, kn, vn = ints(3, H * G, D) * 0.25, ints(3, H, D), torch.randn(3, H, D, device=DEV)
        outs = []
        truth_k[loc.cpu()], truth_v[loc.cpu()] = kn.cpu(), vn.cpu()
        for e in engines:
            e.write_kv(1, loc, kn, vn, decode=True)
            e.begin_decode_step(rows, seq, rtt)
            outs.append(e.decode_attention(1, q, kn, vn, None))
        assert torch.equal(engines[0].ws.ids.cpu(), engines[1].ws.ids.cpu()), step
        assert ((outs[0] - outs[1]).norm() / outs[0].norm()).item() < ATTN_RTOL[torch.float32]
    a, b = (e.residency() for e in engines)
    a.pop("exposed_wait_ms"), b.pop("exposed_wait_ms")          # GPU timings, not state
    assert a == b and a["admitted_blocks"] > 0 and a["evicted_blocks"] > 0 and a["bytes_d2h"] > 0
    # decode tokens reached the host tier as whole blocks: every complete block holds exactly its tokens
    for e in engines:
        for r in range(3):
            n = int(seq[r]) // 8 * 8
            locs = rtt[r, :n].long().cpu()
            hk, hv = e.host.read_tokens(0, locs)
            assert torch.equal(hk, truth_k[locs]) and torch.equal(hv, truth_v[locs])


# ---- bad and extreme inputs -------------------------------------------------------------------
def test_infinite_and_nan_scores_never_displace_forced_blocks(seed):
    """+inf / NaN in the query: candidates are clamped, so sink and recent blocks stay first,
    the kernel's ``forced`` flags equal the reference's, and decode keeps its current block."""
    bs = 8
    lens = [200, 77]
    args, nb_max = _topk_case(lens, bs, H=2, G=2, D=16, integer=True)
    q = args[0].clone()
    q[0, :, 0] = float("inf")
    q[1, 1, 3] = float("nan")
    args[0] = q
    got = select_topk(*args, bs, 1, 2, nb_max, 6)
    want = REF.select_topk(*args, bs, 1, 2, nb_max, 6)
    assert torch.equal(got[0].cpu(), want[0].cpu()) and torch.equal(got[1].cpu(), want[1].cpu())
    seq = args[5].cpu()
    for b in range(2):
        last = (int(seq[b]) - 1) // bs
        assert (got[0][b].cpu() == last).any(-1).all() and (got[0][b].cpu() == 0).any(-1).all()


def test_nan_keys_give_the_same_summaries(seed):
    H, D, bs, P = 1, 4, 8, 3
    hk, hv = host_tensor((H, P, bs, D), torch.float32), host_tensor((H, P, bs, D), torch.float32)
    kmin, kmax = torch.zeros(P, H, D, device=DEV), torch.zeros(P, H, D, device=DEV)
    ref = [t.clone() for t in (hk, hv, kmin, kmax)]
    k = torch.randn(3, H, D, device=DEV)
    k[0, 0, 0] = float("nan")
    for i in range(3):      # NaN first, then folded tokens
        loc = torch.tensor([8 + i], device=DEV)
        write_kv(hk, hv, kmin, kmax, loc, k[i:i + 1], k[i:i + 1], bs, one_token_each=True)
        REF.write_kv(*ref, loc, k[i:i + 1], k[i:i + 1], bs)
    for got, want in ((kmin, ref[2]), (kmax, ref[3])):
        torch.testing.assert_close(got.cpu(), want.cpu(), rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(kmin[1, 0, 0]) and not torch.isnan(kmin[1, 0, 1])


# ---- 5. paged_attention: the paired forward's dense and draft layers -----------------------------
def _paged_case(lens, H, G, D, Dv, NQ, dtype, strided_q=False):
    """SGLang-like pool: distinct random token slots per request, ``kv_lens`` = ``lens``."""
    N = sum(lens) + 7
    perm = torch.randperm(N)
    rtt = torch.zeros((len(lens) + 2, max(lens) + 5), dtype=torch.int32)
    rows = torch.randperm(len(lens) + 2)[:len(lens)]
    at = 0
    for b, n in enumerate(lens):
        rtt[rows[b], :n] = perm[at:at + n].int()
        at += n
    k_buf, v_buf = torch.randn(N, H, D).to(dtype), torch.randn(N, H, Dv).to(dtype)
    if strided_q:    # SGLang's q is a view of the fused qkv projection
        q = torch.randn(len(lens), NQ, H * G * D + 3 * D).to(dtype)[..., :H * G * D].view(len(lens), NQ, H * G, D)
    else:
        q = torch.randn(len(lens), NQ, H * G, D).to(dtype)
    return [t.to(DEV) for t in (q, k_buf, v_buf, rtt, rows, torch.tensor(lens))]


@pytest.mark.parametrize("NQ", [1, 2])
def test_paged_attention_reference_is_causal_prefill(seed, NQ):
    """The reference equals SGLang torch_native's causal extend over the last NQ tokens."""
    q, kb, vb, rtt, rows, kv = _paged_case([5, 40, NQ], 2, 3, 16, 16, NQ, torch.float32)
    o = REF.paged_attention(q, kb, vb, rtt, rows, kv, 0.3)
    for b in range(q.shape[0]):
        loc = rtt[rows[b], :int(kv[b])].long()
        want = prefill_attention(q[b], kb[loc], vb[loc], int(kv[b]) - NQ, 0.3)
        torch.testing.assert_close(o[b], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("NQ", [1, 2])
def test_paged_attention_matches_reference(seed, dtype, NQ):
    lens = [NQ, 37, 130, 64]
    q, kb, vb, rtt, rows, kv = _paged_case(lens, 2, 4, 32, 32, NQ, dtype, strided_q=True)
    ro = REF.paged_attention(q.float(), kb.float(), vb.float(), rtt, rows, kv, 0.2)
    for splits, hint in ((None, None), (1, None), (3, None), (None, 512)):
        o = paged_attention(q, kb, vb, rtt, rows, kv, 0.2, max_kv_len=hint, num_splits=splits, block_n=16)
        assert o.dtype == dtype and not torch.isnan(o).any()
        err = ((o.float() - ro).norm() / ro.norm()).item()
        assert err < ATTN_RTOL[dtype], (splits, hint, err)
    assert paged_attention(q[:0], kb, vb, rtt, rows[:0], kv[:0], 0.2).shape == (0, NQ, 8, 32)


def test_paged_attention_through_kv_ops(seed):
    """``get_kv_ops('triton').paged_attention`` is the kernel; Qwen-like GQA (G=4), D=128."""
    q, kb, vb, rtt, rows, kv = _paged_case([300, 17], 2, 4, 128, 128, 2, torch.float32)
    o = get_kv_ops("triton").paged_attention(q, kb, vb, rtt, rows, kv, None, max_kv_len=300)
    ro = REF.paged_attention(q, kb, vb, rtt, rows, kv, None)
    assert ((o - ro).norm() / ro.norm()).item() < ATTN_RTOL[torch.float32]


def test_index_checks_name_the_argument(monkeypatch):
    monkeypatch.setenv("OASIS_KERNEL_CHECKS", "1")
    hk, hv = host_tensor((1, 4, 8, 4), torch.float32), host_tensor((1, 4, 8, 4), torch.float32)
    kmin = torch.zeros(4, 1, 4, device=DEV)
    k = torch.randn(2, 1, 4, device=DEV)
    with pytest.raises(IndexError, match="loc"):
        write_kv(hk, hv, kmin, kmin.clone(), torch.tensor([3, 32], device=DEV), k, k, 8)
    dst = torch.zeros(4, 8, device=DEV)
    with pytest.raises(IndexError, match="dst_idx"):
        copy_blocks(dst, dst.clone(), torch.tensor([0, 4], device=DEV), dst.clone(), dst.clone(), torch.tensor([0, 1], device=DEV))
    with pytest.raises(IndexError, match="src_idx"):
        copy_blocks(dst, dst.clone(), torch.tensor([0, 1], device=DEV), dst.clone(), dst.clone(), torch.tensor([0, 4], device=DEV))
    q, kb, vb, rtt, rows, kv = _paged_case([4, 9], 1, 2, 16, 16, 2, torch.float32)
    with pytest.raises(IndexError, match="kv_lens"):
        paged_attention(q, kb, vb, rtt, rows, torch.tensor([1, 9], device=DEV), None)
    bad = rtt.clone()
    bad[rows[1], 3] = 10**6
    with pytest.raises(IndexError, match="req_to_token"):
        paged_attention(q, kb, vb, bad, rows, torch.tensor([4, 9], device=DEV), None)
    with pytest.raises(IndexError, match="kv_lens"):      # the reference checks always
        REF.paged_attention(q, kb, vb, rtt, rows, torch.tensor([4, rtt.shape[1] + 1], device=DEV), None)
    with pytest.raises(AssertionError, match="contiguous"):
        paged_attention(q, kb, vb, rtt, torch.stack([rows, rows], 1)[:, 0], torch.tensor([4, 9], device=DEV), None)


# ---- 2b. scoring int8 summaries (an experiment, issue 17: core.summaries.quantize_outward) ----------
@pytest.mark.parametrize("sink,recent,k", [(1, 2, 6), (0, 1, 40)])
def test_int8_summaries_topk_exact_on_integer_scores(seed, sink, recent, k):
    """Levels, queries and a power-of-two scale: every product and sum is exact, so the kernel's
    selection equals the reference over the dequantized summaries exactly (ties included)."""
    bs, H, G, D = 8, 2, 3, 16
    lens = [int(x) for x in torch.randint(1, 30 * bs, (4,))] + [bs * 7]
    (q, kmin, _, rtt, rows, seq), nb_max = _topk_case(lens, bs, H=H, G=G, D=D, integer=True)
    P = kmin.shape[0]
    a, b = torch.randint(-100, 101, (P, H, D)), torch.randint(-100, 101, (P, H, D))
    lo, hi = torch.minimum(a, b).to(torch.int8).to(DEV), torch.maximum(a, b).to(torch.int8).to(DEV)
    scale = (2.0 ** torch.randint(-3, 2, (P, H))).to(DEV)
    got = select_topk(q, lo, hi, rtt, rows, seq, bs, sink, recent, nb_max, k, kscale=scale)
    want = REF.select_topk(q, dequantize(lo, scale), dequantize(hi, scale), rtt, rows, seq, bs, sink, recent, nb_max, k)
    assert torch.equal(got[0].cpu(), want[0].cpu()) and torch.equal(got[1].cpu(), want[1].cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_summaries_scores_match_the_reference(seed, dtype):
    bs, H, G, D = 16, 2, 4, 64
    lens = [int(x) for x in torch.randint(bs, 50 * bs, (3,))]
    (q, kmin, kmax, rtt, rows, seq), nb_max = _topk_case(lens, bs, H, G, D, integer=False, dtype=torch.float32)
    lo, hi, scale = quantize_outward(kmin, kmax, "int8")
    q = q.to(dtype)
    keys = block_keys(q, lo, hi, rtt, rows, seq, bs, 0, 1, nb_max, kscale=scale)
    hi32 = (keys >> 32).cpu()
    bits = torch.where(hi32 < 0, hi32 ^ 0x7FFFFFFF, hi32).to(torch.int32).view(torch.float32)
    pages = block_pages(rtt, rows, nb_max, bs).cpu()
    want = quest_scores(q.cpu(), dequantize(lo, scale).cpu()[pages], dequantize(hi, scale).cpu()[pages])
    nc = (seq // bs).cpu()
    j = torch.arange(nb_max)[None, None, :].expand(len(lens), H, nb_max)
    cand = j < nc[:, None, None] - 1
    assert torch.allclose(bits[cand], want[cand], rtol=1e-5, atol=1e-4)
    with pytest.raises(AssertionError):                     # levels must be int8 with a float32 scale
        block_keys(q, kmin, kmax, rtt, rows, seq, bs, 0, 1, nb_max, kscale=scale)
