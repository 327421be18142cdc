"""Triton kernels of OasisKV (imported as ``oasis_sglang.kernels``), each beside its torch reference.

  write_kv.py       1. host-tier write fused with the per-block min/max key summaries
  topk.py           2. Quest block scoring (GQA max) + top-K with forced sink/recent blocks
  sparse_decode.py  3. split-K decode attention over head-wise working sets (1-2 query rows, LSE)
  copy_blocks.py    4. zero-copy H2D gather / D2H write-back of (KV head, block) pieces
  paged_attention.py 5. split-KV causal attention of 1-2 new tokens per request over SGLang's
                    token-major pool (the paired forward's dense layers and the draft layer)
  plan_transfer.py  6. capped-eviction plan of a layer fused with its admissions' copy lists
                    (6b: the candidates a per-step transfer budget may refuse)
  share_budget.py   6c. one layer's step budget shared across (request, KV head) by score rank
  append_tokens.py  7. decoded tokens into their resident slots + write-back of completed blocks
  replay_churn.py   8. (benchmarks only) the churn replay of one layer in one launch (``bench_oasis --churn``)
  dense_plan.py     9. the dense path's working-set update (short contexts) of every layer in one launch

``TritonKVOps`` bundles them behind ``core.ops.BaseKVOps``; ``get_kv_ops(name)`` is the lazy
factory over the registry ``{"torch", "triton"}`` (Triton is imported only when asked for).
Tests: ``tests/kernels/test_kernels.py`` (CPU under ``TRITON_INTERPRET=1``; marker ``gpu`` on CUDA).
Speed: ``scripts/bench_kernels.py``.
"""

from __future__ import annotations

import importlib

KV_OPS = {
    "torch": "oasis_sglang.core.ops:TorchKVOps",
    "triton": "oasis_sglang.kernels.triton_ops:TritonKVOps",
}


def get_kv_ops(name: str):
    """A new ops object of backend ``name`` (``"torch"`` or ``"triton"``).

    Raises:
        ValueError: unknown backend name.
    """
    if name not in KV_OPS:
        raise ValueError(f"OasisKV kernels: unknown backend {name!r}; choose one of {sorted(KV_OPS)}")
    mod, cls = KV_OPS[name].split(":")
    return getattr(importlib.import_module(mod), cls)()
