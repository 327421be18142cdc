"""The three stages of OasisKV's per-layer prefetch: predict, select, transfer.

Paper: Methodology, Asynchronous Prefetch Pipeline. For one sparse layer and a step whose
context is ``seq`` tokens per request:

  (a) predict   Quest upper-bound scores of a query against every block's min/max key
                summary, top-K blocks per (request, KV head), sink / recent blocks forced
                (``ops.select_topk``);
  (b) select    plan admissions against the resident set: LRU eviction, at most ``fetch_cap``
                evicting admissions per (request, KV head), and with a step budget
                (``core/budget.py``) that layer's share of it, given to the candidates of all
                (request, KV head) pairs by score rank (``ops.budget_candidates``,
                ``ops.share_budget``, ``ops.plan_transfer``);
  (c) transfer  copy the admitted 4 KiB-class pieces from the host tier into their working-set
                slots (``ops.copy_blocks``: the H2D gather kernel on CUDA).

``OasisSparseKV`` runs them inline for a synchronous step, or queues them on
``PrefetchPipeline`` (``core/prefetch.py``) to prepare the next step.
"""

from __future__ import annotations

import torch

from ..config import OasisConfig
from .bench_hooks import BenchHooks
from .budget import TransferBudget
from .host_tier import HostTier
from .ops import BaseKVOps
from .prediction import PredictionRecord
from .prefetch import PrefetchPipeline
from .summaries import KeySummaries
from .working_set import WorkingSet


