"""The ``OasisKV decode:`` log line: its format, its one parser, and when it is written.

The line is written at a request's first decode step and every ``--decode-log-interval`` decode
steps (SGLang's own decode log uses the same flag). Building it reads the engine's device
counters (``core/report.py``: a host sync), so the decode path writes it only then; the
Prometheus metrics (``metrics.py``) are updated from the same report. Keys are stable:
``scripts/run_demo.py``, ``bench_oasis`` and the tests parse the line with the functions here.
"""

from __future__ import annotations

import logging
import os
import re
import time

from oasis_sglang.config import OasisConfigError

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
    unset), or ``OASIS_DECODE_LOG_INTERVAL`` (benchmarks: each line reads the device counters, a
    host sync that drains the overlap scheduler's queue, so a long interval measures its cost).

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

    Args:
        engine: the ``OasisSparseKV``. interval: decode steps between lines (>= 1).
        metrics: ``metrics.OasisMetrics`` or ``None``.
        draft_match: callable returning ``(matches, drafts)`` or ``None`` (``spec_probe``).
        emit: write the line and update ``metrics``; ``False`` on TP ranks other than 0 (one
            line per server; their step budget is still resized at each due line).
    """

    def __init__(self, engine, interval: int = 40, metrics=None, draft_match=None, emit: bool = True):
        self.engine, self.interval, self.metrics = engine, max(1, int(interval)), metrics
        self.draft_match = draft_match
        self.emit = emit
        self._logged_step = -1
        self._mark: tuple[float, int, int] | None = None    # (time, decode steps, admitted blocks) at the last line

    def due(self) -> bool:
        """A line is due: a decode step ran, the last one started a request's decoding or is a
        multiple of the interval, and no line was written for it yet."""
        s = self.engine.stats
        return 0 < s.decode_steps != self._logged_step and (s.new_request_started or s.decode_steps % self.interval == 0)

    def maybe_log(self) -> None:
        """Write the line when ``due`` (reads the device counters: a host sync)."""
        if not self.due():
            return
        self._logged_step = self.engine.stats.decode_steps
        r = self.engine.residency()          # (a host sync: the steps so far are done)
        self._observe_step_time(r["admitted_blocks"])
        if not self.emit:
            return
        r["draft_match"] = self.draft_match() if self.draft_match is not None else None
        logger.info(format_residency(r))
        if self.metrics is not None:
            self.metrics.update(r)

    def _observe_step_time(self, admitted_blocks: int) -> None:
        """The decode step time and the bytes admitted per step since the last line (wall time
        and counters over decode steps, after the sync of the report) size a link-fraction step
        budget (``core.budget.TransferBudget.observe_step``)."""
        now, steps = time.perf_counter(), self.engine.stats.decode_steps
        if self._mark is not None and steps > self._mark[1]:
            n = steps - self._mark[1]
            step_s, budget = (now - self._mark[0]) / n, self.engine.budget
            copied = max(0, admitted_blocks - self._mark[2]) * self.engine.block_bytes / n
            # a line at a request's first decode step follows its prefill, whose time is not a
            # decode step's: such an interval may only lower the step time, never raise it
            if not (self.engine.stats.new_request_started and budget.step_s is not None and step_s > budget.step_s):
                budget.observe_step(step_s, copied)
        self._mark = (now, steps, admitted_blocks)
