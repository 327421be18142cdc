"""OasisSparseKV: the OasisKV state of one model and its per-layer steps, on any device.

The heavy operations go through ``self.ops`` (``core/ops.py``): the torch references by
default, the Triton kernels of ``oasis_sglang.kernels`` on CUDA.

One decode step (paper: Methodology), driven by the caller:

  ``begin_decode_step(rows, seq_lens, req_to_token, mode=...)``  once per batch, host side:
      counters, and whether every row's working set was predicted for exactly this context
      (``core/prediction.py``; otherwise the step selects synchronously);
  ``prepare_step_device()``  device side, recorded in a CUDA graph when capturing (eager
      steps do it inside ``begin_decode_step``): LRU clock, ``seq - 1``, ``seq + 1``;
  per sparse layer ``write_kv(..., decode=True)`` then ``decode_attention(layer, q, k, v)``:
      1. the new token's key is folded into its block's min/max summary (``write_kv``);
      2. wait for this layer's prefetch (or, on a synchronous step, score every complete
         block with the query (Quest bound, GQA max), take the top-K per KV head with sink /
         recent blocks forced, and bring missing blocks in from the host tier, evicting LRU
         blocks, at most ``fetch_cap`` evicting admissions per (request, KV head));
      3. write the new token into its resident block, write blocks it completed back to the
         host tier (where the full KV cache lives), attend over the working set;
      4. queue the next step's predict / select / transfer (``core/stages.py``) on the
         prefetch pipeline (``core/prefetch.py``).
Prefill of a sparse layer writes the host tier and summaries the same way and attends densely
over the new tokens plus any cached prefix read back from the host tier; with an asynchronous
predictor it predicts the request's first decode step from the last prompt token's query.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence

import torch

from ..config import OasisConfig, OasisConfigError
from . import attention as attn
from .bench_hooks import BenchHooks
from .budget import TransferBudget
from .checks import as_int, check_batch, check_rows, check_table, host_lists
from .devcopy import to_device
from .host_tier import EveryFewSeconds, HostTier, HostTierFull
from .kv_dtype import as_stored, summary_dtype
from .ops import BaseKVOps, TorchKVOps
from .prediction import PredictionRecord
from .prefetch import PrefetchPipeline, get_predictor
from .remote import RemoteBlocks
from .report import OasisStats, residency
from .stages import PrefetchStages
from .step import DecodeStep, StepMode
from .summaries import KeySummaries
from .working_set import WorkingSet

logger = logging.getLogger(__name__)

class OasisSparseKV:
    """OasisKV state of one model: host tier, summaries and working set of its sparse layers.

    Args:
        cfg: the validated :class:`OasisConfig`.
        num_layers: model layers; ``cfg.dense_layers`` are excluded, the rest are sparse.
        num_tokens: token locations of the KV pool (``size + page_size`` of SGLang's pool).
        num_rows: request rows (SGLang ``ReqToTokenPool`` size).
        head_num, head_dim, v_head_dim: KV heads and head sizes.
        dtype: KV cache dtype (what the host tier and working set store: the model's dtype, or
            ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` for SGLang's fp8 KV cache).
        compute_dtype: the model's dtype, needed with an fp8 ``dtype``: the min/max key summaries
            are kept in it, and the new tokens' K/V are attended as the fp8 cache holds them
            (``core.kv_dtype``). Default: ``dtype``.
        device: where the working set and summaries live.
        ops: the kernels (``core.ops.BaseKVOps``); default the torch references. The glue
            passes ``oasis_sglang.kernels.get_kv_ops("triton")`` on CUDA.
        predictor: ``core.prefetch`` predictor name; default ``cfg.predictor`` (``"auto"``:
            ``"current"``; the glue resolves it with ``cfg.predictor_for``).
        padding_row: the request row that pads a captured batch (SGLang's ``ReqToTokenPool``
            never hands out row 0): its tokens are never written back, counted or checked.
        host_slots: ``None`` (default): the whole host tier. An int ``S``: a compact host tier
            of ``S`` pieces (``HostTier(num_slots=S)``; a PD decode node's, disagg/README.md):
            the engine keeps a device copy of its slot table (``host_slots_d [L, H * P]``
            int32), every kernel reaches the host tier through its layer's row, and pieces get
            and give back slots with ``assign_host_pieces`` / ``free_host_pages``. A write to
            a piece without a slot is dropped and a copy from one not made; both are counted in
            ``host_dropped`` (``[L, 2]`` int64 device: (token, KV head) writes, copies).
    Raises:
        OasisConfigError: a dense layer index is out of range; ``measure_agreement`` with a
            synchronous predictor.
        ValueError: an fp8 ``dtype`` without ``compute_dtype``, or an fp8 ``compute_dtype``; a bad
            ``host_slots`` (``HostTier``).

    ``bench`` (:class:`BenchHooks`) holds the benchmark / test switches; serving leaves them off.
    """

    def __init__(self, cfg: OasisConfig, num_layers: int, num_tokens: int, num_rows: int,
                 head_num: int, head_dim: int, v_head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, ops: BaseKVOps | None = None, predictor: str | None = None,
                 padding_row: int | None = None, compute_dtype: torch.dtype | None = None,
                 host_slots: int | None = None):
        cfg.check_model(num_layers)
        sdtype = summary_dtype(dtype, compute_dtype)
        if predictor is None:
            predictor = "current" if cfg.predictor == "auto" else cfg.predictor
        self.predictor = get_predictor(predictor)
        if cfg.measure_agreement and not self.predictor.asynchronous:
            raise OasisConfigError("kv_sparse_config: 'measure_agreement' needs a predictor that predicts a step "
                                   "ahead (previous or lookahead), not current")
        ops = ops if ops is not None else TorchKVOps()
        self.cfg, self.device, self.bs = cfg, torch.device(device), cfg.block_size
        self.head_num, self.head_dim, self.v_head_dim = head_num, head_dim, v_head_dim
        self.num_layers = num_layers
        self.sparse_layers = [i for i in range(num_layers) if i not in cfg.dense_layers]
        self.index = {l: i for i, l in enumerate(self.sparse_layers)}
        num_pages = -(-num_tokens // self.bs)
        pin = self.device.type == "cuda"
        L = len(self.sparse_layers)
        self.host = HostTier(L, num_pages, self.bs, head_num, head_dim, v_head_dim, dtype, pin_memory=pin,
                             pin_device=self.device.index if pin else None, num_slots=host_slots)
        # a compact host tier: the slot table's device copy (the kernels' ``slots``), kept in step
        # with ``host.slots`` by assign_host_pieces / free_host_pages; dropped host writes (token,
        # KV head) and copies not made (pieces) per sparse layer, one column each so the compute
        # stream (writes) and a prefetch stream (copies) never update one element
        self.host_slots_d = self.host.slots.to(self.device) if self.host.compact else None
        self.host_dropped = torch.zeros((L, 2), dtype=torch.int64, device=self.device)
        self.kv_dtype = dtype
        self.summaries = KeySummaries(L, num_pages, head_num, head_dim, sdtype, self.device)
        self.ws = WorkingSet(L, num_rows, head_num, cfg.budget_blocks, self.bs, head_dim, v_head_dim, dtype, self.device)
        self.stats = OasisStats()
        self._bench = BenchHooks()
        self.record = PredictionRecord(num_rows, self.device)
        self.pipe = PrefetchPipeline(L, self.device)
        # hits, admitted (copied), evicted, written-back blocks per sparse layer: device counters,
        # read only when reporting; one row per layer so a layer's prefetch stream and the
        # compute stream never update the same element concurrently
        self.counters = torch.zeros((L, 4), dtype=torch.int64, device=self.device)
        self.block_bytes = self.bs * (head_dim + v_head_dim) * torch.empty((), dtype=dtype).element_size()
        # the step budget (core/budget.py): blocks per sparse layer and step, a device scalar
        self.budget = TransferBudget(cfg.transfer_budget, self.block_bytes, L, self.device)
        self.stages = PrefetchStages(cfg, ops, self.summaries, self.ws, self.host, self.counters, self.pipe,
                                     self.record, self._bench, padding_row, self.budget,
                                     host_slots=self.host_slots_d, host_dropped=self.host_dropped)
        self._clock = torch.zeros((), dtype=torch.int64, device=self.device)   # LRU clock (device)
        self._host_steps = 0               # eager + replayed decode steps (host count)
        self._step: DecodeStep | None = None
        self._prefilled = False            # a prefill ran since the last decode step
        self._dense_graphs = False         # a dense-path decode graph was captured (replays may choose it)
        self.last_batch = None             # (rows, seq) of the last step: device tensors, or host lists (replay)
        self.last_step_timed = False       # the last decode step's exposed wait was timed (eager, CUDA)
        self._fwd_stream = None            # stream of the last forward (CUDA), see ``reset_rows``
        # row -> CUDA event after the last sparse layer's plan of its first decode step
        # (``extend_attention``; read by ``planned_working_set``)
        self._plan_done: dict[int, object] = {}
        # per sparse layer: a decode write's ``(loc, k, v)`` whose summary fold waits for that
        # layer's ``decode_attention`` (one launch with the append); see ``write_kv``
        self._folds: list = [None] * L
        self._no_tensor = torch.empty(0, dtype=torch.int64)   # the device fields of a replay step (none)
        # rows of replayed steps whose working set was predicted for another context than the
        # step's (a host decision the device disproves; ``prepare_step_device``): device counter,
        # zeroed at the first replay (captures' warm-up runs count garbage), read when reporting
        self.replay_misses = torch.zeros((), dtype=torch.int64, device=self.device)
        self._replay_misses_armed = False
        # the check costs 6 small launches per captured step; the glue turns it on where a wrong
        # host length is possible (host lengths from the prediction record, ``record_lengths``)
        self.check_replays = False
        # a compact host tier: row -> the block of its last step's new token whose page has its
        # slots (``assign_write_pages``); pieces not written back for want of a free slot
        self._write_block: dict[int, int] = {}
        self.host_write_misses = 0
        # rows whose decoded block found no slot in a full compact pool (never written back: their
        # later steps would attend without it); the PD glue ends them (``DecodeSide.starved_rows``)
        self.write_starved: set[int] = set()
        self._write_warn = EveryFewSeconds(self.WRITE_WARN_S)

    @staticmethod
    def memory_plan(cfg: OasisConfig, num_layers: int, num_tokens: int, num_rows: int, head_num: int,
                    head_dim: int, v_head_dim: int, dtype_bytes: int, summary_dtype_bytes: int | None = None,
                    host_slots: int | None = None) -> dict:
        """Bytes the state will allocate, before allocating it.

        Args: the constructor's sizes; ``dtype_bytes`` bytes per element of the KV cache dtype
        (1 for fp8), ``summary_dtype_bytes`` of the summaries' (default ``dtype_bytes``; the
        model's dtype with an fp8 KV cache); ``host_slots``: a compact host tier of that many
        (sparse layer, KV head, block) pieces (the constructor's ``host_slots``): its pool is
        the host tier, whatever ``num_tokens`` (its slot table, 4 bytes per piece of the whole
        tier on the host and again on the device, is left out).
        Returns ``{"working_set": device bytes, "summaries": device bytes, "host_tier": host bytes}``.
        Raises:
            ValueError: ``host_slots`` not a positive integer.
        """
        if host_slots is not None and (isinstance(host_slots, bool) or not isinstance(host_slots, int)
                                       or host_slots < 1):
            raise ValueError(f"memory_plan: host_slots must be a positive integer (pieces) or None, got {host_slots!r}")
        sbytes = dtype_bytes if summary_dtype_bytes is None else summary_dtype_bytes
        L = num_layers - len([x for x in cfg.dense_layers if x < num_layers])
        pages = -(-num_tokens // cfg.block_size)
        return {
            "working_set": L * num_rows * head_num * cfg.budget_tokens * (head_dim + v_head_dim) * dtype_bytes,
            "summaries": 2 * L * pages * head_num * head_dim * sbytes,
            "host_tier": (L * pages * head_num if host_slots is None else host_slots)
            * cfg.block_size * (head_dim + v_head_dim) * dtype_bytes,
        }

    @staticmethod
    def token_capacity(cfg: OasisConfig, device_bytes: int, dense_cell_bytes: int, host_bytes: int | None,
                       num_layers: int, num_rows: int, head_num: int, head_dim: int, v_head_dim: int,
                       dtype_bytes: int, summary_dtype_bytes: int | None = None) -> dict:
        """How many tokens of KV cache (SGLang's ``max_total_num_tokens``) fit when the sparse
        layers' KV lives in the host tier: SGLang sizes its pool as if every layer's KV were on
        the device (``model_executor/pool_configurator.py``: ``device_bytes // cell_size``), which
        caps OasisKV at a dense server's tokens on the device it has (22 x 16K of Qwen3-8B on an
        80 GB GPU, where the host tier could hold 41).

        Per token, the device keeps the dense layers' KV, a draft model's KV (both in SGLang's
        ``dense_cell_bytes``) and the summaries (``2 / block_size`` of the sparse layers' keys);
        the host tier the sparse layers' K and V. The working set is per request row, not per
        token: it comes off the device budget first.

        Args:
            device_bytes: SGLang's device budget for the KV cache (bytes, after weights and its
                activation reserve). dense_cell_bytes: SGLang's bytes per token with every
                layer on the device (its ``cell_size``, draft model included).
            host_bytes: host memory the tier may take on this rank (bytes); ``None``: the
                device and the host are one memory (CPU): the host tier counts against
                ``device_bytes``.
            num_rows: request rows (``--max-running-requests`` + 1). Others: ``memory_plan``'s.
        Returns:
            ``{"tokens", "device_cell", "host_cell", "working_set", "limit"}``: tokens (a
            multiple of ``block_size``; one block below what fits, as SGLang allocates one page
            more than its pool's size), device and host bytes per token, working-set bytes, and
            which memory bounds it (``"device"`` or ``"host"``).
        Raises:
            ValueError: the working set does not fit ``device_bytes`` or leaves no room for a
                block (naming ``--mem-fraction-static``, ``budget_tokens`` and
                ``--max-running-requests``), or the host memory has room for no block. Every
                layer dense (no host tier): the device alone bounds it.
        """
        bs = cfg.block_size
        plan = OasisSparseKV.memory_plan(cfg, num_layers, bs, num_rows, head_num, head_dim, v_head_dim,
                                         dtype_bytes, summary_dtype_bytes)
        host_block = plan["host_tier"]      # one block of every sparse layer: what SGLang's cell counts for them
        dev_block = max(0, dense_cell_bytes * bs - host_block) + plan["summaries"]
        ws = plan["working_set"]
        fix = "raise --mem-fraction-static, or lower budget_tokens or --max-running-requests"
        if device_bytes <= 0:
            raise ValueError(f"SGLang left no device memory for the KV cache ({device_bytes} bytes); raise "
                             f"--mem-fraction-static")
        if ws >= device_bytes:
            raise ValueError(f"the working set ({ws / 2**30:.2f} GiB: budget_tokens={cfg.budget_tokens} x "
                             f"{num_rows} request rows) does not fit the KV cache's device budget "
                             f"({device_bytes / 2**30:.2f} GiB, SGLang's --mem-fraction-static share after the "
                             f"weights); {fix}")
        by_dev = (device_bytes - ws) // max(1, dev_block + (host_block if host_bytes is None else 0))
        by_host = max(0, host_bytes) // host_block if host_bytes is not None and host_block else None
        blocks, limit = (by_dev, "device") if by_host is None or by_dev <= by_host else (by_host, "host")
        blocks -= 1                     # SGLang allocates its pool's tokens plus one page (``size + page_size``)
        if blocks < 1:
            if limit == "host":
                raise ValueError(f"no block of KV cache fits the host memory available: a {bs}-token block takes "
                                 f"{host_block / 2**10:.1f} KiB of host tier, {max(0, host_bytes) / 2**30:.2f} GiB "
                                 f"are free for it; free host memory")
            raise ValueError(f"no block of KV cache fits the device budget ({device_bytes / 2**30:.2f} GiB) after the "
                             f"working set's {ws / 2**30:.2f} GiB (budget_tokens={cfg.budget_tokens} x {num_rows} "
                             f"request rows); {fix}")
        return {"tokens": int(blocks) * bs, "device_cell": dev_block / bs, "host_cell": host_block / bs,
                "working_set": ws, "limit": limit}

    @property
    def ops(self) -> BaseKVOps:
        """The kernels (``core.ops.BaseKVOps``), shared with the prefetch stages; fixed at construction."""
        return self.stages.ops

    @property
    def padding_row(self) -> int | None:
        """The request row that pads a captured batch (never written back, counted or checked)."""
        return self.stages.padding_row

    @property
    def bench(self) -> BenchHooks:
        """The benchmark / test switches (:class:`BenchHooks`); assign a new one to replace them."""
        return self._bench

    @bench.setter
    def bench(self, hooks: BenchHooks) -> None:
        if not isinstance(hooks, BenchHooks):
            raise TypeError(f"bench: want a BenchHooks, got {type(hooks).__name__}")
        self._bench = self.stages.bench = hooks

    def set_policy(self, fetch_cap: int | None | str = "keep", predictor: str | None = None) -> None:
        """Benchmarks: another ``fetch_cap`` and / or predictor over the same state (no
        reallocation). ``fetch_cap="keep"`` leaves it as it is. A captured CUDA graph keeps the
        predictor it was recorded with: after a predictor change capture again (replays choose
        no dense-path graph until one is captured again).

        Raises:
            OasisConfigError: a bad ``fetch_cap`` (the config's validation), an unknown predictor,
                or ``current`` with ``measure_agreement`` (nothing changes then).
        """
        pred = self.predictor
        if predictor is not None:
            if predictor not in ("current", "previous", "lookahead"):
                raise OasisConfigError(f"set_policy: predictor {predictor!r}: want current, previous or lookahead "
                                       "('auto' is resolved when the server starts)")
            pred = get_predictor(predictor)
            if self.cfg.measure_agreement and not pred.asynchronous:
                raise OasisConfigError("set_policy: 'measure_agreement' needs a predictor that predicts a step "
                                       "ahead (previous or lookahead), not current")
        cfg = self.cfg if fetch_cap == "keep" else dataclasses.replace(self.cfg, fetch_cap=fetch_cap)
        self.cfg = self.stages.cfg = cfg
        if predictor is not None:
            # what the record holds means something else per predictor (a prefetched context, or
            # for current a context selected whole): the next step of each row selects afresh
            self.record.clear()
            self._dense_graphs = False            # recorded with the old predictor's marks and hits
        self.predictor = pred

    def measure_link(self, pieces: int = 4096, repeats: int = 5) -> float | None:
        """Time the admission copy (``ops.copy_blocks``: host tier -> device, ``pieces``
        random (KV head, block) pieces of ``block_bytes``, best of ``repeats``) and give the
        rate to the step budget (``budget.set_link_rate``). Call once at start-up, before
        serving (it synchronises the device).

        Returns:
            The rate in bytes/s, or ``None`` off CUDA (no link: the budget stays unlimited).
        """
        if self.device.type != "cuda" or not self.sparse_layers:
            return None
        bs, D, Dv, H, P = self.bs, self.head_dim, self.v_head_dim, self.head_num, self.host.num_pages
        rows = self.host.num_slots if self.host.compact else H * P     # pool rows, or layer 0's pieces
        n = max(1, min(int(pieces), rows))
        src = torch.randperm(rows, device=self.device)[:n]
        dst = torch.arange(n, device=self.device)
        k = torch.empty((n, bs * D), dtype=self.host.dtype, device=self.device)
        v = torch.empty((n, bs * Dv), dtype=self.host.dtype, device=self.device)
        hk, hv = self.host.piece_views(0)
        self.ops.copy_blocks(k, v, dst, hk, hv, src)                  # warm-up (compiles the kernel)
        best = float("inf")
        for _ in range(max(1, int(repeats))):
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            self.ops.copy_blocks(k, v, dst, hk, hv, src)
            t1.record()
            t1.synchronize()
            best = min(best, t0.elapsed_time(t1) / 1e3)
        rate = n * self.block_bytes / best if best > 0 else None
        self.budget.set_link_rate(rate)
        return rate

    def attach_remote(self, remote: RemoteBlocks | None) -> None:
        """PD decode node: read host-tier pieces admitted from a prefill node on demand
        (``core/remote.py``); ``None`` detaches. With ``pd_read_mode: deferred`` pipelined plans
        leave out blocks not read yet and each decode step starts by reading them
        (``RemoteBlocks.service``), so captured steps read nothing on the host; with ``wait``
        the transfer stage reads the plan on the host (decode steps run eagerly).

        A compact host tier (``host_slots``): ``remote`` reads into pool rows it assigns first
        (``RemoteBlocks.use_slots`` with ``assign_host_pieces`` / ``free_host_pages``); a step
        that reads inside its layers plans whole-tier pieces, reads them, then copies from their
        pool rows (``PrefetchStages.transfer``); each decode step first gives the page its
        requests write into a slot per (sparse layer, KV head) (``assign_write_pages``).

        Raises:
            ValueError: ``remote`` sized for another host tier (layers, KV heads or pages), or
                keeping its device state on another device than this engine's.
        """
        if remote is not None and (remote.L, remote.H, remote.P) != (
                len(self.sparse_layers), self.head_num, self.host.num_pages):
            raise ValueError(f"attach_remote: RemoteBlocks for {(remote.L, remote.H, remote.P)} (layers, KV heads, "
                             f"pages); this engine has {(len(self.sparse_layers), self.head_num, self.host.num_pages)}")
        if remote is not None and (remote.device.type != self.device.type or (
                remote.device.index is not None and self.device.index is not None
                and remote.device.index != self.device.index)):
            raise ValueError(f"attach_remote: RemoteBlocks on {remote.device}; this engine runs on {self.device}")
        if remote is not None and self.host.compact:
            host = self.host
            remote.use_slots(host.slots, self.assign_host_pieces, self.free_host_pages, lambda: host.free_slots)
        self.stages.remote = remote

    def _service_remote(self) -> None:
        """Start of a step on a PD decode node that defers reads: after the plans queued by the
        last step, read the blocks they left out (``RemoteBlocks.service``)."""
        if self.stages.defers_reads:
            self.pipe.join()
            self.stages.remote.service()

    def install_working_set(self, row: int, ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            seq_next: int) -> None:
        """PD decode node: give request row ``row`` the first decode step's working set that a
        prefill node planned (``extend_attention`` there), so its first step here attends exactly
        what it would have attended on the prefill node (``disagg/admission.py``).

        Args:
            ids: ``[L, H, K]`` int64 block numbers per (sparse layer, KV head, slot), -1 empty.
            k, v: ``[L, H, K, bs, D]`` / ``[..., Dv]`` the slots' K/V (the KV cache dtype).
            seq_next: the context of the row's first decode step (prompt tokens + 1).
        Raises:
            ValueError: a bad row or shapes (before anything changes).
        """
        L, H, K, bs = self.ws.L, self.head_num, self.ws.K, self.bs
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < self.ws.R or seq_next < 1:
            raise ValueError(f"install_working_set: row {row!r} (0..{self.ws.R - 1}), seq_next {seq_next!r}")
        if tuple(ids.shape) != (L, H, K) or tuple(k.shape) != (L, H, K, bs, self.head_dim) \
                or tuple(v.shape) != (L, H, K, bs, self.v_head_dim):
            raise ValueError(f"install_working_set: ids {tuple(ids.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: "
                             f"want [{L}, {H}, {K}] and [{L}, {H}, {K}, {bs}, {self.head_dim}/{self.v_head_dim}]")
        self.pipe.drain()
        for li in range(L):
            self.ws.k[li][row] = k[li].to(self.device, self.ws.k[li].dtype)
            self.ws.v[li][row] = v[li].to(self.device, self.ws.v[li].dtype)
        self._install_row(row, to_device(ids, self.device), seq_next)

    def _install_row(self, row: int, ids_d: torch.Tensor, seq_next: int) -> None:
        """The block table, LRU times and prediction record of an installed working set
        (``ids_d [L, H, K]`` int64 on the device; its K/V already in the row's slots)."""
        self.ws.ids[:, row] = ids_d
        self.ws.last_used[:, row] = torch.where(ids_d >= 0, self._clock + 1, 0)
        if self.predictor.asynchronous:
            self.record.mark(to_device([row], self.device), to_device([seq_next], self.device))
            self.record.mirror([row], [seq_next])
        self._prefilled = True

    def install_working_set_from_host(self, row: int, ids: torch.Tensor, pages: torch.Tensor, seq_next: int) -> None:
        """PD decode node: ``install_working_set`` with the blocks' K/V taken from this engine's
        own host tier (where the caller read them: ``disagg/serving.py DecodeSide.admit``),
        gathered into the row's slots by ``ops.copy_blocks`` as the transfer stage does.

        Args:
            ids: ``[L, H, K]`` int64 block numbers per (sparse layer, KV head, slot), -1 empty;
                a block at or past ``N`` (the next token's) is admitted empty, without a copy.
            pages: ``[N]`` int64 the request's host pages, block by block.
            seq_next: the context of the row's first decode step (prompt tokens + 1).
        Raises:
            ValueError: a bad row, shapes or pages (before anything changes).
        """
        L, H, K, bs, P = self.ws.L, self.head_num, self.ws.K, self.bs, self.host.num_pages
        pages = torch.as_tensor(pages).reshape(-1).cpu().to(torch.int64)
        ids = torch.as_tensor(ids).cpu().to(torch.int64)
        N = pages.numel()
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < self.ws.R or seq_next < 1 \
                or tuple(ids.shape) != (L, H, K) or not N or int(pages.min()) < 0 or int(pages.max()) >= P:
            raise ValueError(f"install_working_set_from_host: row {row!r} (0..{self.ws.R - 1}), ids "
                             f"{tuple(ids.shape)} (want [{L}, {H}, {K}]), {N} pages in 0..{P - 1}, seq_next {seq_next!r}")
        self.pipe.drain()
        dev = self.device
        ids_d = to_device(ids, dev)              # (no host wait for the step in flight: devcopy)
        hh = torch.arange(H, dtype=torch.int64)[:, None].expand(H, K)
        slot = (row * H + hh) * K + torch.arange(K, dtype=torch.int64)[None, :]          # [H, K]
        live = (ids >= 0) & (ids < N)                                                     # [L, H, K]
        dst = to_device(torch.where(live, slot, -1), dev)
        src = hh * P + pages[ids.clamp(0, N - 1)]                                        # [L, H, K] pieces
        if self.host.compact:            # their pool rows; a piece without one: no copy, counted
            src = self.host.slots.to(torch.int64).gather(1, src.reshape(L, -1)).view(L, H, K)
            lost = live & (src < 0)
            live = live & (src >= 0)
            dst = to_device(torch.where(live, slot, -1), dev)
            self.host_dropped[:, 1] += to_device(lost.sum((1, 2)), dev)
        src = to_device(src, dev)
        D, Dv = self.head_dim, self.v_head_dim
        for li in range(L):
            hk, hv = self.host.piece_views(li)
            self.ops.copy_blocks(self.ws.k[li].view(-1, bs * D), self.ws.v[li].view(-1, bs * Dv), dst[li].reshape(-1),
                                 hk, hv, src[li].reshape(-1))
        # admitted (copied host -> device) blocks, as the transfer stage counts them
        self.counters[:, 1] += to_device(live.sum((1, 2)), dev)
        self._install_row(row, ids_d, seq_next)

    def is_sparse(self, layer_id: int) -> bool:
        """True when ``layer_id`` (model layer index) is served by OasisKV."""
        return layer_id in self.index

    def _sparse_index(self, layer_id: int, what: str) -> int:
        """Index of sparse layer ``layer_id`` in the state. Raises ValueError for a dense or
        unknown layer (its KV cache is SGLang's, not OasisKV's)."""
        if isinstance(layer_id, bool) or not isinstance(layer_id, int):
            raise ValueError(f"{what}: layer_id {layer_id!r}: want an int (model layer index)")
        li = self.index.get(layer_id)
        if li is None:
            kind = "dense (config dense_layers)" if 0 <= layer_id < self.num_layers else \
                f"not a layer of this model (0..{self.num_layers - 1})"
            raise ValueError(f"{what}: layer {layer_id} is {kind}; OasisKV serves layers {self.sparse_layers}")
        return li

    # ---- writes -------------------------------------------------------------------------
    def write_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 decode: bool = False) -> None:
        """New tokens of a sparse layer (``loc [N]``, ``k [N, H, D]``, ``v [N, H, Dv]``).

        Their keys are folded into the block summaries (``ops.write_kv``). Prefill tokens go to
        the host tier now. Decode tokens (``decode=True``, one per request) go to the working
        set in ``decode_attention`` and reach the host tier as whole blocks once their block is
        complete (4 KiB pieces instead of 256 B ones; the partial block is always resident).
        Their fold is deferred to that layer's ``decode_attention``, which does it in the
        launch of its append (``ops.append_tokens(fold=...)``: one launch per sparse layer and
        step fewer); any other engine call first does a deferred fold on its own (the same
        result). The decode token's block is always resident and forced (``recent_blocks >=
        1``), so no selection of this step reads its summary before the fold.

        Raises:
            ValueError: a dense or unknown layer; mismatched shapes.
        """
        li = self._sparse_index(layer_id, "write_kv")
        if not (loc.dim() == 1 and k.shape[0] == v.shape[0] == loc.shape[0]):
            raise ValueError(f"write_kv: loc {tuple(loc.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: "
                             f"want loc [N], k [N, {self.head_num}, {self.head_dim}], v [N, {self.head_num}, {self.v_head_dim}]")
        self.pipe.wait(li)       # a prefetch of this layer may still read the summaries / host tier
        self._flush_fold(li)     # an earlier decode write of this layer that no attention consumed
        k, v = k.view(-1, self.head_num, self.head_dim), v.view(-1, self.head_num, self.v_head_dim)
        if decode:
            self._folds[li] = (loc, k, v)
            return
        s = self.summaries
        self.ops.write_kv(*self.host.buffers(li), s.kmin[li], s.kmax[li], loc, k, v, self.bs, **self._host_kw(li))

    def _flush_fold(self, li: int) -> None:
        """The deferred summary fold of sparse layer ``li``'s last decode write, on its own
        (``ops.write_kv`` as an undeferred decode write would have run it), if one is pending."""
        f = self._folds[li]
        if f is None:
            return
        self._folds[li] = None
        s = self.summaries
        self.ops.write_kv(*self.host.buffers(li), s.kmin[li], s.kmax[li], f[0], f[1], f[2], self.bs,
                          one_token_each=True, write_host=False, **self._host_kw(li))

    def _flush_folds(self) -> None:
        """Every sparse layer's pending fold (``_flush_fold``; nothing to do, the usual case, costs
        one C-level scan of the list per step)."""
        if not any(self._folds):
            return
        for li, f in enumerate(self._folds):
            if f is not None:
                self._flush_fold(li)

    # ---- prefill --------------------------------------------------------------------------
    def extend_attention(self, layer_id: int, q: torch.Tensor, rows: torch.Tensor, prefix_lens: torch.Tensor,
                         extend_lens: torch.Tensor, req_to_token: torch.Tensor, scale: float | None,
                         k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None, *,
                         host: tuple[Sequence[int], Sequence[int], Sequence[int]] | None = None) -> torch.Tensor:
        """Prefill (extend) of a sparse layer whose new K/V were already written (``write_kv``).

        Args:
            q: ``[T, Hq, D]`` queries of all new tokens, request after request.
            rows, prefix_lens, extend_lens: ``[B]``. req_to_token: SGLang's ``[R, max_len]`` table.
            k_new, v_new: ``[T, H, D/Dv]`` the new tokens' K/V (on the device); when given, only
                the cached prefix is read back from the host tier.
            host: ``(rows, prefix_lens, extend_lens)`` as host integer lists (SGLang's scheduler
                rows and ``extend_prefix_lens_cpu`` / ``extend_seq_lens_cpu``): then no device
                value is read back (without them, three reads per sparse layer of every prefill
                forward, each a host sync on a GPU). The device tensors are taken to hold the
                same values.
        Returns:
            ``[T, Hq, Dv]``.
        Raises:
            ValueError: a dense or unknown layer; ``rows``, ``prefix_lens`` and ``extend_lens`` of
                different lengths, host lists of another length than ``rows``, a negative
                length, or ``sum(extend_lens) != T`` (checked before any state changes).
        """
        li = self._sparse_index(layer_id, "extend_attention")
        self._flush_folds()
        if host is not None:
            if len(host) != 3 or any(len(x) != rows.shape[0] for x in host):
                raise ValueError(f"extend_attention: host lists of lengths {[len(x) for x in host]} for "
                                 f"{rows.shape[0]} rows: want (rows, prefix_lens, extend_lens), one entry per row")
            rows_c, pre_c, ext_c = (list(map(int, x)) for x in host)
        else:
            rows_c, pre_c, ext_c = rows.tolist(), prefix_lens.tolist(), extend_lens.tolist()
        if not len(rows_c) == len(pre_c) == len(ext_c):
            raise ValueError(f"extend_attention: {len(rows_c)} rows, {len(pre_c)} prefix_lens, {len(ext_c)} extend_lens")
        if min(pre_c + ext_c, default=0) < 0 or sum(ext_c) != q.shape[0]:
            raise ValueError(f"extend_attention: extend_lens {ext_c} (sum {sum(ext_c)}) and prefix_lens {pre_c} "
                             f"for q of {q.shape[0]} tokens: want non-negative lengths summing to the tokens")
        self._note_forward_stream()
        out = q.new_empty((q.shape[0], q.shape[1], self.v_head_dim))
        start = 0
        for r, pre, ext in zip(rows_c, pre_c, ext_c):
            n = pre + ext
            if k_new is None:
                k, v = self.read_prefix(li, req_to_token[r], n, q.device)
            else:
                # attended as the KV cache holds them (fp8: rounded, as SGLang's pool would)
                k = as_stored(k_new[start:start + ext].view(ext, self.head_num, self.head_dim), self.kv_dtype)
                v = as_stored(v_new[start:start + ext].view(ext, self.head_num, self.v_head_dim), self.kv_dtype)
                if pre:
                    kp, vp = self.read_prefix(li, req_to_token[r], pre, k.device)
                    k, v = torch.cat([kp.to(k.dtype), k]), torch.cat([vp.to(v.dtype), v])
            out[start:start + ext] = attn.prefill_attention(q[start:start + ext], k.to(q.device), v.to(q.device), pre, scale)
            start += ext
        self._prefilled = True
        if len(ext_c):
            # blocks these tokens went into reach the host tier only: a resident copy (a block
            # admitted empty as the next token's, or by an earlier chunk) is stale from here on
            self.pipe.wait(li)
            # (host lists reach the device through page-locked staging, devcopy.to_device:
            # ``torch.tensor(list, device=cuda)`` would wait for the queued forward, a host sync)
            self.ws.drop_blocks_from(li, rows.to(self.device, torch.int64),
                                     to_device([p // self.bs for p in pre_c], self.device))
        keep = [i for i, e in enumerate(ext_c) if e > 0]        # rows with new tokens (SGLang sends no others)
        if li == 0 and keep:
            # their working sets were just cut back: no earlier prediction (or dense path mark)
            # holds for them any more; an asynchronous predictor marks them again below
            self.record.forget([rows_c[i] for i in keep])
        if self.predictor.asynchronous and keep and not self.bench.skip_prefetch:
            # the first decode step's working set, predicted from the last prompt token's query
            ends = to_device(ext_c, self.device).cumsum(0) - 1
            sel = to_device(keep, self.device)
            seq_next_h = [pre_c[i] + ext_c[i] + 1 for i in keep]
            rtt = req_to_token if req_to_token.device == self.device else req_to_token.to(self.device)
            self.pipe.wait(li)
            self.stages.launch(li, q[ends[sel]].view(len(keep), -1, self.head_dim),
                               rows.to(self.device, torch.int64)[sel], to_device(seq_next_h, self.device),
                               rtt, -(-max(seq_next_h) // self.bs), self._clock + 1)
            if li == 0:
                self.record.mirror([rows_c[i] for i in keep], seq_next_h)
            if li == self.ws.L - 1 and self.pipe.cuda:
                ev = self.pipe.ready[li]            # after every layer's plan (same streams, in order)
                for i in keep:
                    self._plan_done[rows_c[i]] = ev
        return out

    def note_new_request(self) -> None:
        """A request arrived without a prefill here (a PD decode node's admission): the next
        decode step counts as a request's first (``OasisStats.new_request_started``, which
        writes the ``OasisKV decode`` log line), as after a local prefill."""
        self._prefilled = True

    def side_stream(self):
        """A CUDA stream of this engine's own for PD's host reads and region writes, never the
        forward stream or a prefetch stage stream (PyTorch hands streams out round-robin from a
        pool of 32; SGLang redraws its schedule stream for the same reason). ``None`` off CUDA."""
        if self.device.type != "cuda":
            return None
        taken = {getattr(s, "cuda_stream", None) for s in self.pipe.streams}
        if self._fwd_stream is not None:
            taken.add(self._fwd_stream.cuda_stream)
        s = getattr(self, "_side", None)
        for _ in range(64):
            if s is not None and s.cuda_stream not in taken:
                break
            s = torch.cuda.Stream(self.device)
        self._side = s
        return s

    def planned_working_set(self, row: int) -> torch.Tensor:
        """PD prefill node: the working set ``extend_attention`` planned for request row ``row``'s
        first decode step, ``[L, H, K]`` int64 block numbers on the CPU (-1 empty).

        On CUDA the host waits for that row's plan only (an event recorded after its last
        sparse layer's stages), not for the pipeline's streams, where SGLang's overlap scheduler
        may already have queued the next batch's stages; the ids are read on a side stream.
        Raises:
            ValueError: a bad row.
        """
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < self.ws.R:
            raise ValueError(f"planned_working_set: row {row!r} not in 0..{self.ws.R - 1}")
        if not self.pipe.cuda:
            return self.ws.ids[:, row].clone()
        ev = self._plan_done.pop(row, None)
        side = self.side_stream()
        if ev is not None:
            side.wait_event(ev)
        with torch.cuda.stream(side):
            ids = self.ws.ids[:, row].to("cpu", non_blocking=False)
        return ids

    def read_prefix(self, layer_id_index: int, req_to_token_row: torch.Tensor, n: int,
                    device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions ``0 .. n-1`` of one request from the host tier, on ``device``
        (``HostTier.read_prefix`` with this engine's ``ops.copy_blocks``).

        Returns:
            ``(k [n, H, D], v [n, H, Dv])`` in the host tier's dtype.
        """
        if self.host.compact:
            return self.host.read_prefix(layer_id_index, req_to_token_row, n, device, self.ops.copy_blocks,
                                         slots=self.host_slots_d[layer_id_index].to(device))
        return self.host.read_prefix(layer_id_index, req_to_token_row, n, device, self.ops.copy_blocks)

    # ---- a compact host tier's slots -----------------------------------------------------
    def _host_kw(self, li: int) -> dict:
        """The ``slots`` / ``dropped`` arguments of a host write of sparse layer ``li`` (a
        compact tier: its table row on the device and its dropped-writes counter; else none,
        so the whole tier's calls are exactly as before)."""
        if self.host_slots_d is None:
            return {}
        return {"slots": self.host_slots_d[li], "dropped": self.host_dropped[li, 0]}

    def assign_host_pieces(self, layers, heads, pages) -> torch.Tensor:
        """Give host pieces ``(layers[i], heads[i], pages[i])`` (sparse-layer index, KV head,
        host page; ``[N]`` integers) slots of the compact host tier (``HostTier.assign``: a
        piece keeps a slot it has, duplicates share one) and copy them into the device table
        (staged through page-locked memory on CUDA: no wait for the device, ``devcopy``).

        Returns: ``[N]`` int64 (CPU) the pieces' pool rows.
        Raises:
            RuntimeError: the whole host tier (no ``host_slots``).
            ValueError: a bad argument (``HostTier.assign``); HostTierFull: not enough free slots
                (both before anything changes)."""
        if self.host_slots_d is None:
            raise RuntimeError("assign_host_pieces: this engine's host tier is whole (no host_slots)")
        got = self.host.assign(layers, heads, pages)
        if got.numel():
            li = torch.as_tensor(layers).reshape(-1).to(torch.int64)
            hh = torch.as_tensor(heads).reshape(-1).to(torch.int64)
            pp = torch.as_tensor(pages).reshape(-1).to(torch.int64)
            flat = (li * self.head_num + hh) * self.host.num_pages + pp
            self.host_slots_d.view(-1).index_copy_(0, to_device(flat, self.device),
                                                   to_device(got, self.device, torch.int32))
        return got

    def free_host_pages(self, pages) -> int:
        """Free every slot (all sparse layers and KV heads) of host pages ``pages [M]`` in the
        compact host tier and in the device table (``HostTier.unassign``). Orders the current
        stream after the last forward and every prefetch in flight first (as ``reset_rows``),
        so no queued kernel reads or writes a freed slot through the old table.

        Returns: the number of slots freed.
        Raises:
            RuntimeError: the whole host tier. ValueError: bad pages (before anything changes)."""
        if self.host_slots_d is None:
            raise RuntimeError("free_host_pages: this engine's host tier is whole (no host_slots)")
        n = self.host.unassign(pages)
        self._write_block.clear()             # (assign_write_pages checks its rows again)
        if n:
            self._after_forward()
            self.pipe.drain()
            pp = torch.unique(torch.as_tensor(pages).reshape(-1).to(torch.int64))
            cols = (torch.arange(self.head_num, dtype=torch.int64)[:, None] * self.host.num_pages + pp[None, :])
            self.host_slots_d.index_fill_(1, to_device(cols.reshape(-1), self.device), -1)
        return n

    WRITE_WARN_S = 10.0     # the most often a full pool refusing a write-back page is warned about

    def assign_write_pages(self, rows: Sequence[int], seq_lens: Sequence[int], req_to_token: torch.Tensor) -> int:
        """A compact host tier: give the page each request's next token lands in (position
        ``seq_lens[i] - 1`` of row ``rows[i]``) a slot per (sparse layer, KV head), so
        ``append_tokens`` can write the block back once complete. A row whose page got them
        for the same block already is skipped (no device read); the others' pages are read from
        ``req_to_token`` (one small gather; on CUDA it waits for the table's writes). When the
        pool is full the pages that do not fit get none: their write-back is dropped and
        counted (``host_dropped[:, 0]``), here in ``host_write_misses`` (pieces) with a warning
        at most every ``WRITE_WARN_S`` seconds. Nothing on the whole tier.

        Args:
            rows, seq_lens: host integers, one per request (``seq_lens`` with the new token).
            req_to_token: SGLang's ``[R, W]`` table.
        Returns: slots newly assigned."""
        if self.host_slots_d is None or not len(rows):
            return 0
        bs = self.bs
        todo = [(int(r), int(s) - 1) for r, s in zip(rows, seq_lens)
                if int(s) >= 1 and self._write_block.get(int(r)) != (int(s) - 1) // bs]
        if not todo:
            return 0
        r_t = torch.tensor([r for r, _ in todo], dtype=torch.int64)
        pos = torch.tensor([p for _, p in todo], dtype=torch.int64)
        loc = req_to_token[r_t.to(req_to_token.device), pos.to(req_to_token.device)].to("cpu", torch.int64)
        pages = torch.unique(torch.div(loc, bs, rounding_mode="floor"))
        L, H, P = self.host.num_layers, self.head_num, self.host.num_pages
        cols = (torch.arange(H)[:, None] * P + pages[None, :]).reshape(-1)             # [H * n]
        need = (self.host.slots[:, cols] < 0).view(L, H, -1).any(0).any(0)             # [n] pages lacking one
        got = 0
        miss = 0
        li = torch.arange(L)[:, None].expand(L, H).reshape(-1)                          # [L * H]
        hh = torch.arange(H)[None, :].expand(L, H).reshape(-1)
        todo_pages = pages[need]
        n = todo_pages.numel()
        before = self.host.free_slots
        try:                                       # every page at once (one assign, one table copy)
            if n:
                self.assign_host_pieces(li.repeat(n), hh.repeat(n), todo_pages.repeat_interleave(L * H))
            got = before - self.host.free_slots
            todo_pages = todo_pages[:0]
        except HostTierFull:                       # then page by page: one that fits gets all its pieces
            pass
        for pg in todo_pages.tolist():
            before = self.host.free_slots
            try:
                self.assign_host_pieces(li, hh, torch.full_like(li, pg))
            except HostTierFull:
                miss += int((self.host.slots[li, hh * P + pg] < 0).sum())
                self.write_starved.update(r for (r, _), lc in zip(todo, loc.tolist()) if lc // bs == pg)
                continue
            got += before - self.host.free_slots
        if miss:
            self.host_write_misses += miss
            if self._write_warn.due():
                logger.warning("OasisKV: the compact host tier is full: %d pieces of pages decoded into have no slot "
                               "(their blocks are not written back: their requests end; %d in all so far); raise pd_host_slots",
                               miss, self.host_write_misses)
        for (r, p), lc in zip(todo, loc.tolist()):
            if bool((self.host.slots[:, torch.arange(H) * P + lc // bs] >= 0).all()):
                self._write_block[r] = p // bs
        return got

    # ---- decode ---------------------------------------------------------------------------
    def begin_decode_step(self, rows: torch.Tensor, seq_lens: torch.Tensor, req_to_token: torch.Tensor, *,
                          mode: StepMode | str = StepMode.EAGER, max_seq_len: int | None = None,
                          rows_host: Sequence[int] | None = None,
                          seq_lens_host: Sequence[int] | None = None, seq_offset: int = 0,
                          dense: bool = False) -> DecodeStep:
        """Start a decode step: call once per batch, before its first sparse layer.

        Args:
            rows: ``[B]`` request rows. seq_lens: ``[B]`` context lengths including the new
                token. req_to_token: SGLang's ``[R, max_len]`` table (position -> token slot).
            mode: ``StepMode`` (or its value): ``eager`` (the step runs now), ``capture`` (SGLang
                captures or warms up a decode CUDA graph: no host or device value is read; call
                ``prepare_step_device`` inside the graph) or ``replay`` (host bookkeeping of a
                captured step about to be replayed; ``rows_host`` / ``seq_lens_host`` are the
                real rows, without padding, and are required).
            max_seq_len: ``max(seq_lens)`` when the caller knows it on the host (SGLang's
                ``seq_lens_cpu``); otherwise (eager) it is read from the device (a sync); capture
                uses ``req_to_token``'s width unless given. It must not be below the true
                maximum (blocks past it are never selected).
            rows_host, seq_lens_host: ``rows`` and ``seq_lens`` as host integers (SGLang's
                scheduler rows and ``seq_lens_cpu``): the "was every row predicted for this
                context?" check then reads no device memory.
            seq_offset: tokens of context each row has beyond ``seq_lens`` (0 or 1): the decode
                row of SGLang's paired TARGET_VERIFY batch sees one more token than the
                batch's ``seq_lens``. Added on the device: at once (eager) or in
                ``prepare_step_device`` (capture, so a replay adds it to the replayed lengths).
                ``seq_lens_host`` and ``max_seq_len`` already include it.
            dense: ``capture`` only: capture the dense path for short contexts
                (``dense_short_contexts``) as a second decode graph of the same batch size,
                beside the full path's (``can_capture_dense``). Its layers select and copy
                nothing; ``prepare_step_device`` records the slot update of ``_dense_plan``.
                Once one was captured, a ``replay`` step whose rows take the dense path (the
                host check of ``_can_run_dense``) returns ``DecodeStep.dense`` True: the
                caller then replays the dense graph.
        Returns:
            The :class:`DecodeStep` the layers will read (also ``self.step``).
        Raises:
            ValueError: an unknown mode; ``rows`` / ``seq_lens`` that are not 1-D integer tensors
                of one length; a ``req_to_token`` that is not a 2-D integer table; host lists
                that are not lists of integers of the batch's length, or only one of them; rows
                outside the request table, lengths outside ``1 .. req_to_token's width``;
                ``max_seq_len`` outside that range or below the longest host length; ``replay``
                without host lists. All checked before any state changes. With host lists the
                device tensors are taken to hold the same values (they are not read back);
                without them (eager) the values are checked with one device read.
        """
        what = "begin_decode_step"
        self._flush_folds()                       # decode writes no attention consumed (none in SGLang)
        try:
            mode = StepMode(mode)
        except ValueError:
            raise ValueError(f"{what}: mode {mode!r}: want one of {[m.value for m in StepMode]}") from None
        if seq_offset not in (0, 1) or isinstance(seq_offset, bool):
            raise ValueError(f"{what}: seq_offset {seq_offset!r}: want 0 or 1 (tokens beyond seq_lens)")
        if dense is not False and (dense is not True or mode is not StepMode.CAPTURE):
            raise ValueError(f"{what}: dense={dense!r} in a {mode.value} step: want True only when capturing "
                             "(a replay chooses the dense graph itself)")
        if dense and not self.can_capture_dense():
            raise ValueError(f"{what}: dense capture while the dense path is off (can_capture_dense: "
                             "dense_short_contexts off, measure_agreement, a PD decode node or benchmark hooks)")
        width = None if req_to_token is None else check_table(req_to_token, what)
        if mode is StepMode.REPLAY:
            return self._begin_replay(rows_host, seq_lens_host, width, req_to_token)
        B = check_batch(rows, seq_lens, what)
        if width is None:
            raise ValueError(f"{what}: req_to_token is required for an {mode.value} step")
        host = None
        if (rows_host is None) != (seq_lens_host is None):
            raise ValueError(f"{what}: rows_host and seq_lens_host go together (one of them is None)")
        if mode is StepMode.EAGER and rows_host is not None:
            host = host_lists(rows_host, seq_lens_host, what, self.ws.R, width)
            if len(host[0]) != B:
                raise ValueError(f"{what}: rows_host / seq_lens_host have {len(host[0])} entries for a "
                                 f"batch of {B}")
        if max_seq_len is not None:
            max_seq_len = as_int(max_seq_len, "max_seq_len", what)
            if not 1 <= max_seq_len <= width:
                raise ValueError(f"{what}: max_seq_len {max_seq_len}: want 1 .. {width} (req_to_token's width; "
                                 "the new token included)")
            if host is not None and host[1] and max_seq_len < max(host[1]):
                raise ValueError(f"{what}: max_seq_len {max_seq_len} is below the longest context in "
                                 f"seq_lens_host ({max(host[1])}): blocks past it would never be selected")
        rows_d = rows.to(self.device, torch.int64)
        seq = seq_lens.to(self.device, torch.int64)
        if seq_offset and mode is not StepMode.CAPTURE:
            seq = seq + seq_offset
        rtt = req_to_token if req_to_token.device == self.device else req_to_token.to(self.device)
        if mode is StepMode.CAPTURE:
            max_seq = max_seq_len if max_seq_len is not None else width
        elif B == 0:
            max_seq = 1
        elif host is not None:
            max_seq = max_seq_len if max_seq_len is not None else max(host[1])
        else:
            # no host values: check the device's (one read; the step would read the device anyway)
            lo_r, hi_r, lo_s, hi_s = torch.stack([rows_d.min(), rows_d.max(), seq.min(), seq.max()]).tolist()
            if lo_r < 0 or hi_r >= self.ws.R or lo_s < 1 or hi_s > width:
                raise ValueError(f"{what}: rows in [{lo_r}, {hi_r}] / seq_lens in [{lo_s}, {hi_s}]: want rows in "
                                 f"0 .. {self.ws.R - 1} and lengths in 1 .. {width} (req_to_token's width)")
            if max_seq_len is not None and max_seq_len < hi_s:
                raise ValueError(f"{what}: max_seq_len {max_seq_len} is below the longest context ({hi_s})")
            max_seq = max_seq_len if max_seq_len is not None else hi_s
        step = DecodeStep(mode, rows_d, seq, rtt, -(-max_seq // self.bs), max_seq,
                          None if host is None else host[0], None if host is None else host[1],
                          sync=not self.predictor.asynchronous,
                          seq_offset=seq_offset if mode is StepMode.CAPTURE else 0)
        self._step = step
        if mode is StepMode.CAPTURE and dense:
            step.dense, step.sync = True, False
            self._dense_graphs = True
        if mode is StepMode.CAPTURE or B == 0:
            return step
        self._note_forward_stream()
        if self.host_slots_d is not None:        # a compact tier: the pages this step writes into get slots
            if host is not None:
                self.assign_write_pages(host[0], host[1], rtt)
            else:
                self.assign_write_pages(rows_d.tolist(), seq.tolist(), rtt)
        self._service_remote()
        self._host_steps += 1
        step.timed = self.last_step_timed = self.device.type == "cuda"    # the stage streams exist on CUDA only
        s = self.stats
        s.decode_steps += 1
        s.new_request_started, self._prefilled = self._prefilled, False
        self.last_batch = (rows_d, seq)
        if self.predictor.asynchronous and not self.bench.assume_predicted:
            # every row must have been predicted for exactly this context; otherwise this step
            # selects synchronously (e.g. a request resumed with another length)
            rec = self.record
            if host is not None and rec.trusted:
                step.sync = not rec.all_predicted_host(*host)
                k = self.bench.host_check_interval
                if k and self._host_steps % k == 0:
                    dev = not rec.all_predicted_device(rows_d, seq)
                    if dev != step.sync:
                        logger.error(
                            "OasisKV: host record of predictions disagrees with the device (host %s, device %s); "
                            "reading the device every step from now on", step.sync, dev)
                        rec.distrust()
                        step.sync = dev
            else:
                step.sync = not rec.all_predicted_device(rows_d, seq)
            s.sync_steps += int(step.sync)
        step.dense = self._can_run_dense(host, max_seq)
        if step.dense:
            step.sync = False
            s.dense_steps += 1
        self.prepare_step_device()               # (a dense step's slot update included)
        if host is not None and self.record.trusted and self.cfg.dense_short_contexts and (step.dense or (
                not self.predictor.asynchronous and self._next_fits(max_seq))):
            # the working sets hold every block of the context (a dense step: of the next one too;
            # a synchronous full step: of this one, which selects them all): the next step may run dense
            self.record.mark(rows_d, step.seq_p1)
            self.record.mirror(host[0], [x + 1 for x in host[1]])
        return step

    def can_capture_dense(self) -> bool:
        """A decode CUDA graph of the dense path for short contexts may be captured beside the
        full path's (``begin_decode_step(mode="capture", dense=True)``): ``dense_short_contexts``
        is on, without ``measure_agreement``, a PD decode node's remote reads or the
        benchmarks' prefetch hooks (the cases ``_can_run_dense`` refuses whatever the batch)."""
        cfg, b = self.cfg, self.bench
        return bool(cfg.dense_short_contexts) and not cfg.measure_agreement and self.stages.remote is None \
            and not b.skip_prefetch and not b.assume_predicted

    def _next_fits(self, max_seq: int) -> bool:
        """The next context of a batch whose longest context is ``max_seq`` tokens fits the
        working set (``K * block_size`` tokens): the condition of the dense path."""
        return max_seq + 1 <= self.ws.K * self.bs

    def _can_run_dense(self, host, max_seq: int) -> bool:
        """Host-only: this eager step may take the dense path for short contexts
        (``dense_short_contexts``): every row's next context fits the working set
        (``max_seq + 1 <= K * bs`` tokens) and the host record says each row's working set was
        made whole for exactly this context (by the last step or the prefill's prediction). Not
        with ``measure_agreement``, on a PD decode node, under the benchmarks' prefetch hooks,
        or without host rows."""
        cfg, b = self.cfg, self.bench
        if not cfg.dense_short_contexts or host is None or not host[0] or cfg.measure_agreement:
            return False
        if self.stages.remote is not None or b.skip_prefetch or b.assume_predicted:
            return False
        if not self._next_fits(max_seq) or not self.record.trusted:
            return False
        return self.record.all_predicted_host(*host)

    def _dense_plan(self, st: DecodeStep) -> None:
        """The dense step's working-set update, for every sparse layer at once (``ids`` /
        ``last_used`` ``[L, R, H, K]``): the blocks of the tokens at ``seq - 1`` and ``seq`` (the
        one this step appends and the next step's) each get the first free slot where not
        resident; every resident block of the next context is marked used at the next step's
        LRU clock and counted a hit, as the full path's plan would (``plan_admissions``: with
        ``K`` at least the context's blocks the top-K is every block, and missing ones take free
        slots in slot order). A new block has no token before the appended one: nothing is
        copied. ``ops.dense_plan``: one launch per step with the Triton kernels (kernel 9), about 25
        with the torch reference, instead of the per-layer pipeline; no host read,
        so a captured dense step records it (the padding row of a captured batch is updated
        like any row but counts no hits)."""
        if st.mode is not StepMode.CAPTURE:
            self.pipe.join()                      # plans queued on the stage streams write ids
            self.pipe.forget_waits()              # nothing waits on a transfer in this step
        # (a capture: the full path's capture before it ended joined; a replay joins first)
        self.ops.dense_plan(self.ws.ids, self.ws.last_used, st.rows, st.seq, self.bs, self.predictor.asynchronous,
                            st.clock_next, self.counters, self.padding_row)

    def _begin_replay(self, rows_host, seq_lens_host, width: int | None, req_to_token=None) -> DecodeStep:
        """``begin_decode_step(mode="replay")``: the host side of what the captured layers did
        when captured (step counters, the host record of predictions, the batch for reporting);
        the replay also waits for prefetches queued by eager work (a prefill predicts a
        request's first decode step). The host record is advanced before the replay runs; if
        the replay then fails, the next report finds the mismatch and rebuilds it."""
        if rows_host is None or seq_lens_host is None:
            raise ValueError("begin_decode_step: a replay needs rows_host and seq_lens_host (the real rows)")
        rows_l, seq_l = host_lists(rows_host, seq_lens_host, "begin_decode_step (replay)", self.ws.R, width)
        self._note_forward_stream()               # the replay runs on the caller's stream
        if not self._replay_misses_armed:         # (after the captures' warm-up runs)
            self.replay_misses.zero_()
            self._replay_misses_armed = True
        self.pipe.join()
        if self.host_slots_d is not None and req_to_token is not None:
            self.assign_write_pages(rows_l, seq_l, req_to_token)
        self._service_remote()
        self.pipe.forget_waits()                  # exposed waits are timed on eager steps only
        self.last_step_timed = False
        self._host_steps += 1
        s = self.stats
        s.decode_steps += 1
        s.graph_steps += 1
        s.new_request_started, self._prefilled = self._prefilled, False
        self.last_batch = (rows_l, seq_l)
        max_seq = max(seq_l, default=0)
        dense = self._dense_graphs and self._can_run_dense((rows_l, seq_l), max_seq)
        s.dense_steps += int(dense)
        if self.predictor.asynchronous:
            self.record.mirror(rows_l, [x + 1 for x in seq_l])
        elif self._dense_graphs and rows_l and self.record.trusted and self._next_fits(max_seq):
            # current: this step selects (or, dense, keeps) the whole context, as an eager step
            # marks it in begin_decode_step; the graph marks nothing for current, so mark here
            self.record.mark(to_device(rows_l, self.device), to_device([x + 1 for x in seq_l], self.device))
            self.record.mirror(rows_l, [x + 1 for x in seq_l])
        self._step = None                         # the graph runs the layers: no eager layer may use this step
        e = self._no_tensor
        return DecodeStep(StepMode.REPLAY, e, e, e, 0, 0, rows_l, seq_l, dense=dense)

    def prepare_step_device(self) -> None:
        """The step's per-step device values: LRU clock + 1, ``seq - 1``, ``seq + 1`` (three
        launches per step instead of per layer; a captured step's ``seq_offset`` first).
        Graph-recordable (no host read): SGLang's
        ``init_forward_metadata_in_graph`` calls it inside a captured decode graph; an eager
        ``begin_decode_step`` calls it itself.

        Raises:
            RuntimeError: no step was begun (or the last one was a replay).
        """
        st = self._step
        if st is None:
            raise RuntimeError("OasisKV: prepare_step_device without begin_decode_step")
        self._clock += 1
        if st.seq_offset:
            st.seq = st.seq_lens + st.seq_offset     # recorded: a replay offsets the replayed lengths
        if st.mode is StepMode.CAPTURE and self.check_replays and self.predictor.asynchronous and not (
                self.bench.assume_predicted or self.bench.skip_prefetch):
            # each replay checks the host's decision that every row was predicted for exactly
            # this context (``can_replay``) against the device record, before layer 0 marks it
            bad = self.record.seq[st.rows] != st.seq
            if self.padding_row is not None:
                bad &= st.rows != self.padding_row
            self.replay_misses += bad.sum()
        st.seq_m1, st.seq_p1, st.clock_next = st.seq - 1, st.seq + 1, self._clock + 1
        if st.dense:
            self._dense_plan(st)
            if st.mode is StepMode.CAPTURE and self.predictor.asynchronous:
                self.record.mark(st.rows, st.seq_p1)     # what layer 0's prefetch marks on the full path

    @property
    def clock(self) -> torch.Tensor:
        """The LRU clock (0-dim int64 device tensor; advanced once per decode step)."""
        return self._clock

    @property
    def step(self) -> DecodeStep | None:
        """The current decode step (``None`` before the first one and after a replay's bookkeeping)."""
        return self._step

    def can_replay(self, rows_host: Sequence[int] | None, seq_lens_host: Sequence[int] | None) -> bool:
        """Host-only check before replaying a captured decode step (no device read).

        Args:
            rows_host, seq_lens_host: the batch's request rows and context lengths (including
                the new token), host integers, in batch order.
        Returns:
            True when the captured step computes this batch exactly as the eager one would: the
            predictor selects synchronously (``current``), or every row was predicted for
            exactly this context according to the host record. False when the record is not
            trusted (a prediction came without host rows) or a row was not predicted, and on a
            PD decode node whose steps read from the prefill node inside their layers
            (``attach_remote`` without ``pd_read_mode: deferred`` and a predictor planning a step
            ahead): the caller then runs the step eagerly, which selects synchronously.
        """
        if rows_host is None or seq_lens_host is None or len(rows_host) != len(seq_lens_host) \
                or any(r is None for r in rows_host):
            return False
        if self.stages.remote is not None and not (self.stages.defers_reads and self.predictor.asynchronous):
            return False                          # a PD step that reads inside its layers (core/remote.py)
        if not self.predictor.asynchronous:
            return True
        return self.record.can_replay(rows_host, seq_lens_host)

    def decode_attention(self, layer_id: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                         scale: float | None, q_draft: torch.Tensor | None = None,
                         k_draft: torch.Tensor | None = None, v_draft: torch.Tensor | None = None) -> torch.Tensor:
        """Decode of one sparse layer for the current step (one new token per request, already
        written by ``write_kv``).

        Args:
            q: ``[B, Hq, D]``. k_new: ``[B, H, D]``, v_new: ``[B, H, Dv]`` the new tokens.
            scale: softmax scale (``None``: ``1/sqrt(D)``).
            q_draft, k_draft, v_draft: the paired draft row (``[B, Hq, D]``, ``[B, H, D/Dv]``)
                at position ``seq_lens``: it attends over the same working set plus the new
                token and itself; its K/V are never written (a probe). Its query feeds the
                ``lookahead`` predictor.
        Returns:
            ``[B, Hq, Dv]``, or ``[B, 2, Hq, Dv]`` (normal row, draft row) with a draft row.
        Raises:
            ValueError: a dense or unknown layer; a batch other than the step's; draft tensors
                given partly, or with the wrong batch or size.
            RuntimeError: no step was begun, the step is a replay, or a captured step's device
                values were not prepared (``prepare_step_device``).

        With an asynchronous predictor the working set was prefetched by the previous step (or
        the prefill); this layer only waits for its transfer event. A step whose rows were not
        all predicted for exactly this context selects synchronously with the current query.
        In a captured step the last sparse layer joins the stage streams, so the step is
        self-contained (a graph cannot wait on work recorded outside it).
        """
        li = self._sparse_index(layer_id, "decode_attention")
        st = self._step
        if st is None:
            raise RuntimeError("OasisKV: decode_attention without begin_decode_step for this batch")
        cfg, bs = self.cfg, self.bs
        B = q.shape[0]
        if B != st.batch_size:
            raise ValueError(f"decode_attention: q has {B} rows but the step's batch has {st.batch_size}")
        H, D, Dv = self.head_num, self.head_dim, self.v_head_dim
        if not (q.dim() == 3 and q.shape[2] == D and q.shape[1] % H == 0 and q.shape[1] > 0):
            raise ValueError(f"decode_attention: q has shape {tuple(q.shape)}: want [B, Hq, {D}] with Hq a multiple "
                             f"of the {H} KV heads")
        Hq = q.shape[1]
        check_rows(k_new, (B, H, D), "k_new")
        check_rows(v_new, (B, H, Dv), "v_new")
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                  or not math.isfinite(scale) or scale <= 0):
            raise ValueError(f"decode_attention: scale {scale!r}: want a positive number or None (1/sqrt(D))")
        drafts = (q_draft, k_draft, v_draft)
        if any(x is not None for x in drafts):
            if any(x is None for x in drafts):
                raise ValueError("decode_attention: q_draft, k_draft and v_draft go together")
            for name, x, w in zip(("q_draft", "k_draft", "v_draft"), drafts, ((B, Hq, D), (B, H, D), (B, H, Dv))):
                check_rows(x, w, name)
        fold, self._folds[li] = self._folds[li], None      # this layer's decode write (``write_kv``)
        if fold is not None and fold[0].shape[0] != B:       # not this batch's: fold it on its own
            self._folds[li] = fold
            self._flush_fold(li)
            fold = None
        if B == 0:
            return q.new_empty((0, q.shape[1], self.v_head_dim) if q_draft is None else (0, 2, q.shape[1], self.v_head_dim))
        if st.seq_m1 is None:
            raise RuntimeError("OasisKV: the step's device values are not prepared (prepare_step_device)")
        rows, seq, rtt = st.rows, st.seq, st.req_to_token
        self.pipe.wait(li)
        qv = q.view(B, -1, self.head_dim)
        if st.sync:
            self.stages.run_now(li, qv, rows, seq, rtt, st.nb_max, self._clock)
        elif cfg.measure_agreement:
            self.stages.measure(li, qv, rows, seq, rtt, st.nb_max)
        # the new token into its resident block; completed blocks written back to the host tier
        self.ops.append_tokens(self.ws.k[li], self.ws.v[li], self.ws.ids[li], rows, st.seq_m1,
                               k_new.view(B, self.head_num, self.head_dim), v_new.view(B, self.head_num, self.v_head_dim),
                               *self.host.buffers(li), rtt, self.ws.violations, self.counters[li],
                               skip_row=self.padding_row, **self._host_kw(li),
                               fold=None if fold is None else (self.summaries.kmin[li], self.summaries.kmax[li],
                                                               fold[0], fold[1]))
        if q_draft is None:
            qq, kx, vx = q.view(B, 1, q.shape[1], q.shape[2]), None, None
        else:
            qq = torch.stack([q.view(B, q.shape[1], q.shape[2]), q_draft.view(B, q.shape[1], q.shape[2])], 1)
            # the draft token's own K/V as the KV cache would hold them (SGLang's verify pass
            # writes them to the pool before attending)
            kx = as_stored(k_draft.view(B, self.head_num, self.head_dim), self.kv_dtype)
            vx = as_stored(v_draft.view(B, self.head_num, self.v_head_dim), self.kv_dtype)
        out, _ = self.ops.sparse_decode_attention(qq, self.ws.k[li], self.ws.v[li], self.ws.ids[li], rows, seq,
                                                  scale, k_extra=kx, v_extra=vx)
        if self.predictor.asynchronous and not self.bench.skip_prefetch and not st.dense:
            qd = None if q_draft is None else q_draft.view(B, -1, self.head_dim)
            self.stages.launch(li, self.predictor.query(qv, qd), rows, st.seq_p1, rtt, -(-(st.max_seq + 1) // bs),
                               st.clock_next)
            if li == 0 and st.mode is StepMode.EAGER:
                self.record.mirror(st.rows_host, None if st.seq_host is None else [x + 1 for x in st.seq_host])
        if st.mode is StepMode.CAPTURE and li == len(self.sparse_layers) - 1:
            self.pipe.join()
        if q_draft is None:
            return out.view(B, q.shape[1], self.v_head_dim)
        return out

    # ---- lifecycle and reporting ----------------------------------------------------------
    def reset_rows(self, rows) -> None:
        """Free the working set of finished (or newly allocated) request rows.

        Waits (on the device) for every prefetch in flight and for the last forward first, so no
        stage still writes the rows' slots or reads their host pages when they are reused. The
        last forward matters under SGLang's overlap scheduler: it frees a finished request from
        its own stream while the next batch, which still holds that request for one step, runs
        on the forward stream."""
        self._after_forward()
        self.pipe.drain()
        self.ws.reset_rows(rows)
        self.record.forget(rows)
        for r in (rows.tolist() if isinstance(rows, torch.Tensor) else rows):
            self._write_block.pop(int(r), None)
            self.write_starved.discard(int(r))

    def _note_forward_stream(self) -> None:
        """Remember the stream the current forward runs on (CUDA; a capture's stream is not the
        one its replays run on, so only eager calls and a replay's bookkeeping count)."""
        if self.device.type == "cuda":
            self._fwd_stream = torch.cuda.current_stream(self.device)

    def _after_forward(self) -> None:
        """Order the current stream after the last forward's stream (no host sync)."""
        fs = self._fwd_stream
        if fs is not None:
            cur = torch.cuda.current_stream(self.device)
            if cur != fs:
                cur.wait_stream(fs)

    def residency(self) -> dict:
        """KV residency of the last decode step, counters and memory sizes: ``core.report.residency``.

        Raises:
            RuntimeError: a decoded token found its block not resident (``WorkingSet.check``).
        """
        return residency(self)
