"""Time ``HostTier.discard`` for one ended request on an on-demand (CPU) host tier: what a PD
decode node's release costs inside its decode loop (``disagg/serving.py DecodeSide.release``).

The tier has the Qwen3-8B shapes by default (34 sparse layers, 8 KV heads, head size 128,
16-token blocks, bf16: 4 KiB pieces). The request holds ``--tokens`` of context in blocks
scattered over the tier (a random permutation, as after many requests came and went) or
consecutive (``--layout consecutive``); a fraction ``f`` of its (layer, KV head, block) pieces
was read from its prefill node (written here, ``RemoteBlocks.present``). For each ``f`` the
pieces are written, then given back twice over fresh copies: with every piece (no mask) and
with ``written`` = those pieces (``--repeat`` times each, alternating, one seed per repeat).
Reports the median run (the upper one of an even count): its seconds, ``madvise`` calls and
resident memory.

    python scripts/bench_discard.py [--tokens 16384] [--fractions 0.16 0.45 1.0] [--baseline 63b14b5] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # this checkout's package, not an installed copy

from oasis_sglang.core import host_tier as this_mod  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def baseline_module(rev: str):
    """``oasis_sglang/core/host_tier.py`` as of git revision ``rev`` of this checkout, imported
    as a module of its own (it imports only torch and the standard library).

    Raises:
        SystemExit: ``rev`` is not a revision of this checkout or has no such file."""
    import importlib.util
    import subprocess
    import tempfile

    r = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:oasis_sglang/core/host_tier.py"],
                       capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"bench_discard: --baseline {rev}: {r.stderr.strip() or 'git show failed'}")
    path = Path(tempfile.mkdtemp(prefix="bench_discard_")) / "host_tier_baseline.py"
    path.write_text(r.stdout)
    spec = importlib.util.spec_from_file_location("host_tier_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(a, f: float, layout: str, variant: str, seed: int, ht_mod=this_mod) -> dict:
    """One tier, one request, one ``discard``: ``variant`` "no" / "baseline" without the mask,
    "yes" with it (``ht_mod``: the host_tier module to time)."""
    HostTier = ht_mod.HostTier
    masked = variant == "yes"
    g = torch.Generator().manual_seed(seed)
    L, H, bs, D = a.layers, a.kv_heads, a.block_size, a.head_dim
    n = -(-a.tokens // bs)
    P = max(a.pages, n)
    try:
        tier = HostTier(L, P, bs, H, D, D, torch.bfloat16)
    except (OSError, RuntimeError) as e:
        raise SystemExit(f"bench_discard: a tier of {L} layers x {H} KV heads x {P} blocks of {bs} tokens x {D} dims "
                         f"could not be mapped ({e}); lower --pages or --tokens")
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
        given = tier.discard(pages, written=written) if masked else tier.discard(pages)   # (runs on older code too)
        dt = time.perf_counter() - t0
    finally:
        ht_mod._libc = orig
    left = tier.resident_bytes()
    del tier
    return {"fraction": f, "layout": layout, "variant": variant, "mask": masked, "seconds": round(dt, 4), "madvise_calls": calls[0],
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
    ap.add_argument("--masks", nargs="+", choices=["no", "yes"], default=["no", "yes"],
                    help="give back without and / or with the written mask")
    ap.add_argument("--baseline", default=None, metavar="REV",
                    help="also time host_tier.py of this git revision (without the mask), interleaved with the "
                         "others, e.g. 63b14b5 (before the mask)")
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
    fractions, layouts = list(dict.fromkeys(a.fractions)), list(dict.fromkeys(a.layouts))     # repeats once
    variants = list(dict.fromkeys(a.masks))
    mods = {v: this_mod for v in variants}
    if a.baseline:
        mods["baseline"] = baseline_module(a.baseline)
        variants = ["baseline"] + variants
    plan = [(lay, f, v, i) for lay in layouts for f in fractions for i in range(a.repeat) for v in variants]
    runs = [run(a, f, lay, v, seed=17 + i, ht_mod=mods[v]) for lay, f, v, i in tqdm(plan, desc="bench_discard")]
    rows = []
    for lay in layouts:
        for f in fractions:
            for v in variants:
                same = sorted((r for r in runs if (r["layout"], r["fraction"], r["variant"]) == (lay, f, v)),
                              key=lambda r: r["seconds"])
                # the median run (the upper one of an even count) with its own calls and memory
                rows.append({**same[len(same) // 2], "seconds_all": [r["seconds"] for r in same]})
    print(f"| layout | read share | variant | seconds | madvise calls | resident before / after MiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['fraction']:.2f} | {(a.baseline and r['variant'] == 'baseline' and f'{a.baseline}, no mask') or ('mask' if r['mask'] else 'no mask')} | {r['seconds']:.3f} | "
              f"{r['madvise_calls']} | {r['resident_before_mib']:.1f} / {r['resident_after_mib']:.1f} |")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"args": vars(a), "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
