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


def host_rows(forward_batch, stashed: list[int] | None = None, extra: int = 0):
    """``(request rows, seq_lens + extra)`` as host integer lists, else ``(None, None)``.

    Args:
        stashed: the scheduler's rows of the batch (``OasisRuntime.batch_rows_host``).
        extra: tokens added to every length (1 for the paired verify pass).

    Without them the engine's per-step check reads the device (logged the first 5 times)."""
    global _warned_host
    B = forward_batch.req_pool_indices.shape[0]
    rows = stashed if stashed is not None and len(stashed) == B else None
    seq = getattr(forward_batch, "seq_lens_cpu", None)
    if rows is None or seq is None or len(seq) != B:
        if _warned_host < 5:
            logger.info("OasisKV: a %s batch carries no host copy of its rows (%s) or lengths (%s) for %d requests; "
                        "this step's prediction check reads the device (and decode steps run eagerly until the "
                        "next OasisKV decode line rebuilds the host record)", forward_batch.forward_mode,
                        None if rows is None else len(rows), None if seq is None else len(seq), B)
            _warned_host += 1
        return None, None
    return list(rows), (seq + extra).tolist()


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
