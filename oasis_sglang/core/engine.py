"""OasisSparseKV: the per-layer OasisKV steps, on any device.

The heavy operations go through ``self.ops`` (``core.ops``): the torch references by default,
the Triton kernels of ``oasis_sglang.kernels`` on CUDA.

Synchronous ("current" query) selection, as in the foundation of the paper's pipeline; the
look-ahead predictor and the asynchronous predict/select/transfer stages build on it.

Decode step of one sparse layer (paper: Methodology):
  1. fold the new token's key into its block's min/max summary (``ops.write_kv``);
  2. (a block's summary is final once its last token is written);
  3. score every complete block of each request with the query (Quest bound, GQA max) and
     take the top-K per KV head, sink and recent blocks forced;
  4. bring missing blocks from the host tier into the working set, evicting LRU blocks,
     at most ``fetch_cap`` evicting admissions per (request, KV head);
  5. write the new token into its resident block, write blocks it completed back to the
     host tier (where the full KV cache lives) and attend over the working set.
Prefill of a sparse layer writes the host tier and summaries the same way and attends densely
over the new tokens plus any cached prefix read back from the host tier.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..config import OasisConfig, OasisConfigError
from . import attention as attn

logger = logging.getLogger(__name__)
from .host_tier import HostTier
from .ops import BaseKVOps, TorchKVOps
from .prefetch import PrefetchPipeline, get_predictor
from .summaries import KeySummaries
from .working_set import WorkingSet


@dataclass
class OasisStats:
    """Counters since start (blocks are (KV head, block) pieces of one layer)."""

    decode_steps: int = 0
    sync_steps: int = 0              # steps that selected synchronously although the predictor is async
    graph_steps: int = 0             # decode steps replayed from a CUDA graph (counted in decode_steps)
    new_request_started: bool = False  # a prefill ran since the previous decode step


class OasisSparseKV:
    """OasisKV state of one model: host tier, summaries and working set of its sparse layers.

    Args:
        cfg: the validated :class:`OasisConfig`.
        num_layers: model layers; ``cfg.dense_layers`` are excluded, the rest are sparse.
        num_tokens: token locations of the KV pool (``size + page_size`` of SGLang's pool).
        num_rows: request rows (SGLang ``ReqToTokenPool`` size).
        head_num, head_dim, v_head_dim: KV heads and head sizes; dtype: KV dtype.
        device: where the working set and summaries live.
        ops: the kernels (``core.ops.BaseKVOps``); default the torch references. The glue
            passes ``oasis_sglang.kernels.get_kv_ops("triton")`` on CUDA.
        predictor: ``core.prefetch`` predictor name; default ``cfg.predictor`` (``"auto"``:
            ``"current"``; the glue resolves it with ``cfg.predictor_for``).
    Raises:
        OasisConfigError: a dense layer index is out of range.
    """

    def __init__(self, cfg: OasisConfig, num_layers: int, num_tokens: int, num_rows: int,
                 head_num: int, head_dim: int, v_head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, ops: BaseKVOps | None = None, predictor: str | None = None):
        cfg.check_model(num_layers)
        if predictor is None:
            predictor = "current" if cfg.predictor == "auto" else cfg.predictor
        self.predictor = get_predictor(predictor)
        if cfg.measure_agreement and not self.predictor.asynchronous:
            raise OasisConfigError("kv_sparse_config: 'measure_agreement' needs a predictor that predicts a step "
                                   "ahead (previous or lookahead), not current")
        self.ops = ops if ops is not None else TorchKVOps()
        self.cfg, self.device, self.bs = cfg, torch.device(device), cfg.block_size
        self.head_num, self.head_dim, self.v_head_dim = head_num, head_dim, v_head_dim
        self.num_layers = num_layers
        self.sparse_layers = [i for i in range(num_layers) if i not in cfg.dense_layers]
        self.index = {l: i for i, l in enumerate(self.sparse_layers)}
        num_pages = -(-num_tokens // self.bs)
        pin = self.device.type == "cuda"
        L = len(self.sparse_layers)
        self.host = HostTier(L, num_pages, self.bs, head_num, head_dim, v_head_dim, dtype, pin_memory=pin,
                             pin_device=self.device.index if pin else None)
        self.summaries = KeySummaries(L, num_pages, head_num, head_dim, dtype, self.device)
        self.ws = WorkingSet(L, num_rows, head_num, cfg.budget_blocks, self.bs, head_dim, v_head_dim, dtype, self.device)
        self.stats = OasisStats()
        # hits, admitted (copied), evicted, written-back blocks per sparse layer: device counters,
        # read only when reporting; one row per layer so a layer's prefetch stream and the
        # compute stream never update the same element concurrently
        self._counters = torch.zeros((L, 4), dtype=torch.int64, device=self.device)
        self._step = 0
        self._step_d = torch.zeros((), dtype=torch.int64, device=self.device)   # LRU clock on the device
        # set by a caller that replays captured decode steps (CUDA graphs): every row is known to
        # be predicted for its context, so the per-step host check is skipped
        self.assume_predicted = False
        # set by the glue while SGLang captures (and warms up) a decode CUDA graph: see
        # ``decode_attention`` ("Graph mode") and ``graph_step``
        self.graph_mode = False
        # request row that pads a captured batch (SGLang's ReqToTokenPool never hands out row 0);
        # its tokens are not counted as invariant violations. None: no padding row.
        self.padding_row: int | None = None
        # request rows (host integers, batch order) of the batch being run, when the glue knows
        # them (SGLang: the scheduler's batch); None otherwise
        self.batch_rows_host: list[int] | None = None
        self._last_li = L                  # layer order wraps -> a new decode step begins
        self._last_step_timed = False      # the last decode step's exposed wait was timed (eager, CUDA)
        self._sync_step = True
        self._prefilled = False
        self._last_batch = None            # (rows, seq) device tensors of the last step, read when reporting
        self.pipe = PrefetchPipeline(L, self.device)
        # context length each row's working set was last predicted for (-1: none); written by the
        # first sparse layer's prediction only: every layer of a row is predicted in the same step
        self._pred_seq = torch.full((num_rows,), -1, dtype=torch.int64, device=self.device)
        # per-step values shared by the layers of one decode step (see ``_step_values``)
        self._step_vals = None
        # host mirror of the first sparse layer's predictions {row: context}, kept while every
        # call brings the rows and lengths on the host: the per-step check then reads no device
        # memory (no host synchronisation on the decode path); None once it cannot be trusted
        self._pred_host: dict[int, int] | None = {}
        # steps between confirmations of a step's decision on the device (0: never on the decode
        # path; residency() compares the whole record at every report instead)
        self.host_check_interval = 0
        self._agreement = torch.zeros((L, 2), dtype=torch.int64, device=self.device)   # [hits, true blocks]
        self._pred_wanted = (torch.full((L, num_rows, head_num, cfg.budget_blocks), -1, dtype=torch.int64,
                                        device=self.device) if cfg.measure_agreement else None)
        self._block_bytes = self.bs * (head_dim + v_head_dim) * torch.empty((), dtype=dtype).element_size()
        self._fwd_stream = None            # stream of the last forward (CUDA), see ``reset_rows``
        # OASIS_ABLATE=no-transfer: a speed ablation for benchmarks (scripts/bench_oasis.py --suite
        # stall): admissions are planned and counted but not copied, so the step's exposed transfer
        # cost is the difference to a normal run; the working set then holds wrong data
        ablate = os.environ.get("OASIS_ABLATE", "")
        if ablate not in ("", "no-transfer"):
            raise OasisConfigError(f"OASIS_ABLATE: unknown ablation {ablate!r} (choices: no-transfer, or unset)")
        self.skip_admission_copy = ablate == "no-transfer"
        if self.skip_admission_copy:
            logger.warning("OasisKV: OASIS_ABLATE=no-transfer: admitted blocks are NOT copied from the host tier "
                           "(a speed ablation for benchmarks: outputs are wrong)")

    @staticmethod
    def memory_plan(cfg: OasisConfig, num_layers: int, num_tokens: int, num_rows: int, head_num: int,
                    head_dim: int, v_head_dim: int, dtype_bytes: int) -> dict:
        """Bytes the state will allocate, before allocating it.

        Returns ``{"working_set": device bytes, "summaries": device bytes, "host_tier": host bytes}``.
        """
        L = num_layers - len([x for x in cfg.dense_layers if x < num_layers])
        pages = -(-num_tokens // cfg.block_size)
        return {
            "working_set": L * num_rows * head_num * cfg.budget_tokens * (head_dim + v_head_dim) * dtype_bytes,
            "summaries": 2 * L * pages * head_num * head_dim * dtype_bytes,
            "host_tier": L * pages * cfg.block_size * head_num * (head_dim + v_head_dim) * dtype_bytes,
        }

    def is_sparse(self, layer_id: int) -> bool:
        """True when ``layer_id`` (model layer index) is served by OasisKV."""
        return layer_id in self.index

    def _sparse_index(self, layer_id: int, what: str) -> int:
        """Index of sparse layer ``layer_id`` in the state. Raises ValueError for a dense or
        unknown layer (its KV cache is SGLang's, not OasisKV's)."""
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
        """
        li = self._sparse_index(layer_id, "write_kv")
        if not (loc.dim() == 1 and k.shape[0] == v.shape[0] == loc.shape[0]):
            raise ValueError(f"write_kv: loc {tuple(loc.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: "
                             f"want loc [N], k [N, {self.head_num}, {self.head_dim}], v [N, {self.head_num}, {self.v_head_dim}]")
        self.pipe.wait(li)       # a prefetch of this layer may still read the summaries / host tier
        s = self.summaries
        self.ops.write_kv(self.host.k[li], self.host.v[li], s.kmin[li], s.kmax[li], loc,
                          k.view(-1, self.head_num, self.head_dim), v.view(-1, self.head_num, self.v_head_dim),
                          self.bs, one_token_each=decode, write_host=not decode)

    # ---- prefill --------------------------------------------------------------------------
    def extend_attention(self, layer_id: int, q: torch.Tensor, rows: torch.Tensor, prefix_lens: torch.Tensor,
                         extend_lens: torch.Tensor, req_to_token: torch.Tensor, scale: float | None,
                         k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None) -> torch.Tensor:
        """Prefill (extend) of a sparse layer whose new K/V were already written (``write_kv``).

        Args:
            q: ``[T, Hq, D]`` queries of all new tokens, request after request.
            rows, prefix_lens, extend_lens: ``[B]``. req_to_token: SGLang's ``[R, max_len]`` table.
            k_new, v_new: ``[T, H, D/Dv]`` the new tokens' K/V (on the device); when given, only
                the cached prefix is read back from the host tier.
        Returns:
            ``[T, Hq, Dv]``.
        Raises:
            ValueError: a dense or unknown layer; ``rows``, ``prefix_lens`` and ``extend_lens`` of
                different lengths, a negative length, or ``sum(extend_lens) != T`` (checked
                before any state changes).
        """
        li = self._sparse_index(layer_id, "extend_attention")
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
                k = k_new[start:start + ext].view(ext, self.head_num, self.head_dim)
                v = v_new[start:start + ext].view(ext, self.head_num, self.v_head_dim)
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
            self.ws.drop_blocks_from(li, rows.to(self.device, torch.int64),
                                     torch.tensor([p // self.bs for p in pre_c], device=self.device))
        keep = [i for i, e in enumerate(ext_c) if e > 0]        # rows with new tokens (SGLang sends no others)
        if self.predictor.asynchronous and keep:
            # the first decode step's working set, predicted from the last prompt token's query
            ends = torch.tensor(ext_c, device=self.device).cumsum(0) - 1
            sel = torch.tensor(keep, device=self.device)
            seq_next = torch.tensor([pre_c[i] + ext_c[i] + 1 for i in keep], device=self.device)
            rtt = req_to_token if req_to_token.device == self.device else req_to_token.to(self.device)
            self.pipe.wait(li)
            self._issue_prefetch(li, q[ends[sel]].view(len(keep), -1, self.head_dim),
                                 rows.to(self.device, torch.int64)[sel], seq_next, rtt,
                                 -(-max(pre_c[i] + ext_c[i] + 1 for i in keep) // self.bs))
            if li == 0:
                self._mirror([rows_c[i] for i in keep], [pre_c[i] + ext_c[i] + 1 for i in keep])
        return out

    def read_prefix(self, layer_id_index: int, req_to_token_row: torch.Tensor, n: int,
                    device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions ``0 .. n-1`` of one request from the host tier, on ``device``.

        Args:
            layer_id_index: sparse-layer index (``self.index[layer_id]``).
            req_to_token_row: the request's row of SGLang's ``req_to_token`` (position -> slot).
            n: tokens to read.
        Returns:
            ``(k [n, H, D], v [n, H, Dv])`` in the host tier's dtype.

        Whole blocks go through ``ops.copy_blocks`` (on CUDA the H2D gather kernel, 4 KiB pieces
        straight from pinned memory; a 16K-token prefix of a Qwen3-8B layer is 32 MB, under a
        millisecond); a tail that is not a whole block is gathered token by token on the host.
        (SGLang's prefixes are page-aligned and ``--page-size`` is the block size, so the tail
        is empty for a chunked prefill or a radix-cache hit.) This replaces a token-by-token
        gather on the host CPU.
        """
        li, bs, H, D, Dv = layer_id_index, self.bs, self.head_num, self.head_dim, self.v_head_dim
        nb = n // bs
        dev = torch.device(device)
        parts_k, parts_v = [], []
        if nb:
            rt = req_to_token_row.to(dev)
            pages = torch.div(rt[:nb * bs:bs].to(torch.int64), bs, rounding_mode="floor")           # [nb]
            P = self.host.num_pages
            src = (torch.arange(H, device=dev)[:, None] * P + pages[None, :]).reshape(-1)        # [H * nb]
            dst = torch.arange(H * nb, device=dev)
            kb = torch.empty((H * nb, bs * D), dtype=self.host.dtype, device=dev)
            vb = torch.empty((H * nb, bs * Dv), dtype=self.host.dtype, device=dev)
            self.ops.copy_blocks(kb, vb, dst, self.host.k[li].view(-1, bs * D), self.host.v[li].view(-1, bs * Dv), src)
            parts_k.append(kb.view(H, nb * bs, D).transpose(0, 1))
            parts_v.append(vb.view(H, nb * bs, Dv).transpose(0, 1))
        if n > nb * bs:
            kt, vt = self.host.read_tokens(li, req_to_token_row[nb * bs:n])
            parts_k.append(kt.to(dev))
            parts_v.append(vt.to(dev))
        if len(parts_k) == 1:
            return parts_k[0].contiguous(), parts_v[0].contiguous()
        if not parts_k:
            return (torch.empty((0, H, D), dtype=self.host.dtype, device=dev),
                    torch.empty((0, H, Dv), dtype=self.host.dtype, device=dev))
        return torch.cat(parts_k), torch.cat(parts_v)

    # ---- decode ---------------------------------------------------------------------------
    def decode_attention(self, layer_id: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                         rows: torch.Tensor, seq_lens: torch.Tensor, req_to_token: torch.Tensor,
                         scale: float | None, max_seq_len: int | None = None,
                         q_draft: torch.Tensor | None = None, k_draft: torch.Tensor | None = None,
                         v_draft: torch.Tensor | None = None, rows_host: Sequence[int] | None = None,
                         seq_lens_host: Sequence[int] | None = None) -> torch.Tensor:
        """Decode of a sparse layer (one new token per request, already written by ``write_kv``).

        Args:
            q: ``[B, Hq, D]``. k_new: ``[B, H, D]``, v_new: ``[B, H, Dv]`` the new tokens.
            rows: ``[B]`` request rows. seq_lens: ``[B]`` context lengths including the new token.
            max_seq_len: ``max(seq_lens)`` when the caller knows it on the host (SGLang's
                ``seq_lens_cpu``); otherwise it is read from the device (a sync). It must not
                be below the true maximum (blocks past it are never selected).
            q_draft, k_draft, v_draft: the paired draft row (``[B, Hq, D]``, ``[B, H, D/Dv]``)
                at position ``seq_lens``: it attends over the same working set plus the new
                token and itself; its K/V are never written (a probe). Its query feeds the
                ``lookahead`` predictor.
            rows_host, seq_lens_host: ``rows`` and ``seq_lens`` as host integers (SGLang's
                ``req_pool_indices_cpu`` / ``seq_lens_cpu``), when the caller has them: the
                per-step "was every row predicted for this context?" check then reads no
                device memory (the record is compared with the device one at each ``residency()``).
        Returns:
            ``[B, Hq, Dv]``, or ``[B, 2, Hq, Dv]`` (normal row, draft row) with a draft row.
        Raises:
            ValueError: a dense or unknown layer; draft tensors given partly, or with the wrong
                batch or size; ``rows_host`` / ``seq_lens_host`` of the wrong length or out of
                range, ``max_seq_len`` below 1 (the host values are checked at a step's first
                sparse layer, before any state changes).

        With an asynchronous predictor the working set was prefetched by the previous step (or
        the prefill); this layer only waits for its transfer event. A step whose rows were not
        all predicted for exactly this context (read once per step at its first sparse layer)
        selects synchronously with the current query instead.

        Graph mode (``graph_mode``, set while SGLang captures a decode CUDA graph): nothing here
        reads the host or the device's values; the top-K candidates span ``req_to_token``'s
        width (the longest context a row can hold) instead of ``max_seq_len``; only the device
        clock advances (``graph_step`` does the host bookkeeping before each replay, and
        ``can_replay`` decides beforehand that every row was predicted); the last sparse layer
        joins the stage streams, so a captured step is self-contained (its last layers'
        transfers cannot overlap the next step). Rows equal to ``padding_row`` pad the batch.
        """
        li = self._sparse_index(layer_id, "decode_attention")
        cfg, bs = self.cfg, self.bs
        B = q.shape[0]
        drafts = (q_draft, k_draft, v_draft)
        if any(x is not None for x in drafts):
            if any(x is None for x in drafts):
                raise ValueError("decode_attention: q_draft, k_draft and v_draft go together")
            want = ((B, q.shape[-2], q.shape[-1]) if q.dim() == 3 else tuple(q.shape),
                    (B, self.head_num, self.head_dim), (B, self.head_num, self.v_head_dim))
            for name, x, w in zip(("q_draft", "k_draft", "v_draft"), drafts, want):
                if x.numel() != math.prod(w) or x.shape[0] != B:
                    raise ValueError(f"decode_attention: {name} has shape {tuple(x.shape)}, expected {w}")
        if B == 0:
            return q.new_empty((0, q.shape[1], self.v_head_dim) if q_draft is None else (0, 2, q.shape[1], self.v_head_dim))
        rows_d = rows.to(self.device, torch.int64)
        seq = seq_lens.to(self.device, torch.int64)
        rtt = req_to_token if req_to_token.device == self.device else req_to_token.to(self.device)
        if self.graph_mode:          # captured: sized for the longest context a row can hold
            max_seq = rtt.shape[1]
        else:
            max_seq = max_seq_len if max_seq_len is not None else int(seq.max())
        nb_max = -(-max_seq // bs)
        new_step = li <= self._last_li          # always true at the first sparse layer (li == 0)
        host = None
        if new_step and not self.graph_mode:
            # host values are read once per step, at its first sparse layer (the later layers
            # of the step serve the same rows and lengths)
            if rows_host is not None and seq_lens_host is not None:
                host = [int(r) for r in rows_host], [int(x) for x in seq_lens_host]
                if len(host[0]) != B or len(host[1]) != B:
                    raise ValueError(f"decode_attention: rows_host / seq_lens_host have {len(host[0])} / "
                                     f"{len(host[1])} entries for a batch of {B}")
                if min(host[0]) < 0 or min(host[1]) < 1:
                    raise ValueError(f"decode_attention: rows_host {host[0]} / seq_lens_host {host[1]}: want rows "
                                     f">= 0 and context lengths >= 1 (the new token included)")
            if max_seq < 1:
                raise ValueError(f"decode_attention: max_seq_len {max_seq}: want >= 1 (the new token included)")
        if new_step:
            self._step_vals = None
            if self.graph_mode:      # device clock only; the host bookkeeping is graph_step's
                self._step_d += 1
                self._sync_step = False
            else:
                self._note_forward_stream()
                self._begin_step(li, rows_d, seq, host)
        self._last_li = li
        seq_m1, seq_p1, step_next = self._step_values(seq_lens, seq)
        self.pipe.wait(li)
        qv = q.view(B, -1, self.head_dim)
        if not self.predictor.asynchronous or self._sync_step:
            # 3.-4. score with this step's query, select and bring missing blocks in
            wanted, forced = self._predict(li, qv, rows_d, seq, rtt, nb_max)
            self._select_transfer(li, rows_d, seq, rtt, wanted, forced, self._step_d)
        elif cfg.measure_agreement:
            self._measure_agreement(li, qv, rows_d, seq, rtt, nb_max)
        # 5. the new token into its resident block; completed blocks written back to the host tier
        self.ops.append_tokens(self.ws.k[li], self.ws.v[li], self.ws.ids[li], rows_d, seq_m1,
                               k_new.view(B, self.head_num, self.head_dim), v_new.view(B, self.head_num, self.v_head_dim),
                               self.host.k[li], self.host.v[li], rtt, self.ws.violations, self._counters[li],
                               skip_row=self.padding_row)
        if q_draft is None:
            qq, kx, vx = q.view(B, 1, q.shape[1], q.shape[2]), None, None
        else:
            qq = torch.stack([q.view(B, q.shape[1], q.shape[2]), q_draft.view(B, q.shape[1], q.shape[2])], 1)
            kx = k_draft.view(B, self.head_num, self.head_dim)
            vx = v_draft.view(B, self.head_num, self.v_head_dim)
        out, _ = self.ops.sparse_decode_attention(qq, self.ws.k[li], self.ws.v[li], self.ws.ids[li], rows_d, seq,
                                                  scale, k_extra=kx, v_extra=vx)
        if self.predictor.asynchronous:
            qd = None if q_draft is None else q_draft.view(B, -1, self.head_dim)
            self._issue_prefetch(li, self.predictor.query(qv, qd), rows_d, seq_p1, rtt, -(-(max_seq + 1) // bs),
                                 step_next)
            if li == 0 and not self.graph_mode:
                self._mirror(None if host is None else host[0], None if host is None else [x + 1 for x in host[1]])
        if self.graph_mode and li == len(self.sparse_layers) - 1:
            # a captured step is self-contained: its prefetches join the compute stream before
            # the graph ends (a graph cannot wait on work recorded outside it)
            self.pipe.join()
        if q_draft is None:
            return out.view(B, q.shape[1], self.v_head_dim)
        return out

    def _step_values(self, seq_lens: torch.Tensor, seq: torch.Tensor):
        """``(seq - 1, seq + 1, device clock + 1)`` of the current decode step, computed by its
        first sparse layer and reused by the others while they pass the same ``seq_lens`` tensor
        (SGLang passes ``forward_batch.seq_lens`` to every layer): three launches per step
        instead of three per layer. Reset when a step begins (``_begin_step`` / graph mode)."""
        v = self._step_vals
        if v is None or v[0] is not seq_lens:
            v = self._step_vals = (seq_lens, seq - 1, seq + 1, self._step_d + 1)
        return v[1:]

    # ---- CUDA-graph decode (SGLang's decode graph runner) ------------------------------------
    def can_replay(self, rows_host: Sequence[int], seq_lens_host: Sequence[int]) -> bool:
        """Host-only check before replaying a captured decode step (no device read).

        Args:
            rows_host, seq_lens_host: the batch's request rows and context lengths (including
                the new token), host integers, in batch order.
        Returns:
            True when the captured step computes this batch exactly as the eager one would: the
            predictor selects synchronously (``current``), or every row was predicted for
            exactly this context according to the host record. False when the record is not
            trusted (a prediction came without host rows) or a row was not predicted: the
            caller then runs the step eagerly, which selects synchronously.
        """
        if rows_host is None or seq_lens_host is None or len(rows_host) != len(seq_lens_host) \
                or any(r is None for r in rows_host):
            return False
        if not self.predictor.asynchronous:
            return True
        if self._pred_host is None:
            return False
        return all(self._pred_host.get(int(r)) == int(x) for r, x in zip(rows_host, seq_lens_host))

    def graph_step(self, rows_host: Sequence[int], seq_lens_host: Sequence[int]) -> None:
        """Host bookkeeping of one decode step replayed from a CUDA graph; call before the replay.

        The captured ``decode_attention`` calls did the device work (including the LRU clock)
        when captured; what they did on the host (step counters, the host record of predictions,
        the batch for reporting) happens here. It also makes the replay wait for prefetches
        queued by eager work (a prefill predicts a request's first decode step).

        Args:
            rows_host, seq_lens_host: the real rows (no padding) and their context lengths.
        Raises:
            ValueError: the two lists differ in length or hold non-integers (nothing changed).

        The host record is advanced before the replay runs; if the replay then fails, the next
        report finds the mismatch and rebuilds the record from the device (``_confirm_mirror``).
        """
        try:
            rows_l, seq_l = [int(r) for r in rows_host], [int(x) for x in seq_lens_host]
        except (TypeError, ValueError):
            raise ValueError(f"graph_step: rows_host and seq_lens_host must be integers, got {rows_host!r}, "
                             f"{seq_lens_host!r}") from None
        if len(rows_l) != len(seq_l):
            raise ValueError(f"graph_step: {len(rows_l)} rows but {len(seq_l)} lengths")
        self._note_forward_stream(replay=True)    # the replay runs on the caller's stream
        self.pipe.join()
        self.pipe.forget_waits()                  # exposed waits are timed on eager steps only
        self._last_step_timed = False
        self._step += 1
        s = self.stats
        s.decode_steps += 1
        s.graph_steps += 1
        s.new_request_started, self._prefilled = self._prefilled, False
        self._last_li = len(self.sparse_layers)
        self._last_batch = (rows_l, seq_l)
        if self.predictor.asynchronous:
            self._mirror(rows_l, [x + 1 for x in seq_l])

    def _mirror(self, rows_h, seq_next_h) -> None:
        """Record the first sparse layer's predictions on the host, or stop trusting the record
        when a prediction came without host values (until ``_confirm_mirror`` rebuilds it)."""
        if self._pred_host is None:
            return
        if rows_h is None:
            self._pred_host = None
            return
        self._pred_host.update(zip(rows_h, seq_next_h))

    def _confirm_mirror(self) -> None:
        """Compare the host record of predictions with the device one (a host read; called when
        reporting, so the device work queued so far is done). A mismatch is logged as an error;
        either way, and when the record was dropped, it is rebuilt from the device record, so
        the per-step check (and CUDA-graph replay) stays on the host."""
        dev = self._pred_seq.tolist()
        if self._pred_host is None:
            logger.info("OasisKV: rebuilding the host record of predictions from the device (a decode step "
                        "came without host rows)")
        else:
            bad = {r: (s, dev[r]) for r, s in self._pred_host.items() if dev[r] != s}
            if bad:
                logger.error("OasisKV: host record of predictions disagrees with the device for rows %s (host, "
                             "device); rebuilt from the device", dict(list(bad.items())[:8]))
        self._pred_host = {r: s for r, s in enumerate(dev) if s >= 0}

    def _begin_step(self, li: int, rows: torch.Tensor, seq: torch.Tensor, host=None) -> None:
        """Host bookkeeping at the first sparse layer of a decode step: decides whether every
        row was predicted for exactly this context, from the host mirror when ``host`` =
        ``(rows, seq_lens)`` as host integers is given (no device read), else with one host
        read of the device record."""
        self._step += 1
        self._step_d += 1
        self._last_step_timed = self.device.type == "cuda"     # the stage streams exist on CUDA only
        s = self.stats
        s.decode_steps += 1
        s.new_request_started, self._prefilled = self._prefilled, False
        self._last_batch = (rows, seq)
        self._sync_step = False
        if self.predictor.asynchronous and not self.assume_predicted:
            # every row must have been predicted for exactly this context; otherwise this step
            # selects synchronously (e.g. a request resumed with another length)
            if host is not None and self._pred_host is not None and li == 0:
                self._sync_step = any(self._pred_host.get(r) != x for r, x in zip(*host))
                if self.host_check_interval and self._step % self.host_check_interval == 0:
                    dev = bool((self._pred_seq[rows] != seq).any())
                    if dev != self._sync_step:
                        logger.error("OasisKV: host record of predictions disagrees with the device (host %s, "
                                     "device %s); reading the device every step from now on",
                                     self._sync_step, dev)
                        self._pred_host, self._sync_step = None, dev
            else:
                self._sync_step = bool((self._pred_seq[rows] != seq).any())
            s.sync_steps += int(self._sync_step)

    def _predict(self, li, q, rows, seq, rtt, nb_max):
        """Stage (a): Quest scores of ``q [B, Hq, D]`` and the top-K per (request, KV head) for a
        step whose context is ``seq [B]`` tokens. Returns ``(wanted, forced)`` ``[B, H, K]``."""
        s, cfg = self.summaries, self.cfg
        return self.ops.select_topk(q, s.kmin[li], s.kmax[li], rtt, rows, seq, self.bs, cfg.sink_blocks,
                                    cfg.recent_blocks, nb_max, cfg.budget_blocks)

    def _select_transfer(self, li, rows, seq, rtt, wanted, forced, step):
        """Stages (b) and (c): plan admissions against the resident set (capped eviction) and copy
        the admitted blocks from the host tier into their slots, for a step of context ``seq``.

        A block with no token before the step's new one (it starts at ``seq - 1``) is admitted
        without a copy: the new token is its first."""
        self._copy_in(li, self._select(li, rows, seq, rtt, wanted, forced, step))

    def _select(self, li, rows, seq, rtt, wanted, forced, step):
        """Stage (b) (``ops.plan_transfer``): returns the copy lists ``(dst, src, counts)``."""
        if self.cfg.measure_agreement:
            self._pred_wanted[li][rows] = torch.where(forced, -1, wanted)
        return self.ops.plan_transfer(self.ws.ids[li], self.ws.last_used[li], rows, wanted, forced, step,
                                      self.cfg.fetch_cap, seq, rtt, self.bs, self.host.num_pages, self._counters[li],
                                      skip_row=self.padding_row)

    def _copy_in(self, li: int, plan) -> None:
        """Stage (c), H2D: the working-set pieces of ``plan = (dst, src, counts)`` from the host tier
        (nothing under the ``OASIS_ABLATE=no-transfer`` benchmark ablation)."""
        if self.skip_admission_copy:
            return
        bs = self.bs
        dst, src, counts = plan
        self.ops.copy_blocks(self.ws.k[li].view(-1, bs * self.head_dim), self.ws.v[li].view(-1, bs * self.v_head_dim),
                             dst.reshape(-1), self.host.k[li].view(-1, bs * self.head_dim),
                             self.host.v[li].view(-1, bs * self.v_head_dim), src.reshape(-1), counts=counts)

    def _issue_prefetch(self, li, q, rows, seq_next, rtt, nb_max_next, step=None) -> None:
        """Queue predict -> select -> transfer of layer ``li`` for the next step (context
        ``seq_next``; LRU clock ``step``, default the device clock + 1) on the pipeline's
        streams, after the work queued so far."""
        if li == 0:
            self._pred_seq[rows] = seq_next      # intent, on the compute stream (read by _begin_step)
        step = self._step_d + 1 if step is None else step
        self.pipe.launch(li, (
            lambda _: self._predict(li, q, rows, seq_next, rtt, nb_max_next),
            lambda wf: self._select(li, rows, seq_next, rtt, wf[0], wf[1], step),
            lambda plan: self._copy_in(li, plan),
        ), keep=(q, rows, seq_next, rtt, step))

    def _measure_agreement(self, li, q, rows, seq, rtt, nb_max) -> None:
        """Measurement mode: |predicted top-K ∩ this step's own top-K| over the non-forced blocks."""
        wanted, forced = self._predict(li, q, rows, seq, rtt, nb_max)
        true = torch.where(forced, -1, wanted)                              # [B, H, K]
        pred = self._pred_wanted[li][rows]
        hit = ((true[..., :, None] == pred[..., None, :]) & (pred >= 0)[..., None, :]).any(-1) & (true >= 0)
        self._agreement[li] += torch.stack([hit.sum(), (true >= 0).sum()])

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
        self._pred_seq[torch.as_tensor(rows, dtype=torch.int64, device=self.device)] = -1
        if self._pred_host is not None:
            for r in torch.as_tensor(rows).reshape(-1).tolist():
                self._pred_host.pop(int(r), None)

    def _note_forward_stream(self, replay: bool = False) -> None:
        """Remember the stream the current forward runs on (CUDA; a capture's stream is not the
        one its replays run on, so only eager calls and ``graph_step`` before a replay count)."""
        if self.device.type == "cuda" and (replay or not self.graph_mode):
            self._fwd_stream = torch.cuda.current_stream(self.device)

    def _after_forward(self) -> None:
        """Order the current stream after the last forward's stream (no host sync)."""
        fs = self._fwd_stream
        if fs is not None:
            cur = torch.cuda.current_stream(self.device)
            if cur != fs:
                cur.wait_stream(fs)

    def residency(self) -> dict:
        """KV residency of the last decode step and memory sizes (bytes). Reads the device counters.

        Raises:
            RuntimeError: a decoded token found its block not resident (``WorkingSet.check``).
        """
        self.pipe.drain()
        self._confirm_mirror()
        self.ws.check()
        s = self.stats
        hits, admitted, evicted, written_back = (int(x) for x in self._counters.sum(0).tolist())
        ctx, held = [], []
        if self._last_batch is not None:
            rows, seq = self._last_batch
            if isinstance(rows, list):           # recorded by graph_step (host values)
                rows = torch.tensor(rows, dtype=torch.int64, device=self.device)
                seq = torch.tensor(seq, dtype=torch.int64, device=self.device)
            li = 0
            ids0 = self.ws.ids[li][rows, 0]                                    # [B, K], layer 0, KV head 0
            held = ((seq[:, None] - ids0 * self.bs).clamp(0, self.bs) * (ids0 >= 0)).sum(-1).tolist()
            ctx = seq.tolist()
        agree = self._agreement.tolist()
        waits = self.pipe.exposed_wait_ms()
        return {
            "predictor": self.predictor.name,
            "context_tokens": ctx,
            "device_working_set_tokens": held,
            "budget_tokens": self.cfg.budget_tokens,
            "sparse_layers": len(self.sparse_layers),
            "working_set_bytes": self.ws.nbytes,
            "summary_bytes": self.summaries.nbytes,
            "host_tier_bytes": self.host.nbytes,
            "decode_steps": s.decode_steps,
            "hit_blocks": hits,
            "admitted_blocks": admitted,
            "evicted_blocks": evicted,
            "bytes_h2d": admitted * self._block_bytes,
            "bytes_d2h": written_back * self._block_bytes,
            "sync_steps": s.sync_steps,
            "graph_steps": s.graph_steps,
            "exposed_wait_ms": waits,
            "exposed_wait_timed": self._last_step_timed,
            "agreement": [a / t if t else None for a, t in agree] if self.cfg.measure_agreement else None,
            "prediction_check": "host" if self._pred_host is not None else "device",
        }
