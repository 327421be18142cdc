"""Exposed transfer stall and paired-forward cost of the OasisKV decode step on a CUDA GPU.

    python scripts/bench_pipeline.py [--batch 32] [--context 16384] [--budget 2048] [--layers 8]
        [--steps 24] [--caps 1 2 4 8] [--drift 1.0] [--out out/bench_pipeline]

What runs (engine level, no SGLang scheduler): ``--layers`` Qwen3-8B-shaped sparse layers (32 q /
8 KV heads, head_dim 128, bf16, 16-token blocks), each step and layer doing the layer's real
GEMMs at batch ``B`` (QKV 4096x6144, O 4096x4096, gate/up 4096x24576, down 12288x4096: the
non-attention work a decode step hides the prefetch behind) and then OasisKV's decode path with
the Triton kernels: summaries, write, write-back, sparse attention, and, per predictor:

* ``current``: score + top-K + admission + H2D copy on the critical path (the foundation);
* ``previous``: the same three stages for the next step on their own streams;
* ``lookahead``: as ``previous`` plus a draft row (2 query rows per request: attention over the
  working set with the draft's own K/V, GEMMs at ``2B`` rows); the draft query is the next
  step's query (an oracle draft).

Queries follow ``q_t = sqrt(1 - a^2) q_{t-1} + a * noise`` with ``a = --drift`` (1.0: a fresh
random query every step, the worst case for the prediction: every step admits ``fetch_cap``
blocks per request, layer and KV head). Random K/V: the speed of the same work, not a real
attention pattern.

Reported per (predictor, fetch_cap), medians over the steps after the first two (the initial
fill): GPU time per step (CUDA events), host wall time per step, exposed wait (the compute
stream's stall on the transfer events, summed over layers), its share of the step, blocks and
bytes copied host-to-device per step (with the cap's bound ``cap * B * H * layers``), the hit
rate, and the step time relative to ``previous`` (for ``lookahead``: the paired-forward cost).
Writes ``results.md`` and ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from oasis_sglang.argtypes import positive_int, unit_float
from oasis_sglang.config import OasisConfig
from oasis_sglang.core import OasisSparseKV
from oasis_sglang.core.bench_hooks import BenchHooks
from oasis_sglang.kernels import get_kv_ops

HID, HQ, H, D, FFN = 4096, 32, 8, 128, 12288
DT = torch.bfloat16
DEV = "cuda"


class Layer:
    """One Qwen3-8B decoder layer's GEMM weights (random), run on ``[M, 4096]`` activations."""

    def __init__(self):
        dt = DT if DEV == "cuda" else torch.float32
        self.w = [torch.randn(a, b, device=DEV, dtype=dt) * 0.01
                  for a, b in ((HID, (HQ + 2 * H) * D), (HQ * D, HID), (HID, 2 * FFN), (FFN, HID))]

    def __call__(self, x):
        qkv = x @ self.w[0]
        o = qkv[:, :HQ * D] @ self.w[1]
        gu = o @ self.w[2]
        return (gu[:, :FFN] * gu[:, FFN:]) @ self.w[3]


def build(args):
    B, C, L = args.batch, args.context, args.layers
    n_tok = B * (C + args.steps + 16)
    kern = "triton" if DEV == "cuda" else "torch"
    cfg = OasisConfig(budget_tokens=args.budget, block_size=16, fetch_cap=8, dense_layers=(), kernels=kern)
    t0 = time.time()
    eng = OasisSparseKV(cfg, L, n_tok, B, H, D, D, DT, DEV, ops=get_kv_ops(kern), predictor="previous")
    print(f"engine: host tier {eng.host.nbytes / 2**30:.1f} GiB pinned, working set {eng.ws.nbytes / 2**30:.2f} GiB "
          f"({time.time() - t0:.0f} s)", flush=True)
    per = C + args.steps + 16
    rt = (torch.arange(B, device=DEV)[:, None] * per + torch.arange(per, device=DEV)[None]).to(torch.int32)
    if args.rtt_width > per:              # SGLang's table is as wide as the model's context; the rest unused
        rt = torch.cat([rt, torch.zeros((B, args.rtt_width - per), dtype=rt.dtype, device=DEV)], 1)
    rows = torch.arange(B, device=DEV)
    for l in tqdm(range(L), desc="prefill (write host tier + summaries)"):
        for b in range(B):
            k = torch.randn(C, H, D, device=DEV, dtype=DT)
            eng.write_kv(l, rt[b, :C].long(), k, torch.randn_like(k))
    sync()
    return eng, rt, rows


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


