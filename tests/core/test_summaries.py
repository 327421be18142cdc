"""8-bit key summaries rounded outwards (core.summaries.quantize_outward): the interval always
contains the exact one, so the Quest score stays an upper bound of every key's q . k."""

import pytest
import torch

from oasis_sglang.core.selection import quest_scores
from oasis_sglang.core.summaries import SUMMARY_FORMATS, _e4m3_grid, dequantize, quantize_outward
from oasis_sglang.eval import sparse_sim


def _keys(NB, H, bs, D):
    """Keys whose magnitudes span 10 decades across (block, KV head) vectors, with exact zeros."""
    k = torch.randn(NB, bs, H, D) * 10.0 ** torch.randint(-6, 4, (NB, 1, H, 1)).float()
    k[0] = 0.0                                                  # an all-zero block
    k[1, :, :, 0] = 0.0                                         # a zero coordinate
    return k


@pytest.mark.parametrize("fmt", SUMMARY_FORMATS)
def test_the_interval_contains_the_exact_summary_and_is_tight(seed, fmt):
    k = _keys(64, 3, 8, 32)
    kmin, kmax = k.amin(1), k.amax(1)                               # [NB, H, D]
    qlo, qhi, scale = quantize_outward(kmin, kmax, fmt)
    assert qlo.dtype == qhi.dtype == (torch.int8 if fmt == "int8" else torch.float8_e4m3fn)
    assert qlo.shape == kmin.shape and scale.shape == kmin.shape[:-1] and scale.dtype == torch.float32
    lo, hi = dequantize(qlo, scale), dequantize(qhi, scale)
    assert (lo <= kmin).all() and (hi >= kmax).all()
    assert torch.equal(lo[0], torch.zeros_like(lo[0])) and torch.equal(hi[0], torch.zeros_like(hi[0]))
    # tight: at most one step of the format outside (int8: one scale; e4m3: 1/8 of the value, or
    # the smallest subnormal step near zero)
    if fmt == "int8":
        slack = scale[..., None] * 1.0001
    else:
        slack = torch.maximum(kmax.abs(), kmin.abs()) / 8 * 1.0001 + scale[..., None] * 2.0 ** -9
    assert ((kmin - lo) <= slack).all() and ((hi - kmax) <= slack).all()
    assert ((hi - lo) <= (kmax - kmin) + 2 * slack).all()


@pytest.mark.parametrize("fmt", SUMMARY_FORMATS)
def test_the_quest_score_stays_an_upper_bound_of_every_key(seed, fmt):
    NB, H, G, bs, D = 48, 2, 3, 16, 64
    k = _keys(NB, H, bs, D)
    q = torch.randn(1, H * G, D) * 10.0 ** torch.randint(-3, 3, (1, H * G, 1)).float()
    kmin, kmax = k.amin(1), k.amax(1)
    qlo, qhi, scale = quantize_outward(kmin, kmax, fmt)
    s8 = quest_scores(q, dequantize(qlo, scale)[None], dequantize(qhi, scale)[None])[0]     # [H, NB]
    exact = quest_scores(q, kmin[None], kmax[None])[0]
    dots = torch.einsum("hgd,nthd->hgnt", q[0].view(H, G, D).double(), k.double()).amax(-1).amax(1)   # [H, NB]
    tol = 1e-5 * (q.abs().amax() * k.abs().amax(1).amax(-1).T.double() * D)                  # fp32 sums
    assert (s8.double() >= dots - tol).all()
    assert (s8.double() >= exact.double() - tol).all()


def test_the_e4m3_grid_is_every_finite_value_once():
    g = _e4m3_grid("cpu")
    assert len(g) == 253 and g[0] == -448 and g[-1] == 448 and (g[1:] > g[:-1]).all()
    assert torch.equal(g.to(torch.float8_e4m3fn).float(), g)


@pytest.mark.parametrize("bad, match", [
    (dict(fmt="int4"), "summary format"),
    (dict(kmax=torch.zeros(3, 5)), "differ in shape"),
    (dict(kmin=torch.full((3, 4), float("-inf"))), "finite"),
    (dict(kmax=torch.full((3, 4), float("nan"))), "finite"),
])
def test_bad_input_is_refused_naming_it(bad, match):
    args = dict(kmin=torch.zeros(3, 4), kmax=torch.ones(3, 4), fmt="int8") | bad
    with pytest.raises(ValueError, match=match):
        quantize_outward(args["kmin"], args["kmax"], args["fmt"])


def test_the_simulation_scores_8_bit_summaries_and_records_their_agreement(seed):
    H, G, T, D, P, bs = 2, 2, 160, 16, 100, 8
    q, k, v = torch.randn(1, H * G, T, D), torch.randn(1, H, T, D), torch.randn(1, H, T, D)
    outs = {}
    for fmt in (None, "int8"):
        cfg = sparse_sim.SimConfig(prefix_len=P, budget_tokens=48, block_size=bs, dense_layers=(), summary_dtype=fmt)
        with sparse_sim.simulate(cfg):
            outs[fmt], _ = sparse_sim.oasis_sim_attention(type("L", (), {"layer_idx": 2})(), q, k, v, None)
        if fmt is None:
            assert cfg.summary_agreement == {}
        else:
            s, n = cfg.summary_agreement[2]
            assert n == (T - P) * H and 0.5 < s / n <= 1          # int8 rarely changes a random top-K
    assert torch.equal(outs[None][:, :P], outs["int8"][:, :P])    # prefill is dense either way
    with pytest.raises(ValueError, match="summary_dtype"):
        sparse_sim.SimConfig(prefix_len=P, summary_dtype="fp16")
