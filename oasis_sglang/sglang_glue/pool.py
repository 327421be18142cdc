"""OasisKVPool: SGLang's ``MHATokenToKVPool`` whose sparse layers keep no device KV.

Dense layers (``dense_layers``) keep SGLang's device buffers ``[size + page, H, D]``. Sparse
layers get a one-page placeholder on the device; their KV goes to the OasisKV host tier
(``core.host_tier``) through ``set_kv_buffer``, and the attention backend reads it from the
working set. SGLang's allocator, radix cache and free lists manage token locations as usual.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, unwrap_write_loc

from ..config import OasisConfig


class OasisKVPool(MHATokenToKVPool):
    """KV pool for ``--kv-sparse oasis`` (MHA / GQA models, NHD layout).

    Extra args: ``oasis_cfg`` (:class:`OasisConfig`). ``self.oasis`` (the
    :class:`~oasis_sglang.core.OasisSparseKV`) is attached by the backend hook before the first
    forward pass.
    """

    def __init__(self, *args, oasis_cfg: OasisConfig, **kwargs):
        self.oasis_cfg = oasis_cfg
        self.oasis = None
        super().__init__(*args, **kwargs)

    def _is_dense(self, layer_id: int) -> bool:
        return layer_id in self.oasis_cfg.dense_layers

    def _create_buffers(self):
        if self.is_quantized_kv_cache or self.post_capture_active or self.use_hnd:
            raise ValueError("--kv-sparse oasis: quantized, post-capture and HND KV layouts are not supported")
        self.k_scale_buffer = self.v_scale_buffer = self.dq_k_buffer = self.dq_v_buffer = None
        n = self.size + self.page_size
        self.k_buffer, self.v_buffer = [], []
        for i in range(self.layer_num):
            rows = n if self._is_dense(i + self.start_layer) else self.page_size
            self.k_buffer.append(torch.zeros((rows, self.head_num, self.head_dim), dtype=self.store_dtype, device=self.device))
            self.v_buffer.append(torch.zeros((rows, self.head_num, self.v_head_dim), dtype=self.store_dtype, device=self.device))
        self._kv_buffer_descs = self._build_kv_buffer_descs()
        self._init_data_ptrs_and_strides()

    def _check_dense(self, layer_id: int) -> None:
        if not self._is_dense(layer_id):
            raise RuntimeError(f"OasisKV: layer {layer_id} is sparse; its KV lives in the host tier")

    def _get_key_buffer(self, layer_id: int):
        self._check_dense(layer_id)
        return super()._get_key_buffer(layer_id)

    def _get_value_buffer(self, layer_id: int):
        self._check_dense(layer_id)
        return super()._get_value_buffer(layer_id)

    def set_kv_buffer(self, layer, loc_info, cache_k, cache_v, k_scale=None, v_scale=None,
                      layer_id_override=None, dcp_kv_mask=None):
        """Dense layers: SGLang's write. Sparse layers: ``cache_k/v [N, H, D]`` at ``loc [N]`` into the host tier."""
        layer_id = layer_id_override if layer_id_override is not None else layer.layer_id
        if self._is_dense(layer_id):
            return super().set_kv_buffer(layer, loc_info, cache_k, cache_v, k_scale, v_scale,
                                         layer_id_override, dcp_kv_mask)
        loc, _, _ = unwrap_write_loc(loc_info)
        self.oasis.write_kv(layer_id, loc, cache_k, cache_v)


    def get_contiguous_buf_infos(self):
        """What SGLang's PD KV transfer (``disaggregation/nixl/conn.py``) registers and sends page
        by page, for ``--kv-sparse oasis`` on both nodes (``oasis_sglang/disagg/serving.py``).

        SGLang's list is ``[K of every layer] + [V of every layer]``, each region
        ``(address, bytes, bytes per page)`` with one item per page. OasisKV's sparse layers
        keep no device KV (their placeholder must not be advertised as a full region), so the
        halves are: the dense layers' K / V buffers, then per sparse layer the min / max key
        summaries (``[P, H, D]``; summaries wider than 16 bits cross in bf16 staging buffers,
        ``pd_summaries``, which the prefill node fills rounded outward right before a request's
        send and the decode node reads back at its admission: ``disagg/serving.py``), then one
        ``int64 [P]`` page-number
        buffer each (``pd_page_ids``; on a prefill node page ``p`` holds ``p``, so a decode
        node receives, at its own pages, the prefill node's page of each block: where to read
        the blocks' K/V on demand), then one ``int16 [P, sparse * H + 4]`` first-step mask buffer
        each (``pd_first_step``: per block, the slot + 1 of each (sparse layer, KV head) working
        set of the request's first decode step that holds it, and the request's bootstrap room
        as a tag, as the prefill node planned them with the last
        prompt token's query: ``disagg/admission.py first_step_mask``; the prefill node writes
        it right before the request's send, which it makes in one piece). Every region has the
        same ``P = (size + page_size) / page_size`` pages, as SGLang's prepared transfers
        assume.

        Returns: ``(ptrs, lens, item_lens)``, lists of ``2 * (dense + sparse + 2)`` ints.
        Raises:
            RuntimeError: the OasisKV engine is not attached yet, or ``--page-size`` differs
                from ``block_size`` (both checked at start-up; this guards the layout).
        """
        eng = self.oasis
        if eng is None or self.page_size != eng.bs:
            raise RuntimeError("OasisKV PD: the KV pool's transfer regions need the OasisKV engine and "
                               "--page-size == block_size")
        P = (self.size + self.page_size) // self.page_size
        if getattr(self, "pd_page_ids", None) is None:
            self.pd_page_ids = [torch.arange(P, dtype=torch.int64, device=self.device) for _ in range(2)]
        if getattr(self, "pd_first_step", None) is None:
            from ..disagg.admission import first_step_width
            self.pd_first_step = [torch.zeros((P, first_step_width(len(eng.sparse_layers), eng.head_num)),
                                              dtype=torch.int16, device=self.device) for _ in range(2)]
        smin, smax = eng.summaries.kmin, eng.summaries.kmax
        if smin and smin[0].element_size() > 2:
            if getattr(self, "pd_summaries", None) is None:
                self.pd_summaries = tuple([torch.zeros(t.shape, dtype=torch.bfloat16, device=t.device) for t in s]
                                          for s in (smin, smax))
            smin, smax = self.pd_summaries
        else:
            self.pd_summaries = None
        dense = [i for i in range(self.layer_num) if self._is_dense(i + self.start_layer)]
        halves = ([self.k_buffer[i] for i in dense] + list(smin) + [self.pd_page_ids[0], self.pd_first_step[0]],
                  [self.v_buffer[i] for i in dense] + list(smax) + [self.pd_page_ids[1], self.pd_first_step[1]])
        ptrs, lens, items = [], [], []
        for half in halves:
            for t in half:
                if t.shape[0] not in (P, P * self.page_size) or not t.is_contiguous():
                    raise RuntimeError(f"OasisKV PD: a transfer region of shape {tuple(t.shape)} is not {P} "
                                       "contiguous pages")
                ptrs.append(t.data_ptr())
                lens.append(t.numel() * t.element_size())
                items.append(t.numel() * t.element_size() // P)
        self.pd_page_bytes = sum(items)           # what crosses per page at admission (disagg/serving.py)
        self.pd_full_page_bytes = self.page_size * self.layer_num * self.head_num * (
            self.head_dim + self.v_head_dim) * torch.empty((), dtype=self.store_dtype).element_size()
        return ptrs, lens, items

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor):
        """Speculative decoding's move of accepted draft tokens' KV to their final slots
        (``spec_utils.move_accept_tokens_to_target_kvcache``; NGRAM calls it every step).

        With ``--kv-sparse oasis`` the draft is a probe that is never accepted, so every move is
        the identity (the bonus token already sits where it belongs) and nothing is copied.
        Args: ``tgt_loc`` / ``src_loc`` ``[N]`` int64 token slots (one host read to check them).
        Raises:
            RuntimeError: a move to another slot (a draft was accepted), before anything changes.
        """
        if tgt_loc.shape != src_loc.shape or (tgt_loc.numel() and bool((tgt_loc != src_loc).any())):
            raise RuntimeError("OasisKV: a speculative draft was accepted (its KV would move to another slot); "
                               "with --kv-sparse oasis drafts are look-ahead probes and must be rejected")


