"""OasisAttnBackend: wraps the attention backend SGLang built (torch_native, triton or intel_amx).

Dense layers go to the wrapped backend, except in the paired forward (TARGET_VERIFY), where
they run ``ops.paged_attention`` (split-KV, GQA-grouped); sparse layers run OasisKV
(``core.engine.OasisSparseKV``): prefill over the host tier, decode over the working set.
``OasisDraftBackend`` wraps the draft worker's draft-extend backend the same way.
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from ..config import OasisConfig, OasisConfigError
from ..core import OasisSparseKV

logger = logging.getLogger(__name__)


# members AttentionBackend defines that the wrappers override themselves (``forward`` and
# ``forward_mixed`` dispatch to the wrapper's forward_extend / forward_decode)
_OWN = {"forward", "forward_mixed", "forward_extend", "forward_decode", "init_forward_metadata", "support_triton",
        "needs_cpu_seq_lens"}


def delegate_base_members(cls):
    """Class decorator: every method and property ``AttentionBackend`` defines (CUDA-graph
    hooks, ``verify_mask``, ...) goes to ``self.inner`` instead of the base class's default, so
    a wrapper behaves as the backend it wraps; plain class attributes are read from the inner
    backend at construction. ``needs_cpu_seq_lens`` stays True: the wrappers use SGLang's host
    copy of the lengths."""
    for name, val in vars(AttentionBackend).items():
        if name.startswith("__") or name in _OWN or name in vars(cls):
            continue
        if isinstance(val, property):
            setattr(cls, name, property((lambda n: lambda self: getattr(self.inner, n))(name)))
        elif callable(val) or isinstance(val, (staticmethod, classmethod)):
            setattr(cls, name, (lambda n: lambda self, *a, **k: getattr(self.inner, n)(*a, **k))(name))
    return cls


def _copy_plain_attributes(wrapper, inner) -> None:
    for name, val in vars(AttentionBackend).items():
        if not name.startswith("__") and name not in _OWN and not callable(val) \
                and not isinstance(val, (property, staticmethod, classmethod)) and hasattr(inner, name):
            setattr(wrapper, name, getattr(inner, name))


@delegate_base_members
class WrappedBackend(AttentionBackend):
    """A backend that wraps the one SGLang built (``self.inner``) and answers for it: every
    member it does not define, and every ``AttentionBackend`` member (``delegate_base_members``),
    is the wrapped backend's; subclasses override ``forward_extend`` / ``forward_decode``."""

    def __init__(self, inner: AttentionBackend):
        super().__init__()
        self.inner = inner
        _copy_plain_attributes(self, inner)

    def __getattr__(self, name):  # everything else is the wrapped backend's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def init_forward_metadata(self, forward_batch):
        """Delegate: the wrapped backend still serves the passes the wrapper does not take."""
        return self.inner.init_forward_metadata(forward_batch)

    def support_triton(self):
        """Delegate to the wrapped backend."""
        return self.inner.support_triton()

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        """Delegate."""
        return self.inner.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        """Delegate."""
        return self.inner.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)


