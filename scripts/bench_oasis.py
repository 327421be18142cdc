"""OasisKV vs dense SGLang, side by side on one GPU host, through SGLang's own ``bench_serving``.

    python scripts/bench_oasis.py --suite paired [--input-len 16384] [--output-len 128] [--batch 8]
                                  [--out out/bench_oasis]

Each system is a real ``sglang serve`` on the Qwen3-8B-shaped dummy model (``$M``, random weights,
``--load-format dummy``; its EAGLE-3 dummy draft is ``$D``; both from ../shared/gpu-host), started
one after the other on the same GPU. For each, ``python -m sglang.bench_serving`` sends
``--batch`` random-id prompts of ``--input-len`` tokens at concurrency ``--batch`` (all running at
once) and ``--output-len`` output tokens each, greedy, ``ignore_eos``. Reported per system:

* decode tok/s: the median of the server's ``Decode batch ... gen throughput`` log lines at the
  most requests that ran at once (SGLang's own figure; long prefills can keep that below
  ``--batch``), and that count;
* step ms: ``running / decode tok/s`` (one decode step; with a draft, one paired forward + draft);
* output tok/s, median TPOT and ITL: from ``bench_serving``;
* for oasis: the last ``OasisKV decode`` line (hit rate, H2D, exposed wait, draft match).

Suites:
  paired   the paired forward in SGLang's own step: ``oasis`` vs ``oasis-eagle3`` (and
           ``dense``, ``dense-eagle3`` for reference); issue 4's <= 1.15x target is
           step(oasis-eagle3) / step(oasis).

  throughput  issue 5 (1): ``dense`` with the KV pool of an 80 GB GPU (``--mem-fraction-static
           0.475``: 22 requests of 16K) vs ``oasis`` with a host tier of ``--batch`` requests
           (decode steps in CUDA graphs); e.g. ``--batch 32 --input-len 16384 --output-len 256
           --predictor previous``.

Random weights give no real draft acceptance and no real attention pattern: these runs measure
speed only; the predicted top-K is used as if it were real (the pipeline does the same work).
Writes ``<out>/bench_oasis.md`` (table), ``.json`` (raw) and each server's log.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

from oasis_sglang.sglang_glue.launch import launch, oasis_args

DECODE = re.compile(r"Decode batch.*?#running-req: (\d+).*?gen throughput \(token/s\): ([\d.]+)")
SERVING = {"output_tok_s": r"Output token throughput \(tok/s\):\s+([\d.]+)",
           "median_tpot_ms": r"Median TPOT \(ms\):\s+([\d.]+)",
           "median_itl_ms": r"Median ITL \(ms\):\s+([\d.]+)",
           "median_ttft_ms": r"Median TTFT \(ms\):\s+([\d.]+)",
           "completed": r"Successful requests:\s+(\d+)"}
EAGLE = ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "1", "--speculative-eagle-topk", "1",
         "--speculative-num-draft-tokens", "2"]
SUITES = {"paired": ["oasis", "oasis-eagle3", "dense", "dense-eagle3"],
          "throughput": ["dense", "oasis"]}
# throughput suite: the KV pool an 80 GB GPU holds for Qwen3-8B (issue 5; 367,922 tokens on the H200)
DENSE_80GB_MEM_FRACTION = 0.475


def system_args(name: str, a) -> list[str]:
    """Server flags of system ``name`` (``dense``, ``dense-eagle3``, ``oasis``, ``oasis-eagle3``).

    ``paired``: every system gets a KV pool (host tier for oasis) of exactly ``--batch`` requests.
    ``throughput``: dense gets the 80 GB-equivalent pool (``--mem-fraction-static 0.475``) and runs
    as many requests as fit there; oasis gets a host tier of ``--batch`` requests (its device
    memory holds only the working sets), so ``--batch`` is what the host tier allows.
    """
    ctx = a.input_len + a.output_len + 64
    args = ["--load-format", "dummy", "--attention-backend", "triton", "--sampling-backend", "pytorch",
            "--max-running-requests", str(a.batch), "--context-length", str(ctx),
            "--log-level", "info", "--decode-log-interval", "10"]
    if a.suite == "throughput" and name == "dense":
        args += ["--mem-fraction-static", str(DENSE_80GB_MEM_FRACTION)]
    else:
        args += ["--max-total-tokens", str(a.batch * ctx)]
    if name.startswith("dense"):
        args += ["--disable-prefill-cuda-graph", "--cuda-graph-max-bs", str(max(8, a.batch))]
    else:
        cfg = {"budget_tokens": a.budget, "kernels": "triton"}
        if a.fetch_cap is not None:
            cfg["fetch_cap"] = a.fetch_cap
        if a.predictor:
            cfg["predictor"] = a.predictor
        args += oasis_args(**cfg)
        if not name.endswith("eagle3"):
            args += ["--cuda-graph-max-bs", str(max(8, a.batch))]
        if a.eager:
            args += ["--disable-cuda-graph"]
    if name.endswith("eagle3"):
        args += EAGLE + ["--speculative-draft-model-path", os.environ["D"]]
    return args


def bench_serving(url: str, a, tag: str, out: Path) -> dict:
    """``sglang.bench_serving`` with all ``--batch`` prompts at once; the figures it prints."""
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", url,
           "--dataset-name", "random-ids", "--random-input-len", str(a.input_len), "--random-output-len",
           str(a.output_len), "--random-range-ratio", "1", "--num-prompts", str(a.batch), "--max-concurrency",
           str(a.batch), "--tokenize-prompt", "--tokenizer", os.environ["M"], "--model", os.environ["M"],
           "--disable-tqdm", "--seed", "1", "--output-file", str(out / f"serving_{tag}.jsonl")]
    if os.environ.get("DS"):
        cmd += ["--dataset-path", os.environ["DS"]]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
    (out / f"bench_serving_{tag}.txt").write_text(" ".join(cmd) + "\n" + r.stdout + "\n" + r.stderr[-4000:])
    if r.returncode:
        raise RuntimeError(f"bench_serving for {tag} exited {r.returncode}: {r.stderr[-2000:]}")
    res = {}
    for k, pat in SERVING.items():
        m = re.search(pat, r.stdout)
        res[k] = float(m.group(1)) if m else None
    return res


def run_system(name: str, a, out: Path) -> dict:
    """Start system ``name``, benchmark it, stop it; its figures (``error`` when it failed)."""
    log_path = out / f"server_{name}.log"
    t0 = time.time()
    try:
        srv = launch(os.environ["M"], 0, system_args(name, a), log_path, timeout=a.timeout, echo=False)
    except Exception as e:  # noqa: BLE001 - report and go on with the next system
        return {"system": name, "error": f"start failed: {e.__class__.__name__}: {str(e)[:300]}"}
    try:
        res = {"system": name, "start_s": round(time.time() - t0, 1)}
        res.update(bench_serving(srv.url, a, name, out))
        log = srv.log()
        lines = [(int(n), float(g)) for n, g in DECODE.findall(log)]
        top = max((n for n, _ in lines), default=0)       # prefills stagger arrivals: not always --batch
        full = [g for n, g in lines if n == top]
        res["max_running"] = top
        res["decode_lines_at_max_running"] = len(full)
        res["decode_tok_s"] = statistics.median(full) if full else None
        res["step_ms"] = 1e3 * top / res["decode_tok_s"] if res["decode_tok_s"] else None
        lines = srv.residency_lines()
        res["oasis_line"] = lines[-1].split("OasisKV decode: ", 1)[-1] if lines else None
        return res
    except Exception as e:  # noqa: BLE001
        return {"system": name, "error": f"{e.__class__.__name__}: {str(e)[:500]}"}
    finally:
        srv.stop()


def table(results: list[dict], a) -> str:
    """Markdown table; ``x step`` is each system's step time over the first one with the same base."""
    base = {r["system"]: r.get("step_ms") for r in results}
    lines = [f"Qwen3-8B-shaped dummy (random weights), suite {a.suite}: {a.batch} requests of {a.input_len} input "
             f"tokens sent together, {a.output_len} output tokens each; oasis budget {a.budget}, fetch_cap "
             f"{a.fetch_cap or 'default (8)'}, predictor {a.predictor or 'default'}, "
             f"{'eager' if a.eager else 'decode CUDA graphs'}"
             + (f"; dense KV pool --mem-fraction-static {DENSE_80GB_MEM_FRACTION}" if a.suite == "throughput" else "")
             + ".", "",
             "| system | most running | decode tok/s there | step ms | step vs same system without draft | output tok/s | "
             "median TPOT ms | median ITL ms |", "|---|---|---|---|---|---|---|---|"]
    f = lambda x, p=1: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    for r in results:
        if "error" in r:
            lines.append(f"| {r['system']} | failed: {r['error'][:120]} | | | | | | |")
            continue
        ref = base.get(r["system"].replace("-eagle3", "")) if r["system"].endswith("eagle3") else None
        ratio = r["step_ms"] / ref if ref and r.get("step_ms") else None
        lines.append(f"| {r['system']} | {r.get('max_running', '-')} | {f(r['decode_tok_s'])} | {f(r['step_ms'], 2)} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}x'} | {f(r['output_tok_s'])} | "
                     f"{f(r['median_tpot_ms'], 2)} | {f(r['median_itl_ms'], 2)} |")
    for r in results:
        if r.get("oasis_line"):
            lines.append(f"\n{r['system']}: last OasisKV decode line: `{r['oasis_line'][:900]}`")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=sorted(SUITES), default="paired")
    ap.add_argument("--systems", nargs="+", default=None, help="override the suite's systems")
    ap.add_argument("--input-len", type=int, default=16384)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="requests running together (= prompts = concurrency)")
    ap.add_argument("--budget", type=int, default=2048, help="oasis budget_tokens")
    ap.add_argument("--fetch-cap", type=int, default=None, help="oasis fetch_cap (default: the config's)")
    ap.add_argument("--predictor", default=None, choices=["previous", "lookahead", "current"],
                    help="oasis predictor (default: the config's: lookahead with a draft, else current)")
    ap.add_argument("--eager", action="store_true", help="oasis without CUDA graphs")
    ap.add_argument("--timeout", type=int, default=900, help="seconds for a server start / one bench_serving run")
    ap.add_argument("--out", default=os.environ.get("OUT", "out") + "/bench_oasis")
    a = ap.parse_args()
    for var in ("M",) + (("D",) if any(s.endswith("eagle3") for s in (a.systems or SUITES[a.suite])) else ()):
        if not os.environ.get(var):
            ap.error(f"environment variable {var} must name the model folder (source the gpu-host kit's env.sh)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    systems = a.systems or SUITES[a.suite]
    for name in tqdm(systems, desc=f"bench_oasis {a.suite}", file=sys.stderr):
        r = run_system(name, a, out)
        print(json.dumps(r), file=sys.stderr, flush=True)
        results.append(r)
        md = table(results, a)          # written after every system: a cut-short run keeps what it measured
        (out / "bench_oasis.md").write_text(md + "\n")
        (out / "bench_oasis.json").write_text(json.dumps({"args": vars(a), "results": results}, indent=1))
    print(md)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