class PrefetchStages:
    """The stage functions over one engine's state (no state of their own but the
    ``measure_agreement`` buffers).

    Args:
        cfg: the config. ops: the kernels. summaries, ws, host: the engine's state.
        counters: ``[L, 4]`` int64 device counters (hits, admitted, evicted, written back).
        pipe: the engine's ``PrefetchPipeline``. record: its ``PredictionRecord``.
        bench: its ``BenchHooks`` (read at call time). padding_row: the request row that pads
            a captured batch, or ``None``. budget: the engine's ``TransferBudget`` (``None``
            or disabled: the cap alone).
        host_slots / host_dropped: a compact host tier (``HostTier(num_slots=...)``): the
            engine's device copy of the slot table ``[L, H * P]`` int32 and its ``[L, 2]`` int64
            dropped counters (column 1: copies not made, a piece without a slot); ``None``: the
            whole tier.
    """

    def __init__(self, cfg: OasisConfig, ops: BaseKVOps, summaries: KeySummaries, ws: WorkingSet, host: HostTier,
                 counters: torch.Tensor, pipe: PrefetchPipeline, record: PredictionRecord, bench: BenchHooks,
                 padding_row: int | None, budget: TransferBudget | None = None,
                 host_slots: torch.Tensor | None = None, host_dropped: torch.Tensor | None = None):
        self.cfg, self.ops, self.summaries, self.ws, self.host = cfg, ops, summaries, ws, host
        self.host_slots, self.host_dropped = host_slots, host_dropped
        self.budget = budget
        self.remote = None       # a PD decode node's RemoteBlocks (core/remote.py): pieces read on demand
        self.counters, self.pipe, self.record, self.bench, self.padding_row = counters, pipe, record, bench, padding_row
        L, R, H = ws.L, ws.R, ws.H
        dev = counters.device
        self.agreement = torch.zeros((L, 2), dtype=torch.int64, device=dev)     # [hits, true blocks] per layer
        self.pred_wanted = (torch.full((L, R, H, cfg.budget_blocks), -1, dtype=torch.int64, device=dev)
                            if cfg.measure_agreement else None)

    def predict(self, li: int, q: torch.Tensor, rows: torch.Tensor, seq: torch.Tensor, rtt: torch.Tensor,
                nb_max: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage (a): scores of ``q [B, Hq, D]`` and the top-K per (request, KV head) for a step
        of context ``seq [B]``; blocks past ``nb_max`` are never candidates.

        Returns:
            ``(wanted, forced)`` ``[B, H, K]`` (int64 block ids, -1 padded; bool).
        """
        s, cfg = self.summaries, self.cfg
        wanted, forced = self.ops.select_topk(q, s.kmin[li], s.kmax[li], rtt, rows, seq, cfg.block_size,
                                              cfg.sink_blocks, cfg.recent_blocks, nb_max, cfg.budget_blocks)
        churn = self.bench.churn_mean(li, self.ws.L)
        if churn is not None:        # benchmarks: a measured admission rate instead of random weights'
            wanted, forced = self.ops.replay_churn(wanted, forced, self.ws.ids[li], rows, churn, seq, li, nb_max)
        return wanted, forced

    @property
    def defers_reads(self) -> bool:
        """A PD decode node whose pipelined plans leave out blocks not read yet
        (``pd_read_mode: deferred``, ``core/remote.py``)."""
        return self.remote is not None and self.cfg.pd_read_mode == "deferred"

    def select(self, li: int, rows: torch.Tensor, seq: torch.Tensor, rtt: torch.Tensor, wanted: torch.Tensor,
               forced: torch.Tensor, clock: torch.Tensor, pipelined: bool = False):
        """Stage (b) (``ops.plan_transfer``) at LRU clock ``clock`` (0-dim int64 device tensor).
        A ``pipelined`` plan (for the next step) on a node that ``defers_reads`` leaves out the
        blocks not read yet (``RemoteBlocks.filter_planned``).

        Returns:
            The copy lists ``(dst, src, counts)`` of ``ops.plan_transfer``.
        """
        if self.pred_wanted is not None:
            self.pred_wanted[li][rows] = torch.where(forced, -1, wanted)
        if pipelined and self.defers_reads:
            wanted, forced = self.remote.filter_planned(li, rows, wanted, forced, seq, rtt, self.cfg.block_size,
                                                        self.ws.ids[li], self.cfg.fetch_cap)
        allow = None
        if self.budget is not None and self.budget.enabled:
            cand = self.ops.budget_candidates(self.ws.ids[li], rows, wanted, forced, self.cfg.fetch_cap,
                                              self.budget.blocks)
            allow = self.ops.share_budget(cand, self.budget.blocks, clock, wanted.shape[-1])
        kw = {} if self.host_slots is None or self._reads_in_step(pipelined) else \
            {"slots": self.host_slots[li], "dropped": self.host_dropped[li, 1]}
        return self.ops.plan_transfer(self.ws.ids[li], self.ws.last_used[li], rows, wanted, forced, clock,
                                      self.cfg.fetch_cap, seq, rtt, self.cfg.block_size, self.host.num_pages,
                                      self.counters[li], skip_row=self.padding_row, allow=allow, **kw)

    def _reads_in_step(self, pipelined: bool) -> bool:
        """The transfer stage of this plan reads missing pieces from their peer first (a PD
        decode node, except a ``pipelined`` plan of one that ``defers_reads``). On a compact
        tier such a plan lists whole-tier pieces ``h * P + page`` (``select``); ``transfer``
        reads them, which gives them slots, then copies from their pool rows."""
        return self.remote is not None and not (pipelined and self.defers_reads)

    def _to_pool_rows(self, li: int, dst: torch.Tensor, src: torch.Tensor, counts: torch.Tensor):
        """A compact tier: a plan of whole-tier pieces (``src [B*H, K]`` int64 ``h * P + page``)
        as pool rows through the layer's slot table, after its reads gave them slots. A copy
        whose piece has none (the pool was full, or its peer lost) is not made: its entry leaves
        the list (live copies stay first in slot order), it is counted in ``host_dropped[li, 1]``
        and not as admitted (``counters[li, 1]``), as ``plan_transfer`` does with ``slots``.
        Returns ``(dst, src, counts)``."""
        table = self.host_slots[li].long()
        live = dst >= 0
        row = torch.where(live, table[src.clamp(0, table.numel() - 1)], -1)
        lost = live & (row < 0)
        ok = live & ~lost
        first = torch.sort((~ok).to(torch.int8), dim=-1, stable=True).indices
        dst = torch.gather(torch.where(ok, dst, -1), -1, first)
        src = torch.gather(torch.where(ok, row, -1), -1, first)
        n = lost.sum()
        self.host_dropped[li, 1] += n
        self.counters[li, 1] -= n
        return dst, src, ok.sum(-1).to(counts.dtype)

    def transfer(self, li: int, plan, pipelined: bool = False) -> None:
        """Stage (c), H2D: the working-set pieces of ``plan = (dst, src, counts)`` from the host
        tier (nothing under ``BenchHooks.skip_admission_copy``). On a PD decode node
        (``remote`` set) the pieces not in this node's host tier are read from their peer first
        (a host read of the plan: not for CUDA-graph capture), except in a ``pipelined`` plan
        of a node that ``defers_reads`` (it holds only pieces already here)."""
        if self.bench.skip_admission_copy:
            return
        bs, D, Dv = self.cfg.block_size, self.host.head_dim, self.host.v_head_dim
        dst, src, counts = plan
        if self._reads_in_step(pipelined):          # read what is not here yet first
            self.remote.ensure_local(li, src.reshape(-1)[dst.reshape(-1) >= 0])
            if self.host_slots is not None:         # whole-tier pieces (select): now their pool rows
                dst, src, counts = self._to_pool_rows(li, dst, src, counts)
        hk, hv = self.host.piece_views(li)            # (a compact tier: the pools; src are pool rows)
        self.ops.copy_blocks(self.ws.k[li].view(-1, bs * D), self.ws.v[li].view(-1, bs * Dv), dst.reshape(-1),
                             hk, hv, src.reshape(-1), counts=counts)

    def run_now(self, li: int, q: torch.Tensor, rows: torch.Tensor, seq: torch.Tensor, rtt: torch.Tensor,
                nb_max: int, clock: torch.Tensor) -> None:
        """All three stages inline, on the current stream (a synchronous step).

        A block with no token before the step's new one (it starts at ``seq - 1``) is admitted
        without a copy: the new token is its first."""
        wanted, forced = self.predict(li, q, rows, seq, rtt, nb_max)
        self.transfer(li, self.select(li, rows, seq, rtt, wanted, forced, clock))

    def launch(self, li: int, q: torch.Tensor, rows: torch.Tensor, seq_next: torch.Tensor, rtt: torch.Tensor,
               nb_max_next: int, clock_next: torch.Tensor) -> None:
        """Queue predict -> select -> transfer of layer ``li`` for the next step (context
        ``seq_next``, LRU clock ``clock_next``) on the pipeline's streams, after the work queued
        so far. The first sparse layer (``li == 0``) also marks the device prediction record."""
        if li == 0:
            self.record.mark(rows, seq_next)      # on the compute stream, read by the next step's check
        self.pipe.launch(li, (
            lambda _: self.predict(li, q, rows, seq_next, rtt, nb_max_next),
            lambda wf: self.select(li, rows, seq_next, rtt, wf[0], wf[1], clock_next, pipelined=True),
            lambda plan: self.transfer(li, plan, pipelined=True),
        ), keep=(q, rows, seq_next, rtt, clock_next))

    def measure(self, li: int, q: torch.Tensor, rows: torch.Tensor, seq: torch.Tensor, rtt: torch.Tensor,
                nb_max: int) -> None:
        """``measure_agreement``: |predicted top-K ∩ this step's own top-K| over the non-forced
        blocks, accumulated per layer in ``agreement``."""
        wanted, forced = self.predict(li, q, rows, seq, rtt, nb_max)
        true = torch.where(forced, -1, wanted)                              # [B, H, K]
        pred = self.pred_wanted[li][rows]
        hit = ((true[..., :, None] == pred[..., None, :]) & (pred >= 0)[..., None, :]).any(-1) & (true >= 0)
        self.agreement[li] += torch.stack([hit.sum(), (true >= 0).sum()])