class OasisAttnBackend(WrappedBackend):
    """Attention backend for ``--kv-sparse oasis``.

    Args:
        inner: the backend SGLang built for this model runner.
        engine: the model's OasisKV state.
        pool: the ``OasisKVPool``. req_to_token_pool: SGLang's request table.
        log_interval: decode steps between ``OasisKV decode`` log lines.
    """

    def __init__(self, inner: AttentionBackend, engine: OasisSparseKV, pool, req_to_token_pool,
                 log_interval: int = 40, metrics=None):
        super().__init__(inner)
        self.metrics = metrics
        self.engine, self.pool, self.req_to_token_pool = engine, pool, req_to_token_pool
        self.token_to_kv_pool = pool
        self.log_interval = max(1, int(log_interval))
        self.last_sparse_layer = engine.sparse_layers[-1] if engine.sparse_layers else -1

    def init_forward_metadata(self, forward_batch):
        """Eager forward: the engine leaves CUDA-graph mode; then the wrapped backend's metadata."""
        self.engine.graph_mode = False
        return self.inner.init_forward_metadata(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """SGLang's decode CUDA-graph runner, outside the graph (``base_attn_backend.py``): before a
        capture (and its warm-up runs) the engine enters graph mode; before a replay it logs
        (periodic line, about the steps already queued) and does the step's host bookkeeping
        (``OasisSparseKV.graph_step``). The wrapped backend prepares its own metadata first."""
        r = self.inner.init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)
        if not forward_batch.forward_mode.is_decode():
            return r
        if in_capture:
            self.engine.graph_mode = True
            return r
        B = forward_batch.batch_size - (getattr(forward_batch, "num_padding", 0) or 0)
        rows = self.engine.batch_rows_host
        if rows is None or len(rows) != B:   # can_run_graph_hook refuses such a batch first
            raise RuntimeError(f"OasisKV: replaying a decode CUDA graph without the batch's {B} rows on the host")
        self._maybe_log()           # about the steps before this one: their device work is queued
        self.engine.graph_step(rows, forward_batch.seq_lens_cpu[:B].tolist())
        return r

    def _write(self, layer, forward_batch, k, v, save_kv_cache, decode: bool):
        if k is None or v is None:
            raise RuntimeError("OasisKV: layers without their own K/V (KV sharing) are not supported")
        if save_kv_cache:
            self.engine.write_kv(layer.layer_id, forward_batch.out_cache_loc, k, v, decode=decode)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        """Prefill: ``q [T, Hq*D]``, ``k/v [T, H*D]`` -> ``[T, Hq*Dv]``; sparse layers via OasisKV, others via the wrapped backend.

        A TARGET_VERIFY batch (speculative decoding) is the paired forward: see ``_forward_verify``.
        """
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
            k.view(-1, H, layer.qk_head_dim), v.view(-1, H, layer.v_head_dim))
        return o.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        """Decode: ``q [B, Hq*D]``, ``k/v [B, H*D]`` -> ``[B, Hq*Dv]``; sparse layers over the working set, others via the wrapped backend."""
        if not self.engine.is_sparse(layer.layer_id):
            return self.inner.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        self._write(layer, forward_batch, k, v, save_kv_cache, decode=True)
        H = layer.tp_k_head_num
        rows_h, seq_h = self._host_rows(layer, forward_batch)
        o = self.engine.decode_attention(
            layer.layer_id, q.view(-1, layer.tp_q_head_num, layer.qk_head_dim), k.view(-1, H, layer.qk_head_dim),
            v.view(-1, H, layer.v_head_dim), forward_batch.req_pool_indices, forward_batch.seq_lens,
            self.req_to_token_pool.req_to_token, layer.scaling, _max_seq_len(forward_batch),
            rows_host=rows_h, seq_lens_host=seq_h)
        if layer.layer_id == self.last_sparse_layer and not self.engine.graph_mode:
            self._maybe_log()
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
        Hq, H, D, Dv = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim, layer.v_head_dim
        q2, k2, v2 = q.view(-1, 2, Hq, D), k.view(-1, 2, H, D), v.view(-1, 2, H, Dv)
        if save_kv_cache:
            self.engine.write_kv(layer.layer_id, forward_batch.out_cache_loc.view(-1, 2)[:, 0], k2[:, 0], v2[:, 0],
                                 decode=True)
        mx = _max_seq_len(forward_batch)
        rows_h, seq_h = self._host_rows(layer, forward_batch, extra=1)
        o = self.engine.decode_attention(
            layer.layer_id, q2[:, 0], k2[:, 0], v2[:, 0], forward_batch.req_pool_indices, forward_batch.seq_lens + 1,
            self.req_to_token_pool.req_to_token, layer.scaling, None if mx is None else mx + 1,
            q_draft=q2[:, 1], k_draft=k2[:, 1], v_draft=v2[:, 1], rows_host=rows_h, seq_lens_host=seq_h)
        if layer.layer_id == self.last_sparse_layer:
            self._maybe_log()
        return o.reshape(-1, Hq * Dv)

    def _host_rows(self, layer, forward_batch, extra: int = 0):
        """Host rows and lengths for the engine's per-step check, at the first sparse layer only
        (``(None, None)`` elsewhere: the engine reads them there only)."""
        if layer.layer_id != self.engine.sparse_layers[0]:
            return None, None
        if self.engine.graph_mode:   # capture / warm-up: dummy rows, nothing to check
            return None, None
        return _host_rows(forward_batch, self.engine.batch_rows_host, extra)

    def _maybe_log(self):
        """Log on the first decode step of a request and every ``log_interval`` decode steps."""
        s = self.engine.stats
        if s.decode_steps == getattr(self, "_logged_step", -1):
            return                  # (a replay logs about the step before it, which may have logged)
        if s.new_request_started or s.decode_steps % self.log_interval == 0:
            self._logged_step = s.decode_steps
            r = self.engine.residency()
            from . import spec_probe

            r["draft_match"] = spec_probe.draft_match() if spec_probe.ACTIVE else None
            logger.info(format_residency(r))
            if self.metrics is not None:
                self.metrics.update(r)


