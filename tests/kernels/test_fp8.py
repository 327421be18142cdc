"""fp8 KV cache (``--kv-cache-dtype fp8_e4m3 / fp8_e5m2``): the Triton kernels with an fp8 host
tier and working set against their torch references (``core.ops.TorchKVOps``), and the engine
with an fp8 KV cache against attention over the values such a cache holds.

Exact for writes, copies and summaries; the attention tolerance table of test_kernels.py. On a
CPU host the kernels run under the Triton interpreter, whose float -> fp8 conversion does not
round as torch does (1-6% of random values come out wrong: a value whose mantissa rounds up
past the next power of two gets half of it, e.g. 0.4950 -> 0.25 instead of 0.5; the GPU rounds
to nearest even, as torch): there the tests that convert in a kernel feed values that fp8 holds
exactly, so the conversion is the identity on both sides.
"""

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("no CUDA and TRITON_INTERPRET is not set (conftest.py sets it)", allow_module_level=True)

from oasis_sglang.config import OasisConfig  # noqa: E402
from oasis_sglang.core import OasisSparseKV  # noqa: E402
from oasis_sglang.core.attention import decode_attention  # noqa: E402
from oasis_sglang.core.kv_dtype import as_stored, summary_dtype  # noqa: E402
from oasis_sglang.core.ops import TorchKVOps  # noqa: E402
from oasis_sglang.kernels import get_kv_ops  # noqa: E402
from oasis_sglang.kernels.append_tokens import append_tokens  # noqa: E402
from oasis_sglang.kernels.copy_blocks import copy_blocks  # noqa: E402
from oasis_sglang.kernels.paged_attention import paged_attention  # noqa: E402
from oasis_sglang.kernels.sparse_decode import sparse_decode_attention  # noqa: E402
from oasis_sglang.kernels.write_kv import write_kv  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
pytestmark = [pytest.mark.gpu] if CUDA else []
REF = TorchKVOps()
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
ATTN_RTOL = {torch.float32: 3e-3, torch.bfloat16: 2e-2}


def vals(shape, dtype, kv_dtype, scale=1.0):
    """Random values in ``dtype``; on the interpreter ones ``kv_dtype`` holds exactly (module docstring)."""
    x = (torch.randn(shape) * scale).to(dtype)
    return x if CUDA else as_stored(x, kv_dtype)


def host(shape, dtype):
    t = torch.randn(shape).to(dtype)
    return t.pin_memory() if CUDA else t


def same(a, b):
    return torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8)) if a.dtype in FP8 else torch.equal(a.cpu(), b.cpu())


