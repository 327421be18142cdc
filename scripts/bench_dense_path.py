#!/usr/bin/env python3
"""The dense path for short contexts (``dense_short_contexts``) on and off, served: one SGLang
server with ``--kv-sparse oasis`` per setting (SmolLM2-135M-Instruct; SGLang's CPU engine when
there is no GPU), the same random-id prompts through SGLang's ``bench_serving``, and the
``OasisKV decode`` line's step counters.

    python scripts/bench_dense_path.py [--input-len 256] [--output-len 128] [--requests 4] [--budget 512]

Prompt + output must fit the budget for the dense steps to run (the script refuses otherwise).
Prints a markdown table and writes ``<out>/bench_dense_path.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SERVING = {"output_tok_s": r"Output token throughput \(tok/s\):\s+([\d.]+)",
           "median_tpot_ms": r"Median TPOT \(ms\):\s+([\d.]+)",
           "median_ttft_ms": r"Median TTFT \(ms\):\s+([\d.]+)"}


def bench_serving(url: str, model: str, a, log: Path, per_request: Path) -> dict:
    """``sglang.bench_serving``: ``a.requests`` random-id prompts sent at once; the figures it prints
    (its output in ``log``, its per-request records in ``per_request``).

    Raises:
        RuntimeError: bench_serving exited non-zero (its stderr's tail in the message).
    """
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", url,
           "--dataset-name", "random-ids", "--random-input-len", str(a.input_len), "--random-output-len",
           str(a.output_len), "--random-range-ratio", "1", "--num-prompts", str(a.requests), "--max-concurrency",
           str(a.requests), "--tokenize-prompt", "--tokenizer", model, "--model", model, "--disable-tqdm",
           "--seed", "1", "--output-file", str(per_request)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
    log.write_text(" ".join(cmd) + "\n" + r.stdout + "\n" + r.stderr[-4000:])
    if r.returncode:
        raise RuntimeError(f"bench_serving exited {r.returncode}: {r.stderr[-2000:]}")
    return {k: (float(m.group(1)) if (m := re.search(p, r.stdout)) else None) for k, p in SERVING.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input-len", type=int, default=256, help="prompt tokens per request")
    ap.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    ap.add_argument("--requests", type=int, default=4, help="requests sent at once")
    ap.add_argument("--budget", type=int, default=512, help="budget_tokens (a multiple of --block-size)")
    ap.add_argument("--block-size", type=int, default=16, help="block_size (SGLang's --page-size)")
    ap.add_argument("--predictor", default="auto", choices=["auto", "current", "previous"])
    ap.add_argument("--timeout", type=int, default=1800, help="seconds for one bench_serving run")
    ap.add_argument("--out", default=os.environ.get("OUT", "out") + "/bench_dense_path")
    a = ap.parse_args()
    for k in ("input_len", "output_len", "requests", "budget", "block_size", "timeout"):
        if getattr(a, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be >= 1, got {getattr(a, k)}")
    if a.input_len + a.output_len + 1 > a.budget:
        ap.error(f"--input-len + --output-len ({a.input_len + a.output_len}) must stay below --budget ({a.budget}): "
                 "longer contexts never take the dense path")
    from oasis_sglang.config import OasisConfig, OasisConfigError

    try:
        OasisConfig(budget_tokens=a.budget, block_size=a.block_size, predictor=a.predictor)
    except OasisConfigError as e:
        ap.error(str(e))
    from tqdm import tqdm

    from oasis_sglang.models import prepare_smollm2
    from oasis_sglang.sglang_glue.log_line import parse_decode_counters
    from oasis_sglang.testing.launch import base_args, free_port, has_cuda, launch, oasis_args

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model = str(prepare_smollm2())
    ctx = a.input_len + a.output_len + 64
    rows = []
    for dense in tqdm((True, False), desc="bench_dense_path"):
        cfg = dict(budget_tokens=a.budget, block_size=a.block_size, predictor=a.predictor, dense_short_contexts=dense)
        args = base_args(max_total_tokens=max(65536, a.requests * ctx), max_running_requests=a.requests) + [
            "--page-size", str(a.block_size), "--context-length", str(max(ctx, a.budget + 64)),
            "--decode-log-interval", "8"] + oasis_args(**cfg)
        name = f"dense_short_contexts_{str(dense).lower()}"
        srv = launch(model, free_port(), args, out / f"server_{name}.log", echo=False)
        try:
            t0 = time.time()
            res = bench_serving(srv.url, model, a, out / f"bench_serving_{name}.txt", out / f"serving_{name}.jsonl")
            res["wall_s"] = round(time.time() - t0, 1)
            lines = srv.residency_lines()
            last = parse_decode_counters(lines[-1]) if lines else {}
            res.update(dense_short_contexts=dense, decode_steps=last.get("decode_steps"),
                       dense_steps=last.get("dense_steps"), admitted_blocks=last.get("admitted_blocks"))
        finally:
            srv.stop()
        rows.append(res)
    meta = {"model": "SmolLM2-135M-Instruct", "device": "cuda" if has_cuda() else "cpu",
            "date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(a)}
    (out / "bench_dense_path.json").write_text(json.dumps({"meta": meta, "runs": rows}, indent=1))
    print(f"{a.requests} requests x ({a.input_len} in + {a.output_len} out), budget {a.budget}, block {a.block_size}, "
          f"predictor {a.predictor}, {meta['device']}")
    print("| dense_short_contexts | output tok/s | median TPOT ms | median TTFT ms | decode steps | dense steps |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {str(r['dense_short_contexts']).lower()} | {r['output_tok_s']} | {r['median_tpot_ms']} | "
              f"{r['median_ttft_ms']} | {r['decode_steps']} | {r['dense_steps']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
