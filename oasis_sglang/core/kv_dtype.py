"""KV cache dtypes: what the host tier and working set store versus what attention computes in.

SGLang's ``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2`` store the KV cache in 8-bit floats
(``MHATokenToKVPool``: a ``torch.uint8`` buffer viewed as ``torch.float8_e4m3fn`` /
``torch.float8_e5m2``); a new token's K/V are cast to that dtype when written (``set_kv_buffer``:
``cache_k.to(self.dtype)``, divided first by the layer's ``k_scale`` when the checkpoint has one),
and attention reads them back cast to the query's dtype. OasisKV stores the same fp8 values in
its host tier and working set (half the bytes of bf16 on the host link and in host RAM), keeps
the min/max key summaries in the model's dtype (exact: every fp8 value is a bf16 / fp16 value),
and computes every attention over the values the KV cache holds (:func:`as_stored`), so a
budget that covers the context gives the same result as SGLang's fp8 KV cache.

Per-layer KV scales other than 1 (checkpoints with calibrated ``k_scale`` / ``v_scale``) are not
supported yet; the SGLang glue refuses them by name.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    """True for the 8-bit float KV dtypes SGLang's MHA pool stores (``float8_e4m3fn``, ``float8_e5m2``)."""
    return dtype in FP8_DTYPES


def as_stored(x: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """The values a KV cache of ``kv_dtype`` holds for ``x``, in ``x``'s dtype.

    ``x.to(kv_dtype).to(x.dtype)`` (round to nearest even, as SGLang's ``set_kv_buffer``); ``x``
    itself when ``kv_dtype`` is ``x``'s dtype. Shapes and devices unchanged.
    """
    if x.dtype == kv_dtype:
        return x
    return x.to(kv_dtype).to(x.dtype)


def summary_dtype(kv_dtype: torch.dtype, compute_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype of the min/max key summaries: the KV dtype, or for fp8 KV the model's
    (``compute_dtype``; an fp8 summary would round the Quest bound inwards).

    Raises:
        ValueError: fp8 ``kv_dtype`` without a ``compute_dtype``, or an fp8 ``compute_dtype``.
    """
    if compute_dtype is not None and is_fp8(compute_dtype):
        raise ValueError(f"compute_dtype {compute_dtype}: want the model's dtype (bfloat16, float16 or float32)")
    if is_fp8(kv_dtype):
        if compute_dtype is None:
            raise ValueError(f"dtype {kv_dtype} (an fp8 KV cache) needs compute_dtype, the model's dtype")
        return compute_dtype
    return kv_dtype