@pytest.mark.parametrize("kv", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scan", [False, True], ids=["segments", "scan"])
def test_write_kv_fp8_host_tier_and_model_dtype_summaries(seed, kv, dtype, scan):
    """Prefill chunks then decode tokens: the host tier holds ``k.to(fp8)``, the summaries (in the
    model's dtype) are the exact min / max of the fp8 values, kernel == reference."""
    H, D, Dv, bs, P = 2, 32, 24, 8, 12
    hk, hv = host((H, P, bs, D), kv), host((H, P, bs, Dv), kv)
    kmin, kmax = torch.randn(P, H, D).to(dtype).to(DEV), torch.randn(P, H, D).to(dtype).to(DEV)
    ref = [t.clone() for t in (hk, hv, kmin, kmax)]
    loc_all = torch.randperm(P)[:5].repeat_interleave(bs) * bs + torch.arange(bs).repeat(5)
    for a, b in ((0, 13), (13, 29), (29, 30), (30, 31), (31, 40)):
        loc = loc_all[a:b].to(DEV)
        k, v = vals((b - a, H, D), dtype, kv).to(DEV), vals((b - a, H, Dv), dtype, kv).to(DEV)
        write_kv(hk, hv, kmin, kmax, loc, k, v, bs, one_token_each=b - a == 1, scan=scan)
        REF.write_kv(*ref, loc, k, v, bs)
    if CUDA:
        torch.cuda.synchronize()
    for got, want in zip((hk, hv, kmin, kmax), ref):
        assert got.dtype == want.dtype and same(got, want)
    assert hk.dtype == kv and kmin.dtype == dtype
    for p in (loc_all[::bs] // bs).tolist():
        block = hk[:, p].to(dtype)                                      # [H, bs, D] as the tier holds it
        assert torch.equal(kmin[p].cpu(), block.amin(1).cpu()) and torch.equal(kmax[p].cpu(), block.amax(1).cpu())


@pytest.mark.parametrize("kv", FP8)
def test_copy_blocks_moves_fp8_pieces_exactly(seed, kv):
    Ns, Nd, M, piece = 30, 20, 11, 16 * 32
    sk, sv = host((Ns, piece), kv), host((Ns, piece), kv)
    dk, dv = torch.randn(Nd, piece).to(kv).to(DEV), torch.randn(Nd, piece).to(kv).to(DEV)
    si, di = torch.randint(0, Ns, (M,)), torch.randperm(Nd)[:M]
    want_k, want_v = dk.cpu().clone(), dv.cpu().clone()
    want_k[di], want_v[di] = sk.cpu()[si], sv.cpu()[si]
    copy_blocks(dk, dv, di.to(DEV), sk, sv, si.to(DEV))
    if CUDA:
        torch.cuda.synchronize()
    assert same(dk, want_k) and same(dv, want_v)


@pytest.mark.parametrize("fold", [False, True], ids=["append", "append+fold"])
@pytest.mark.parametrize("kv", FP8)
def test_append_tokens_fp8_equals_reference_exactly(seed, kv, fold):
    """``fold``: the keys folded into bf16 summaries as the fp8 tier holds them (rounded)."""
    R, H, K, bs, D, Dv, P = 4, 2, 4, 8, 16, 8, 40
    ids = torch.stack([torch.randperm(8)[:K] for _ in range(R * H)]).view(R, H, K).to(DEV)
    rows = torch.tensor([1, 3, 2], device=DEV)
    blk = ids[rows, 0, 0]
    pos = blk * bs + torch.tensor([bs - 1, 3, bs - 1], device=DEV)         # two complete their block
    rtt = (torch.randperm(P)[:8].repeat_interleave(bs) * bs + torch.arange(bs).repeat(8)).int()
    rtt = rtt[None].expand(R, -1).contiguous().to(DEV)
    k, v = vals((3, H, D), torch.bfloat16, kv).to(DEV), vals((3, H, Dv), torch.bfloat16, kv).to(DEV)
    states = []
    for fn in (REF.append_tokens, append_tokens):
        g = torch.Generator().manual_seed(seed)
        ws_k = torch.randn(R, H, K, bs, D, generator=g).to(kv).to(DEV)
        ws_v = torch.randn(R, H, K, bs, Dv, generator=g).to(kv).to(DEV)
        hk, hv = host((H, P, bs, D), kv).zero_(), host((H, P, bs, Dv), kv).zero_()
        viol, ctr = torch.zeros((), dtype=torch.int64, device=DEV), torch.zeros(4, dtype=torch.int64, device=DEV)
        kmin = torch.randn(P, H, D, generator=g).to(torch.bfloat16).to(DEV)
        kmax = (kmin.float() + 1).to(torch.bfloat16)
        fn(ws_k, ws_v, ids, rows, pos, k, v, hk, hv, rtt, viol, ctr,
           fold=(kmin, kmax, rtt[rows, pos].long(), k) if fold else None)
        states.append((ws_k, ws_v, hk, hv, viol, ctr, kmin, kmax))
    if CUDA:
        torch.cuda.synchronize()
    for a, b in zip(*states):
        assert same(a, b)
    assert int(states[1][5][3]) > 0 and states[1][2].float().abs().sum() > 0, "blocks were written back"


def _ws(B, H, G, KS, bs, D, kv, qdtype, NQ):
    R = B + 1
    ws_k, ws_v = torch.randn(R, H, KS, bs, D).to(kv), torch.randn(R, H, KS, bs, D).to(kv)
    ids = torch.full((R, H, KS), -1, dtype=torch.int64)
    rows = torch.randperm(R)[:B]
    seq = torch.randint(bs, KS * bs, (B,))
    for b in range(B):
        nb = -(-int(seq[b]) // bs)
        for h in range(H):
            ids[rows[b], h, torch.randperm(KS)[:nb]] = torch.randperm(nb)
    q = torch.randn(B, NQ, H * G, D).to(qdtype)
    return [t.to(DEV) for t in (q, ws_k, ws_v, ids, rows, seq)]


@pytest.mark.parametrize("kv", FP8)
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("NQ", [1, 2])
def test_sparse_decode_attention_reads_an_fp8_working_set(seed, kv, qdtype, NQ):
    """Kernel over the fp8 working set vs the reference over the same values in fp32."""
    B, H, G, KS, bs, D = 3, 2, 2, 6, 8, 32
    q, ws_k, ws_v, ids, rows, seq = _ws(B, H, G, KS, bs, D, kv, qdtype, NQ)
    kx = vx = None
    if NQ == 2:     # the draft token's own K/V: as the cache would hold them (the engine's as_stored)
        kx, vx = as_stored(torch.randn(B, H, D, device=DEV).to(qdtype), kv), as_stored(torch.randn(B, H, D, device=DEV).to(qdtype), kv)
    o, _ = sparse_decode_attention(q, ws_k, ws_v, ids, rows, seq, 0.2, kx, vx, num_splits=2, block_n=16)
    ro, _ = REF.sparse_decode_attention(q.float(), ws_k.float(), ws_v.float(), ids, rows, seq, 0.2,
                                        None if kx is None else kx.float(), None if vx is None else vx.float())
    rf, _ = REF.sparse_decode_attention(q, ws_k, ws_v, ids, rows, seq, 0.2, kx, vx)     # the reference on fp8
    assert o.dtype == qdtype and rf.dtype == qdtype and not torch.isnan(o).any()
    assert ((o.float() - ro).norm() / ro.norm()).item() < ATTN_RTOL[qdtype]
    assert ((rf.float() - ro).norm() / ro.norm()).item() < ATTN_RTOL[qdtype]


@pytest.mark.parametrize("kv", FP8)
def test_paged_attention_reads_sglangs_fp8_pool(seed, kv):
    """The paired forward's dense / draft layers over SGLang's fp8 pool (``get_key_buffer``'s fp8 view)."""
    H, G, D, NQ, lens = 2, 2, 32, 2, [40, 9, 70]
    N = sum(lens) + 5
    kb, vb = torch.randn(N, H, D).to(kv).to(DEV), torch.randn(N, H, D).to(kv).to(DEV)
    rtt = torch.zeros((3, 80), dtype=torch.int32)
    perm, at = torch.randperm(N), 0
    for r, n in enumerate(lens):
        rtt[r, :n] = perm[at:at + n].int()
        at += n
    rtt, rows, kvl = rtt.to(DEV), torch.arange(3, device=DEV), torch.tensor(lens, device=DEV)
    q = torch.randn(3, NQ, H * G, D).to(torch.bfloat16).to(DEV)
    o = paged_attention(q, kb, vb, rtt, rows, kvl, 0.2, max_kv_len=80, block_n=16)
    ro = REF.paged_attention(q.float(), kb.float(), vb.float(), rtt, rows, kvl, 0.2)
    assert o.dtype == torch.bfloat16 and ((o.float() - ro).norm() / ro.norm()).item() < ATTN_RTOL[torch.bfloat16]


@pytest.mark.parametrize("kv", FP8)
@pytest.mark.parametrize("ops", ["torch", "triton"])
def test_engine_with_an_fp8_cache_attends_what_the_cache_holds(seed, kv, ops):
    """A budget covering the context: prefill and 12 decode steps of an fp8 engine equal dense
    attention over ``as_stored`` K/V (what SGLang's fp8 pool holds); half the host bytes of bf16."""
    cfg = OasisConfig(budget_tokens=256, block_size=8, fetch_cap=2, sink_blocks=1, recent_blocks=1, dense_layers=(0,))
    H, G, D, R, dt = 2, 2, 16, 4, torch.float32
    e = OasisSparseKV(cfg, 2, 1024, R, H, D, D, kv, DEV, ops=TorchKVOps() if ops == "torch" else get_kv_ops("triton"),
                      compute_dtype=dt)
    e16 = OasisSparseKV(cfg, 2, 1024, R, H, D, D, torch.bfloat16, DEV)
    assert e.host.k[0].dtype == e.ws.k[0].dtype == kv and e.summaries.kmin[0].dtype == dt
    assert 2 * e.host.nbytes == e16.host.nbytes and 2 * e.block_bytes == e16.block_bytes
    lens = [37, 60]
    rows = torch.tensor([1, 2], device=DEV)
    rtt = torch.zeros((R, 128), dtype=torch.int32)
    rtt[1], rtt[2] = torch.arange(128), torch.arange(128, 256)
    rtt = rtt.to(DEV)
    k_all, v_all = vals((2, 128, H, D), dt, kv).to(DEV), vals((2, 128, H, D), dt, kv).to(DEV)
    q = torch.randn(sum(lens), H * G, D, device=DEV)
    loc = torch.cat([rtt[1, :lens[0]], rtt[2, :lens[1]]]).long()
    k0 = torch.cat([k_all[0, :lens[0]], k_all[1, :lens[1]]])
    v0 = torch.cat([v_all[0, :lens[0]], v_all[1, :lens[1]]])
    e.write_kv(1, loc, k0, v0)
    out = e.extend_attention(1, q, rows, torch.zeros(2, dtype=torch.long), torch.tensor(lens), rtt, None, k0, v0)
    from oasis_sglang.core.attention import prefill_attention
    want = torch.cat([prefill_attention(q[:37], as_stored(k0[:37], kv), as_stored(v0[:37], kv), 0, None),
                      prefill_attention(q[37:], as_stored(k0[37:], kv), as_stored(v0[37:], kv), 0, None)])
    assert torch.equal(out, want) if ops == "torch" else ((out - want).norm() / want.norm()).item() < ATTN_RTOL[dt]
    seq = torch.tensor(lens, device=DEV)
    for step in range(12):
        seq = seq + 1
        loc = rtt[rows, seq - 1].long()
        kn, vn = k_all[[0, 1], seq - 1], v_all[[0, 1], seq - 1]
        qn = torch.randn(2, H * G, D, device=DEV)
        e.write_kv(1, loc, kn, vn, decode=True)
        e.begin_decode_step(rows, seq, rtt)
        o = e.decode_attention(1, qn, kn, vn, None)
        for b in range(2):
            n = int(seq[b])
            w = decode_attention(qn[b], as_stored(k_all[b, :n], kv), as_stored(v_all[b, :n], kv), None)
            err = ((o[b] - w).norm() / w.norm()).item()
            assert (torch.equal(o[b], w) if ops == "torch" else err < ATTN_RTOL[dt]), (step, b, err)
    r = e.residency()                    # raises on a token whose block was not resident
    assert r["bytes_d2h"] > 0 and r["bytes_d2h"] % e.block_bytes == 0, "completed blocks written back in fp8"


def test_fp8_needs_the_model_dtype_for_the_summaries():
    cfg = OasisConfig(budget_tokens=64, block_size=8, dense_layers=(0,))
    with pytest.raises(ValueError, match="compute_dtype"):
        OasisSparseKV(cfg, 2, 256, 2, 2, 16, 16, torch.float8_e4m3fn, "cpu")
    with pytest.raises(ValueError, match="compute_dtype"):
        summary_dtype(torch.bfloat16, torch.float8_e5m2)
    plan = OasisSparseKV.memory_plan(cfg, 2, 256, 2, 2, 16, 16, dtype_bytes=1, summary_dtype_bytes=2)
    plan16 = OasisSparseKV.memory_plan(cfg, 2, 256, 2, 2, 16, 16, dtype_bytes=2)
    assert 2 * plan["host_tier"] == plan16["host_tier"] and 2 * plan["working_set"] == plan16["working_set"]
    assert plan["summaries"] == plan16["summaries"]
