"""OasisStats (host counters of the decode loop) and the residency report of an engine.

The report is what the ``OasisKV decode:`` log line (``sglang_glue/log_line.py``) and the
Prometheus metrics (``sglang_glue/metrics.py``) publish. It reads device counters and timing
events. ``residency`` reads them at once (a host sync: the host waits for every queued step);
``snapshot`` queues one device-to-host copy of them and ``finish`` reads it once it has landed, so
the decode loop never waits for the device (SGLang's overlap scheduler keeps the GPU a step
ahead of the host; a sync there leaves the GPU idle while the host prepares the next step).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .devcopy import to_device

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from .engine import OasisSparseKV


@dataclass
class OasisStats:
    """Host counters since start-up."""

    decode_steps: int = 0
    sync_steps: int = 0              # steps that selected synchronously although the predictor is async
    graph_steps: int = 0             # decode steps replayed from a CUDA graph (counted in decode_steps)
    dense_steps: int = 0             # eager steps on the dense path for short contexts (no selection)
    new_request_started: bool = False  # a prefill ran before the last decode step
    replay_misses: int = 0           # rows of replayed steps predicted for another context (last report)


@dataclass
class ReportSnapshot:
    """A residency report queued on the device (``snapshot``), read by ``finish``.

    ``packed`` (int64 ``[n]``; page-locked host memory on CUDA) receives, in stream order after
    every queued step, the device values of the report (``sizes``: name -> values): ``counters``
    (4), ``violations`` (1), per request of the last step ``held`` (working-set tokens, ``B``)
    and ``context`` (``B``; absent when the step's values were host lists: ``context_host``),
    ``agreement`` (``2 L``), ``record`` (the device prediction record, ``R``), ``budget`` (the
    step budget's blocks, 1, when it is enabled) and each ``extra`` tensor (flattened).
    """

    host: dict                       # the report's host fields, as they were at the snapshot
    packed: torch.Tensor
    sizes: dict[str, int]             # part name -> int64 values, in ``packed`` order
    record_host: dict[int, int] | None   # a copy of the host mirror at the snapshot (None: not checked)
    context_host: list[int] | None       # contexts of a replayed step (host values), else None
    wait_events: list = field(default_factory=list)
    extra: tuple[str, ...] = ()
    done: "torch.cuda.Event | None" = None   # recorded after the copy (timing enabled); None on CPU

    def ready(self) -> bool:
        """The copy has landed (never waits). Always True on CPU."""
        return self.done is None or self.done.query()


def snapshot(eng: "OasisSparseKV", extra: dict[str, torch.Tensor] | None = None) -> ReportSnapshot:
    """Queue a copy of the report's device values after every queued step (no host sync on CUDA,
    except to rebuild an untrusted prediction mirror, which the next steps would otherwise read
    from the device one by one).

    Args:
        eng: the engine. extra: more device tensors to copy with it (``{name: tensor}``; integer
            values, e.g. the speculative probe's ``[matches, drafts]``); ``finish`` returns them as
            lists under their names.
    Returns:
        a ``ReportSnapshot``; on CUDA its ``done`` event (timing enabled) also marks the point of
        the stream the report is about.
    """
    eng.pipe.drain()
    if not eng.record.trusted:
        eng.record.confirm()                 # a host read, rare: only after a step without host rows
    dev = eng.device
    parts = {"counters": eng.counters.sum(0), "violations": eng.ws.violations,
             "replay_misses": eng.replay_misses, "held": None, "context": None,
             "agreement": eng.stages.agreement, "record": eng.record.seq,
             "budget": eng.budget.blocks if eng.budget.enabled else None}
    context_host = None
    if eng.last_batch is not None:
        rows, seq = eng.last_batch
        if isinstance(rows, list):           # recorded by a replayed step (host values)
            context_host = [int(x) for x in seq]
            rows, seq = to_device(rows, dev), to_device(seq, dev)
        else:
            parts["context"] = seq
        ids0 = eng.ws.ids[0][rows, 0]                                      # [B, K], layer 0, KV head 0
        parts["held"] = ((seq[:, None] - ids0 * eng.bs).clamp(0, eng.bs) * (ids0 >= 0)).sum(-1)
    for k, t in (extra or {}).items():
        if k in parts:
            raise ValueError(f"snapshot: extra name {k!r} is one of the report's own parts")
        parts[k] = t
    parts = {k: t.reshape(-1).to(torch.int64) for k, t in parts.items() if t is not None}
    packed = torch.cat(list(parts.values()))
    done = None
    if dev.type == "cuda":
        host_buf = torch.empty(packed.shape, dtype=torch.int64, pin_memory=True)
        host_buf.copy_(packed, non_blocking=True)
        done = torch.cuda.Event(enable_timing=True)
        done.record(torch.cuda.current_stream(dev))
        packed = host_buf
    s = eng.stats
    host = {
        "predictor": eng.predictor.name,
        "budget_tokens": eng.cfg.budget_tokens,
        "sparse_layers": len(eng.sparse_layers),
        "working_set_bytes": eng.ws.nbytes,
        "summary_bytes": eng.summaries.nbytes,
        "host_tier_bytes": eng.host.nbytes,
        "decode_steps": s.decode_steps,
        "sync_steps": s.sync_steps,
        "graph_steps": s.graph_steps,
        "dense_steps": s.dense_steps,
        "exposed_wait_timed": eng.last_step_timed,
    }
    return ReportSnapshot(host, packed, {k: t.numel() for k, t in parts.items()}, dict(eng.record.host),
                          context_host, eng.pipe.wait_events(), tuple((extra or {}).keys()), done)


def finish(eng: "OasisSparseKV", snap: ReportSnapshot) -> dict:
    """The report of a snapshot (waits for its copy if it has not landed: check ``ready`` first
    to never wait). Confirms the host prediction mirror of the snapshot against the device record
    copied with it (``PredictionRecord.confirm_copy``) and checks the invariant.

    Returns:
        the ``residency`` dict, plus one list per ``extra`` name.
    Raises:
        RuntimeError: a decoded token found its block not resident (the invariant
            ``WorkingSet.check`` reads, here from the copy).
    """
    if snap.done is not None:
        snap.done.synchronize()
    vals, got, i = snap.packed.tolist(), {}, 0
    for k, n in snap.sizes.items():
        got[k], i = vals[i:i + n], i + n
    (misses,) = got["replay_misses"]
    if misses > eng.stats.replay_misses:
        # the host replayed steps for rows whose working set was predicted for another context:
        # its lengths or its record were wrong; the mirror is rebuilt from the device below
        logger.error("OasisKV: %d rows of replayed decode steps had a working set predicted for another context "
                     "than theirs (%d since start-up; the host's lengths or its record of predictions were wrong); "
                     "the host record is rebuilt from the device", misses - eng.stats.replay_misses, misses)
        eng.record.distrust()
    eng.stats.replay_misses = max(eng.stats.replay_misses, misses)
    (violations,) = got["violations"]
    if violations:
        raise RuntimeError(f"OasisKV invariant: {violations} decoded token(s) found their block not resident")
    held = got.get("held", [])
    ctx = snap.context_host if snap.context_host is not None else got.get("context", [])
    checked = snap.record_host is not None and eng.record.confirm_copy(snap.record_host, got["record"])
    if not eng.record.trusted:
        # found wrong (a bug, logged as an error): rebuilt from the device now, a host read, so
        # the steps (and, with TP, every rank's CUDA-graph decision) do not read the device
        # until the next report
        eng.record.confirm()
    hits, admitted, evicted, written_back = got["counters"]
    agree_flat = got["agreement"]
    agree = list(zip(agree_flat[0::2], agree_flat[1::2]))
    r = dict(snap.host)
    wait = [0.0 if ev is None else ev[0].elapsed_time(ev[1]) for ev in snap.wait_events]
    r.update({
        "context_tokens": ctx,
        "device_working_set_tokens": held,
        "hit_blocks": hits,
        "admitted_blocks": admitted,
        "evicted_blocks": evicted,
        "bytes_h2d": admitted * eng.block_bytes,
        "bytes_d2h": written_back * eng.block_bytes,
        "exposed_wait_ms": wait,
        "transfer_budget_bytes": eng.budget.bytes_for(got["budget"][0]) if "budget" in got else None,
        "agreement": [a / t if t else None for a, t in agree] if eng.cfg.measure_agreement else None,
        "prediction_check": "host" if checked else "device",
        "replay_misses": misses,
    })
    r.update({k: got[k] for k in snap.extra})
    return r


def residency(eng: "OasisSparseKV") -> dict:
    """KV residency of the last decode step, traffic counters and memory sizes, read now
    (``finish(eng, snapshot(eng))``: a host sync).

    Drains the prefetch pipeline, confirms the host prediction record against the device one
    and checks that no decoded token missed its block. Byte counts are bytes; ``*_tokens`` are
    tokens (layer 0, KV head 0 for the working set); counters are since start-up.

    Returns:
        A dict with the keys ``predictor, context_tokens, device_working_set_tokens,
        budget_tokens, sparse_layers, working_set_bytes, summary_bytes, host_tier_bytes,
        decode_steps, hit_blocks, admitted_blocks, evicted_blocks, bytes_h2d, bytes_d2h,
        sync_steps, graph_steps, dense_steps, exposed_wait_ms, exposed_wait_timed, agreement,
        prediction_check, transfer_budget_bytes`` (bytes a step may admit; ``None``: unlimited),
        ``replay_misses`` (rows of replayed steps whose working set the device record says was
        predicted for another context than the step's; an error is logged when it grows).
    Raises:
        RuntimeError: a decoded token found its block not resident (``finish``).
    """
    return finish(eng, snapshot(eng))
