"""OasisKV core: torch only, no SGLang import (tested on CPU).

Pieces (paper: Methodology):
  host_tier.HostTier          full KV cache of the sparse layers in host memory
  summaries.KeySummaries      per-block, per-KV-head min/max keys (Quest)
  selection                   Quest upper-bound scoring and top-K block selection
  working_set.WorkingSet      bounded device slot pool + head-wise block table
  attention                   reference attention (prefill over host KV, decode over the working set)
  ops                         the hot operations behind BaseKVOps; TorchKVOps = references
                              (oasis_sglang.kernels.TritonKVOps implements them in Triton)
  prefetch                    predictors and the predict/select/transfer PrefetchPipeline (streams)
  stages.PrefetchStages       the three stage functions over the engine's state
  prediction.PredictionRecord which context each row's working set was predicted for (device + host)
  step.DecodeStep, StepMode   one decode batch as the layers see it (eager / capture / replay)
  report                      OasisStats and the residency report
  bench_hooks.BenchHooks      benchmark / test switches (never set in serving)
  engine.OasisSparseKV        construction, writes, prefill, begin_decode_step, per-layer decode
"""
from .engine import OasisSparseKV  # noqa: F401
from .step import DecodeStep, StepMode  # noqa: F401
