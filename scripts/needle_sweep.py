#!/usr/bin/env python3
"""Needle sweep: dense SGLang vs --kv-sparse oasis configs on SmolLM2-135M-Instruct.

For each haystack length (tokens of Paul Graham essays) and needle depth, asks the needle
question through the OpenAI-compatible API of each server and prints a markdown table of
answers (correct = the planted number appears). One server at a time, same host, same prompts.

    python scripts/needle_sweep.py --lengths 2048,4096,6000 --depths 0.2,0.5,0.8 \
        --oasis '{"budget_tokens": 512}' --oasis '{"budget_tokens": 512, "block_size": 8}'

    python scripts/needle_sweep.py --kv-dtypes auto,fp8_e4m3 --oasis '{"budget_tokens": 512, "block_size": 8}'

``--kv-dtypes``: every config (dense and oasis) is served with each SGLang ``--kv-cache-dtype``
(``auto`` = the model's), one column each.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="2048,4096,6000")
    p.add_argument("--depths", default="0.2,0.5,0.8")
    p.add_argument("--oasis", action="append", default=[], help="a --kv-sparse-config JSON (repeatable)")
    p.add_argument("--kv-dtypes", default="auto", help="comma-separated SGLang --kv-cache-dtype values (auto, "
                   "fp8_e4m3, fp8_e5m2): each config is served with each")
    p.add_argument("--port", type=int, default=0, help="server port (default 0: a free one for each server)")
    p.add_argument("--out", type=Path, default=ROOT / "out" / "needle_sweep")
    a = p.parse_args()
    kv_dtypes = list(dict.fromkeys(x.strip() for x in a.kv_dtypes.split(",") if x.strip()))   # once each
    bad = [x for x in kv_dtypes if x not in ("auto", "fp8_e4m3", "fp8_e5m2")]
    if bad or not kv_dtypes:
        p.error(f"--kv-dtypes: {bad or a.kv_dtypes!r}: want a comma-separated list of auto, fp8_e4m3, fp8_e5m2")
    try:
        lengths = [int(x) for x in a.lengths.split(",")]
        depths = [float(x) for x in a.depths.split(",")]
    except ValueError:
        p.error(f"--lengths {a.lengths!r} / --depths {a.depths!r}: want comma-separated integers / numbers")
    if min(lengths) < 64 or not all(0 <= d <= 1 for d in depths):
        p.error("--lengths must be >= 64 tokens and --depths in [0, 1]")
    if not 0 <= a.port <= 65535:
        p.error(f"--port {a.port}: want 0 (a free port) to 65535")
    from oasis_sglang.config import OasisConfig, OasisConfigError

    oasis = a.oasis or ['{"budget_tokens": 512}']
    for c in oasis:                        # every config is checked before the first server starts
        try:
            OasisConfig.from_json(c)
        except OasisConfigError as e:
            p.error(f"--oasis {c!r}: {e}")
    import requests
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from oasis_sglang import needle
    from oasis_sglang.models import prepare_smollm2
    from oasis_sglang.testing.launch import base_args, launch, oasis_args

    model = str(prepare_smollm2())
    tok = AutoTokenizer.from_pretrained(model)
    cases = [(L, d) for L in lengths for d in depths]
    prompts = {c: needle.build(tok, *c) for c in cases}
    configs = [("dense", [])] + [(f"oasis {c}", oasis_args(**json.loads(c))) for c in oasis]
    if kv_dtypes != ["auto"]:
        configs = [(f"{n} (KV {kv})", x + ([] if kv == "auto" else ["--kv-cache-dtype", kv]))
                   for kv in kv_dtypes for n, x in configs]
    table = {}
    a.out.mkdir(parents=True, exist_ok=True)
    for i, (name, extra) in enumerate(configs):
        try:
            srv = launch(model, a.port, base_args() + extra, a.out / f"{i}.log")
        except Exception as e:  # noqa: BLE001 - the other configs still run; the table says why
            for c in cases:
                table[(name, c)] = (False, f"server did not start: {type(e).__name__}: {str(e)[:80]}")
            continue
        try:
            for c in tqdm(cases, desc=name):
                r = requests.post(srv.url + "/v1/chat/completions", json={
                    "model": "m", "messages": prompts[c].messages, "max_tokens": 16, "temperature": 0}, timeout=1800)
                ans = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else f"HTTP {r.status_code}: {r.text[:80]}"
                table[(name, c)] = (prompts[c].answer in ans, ans.strip())
                # written after every answer: a later failure loses nothing
                (a.out / "results.json").write_text(json.dumps(
                    [{"config": n, "length": cc[0], "depth": cc[1], "correct": ok, "answer": t}
                     for (n, cc), (ok, t) in table.items()], indent=1))
        finally:
            srv.stop()
    print(f"\n{time.strftime('%Y-%m-%d')}: needle '{needle.NEEDLE}' / '{needle.QUESTION}'\n")
    print("| length | depth | " + " | ".join(n for n, _ in configs) + " |")
    print("|---|---|" + "---|" * len(configs))
    for c in cases:
        cells = [("yes" if table[(n, c)][0] else f"no ({table[(n, c)][1][:40]!r})") for n, _ in configs]
        print(f"| {c[0]} | {c[1]} | " + " | ".join(cells) + " |")
    for n, _ in configs:
        print(f"{n}: {sum(table[(n, c)][0] for c in cases)}/{len(cases)} correct")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