class OasisDraftBackend(WrappedBackend):
    """The draft worker's draft-extend backend for ``--kv-sparse oasis`` with a draft.

    After each paired forward SGLang's EAGLE v2 worker runs a DRAFT_EXTEND_V2 pass of 2 tokens
    per request over the draft model's own (dense) KV cache; SGLang sends it through its prefill
    kernel. Here it runs ``ops.paged_attention`` (split-KV, GQA-grouped, each KV tile loaded
    once for both rows); every other pass goes to the wrapped backend.
    """

    def __init__(self, inner: AttentionBackend, ops, pool, req_to_token_pool):
        super().__init__(inner)
        self.ops, self.pool, self.req_to_token_pool = ops, pool, req_to_token_pool

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        """DRAFT_EXTEND_V2 (``forward_batch.seq_lens`` already counts its 2 tokens): paged
        attention; anything else: the wrapped backend. ``q [2B, Hq*D]`` -> ``[2B, Hq*Dv]``."""
        if forward_batch.forward_mode.is_draft_extend_v2() and paged_ok(layer, kwargs):
            return paired_paged_attention(self.ops, self.pool, self.req_to_token_pool.req_to_token,
                                          q, k, v, layer, forward_batch, save_kv_cache, extra_lens=0)
        return self.inner.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)


_PLAIN_KWARGS = ("sinks", "score_mod", "aux_tensors")


def paged_ok(layer, kwargs) -> bool:
    """``ops.paged_attention`` computes this layer exactly: plain causal decoder self-attention,
    no logit cap, sliding window, iRoPE, sinks, score_mod, quantized KV or extra inputs (else the
    wrapped backend runs)."""
    attn_type = getattr(getattr(layer, "attn_type", None), "name", "DECODER")
    return (attn_type == "DECODER" and not getattr(layer, "use_irope", False)
            and all(k in _PLAIN_KWARGS for k, v in kwargs.items() if v is not None)
            and not getattr(layer, "is_cross_attention", False) and getattr(layer, "logit_cap", 0) in (0, None, 0.0)
            and (getattr(layer, "sliding_window_size", -1) or -1) < 0 and getattr(layer, "k_scale", None) is None
            and getattr(layer, "xai_temperature_len", -1) in (-1, None)
            and all(kwargs.get(a) is None for a in ("sinks", "score_mod", "aux_tensors")))


