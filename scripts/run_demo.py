#!/usr/bin/env python3
"""The main job: SmolLM2-135M-Instruct answers a question about a fact planted in a long essay
prompt, served by SGLang with ``--kv-sparse oasis`` (budget 512 tokens) and, for comparison,
dense. Prints both answers and the KV residency (host tier vs device working set).

    python scripts/run_demo.py [--tokens 5000] [--depth 0.5] [--budget 512]

Runs on CPU (SGLang's CPU engine) when there is no GPU. Expects the patches applied and the
package installed (scripts/main.sh does both).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


LOG_EVERY = 4


def _counter_deltas(first: str, last: str) -> dict:
    """Differences of the cumulative counters (``parse_decode_counters``: decode steps, admitted /
    evicted blocks, H2D MiB) between two ``OasisKV decode`` lines; a field either lacks is left out."""
    from oasis_sglang.sglang_glue.log_line import parse_decode_counters

    a, b = parse_decode_counters(first), parse_decode_counters(last)
    return {k: b[k] - a[k] for k in ("decode_steps", "admitted_blocks", "evicted_blocks", "h2d_mib")
            if a[k] is not None and b[k] is not None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=5000, help="haystack length in tokens (default 5000)")
    p.add_argument("--depth", type=float, default=0.5, help="needle depth in [0, 1] (default 0.5)")
    p.add_argument("--budget", type=int, default=512, help="OasisKV budget_tokens (default 512)")
    p.add_argument("--block-size", type=int, default=8,
                   help="OasisKV block_size (default 8: SmolLM2's head_dim is 64, see docs/benchmarks.md)")
    p.add_argument("--port", type=int, default=0, help="server port (default 0: a free port)")
    p.add_argument("--no-dense", action="store_true", help="skip the dense comparison run")
    p.add_argument("--out", type=Path, default=ROOT / "out" / "demo")
    a = p.parse_args()
    from oasis_sglang.config import OasisConfig

    try:                  # refused here, not after a 1.5-2 min server start
        OasisConfig(budget_tokens=a.budget, block_size=a.block_size)
    except ValueError as e:
        p.error(f"--budget / --block-size: {e}")
    if not 0 <= a.port <= 65535:
        p.error(f"--port {a.port}: want 0 (a free port) to 65535")
    if not 0 <= a.depth <= 1:          # also refuses nan
        p.error(f"--depth {a.depth}: want a number in [0, 1]")

    import openai
    from transformers import AutoConfig, AutoTokenizer

    from oasis_sglang import needle
    from oasis_sglang.models import prepare_smollm2
    from oasis_sglang.sglang_glue.log_line import parse_residency
    from oasis_sglang.testing.launch import base_args, has_cuda, launch, oasis_args

    model = str(prepare_smollm2())
    tok = AutoTokenizer.from_pretrained(model)
    try:
        prompt = needle.build(tok, a.tokens, a.depth)
    except ValueError as e:
        p.error(f"--tokens / --depth: {e}")
    n_prompt = len(needle.chat_ids(tok, prompt.messages))
    ctx = getattr(AutoConfig.from_pretrained(model), "max_position_embeddings", None)
    if ctx is not None and n_prompt + 32 > ctx:
        p.error(f"--tokens {a.tokens}: the prompt is {n_prompt} tokens and the answer 32, above the model's "
                f"context of {ctx} tokens")
    device = "cuda" if has_cuda() else "cpu"
    print(f"model: {model}\ndevice: {device}\nprompt: {n_prompt} tokens of Paul Graham essays, "
          f"needle at depth {a.depth}: {needle.NEEDLE!r}\nquestion: {needle.QUESTION!r}\n", flush=True)

    # an OasisKV decode line every LOG_EVERY steps (SGLang's --decode-log-interval, default 40): the
    # short answer then shows the working set at work, not only its first step
    runs = [("oasis", oasis_args(budget_tokens=a.budget, block_size=a.block_size)
             + ["--decode-log-interval", str(LOG_EVERY)])] + ([] if a.no_dense else [("dense", [])])
    results = {}
    for name, extra in runs:
        t0 = time.time()
        print(f"[{name}] starting SGLang ({' '.join(extra) or '--kv-sparse none'}); log: "
              f"{a.out / f'server_{name}.log'} ...", flush=True)
        srv = launch(model, a.port, base_args(device) + extra, a.out / f"server_{name}.log", echo=False)
        try:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
            t1 = time.time()
            try:
                r = client.chat.completions.create(model=model, messages=prompt.messages, max_tokens=32, temperature=0)
            except openai.APIError as e:
                # a server that died (e.g. the OOM killer took its scheduler) answers as a refused connection
                tail = "\n".join(srv.log().splitlines()[-15:])
                state = ("the server process has exited" if srv.proc.poll() is not None
                         else "the server is still running")
                print(f"[{name}] request failed: {e.__class__.__name__}: {e}; {state}. Last lines of "
                      f"{srv.log_path}:\n{tail}", file=sys.stderr, flush=True)
                return 2
            ans = r.choices[0].message.content.strip()
            results[name] = {"answer": ans, "correct": prompt.answer in ans,
                             "prompt_tokens": r.usage.prompt_tokens, "request_s": round(time.time() - t1, 1)}
            if name == "oasis":
                lines = srv.residency_lines()
                if not lines:
                    raise RuntimeError(f"no OasisKV decode line in {srv.log_path}: is the plugin active?")
                res = parse_residency(lines[-1])
                results[name]["residency"] = res
                mine = [l for l in lines if parse_residency(l)["context"][0] >= n_prompt]   # not the warm-up's
                results[name]["decode"] = _counter_deltas(mine[0], mine[-1]) if mine else {}
                init = [l for l in srv.log().splitlines() if "OasisKV:" in l and "sparse /" in l]
                results[name]["pool"] = init[-1].split("OasisKV: ", 1)[1] if init else ""
        finally:
            srv.stop()
        print(f"[{name}] answer: {ans!r} ({'correct' if results[name]['correct'] else 'WRONG'}), "
              f"{time.time() - t0:.0f} s with start-up", flush=True)

    o = results["oasis"]
    res = o["residency"]
    print("\n" + "=" * 80 + f"\n=== OasisKV KV residency (last OasisKV decode line; one every {LOG_EVERY} decode steps) ===")
    print(f"context (full KV cache in the host tier): {res['context'][0]} tokens")
    print(f"device working set: {res['device'][0]} tokens per sparse layer and KV head (budget {res['budget']}), "
          f"{res['context'][0] / max(1, res['device'][0]):.1f}x fewer than the context")
    d = o.get("decode") or {}
    if len(d) == 4:
        print(f"this request's decode, between its first and last logged step ({d['decode_steps']:.0f} steps): "
              f"{d['admitted_blocks']:.0f} blocks copied in from the host tier ({d['h2d_mib']:.1f} MiB), "
              f"{d['evicted_blocks']:.0f} evicted (for those copies and for the blocks the new tokens start); "
              f"a block = {a.block_size} tokens of one layer and KV head, at most fetch_cap copies per step each")
    print(f"memory: {o['pool']}")
    mem = {k: float(v) for k, v in re.findall(r"(working set|summaries|host tier) ([\d.]+) MiB", o["pool"])}
    if len(mem) == 3:
        dev = mem["working set"] + mem["summaries"]
        print(f"  device total {dev:.1f} MiB (working set + summaries) vs host tier {mem['host tier']:.1f} MiB: "
              f"{mem['host tier'] / dev:.1f}x")
    print("  (working set: all request rows, bounded by the budget; summaries: min/max keys of every block of the\n"
          "   host tier, 2/block_size of its keys, so they grow with --max-total-tokens, not with the budget; request\n"
          "   rows = --max-running-requests + 1, SGLang reserves row 0"
          + ("; on this CPU host device and host tier are both system RAM)" if device == "cpu" else ")"))
    print("\n=== answers ===")
    for name, r in results.items():
        print(f"{name:>6}: {r['answer']!r}  -> {'correct' if r['correct'] else 'WRONG'} (expected {prompt.answer}; "
              f"request {r['request_s']} s)")
    print("  (request times on a 2-core CPU host include the prefill and are not a speed comparison: the GPU figures\n"
          "   are in docs/benchmarks.md)")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "result.json").write_text(json.dumps(results, indent=2))
    print(f"\nresults: {a.out / 'result.json'}; server logs: {a.out}/server_*.log")
    ok = o["correct"] and res["device"][0] <= res["budget"] < res["context"][0]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
