"""core/selection.py: the Quest upper bound (GQA max) and top-K block selection."""

import pytest
import torch

from oasis_sglang.core.selection import quest_scores, select_blocks


def test_quest_bound_is_an_upper_bound(seed):
    B, H, G, D, NB, bs = 2, 3, 3, 8, 5, 4
    keys = torch.randn(B, NB, H, bs, D)
    q = torch.randn(B, H * G, D)
    kmin, kmax = keys.amin(3), keys.amax(3)
    u = quest_scores(q, kmin, kmax)                                   # [B, H, NB]
    dots = torch.einsum("bhgd,bnhtd->bhgnt", q.view(B, H, G, D), keys)  # exact scores
    assert (u[:, :, None, :, None] >= dots - 1e-5).all()
    # GQA: the KV head's score is the max of its group's bounds
    per_head = torch.maximum(q.view(B, H, G, 1, D) * kmin.permute(0, 2, 1, 3)[:, :, None],
                             q.view(B, H, G, 1, D) * kmax.permute(0, 2, 1, 3)[:, :, None]).sum(-1)
    assert torch.allclose(u, per_head.amax(2))


def _ref_select(scores, nb, nc, k, sink, recent):
    forced = [j for j in range(nb) if j < sink or j >= nb - recent]
    cand = sorted((j for j in range(nc) if j not in forced), key=lambda j: (-scores[j], j))
    return forced + cand[: max(0, k - len(forced))]


@pytest.mark.parametrize("k,sink,recent", [(6, 1, 2), (4, 0, 1), (10, 2, 3)])
def test_select_blocks_matches_reference(seed, k, sink, recent):
    B, H, NB = 4, 3, 12
    scores = torch.randint(0, 5, (B, H, NB)).float()   # many ties: tie-break must be deterministic
    nb = torch.tensor([12, 7, 3, 1])
    nc = nb - torch.tensor([0, 1, 1, 1])               # last block partial for rows 1..3
    wanted, forced = select_blocks(scores, nb, nc, k, sink, recent)
    assert wanted.shape == (B, H, k)
    for b in range(B):
        for h in range(H):
            ref = _ref_select(scores[b, h].tolist(), int(nb[b]), int(nc[b]), k, sink, recent)
            got = [x for x in wanted[b, h].tolist() if x >= 0]
            assert sorted(got) == sorted(ref), (b, h, got, ref)
            assert len(set(got)) == len(got) == min(k, int(nb[b]))
            nf = int(forced[b, h].sum())
            assert set(wanted[b, h, :nf].tolist()) == {j for j in ref if j < sink or j >= int(nb[b]) - recent}