def paired_paged_attention(ops, pool, req_to_token, q, k, v, layer, forward_batch, save_kv_cache,
                           extra_lens: int):
    """Two consecutive new tokens per request (a causal chain) over a dense layer's whole KV cache.

    Args:
        q: ``[2B, Hq*D]`` (or ``[2B, Hq, D]``); k / v: ``[2B, H*D]`` written to ``pool`` at
            ``forward_batch.out_cache_loc`` first when ``save_kv_cache``.
        extra_lens: tokens to add to ``forward_batch.seq_lens`` to get what the second row sees
            (TARGET_VERIFY: 2, the prefix excludes the verify tokens; DRAFT_EXTEND_V2: 0).
    Returns:
        ``[2B, Hq*Dv]``.
    Raises:
        RuntimeError: the batch does not hold exactly 2 tokens per request.
    """
    Hq, H, D, Dv = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim, layer.v_head_dim
    B = forward_batch.req_pool_indices.shape[0]
    if save_kv_cache and (k is None or v is None):
        raise RuntimeError("OasisKV: layers without their own K/V (KV sharing) are not supported")
    if q.shape[0] != 2 * B:
        raise RuntimeError(f"OasisKV: the paired forward needs 2 tokens per request, got {q.shape[0]} for {B} requests")
    if save_kv_cache:
        pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k.view(-1, H, D), v.view(-1, H, Dv))
    mx = _max_seq_len(forward_batch)
    o = ops.paged_attention(q.view(B, 2, Hq, D), pool.get_key_buffer(layer.layer_id),
                            pool.get_value_buffer(layer.layer_id), req_to_token, forward_batch.req_pool_indices,
                            forward_batch.seq_lens + extra_lens, layer.scaling,
                            None if mx is None else mx + extra_lens)
    return o.reshape(-1, Hq * Dv)


def draft_backend_hook(result, self, *args, **kwargs):
    """AFTER ``EagleDraftWorker.init_attention_backend``: wrap the draft-extend backend (the
    draft layer of the paired forward) when ``--kv-sparse oasis`` runs with a draft."""
    sa = getattr(self, "server_args", None) or self.draft_runner.server_args
    if getattr(sa, "kv_sparse", "none") != "oasis":
        return result
    from oasis_sglang.kernels import get_kv_ops

    cfg = OasisConfig.from_json(sa.kv_sparse_config)
    ops = get_kv_ops(cfg.kernel_backend(torch.device(self.draft_runner.device).type))
    wrapped = {}

    def wrap(b):
        if b is None or isinstance(b, OasisDraftBackend):
            return b
        return wrapped.setdefault(id(b), OasisDraftBackend(b, ops, self.draft_runner.token_to_kv_pool,
                                                           self.draft_runner.req_to_token_pool))

    self.draft_extend_attn_backend = wrap(self.draft_extend_attn_backend)
    self.draft_runner.attn_backend = wrap(self.draft_runner.attn_backend)
    logger.info("OasisKV: the draft layer's draft-extend pass runs %s paged attention", ops.name)
    return result


_warned_host = 0


def _host_rows(forward_batch, stashed=None, extra: int = 0):
    """``(request rows, seq_lens + extra)`` as host integer lists, else ``(None, None)``.

    The rows come from the scheduler (``run_batch_hook`` stashes ``req.req_pool_idx`` of the
    batch being run, in batch order), the lengths from SGLang's ``seq_lens_cpu``. Without them
    the engine's per-step check reads the device."""
    global _warned_host
    B = forward_batch.req_pool_indices.shape[0]
    rows = stashed if stashed is not None and len(stashed) == B else None
    seq = getattr(forward_batch, "seq_lens_cpu", None)
    if rows is None or seq is None or len(seq) != B:
        if _warned_host < 5:
            logger.info("OasisKV: a %s batch carries no host copy of its rows (%s) or lengths (%s) for %d requests; "
                        "this step's prediction check reads the device (and decode steps run eagerly until the "
                        "next OasisKV decode line rebuilds the host record)", forward_batch.forward_mode,
                        None if rows is None else len(rows), None if seq is None else len(seq), B)
            _warned_host += 1
        return None, None
    return list(rows), (seq + extra).tolist()


