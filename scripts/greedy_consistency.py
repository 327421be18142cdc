#!/usr/bin/env python3
"""Do two server environments give the same greedy tokens? One bench_oasis system (its flags from
``oasis_sglang.bench.serving.system_args``), started once per environment variant, answers the same
random-id prompts one at a time (no batch effects: the same kernels see the same shapes), and the
token ids are compared.

For an environment switch that must not change what is computed, only when it is computed, e.g.
SGLang's overlap scheduler with the speculative paired forward (``OASIS_SPEC_OVERLAP``,
``sglang_glue/server_args._overlap_args``). With a working set smaller than the context the tokens
depend on which blocks each step selected, so a stale working set or sequence length shows up as a
divergence. On the GPU host (``M`` / ``D``: the Qwen3-8B-shaped dummy and its EAGLE-3 draft,
``.gpuhost/kit/env.sh``)::

    python scripts/greedy_consistency.py --system oasis-eagle3 --predictor lookahead \\
        --input-len 4096 --output-len 64 --prompts 4 --budget 1024 \\
        --variant OASIS_SPEC_OVERLAP=0 --variant OASIS_SPEC_OVERLAP=1 --out $OUT/greedy

Writes ``<out>/greedy.json`` (per variant: token ids and log-probabilities per prompt, the last
``OasisKV decode`` line; written also when a variant fails) and prints, per prompt, the first
position where a variant leaves the first one and the largest log-probability difference. Exit
status 0 when every token and log-probability is equal, 1 when any differs, 2 on a bad argument
or a server that does not start, 3 when a request fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
from pathlib import Path

import requests

from oasis_sglang.argtypes import positive_int
from oasis_sglang.bench.serving import Run, system_args


def variant(text: str) -> dict:
    """``"A=1,B=x"`` -> ``{"A": "1", "B": "x"}`` (``""``: the inherited environment).

    Raises:
        argparse.ArgumentTypeError: an item without ``=``.
    """
    out = {}
    for item in filter(None, text.split(",")):
        k, eq, v = item.partition("=")
        if not eq or not k.strip():
            raise argparse.ArgumentTypeError(f"--variant: {item!r} is not NAME=VALUE")
        out[k.strip()] = v.strip()
    return out


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` random token ids in ``[100, vocab)``."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def greedy(url: str, ids: list[int], n: int, timeout: float) -> tuple[list[int], list[float]]:
    """The server's greedy continuation of ``ids``: ``n`` token ids (EOS ignored) and their
    log-probabilities (a different selection changes these even where the token stays)."""
    r = requests.post(url + "/generate", json={
        "input_ids": ids, "return_logprob": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}, timeout=timeout)
    r.raise_for_status()
    out = r.json()["meta_info"]["output_token_logprobs"]
    return [t[1] for t in out], [t[0] for t in out]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where ``a`` and ``b`` differ (the shorter length if one is a
    prefix of the other), ``None`` when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def logprob_difference(a: list, b: list) -> float:
    """Largest ``|a[i] - b[i]|`` over the positions both have (``0.0`` when none). A position
    where exactly one side is NaN or missing (``None``) counts as ``inf``; both NaN or both
    ``None`` count as equal (compared as they are, so the order of the positions never matters)."""
    worst = 0.0
    for x, y in zip(a, b):
        if x is None or y is None:
            d = 0.0 if x is None and y is None else math.inf
        elif math.isnan(x) or math.isnan(y):
            d = 0.0 if math.isnan(x) and math.isnan(y) else math.inf
        else:
            d = abs(x - y)
        worst = max(worst, d)
    return worst


def main(argv=None) -> int:
    from oasis_sglang.testing.launch import launch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--system", default="oasis-eagle3", choices=["dense", "oasis", "dense-eagle3", "oasis-eagle3"])
    ap.add_argument("--predictor", default=None, choices=["previous", "lookahead", "current"],
                    help="oasis predictor (default: lookahead with a draft, previous without)")
    ap.add_argument("--input-len", type=positive_int, default=4096, help="prompt tokens")
    ap.add_argument("--output-len", type=positive_int, default=64, help="tokens generated per prompt")
    ap.add_argument("--prompts", type=positive_int, default=4)
    ap.add_argument("--budget", type=positive_int, default=1024, help="oasis budget_tokens (below --input-len: "
                    "the tokens then depend on the selection)")
    ap.add_argument("--fetch-cap", type=positive_int, default=None)
    ap.add_argument("--variant", type=variant, action="append", required=True,
                    help="NAME=VALUE[,NAME=VALUE] set for one server (give it twice or more)")
    ap.add_argument("--vocab", type=positive_int, default=32000, help="prompt ids are drawn below this")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=positive_int, default=900, help="seconds for a server start / one request")
    ap.add_argument("--out", default=os.environ.get("OUT", "out") + "/greedy")
    a = ap.parse_args(argv)
    if len(a.variant) < 2:
        ap.error("--variant: give at least two to compare")
    draft = a.system.endswith("eagle3")
    for var in ("M",) + (("D",) if draft else ()):
        if not os.environ.get(var):
            ap.error(f"set {var} (the model path; D: the draft's, for an -eagle3 system), as .gpuhost/kit/env.sh does")
    if a.predictor is None:
        a.predictor = "lookahead" if draft else "previous"
    if a.predictor == "lookahead" and not draft:
        ap.error(f"--predictor lookahead needs a draft model: --system {a.system} has none (use previous or current)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    run = Run(f"greedy/{a.input_len}/{a.system}", a.system, a.input_len, a.output_len, 1, "exact",
              None if a.system.startswith("dense") else a.fetch_cap)
    a.eager = False
    args = system_args(run, a)
    ps = prompts(a.prompts, a.input_len, a.vocab, a.seed)
    results = []

    def save(diffs=None, lp_diff=None):
        (out / "greedy.json").write_text(json.dumps({
            "args": args, "input_len": a.input_len, "output_len": a.output_len, "variants": results,
            "first_difference": diffs, "max_logprob_diff": lp_diff}, indent=1))

    for i, env in enumerate(a.variant):
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        ids, lps, lines, failed = [], [], [], None
        try:
            log = out / f"server_{i}.log"
            try:
                srv = launch(os.environ["M"], 0, args, log, timeout=a.timeout, echo=False)
            except Exception as e:  # noqa: BLE001 - report which variant failed, keep what was collected
                print(f"variant {env}: the server did not start: {e}", file=sys.stderr)
                save()
                return 2
            try:
                for j, p in enumerate(ps):
                    i_, l_ = greedy(srv.url, p, a.output_len, a.timeout)
                    ids.append(i_)
                    lps.append(l_)
                    print(f"variant {env}: prompt {j}: {ids[-1][:8]}...", flush=True)
                lines = [ln for ln in srv.log().splitlines() if "OasisKV decode:" in ln]
            except Exception as e:  # noqa: BLE001 - a failed request is not a difference
                failed = f"{e.__class__.__name__}: {e}"
            finally:
                srv.stop()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        results.append({"env": env, "ids": ids, "logprobs": lps, "oasis_line": lines[-1] if lines else None,
                        **({"error": failed} if failed else {})})
        if failed:
            print(f"variant {env}: a request failed: {failed}", file=sys.stderr)
            save()
            return 3
    diffs = [[first_difference(results[0]["ids"][j], r["ids"][j]) for j in range(len(ps))] for r in results[1:]]
    # log-probabilities at every position both outputs have (after a differing token they differ
    # anyway): bitwise equal when the same blocks were attended with the same kernels
    lp_diff = [max((logprob_difference(results[0]["logprobs"][j], r["logprobs"][j]) for j in range(len(ps))),
                   default=0.0) for r in results[1:]]
    save(diffs, lp_diff)
    same_ids = all(d is None for row in diffs for d in row)
    same_lp = all(x == 0.0 for x in lp_diff)
    for r, row, lp in zip(results[1:], diffs, lp_diff):
        print(f"{r['env']} vs {results[0]['env']}: first differing token per prompt: {row}; "
              f"largest log-probability difference: {lp:.3g}")
    print("greedy_consistency: " + ("SAME tokens" if same_ids else "DIFFERENT tokens")
          + ("" if not same_ids else ", same log-probabilities" if same_lp else ", DIFFERENT log-probabilities"))
    return 0 if same_ids and same_lp else 1
