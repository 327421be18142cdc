"""Host-side facts of an SGLang ``ForwardBatch`` the glue passes to the engine.

SGLang 0.5.17's ``ForwardBatch`` (``model_executor/forward_batch_info.py``) keeps its request
rows on the device and its lengths on both sides (``seq_lens`` / ``seq_lens_cpu``); the rows
reach the host through the scheduler hook (``scheduler_hooks.run_batch_hook``).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_warned_host = 0


def max_seq_len(forward_batch) -> int | None:
    """``max(seq_lens)`` (tokens) from SGLang's host copy of the lengths, when the batch carries one."""
    cpu = getattr(forward_batch, "seq_lens_cpu", None)
    return int(cpu.max()) if cpu is not None and cpu.numel() else None


_MISMATCH_LOGGED = 5     # batches whose lengths differed, logged as errors (then only counted)
_mismatch_events = 0


def host_lengths(forward_batch, rows: list[int], extra: int, runtime=None) -> list[int] | None:
    """Each of ``rows``' context (``seq_lens + extra`` tokens; host integers, batch order) with
    no device read, or ``None`` when the host has none.

    SGLang's host copy (``seq_lens_cpu``) when the batch carries one. With
    ``runtime.record_lengths`` (a draft that is never accepted: every step adds exactly one
    token per request) the prediction record's lengths (``PredictionRecord.lengths_host``)
    when it knows every row: SGLang then publishes no host copy under its overlap scheduler
    (the attention backend declares ``needs_cpu_seq_lens`` False), and where it still does
    (the CPU engine, other backends asking for it) the two are compared: a difference is
    counted in ``runtime.length_mismatches``, logged as an error, the record's host mirror is
    dropped (rebuilt from the device record at the next report) and SGLang's lengths are used.

    Args:
        rows: the batch's request rows (its first ``len(rows)`` lengths are used; a captured
            batch's padding follows them). A host copy shorter than ``rows`` gives ``None``.
        extra: tokens added to every length (1 for the paired verify pass's decode row).
    """
    global _mismatch_events
    B = len(rows)
    cpu = getattr(forward_batch, "seq_lens_cpu", None)
    if cpu is not None and len(cpu) < B:
        return None                  # a copy that does not cover the batch: trust neither source
    truth = None if cpu is None else (cpu[:B] + extra).tolist()
    eng = None if runtime is None else runtime.engine
    rec = eng.record.lengths_host(rows) if eng is not None and runtime.record_lengths \
        and eng.predictor.asynchronous else None      # (a synchronous predictor keeps no record per step)
    if rec is None:
        return truth
    if truth is not None and truth != rec:
        bad = [(r, a, b) for r, a, b in zip(rows, rec, truth) if a != b]
        runtime.length_mismatches += len(bad)
        _mismatch_events += 1
        if _mismatch_events <= _MISMATCH_LOGGED:
            logger.error("OasisKV: the prediction record's lengths differ from SGLang's for %d of %d rows (row, "
                         "record, SGLang: %s); SGLang's are used and the record's host mirror is rebuilt",
                         len(bad), B, bad[:4])
        runtime.engine.record.distrust()
        return truth
    return rec


def host_rows(forward_batch, stashed: list[int] | None = None, extra: int = 0, runtime=None):
    """``(request rows, seq_lens + extra)`` as host integer lists, else ``(None, None)``.

    Args:
        stashed: the scheduler's rows of the batch (``OasisRuntime.batch_rows_host``).
        extra: tokens added to every length (1 for the paired verify pass).
        runtime: the ``OasisRuntime`` (its prediction record's lengths: ``host_lengths``).

    Without them the engine's per-step check reads the device (logged the first 5 times)."""
    global _warned_host
    B = forward_batch.req_pool_indices.shape[0]
    rows = stashed if stashed is not None and len(stashed) == B else None
    cpu = getattr(forward_batch, "seq_lens_cpu", None)
    if cpu is not None and len(cpu) != B:         # (an eager batch is not padded: another batch's copy)
        rows = None
    seq = None if rows is None else host_lengths(forward_batch, rows, extra, runtime)
    if rows is None or seq is None:
        if _warned_host < 5:
            logger.info("OasisKV: a %s batch carries no host copy of its rows (%s) or lengths (%s) for %d requests; "
                        "this step's prediction check reads the device (and decode steps run eagerly until the "
                        "next OasisKV decode line rebuilds the host record)", forward_batch.forward_mode,
                        None if rows is None else len(rows), None if seq is None else len(seq), B)
            _warned_host += 1
        return None, None
    return list(rows), seq


def extend_host(forward_batch, stashed: list[int] | None):
    """``(rows, prefix_lens, extend_lens)`` of an extend batch as host integer lists (the
    scheduler's rows and SGLang's ``extend_prefix_lens_cpu`` / ``extend_seq_lens_cpu``), or
    ``None`` when the batch lacks one of them or their lengths differ from its rows': the engine
    then reads the device (``OasisSparseKV.extend_attention``)."""
    B = forward_batch.req_pool_indices.shape[0]
    pre = getattr(forward_batch, "extend_prefix_lens_cpu", None)
    ext = getattr(forward_batch, "extend_seq_lens_cpu", None)
    if stashed is None or pre is None or ext is None or not len(stashed) == len(pre) == len(ext) == B:
        return None
    return list(stashed), list(pre), list(ext)