def run_batch_hook(self, batch, *args, **kwargs):
    """BEFORE ``Scheduler.run_batch``: stash the batch's request rows (host integers, batch
    order) on the OasisKV engine, so the per-step prediction check and the CUDA-graph replay
    decision need no device read (SGLang 0.5.17's ForwardBatch keeps its rows on the device)."""
    eng = getattr(getattr(self, "req_to_token_pool", None), "_oasis", None)
    if eng is not None:
        reqs = getattr(batch, "reqs", None)
        rows = None if reqs is None else [r.req_pool_idx for r in reqs]
        eng.batch_rows_host = None if rows is None or any(r is None for r in rows) else rows
    return None


def can_run_graph_hook(result, self, forward_batch, *args, **kwargs):
    """AFTER ``DecodeCudaGraphRunner.can_run_graph``: replay a decode step only when the OasisKV
    engine says every row was predicted for this context (``OasisSparseKV.can_replay``, host
    values only); otherwise SGLang runs it eagerly and the engine selects synchronously."""
    if not result:
        return result
    mr = getattr(self, "model_runner", None)
    eng = getattr(getattr(mr, "req_to_token_pool", None), "_oasis", None)
    if eng is None or getattr(mr, "is_draft_worker", False) or not forward_batch.forward_mode.is_decode():
        return result
    rows, seq = eng.batch_rows_host, getattr(forward_batch, "seq_lens_cpu", None)
    B = forward_batch.batch_size
    if rows is None or seq is None or len(rows) != B or len(seq) != B:
        return False
    return eng.can_replay(rows, seq.tolist())


def _max_seq_len(forward_batch) -> int | None:
    """``max(seq_lens)`` from SGLang's host copy of the lengths, when the batch carries one."""
    cpu = getattr(forward_batch, "seq_lens_cpu", None)
    return int(cpu.max()) if cpu is not None and cpu.numel() else None


def format_residency(r: dict) -> str:
    """One ``OasisKV decode`` log line (parsed by scripts/run_demo.py; keep the keys stable)."""
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


