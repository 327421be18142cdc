"""OasisStats (host counters of the decode loop) and the residency report of an engine.

The report is what the ``OasisKV decode:`` log line (``sglang_glue/log_line.py``) and the
Prometheus metrics (``sglang_glue/metrics.py``) publish. Building it reads device counters and
timing events (host syncs), so the glue builds one only every ``--decode-log-interval`` steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

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


def residency(eng: "OasisSparseKV") -> dict:
    """KV residency of the last decode step, traffic counters and memory sizes.

    Drains the prefetch pipeline, confirms the host prediction record against the device one
    and checks that no decoded token missed its block. Byte counts are bytes; ``*_tokens`` are
    tokens (layer 0, KV head 0 for the working set); counters are since start-up.

    Returns:
        A dict with the keys ``predictor, context_tokens, device_working_set_tokens,
        budget_tokens, sparse_layers, working_set_bytes, summary_bytes, host_tier_bytes,
        decode_steps, hit_blocks, admitted_blocks, evicted_blocks, bytes_h2d, bytes_d2h,
        sync_steps, graph_steps, dense_steps, exposed_wait_ms, exposed_wait_timed, agreement,
        prediction_check, transfer_budget_bytes`` (bytes a step may admit; ``None``: unlimited).
    Raises:
        RuntimeError: a decoded token found its block not resident (``WorkingSet.check``).
    """
    eng.pipe.drain()
    eng.record.confirm()
    eng.ws.check()
    s = eng.stats
    hits, admitted, evicted, written_back = (int(x) for x in eng.counters.sum(0).tolist())
    ctx, held = [], []
    if eng.last_batch is not None:
        rows, seq = eng.last_batch
        if isinstance(rows, list):           # recorded by a replayed step (host values)
            rows = torch.tensor(rows, dtype=torch.int64, device=eng.device)
            seq = torch.tensor(seq, dtype=torch.int64, device=eng.device)
        ids0 = eng.ws.ids[0][rows, 0]                                      # [B, K], layer 0, KV head 0
        held = ((seq[:, None] - ids0 * eng.bs).clamp(0, eng.bs) * (ids0 >= 0)).sum(-1).tolist()
        ctx = seq.tolist()
    agree = eng.stages.agreement.tolist()
    return {
        "predictor": eng.predictor.name,
        "context_tokens": ctx,
        "device_working_set_tokens": held,
        "budget_tokens": eng.cfg.budget_tokens,
        "sparse_layers": len(eng.sparse_layers),
        "working_set_bytes": eng.ws.nbytes,
        "summary_bytes": eng.summaries.nbytes,
        "host_tier_bytes": eng.host.nbytes,
        "decode_steps": s.decode_steps,
        "hit_blocks": hits,
        "admitted_blocks": admitted,
        "evicted_blocks": evicted,
        "bytes_h2d": admitted * eng.block_bytes,
        "bytes_d2h": written_back * eng.block_bytes,
        "sync_steps": s.sync_steps,
        "graph_steps": s.graph_steps,
        "dense_steps": s.dense_steps,
        "transfer_budget_bytes": eng.budget.bytes_per_step if eng.budget.enabled else None,
        "exposed_wait_ms": eng.pipe.exposed_wait_ms(),
        "exposed_wait_timed": eng.last_step_timed,
        "agreement": [a / t if t else None for a, t in agree] if eng.cfg.measure_agreement else None,
        "prediction_check": "host" if eng.record.trusted else "device",
    }
