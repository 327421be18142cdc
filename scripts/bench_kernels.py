"""Benchmark the OasisKV Triton kernels on a CUDA GPU and print one table.

    python scripts/bench_kernels.py [--out results.md] [--layers 36] [--only paired|plan|scoring|attention]

Method (the device entry's METHOD.md): the byte floor of each kernel is stated first (every
input read once, every output written once); ceilings are measured here first (HBM device copy,
pinned host<->device copy); kernels are timed with CUDA events (``triton.testing.do_bench``,
median of many runs after warm-up) on inputs larger than L2 and never on zeros.
Columns: kernel, shape, time, bytes, achieved GB/s, % of the ceiling it is bound by, target.
Shapes follow issue 3: Qwen3-8B-like attention (32 q / 8 KV heads, head_dim 128, bf16,
blocks of 16 tokens = 4 KiB per (KV head, block) piece).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
import triton
from tqdm import tqdm

from oasis_sglang.kernels.copy_blocks import copy_blocks
from oasis_sglang.kernels.paged_attention import paged_attention
from oasis_sglang.kernels.sparse_decode import _capability, default_block_n, sparse_decode_attention
from oasis_sglang.kernels.topk import block_keys, select_topk, topk_from_keys
from oasis_sglang.kernels.write_kv import write_kv

H, G, D, BS = 8, 4, 128, 16
DT = torch.bfloat16
E = 2  # bytes per element


def bench(fn, rep=200):
    """Median milliseconds of ``fn`` (CUDA events, after warm-up)."""
    return triton.testing.do_bench(fn, warmup=50, rep=rep, return_mode="median")


def bench_graph(fn, calls: int = 20):
    """Median milliseconds of one ``fn`` call replayed from a CUDA graph of ``calls`` calls.

    Graph replay removes the host-side launch cost, so this is the GPU time of the kernels.
    Returns ``None`` when ``fn`` cannot be captured (it synchronises with the host).
    """
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
        return bench(g.replay) / calls
    except Exception as e:  # noqa: BLE001
        print(f"not capturable: {e.__class__.__name__}: {str(e)[:120]}", file=sys.stderr)
        torch.cuda.synchronize()
        return None


def ceilings() -> dict:
    """Measured GB/s: HBM copy (read + write counted), pinned H2D and D2H copies."""
    n = 1 << 30
    a = torch.randn(n // 2, device="cuda", dtype=DT)
    b = torch.empty_like(a)
    hbm = 2 * n / bench(lambda: b.copy_(a)) / 1e6
    h = torch.randn(n // 2, dtype=DT).pin_memory()
    h2d = n / bench(lambda: b.copy_(h, non_blocking=True), rep=100) / 1e6
    d2h = n / bench(lambda: h.copy_(b, non_blocking=True), rep=100) / 1e6
    return {"hbm": hbm, "h2d": h2d, "d2h": d2h}


def sglang_decode(B: int, ctx: int, splits: int):
    """SGLang 0.5.17's triton decode kernel on a dense ``ctx``-token context (page size 1).

    Returns ``(fn, bytes)`` or ``None`` when SGLang is not importable here.
    """
    try:
        from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
    except Exception as e:  # noqa: BLE001
        print(f"SGLang triton decode kernel unavailable: {e}", file=sys.stderr)
        return None
    N = B * ctx
    k = torch.randn(N, H, D, device="cuda", dtype=DT)
    v = torch.randn(N, H, D, device="cuda", dtype=DT)
    q = torch.randn(B, H * G, D, device="cuda", dtype=DT)
    o = torch.empty_like(q)
    indptr = torch.arange(0, N + 1, ctx, device="cuda", dtype=torch.int32)
    indices = torch.randperm(N, device="cuda").int()
    logits = torch.empty(B, H * G, splits, D, device="cuda", dtype=torch.float32)
    lse = torch.empty(B, H * G, splits, device="cuda", dtype=torch.float32)
    nsp = torch.full((B,), splits, device="cuda", dtype=torch.int32)

    def fn():
        decode_attention_fwd(q, k, v, o, indptr, indices, logits, lse, nsp, splits, 1 / math.sqrt(D), 1.0, 1.0)

    return fn, 2 * N * H * D * E


def paired_case(B: int, ctx: int):
    """The paired forward's dense / draft layer: 2 new tokens per request on a ``ctx``-token
    context (page size 1, random slots), as OasisKV (``paged_attention``) and SGLang's verify
    (``extend_attention_fwd``, prefix from the pool + the 2 new tokens) and SGLang's
    AMD-only split-KV verify (``verify_splitkv_fwd``, NVIDIA-safe) see it.

    Returns ``{name: fn}`` (SGLang's entries only when SGLang is importable) and the bytes read.
    """
    N = B * ctx
    k = torch.randn(N, H, D, device="cuda", dtype=DT)
    v = torch.randn(N, H, D, device="cuda", dtype=DT)
    perm = torch.randperm(N, device="cuda")
    rtt = perm.view(B, ctx).int().contiguous()
    rows = torch.arange(B, device="cuda")
    kv = torch.full((B,), ctx, device="cuda", dtype=torch.int64)
    q2 = torch.randn(B, 2, H * G, D, device="cuda", dtype=DT)
    fns = {"oasis": lambda: paged_attention(q2, k, v, rtt, rows, kv, None, max_kv_len=ctx)}
    try:
        from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
        from sglang.kernels.ops.attention.verify_splitkv import verify_splitkv_fwd
    except Exception as e:  # noqa: BLE001
        print(f"SGLang extend kernel unavailable: {e}", file=sys.stderr)
        return fns, 2 * N * H * D * E
    qf = q2.view(2 * B, H * G, D)
    prefix = rtt[:, :ctx - 2].reshape(-1).long()
    new = rtt[:, ctx - 2:].reshape(-1).long()
    kx, vx = k[new].contiguous(), v[new].contiguous()
    o = torch.empty_like(qf)
    qo = torch.arange(0, 2 * B + 1, 2, device="cuda", dtype=torch.int32)
    kvp = torch.arange(0, B * (ctx - 2) + 1, ctx - 2, device="cuda", dtype=torch.int32)
    sc = 1 / math.sqrt(D)
    args = (qf, kx, vx, o, k, v, qo, kvp, prefix, None, True, None, 2, 1.0, 1.0, sc)
    fns["sglang_extend"] = lambda: extend_attention_fwd(*args)
    fns["sglang_splitkv"] = lambda: verify_splitkv_fwd(*args)
    return fns, 2 * N * H * D * E


def ws_case(B: int, K: int, full: bool = True, dev: str = "cuda"):
    """A working set with every slot resident (``K`` blocks per (request, KV head))."""
    R = B
    ws_k = torch.randn(R, H, K, BS, D, device=dev, dtype=DT)
    ws_v = torch.randn(R, H, K, BS, D, device=dev, dtype=DT)
    ids = torch.stack([torch.randperm(4 * K, device=dev)[:K] for _ in range(R * H)]).view(R, H, K)
    seq = torch.full((B,), 4 * K * BS, device=dev, dtype=torch.int64)
    q = torch.randn(B, 1, H * G, D, device=dev, dtype=DT)
    rows = torch.arange(B, device=dev)
    return q, ws_k, ws_v, ids, rows, seq


def paired_section(add, rows, raw):
    """4. The paired forward's dense layers and draft layer: 2 rows over the whole context, vs
    the plain step's 1-row SGLang decode kernel (the <= 1.15x target) and SGLang's verify kernels."""
    for B, ctx in ((8, 16384), (32, 16384), (16, 32768)):
        fns, nbytes = paired_case(B, ctx)
        best, best_s = None, None
        for splits in (8, 16, 32):
            d = sglang_decode(B, ctx, splits)
            if d is not None:
                t = bench_graph(d[0])
                if best is None or t < best:
                    best, best_s = t, splits
                del d
        shape = f"B={B}, {ctx // 1024}K context"
        if best is not None:
            d = sglang_decode(B, ctx, best_s)
            add("SGLang triton decode (plain step, 1 row)", shape + f" ({best_s} splits)", d[0], nbytes, "hbm")
            del d
        ms_p = add("paged_attention (paired: 2 rows)", shape, fns["oasis"], nbytes, "hbm",
                   extra="" if best is None else "paired/plain GPU time = {r}x (target <= 1.15x)")
        if best is not None:
            rows[-1] = rows[-1][:9] + (rows[-1][9].replace("{r}", f"{ms_p / best:.2f}"),)
            raw[f"paired_over_plain_B{B}_{ctx}"] = ms_p / best
        for name, label in (("sglang_extend", "SGLang verify today (extend kernel, 2 rows)"),
                            ("sglang_splitkv", "SGLang split-KV verify (AMD-only path, 2 rows)")):
            if name in fns:
                try:
                    t = add(label, shape, fns[name], nbytes, "hbm")
                    if best is not None:
                        raw[f"{name}_over_plain_B{B}_{ctx}"] = t / best
                except Exception as e:  # noqa: BLE001
                    print(f"{label}: {e.__class__.__name__}: {str(e)[:200]}", file=sys.stderr)
        del fns
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the table (markdown) and raw numbers (.json) here")
    ap.add_argument("--layers", type=int, default=36, help="layers per decode step (Qwen3-8B: 36)")
    ap.add_argument("--only", choices=["paired", "plan", "scoring", "attention"], default=None,
                    help="paired: only the paired-forward section (dense and draft layers, 2 rows); plan: only "
                         "the admission plan, step budget and churn replay kernels; scoring: only block scoring "
                         "with bf16 vs int8 summaries (an issue-17 experiment); attention: the sparse decode "
                         "attention's launch parameters swept at the served batch sizes")
    ap.add_argument("--weights-gb", type=float, default=16.4, help="weight bytes read per decode step (GB)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    rows, raw = [], {}
    steps = tqdm(total=6, desc="bench_kernels", file=sys.stderr)
    ceil = ceilings()
    raw["ceilings_GBps"] = ceil
    steps.update()

    def add(kernel, shape, fn_or_ms, nbytes, bound, target="", extra="", graph=True):
        """Time ``fn`` eagerly and from a CUDA graph; GB/s from the GPU (graph) time when there is one."""
        if callable(fn_or_ms):
            eager = bench(fn_or_ms)
            gpu = bench_graph(fn_or_ms) if graph else None
        else:
            eager, gpu = fn_or_ms, None
        ms = gpu if gpu is not None else eager
        gbs = nbytes / ms / 1e6
        rows.append((kernel, shape, eager * 1e3, gpu * 1e3 if gpu else float("nan"), nbytes / 2**20, gbs,
                     100 * gbs / ceil[bound], bound, target, extra))
        return ms

    if args.only == "paired":
        paired_section(add, rows, raw)
        steps.close()
        return finish(rows, raw, ceil, args.out)
    if args.only == "plan":
        plan_section(add, raw)
        steps.close()
        return finish(rows, raw, ceil, args.out)
    if args.only == "attention":
        for B in (40, 43, 8, 120):
            attention_section(add, raw, B)
        steps.close()
        return finish(rows, raw, ceil, args.out)
    if args.only == "scoring":
        for B, ctx in ((40, 16384), (20, 32768), (64, 32768)):
            scoring_section(add, raw, B, ctx)
        steps.close()
        return finish(rows, raw, ceil, args.out)

    # 4. H2D gather and D2H write-back of 4 KiB pieces (one launch for K and V)
    P, M = 32768, 8192
    hk = torch.randn(H * P, BS * D, dtype=DT).pin_memory()
    hv = torch.randn(H * P, BS * D, dtype=DT).pin_memory()
    wk = torch.randn(4 * M, BS * D, device="cuda", dtype=DT)
    wv = torch.randn(4 * M, BS * D, device="cuda", dtype=DT)
    src_i, dst_i = torch.randperm(H * P, device="cuda")[:M], torch.randperm(4 * M, device="cuda")[:M]
    nbytes = 2 * M * BS * D * E
    add("copy_blocks H2D (gather)", f"{M} x 2 random pieces of 4 KiB", lambda: copy_blocks(wk, wv, dst_i, hk, hv, src_i),
        nbytes, "h2d", ">= 49 GB/s")
    add("copy_blocks D2H (write-back)", f"{M} x 2 random pieces of 4 KiB", lambda: copy_blocks(hk, hv, src_i, wk, wv, dst_i),
        nbytes, "d2h")
    m64 = 64 // 16 * H         # a decode step of 64 requests completes ~4 blocks x 8 KV heads per layer
    add("copy_blocks D2H (write-back)", f"{m64} x 2 pieces (decode step, 64 req)",
        lambda: copy_blocks(hk, hv, src_i[:m64], wk, wv, dst_i[:m64]), 2 * m64 * BS * D * E, "d2h")
    raw["pinned_host_GiB"] = 2 * hk.numel() * E / 2**30
    steps.update()

    # 1. summaries (+ host-tier write for prefill): a decode batch (one token each), a 16K prefill
    hk4, hv4 = hk.view(H, P, BS, D), hv.view(H, P, BS, D)
    kmin = torch.randn(P, H, D, device="cuda", dtype=DT)
    kmax = torch.randn(P, H, D, device="cuda", dtype=DT)
    n = 64
    loc = torch.randperm(P, device="cuda")[:n] * BS + torch.randint(0, BS, (n,), device="cuda")
    k = torch.randn(n, H, D, device="cuda", dtype=DT)
    add("write_kv (summaries only)", "decode, 64 requests (tokens go to the working set)",
        lambda: write_kv(hk4, hv4, kmin, kmax, loc, k, k, BS, one_token_each=True, write_host=False),
        2 * n * H * D * E, "hbm")
    add("write_kv (host tier + summaries)", "64 single tokens (256 B host pieces; not used in decode)",
        lambda: write_kv(hk4, hv4, kmin, kmax, loc, k, k, BS, one_token_each=True), 2 * n * H * D * E, "d2h")
    n = 16384
    loc = torch.arange(n, device="cuda") + BS * 7
    k = torch.randn(n, H, D, device="cuda", dtype=DT)
    add("write_kv (host tier + summaries)", "prefill, 16384 tokens", lambda: write_kv(hk4, hv4, kmin, kmax, loc, k, k, BS),
        2 * n * H * D * E, "d2h", graph=False)
    hk = hv = hk4 = hv4 = wk = wv = None    # free the pinned tier (the lambdas above are done with them)
    steps.update()

    # 2. scoring + top-K: 64 requests x 32K context x 8 KV heads, one layer; x layers per step
    B, ctx, K = 64, 32768, 128
    nb = ctx // BS
    Pp = B * nb
    smin = torch.randn(Pp, H, D, device="cuda", dtype=DT)
    smax = smin + torch.rand(Pp, H, D, device="cuda", dtype=DT)
    rtt = (torch.randperm(Pp, device="cuda").view(B, nb)[:, :, None] * BS
           + torch.arange(BS, device="cuda")).view(B, ctx).int()
    qs = torch.randn(B, H * G, D, device="cuda", dtype=DT)
    rws = torch.arange(B, device="cuda")
    seq = torch.full((B,), ctx, device="cuda", dtype=torch.int64)
    sbytes = 2 * Pp * H * D * E
    shape = f"{B} req x {ctx // 1024}K ctx x {H} KV heads, 1 layer"
    sweep = {}
    for bn, nw in ((16, 2), (16, 4), (32, 4), (32, 8), (64, 4), (64, 8), (128, 8)):
        t = bench_graph(lambda: block_keys(qs, smin, smax, rtt, rws, seq, BS, 1, 2, nb, block_n=bn, num_warps=nw))
        sweep[f"block_n={bn},num_warps={nw}"] = t
    raw["block_keys_sweep_ms"] = sweep
    print("block_keys launch sweep (GPU ms):", json.dumps(sweep), file=sys.stderr)
    best = min(sweep, key=sweep.get)
    launch = dict(kv.split("=") for kv in best.split(","))
    launch = {k: int(v) for k, v in launch.items()}
    ms_topk = add("select_topk (score + top-K)", shape + f" ({best})",
                  lambda: select_topk(qs, smin, smax, rtt, rws, seq, BS, 1, 2, nb, K, **launch), sbytes, "hbm")
    add("  of which block_keys (scoring)", shape + f" ({best})",
        lambda: block_keys(qs, smin, smax, rtt, rws, seq, BS, 1, 2, nb, **launch), sbytes, "hbm")
    keys = block_keys(qs, smin, smax, rtt, rws, seq, BS, 1, 2, nb)
    add("  of which torch.topk on the keys", f"[{B}, {H}, {nb}] int64, k={K}", lambda: topk_from_keys(keys, K),
        keys.numel() * 8, "hbm")
    raw["select_topk_ms_per_layer"] = ms_topk
    smin = smax = keys = None          # (not del: the lambdas above name them)
    steps.update()
    dense = sglang_decode(B, ctx, 16)
    if dense is not None:
        fn, nbytes = dense
        ms_dense = add("SGLang triton decode (dense)", f"{B} req x {ctx // 1024}K ctx, 1 layer", fn, nbytes, "hbm")
        weights_ms = args.weights_gb * 1e9 / (ceil["hbm"] / 2 * 1e9) * 1e3
        step_ms = args.layers * ms_dense + weights_ms
        raw["dense_step_ms_estimate"] = step_ms
        raw["topk_share_of_dense_step"] = args.layers * ms_topk / step_ms
        rows.append(("select_topk x layers / dense step", f"{args.layers} layers; dense step = {args.layers} x attention + "
                     f"{args.weights_gb} GB weights at HBM read speed = {step_ms:.1f} ms", float("nan"),
                     args.layers * ms_topk * 1e3, 0, 0, 100 * args.layers * ms_topk / step_ms, "share of step",
                     "<= 5%", ""))
        del fn, dense
    torch.cuda.empty_cache()
    steps.update()

    # 3. sparse decode attention over a 2,048-token working set vs SGLang on a dense 2,048 context
    for B in (8, 32, 64):
        q, ws_k, ws_v, ids, rws, seq = ws_case(B, 2048 // BS)
        nbytes = 2 * B * H * 2048 * D * E
        ms_sp = add("sparse_decode_attention", f"B={B}, 2048-token working set, 1 row",
                    lambda: sparse_decode_attention(q, ws_k, ws_v, ids, rws, seq, None), nbytes, "hbm", ">= 70% HBM")
        q2 = torch.randn(B, 2, H * G, D, device="cuda", dtype=DT)
        kx = torch.randn(B, H, D, device="cuda", dtype=DT)
        add("sparse_decode_attention", f"B={B}, 2048-token working set, 2 rows (normal + draft)",
            lambda: sparse_decode_attention(q2, ws_k, ws_v, ids, rws, seq, None, kx, kx), nbytes, "hbm")
        best, best_s = None, None
        for splits in (4, 8, 16):
            d = sglang_decode(B, 2048, splits)
            if d is not None:
                t = bench_graph(d[0])
                if best is None or t < best:
                    best, best_s = t, splits
                del d
        if best is not None:
            d = sglang_decode(B, 2048, best_s)
            add("SGLang triton decode (dense)", f"B={B}, 2048-token context ({best_s} splits, best of 4/8/16)", d[0],
                nbytes, "hbm", extra=f"oasis/sglang GPU time = {ms_sp / best:.2f}x (target <= 1.2x)")
            del d
        q = ws_k = ws_v = ids = None
        torch.cuda.empty_cache()
    steps.update()

    paired_section(add, rows, raw)
    steps.update()
    plan_section(add, raw)
    steps.close()
    return finish(rows, raw, ceil, args.out)


def plan_section(add, raw, B: int = 40, ctx: int = 16384, K: int = 128, cap: int = 8, churn: float = 4.4,
                 dev: str = "cuda") -> None:
    """One sparse layer's select stage at the 16K serving point (40 requests, 8 KV heads, a
    2048-token working set of 16-token blocks): the admission plan (kernel 6), the step budget's
    candidates (6b) and share (6c), finite and unlimited, and the benchmarks' churn replay (8).
    Random scores: every head misses most of its top-K (the plan's worst case). The plan updates
    the block table it reads, so repeated calls time a table in its steady state. ``dev``: "cpu"
    with ``TRITON_INTERPRET=1`` checks the section's own inputs (tests/scripts)."""
    from oasis_sglang.core.selection import select_blocks
    from oasis_sglang.kernels.plan_transfer import budget_candidates, plan_transfer
    from oasis_sglang.kernels.replay_churn import replay_churn
    from oasis_sglang.kernels.share_budget import share_budget

    nb, R = ctx // BS, B + 1
    ids = torch.rand(R, H, nb, device=dev).argsort(-1)[..., :K].contiguous()       # distinct resident blocks
    last = torch.randint(0, 1000, (R, H, K), device=dev)
    rows = torch.arange(1, R, device=dev)
    n = torch.full((B,), nb, device=dev)
    wanted, forced = select_blocks(torch.randn(B, H, nb, device=dev), n, n - 1, K, 1, 2)
    seq = torch.full((B,), ctx, device=dev, dtype=torch.int64)
    rtt = torch.arange(R * ctx, device=dev, dtype=torch.int32).view(R, ctx)
    counters = torch.zeros(4, dtype=torch.int64, device=dev)
    step = torch.tensor(1001, dtype=torch.int64, device=dev)
    finite = torch.tensor(B * H * 4, dtype=torch.int64, device=dev)               # 4 per head: binds
    unlimited = torch.tensor(-1, dtype=torch.int64, device=dev)
    shape = f"{B} req x {H} KV heads, K={K}, {nb} blocks, cap {cap}"
    nbytes = 6 * B * H * K * 8                    # ids, last_used, wanted read; ids, last_used, lists written
    cand = budget_candidates(ids, rows, wanted, forced, cap, finite)
    allow = share_budget(cand, finite, step, K)
    raw["plan_section"] = {"B": B, "ctx": ctx, "K": K, "cap": cap,
                           "candidates_per_layer": int((cand >= 0).sum()), "budget_blocks": int(finite)}
    add("plan_transfer (kernel 6)", shape, lambda: plan_transfer(ids, last, rows, wanted, forced, step, cap, seq, rtt,
                                                                  BS, R * ctx // BS, counters), nbytes, "hbm")
    add("plan_transfer with a budget share", shape, lambda: plan_transfer(
        ids, last, rows, wanted, forced, step, cap, seq, rtt, BS, R * ctx // BS, counters, allow=allow), nbytes, "hbm")
    add("budget_candidates (6b), finite budget", shape,
        lambda: budget_candidates(ids, rows, wanted, forced, cap, finite), 3 * B * H * K * 8, "hbm")
    add("budget_candidates (6b), unlimited", shape,
        lambda: budget_candidates(ids, rows, wanted, forced, cap, unlimited), B * H * cap * 4, "hbm")
    add("share_budget (6c), finite budget", f"[{B * H}, {cand.shape[1]}] candidates",
        lambda: share_budget(cand, finite, step, K), cand.numel() * 4, "hbm")
    add("share_budget (6c), unlimited", f"[{B * H}, {cand.shape[1]}] candidates",
        lambda: share_budget(cand, unlimited, step, K), B * H * 4, "hbm")
    add("replay_churn (kernel 8, benchmarks)", shape + f", {churn} missed per head",
        lambda: replay_churn(wanted, forced, ids, rows, churn, seq, salt=3), 5 * B * H * K * 8, "hbm")


def scoring_section(add, raw, B: int, ctx: int, K: int = 128, dev: str = "cuda") -> None:
    """One sparse layer's block scoring (``block_keys``) and top-K at ``B`` requests of ``ctx``
    tokens (8 KV heads, 16-token blocks): bf16 min/max summaries against int8 levels with one
    float32 scale per (block, KV head) (``core.summaries.quantize_outward``; 1 + 4 / (2 D) bytes
    per element instead of 2). Each format's launch parameters are swept first; the faster is used.
    ``dev``: "cpu" with ``TRITON_INTERPRET=1`` checks the section's inputs (tests)."""
    from oasis_sglang.core.summaries import quantize_outward

    nb = ctx // BS
    Pp = B * nb
    smin = torch.randn(Pp, H, D, device=dev, dtype=DT)
    smax = smin + torch.rand(Pp, H, D, device=dev, dtype=DT)
    lo8, hi8, scale = quantize_outward(smin, smax, "int8")
    rtt = (torch.randperm(Pp, device=dev).view(B, nb)[:, :, None] * BS
           + torch.arange(BS, device=dev)).view(B, ctx).int()
    qs = torch.randn(B, H * G, D, device=dev, dtype=DT)
    rws = torch.arange(B, device=dev)
    seq = torch.full((B,), ctx, device=dev, dtype=torch.int64)
    shape = f"{B} req x {ctx // 1024}K ctx x {H} KV heads, 1 layer"
    res = raw.setdefault("scoring_section", {})
    for name, (a, b, extra, nbytes) in {
            "bf16": (smin, smax, {}, 2 * Pp * H * D * E),
            "int8 + scale": (lo8, hi8, {"kscale": scale}, 2 * Pp * H * D + Pp * H * 4)}.items():
        sweep = {}
        for bn, nw in ((32, 4), (64, 4), (64, 8), (128, 8)) if dev == "cuda" else ((64, 4),):
            sweep[(bn, nw)] = bench_graph(lambda: block_keys(qs, a, b, rtt, rws, seq, BS, 1, 2, nb, block_n=bn,
                                                             num_warps=nw, **extra)) if dev == "cuda" else 0.0
        (bn, nw) = min(sweep, key=sweep.get)
        launch = dict(block_n=bn, num_warps=nw, **extra)
        res[f"{name} {shape}"] = {f"block_n={k[0]},num_warps={k[1]}": v for k, v in sweep.items()}
        add(f"block_keys, {name} summaries", shape + f" (block_n={bn}, num_warps={nw})",
            lambda: block_keys(qs, a, b, rtt, rws, seq, BS, 1, 2, nb, **launch), nbytes, "hbm")
        add(f"select_topk, {name} summaries", shape,
            lambda: select_topk(qs, a, b, rtt, rws, seq, BS, 1, 2, nb, K, **launch), nbytes, "hbm")


ATTENTION_SWEEP = tuple((s, bn, nw, ns) for s in (None, 4, 8) for bn in (64, 128) for nw in (4, 8) for ns in (2, 3))


def attention_section(add, raw, B: int, ws_tokens: int = 2048, dev: str = "cuda", sweep=ATTENTION_SWEEP) -> None:
    """The sparse decode attention (kernel 4) over ``B`` requests' ``ws_tokens``-token working
    sets (one row per request, all slots resident), for each launch in ``sweep``: ``(num_splits``
    (``None``: ``choose_splits``), ``block_n``, ``num_warps``, ``num_stages)``. Each launch's output
    is compared with the default launch's first (a launch that changes the result is reported and
    not timed); then the default and the fastest are timed through ``add``, and every timing of
    the sweep goes to ``raw["attention_section"]`` (us per call; a launch that fails to compile
    or changes the result is recorded as text). Bytes: ``2 * B * 8 KV heads * ws_tokens * 128 *
    2`` (K and V in bf16, read once). ``dev``: "cpu" with ``TRITON_INTERPRET=1`` checks the section
    (tests).

    Raises:
        ValueError: ``ws_tokens`` is not a positive multiple of the 16-token block."""
    if ws_tokens < BS or ws_tokens % BS:
        raise ValueError(f"attention_section: ws_tokens {ws_tokens} must be a positive multiple of the {BS}-token block")
    q, ws_k, ws_v, ids, rws, seq = ws_case(B, ws_tokens // BS, dev=dev)
    nbytes = 2 * B * H * ws_tokens * D * E
    ref, _ = sparse_decode_attention(q, ws_k, ws_v, ids, rws, seq, None)
    res = raw.setdefault("attention_section", {}).setdefault(f"B={B}, {ws_tokens}-token working set", {})
    times = {}
    for s, bn, nw, ns in sweep:
        fn = (lambda s=s, bn=bn, nw=nw, ns=ns: sparse_decode_attention(q, ws_k, ws_v, ids, rws, seq, None,
                                                                       num_splits=s, block_n=bn, num_warps=nw,
                                                                       num_stages=ns))
        name = f"splits={'auto' if s is None else s},block_n={bn},warps={nw},stages={ns}"
        try:
            err = (fn()[0].float() - ref.float()).abs().max().item()
        except Exception as e:  # noqa: BLE001 - a launch that does not compile here: reported, the sweep goes on
            res[name] = f"failed: {e.__class__.__name__}: {str(e)[:200]}"
            continue
        if not err <= 0.02 * ref.float().abs().max().item() + 1e-3:       # bf16 sums in another order
            res[name] = f"wrong: max |diff| {err:.3g} against the default launch"
            continue
        times[name] = bench_graph(fn) if dev == "cuda" else 0.0
        res[name] = times[name]
    if not times:
        return                     # every launch failed or was wrong: raw says which
    dbn = default_block_n(_capability(q.device), D, D, E)          # the launch the engine makes
    default = f"splits=auto,block_n={dbn},warps=4,stages=2"
    best = min(times, key=times.get)
    shape = f"B={B}, {ws_tokens}-token working set, 1 row"
    for name in dict.fromkeys(n for n in (default, best) if n in times):
        s, bn, nw, ns = (x.split("=")[1] for x in name.split(","))
        add("sparse_decode_attention" + (" (default)" if name == default else " (fastest of the sweep)"),
            f"{shape} ({name})",
            lambda s=s, bn=bn, nw=nw, ns=ns: sparse_decode_attention(
                q, ws_k, ws_v, ids, rws, seq, None, num_splits=None if s == "auto" else int(s), block_n=int(bn),
                num_warps=int(nw), num_stages=int(ns)), nbytes, "hbm")


def finish(rows, raw, ceil, out) -> int:
    """Print the table and write it (markdown) and the raw numbers (.json) to ``out``."""
    dev = torch.cuda.get_device_name()
    lines = [f"Device: {dev}; torch {torch.__version__}, triton {triton.__version__}. Ceilings measured here: "
             f"HBM copy {ceil['hbm']:.0f} GB/s (read + write), pinned H2D {ceil['h2d']:.1f} GB/s, "
             f"D2H {ceil['d2h']:.1f} GB/s.", "",
             "Eager = one call as the engine makes it (includes host-side launch cost); GPU = the same call "
             "replayed from a CUDA graph (kernel time). GB/s and % use the GPU time when there is one.", "",
             "| kernel | shape | eager (us) | GPU (us) | MiB moved | GB/s | % of ceiling | ceiling | target | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:.1f} | {r[5]:.1f} | {r[6]:.1f} | {r[7]} | "
                     f"{r[8]} | {r[9]} |")
    table = "\n".join(lines)
    print(table)
    raw["rows"] = rows
    if out:
        with open(out, "w") as f:
            f.write(table + "\n")
        with open(out.rsplit(".", 1)[0] + ".json", "w") as f:
            json.dump(raw, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
