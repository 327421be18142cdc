"""Stacked bars of the decode step's GPU time per sparse layer, by kernel group, from
``scripts/bench_pipeline.py --graph --graph-profile`` results (one bar per results file and fetch_cap).

    python scripts/plot_profile.py A.json[=label] B.json[=label] ... [--variant previous] [--out profile.png]

Each bar sums the kernel time the profiler recorded per replayed step (``kernels`` of the graph
row of ``--variant``), divided by the run's sparse layers. Kernels of the stage streams overlap
the compute stream's, so a bar can exceed the step time; the step time per layer is marked on it.
Groups: attention (split-K decode), GEMMs (the layer's real weights), scoring, top-K (the fused
selection, or ``torch.topk`` + key decode), admission plan, H2D copy, token append + summaries.
Also prints the table behind the plot.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GROUPS = [
    ("attention", ("_stage1", "_stage2")),
    ("GEMMs", ("nvjet", "cublasLt", "sm90_xmma", "cutlass")),
    ("scoring", ("_score_kernel",)),
    ("top-K", ("_select_kernel", "sbtopk", "radixSort", "_decode_keys_kernel", "gatherTopK", "mbtopk")),
    ("admission plan", ("_plan_transfer_kernel",)),
    ("H2D copy", ("_copy_rows_kernel", "_copy_blocks_kernel")),
    ("append + summaries", ("_append_tokens_kernel", "_write_kv_kernel")),
]


def group_of(name: str) -> str:
    for g, keys in GROUPS:
        if any(k in name for k in keys):
            return g
    return "other"


def bars(path: Path, variant: str) -> list[dict]:
    """``[{fetch_cap, step_us, groups: {group: us}}]`` per sparse layer for one results file."""
    res = json.loads(path.read_text())
    layers = res["args"]["layers"]
    out = []
    for r in res["graph"]:
        if r["variant"] != variant or not r.get("kernels"):
            continue
        g = {}
        for name, us, _ in r["kernels"]:
            g[group_of(name)] = g.get(group_of(name), 0.0) + us / layers
        out.append({"fetch_cap": r["fetch_cap"], "step_us": 1e3 * r["gpu_ms"] / layers, "groups": g})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="results.json of bench_pipeline, optionally =label (| breaks the line)")
    ap.add_argument("--variant", default="previous")
    ap.add_argument("--out", default="out/profile.png")
    a = ap.parse_args()
    rows = []
    for spec in a.results:
        p, _, label = spec.partition("=")
        for b in bars(Path(p), a.variant):
            rows.append((f"{(label or Path(p).stem).replace('|', chr(10))}\ncap {b['fetch_cap']}", b))
    if not rows:
        raise SystemExit(f"no graph rows of variant {a.variant!r} with a kernel profile in {a.results}")
    names = [g for g, _ in GROUPS] + ["other"]
    print("| run | step us/layer | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for label, b in rows:
        print(f"| {label.replace(chr(10), ', ')} | {b['step_us']:.0f} | "
              + " | ".join(f"{b['groups'].get(n, 0.0):.0f}" for n in names) + " |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * len(rows), 4.5))
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    for n in names:
        h = [b["groups"].get(n, 0.0) for _, b in rows]
        ax.bar(x, h, bottom=bottom, label=n)
        bottom = [u + v for u, v in zip(bottom, h)]
    ax.scatter(list(x), [b["step_us"] for _, b in rows], marker="_", s=900, color="black", zorder=3,
               label="step time per layer")
    ax.set_xticks(list(x), [lbl for lbl, _ in rows], fontsize=8)
    ax.set_ylabel("GPU us per sparse layer (kernel time, all streams)")
    ax.set_title("OasisKV decode step by kernel group (CUDA-graph replays)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=120)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
