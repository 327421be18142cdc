"""The teacher-forced selection simulation (oasis_sglang.eval.sparse_sim) used by
scripts/measure_agreement.py: attention per decode position over exactly the selected blocks,
and equality with dense when the budget covers the context (real SmolLM2)."""

import types

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from oasis_sglang.core.selection import quest_scores, select_blocks
from oasis_sglang.eval import sparse_sim


def test_block_summaries_cover_partial_blocks(seed):
    k = torch.randn(3, 37, 8)
    lo, hi = sparse_sim.block_summaries(k, 16)
    assert lo.shape == (3, 3, 8)
    full = k[:, :32].reshape(3, 2, 16, 8)
    ref_lo, ref_hi = full.amin(2), full.amax(2)
    assert torch.equal(lo[:2], ref_lo.transpose(0, 1)) and torch.equal(hi[:2], ref_hi.transpose(0, 1))
    assert torch.equal(lo[2], k[:, 32:].amin(1)) and torch.equal(hi[2], k[:, 32:].amax(1))


@pytest.mark.parametrize("predictor", ["current", "previous"])
def test_decode_positions_attend_exactly_the_selected_blocks(seed, predictor):
    H, G, T, D, P, bs = 2, 3, 150, 16, 100, 8
    q, k, v = torch.randn(1, H * G, T, D), torch.randn(1, H, T, D), torch.randn(1, H, T, D)
    cfg = sparse_sim.SimConfig(prefix_len=P, budget_tokens=48, block_size=bs, dense_layers=(), predictor=predictor, chunk=16)
    with sparse_sim.simulate(cfg):
        out, _ = sparse_sim.oasis_sim_attention(types.SimpleNamespace(layer_idx=3), q, k, v, None)
    dense = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
    assert torch.allclose(out[:, :P], dense[:, :P])                    # prefill is dense
    kmin, kmax = sparse_sim.block_summaries(k[0], bs)
    for t in (P, P + 7, T - 1):
        qsel = q[0, :, t - (predictor == "previous")]
        nb, nc = -(-(t + 1) // bs), (t + 1) // bs
        sc = quest_scores(qsel[None], kmin[None, :nb], kmax[None, :nb])
        wanted, _ = select_blocks(sc, torch.tensor([nb]), torch.tensor([nc]), 6, 1, 2)
        for h in range(H):
            blocks = sorted(int(b) for b in wanted[0, h] if b >= 0)
            pos = [p for b in blocks for p in range(b * bs, min(t + 1, (b + 1) * bs))]
            assert len(pos) <= 48
            ref = scaled_dot_product_attention(q[0, h * G:(h + 1) * G, t][:, None], k[0, h, pos][None].expand(G, -1, -1),
                                               v[0, h, pos][None].expand(G, -1, -1))
            assert torch.allclose(out[0, t, h * G:(h + 1) * G], ref[:, 0], atol=1e-5)
    s, n = cfg.agreement[3]
    assert n > 0 and 0 <= s / n <= 1


def test_smollm2_dense_when_budget_covers_context_and_not_below(seed):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oasis_sglang.models import essay_texts, prepare_smollm2

    folder = prepare_smollm2()
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32,
                                                 attn_implementation=sparse_sim.register()).eval()
    ids = torch.tensor(tok.encode(essay_texts()[0][1], add_special_tokens=False)[:240])[None]
    logits = {}
    with torch.inference_mode():
        for budget in (None, 256, 64):
            with sparse_sim.simulate(sparse_sim.SimConfig(prefix_len=160, budget_tokens=budget)) as cfg:
                logits[budget] = model(ids).logits[0, 160:]
    assert torch.allclose(logits[256], logits[None], atol=2e-3, rtol=1e-3)
    assert not torch.allclose(logits[64], logits[None], atol=1e-2)
    assert sorted(cfg.agreement) == list(range(2, model.config.num_hidden_layers))
