"""core/host_tier.py: the host-memory KV store of the sparse layers (layout, reads, pinning)."""

import pytest
import torch

from oasis_sglang.core.host_tier import HostTier
from oasis_sglang.core.ops import TorchKVOps


def test_host_tier_layout_and_roundtrip(seed):
    H, D, Dv, bs, P = 3, 8, 6, 4, 10
    ht = HostTier(2, P, bs, H, D, Dv, torch.float32)
    loc = torch.randperm(P * bs)[:17]
    k, v = torch.randn(17, H, D), torch.randn(17, H, Dv)
    kmin, kmax = torch.zeros(P, H, D), torch.zeros(P, H, D)
    TorchKVOps().write_kv(ht.k[1], ht.v[1], kmin, kmax, loc, k, v, bs)
    # layout: k[layer][head, block, offset, :]
    for i, l in enumerate(loc.tolist()):
        for h in range(H):
            assert torch.equal(ht.k[1][h, l // bs, l % bs], k[i, h])
            assert torch.equal(ht.v[1][h, l // bs, l % bs], v[i, h])
    k2, v2 = ht.read_tokens(1, loc)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    assert ht.k[0].abs().sum() == 0  # other layer untouched


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_host_tier_rejects_bad_pin_threads(bad):
    with pytest.raises(ValueError, match="pin_threads"):
        HostTier(1, 2, 4, 1, 8, 8, torch.float32, pin_threads=bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the host tier is page-locked only with CUDA")
@pytest.mark.parametrize("threads", [1, 4])
def test_host_tier_pinned_by_threads_is_zeroed_pinned_and_in_order(threads):
    H, D, Dv, bs, P, L = 2, 16, 8, 4, 64, 5
    ht = HostTier(L, P, bs, H, D, Dv, torch.bfloat16, pin_memory=True, pin_threads=threads)
    assert len(ht.k) == len(ht.v) == L
    assert all(t.shape == (H, P, bs, D) for t in ht.k) and all(t.shape == (H, P, bs, Dv) for t in ht.v)
    assert len({t.data_ptr() for t in ht.k + ht.v}) == 2 * L
    for t in ht.k + ht.v:
        assert t.is_pinned() and t.abs().sum() == 0
    # a non-blocking copy from a registered buffer reads it (flag 0: registered with this device)
    ht.v[L - 1][1, P - 1].fill_(2.0)
    got = ht.v[L - 1][1, P - 1].to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert float(got.float().sum()) == 2.0 * bs * Dv
