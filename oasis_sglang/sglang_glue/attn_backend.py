"""OasisAttnBackend: the target model's attention backend for ``--kv-sparse oasis``.

It wraps the backend SGLang built (torch_native, triton or intel_amx; ``wrapped_backend.py``)
and only delegates to the engine (``core.OasisSparseKV``):

* SGLang's forward-metadata hooks (``layers/attention/base_attn_backend.py``) start each decode
  step: ``init_forward_metadata`` (eager) and ``init_forward_metadata_out_graph`` (before a
  CUDA-graph capture or replay of a DECODE batch, or of the paired TARGET_VERIFY batch with a
  draft: ``DecodeCudaGraphRunner`` captures one or the other) call ``engine.begin_decode_step``;
  ``init_forward_metadata_in_graph`` (recorded in a captured graph) calls
  ``engine.prepare_step_device``;
* sparse layers: prefill through ``engine.extend_attention``, decode through
  ``engine.decode_attention``, the paired verify pass as a decode step plus its draft row;
* dense layers: the wrapped backend, except in the paired verify pass (``draft_backend.py``).
"""

from __future__ import annotations

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from ..core import StepMode
from .batch_info import extend_host, host_lengths, host_rows, max_seq_len
from .draft_backend import paged_ok, paired_paged_attention
from .log_line import DecodeLog
from .runtime import OasisRuntime
from .wrapped_backend import WrappedBackend


