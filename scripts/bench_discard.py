"""Time ``HostTier.discard`` for one ended request on an on-demand (CPU) host tier: what a PD
decode node's release costs inside its decode loop (``disagg/serving.py DecodeSide.release``).

The tier has the Qwen3-8B shapes by default (34 sparse layers, 8 KV heads, head size 128,
16-token blocks, bf16: 4 KiB pieces). The request holds ``--tokens`` of context in blocks
scattered over the tier (a random permutation, as after many requests came and went) or
consecutive (``--layout consecutive``); a fraction ``f`` of its (layer, KV head, block) pieces
was read from its prefill node (written here, ``RemoteBlocks.present``). For each ``f`` the
pieces are written, then given back twice over fresh copies: with every piece (no mask) and
with ``written`` = those pieces. Reports the median seconds of ``--repeat`` runs (the two
alternate) and the ``madvise`` calls.

    python scripts/bench_discard.py [--tokens 16384] [--fractions 0.16 0.45 1.0] [--out out/bench_discard.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # this checkout's package, not an installed copy

from oasis_sglang.core import host_tier as ht_mod  # noqa: E402
from oasis_sglang.core.host_tier import HostTier  # noqa: E402


def run(a, f: float, layout: str, masked: bool, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    L, H, bs, D = a.layers, a.kv_heads, a.block_size, a.head_dim
    n = -(-a.tokens // bs)
    P = max(a.pages, n)
    tier = HostTier(L, P, bs, H, D, D, torch.bfloat16)
    pages = (torch.randperm(P, generator=g)[:n] if layout == "scattered" else torch.arange(n)).to(torch.int64)
    written = torch.rand((L, H, n), generator=g) < f
    for li in range(L):
        for h in range(H):
            sel = pages[written[li, h]]
            tier.k[li][h, sel] = 1
            tier.v[li][h, sel] = 1
    resident = tier.resident_bytes()
    calls = [0]
    libc = ht_mod._libc()
    real = libc.madvise

    class Counting:                         # counts calls; the real madvise does the work
        def __getattr__(self, name):
            return getattr(libc, name)

        def madvise(self, *args):
            calls[0] += 1
            return real(*args)

    orig = ht_mod._libc
    ht_mod._libc = lambda: Counting()
    try:
        t0 = time.perf_counter()
        given = tier.discard(pages, written=written if masked else None)
        dt = time.perf_counter() - t0
    finally:
        ht_mod._libc = orig
    left = tier.resident_bytes()
    del tier
    return {"fraction": f, "layout": layout, "mask": masked, "seconds": round(dt, 4), "madvise_calls": calls[0],
            "resident_before_mib": round(resident / 2 ** 20, 2), "resident_after_mib": round(left / 2 ** 20, 2),
            "given_mib": round(given / 2 ** 20, 2)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384, help="the request's context (tokens)")
    ap.add_argument("--pages", type=int, default=8192, help="blocks per layer and KV head in the tier (P)")
    ap.add_argument("--layers", type=int, default=34)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.16, 0.45, 1.0],
                    help="shares of the request's pieces read from its prefill node")
    ap.add_argument("--layouts", nargs="+", choices=["scattered", "consecutive"], default=["scattered", "consecutive"])
    ap.add_argument("--repeat", type=int, default=3, help="runs of each case (the mask and no mask alternate); the median is reported")
    ap.add_argument("--out", default=None, help="JSON file for the results")
    a = ap.parse_args(argv)
    for name in ("tokens", "pages", "layers", "kv_heads", "head_dim", "block_size", "repeat"):
        if getattr(a, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    if any(not 0 <= f <= 1 for f in a.fractions):
        ap.error("--fractions must be in [0, 1]")
    try:
        from tqdm import tqdm
    except ImportError:                     # tqdm comes with SGLang; the script runs without it
        def tqdm(x, **_):
            return x
    plan = [(lay, f, m, i) for lay in a.layouts for f in a.fractions for i in range(a.repeat) for m in (False, True)]
    runs = [run(a, f, lay, m, seed=17 + i) for lay, f, m, i in tqdm(plan, desc="bench_discard")]
    rows = []
    for lay in a.layouts:
        for f in a.fractions:
            for m in (False, True):
                same = [r for r in runs if (r["layout"], r["fraction"], r["mask"]) == (lay, f, m)]
                secs = sorted(r["seconds"] for r in same)
                rows.append({**same[0], "seconds": secs[len(secs) // 2], "seconds_all": secs})
    print(f"| layout | read share | written mask | seconds | madvise calls | resident before / after MiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['fraction']:.2f} | {'yes' if r['mask'] else 'no'} | {r['seconds']:.3f} | "
              f"{r['madvise_calls']} | {r['resident_before_mib']:.1f} / {r['resident_after_mib']:.1f} |")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"args": vars(a), "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
