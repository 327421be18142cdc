"""The ``OasisKV decode:`` log line: its format, its one parser, and when it is written.

The line is written at a request's first decode step and every ``--decode-log-interval`` decode
steps (SGLang's own decode log uses the same flag). It reports the engine's device counters
through a copy queued on the device and read once it has landed (``core/report.py``), so the
decode loop never waits for the device for it; the Prometheus metrics (``metrics.py``) are
updated from the same report. Keys are stable: ``scripts/run_demo.py``, ``bench_oasis`` and the tests parse the line with the functions here.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections import deque

from oasis_sglang.config import OasisConfigError
from oasis_sglang.core.report import finish, snapshot

logger = logging.getLogger(__name__)


def format_residency(r: dict) -> str:
    """One ``OasisKV decode`` log line from a ``core.report.residency`` dict (plus
    ``draft_match``: ``(matches, drafts)`` or ``None``)."""
    hits, adm = r["hit_blocks"], r["admitted_blocks"]
    rate = hits / max(1, hits + adm)
    return (f"OasisKV decode: #running-req: {len(r['context_tokens'])}, "
            f"context tokens (host tier): {r['context_tokens']}, "
            f"device working set tokens per layer and KV head: {r['device_working_set_tokens']} "
            f"(budget {r['budget_tokens']}), sparse layers: {r['sparse_layers']}, "
            f"hit rate: {rate:.3f}, admitted blocks: {adm}, evicted blocks: {r['evicted_blocks']}, "
            f"H2D: {r['bytes_h2d'] / 2**20:.1f} MiB, working set: {r['working_set_bytes'] / 2**20:.1f} MiB, "
            f"summaries: {r['summary_bytes'] / 2**20:.1f} MiB, host tier: {r['host_tier_bytes'] / 2**20:.1f} MiB, "
            f"predictor: {r['predictor']}, fallback synchronous steps: {r['sync_steps']}, "
            f"prediction check: {r.get('prediction_check', 'device')}, "
            f"decode steps: {r.get('decode_steps', 0)}, cuda graph steps: {r.get('graph_steps', 0)}, "
            f"dense steps: {r.get('dense_steps', 0)}, "
            + ("" if r.get("transfer_budget_bytes", None) is None else
               f"transfer budget: {r['transfer_budget_bytes'] / 2**20:.1f} MiB/step, ")
            + (f"exposed wait: {sum(r['exposed_wait_ms']):.3f} ms (last step, all sparse layers)"
               if r.get("exposed_wait_timed", True) else
               "exposed wait: n/a (timed on eager CUDA steps only)")
            + ("" if r["agreement"] is None else
               f", agreement: {_mean(r['agreement']):.4f} (min layer {_min(r['agreement']):.4f})")
            + ("" if not r.get("draft_match") else
               f", draft match: {r['draft_match'][0] / max(1, r['draft_match'][1]):.3f} "
               f"({r['draft_match'][0]}/{r['draft_match'][1]})"))


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


def _min(xs):
    xs = [x for x in xs if x is not None]
    return min(xs) if xs else float("nan")


_RES = re.compile(r"context tokens \(host tier\): \[([\d, ]*)\], device working set tokens per layer and KV head: "
                  r"\[([\d, ]*)\] \(budget (\d+)\)")


def parse_residency(line: str) -> dict:
    """Parse an ``OasisKV decode`` log line into ``{"context": [...], "device": [...], "budget": int}``
    (tokens).

    Raises:
        ValueError: the line is not an ``OasisKV decode`` line.
    """
    m = _RES.search(line) if isinstance(line, str) else None
    if not m:
        raise ValueError(f"not an OasisKV decode line: {line!r}")
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    return {"context": ints(m.group(1)), "device": ints(m.group(2)), "budget": int(m.group(3))}


# numeric fields of an ``OasisKV decode`` line: the counters are cumulative since start-up, so
# figures per request or per step are differences of two lines
_COUNTERS = {"running": r"OasisKV decode: #running-req: (\d+)", "sparse_layers": r"sparse layers: (\d+)",
             "hit_rate": r"hit rate: (\d+(?:\.\d+)?)(?![\d.])", "admitted_blocks": r"admitted blocks: (\d+)",
             "evicted_blocks": r"evicted blocks: (\d+)", "h2d_mib": r"H2D: (\d+(?:\.\d+)?) MiB",
             "host_tier_mib": r"host tier: (\d+(?:\.\d+)?) MiB", "decode_steps": r"decode steps: (\d+)",
             "graph_steps": r"cuda graph steps: (\d+)",
             "dense_steps": r"dense steps: (\d+)",
             "transfer_budget_mib": r"transfer budget: (\d+(?:\.\d+)?) MiB/step"}


def parse_decode_counters(line: str) -> dict[str, float | None]:
    """The numbers of an ``OasisKV decode`` log line: ``running`` (requests of the step the line
    is about), ``sparse_layers``, ``hit_rate`` (0-1, since start-up),
    ``admitted_blocks`` / ``evicted_blocks`` (blocks, cumulative), ``h2d_mib`` (MiB copied host to
    device, cumulative), ``host_tier_mib`` (MiB), ``decode_steps`` / ``graph_steps`` / ``dense_steps`` (cumulative),
    ``transfer_budget_mib`` (MiB a step may admit, when a step budget is sized); None for a
    field the line lacks (an older format, or no budget)."""
    if not isinstance(line, str):
        raise TypeError(f"parse_decode_counters: want a str log line, got {type(line).__name__}")
    out = {}
    for k, pat in _COUNTERS.items():
        m = re.search(pat, line)
        out[k] = float(m.group(1)) if m else None
    return out


INTERVAL_ENV = "OASIS_DECODE_LOG_INTERVAL"


def log_interval(sglang_interval) -> int:
    """Decode steps between ``OasisKV decode`` lines: SGLang's ``--decode-log-interval`` (40 when
    unset), or ``OASIS_DECODE_LOG_INTERVAL`` (benchmarks: a long interval measures what the lines
    cost the decode loop).

    Raises:
        OasisConfigError: the variable is not an integer >= 1 (named with its value).
    """
    v = os.environ.get(INTERVAL_ENV)
    if v is None or not v.strip():
        return int(sglang_interval or 40)
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise OasisConfigError(f"{INTERVAL_ENV}={v!r}: want an integer >= 1 (decode steps between OasisKV lines)")
    return n


class DecodeLog:
    """Writes the ``OasisKV decode`` line (and updates the metrics) for one engine.

    A due line queues a copy of the engine's device counters (``core.report.snapshot``) and is
    written once that copy has landed, at a later call (``poll``): the decode loop never waits
    for the device. On CPU the copy is done at once, so the line is written at the step it is
    about. Its checks (the prediction record, the invariant) run when it is written.

    Args:
        engine: the ``OasisSparseKV``. interval: decode steps between lines (>= 1).
        metrics: ``metrics.OasisMetrics`` or ``None``.
        draft_match: callable returning the speculative probe's ``[matches, drafts]`` (int64
            ``[2]`` on the engine's device, copied with the report) or ``None`` (``spec_probe``).
        emit: write the line and update ``metrics``; ``False`` on TP ranks other than 0 (one
            line per server; their step budget is still resized at each line).
    """

    def __init__(self, engine, interval: int = 40, metrics=None, draft_match=None, emit: bool = True):
        self.engine, self.interval, self.metrics = engine, max(1, int(interval)), metrics
        self.draft_match = draft_match
        self.emit = emit
        self._logged_step = -1
        self._pending: deque = deque()      # (ReportSnapshot, host time, a request had just started)
        # at the last line: (host time, its CUDA event or None, decode steps, admitted blocks)
        self._mark: tuple | None = None

    def due(self) -> bool:
        """A line is due: a decode step ran, the last one started a request's decoding or is a
        multiple of the interval, and no line was queued for it yet."""
        s = self.engine.stats
        return 0 < s.decode_steps != self._logged_step and (s.new_request_started or s.decode_steps % self.interval == 0)

    def maybe_log(self) -> None:
        """Write the lines whose copies have landed (``poll``), then queue one when ``due``."""
        self.poll()
        if not self.due():
            return
        self._logged_step = self.engine.stats.decode_steps
        dm = self.draft_match() if self.draft_match is not None else None
        snap = snapshot(self.engine, None if dm is None else {"draft_match": dm})
        self._pending.append((snap, time.perf_counter(), self.engine.stats.new_request_started))
        self.poll()

    def pending(self) -> int:
        """Lines queued whose copies have not been read yet."""
        return len(self._pending)

    def poll(self, wait: bool = False) -> int:
        """Write the queued lines whose device copies have landed, oldest first (all of them,
        waiting for the device, when ``wait``). Returns the number written.

        Raises:
            RuntimeError: a decoded token found its block not resident (``core.report.finish``).
        """
        n = 0
        while self._pending and (wait or self._pending[0][0].ready()):
            snap, t, started = self._pending.popleft()
            r = finish(self.engine, snap)
            self._observe_step_time(r, snap, t, started)
            n += 1
            if not self.emit:
                continue
            dm = r.pop("draft_match", None)
            r["draft_match"] = None if dm is None else (int(dm[0]), int(dm[1]))
            logger.info(format_residency(r))
            if self.metrics is not None:
                self.metrics.update(r)
        return n

    def _observe_step_time(self, r: dict, snap, t: float, started: bool) -> None:
        """The decode step time and the bytes admitted per step since the last line size a
        link-fraction step budget (``core.budget.TransferBudget.observe_step``). On CUDA the time
        between two lines is the device time between their snapshots (their events), else the
        host time between them."""
        steps, admitted = r["decode_steps"], r["admitted_blocks"]
        if self._mark is not None and steps > self._mark[2]:
            t0, ev0, steps0, adm0 = self._mark
            n, budget = steps - steps0, self.engine.budget
            if ev0 is not None and snap.done is not None:
                step_s = ev0.elapsed_time(snap.done) / 1e3 / n
            else:
                step_s = (t - t0) / n
            copied = max(0, admitted - adm0) * self.engine.block_bytes / n
            # a line at a request's first decode step follows its prefill, whose time is not a
            # decode step's: such an interval may only lower the step time, never raise it
            if not (started and budget.step_s is not None and step_s > budget.step_s):
                budget.observe_step(step_s, copied)
        self._mark = (t, snap.done, steps, admitted)
