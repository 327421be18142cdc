"""Compressed keys: per block and KV head, the coordinate-wise min and max of the keys.

Quest (Tang et al., 2024, Sec. 3) bounds a block's attention score by these two vectors;
OasisKV scores them with the (draft) query to pick each KV head's top-K blocks. They are
``2 / bs`` of the key cache (1/16 of the KV cache for bs=16) and live on the device.
The summaries are folded in token by token as K is written (``core.ops.BaseKVOps.write_kv``):
a block's summary is exact once its last token is written, and only complete blocks are
scored (the partial block is always resident as a recent block).
"""

from __future__ import annotations

import torch


class KeySummaries:
    """Device store of block summaries of the sparse layers: ``kmin/kmax[L][P, H, D]``.

    Indexed by SGLang page (= block) id, so shared radix-cache prefixes share summaries.
    """

    def __init__(self, num_layers: int, num_pages: int, head_num: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.kmin = [torch.zeros((num_pages, head_num, head_dim), dtype=dtype, device=device)
                     for _ in range(num_layers)]
        self.kmax = [torch.zeros((num_pages, head_num, head_dim), dtype=dtype, device=device)
                     for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        """Device bytes of all min and max summaries."""
        return sum(t.numel() * t.element_size() for t in self.kmin + self.kmax)