def build_mha_kv_pool_hook(original, self, *args, **kwargs):
    """AROUND ``KVCacheConfigurator._build_mha_kv_pool``: OasisKVPool when ``--kv-sparse oasis``."""
    import functools

    from .server_args import oasis_config

    cfg = oasis_config(self.server_args)
    if cfg is None or getattr(self, "is_draft_worker", False):
        return original(self, *args, **kwargs)      # the draft model keeps SGLang's own pool
    kwargs["mha_pool_class"] = functools.partial(OasisKVPool, oasis_cfg=cfg)
    return original(self, *args, **kwargs)


def config_from_budget_hook(original, self, budget_bytes, *args, **kwargs):
    """AROUND ``KVCacheConfigurator.config_from_budget``: size the KV cache by what OasisKV keeps
    where (``OasisSparseKV.token_capacity``), not as if every layer lived on the device.

    SGLang turns its device budget into tokens at its per-token size with every layer's KV
    (``pool_configurator.py``) and then lowers ``--max-total-tokens`` to that: on an 80 GB GPU
    OasisKV could hold no more requests than dense (22 x 16K of Qwen3-8B; the H200 had hidden
    it). Here the budget SGLang's configurator sees is the one that gives OasisKV's capacity at
    its own cell size: the device holds the dense layers', a draft model's and the summaries'
    share of each token plus the working set; the host tier (pinned) the sparse layers', up to
    ``HOST_SHARE`` of the host memory available now (split over the TP ranks on the host). The
    user's ``--max-total-tokens`` still caps it (SGLang applies it after). The draft model's
    worker and a server without ``--kv-sparse oasis`` are unchanged; on a CPU the host tier
    and the device budget are one memory.

    Raises:
        OasisConfigError: the working set does not fit the device budget, naming the flags.
    """
    import logging

    from ..config import OasisConfigError
    from ..core import OasisSparseKV
    from .server_args import oasis_config

    cfg = oasis_config(self.server_args)
    if cfg is None or getattr(self, "is_draft_worker", False):
        return original(self, budget_bytes, *args, **kwargs)
    from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator

    conf = create_memory_pool_configurator(self)
    cell = int(getattr(conf, "_cell_size", 0) or 0)
    if not cell:
        return original(self, budget_bytes, *args, **kwargs)
    sa, mc = self.server_args, self.model_config
    tp = max(1, int(getattr(sa, "tp_size", 1) or 1))
    nnodes = max(1, int(getattr(sa, "nnodes", 1) or 1))
    rows = int(sa.max_running_requests or 1) + 1             # SGLang's ReqToTokenPool: size + 1 rows
    if str(getattr(sa, "disaggregation_mode", "null")) == "decode":      # and a PD decode node's pre-allocated
        rows += int(getattr(sa, "disaggregation_decode_extra_slots", 0) or 0)
    from oasis_sglang.core.kv_dtype import is_fp8

    kvb = torch.empty((), dtype=self.kv_cache_dtype).element_size()
    sb = torch.empty((), dtype=self.model_dtype).element_size() if is_fp8(self.kv_cache_dtype) else kvb
    host = None
    # a PD decode node with pd_host_slots: its host tier is a fixed pool (check_memory checks it),
    # so host memory does not bound the tokens; the device does
    compact = str(getattr(sa, "disaggregation_mode", "null")) == "decode" and cfg.pd_host_slots is not None
    if torch.device(self.device).type != "cpu":
        import psutil

        host = COMPACT_HOST_BYTES if compact else int(HOST_SHARE * psutil.virtual_memory().available) // max(
            1, tp // nnodes)
    try:
        cap = OasisSparseKV.token_capacity(
            cfg, int(budget_bytes), cell, host, num_layers=mc.num_hidden_layers, num_rows=rows,
            head_num=mc.get_num_kv_heads(tp), head_dim=mc.head_dim,
            v_head_dim=getattr(mc, "v_head_dim", None) or mc.head_dim, dtype_bytes=kvb, summary_dtype_bytes=sb)
    except ValueError as e:
        raise OasisConfigError(f"--kv-sparse oasis: {e}") from None
    dense = int(budget_bytes) // cell
    logging.getLogger(__name__).info(
        "OasisKV: KV cache sized to %d tokens by the %s memory (a dense pool would hold %d on this device): "
        "device %.1f KiB per token (dense layers, draft, summaries) + working set %.2f GiB, host tier %.1f KiB "
        "per token%s%s", cap["tokens"], cap["limit"], dense, cap["device_cell"] / 1024, cap["working_set"] / 2**30,
        cap["host_cell"] / 1024,
        "" if host is None else f" (a compact pool of pd_host_slots={cfg.pd_host_slots} pieces holds what is read)"
        if compact else f" (up to {host / 2**30:.1f} GiB of host memory)",
        f"; --max-total-tokens {sa.max_total_tokens} caps it" if sa.max_total_tokens else "")
    return original(self, cap["tokens"] * cell, *args, **kwargs)


# the most of the host memory available at start-up the host tier may take by default (pinned;
# the rest stays for the server's own processes and the OS); --max-total-tokens sets it exactly
HOST_SHARE = 0.85
# what token_capacity is told a compact decode tier's host may hold: more than any host (the pool,
# not the tokens, takes host memory there)
COMPACT_HOST_BYTES = 2 ** 62
