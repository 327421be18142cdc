"""OasisKV core: torch only, no SGLang import (tested on CPU).

Pieces (paper: Methodology):
  host_tier.HostTier        full KV cache of the sparse layers in host memory
  summaries.KeySummaries    per-block, per-KV-head min/max keys (Quest)
  selection                 Quest upper-bound scoring and top-K block selection
  working_set.WorkingSet    bounded device slot pool + head-wise block table
  attention                 reference attention (prefill over host KV, decode over the working set)
  ops                       the four hot operations behind BaseKVOps; TorchKVOps = references
                            (oasis_sglang.kernels.TritonKVOps implements them in Triton)
  engine.OasisSparseKV      the per-layer decode/prefill orchestration
"""
from .engine import OasisSparseKV  # noqa: F401
