"""scripts/bench_kernels.py's plan section builds valid inputs for the kernels it times: run on
the CPU at small shapes (Triton's interpreter), every kernel is called and its result is
consistent (the kernels' exactness against their references is tests/kernels')."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_kernels  # noqa: E402


def _recorder():
    """An ``add`` for the bench sections that calls each timed function once and keeps its result
    by kernel name, instead of timing it."""
    seen = {}

    def add(kernel, shape, fn, nbytes, bound, **kw):
        seen[kernel] = fn()
        assert nbytes > 0 and bound == "hbm"
    return seen, add


def test_the_plan_section_times_the_select_stage_kernels_on_valid_inputs():
    seen, add = _recorder()

    raw = {}
    bench_kernels.plan_section(add, raw, B=3, ctx=512, K=8, cap=2, dev="cpu")
    assert len(seen) == 7 and raw["plan_section"]["candidates_per_layer"] > 0
    fin, unl = seen["budget_candidates (6b), finite budget"], seen["budget_candidates (6b), unlimited"]
    assert bool((fin >= 0).any()) and bool((unl == -1).all()), "a finite budget lists candidates, unlimited none"
    assert seen["share_budget (6c), unlimited"].tolist() == [fin.shape[1]] * fin.shape[0]
    p = raw["plan_section"]                        # the shares of the candidates listed before the plans ran
    assert int(seen["share_budget (6c), finite budget"].sum()) == min(p["budget_blocks"], p["candidates_per_layer"])
    w, f = seen["replay_churn (kernel 8, benchmarks)"]
    assert w.shape == (3, 8, 8) and f.dtype == torch.bool


def test_the_scoring_section_times_bf16_and_int8_summaries_on_valid_inputs():
    seen, add = _recorder()

    raw = {}
    bench_kernels.scoring_section(add, raw, B=2, ctx=1024, K=8, dev="cpu")
    assert len(seen) == 4 and len(raw["scoring_section"]) == 2
    w16, f16 = seen["select_topk, bf16 summaries"]
    w8, f8 = seen["select_topk, int8 + scale summaries"]
    assert w8.shape == w16.shape == (2, 8, 8) and torch.equal(f8, f16)       # the same forced blocks
    agree = (w8[..., :, None] == w16[..., None, :]).any(-1).float().mean()
    assert agree > 0.8, f"int8 summaries rounded outwards pick mostly the bf16 top-K ({agree:.2f})"


def test_the_attention_section_sweeps_launches_that_keep_the_result():
    """Each launch of the sweep is checked against the default launch before it is timed; the
    default and the fastest are timed (on CPU: called once, at a tiny shape)."""
    seen, add = _recorder()
    raw = {}
    sweep = ((None, 64, 4, 2), (2, 32, 4, 2), (4, 64, 8, 3))
    bench_kernels.attention_section(add, raw, B=2, ws_tokens=128, dev="cpu", sweep=sweep)
    res = raw["attention_section"]["B=2, 128-token working set"]
    assert list(res) == ["splits=auto,block_n=64,warps=4,stages=2", "splits=2,block_n=32,warps=4,stages=2",
                         "splits=4,block_n=64,warps=8,stages=3"]
    assert all(v == 0.0 for v in res.values()), res          # none changed the result
    o, _ = seen["sparse_decode_attention (default)"]
    assert o.shape == (2, 1, 32, 128) and bool(torch.isfinite(o).all())


def test_the_attention_section_reports_a_launch_that_fails_and_goes_on():
    """A launch that does not compile (``block_n`` 48: not a power of two) is reported in the raw
    results and the sweep times the others; a working set that is not whole blocks is refused."""
    import pytest

    seen, add = _recorder()
    raw = {}
    bench_kernels.attention_section(add, raw, B=1, ws_tokens=64, dev="cpu", sweep=((None, 48, 4, 2), (None, 64, 4, 2)))
    res = raw["attention_section"]["B=1, 64-token working set"]
    assert res["splits=auto,block_n=48,warps=4,stages=2"].startswith("failed: ")
    assert res["splits=auto,block_n=64,warps=4,stages=2"] == 0.0 and "sparse_decode_attention (default)" in seen
    with pytest.raises(ValueError, match="ws_tokens 136"):
        bench_kernels.attention_section(add, {}, B=1, ws_tokens=136, dev="cpu")
