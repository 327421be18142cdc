"""Compressed keys: per block and KV head, the coordinate-wise min and max of the keys.

Quest (Tang et al., 2024, Sec. 3) bounds a block's attention score by these two vectors;
OasisKV scores them with the (draft) query to pick each KV head's top-K blocks. They are
``2 / bs`` of the key cache (1/16 of the KV cache for bs=16) and live on the device.
The summaries are folded in token by token as K is written (``core.ops.BaseKVOps.write_kv``):
a block's summary is exact once its last token is written, and only complete blocks are
scored (the partial block is always resident as a recent block).
"""

from __future__ import annotations

import torch


class KeySummaries:
    """Device store of block summaries of the sparse layers: ``kmin/kmax[L][P, H, D]``.

    Indexed by SGLang page (= block) id, so shared radix-cache prefixes share summaries.
    """

    def __init__(self, num_layers: int, num_pages: int, head_num: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.kmin = [torch.zeros((num_pages, head_num, head_dim), dtype=dtype, device=device)
                     for _ in range(num_layers)]
        self.kmax = [torch.zeros((num_pages, head_num, head_dim), dtype=dtype, device=device)
                     for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        """Device bytes of all min and max summaries."""
        return sum(t.numel() * t.element_size() for t in self.kmin + self.kmax)


# --- 8-bit summaries, rounded outwards (an experiment: scripts/measure_agreement.py --summary-dtype) ---

SUMMARY_FORMATS = ("int8", "fp8_e4m3")
_QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}


def _e4m3_grid(device) -> torch.Tensor:
    """The finite ``float8_e4m3fn`` values, ascending, once each (``-448 .. 448``, ``-0`` dropped): float32 ``[253]``."""
    allv = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    return torch.unique(allv[torch.isfinite(allv)]).to(device)


def quantize_outward(kmin: torch.Tensor, kmax: torch.Tensor, fmt: str
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summaries in 8 bits with one scale per vector, rounded outwards so that the Quest score
    stays an upper bound: ``dequantize(qmin, scale) <= kmin`` and ``dequantize(qmax, scale) >= kmax``
    element by element (Quest, Tang et al. 2024, Sec. 3: the bound holds for any interval that
    contains the block's keys).

    Args:
        kmin, kmax: ``[..., D]`` float summaries (finite), ``kmin <= kmax``.
        fmt: ``"int8"`` (uniform steps of ``scale``: ``floor`` / ``ceil`` of ``k / scale``, 127
            levels each side) or ``"fp8_e4m3"`` (the next ``float8_e4m3fn`` value below / above
            ``k / scale``: 3 mantissa bits, a step of up to 1/8 of the value).

    Returns:
        ``qmin, qmax``: ``[..., D]`` ``torch.int8`` / ``torch.float8_e4m3fn``; ``scale``:
        ``[...]`` float32 = (largest ``|k|`` of the vector pair) / (127 or 448), slightly raised,
        1 for an all-zero pair.

    Raises:
        ValueError: an unknown ``fmt``, shapes that differ, or non-finite summaries.
    """
    if fmt not in SUMMARY_FORMATS:
        raise ValueError(f"summary format must be one of {SUMMARY_FORMATS}, got {fmt!r}")
    if kmin.shape != kmax.shape:
        raise ValueError(f"kmin {tuple(kmin.shape)} and kmax {tuple(kmax.shape)} differ in shape")
    lo, hi = kmin.float(), kmax.float()
    if not (torch.isfinite(lo).all() and torch.isfinite(hi).all()):
        raise ValueError("summaries must be finite to be quantized")
    amax = torch.maximum(lo.abs().amax(-1), hi.abs().amax(-1))
    # 2**-16 of headroom: k / scale stays within the format's range after fp32 rounding
    scale = torch.where(amax > 0, amax / _QMAX[fmt] * (1 + 2.0 ** -16), torch.ones_like(amax))
    s = scale[..., None]
    if fmt == "int8":
        qlo, qhi = torch.floor(lo / s), torch.ceil(hi / s)
        # fp32 division may land one step inside: step out until the product covers the summary
        qlo = qlo - (qlo * s > lo).float()
        qhi = qhi + (qhi * s < hi).float()
        return qlo.clamp(-127, 127).to(torch.int8), qhi.clamp(-127, 127).to(torch.int8), scale
    grid = _e4m3_grid(lo.device)
    ilo = (torch.searchsorted(grid, (lo / s).contiguous(), right=True) - 1).clamp(0, len(grid) - 1)
    ihi = torch.searchsorted(grid, (hi / s).contiguous(), right=False).clamp(0, len(grid) - 1)
    ilo = (ilo - (grid[ilo] * s > lo).long()).clamp(0, len(grid) - 1)
    ihi = (ihi + (grid[ihi] * s < hi).long()).clamp(0, len(grid) - 1)
    return grid[ilo].to(torch.float8_e4m3fn), grid[ihi].to(torch.float8_e4m3fn), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q [..., D]`` (int8 / float8_e4m3fn) times ``scale [...]`` -> float32 ``[..., D]``."""
    return q.float() * scale.float()[..., None]
