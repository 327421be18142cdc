"""Teacher-forced simulation of OasisKV's block selection inside a Hugging Face model.

Used to measure accuracy the way long-context papers do (issue 4: teacher-forced decoding over
held-out text) and the agreement of block predictors, on CPU, without a server. One forward pass
over ``prefix + continuation`` stands for a prefill of the prefix followed by one decode step per
continuation token fed the true token. Registered as a transformers attention function
(``ALL_ATTENTION_FUNCTIONS``), it receives each layer's post-RoPE ``q [1, Hq, T, D]``,
``k / v [1, H, T, D]`` and:

- positions ``< prefix_len`` and dense layers attend causally to everything (prefill is dense);
- decode position ``t`` of a sparse layer attends, per KV head, only to the blocks OasisKV would
  hold: sink + recent blocks and the top-K complete blocks by Quest score
  (``core.selection.quest_scores`` / ``select_blocks``, the same functions the engine uses),
  ``K = budget_tokens // block_size`` in all;
- the query that selects the blocks is the predictor's: ``current`` = step ``t``'s own query (the
  synchronous foundation path, and the upper bound of look-ahead with a perfect draft),
  ``previous`` = step ``t-1``'s query (no draft model).

``fetch_cap`` is not simulated (the working set is exactly the predicted top-K each step).
Per layer it records the agreement of ``previous`` with ``current`` on the non-forced top-K:
``|previous ∩ current| / |current|``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.nn.functional import scaled_dot_product_attention

from ..core.selection import quest_scores, select_blocks

NAME = "oasis_sim"
PREDICTORS = ("current", "previous")


@dataclass
class SimConfig:
    """What to simulate.

    Attributes:
        prefix_len: tokens of the prefill (decode steps start at this position).
        budget_tokens: working set per layer and KV head; ``None`` = dense everywhere.
        block_size, sink_blocks, recent_blocks, dense_layers: as in ``OasisConfig``.
        predictor: which query selects the blocks (``PREDICTORS``).
        chunk: decode positions scored at once (memory: ``chunk * blocks * H * D`` floats).
    """

    prefix_len: int
    budget_tokens: int | None = 512
    block_size: int = 16
    sink_blocks: int = 1
    recent_blocks: int = 2
    dense_layers: tuple[int, ...] = (0, 1)
    predictor: str = "current"
    chunk: int = 128
    agreement: dict = field(default_factory=dict)      # layer -> [sum of agreement, count]

    def __post_init__(self):
        if self.predictor not in PREDICTORS:
            raise ValueError(f"predictor must be one of {PREDICTORS}, got {self.predictor!r}")
        if self.budget_tokens is not None and self.budget_tokens % self.block_size:
            raise ValueError("budget_tokens must be a multiple of block_size")


_ACTIVE: list[SimConfig] = []


def block_summaries(k: torch.Tensor, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``k [H, T, D]`` -> ``(kmin, kmax) [NB, H, D]`` over each block's tokens (partial block: its tokens)."""
    H, T, D = k.shape
    nb = -(-T // bs)
    pad = nb * bs - T
    kp = torch.nn.functional.pad(k, (0, 0, 0, pad))
    lo = torch.nn.functional.pad(k, (0, 0, 0, pad), value=float("inf")).view(H, nb, bs, D).amin(2)
    hi = kp.masked_fill(torch.arange(nb * bs, device=k.device)[None, :, None] >= T, float("-inf")).view(H, nb, bs, D).amax(2)
    return lo.transpose(0, 1).contiguous(), hi.transpose(0, 1).contiguous()


def _select(qsel: torch.Tensor, kmin, kmax, pos: torch.Tensor, cfg: SimConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K of decode positions ``pos [N]`` with selecting queries ``qsel [N, Hq, D]``."""
    bs = cfg.block_size
    n_ctx = pos + 1
    num_blocks, num_complete = (n_ctx + bs - 1) // bs, n_ctx // bs
    nb = int(num_blocks.max())
    N = qsel.shape[0]
    lo = kmin[:nb].unsqueeze(0).expand(N, -1, -1, -1)
    hi = kmax[:nb].unsqueeze(0).expand(N, -1, -1, -1)
    scores = quest_scores(qsel, lo, hi)                              # [N, H, nb]
    return select_blocks(scores, num_blocks, num_complete, cfg.budget_tokens // bs, cfg.sink_blocks, cfg.recent_blocks)


def _topk_set_agreement(a: torch.Tensor, fa: torch.Tensor, b: torch.Tensor, fb: torch.Tensor) -> tuple[float, int]:
    """Sum over rows of ``|a ∩ b| / |b|`` on non-forced entries, and the number of rows with a non-empty ``b``."""
    va, vb = (a >= 0) & ~fa, (b >= 0) & ~fb
    inter = ((b[..., :, None] == a[..., None, :]) & va[..., None, :]).any(-1) & vb
    nb = vb.sum(-1)
    ok = nb > 0
    return float((inter.sum(-1)[ok].float() / nb[ok].float()).sum()), int(ok.sum())


def oasis_sim_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention function: ``query [1, Hq, T, D]``, ``key/value [1, H, T, D]`` -> ``([1, T, Hq, Dv], None)``."""
    cfg = _ACTIVE[-1]
    B, Hq, T, D = query.shape
    H = key.shape[1]
    G = Hq // H
    scale = scaling if scaling is not None else 1.0 / math.sqrt(D)
    out = scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=G > 1)
    layer = getattr(module, "layer_idx", 0)
    P = cfg.prefix_len
    if B != 1 or cfg.budget_tokens is None or layer in cfg.dense_layers or T <= P:
        return out.transpose(1, 2).contiguous(), None
    q, k, v = query[0], key[0], value[0]                            # [Hq, T, D], [H, T, D]
    bs = cfg.block_size
    kmin, kmax = block_summaries(k.float(), bs)
    o = out[0].clone()                                              # [Hq, T, Dv]
    tok_block = torch.arange(T, device=q.device) // bs
    for s in range(P, T, cfg.chunk):
        pos = torch.arange(s, min(T, s + cfg.chunk), device=q.device)
        cur = q[:, pos].transpose(0, 1)                             # [N, Hq, D]
        w_cur, f_cur = _select(cur, kmin, kmax, pos, cfg)
        # both predictors every run: the agreement of `previous` with `current` is recorded
        w_prev, f_prev = _select(q[:, pos - 1].transpose(0, 1), kmin, kmax, pos, cfg)
        a, n = _topk_set_agreement(w_prev, f_prev, w_cur, f_cur)
        acc = cfg.agreement.setdefault(layer, [0.0, 0])
        acc[0] += a
        acc[1] += n
        wanted = w_cur if cfg.predictor == "current" else w_prev
        nbk = kmin.shape[0]
        held = torch.zeros(len(pos), H, nbk + 1, dtype=torch.bool, device=q.device)
        held.scatter_(2, torch.where(wanted >= 0, wanted, nbk), True)
        tmask = held[:, :, :nbk][:, :, tok_block] & (torch.arange(T, device=q.device)[None, None, :] <= pos[:, None, None])
        # attention of each decode position over its KV heads' resident tokens
        qq = q[:, pos].view(H, G, len(pos), D)
        sc = torch.einsum("hgnd,htd->hgnt", qq.float(), k.float()) * scale
        sc = sc.masked_fill(~tmask.permute(1, 0, 2)[:, None], float("-inf"))
        p = torch.softmax(sc, -1)
        o[:, pos] = torch.einsum("hgnt,htd->hgnd", p, v.float()).reshape(Hq, len(pos), -1).to(o.dtype)
    return o.unsqueeze(0).transpose(1, 2).contiguous(), None


def register() -> str:
    """Register ``oasis_sim`` with transformers; returns the name for ``attn_implementation``."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, oasis_sim_attention)
    return NAME


class simulate:
    """Context manager activating a :class:`SimConfig` for forwards of a model loaded with
    ``attn_implementation="oasis_sim"``."""

    def __init__(self, cfg: SimConfig):
        self.cfg = cfg

    def __enter__(self) -> SimConfig:
        _ACTIVE.append(self.cfg)
        return self.cfg

    def __exit__(self, *exc):
        _ACTIVE.remove(self.cfg)
        return False
