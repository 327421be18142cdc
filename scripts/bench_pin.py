"""Host-tier start-up: seconds to zero and page-lock (``cudaHostRegister``) the OasisKV host tier.

    python scripts/bench_pin.py [--gib 16] [--layers 34] [--threads 1 4 8 16] [--out out/bench_pin.md]

Builds ``oasis_sglang.core.host_tier.HostTier`` of about ``--gib`` GiB (Qwen3-8B shapes: 8 KV
heads, head_dim 128, bf16, 16-token blocks, ``--layers`` sparse layers = 2 x layers buffers) once
per ``--threads`` value and reports GB/s. Torch only; needs CUDA (the tier is pinned only there).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # this checkout's package, not an installed copy

from oasis_sglang.core.host_tier import HostTier  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=16.0, help="host tier size, GiB")
    ap.add_argument("--layers", type=int, default=34, help="sparse layers (buffers = 2 x layers)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 4, 8, 16], help="pin_threads values")
    ap.add_argument("--out", default="out/bench_pin.md")
    a = ap.parse_args()
    if not math.isfinite(a.gib) or a.gib <= 0 or a.layers < 1 or min(a.threads) < 1:
        ap.error("--gib must be a finite number > 0, --layers >= 1 and every --threads value >= 1")
    if not torch.cuda.is_available():
        print("bench_pin: needs CUDA (the host tier is page-locked only there)", file=sys.stderr)
        return 2
    H, bs, D = 8, 16, 128
    block_bytes = H * bs * D * 2 * 2                      # K and V of one block, all KV heads, bf16
    pages = max(1, int(a.gib * 2**30 // (a.layers * block_bytes)))
    torch.cuda.init()
    rows = []
    for n in a.threads:
        t0 = time.perf_counter()
        ht = HostTier(a.layers, pages, bs, H, D, D, torch.bfloat16, pin_memory=True, pin_threads=n)
        dt = time.perf_counter() - t0
        gb = ht.nbytes / 1e9
        # the tier is usable: a device gather of one block reads it through the mapping
        ht.k[0][0, pages - 1].fill_(1.0)
        got = ht.k[0][0, pages - 1].to("cuda", non_blocking=True).float().sum().item()
        assert got == bs * D, f"pinned tier read back {got}, expected {bs * D}"
        rows.append({"threads": n, "gb": round(gb, 2), "seconds": round(dt, 2), "gb_s": round(gb / dt, 2)})
        print(json.dumps(rows[-1]), flush=True)
        del ht
        gc.collect()
    md = ["| pin_threads | host tier GB | seconds | GB/s |", "|---|---|---|---|"]
    md += [f"| {r['threads']} | {r['gb']} | {r['seconds']} | {r['gb_s']} |" for r in rows]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
