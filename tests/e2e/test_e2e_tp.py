"""Tensor parallelism end to end: ``--tp 3`` with ``--kv-sparse oasis`` on SGLang's CPU engine
serving SmolLM2-135M-Instruct (9 attention heads, 3 KV heads: one KV head per rank, each rank
with its own engine, host tier share, summaries and working set; gloo collectives).

(a) prompts the budget covers: greedy output equals ``--tp 1`` dense, except where dense's own
    top-2 log-probabilities nearly tie (TP sums the row-parallel layers' partial products in
    another order: bitwise equality is not SGLang's either): up to 464 tokens at budget 512,
    block 8, and 1600 and 2203 tokens (a chunked prefill) at budget 4096, block 16;
(b) the longest needle prompt (6000 tokens, 12x the budget): the needle is found, with each
    rank's working set bounded;
(c) one start-up line naming the ranks' split and one ``OasisKV decode`` line per interval for
    the server (rank 0), not one per rank.
(a) at budget 512 and (b) share one server.
The plugin sets SGLang's CPU environment for TP itself (``server_args._cpu_tp_env``): these
servers start without ``SGLANG_NCCL_SO_PATH`` or ``SGLANG_CPU_OMP_THREADS_BIND``. A bad TP size
is refused in tests/glue/test_server_args.py.
"""

import os
import re

import pytest

from oasis_sglang import needle
from oasis_sglang.sglang_glue.log_line import parse_residency
from oasis_sglang.testing.launch import base_args, launch, oasis_args
from test_e2e import (NEEDLE_CASES, NEEDLE_CFG, OUT, _exact_prompts, assert_dense_or_near_tie, chat, dense_reference,
                      generate_ids, short_prompts)

pytestmark = pytest.mark.e2e
TP = ["--tp", "3"]


@pytest.fixture()
def cpu_env_unset(monkeypatch):
    for var in ("SGLANG_NCCL_SO_PATH", "SGLANG_CPU_OMP_THREADS_BIND"):
        monkeypatch.delenv(var, raising=False)


def test_tp3_oasis_equals_tp1_dense_where_the_budget_covers_and_finds_the_needle_where_not(model, tok, cpu_env_unset):
    prompts = short_prompts(tok)
    n_new = 24
    ref = dense_reference(model, prompts, n_new)                 # --tp 1 dense, shared with the PD tests
    srv = launch(model, 0, base_args() + TP + oasis_args(**NEEDLE_CFG), OUT / "tp3_oasis_512.log")
    try:
        got = [generate_ids(srv.url, p, n_new) for p in prompts]
        for tokens, depth in NEEDLE_CASES[-1:]:        # the longest (test_e2e.py runs all three)
            p = needle.build(tok, tokens, depth)
            assert len(needle.chat_ids(tok, p.messages)) >= 4 * 512
            o = chat(srv.url, p.messages)
            assert p.answer in o, f"--tp 3 oasis (budget 512) lost the needle at ({tokens}, {depth}): {o!r}"
            res = parse_residency(srv.residency_lines()[-1])
            assert res["budget"] == 512 and max(res["device"]) <= 512
        log = srv.log()
    finally:
        srv.stop()
    assert all(len(p) + n_new <= NEEDLE_CFG["budget_tokens"] for p in prompts)
    assert_dense_or_near_tie(prompts, ref, got, "tp3_oasis_vs_tp1_dense")
    starts = [ln for ln in log.splitlines() if "OasisKV: " in ln and "per TP rank: " in ln]
    assert len(starts) == 1 and "per TP rank: 3 ranks, 1 KV head(s) each" in starts[0], starts
    ranks = set(re.findall(r"\[[^\]]* (TP\d)\] OasisKV decode:", log))
    assert ranks == {"TP0"}, f"decode lines from {ranks}: want rank 0's only"
    assert os.environ.get("SGLANG_CPU_OMP_THREADS_BIND") is None, "the plugin set it in the server, not here"


def test_tp3_oasis_equals_tp1_dense_at_long_prompts_the_budget_covers(model, tok, cpu_env_unset):
    """1600 and 2203 tokens (the latter a chunked prefill: SGLang's CPU chunk is 2048 tokens) at
    budget 4096, block 16: each rank's host tier, summaries and working set over many blocks."""
    prompts = _exact_prompts(tok)
    n_new = 24
    ref = dense_reference(model, prompts, n_new)                 # shared with test_e2e_pd.py
    srv = launch(model, 0, base_args() + TP + oasis_args(budget_tokens=4096, kernels="torch"), OUT / "tp3_oasis_full.log")
    try:
        got = [generate_ids(srv.url, p, n_new) for p in prompts]
        assert srv.residency_lines(), "the OasisKV decode path did not run"
    finally:
        srv.stop()
    assert_dense_or_near_tie(prompts, ref, got, "tp3_oasis_full_vs_tp1_dense")
