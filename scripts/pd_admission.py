#!/usr/bin/env python3
"""PD admission traffic with partial KV on SmolLM2 (issue 19), on CPU over NIXL loopback.

A real prompt (Paul Graham essays) goes through SmolLM2-135M-Instruct once (teacher-forced,
``eval/sparse_sim.py`` records every layer's post-RoPE K/V/Q); its KV is then prefilled into one
OasisKV engine (the prefill node), admitted into another with only the dense layers' KV, the
sparse layers' min/max summaries and the first decode step's working set (``disagg/admission.py``),
and decoded there for ``--decode-steps`` steps, missing blocks READ on demand over NIXL
(``disagg/transport.py``, ``core/remote.py``). Prints bytes at admission against a full transfer,
bytes fetched while decoding, and the decode outputs against colocated decode.

    python scripts/pd_admission.py --prompt 5000 --budget 512 --block-size 8 --decode-steps 64
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # this checkout's package, not an installed copy

import torch  # noqa: E402

from oasis_sglang.argtypes import positive_int  # noqa: E402
from oasis_sglang.config import OasisConfig, OasisConfigError  # noqa: E402


def record(prompt: int, steps: int, budget: int, bs: int):
    """SmolLM2's post-RoPE K/V (every layer) and queries (sparse layers) over ``prompt + steps``
    essay tokens; returns ``(kv, queries, sim_prefix, num_layers)``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oasis_sglang.eval import sparse_sim
    from oasis_sglang.models import essay_texts, prepare_smollm2

    folder = prepare_smollm2()
    tok = AutoTokenizer.from_pretrained(folder)
    ids = []
    for _, text in essay_texts():
        ids.extend(tok.encode(text, add_special_tokens=False))
        if len(ids) >= prompt + steps:
            break
    ids = torch.tensor(ids[:prompt + steps])
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32,
                                                 attn_implementation=sparse_sim.register()).eval()
    cfg = sparse_sim.SimConfig(prefix_len=prompt - 1, budget_tokens=budget, block_size=bs, record=True)
    with torch.no_grad(), sparse_sim.simulate(cfg):
        model(ids[None])
    return cfg.kv, cfg.queries, prompt - 1, model.config.num_hidden_layers


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=positive_int, default=5000, help="prompt tokens")
    ap.add_argument("--decode-steps", type=positive_int, default=64)
    ap.add_argument("--budget", type=positive_int, default=512, help="budget_tokens")
    ap.add_argument("--block-size", type=positive_int, default=8)
    ap.add_argument("--summary-dtype", choices=["bf16", "model"], default="bf16",
                    help="the summaries' dtype at admission (bf16: rounded outward)")
    ap.add_argument("--pd-read-mode", choices=["wait", "deferred"], default="wait",
                    help="the decode node's pd_read_mode (wait: outputs == colocated; deferred: serving's default)")
    ap.add_argument("--out", type=Path, default=Path("out/pd_admission"))
    a = ap.parse_args()
    try:
        cfg = OasisConfig(budget_tokens=a.budget, block_size=a.block_size, predictor="previous",
                          pd_read_mode=a.pd_read_mode)
    except OasisConfigError as e:
        ap.error(str(e))
    if a.prompt <= a.budget:
        ap.error(f"--prompt {a.prompt} must exceed --budget {a.budget} (a shorter prompt is held whole)")
    from oasis_sglang.disagg.measure import measure_admission

    t0 = time.time()
    kv, q, sim_prefix, layers = record(a.prompt, a.decode_steps, a.budget, a.block_size)
    r = measure_admission(kv, q, sim_prefix, cfg, layers,
                          summary_dtype=torch.bfloat16 if a.summary_dtype == "bf16" else None)
    r.update(budget=a.budget, block_size=a.block_size, summary_dtype=a.summary_dtype, pd_read_mode=a.pd_read_mode,
             seconds=round(time.time() - t0, 1),
             date=time.strftime("%Y-%m-%d"))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(r, indent=1))
    mb = lambda x: f"{x / 2**20:.2f} MiB"  # noqa: E731
    print(f"SmolLM2-135M, {r['prompt_tokens']}-token prompt, budget {a.budget}, block {a.block_size}, "
          f"summaries {a.summary_dtype}, {r['steps']} decode steps")
    print("| full transfer | admission | of which sparse-layer packet | dense layers | full / admission | "
          "fetched while decoding | decode-node pieces holding data |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {mb(r['full'])} | {mb(r['admission'])} | {mb(r['packet'])} | {mb(r['dense_layers'])} | "
          f"**{r['ratio']:.2f}x** | {mb(r['fetched'])} in {r['remote_reads']} reads | "
          f"{r['decode_host_pieces']} / {r['request_pieces']} ({r['decode_host_pieces'] / r['request_pieces']:.1%}) |")
    print(f"PD decode (pd_read_mode {a.pd_read_mode}) vs colocated decode: max |diff| {r['max_abs_diff']:.3g}, "
          f"relative error mean {r['rel_err_mean']:.3g} / max {r['rel_err_max']:.3g}, steps bitwise equal "
          f"{r['steps_equal']} of {r['steps']}, pieces left out of a plan first {r['deferred_pieces']}; "
          f"bitwise equal: {r['equal']}; "
          f"lost peers: {r['lost'] or 'none'}; {r['seconds']} s; wrote {a.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
