"""The paired forward's dense attention: split-KV paged attention for two tokens per request.

With a speculative draft (``--speculative-algorithm EAGLE3`` etc.) SGLang runs two passes per
step that its own backends send through the prefill kernel (``extend_attention_fwd``: 12-14x a
decode step's attention at 16K on the H200, docs/benchmarks.md): the target's TARGET_VERIFY
pass (2 tokens per request: the token being decoded and the draft) and the draft model's
DRAFT_EXTEND_V2 pass. For the target's dense layers (``OasisAttnBackend``) and for the draft
model (``OasisDraftBackend``), both run ``ops.paged_attention`` here instead (split-KV,
GQA-grouped, each KV tile loaded once for both rows).
"""

from __future__ import annotations

import logging

import torch

from .batch_info import max_seq_len

logger = logging.getLogger(__name__)

_PLAIN_KWARGS = ("sinks", "score_mod", "aux_tensors")


def capturing() -> bool:
    """A CUDA graph is being captured on the current stream (never on CPU)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


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
        RuntimeError: the batch does not hold exactly 2 tokens per request; a layer without
            its own K/V (KV sharing).
    """
    Hq, H, D, Dv = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim, layer.v_head_dim
    B = forward_batch.req_pool_indices.shape[0]
    if save_kv_cache and (k is None or v is None):
        raise RuntimeError("OasisKV: layers without their own K/V (KV sharing) are not supported")
    if q.shape[0] != 2 * B:
        raise RuntimeError(f"OasisKV: the paired forward needs 2 tokens per request, got {q.shape[0]} for {B} requests")
    if save_kv_cache:
        pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k.view(-1, H, D), v.view(-1, H, Dv))
    # the longest context sizes the split-KV grid only (each split's length is derived per
    # request on the device). While SGLang captures a CUDA graph its host lengths are the
    # capture's fill values, so the graph is sized for the table's width instead.
    mx = req_to_token.shape[1] - extra_lens if capturing() else max_seq_len(forward_batch)
    o = ops.paged_attention(q.view(B, 2, Hq, D), pool.get_key_buffer(layer.layer_id),
                            pool.get_value_buffer(layer.layer_id), req_to_token, forward_batch.req_pool_indices,
                            forward_batch.seq_lens + extra_lens, layer.scaling,
                            None if mx is None else mx + extra_lens)
    return o.reshape(-1, Hq * Dv)


class OasisDraftBackend:
    """The draft worker's draft-extend backend for ``--kv-sparse oasis`` with a draft: a mixin.

    After each paired forward SGLang's EAGLE v2 worker runs a DRAFT_EXTEND_V2 pass of 2 tokens
    per request over the draft model's own (dense) KV cache; here it runs
    ``paired_paged_attention``; every other pass goes to the backend's own ``forward_extend``.

    It is not a wrapper: SGLang captures the draft-extend pass in a CUDA graph only for backends
    of its listed classes (``EagleDraftWorker._capture_cuda_graphs``, eagle_worker_v2.py:
    ``isinstance(draft_extend_attn_backend, (TritonAttnBackend, ...))``), so
    :func:`adopt_draft_backend` gives the backend SGLang built a subclass of its own class with
    this ``forward_extend``; the object, its state and its type checks stay SGLang's.
    """

    __slots__ = ()                 # no layout of its own: SGLang's object can take the subclass
    _oasis_base: type = object     # the class SGLang built (its forward_extend serves the other passes)
    _oasis_draft: tuple = ()       # (ops, token_to_kv_pool, req_to_token_pool), set per object

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        """DRAFT_EXTEND_V2 (``forward_batch.seq_lens`` already counts its 2 tokens): paged
        attention; anything else: the backend's own. ``q [2B, Hq*D]`` -> ``[2B, Hq*Dv]``."""
        if forward_batch.forward_mode.is_draft_extend_v2() and paged_ok(layer, kwargs):
            ops, pool, rtp = self._oasis_draft
            return paired_paged_attention(ops, pool, rtp.req_to_token, q, k, v, layer, forward_batch, save_kv_cache,
                                          extra_lens=0)
        return self._oasis_base.forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache,
                                               **kwargs)


_ADOPTED: dict[type, type] = {}


def adopt_draft_backend(backend, ops, pool, req_to_token_pool):
    """Make ``backend`` (the draft worker's attention backend SGLang built) an
    :class:`OasisDraftBackend`: its class becomes ``OasisDraft<its class>``, a subclass of
    both, so it stays an instance of its own class (SGLang's CUDA-graph checks) and only its
    DRAFT_EXTEND_V2 pass changes. Idempotent; ``None`` stays ``None``.

    Returns:
        ``backend`` itself.
    """
    if backend is None:
        return None
    cls = type(backend)
    if not issubclass(cls, OasisDraftBackend):
        sub = _ADOPTED.get(cls)
        if sub is None:
            # (cls first: CPython lets an object change class only to one with its own layout
            # base first; the subclass's own forward_extend still comes before cls's)
            sub = _ADOPTED[cls] = type(f"OasisDraft{cls.__name__}", (cls, OasisDraftBackend),
                                       {"__module__": __name__, "__doc__": OasisDraftBackend.__doc__,
                                        "__slots__": (), "_oasis_base": cls,
                                        "forward_extend": OasisDraftBackend.forward_extend})
        backend.__class__ = sub
    backend._oasis_draft = (ops, pool, req_to_token_pool)
    return backend


def draft_backend_hook(result, self, *args, **kwargs):
    """AFTER ``EagleDraftWorker.init_attention_backend``: the draft-extend backend (the draft
    layer of the paired forward) becomes an :class:`OasisDraftBackend` when ``--kv-sparse
    oasis`` runs with a draft (before SGLang captures the draft-extend CUDA graph)."""
    from .server_args import oasis_config

    sa = getattr(self, "server_args", None) or self.draft_runner.server_args
    cfg = oasis_config(sa)
    if cfg is None:
        return result
    from oasis_sglang.kernels import get_kv_ops

    ops = get_kv_ops(cfg.kernel_backend(torch.device(self.draft_runner.device).type))
    r = self.draft_runner
    for b in (self.draft_extend_attn_backend, r.attn_backend):
        adopt_draft_backend(b, ops, r.token_to_kv_pool, r.req_to_token_pool)
    logger.info("OasisKV: the draft layer's draft-extend pass runs %s paged attention", ops.name)
    return result
