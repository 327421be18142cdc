"""OasisRuntime: what the glue keeps for one model runner, shared by its hooks.

Attached to SGLang's ``ReqToTokenPool`` (``req_to_token_pool._oasis``), which the scheduler,
the model runner and the decode CUDA-graph runner all reach.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OasisRuntime:
    """Attributes:
        engine: the model's ``core.OasisSparseKV``.
        batch_rows_host: request rows of the batch the scheduler runs now (host integers,
            batch order; ``scheduler_hooks.run_batch_hook``), or ``None``.
        capture_dense: the decode CUDA-graph runner is capturing the dense-path variant of a
            batch size (``graph_hooks.capture_one_shape_hook``).
        replay_dense: the last replayed step's bookkeeping chose the dense-path graph
            (``DecodeStep.dense``; read by ``graph_hooks.resolve_variant_hook``).
        log: the engine's ``log_line.DecodeLog`` (its queued lines are written when their
            copies land: at a later step, or when a request is freed).
        record_lengths: decode and paired-verify steps take their host lengths from the
            engine's prediction record (``batch_info.host_lengths``), so the attention backend
            asks SGLang for no host copy of ``seq_lens`` (``needs_cpu_seq_lens`` False: spec v2's
            overlap scheduler then launches step ``t+1`` without waiting for step ``t``'s verify).
            Set with a draft that is never accepted (``install``; ``server_args.record_lengths``:
            on for the CPU engine, on a GPU only with ``OASIS_RECORD_LENGTHS=1``).
        length_mismatches: rows whose record length differed from SGLang's host length where
            the batch carried both (the first batches logged as errors; the record's host
            mirror is then rebuilt). Where SGLang carries none, each replay compares the record
            on the device (``OasisSparseKV.replay_misses``, checked at each report).
    """

    engine: object
    batch_rows_host: list[int] | None = None
    capture_dense: bool = False
    replay_dense: bool = False
    log: object = None
    record_lengths: bool = False
    length_mismatches: int = 0


def runtime_of(req_to_token_pool) -> OasisRuntime | None:
    """The runtime attached to SGLang's ``ReqToTokenPool``, or ``None`` (``--kv-sparse none``,
    or the draft model's pool)."""
    return getattr(req_to_token_pool, "_oasis", None)
