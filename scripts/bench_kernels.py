"""Benchmark the OasisKV Triton kernels on a CUDA GPU and print one table.

    python scripts/bench_kernels.py [--out results.md] [--layers 36]

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
from oasis_sglang.kernels.sparse_decode import sparse_decode_attention
from oasis_sglang.kernels.topk import select_topk
from oasis_sglang.kernels.write_kv import write_kv

H, G, D, BS = 8, 4, 128, 16
DT = torch.bfloat16
E = 2  # bytes per element


def bench(fn, rep=200):
    """Median milliseconds of ``fn`` (CUDA events, after warm-up)."""
    return triton.testing.do_bench(fn, warmup=50, rep=rep, return_mode="median")


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


def ws_case(B: int, K: int, full: bool = True):
    """A working set with every slot resident (``K`` blocks per (request, KV head))."""
    R = B
    ws_k = torch.randn(R, H, K, BS, D, device="cuda", dtype=DT)
    ws_v = torch.randn(R, H, K, BS, D, device="cuda", dtype=DT)
    ids = torch.stack([torch.randperm(4 * K, device="cuda")[:K] for _ in range(R * H)]).view(R, H, K)
    seq = torch.full((B,), 4 * K * BS, device="cuda", dtype=torch.int64)
    q = torch.randn(B, 1, H * G, D, device="cuda", dtype=DT)
    rows = torch.arange(B, device="cuda")
    return q, ws_k, ws_v, ids, rows, seq


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the table (markdown) and raw numbers (.json) here")
    ap.add_argument("--layers", type=int, default=36, help="layers per decode step (Qwen3-8B: 36)")
    ap.add_argument("--weights-gb", type=float, default=16.4, help="weight bytes read per decode step (GB)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    rows, raw = [], {}
    steps = tqdm(total=7, desc="bench_kernels", file=sys.stderr)
    ceil = ceilings()
    raw["ceilings_GBps"] = ceil
    steps.update()

    def add(kernel, shape, ms, nbytes, bound, target="", extra=""):
        gbs = nbytes / ms / 1e6
        rows.append((kernel, shape, ms * 1e3, nbytes / 2**20, gbs, 100 * gbs / ceil[bound], bound, target, extra))

    # 4. H2D gather and D2H write-back of 4 KiB pieces (one launch for K and V)
    P, M = 32768, 8192
    hk = torch.randn(H * P, BS * D, dtype=DT).pin_memory()
    hv = torch.randn(H * P, BS * D, dtype=DT).pin_memory()
    wk = torch.randn(4 * M, BS * D, device="cuda", dtype=DT)
    wv = torch.randn(4 * M, BS * D, device="cuda", dtype=DT)
    sets = [(torch.randperm(H * P, device="cuda")[:M], torch.randperm(4 * M, device="cuda")[:M]) for _ in range(4)]
    it = iter(range(1 << 30))
    nbytes = 2 * M * BS * D * E

    def pick():      # rotate index sets so repeated runs do not re-read the same pieces
        return sets[next(it) % len(sets)]

    def h2d():
        src, dst = pick()
        copy_blocks(wk, wv, dst, hk, hv, src)

    def d2h():
        src, dst = pick()
        copy_blocks(hk, hv, src, wk, wv, dst)

    ms = bench(h2d)
    add("copy_blocks H2D (gather)", f"{M} x 2 pieces of 4 KiB", ms, nbytes, "h2d", ">= 49 GB/s")
    ms = bench(d2h)
    add("copy_blocks D2H (write-back)", f"{M} x 2 pieces of 4 KiB", ms, nbytes, "d2h")
    raw["pinned_host_GiB"] = 2 * hk.numel() * E / 2**30
    steps.update()

    # 1. host-tier write + summaries: a decode batch (one token each) and a 16K-token prefill
    hk4, hv4 = hk.view(H, P, BS, D), hv.view(H, P, BS, D)
    kmin = torch.randn(P, H, D, device="cuda", dtype=DT)
    kmax = torch.randn(P, H, D, device="cuda", dtype=DT)
    for n, one, name in ((64, True, "decode, 64 requests"), (16384, False, "prefill, 16384 tokens")):
        loc = (torch.randperm(P, device="cuda")[:n] * BS + torch.randint(0, BS, (n,), device="cuda")) if one \
            else torch.arange(n, device="cuda") + BS * 7
        k = torch.randn(n, H, D, device="cuda", dtype=DT)
        v = torch.randn(n, H, D, device="cuda", dtype=DT)
        ms = bench(lambda: write_kv(hk4, hv4, kmin, kmax, loc, k, v, BS, one_token_each=one))
        add("write_kv (host tier + summaries)", name, ms, 2 * n * H * D * E, "d2h",
            extra=f"{'256 B' if one else '4 KiB'} host pieces")
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
    ms_topk = bench(lambda: select_topk(qs, smin, smax, rtt, rws, seq, BS, 1, 2, nb, K))
    add("select_topk (score + top-K)", f"{B} req x {ctx // 1024}K ctx x {H} KV heads, 1 layer", ms_topk,
        2 * Pp * H * D * E, "hbm")
    raw["select_topk_ms_per_layer"] = ms_topk
    del smin, smax
    steps.update()
    dense = sglang_decode(B, ctx, 16)
    if dense is not None:
        fn, nbytes = dense
        ms_dense = bench(fn, rep=100)
        add("SGLang triton decode (dense)", f"{B} req x {ctx // 1024}K ctx, 1 layer", ms_dense, nbytes, "hbm")
        weights_ms = args.weights_gb * 1e9 / (ceil["hbm"] / 2 * 1e9) * 1e3
        step_ms = args.layers * ms_dense + weights_ms
        raw["dense_step_ms_estimate"] = step_ms
        raw["topk_share_of_dense_step"] = args.layers * ms_topk / step_ms
        rows.append(("select_topk x layers / dense step", f"{args.layers} layers; dense step = attention + "
                     f"{args.weights_gb} GB weights at HBM read speed", args.layers * ms_topk * 1e3, 0, 0,
                     100 * args.layers * ms_topk / step_ms, "share", "<= 5%", f"dense step {step_ms:.1f} ms"))
        del fn, dense
    torch.cuda.empty_cache()
    steps.update()

    # 3. sparse decode attention over a 2,048-token working set vs SGLang on a dense 2,048 context
    for B in (8, 32, 64):
        q, ws_k, ws_v, ids, rws, seq = ws_case(B, 2048 // BS)
        nbytes = 2 * B * H * 2048 * D * E
        ms = bench(lambda: sparse_decode_attention(q, ws_k, ws_v, ids, rws, seq, None))
        add("sparse_decode_attention", f"B={B}, 2048-token working set, 1 row", ms, nbytes, "hbm", ">= 70% HBM")
        ms_sp = ms
        q2 = torch.randn(B, 2, H * G, D, device="cuda", dtype=DT)
        kx = torch.randn(B, H, D, device="cuda", dtype=DT)
        ms = bench(lambda: sparse_decode_attention(q2, ws_k, ws_v, ids, rws, seq, None, kx, kx))
        add("sparse_decode_attention", f"B={B}, 2048-token working set, 2 rows (normal + draft)", ms, nbytes, "hbm")
        best = None
        for splits in (4, 8, 16):
            d = sglang_decode(B, 2048, splits)
            if d is not None:
                t = bench(d[0])
                best = t if best is None or t < best else best
                del d
        if best is not None:
            add("SGLang triton decode (dense)", f"B={B}, 2048-token context (best of 4/8/16 splits)", best, nbytes, "hbm",
                extra=f"oasis/sglang = {ms_sp / best:.2f}x (target <= 1.2x)")
        del q, ws_k, ws_v, ids
        torch.cuda.empty_cache()
    steps.update()
    steps.close()

    dev = torch.cuda.get_device_name()
    lines = [f"Device: {dev}; torch {torch.__version__}, triton {triton.__version__}. Ceilings measured here: "
             f"HBM copy {ceil['hbm']:.0f} GB/s (read + write), pinned H2D {ceil['h2d']:.1f} GB/s, "
             f"D2H {ceil['d2h']:.1f} GB/s.", "",
             "| kernel | shape | time (us) | MiB moved | GB/s | % of ceiling | ceiling | target | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.1f} | {r[4]:.1f} | {r[5]:.1f} | {r[6]} | {r[7]} | {r[8]} |")
    table = "\n".join(lines)
    print(table)
    raw["rows"] = rows
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
        with open(args.out.rsplit(".", 1)[0] + ".json", "w") as f:
            json.dump(raw, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
