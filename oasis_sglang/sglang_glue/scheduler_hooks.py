"""Hooks on SGLang's scheduler, request table and decode CUDA-graph runner.

Each finds the model's :class:`~.runtime.OasisRuntime` on SGLang's ``ReqToTokenPool`` and
delegates to the engine; without ``--kv-sparse oasis`` (or on the draft model) they do nothing.
"""

from __future__ import annotations

from .batch_info import host_lengths
from .runtime import runtime_of


def run_batch_hook(self, batch, *args, **kwargs):
    """BEFORE ``Scheduler.run_batch``: record the batch's request rows (host integers, batch
    order), so the per-step prediction check and the CUDA-graph replay decision need no device
    read (SGLang 0.5.17's ForwardBatch keeps its rows on the device)."""
    rt = runtime_of(getattr(self, "req_to_token_pool", None))
    if rt is not None:
        reqs = getattr(batch, "reqs", None)
        rows = None if reqs is None else [r.req_pool_idx for r in reqs]
        rt.batch_rows_host = None if rows is None or any(r is None for r in rows) else rows
        if getattr(rt, "pd_decode", False):
            from oasis_sglang.disagg.sglang_hooks import _tp_group, abort_lost

            abort_lost(batch, _tp_group(self))
    return None


def can_run_graph_hook(result, self, forward_batch, *args, **kwargs):
    """AFTER ``DecodeCudaGraphRunner.can_run_graph``: replay a decode step (or the paired
    TARGET_VERIFY step, whose decode row's context is ``seq_lens + 1``) only when the OasisKV
    engine says every row was predicted for this context (``OasisSparseKV.can_replay``, host
    values only); otherwise SGLang runs it eagerly and the engine selects synchronously."""
    if not result:
        return result
    mr = getattr(self, "model_runner", None)
    rt = runtime_of(getattr(mr, "req_to_token_pool", None))
    mode = forward_batch.forward_mode
    if rt is None or getattr(mr, "is_draft_worker", False) or not (mode.is_decode() or mode.is_target_verify()):
        return result
    planned = getattr(forward_batch, "needs_forward_metadata_init", None)
    if planned is not None and not planned():
        # SGLang asks again after it loaded the graph's inputs (the EAGLE verify path:
        # eagle_prepare_for_verify, then ModelRunner._forward_raw): the replay's bookkeeping ran
        # at that load and advanced the record, and the batch is planned for the replay only
        return result
    rows = rt.batch_rows_host
    B = forward_batch.batch_size
    if rows is None or len(rows) != B:
        return False
    extra = 1 if mode.is_target_verify() else 0     # the paired verify's decode row: one more token
    seq = host_lengths(forward_batch, rows, extra, rt)
    return seq is not None and rt.engine.can_replay(rows, seq)


def req_free_hook(self, req, *args, **kwargs):
    """BEFORE ``ReqToTokenPool.free``: free the request's working set, and write the
    ``OasisKV decode`` lines whose copies have landed (the last request of a run finishes with
    no later step to write them)."""
    rt = runtime_of(self)
    if rt is not None and req.req_pool_idx is not None:
        rt.engine.reset_rows([req.req_pool_idx])
        if rt.log is not None:
            rt.log.poll()
    return None


def on_idle_hook(self, *args, **kwargs):
    """BEFORE ``Scheduler.on_idle`` (before ``--sleep-on-idle`` sleeps): once the scheduler has
    no request left, write the ``OasisKV decode`` lines still queued (the overlap scheduler's
    extra step after the last request can queue one after its ``ReqToTokenPool.free``); the
    device has nothing else to do, so waiting for their copies costs no step."""
    rt = runtime_of(getattr(self, "req_to_token_pool", None))
    if rt is not None and rt.log is not None and rt.log.pending() and self.is_fully_idle():
        rt.log.poll(wait=True)
    return None


def req_clear_hook(result, self, *args, **kwargs):
    """AFTER ``ReqToTokenPool.clear``: free every working set."""
    rt = runtime_of(self)
    if rt is not None:
        rt.engine.reset_rows(list(range(rt.engine.ws.R)))
    return result