def init_attention_backends_hook(result, model_runner, *args, **kwargs):
    """AFTER ``ModelRunner.init_attention_backends``: build the OasisKV state and wrap backends."""
    sa = model_runner.server_args
    if getattr(sa, "kv_sparse", "none") != "oasis" or getattr(model_runner, "is_draft_worker", False):
        return result                       # the draft model keeps SGLang's own KV cache and backend
    from .pool import OasisKVPool

    cfg = OasisConfig.from_json(sa.kv_sparse_config)
    mc = model_runner.model_config
    arch = str(getattr(mc, "attention_arch", ""))
    if "MLA" in arch.upper() or getattr(model_runner, "use_mla_backend", False):
        raise OasisConfigError(f"--kv-sparse oasis: MLA/DSA models are not supported ({mc.hf_config.architectures})")
    pool = model_runner.token_to_kv_pool
    if not isinstance(pool, OasisKVPool):
        raise OasisConfigError(
            f"--kv-sparse oasis: this model uses {type(pool).__name__} (hybrid, sliding-window or "
            f"quantized KV); only plain MHA/GQA KV caches are supported")
    if pool.start_layer != 0 or pool.layer_num != mc.num_hidden_layers:
        raise OasisConfigError("--kv-sparse oasis: pipeline parallelism is not supported")
    rtp = model_runner.req_to_token_pool
    dims = dict(num_layers=pool.layer_num, num_tokens=pool.size + pool.page_size, num_rows=rtp.req_to_token.shape[0],
                head_num=pool.head_num, head_dim=pool.head_dim, v_head_dim=pool.v_head_dim)
    check_memory(cfg, OasisSparseKV.memory_plan(cfg, **dims, dtype_bytes=torch.empty((), dtype=pool.dtype).element_size()),
                 model_runner.device)
    from oasis_sglang.kernels import get_kv_ops

    ops = get_kv_ops(cfg.kernel_backend(torch.device(model_runner.device).type))
    has_draft = bool(getattr(sa, "speculative_algorithm", None))
    predictor = cfg.predictor_for(has_draft=has_draft,
                                  model_free_draft=str(getattr(sa, "speculative_algorithm", "")).upper() == "NGRAM")
    if has_draft:
        from . import spec_probe

        spec_probe.activate()
    engine = OasisSparseKV(cfg, **dims, dtype=pool.dtype, device=model_runner.device, ops=ops, predictor=predictor)
    pool.oasis = engine
    rtp._oasis = engine
    engine.padding_row = 0        # ReqToTokenPool never hands out row 0; decode CUDA graphs pad with it
    interval = getattr(sa, "decode_log_interval", 40) or 40
    from .metrics import make_metrics

    metrics = make_metrics(sa)
    wrapped = {}

    def wrap(b):
        if b is None:
            return None
        if id(b) not in wrapped:
            wrapped[id(b)] = OasisAttnBackend(b, engine, pool, rtp, interval, metrics)
        return wrapped[id(b)]

    model_runner.attn_backend = wrap(model_runner.attn_backend)
    if getattr(model_runner, "decode_attn_backend", None) is not None:
        model_runner.decode_attn_backend = wrap(model_runner.decode_attn_backend)
    group = getattr(model_runner, "decode_attn_backend_group", None)
    if group:
        model_runner.decode_attn_backend_group = [wrap(b) for b in group]
    logger.info(
        "OasisKV: %s kernels, %s predictor, %d sparse / %d dense layers, budget %d tokens per request, layer and KV head "
        "(%d blocks of %d), request rows %d; device working set %.1f MiB, summaries %.1f MiB, "
        "host tier %.1f MiB (%d tokens)",
        ops.name, engine.predictor.name, len(engine.sparse_layers), len(cfg.dense_layers), cfg.budget_tokens, cfg.budget_blocks,
        cfg.block_size, engine.ws.R, engine.ws.nbytes / 2**20, engine.summaries.nbytes / 2**20,
        engine.host.nbytes / 2**20, engine.host.capacity_tokens)
    return result


def check_memory(cfg: OasisConfig, plan: dict, device) -> None:
    """Refuse to start when the OasisKV state cannot fit, naming the flags that size it.

    Raises:
        OasisConfigError: working set + summaries exceed free device memory, or the host tier
            exceeds available host memory.
    """
    import psutil

    host_free = psutil.virtual_memory().available
    dev = torch.device(device)
    if dev.type == "cuda":
        dev_free = torch.cuda.mem_get_info(dev)[0]
        host_need = plan["host_tier"]
    else:   # CPU: everything lives in host memory
        dev_free, host_need = host_free, plan["host_tier"] + plan["working_set"] + plan["summaries"]
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    if plan["working_set"] + plan["summaries"] > dev_free or host_need > host_free:
        raise OasisConfigError(
            f"--kv-sparse oasis: not enough memory: device working set {gib(plan['working_set'])} "
            f"(budget_tokens={cfg.budget_tokens} x --max-running-requests rows), summaries "
            f"{gib(plan['summaries'])} and host tier {gib(plan['host_tier'])} (--max-total-tokens) vs "
            f"{gib(dev_free)} free on {dev.type} and {gib(host_free)} host memory available; lower "
            f"budget_tokens, --max-running-requests or --max-total-tokens")


def req_free_hook(self, req, *args, **kwargs):
    """BEFORE ``ReqToTokenPool.free``: free the request's working set."""
    eng = getattr(self, "_oasis", None)
    if eng is not None and req.req_pool_idx is not None:
        eng.reset_rows([req.req_pool_idx])
    return None


def req_clear_hook(result, self, *args, **kwargs):
    """AFTER ``ReqToTokenPool.clear``: free every working set."""
    eng = getattr(self, "_oasis", None)
    if eng is not None:
        eng.reset_rows(list(range(eng.ws.R)))
    return result
