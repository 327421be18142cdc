"""Block scoring and top-K selection (paper: Methodology, Look-ahead Attention; Quest Sec. 3).

Quest upper bound of query ``q`` on a block with key summaries ``m`` (min) and ``M`` (max):
``u(q, block) = sum_d max(q_d * m_d, q_d * M_d)`` >= ``q . k`` for every key ``k`` in the block,
computed as ``q+ . M + q- . m`` (``q+``/``q-`` the positive / negative parts of ``q``; equal for
finite ``m <= M``), the form the Triton kernel runs as two matrix products. A non-finite summary
(a key that overflowed) makes the bound NaN (``0 * inf``), and ``select_blocks`` ranks a NaN
bound last among the candidates.
GQA: a KV head serves ``G`` query heads; a block matters to the KV head if it matters to any
of them, so the KV head's score is the max of the group's bounds.
"""

from __future__ import annotations

import torch


def quest_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Quest upper bounds, GQA-combined by max over the group.

    Args:
        q: ``[B, Hq, D]`` queries (one row per request), ``Hq = H * G``.
        kmin, kmax: ``[B, NB, H, D]`` summaries of each request's blocks.
    Returns:
        ``[B, H, NB]`` float32 scores.
    """
    B, Hq, D = q.shape
    H = kmin.shape[2]
    assert Hq % H == 0 and kmin.shape == kmax.shape and kmin.dim() == 4 and kmin.shape[0] == B and kmin.shape[3] == D, \
        f"quest_scores: q {tuple(q.shape)}, kmin {tuple(kmin.shape)}, kmax {tuple(kmax.shape)}: want q [B, Hq, D] and " \
        f"kmin = kmax [B, NB, H, D] with Hq a multiple of H"
    qg = q.float().view(B, H, Hq // H, 1, D)                       # [B, H, G, 1, D]
    lo = kmin.float().permute(0, 2, 1, 3).unsqueeze(2)             # [B, H, 1, NB, D]
    hi = kmax.float().permute(0, 2, 1, 3).unsqueeze(2)
    zero = qg.new_zeros(())
    qp = torch.where(qg < 0, zero, qg)                             # q+ (NaN kept)
    qn = torch.where(qg > 0, zero, qg)                             # q- (NaN kept)
    bound = (qp * hi).sum(-1) + (qn * lo).sum(-1)                  # [B, H, G, NB]
    return bound.amax(dim=2)


def forced_mask(num_blocks: torch.Tensor, nb_max: int, sink_blocks: int, recent_blocks: int) -> torch.Tensor:
    """``[B, nb_max]`` bool: blocks that are always resident (sink and recent, incl. the partial one)."""
    j = torch.arange(nb_max, device=num_blocks.device)[None, :]
    n = num_blocks[:, None]
    return (j < n) & ((j < sink_blocks) | (j >= n - recent_blocks))


def select_blocks(scores: torch.Tensor, num_blocks: torch.Tensor, num_complete: torch.Tensor,
                  k: int, sink_blocks: int, recent_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K blocks per (request, KV head), sink and recent blocks forced in.

    Args:
        scores: ``[B, H, NB]`` block scores (``quest_scores``).
        num_blocks: ``[B]`` blocks holding context (the last may be partial).
        num_complete: ``[B]`` complete (summarised) blocks.
        k: working-set size in blocks (``budget_tokens // block_size``).
    Returns:
        ``(wanted, forced)``: ``wanted [B, H, k]`` int64 logical block ids in priority order
        (forced blocks first, then by descending score, ties to the lower id; ``-1`` pads when a
        request has fewer than ``k`` blocks) and ``forced [B, H, k]`` bool for the forced entries.
    """
    B, H, NB = scores.shape
    forced = forced_mask(num_blocks, NB, sink_blocks, recent_blocks)[:, None, :].expand(B, H, NB)
    j = torch.arange(NB, device=scores.device)[None, None, :]
    cand = (j < num_complete[:, None, None]) & ~forced
    neg = float("-inf")          # Python scalars: torch.where takes them as kernel arguments (no host copy)
    # candidate scores are finite (NaN lowest, +-inf clamped), so forced blocks (+inf) always
    # rank first and blocks outside the candidates (-inf) last, whatever the query holds
    fmax = torch.finfo(torch.float32).max
    cs = torch.nan_to_num(scores.float(), nan=-3.0e38, posinf=fmax, neginf=-fmax)
    s = torch.where(forced, float("inf"), torch.where(cand, cs, neg))
    order_vals, order = torch.sort(s, dim=-1, descending=True, stable=True)
    kk = min(k, NB)
    top_v, top = order_vals[..., :kk], order[..., :kk]
    wanted = torch.where(top_v == float("-inf"), torch.full_like(top, -1), top)
    is_forced = torch.gather(forced, -1, top) & (wanted >= 0)
    if kk < k:
        pad = torch.full((B, H, k - kk), -1, dtype=wanted.dtype, device=wanted.device)
        wanted = torch.cat([wanted, pad], -1)
        is_forced = torch.cat([is_forced, torch.zeros_like(pad, dtype=torch.bool)], -1)
    return wanted, is_forced
