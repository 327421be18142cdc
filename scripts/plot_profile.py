"""Stacked bars of the decode step's GPU time per sparse layer, by kernel group, from
``scripts/bench_pipeline.py --graph --graph-profile`` results (one bar per results file and fetch_cap).

    python scripts/plot_profile.py A.json[=label] B.json[=label] ... [--variant previous] [--out profile.png]

Each bar sums the kernel time the profiler recorded per replayed step (``kernels`` of the graph
row of ``--variant``), divided by the run's sparse layers. Kernels of the stage streams overlap
the compute stream's, so a bar can exceed the step time; the step time per layer is marked on it.
Groups: attention (split-K decode), GEMMs (the layer's real weights), scoring, top-K (the fused
selection, or ``torch.topk`` + key decode), admission plan, H2D copy, token append + summaries;
"other" holds the rest, including the benchmark's own input refresh (``normal_`` / ``copy_``).
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
    """``[{fetch_cap, step_us, groups: {group: us}}]`` per sparse layer for one results file.

    Raises:
        SystemExit: the file is missing or is not ``bench_pipeline --graph --graph-profile`` output.
    """
    try:
        res = json.loads(path.read_text())
        layers = int(res["args"]["layers"])
        graph = res["graph"]
        assert layers > 0 and isinstance(graph, list)
        out = []
        for r in graph:
            if r["variant"] != variant or not r.get("kernels"):
                continue
            g = {}
            for name, us, _ in r["kernels"]:
                g[group_of(name)] = g.get(group_of(name), 0.0) + float(us) / layers
            out.append({"fetch_cap": r["fetch_cap"], "step_us": 1e3 * float(r["gpu_ms"]) / layers, "groups": g})
        return out
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
        raise SystemExit(f"{path}: not a bench_pipeline.py --graph --graph-profile results.json "
                         f"({e.__class__.__name__}: {e})") from None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="results.json of bench_pipeline, optionally =label (| breaks the line)")
    ap.add_argument("--variant", default="previous")
    ap.add_argument("--out", default="out/profile.png")
    a = ap.parse_args()
    rows = []
    for spec in a.results:
        p, _, label = (spec, "", "") if Path(spec).exists() or "=" not in spec else spec.rpartition("=")
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

    fig, ax = plt.subplots(figsize=(max(7.0, 1.6 + 1.5 * len(rows)), 4.5))
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
    out = Path(a.out) if Path(a.out).suffix else Path(a.out).with_suffix(".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