class Timer:
    """CUDA events on the GPU, wall time elsewhere (the ``--device cpu`` smoke run)."""

    def __init__(self):
        self.ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if DEV == "cuda" else None

    def start(self):
        if self.ev:
            self.ev[0].record()
        self.t = time.perf_counter()

    def stop(self) -> float:
        if self.ev:
            self.ev[1].record()
            self.ev[1].synchronize()
            return self.ev[0].elapsed_time(self.ev[1])
        return (time.perf_counter() - self.t) * 1e3


def run_case(eng, rt, rows, layers, args, predictor, cap):
    B, C, L = args.batch, args.context, args.layers
    eng.set_policy(fetch_cap=cap, predictor=predictor)
    eng.reset_rows(list(range(B)))
    eng.counters.zero_()
    eng.stats.sync_steps = 0
    draft = predictor == "lookahead"
    a = args.drift
    n = args.steps + 2
    qs = [torch.randn(B, HQ, D, device=DEV, dtype=DT)]
    for _ in range(n):
        qs.append((math.sqrt(max(0.0, 1 - a * a)) * qs[-1] + a * torch.randn_like(qs[-1])).to(DT))
    x = torch.randn(2 * B if draft else B, HID, device=DEV, dtype=layers[0].w[0].dtype)
    # the first decode step's working set, as the prefill would predict it (last prompt query)
    for l in range(L):
        q0 = qs[0]
        eng.stages.launch(l, q0, rows, torch.full((B,), C + 1, device=DEV), rt, -(-(C + 1) // 16), eng.clock + 1)
    res = []
    base = None
    for s in range(n):
        if s == 2:
            sync()
            base = eng.counters.sum(0).clone()                         # steady state: after the initial fill

        t = C + s
        seq = torch.full((B,), t + 1, device=DEV)
        timer = Timer()
        sync()
        w0 = time.perf_counter()
        timer.start()
        eng.begin_decode_step(rows, seq, rt, max_seq_len=t + 1)
        for l in range(L):
            layers[l % len(layers)](x)
            k = torch.randn(B, H, D, device=DEV, dtype=DT)
            eng.write_kv(l, rt[:, t].long(), k, k, decode=True)
            kw = dict(q_draft=qs[s + 1], k_draft=k, v_draft=k) if draft else {}
            eng.decode_attention(l, qs[s], k, k, None, **kw)
        gpu = timer.stop()
        sync()
        wall = (time.perf_counter() - w0) * 1e3
        waits = eng.pipe.exposed_wait_ms()
        res.append({"gpu_ms": gpu, "wall_ms": wall, "wait_ms": sum(waits)})
    r = eng.residency()
    hits, copied = (int(x) for x in (eng.counters.sum(0) - base)[:2].tolist())
    keep = res[2:]                                                      # after the first (filling) steps
    med = lambda k: sorted(x[k] for x in keep)[len(keep) // 2]          # noqa: E731
    steps = len(keep)
    piece = eng.block_bytes
    return {
        "predictor": predictor, "fetch_cap": cap, "gpu_ms": med("gpu_ms"), "wall_ms": med("wall_ms"),
        "wait_ms": med("wait_ms"), "wait_share": med("wait_ms") / med("gpu_ms"),
        "h2d_blocks_per_step": copied / steps, "h2d_MB_per_step": copied * piece / steps / 1e6,
        "h2d_GBps": copied * piece / steps / (med("gpu_ms") * 1e6),
        "cap_blocks_per_step": cap * args.batch * H * args.layers,
        "hit_rate": hits / max(1, hits + copied),
        "sync_steps": r["sync_steps"],
    }


def profile_replays(g, set_inputs, s0: int, n: int = 4) -> list[tuple[str, float, float]]:
    """GPU time per replayed step by kernel name (``torch.profiler`` over ``n`` replays; CUPTI
    records the kernels of a graph replay): ``[(name, us per step, launches per step)]``, largest first.
    Kernels of the stage streams overlap the compute stream's, so the sum exceeds the step time."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    tot, cnt = defaultdict(float), defaultdict(int)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for s in range(n):
            set_inputs(s0 + s)
            g.replay()
        torch.cuda.synchronize()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name if len(e.name) < 60 else e.name[:57] + "..."
            tot[name] += e.time_range.elapsed_us()
            cnt[name] += 1
    return sorted(((k, v / n, cnt[k] / n) for k, v in tot.items()), key=lambda x: -x[1])


def run_graph_case(eng, rt, rows, layers, args, variant, cap, profile: bool = False):
    """One decode step captured in a CUDA graph and replayed (no host launch cost).

    ``variant``: ``current`` / ``previous`` / ``lookahead`` as in eager mode, ``no-prefetch``
    (the ``previous`` step with the prefetch stages removed: the same compute with no predict,
    select or transfer; the floor the exposed cost is measured against) or ``no-transfer``
    (``previous`` without the H2D copies: ``previous`` minus this is the exposed transfer cost). Inputs change every
    replay through static buffers (fresh queries, so every step admits up to ``fetch_cap``
    blocks per request, layer and KV head). The stage streams are joined at the end of the
    captured step, so the last layers' transfers cannot overlap the next step's first layers
    here (SGLang's graph runner would impose the same boundary).
    """
    B, C, L = args.batch, args.context, args.layers
    pred = "previous" if variant in ("no-prefetch", "no-transfer") else variant
    eng.set_policy(fetch_cap=cap, predictor=pred)
    eng.reset_rows(list(range(B)))
    eng.counters.zero_()
    draft = variant == "lookahead"
    for l in range(L):
        eng.stages.launch(l, torch.randn(B, HQ, D, device=DEV, dtype=DT), rows, torch.full((B,), C + 1, device=DEV),
                          rt, -(-(C + 1) // 16), eng.clock + 1)
    eng.bench = BenchHooks(assume_predicted=True, skip_prefetch=variant == "no-prefetch",
                           skip_admission_copy=variant == "no-transfer")
    x = torch.randn(2 * B if draft else B, HID, device=DEV, dtype=DT)
    q, qd = torch.randn(B, HQ, D, device=DEV, dtype=DT), torch.randn(B, HQ, D, device=DEV, dtype=DT)
    kb = torch.randn(L, B, H, D, device=DEV, dtype=DT)
    seq = torch.full((B,), C + 1, device=DEV)
    loc = rt[:, C].long().clone()
    max_len = C + args.steps + 16                                          # >= every step's context
    # --sglang-graph: as SGLang captures it, candidates span req_to_token's width
    eng.begin_decode_step(rows, seq, rt, mode="capture", max_seq_len=None if args.sglang_graph else max_len)

    def step():
        eng.prepare_step_device()
        for l in range(L):
            layers[l % len(layers)](x)
            eng.write_kv(l, loc, kb[l], kb[l], decode=True)
            kw = dict(q_draft=qd, k_draft=kb[l], v_draft=kb[l]) if draft else {}
            eng.decode_attention(l, q, kb[l], kb[l], None, **kw)
        eng.pipe.drain()

    def set_inputs(s):
        seq.fill_(C + 1 + s)
        loc.copy_(rt[:, C + s].long())
        q.normal_()
        qd.normal_()
        kb.normal_()

    eng.pipe.timing = False
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):                                      # warm-up (Triton compiles)
            for s in range(2):
                set_inputs(s)
                step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        eng.pipe.ready = [None] * L          # all done: nothing from before the capture to wait on
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        times, base = [], None
        for s in range(2, args.steps + 2):
            set_inputs(s)
            if s == 4:
                torch.cuda.synchronize()
                base = eng.counters.sum(0).clone()
            t = Timer()
            t.start()
            g.replay()
            times.append(t.stop())
        torch.cuda.synchronize()
        hits, copied = (int(x) for x in (eng.counters.sum(0) - base)[:2].tolist())
        kernels = profile_replays(g, set_inputs, args.steps + 2) if profile else None
    finally:
        eng.bench, eng.pipe.timing = BenchHooks(), True
        torch.cuda.synchronize()
        eng.ws.violations.zero_()            # no-prefetch steps write into blocks never brought in
    keep = sorted(times[2:])
    n = args.steps - 2
    return {"variant": variant, "fetch_cap": cap, "gpu_ms": keep[len(keep) // 2], "kernels": kernels,
            "h2d_blocks_per_step": copied / n, "h2d_MB_per_step": copied * eng.block_bytes / n / 1e6,
            "cap_blocks_per_step": cap * B * H * L, "hit_rate": hits / max(1, hits + copied)}


def profile_eager(eng, rt, rows, layers, args):
    """torch.profiler over a few eager ``previous`` steps: where the host time goes."""
    from torch.profiler import ProfilerActivity, profile

    a = argparse.Namespace(**{**vars(args), "steps": 3})
    run_case(eng, rt, rows, layers, a, "previous", 8)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_case(eng, rt, rows, layers, a, "previous", 8)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=positive_int, default=32)
    p.add_argument("--context", type=positive_int, default=16384)
    p.add_argument("--budget", type=positive_int, default=2048)
    p.add_argument("--layers", type=positive_int, default=8)
    p.add_argument("--steps", type=positive_int, default=24)
    p.add_argument("--caps", type=positive_int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--predictors", nargs="+", default=["current", "previous", "lookahead"],
                   choices=["current", "previous", "lookahead"])
    p.add_argument("--drift", type=unit_float, default=1.0, help="query drift a in [0, 1] (see above)")
    p.add_argument("--out", default="out/bench_pipeline")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: a functional smoke run with the torch references")
    p.add_argument("--graph", action="store_true", help="also replay each step from a CUDA graph")
    p.add_argument("--copy-programs", type=int, nargs="+", default=[-1],
                   help="copy_blocks grid sizes to compare in graph mode (0: one program per piece, "
                        "-1: the default, one per two SMs)")
    p.add_argument("--profile", action="store_true", help="print a torch.profiler table of eager steps")
    p.add_argument("--graph-profile", action="store_true",
                   help="with --graph: GPU time per kernel of the replayed no-transfer / previous / lookahead steps")
    p.add_argument("--rtt-width", type=int, default=0,
                   help="req_to_token width in tokens (SGLang: the model's context length + 4, 40,964 for "
                        "Qwen3-8B); 0: just the benchmark's contexts")
    p.add_argument("--sglang-graph", action="store_true",
                   help="graph replays in the engine's graph mode, as SGLang captures them (top-K "
                        "candidates span req_to_token's width; see --rtt-width)")
    p.add_argument("--skip-eager", action="store_true", help="only the --graph replays")
    args = p.parse_args()
    try:
        OasisConfig(budget_tokens=args.budget, block_size=16)
    except ValueError as e:
        p.error(f"--budget: {e}")
    if any(c < -1 for c in args.copy_programs):
        p.error(f"--copy-programs: {args.copy_programs}: want -1 (the default grid), 0 (one program per piece) or more")
    for flag in ("graph_profile", "sglang_graph", "skip_eager"):
        if getattr(args, flag) and not args.graph:
            p.error(f"--{flag.replace('_', '-')} needs --graph")
    if args.graph and args.steps < 6:
        p.error("--steps: graph mode needs at least 6 (2 warm-up, 2 fill, timed replays)")
    per = args.context + args.steps + 16
    if args.rtt_width and args.rtt_width < per:
        p.error(f"--rtt-width {args.rtt_width} is below the benchmark's own table width {per} (context + steps + 16)")
    global DEV
    DEV = args.device
    if DEV == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_pipeline.py needs a CUDA GPU (or --device cpu for a smoke run)")
    eng, rt, rows = build(args)
    layers = [Layer() for _ in range(2)]
    rows_out = []
    for cap in tqdm([] if args.skip_eager else args.caps, desc="fetch_cap"):
        for pred in args.predictors:
            r = run_case(eng, rt, rows, layers, args, pred, cap)
            rows_out.append(r)
            print(json.dumps(r), flush=True)
    prev = {r["fetch_cap"]: r["gpu_ms"] for r in rows_out if r["predictor"] == "previous"}
    md = [f"B={args.batch}, context {args.context}, budget {args.budget}, {args.layers} sparse layers, "
          f"drift {args.drift}, {args.steps} steps (median after 2)", "",
          "| predictor | fetch_cap | GPU ms/step | wall ms/step | exposed wait ms | wait % of step | "
          "H2D blocks/step (cap) | H2D MB/step | H2D GB/s | hit rate | vs previous |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows_out:
        rel = r["gpu_ms"] / prev[r["fetch_cap"]] if r["fetch_cap"] in prev else float("nan")
        md.append(f"| {r['predictor']} | {r['fetch_cap']} | {r['gpu_ms']:.2f} | {r['wall_ms']:.2f} | {r['wait_ms']:.3f} | "
                  f"{100 * r['wait_share']:.1f}% | {r['h2d_blocks_per_step']:.0f} ({r['cap_blocks_per_step']}) | "
                  f"{r['h2d_MB_per_step']:.1f} | {r['h2d_GBps']:.1f} | "
                  f"{r['hit_rate']:.3f} | {rel:.2f}x |")
    if args.graph:
        md += ["", "CUDA graph replays (no host launch cost; the exposed cost is the step minus the "
               "no-prefetch step):", "",
               "| variant | fetch_cap | copy programs | GPU ms/step | exposed vs no-prefetch | exposed transfer (vs no-transfer) | "
               "H2D blocks/step (cap) | H2D MB/step | hit rate |", "|---|---|---|---|---|---|---|---|---|"]
        graph_rows = []
        for cap, cp in tqdm([(c, p) for c in args.caps for p in args.copy_programs], desc="graph fetch_cap"):
            eng.ops.copy_programs = cp
            rs = [run_graph_case(eng, rt, rows, layers, args, v, cap,
                                 profile=args.graph_profile and cp == args.copy_programs[0]
                                 and v in ("previous", "lookahead", "no-transfer"))
                  for v in ["no-prefetch", "no-transfer"] + list(args.predictors)]
            for r in rs:
                r["copy_programs"] = cp
            floor, no_xfer = rs[0]["gpu_ms"], rs[1]["gpu_ms"]
            for r in rs:
                r["exposed_share"] = (r["gpu_ms"] - floor) / r["gpu_ms"]
                r["transfer_share"] = (r["gpu_ms"] - no_xfer) / r["gpu_ms"] if r["variant"] != "no-prefetch" else 0.0
                print(json.dumps(r), flush=True)
                md.append(f"| {r['variant']} | {cap} | {cp} | {r['gpu_ms']:.3f} | {100 * r['exposed_share']:.1f}% | "
                          f"{100 * r['transfer_share']:.1f}% | "
                          f"{r['h2d_blocks_per_step']:.0f} ({r['cap_blocks_per_step']}) | {r['h2d_MB_per_step']:.1f} | "
                          f"{r['hit_rate']:.3f} |")
            graph_rows += rs
            for r in rs:
                if r.get("kernels"):
                    md += ["", f"GPU time per replayed step by kernel: {r['variant']}, fetch_cap {cap} "
                           f"(step {r['gpu_ms']:.3f} ms; stage-stream kernels overlap the compute stream's)", "",
                           "| kernel | us / step | launches / step |", "|---|---|---|"]
                    md += [f"| `{k}` | {us:.1f} | {c:.0f} |" for k, us, c in r["kernels"][:25]]
                    md.append(f"| (all) | {sum(x[1] for x in r['kernels']):.1f} | "
                              f"{sum(x[2] for x in r['kernels']):.0f} |")
        rows_out_graph = graph_rows
    else:
        rows_out_graph = []
    if args.profile:
        md += ["", "```", profile_eager(eng, rt, rows, layers, args), "```"]
    text = "\n".join(md)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows_out, "graph": rows_out_graph}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
