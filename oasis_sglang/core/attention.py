"""Reference attention for OasisKV (torch SDPA; the Triton kernels replace it on CUDA later).

Both functions issue the same ``scaled_dot_product_attention`` calls, with the same tensor
layouts, as SGLang's ``layers/attention/torch_native_backend.py``, so with a working set that
covers the context the output is bitwise equal to SGLang's dense torch_native path.
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

from .kv_dtype import is_fp8


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int,
                      scale: float | None) -> torch.Tensor:
    """Causal attention of one request's new tokens over its whole context.

    Args:
        q: ``[T, Hq, D]`` queries of the ``T`` new tokens (positions ``prefix_len ..``).
        k: ``[n, H, D]``, v: ``[n, H, Dv]`` keys/values of positions ``0 .. n-1``, ``n = prefix_len + T``.
    Returns:
        ``[T, Hq, Dv]``.
    """
    T, Hq, D = q.shape
    n, H, _ = k.shape
    assert n == prefix_len + T and Hq % H == 0, (q.shape, k.shape, prefix_len)
    qh = q.movedim(0, 1)                                            # [Hq, T, D]
    q_red = torch.empty((Hq, n, D), dtype=q.dtype, device=q.device)
    q_red[:, prefix_len:, :] = qh
    kk, vv = k.movedim(0, 1), v.movedim(0, 1)
    if kk.dtype != q.dtype:
        kk, vv = kk.to(q.dtype), vv.to(q.dtype)
    out = scaled_dot_product_attention(q_red.unsqueeze(0), kk.unsqueeze(0), vv.unsqueeze(0),
                                       enable_gqa=Hq != H, scale=scale, is_causal=True)
    return out.squeeze(0).movedim(1, 0)[prefix_len:]


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """One query row over a head-wise working set.

    Args:
        q: ``[Hq, D]``. k: ``[n, H, D]``, v: ``[n, H, Dv]``: for each KV head its ``n`` resident
            tokens in position order (different heads may hold different positions).
    Returns:
        ``[Hq, Dv]``.
    """
    Hq = q.shape[0]
    H = k.shape[1]
    kk, vv = k.movedim(0, 1), v.movedim(0, 1)
    if kk.dtype != q.dtype:
        kk, vv = kk.to(q.dtype), vv.to(q.dtype)
    out = scaled_dot_product_attention(q[:, None, :].unsqueeze(0), kk.unsqueeze(0), vv.unsqueeze(0),
                                       enable_gqa=Hq != H, scale=scale, is_causal=False)
    return out.squeeze(0)[:, 0, :]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor (``core.kv_dtype.is_fp8``) viewed as ``uint8`` (same bytes); any other unchanged."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def gather_working_set(ws_k: torch.Tensor, ws_v: torch.Tensor, ids: torch.Tensor, seq_len: int,
                       block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Resident tokens of one request, per KV head in position order.

    Args:
        ws_k: ``[H, K, bs, D]``, ws_v: ``[H, K, bs, Dv]`` the request's slots; ids: ``[H, K]``
            logical block per slot (``-1`` free); seq_len: context length in tokens.
    Returns:
        ``(k [n, H, D], v [n, H, Dv])``.
    Raises:
        RuntimeError: KV heads hold different numbers of valid tokens (invariant broken).
    """
    H, K = ids.shape
    key = torch.where(ids >= 0, ids, torch.full_like(ids, torch.iinfo(torch.int64).max))
    order = torch.sort(key, dim=-1).indices
    sid = torch.gather(ids, -1, order)
    idx = order[..., None, None]
    # fp8 KV: gathered as bytes (torch has no fp8 gather on the CPU)
    k = torch.gather(_bytes(ws_k), 1, idx.expand(-1, -1, *ws_k.shape[2:])).view(ws_k.dtype)
    v = torch.gather(_bytes(ws_v), 1, idx.expand(-1, -1, *ws_v.shape[2:])).view(ws_v.dtype)
    pos = sid[..., None] * block_size + torch.arange(block_size, device=ids.device)
    valid = (sid[..., None] >= 0) & (pos < seq_len)                 # [H, K, bs]
    cnt = valid.flatten(1).sum(-1)
    if not bool((cnt == cnt[0]).all()):
        raise RuntimeError(f"OasisKV invariant: KV heads hold different token counts {cnt.tolist()}")
    n = int(cnt[0])
    k = k[valid].view(H, n, ws_k.shape[-1]).transpose(0, 1).contiguous()
    v = v[valid].view(H, n, ws_v.shape[-1]).transpose(0, 1).contiguous()
    return k, v
