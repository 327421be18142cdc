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

from dataclasses import dataclass, field

import torch

from ..config import OasisConfig
from . import attention as attn
from .host_tier import HostTier
from .ops import BaseKVOps, TorchKVOps
from .summaries import KeySummaries
from .working_set import WorkingSet


@dataclass
class OasisStats:
    """Counters since start (blocks are (KV head, block) pieces of one layer)."""

    decode_steps: int = 0
    new_request_started: bool = False
    last_context_tokens: list = field(default_factory=list)
    last_resident_tokens: list = field(default_factory=list)


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
    Raises:
        OasisConfigError: a dense layer index is out of range.
    """

    def __init__(self, cfg: OasisConfig, num_layers: int, num_tokens: int, num_rows: int,
                 head_num: int, head_dim: int, v_head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, ops: BaseKVOps | None = None):
        cfg.check_model(num_layers)
        self.ops = ops if ops is not None else TorchKVOps()
        self.cfg, self.device, self.bs = cfg, torch.device(device), cfg.block_size
        self.head_num, self.head_dim, self.v_head_dim = head_num, head_dim, v_head_dim
        self.sparse_layers = [i for i in range(num_layers) if i not in cfg.dense_layers]
        self.index = {l: i for i, l in enumerate(self.sparse_layers)}
        num_pages = -(-num_tokens // self.bs)
        pin = self.device.type == "cuda"
        L = len(self.sparse_layers)
        self.host = HostTier(L, num_pages, self.bs, head_num, head_dim, v_head_dim, dtype, pin_memory=pin)
        self.summaries = KeySummaries(L, num_pages, head_num, head_dim, dtype, self.device)
        self.ws = WorkingSet(L, num_rows, head_num, cfg.budget_blocks, self.bs, head_dim, v_head_dim, dtype, self.device)
        self.stats = OasisStats()
        # hits, admitted, evicted, written-back blocks: device counters, read only when reporting
        self._counters = torch.zeros(4, dtype=torch.int64, device=self.device)
        self._step = 0
        self._fresh_rows: set[int] = set(range(num_rows))   # rows whose next decode starts a request
        self._block_bytes = self.bs * (head_dim + v_head_dim) * torch.empty((), dtype=dtype).element_size()

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

    # ---- writes -------------------------------------------------------------------------
    def write_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 decode: bool = False) -> None:
        """New tokens of a sparse layer (``loc [N]``, ``k [N, H, D]``, ``v [N, H, Dv]``).

        Their keys are folded into the block summaries (``ops.write_kv``). Prefill tokens go to
        the host tier now. Decode tokens (``decode=True``, one per request) go to the working
        set in ``decode_attention`` and reach the host tier as whole blocks once their block is
        complete (4 KiB pieces instead of 256 B ones; the partial block is always resident).
        """
        li = self.index[layer_id]
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
        """
        li = self.index[layer_id]
        out = q.new_empty((q.shape[0], q.shape[1], self.v_head_dim))
        rows_c, pre_c, ext_c = rows.tolist(), prefix_lens.tolist(), extend_lens.tolist()
        start = 0
        for r, pre, ext in zip(rows_c, pre_c, ext_c):
            n = pre + ext
            if k_new is None:
                k, v = self.host.read_tokens(li, req_to_token[r, :n])
            else:
                k = k_new[start:start + ext].view(ext, self.head_num, self.head_dim)
                v = v_new[start:start + ext].view(ext, self.head_num, self.v_head_dim)
                if pre:
                    kp, vp = self.host.read_tokens(li, req_to_token[r, :pre])
                    k, v = torch.cat([kp.to(k.device, k.dtype), k]), torch.cat([vp.to(v.device, v.dtype), v])
            out[start:start + ext] = attn.prefill_attention(q[start:start + ext], k.to(q.device), v.to(q.device), pre, scale)
            start += ext
        return out

    # ---- decode ---------------------------------------------------------------------------
    def decode_attention(self, layer_id: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                         rows: torch.Tensor, seq_lens: torch.Tensor, req_to_token: torch.Tensor,
                         scale: float | None, max_seq_len: int | None = None) -> torch.Tensor:
        """Decode of a sparse layer (one new token per request, already written by ``write_kv``).

        Args:
            q: ``[B, Hq, D]``. k_new: ``[B, H, D]``, v_new: ``[B, H, Dv]`` the new tokens.
            rows: ``[B]`` request rows. seq_lens: ``[B]`` context lengths including the new token.
            max_seq_len: ``max(seq_lens)`` when the caller knows it on the host (SGLang's
                ``seq_lens_cpu``); otherwise it is read from the device (a sync).
        Returns:
            ``[B, Hq, Dv]``.
        """
        li = self.index[layer_id]
        cfg, bs, ops = self.cfg, self.bs, self.ops
        if q.shape[0] == 0:
            return q.new_empty((0, q.shape[1], self.v_head_dim))
        if li == 0:
            self._step += 1
            self.stats.decode_steps += 1
        rows_d = rows.to(self.device, torch.int64)
        seq = seq_lens.to(self.device, torch.int64)
        # 3. score and select (summaries of complete blocks were folded in by write_kv)
        nb_max = -(-(max_seq_len if max_seq_len is not None else int(seq.max())) // bs)
        rtt = req_to_token if req_to_token.device == self.device else req_to_token.to(self.device)
        wanted, forced = ops.select_topk(q.view(q.shape[0], -1, self.head_dim), self.summaries.kmin[li],
                                         self.summaries.kmax[li], rtt, rows_d, seq, bs, cfg.sink_blocks,
                                         cfg.recent_blocks, nb_max, cfg.budget_blocks)
        # 4. admissions from the host tier: fixed-size lists, dead entries skipped (no host sync)
        adm = self.ws.plan(li, rows_d, wanted, forced, self._step, cfg.fetch_cap)
        H, K, P = self.head_num, cfg.budget_blocks, self.host.num_pages
        h = torch.arange(H, device=self.device)[None, :, None]
        r = rows_d[:, None, None]
        blk = adm.block.clamp(min=0)
        page_of = torch.div(rtt[r, blk * bs].long(), bs, rounding_mode="floor")
        dst = torch.where(adm.mask, (r * H + h) * K + adm.entry, -1).reshape(-1)
        ops.copy_blocks(self.ws.k[li].view(-1, bs * self.head_dim), self.ws.v[li].view(-1, bs * self.v_head_dim), dst,
                        self.host.k[li].view(-1, bs * self.head_dim), self.host.v[li].view(-1, bs * self.v_head_dim),
                        (h * P + page_of).reshape(-1))
        self._counters += torch.stack([adm.hits, adm.mask.sum(), adm.evicted, adm.hits.new_zeros(())])
        # 5. the new token into its resident block; completed blocks written back to the host tier
        entry = self.ws.write_token(li, rows_d, seq - 1, k_new, v_new)
        self._write_back(li, rows_d, seq, entry, rtt)
        out, _ = ops.sparse_decode_attention(q.view(q.shape[0], 1, q.shape[1], q.shape[2]), self.ws.k[li],
                                             self.ws.v[li], self.ws.ids[li], rows_d, seq, scale)
        if li == 0:
            rows_c = rows_d.tolist()
            self.stats.new_request_started = bool(self._fresh_rows.intersection(rows_c))
            self._fresh_rows.difference_update(rows_c)
            self.stats.last_context_tokens = seq.tolist()
            ids0 = self.ws.ids[li][rows_d, 0]                                    # [B, K], KV head 0
            held = (seq[:, None] - ids0 * bs).clamp(0, bs) * (ids0 >= 0)
            self.stats.last_resident_tokens = held.sum(-1).tolist()
        return out.view(q.shape[0], q.shape[1], self.v_head_dim)

    def _write_back(self, li: int, rows: torch.Tensor, seq: torch.Tensor, entry: torch.Tensor,
                    req_to_token: torch.Tensor) -> None:
        """Copy the blocks completed by this step's tokens from the working set to the host tier
        (one piece per request and KV head; requests whose block is not complete move nothing)."""
        bs, H, K, P = self.bs, self.head_num, self.cfg.budget_blocks, self.host.num_pages
        done = (seq % bs == 0)[:, None]                                   # [B, 1]
        page = torch.div(req_to_token[rows, seq - 1].long(), bs, rounding_mode="floor")
        h = torch.arange(H, device=rows.device)
        src = ((rows[:, None] * H + h) * K + entry).reshape(-1)
        dst = torch.where(done, h * P + page[:, None], -1).reshape(-1)
        self.ops.copy_blocks(self.host.k[li].view(-1, bs * self.head_dim), self.host.v[li].view(-1, bs * self.v_head_dim),
                             dst, self.ws.k[li].view(-1, bs * self.head_dim), self.ws.v[li].view(-1, bs * self.v_head_dim),
                             src)
        self._counters[3] += done.sum() * H

    # ---- lifecycle and reporting ----------------------------------------------------------
    def reset_rows(self, rows) -> None:
        """Free the working set of finished (or newly allocated) request rows."""
        self.ws.reset_rows(rows)
        self._fresh_rows.update(int(r) for r in rows)

    def residency(self) -> dict:
        """KV residency of the last decode step and memory sizes (bytes). Reads the device counters.

        Raises:
            RuntimeError: a decoded token found its block not resident (``WorkingSet.check``).
        """
        self.ws.check()
        s = self.stats
        hits, admitted, evicted, written_back = (int(x) for x in self._counters.tolist())
        return {
            "context_tokens": list(s.last_context_tokens),
            "device_working_set_tokens": list(s.last_resident_tokens),
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
        }
