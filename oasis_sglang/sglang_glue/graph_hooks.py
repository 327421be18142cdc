"""The dense path for short contexts in SGLang's decode CUDA graphs.

SGLang 0.5.17's ``DecodeCudaGraphRunner`` (``model_executor/runner/decode_cuda_graph_runner.py``)
keys its graphs by ``ShapeKey(size, stream_idx, variant_label)``: with LoRA it captures a
"lora" and a "nolora" graph of each batch size (``_capture_one_stream``) and picks one per
step with ``_resolve_lora_variant`` (``can_run_graph`` and ``load_batch``, the latter after the
attention backend's ``init_forward_metadata_out_graph``). OasisKV uses the same mechanism:

* ``capture_one_shape_hook`` (AROUND ``capture_one_shape``): after SGLang captured a batch
  size, capture it once more with the variant label plus ``"+oasis_dense"`` while
  ``OasisRuntime.capture_dense`` is set, so the engine's capture step is the dense path's
  (``OasisSparseKV.begin_decode_step(mode="capture", dense=True)``: no selection, no copy);
* ``resolve_variant_hook`` (AFTER ``_resolve_lora_variant``): a step whose replay bookkeeping
  chose the dense path (``DecodeStep.dense``, stored as ``OasisRuntime.replay_dense`` by
  ``OasisAttnBackend.init_forward_metadata_out_graph``) replays that graph.

Only the target model's runner with ``--kv-sparse oasis`` and ``dense_short_contexts`` takes
part (``OasisSparseKV.can_capture_dense``); the draft model's runners are left alone. The
second capture of every batch size costs start-up time and graph memory (not measured yet: no
GPU was lent when this was written). The choice is engine-wide: a target-model runner that
overrode ``capture_one_shape`` without SGLang's (none in 0.5.17) would find no dense graph.
"""

from __future__ import annotations

import logging

from .runtime import OasisRuntime, runtime_of

logger = logging.getLogger(__name__)

DENSE_VARIANT = "oasis_dense"


def dense_label(label: str | None) -> str:
    """The variant label of the dense-path graph beside SGLang's ``label`` (``None``, or LoRA's
    "lora" / "nolora")."""
    return DENSE_VARIANT if label is None else f"{label}+{DENSE_VARIANT}"


def _target_runtime(runner) -> OasisRuntime | None:
    """The OasisKV runtime of a decode CUDA-graph runner of the target model, else ``None``."""
    mr = getattr(runner, "model_runner", None)
    if mr is None or getattr(mr, "is_draft_worker", False):
        return None
    return runtime_of(getattr(mr, "req_to_token_pool", None))


def capture_one_shape_hook(original, self, size, forward, stream_idx=None, variant_label=None, *args, **kwargs):
    """AROUND ``DecodeCudaGraphRunner.capture_one_shape``: SGLang's capture of this batch size,
    then (the target model with the dense path on) the dense-path variant of it."""
    out = original(self, size, forward, stream_idx, variant_label, *args, **kwargs)
    rt = _target_runtime(self)
    if rt is None or not rt.engine.can_capture_dense():
        return out
    if not getattr(self, "_oasis_dense_logged", False):
        self._oasis_dense_logged = True
        logger.info("OasisKV: each decode batch size is captured twice, the full path and the dense path for "
                    "short contexts (graph variant %r; dense_short_contexts: false captures one)", DENSE_VARIANT)
    rt.capture_dense = True
    try:
        original(self, size, forward, stream_idx, dense_label(variant_label), *args, **kwargs)
    finally:
        rt.capture_dense = False
    return out


def resolve_variant_hook(result, self, forward_batch, *args, **kwargs):
    """AFTER ``DecodeCudaGraphRunner._resolve_lora_variant``: the dense-path graph's label when
    the step's replay bookkeeping chose the dense path, else SGLang's label."""
    rt = _target_runtime(self)
    if rt is None or not rt.replay_dense:
        return result
    return dense_label(result)