class OasisAttnBackend(WrappedBackend):
    """Attention backend for ``--kv-sparse oasis``.

    Args:
        inner: the backend SGLang built for this model runner.
        runtime: the model's :class:`OasisRuntime` (engine, scheduler rows).
        pool: the ``OasisKVPool``. req_to_token_pool: SGLang's request table.
        log: the :class:`DecodeLog` of the engine (shared by every wrapped backend).
    """

    def __init__(self, inner: AttentionBackend, runtime: OasisRuntime, pool, req_to_token_pool, log: DecodeLog):
        super().__init__(inner)
        self.runtime, self.engine = runtime, runtime.engine
        self.pool, self.req_to_token_pool, self.log = pool, req_to_token_pool, log
        self.token_to_kv_pool = pool
        self.last_sparse_layer = self.engine.sparse_layers[-1] if self.engine.sparse_layers else -1
        self._step_rows = None        # req_pool_indices of the batch the engine's step was begun for

    @property
    def needs_cpu_seq_lens(self) -> bool:
        """SGLang's ``AttentionBackend.needs_cpu_seq_lens`` (read once by the scheduler,
        ``overlap_utils.decide_needs_cpu_seq_lens``): False while the steps take their host
        lengths from the prediction record (``OasisRuntime.record_lengths``). Then SGLang's
        overlapped speculative worker does not wait for step ``t``'s verify to copy its lengths
        to the host before it prepares and launches step ``t+1`` (``FutureMap.resolve_seq_lens_cpu``).
        True when the wrapped backend asks for them itself."""
        return not self.runtime.record_lengths or bool(getattr(self.inner, "needs_cpu_seq_lens", True))

    # ---- SGLang's forward-metadata hooks: one decode step each ---------------------------
    def init_forward_metadata(self, forward_batch):
        """Eager forward: the wrapped backend's metadata, then (decode / paired verify) the step."""
        r = self.inner.init_forward_metadata(forward_batch)
        mode = forward_batch.forward_mode
        if mode.is_decode() or mode.is_target_verify():
            self.runtime.replay_dense = False
            self._begin(forward_batch, StepMode.EAGER)
        return r

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """SGLang's decode CUDA-graph runner (DECODE, or the paired TARGET_VERIFY with a draft),
        outside the graph: before a capture (and its warm-up runs) a ``capture`` step (of the
        dense-path variant while ``runtime.capture_dense``); before a replay the periodic log
        line (about the steps already queued) and a ``replay`` step (host bookkeeping; a verify
        batch's decode row has one more token of context than ``seq_lens``), whose ``dense``
        choice goes to ``runtime.replay_dense``. The wrapped backend first."""
        r = self.inner.init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)
        mode = forward_batch.forward_mode
        if not (mode.is_decode() or mode.is_target_verify()):
            return r
        if in_capture:
            self.runtime.replay_dense = False
            self._begin(forward_batch, StepMode.CAPTURE)
            return r
        B = forward_batch.batch_size - (getattr(forward_batch, "num_padding", 0) or 0)
        rows = self.runtime.batch_rows_host
        if rows is None or len(rows) != B:   # scheduler_hooks.can_run_graph_hook refuses such a batch first
            raise RuntimeError(f"OasisKV: replaying a decode CUDA graph without the batch's {B} rows on the host")
        extra = 1 if mode.is_target_verify() else 0
        # (before the log line: its report may rebuild the record these lengths come from)
        seq = host_lengths(forward_batch, rows, extra, self.runtime)
        if seq is None:                # (can_run_graph_hook refuses such a batch first)
            raise RuntimeError(f"OasisKV: replaying a decode CUDA graph without the host lengths of its {B} rows")
        self.log.maybe_log()           # about the steps before this one: their device work is queued
        self.runtime.replay_dense = False
        st = self.engine.begin_decode_step(forward_batch.req_pool_indices, forward_batch.seq_lens,
                                           self.req_to_token_pool.req_to_token, mode=StepMode.REPLAY, rows_host=rows,
                                           seq_lens_host=seq)
        self.runtime.replay_dense = st.dense     # the runner then picks the dense-path graph (graph_hooks)
        return r

    def init_forward_metadata_in_graph(self, forward_batch):
        """Inside a captured decode (or paired verify) graph: the step's device values
        (``prepare_step_device``)."""
        r = self.inner.init_forward_metadata_in_graph(forward_batch)
        st, mode = self.engine.step, forward_batch.forward_mode
        if (mode.is_decode() or mode.is_target_verify()) and st is not None and st.mode is StepMode.CAPTURE:
            self.engine.prepare_step_device()
        return r

    def _begin(self, forward_batch, mode: StepMode) -> None:
        """``engine.begin_decode_step`` for this batch: a decode batch as it is; a paired verify
        batch (2 tokens per request) as the decode of its first token, whose context is one more
        (``seq_offset=1``: added inside the graph when capturing, so replays see their lengths)."""
        extra = 1 if forward_batch.forward_mode.is_target_verify() else 0
        mx = None if mode is StepMode.CAPTURE else max_seq_len(forward_batch)
        rows_h = seq_h = None
        if mode is StepMode.EAGER:
            rows_h, seq_h = host_rows(forward_batch, self.runtime.batch_rows_host, extra, self.runtime)
        self.engine.begin_decode_step(forward_batch.req_pool_indices, forward_batch.seq_lens,
                                      self.req_to_token_pool.req_to_token, mode=mode,
                                      max_seq_len=None if mx is None else mx + extra,
                                      rows_host=rows_h, seq_lens_host=seq_h, seq_offset=extra,
                                      dense=mode is StepMode.CAPTURE and self.runtime.capture_dense)
        self._step_rows = forward_batch.req_pool_indices

    def _check_step(self, forward_batch) -> None:
        if self.engine.step is None or forward_batch.req_pool_indices is not self._step_rows:
            raise RuntimeError("OasisKV: a decode batch reached a sparse layer without SGLang preparing its forward "
                               "metadata (init_forward_metadata); the OasisKV step was not begun for it")

    # ---- attention -----------------------------------------------------------------------
    def _write(self, layer, forward_batch, k, v, save_kv_cache, decode: bool):
        if k is None or v is None:
            raise RuntimeError("OasisKV: layers without their own K/V (KV sharing) are not supported")
        if save_kv_cache:
            self.engine.write_kv(layer.layer_id, forward_batch.out_cache_loc, k, v, decode=decode)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        """Prefill: ``q [T, Hq*D]``, ``k/v [T, H*D]`` -> ``[T, Hq*Dv]``; sparse layers via OasisKV,
        others via the wrapped backend. A TARGET_VERIFY batch is the paired forward
        (``_forward_verify``; its dense layers run ``paired_paged_attention``)."""
        if not self.engine.is_sparse(layer.layer_id):
            if forward_batch.forward_mode.is_target_verify() and paged_ok(layer, kwargs):
                # the normal token (position seq_lens) and the draft (seq_lens + 1), causal
                return paired_paged_attention(self.engine.ops, self.pool, self.req_to_token_pool.req_to_token,
                                              q, k, v, layer, forward_batch, save_kv_cache, extra_lens=2)
            return self.inner.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        if forward_batch.forward_mode.is_target_verify():
            return self._forward_verify(q, k, v, layer, forward_batch, save_kv_cache)
        self._write(layer, forward_batch, k, v, save_kv_cache, decode=False)
        q_ = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        H = layer.tp_k_head_num
        o = self.engine.extend_attention(
            layer.layer_id, q_, forward_batch.req_pool_indices, forward_batch.extend_prefix_lens,
            forward_batch.extend_seq_lens, self.req_to_token_pool.req_to_token, layer.scaling,
            k.view(-1, H, layer.qk_head_dim), v.view(-1, H, layer.v_head_dim), host=extend_host(forward_batch,
                                                                                          self.runtime.batch_rows_host))
        return o.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        """Decode: ``q [B, Hq*D]``, ``k/v [B, H*D]`` -> ``[B, Hq*Dv]``; sparse layers over the
        working set, others via the wrapped backend."""
        if not self.engine.is_sparse(layer.layer_id):
            return self.inner.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        self._check_step(forward_batch)
        self._write(layer, forward_batch, k, v, save_kv_cache, decode=True)
        H = layer.tp_k_head_num
        o = self.engine.decode_attention(
            layer.layer_id, q.view(-1, layer.tp_q_head_num, layer.qk_head_dim), k.view(-1, H, layer.qk_head_dim),
            v.view(-1, H, layer.v_head_dim), layer.scaling)
        if layer.layer_id == self.last_sparse_layer and self.engine.step.mode is StepMode.EAGER:
            self.log.maybe_log()
        return o.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)

    def _forward_verify(self, q, k, v, layer, forward_batch, save_kv_cache):
        """The paired forward: ``q [2B, Hq*D]``, ``k/v [2B, H*D]`` hold per request the token being
        decoded (row 0, position ``seq_lens``) and the draft token (row 1, position ``seq_lens+1``);
        returns ``[2B, Hq*Dv]``. Row 0 is a normal decode step; row 1 attends over the same
        working set plus row 0 and itself, and its query predicts the next step's blocks. The
        draft's K/V are not written (``spec_probe``: the draft is never accepted).

        Raises:
            RuntimeError: a verify batch with other than 2 tokens per request (the server-args
                check allows only ``--speculative-num-draft-tokens 2`` with topk 1).
        """
        n = forward_batch.spec_info.draft_token_num
        if n != 2:
            raise RuntimeError(f"OasisKV: the paired forward needs 2 verify tokens per request, got {n}")
        self._check_step(forward_batch)
        Hq, H, D, Dv = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim, layer.v_head_dim
        q2, k2, v2 = q.view(-1, 2, Hq, D), k.view(-1, 2, H, D), v.view(-1, 2, H, Dv)
        if save_kv_cache:
            self.engine.write_kv(layer.layer_id, forward_batch.out_cache_loc.view(-1, 2)[:, 0], k2[:, 0], v2[:, 0],
                                 decode=True)
        o = self.engine.decode_attention(layer.layer_id, q2[:, 0], k2[:, 0], v2[:, 0], layer.scaling,
                                         q_draft=q2[:, 1], k_draft=k2[:, 1], v_draft=v2[:, 1])
        if layer.layer_id == self.last_sparse_layer and self.engine.step.mode is StepMode.EAGER:
            self.log.maybe_log()       # (a replayed step logs before its replay; a capture never)
        return o.reshape(-1, Hq * Dv)

