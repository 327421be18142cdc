"""core/ops.py: the torch reference operations behind BaseKVOps (TorchKVOps)."""

import pytest
import torch

from oasis_sglang.core.ops import TorchKVOps
from oasis_sglang.core.working_set import WorkingSet


def test_append_tokens_never_writes_a_block_that_is_not_resident(seed):
    ws = WorkingSet(1, 2, 2, 4, 4, 8, 8, torch.float32, "cpu")
    host_k, host_v = torch.zeros(2, 8, 4, 8), torch.zeros(2, 8, 4, 8)
    rtt = torch.arange(64, dtype=torch.int32).view(2, 32)
    ctr = torch.zeros(4, dtype=torch.int64)
    ops = TorchKVOps()
    ws.ids[0, 1] = torch.tensor([[0, 5, -1, -1], [5, 0, -1, -1]])
    rows, pos = torch.tensor([1]), torch.tensor([21])                # block 5: resident on both heads
    ops.append_tokens(ws.k[0], ws.v[0], ws.ids[0], rows, pos, torch.ones(1, 2, 8), torch.ones(1, 2, 8),
                      host_k, host_v, rtt, ws.violations, ctr)
    ws.check()
    assert ws.k[0][1, 0, 1, 1].eq(1).all() and ws.k[0][1, 1, 0, 1].eq(1).all()
    ops.append_tokens(ws.k[0], ws.v[0], ws.ids[0], rows, torch.tensor([11]), torch.full((1, 2, 8), 7.0),
                      torch.ones(1, 2, 8), host_k, host_v, rtt, ws.violations, ctr)    # block 2 (ends it): absent
    assert not (ws.k[0] == 7).any(), "a token whose block is not resident must not be written"
    assert not host_k.any() and int(ctr[3]) == 0, "nor written back to the host tier"
    with pytest.raises(RuntimeError, match="not resident"):
        ws.check()
