"""Churn replay (benchmarks only): a realistic admission rate on random-weight models.

With random weights every query scores blocks at random, so every step's top-K misses about the
whole ``fetch_cap`` of blocks and the GPU benchmarks measure a worst case. Real text churns
less, or differently: ``scripts/measure_agreement.py --fetch-caps unbounded`` measures, per
sparse layer, how many wanted blocks a step finds not resident (SmolLM2 at budget 2048: 21.63
per step and KV head on average, docs/benchmarks/2026-12-03_churn-smollm2.md). A churn profile
(those per-layer means) replayed here makes each step want that many missing blocks per
(request, KV head) while scoring, planning, copies and attention still do their real work:

    OASIS_CHURN=out/churn_2048/results.json  (read by ``BenchHooks.from_env``; bench_oasis --churn)

For each (request, KV head) the predicted list becomes: its forced (sink / recent) blocks, then
its ``m`` best-scored blocks that are not resident, then resident blocks (slot order) to fill
the working set, then the rest of the prediction; ``m`` is the layer's mean rounded up or down by
a deterministic dither of (context length, request, KV head), so the average is the mean.
No host read (recordable in a CUDA graph).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

MAX_MEAN = 1 << 20          # blocks per step and KV head: far above any working set


def load_profile(path: str | Path) -> tuple[float, ...]:
    """Per-sparse-layer mean of wanted blocks not resident per step and KV head, from the
    ``results.json`` of ``scripts/measure_agreement.py --fetch-caps unbounded`` (its
    ``missing_by_layer`` of the unbounded run), or from a JSON list of numbers.

    Raises:
        ValueError: naming the file: it cannot be read as JSON, has no such run or list, or a
            value is negative, not finite or above ``MAX_MEAN``.
    """
    try:
        data = json.loads(Path(path).read_text())
        if isinstance(data, dict):
            runs = [r for r in data.get("runs", []) if isinstance(r, dict) and r.get("fetch_cap") == "unbounded"
                    and isinstance(r.get("missing_by_layer"), dict) and r["missing_by_layer"]]
            if not runs:
                raise ValueError("no run with fetch_cap 'unbounded' and 'missing_by_layer' (measure it with "
                                 "scripts/measure_agreement.py --fetch-caps unbounded)")
            data = [v for _, v in sorted(runs[0]["missing_by_layer"].items(), key=lambda kv: int(kv[0]))]
        if not isinstance(data, list) or not data or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and 0 <= x <= MAX_MEAN
                for x in data):
            raise ValueError(f"want a non-empty list of per-layer means in [0, {MAX_MEAN}], got {str(data)[:200]}")
        return tuple(float(x) for x in data)
    except (TypeError, AttributeError, KeyError, OverflowError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None


def resample(profile: tuple[float, ...], num_layers: int) -> tuple[float, ...]:
    """``profile`` stretched to ``num_layers`` sparse layers by relative depth (linear)."""
    n = len(profile)
    if n == num_layers or n == 1:
        return tuple(profile) * (num_layers if n == 1 else 1)
    out = []
    for i in range(num_layers):
        x = i * (n - 1) / max(1, num_layers - 1)
        lo = int(math.floor(x))
        hi = min(lo + 1, n - 1)
        out.append(profile[lo] + (x - lo) * (profile[hi] - profile[lo]))
    return tuple(out)


def in_set_pairwise(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``[..., N]`` bool: ``x[..., i] >= 0`` is one of the ``s[..., :] >= 0`` (same leading
    dims; int64 block ids, ``-1`` none). Compares every pair: ``N * M`` per row (the reference
    for ``in_set_bitmap``)."""
    return ((x[..., :, None] == s[..., None, :]) & (x >= 0)[..., :, None] & (s >= 0)[..., None, :]).any(-1)


def in_set_bitmap(x: torch.Tensor, s: torch.Tensor, nb_max: int) -> torch.Tensor:
    """``in_set_pairwise`` for block ids below ``nb_max``, in ``O(N + M + nb_max)`` per row: ``s``
    scattered into a ``[..., nb_max + 1]`` bool map (the last entry takes ids outside
    ``[0, nb_max)``), then read at ``x``. An id of ``x`` or ``s`` at or past ``nb_max`` is taken
    for none. Exact against ``in_set_pairwise`` when every id is below ``nb_max`` (tests/core/test_churn.py)."""
    def slot(t):
        return torch.where((t >= 0) & (t < nb_max), t, nb_max)
    m = torch.zeros(s.shape[:-1] + (nb_max + 1,), dtype=torch.bool, device=s.device)
    m.scatter_(-1, slot(s), True)
    return m.gather(-1, slot(x)) & (x >= 0) & (x < nb_max)


def replay_churn(wanted: torch.Tensor, forced: torch.Tensor, held: torch.Tensor, mean: float, seed: torch.Tensor,
                 salt: int = 0, nb_max: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The prediction rewritten to miss about ``mean`` resident blocks per (request, KV head).

    Args:
        wanted, forced: ``[B, H, K]`` from ``select_topk`` (priority order, ``-1`` padded).
        held: ``[B, H, K]`` int64 the rows' resident blocks (``-1`` free).
        mean: wanted blocks not resident per step and KV head to replay (>= 0).
        seed: ``[B]`` int64 (the rows' context lengths: new every step), with ``salt`` (the
            layer) seeds the dither.
        nb_max: every block id of ``wanted`` and ``held`` is below it (the step's ``nb_max``):
            membership tests go through a bitmap (``in_set_bitmap``). ``None``: every pair is
            compared (``in_set_pairwise``, ``K * K`` per row; on the H200 at 4K with 79 requests
            those compares were about 7 of the 27.8 ms step, docs/benchmarks).
    Returns:
        ``(wanted, forced)`` of the same shapes and dtypes: forced blocks first, then the ``m``
        best non-resident ones, then resident blocks, then the remaining predicted ones; no
        block twice. Where fewer than ``K - forced - m`` blocks are resident (a filling working
        set), more of the prediction is taken (free-slot fills).
    """
    B, H, K = wanted.shape
    dev = wanted.device
    mean = float(mean)
    mean = min(mean, float(K)) if mean > 0 else 0.0        # (NaN and negatives: no churn; at most the list)
    valid = wanted >= 0
    member = in_set_pairwise if nb_max is None else (lambda x, t: in_set_bitmap(x, t, int(nb_max)))
    in_held = member(wanted, held)
    nonres = valid & ~forced & ~in_held
    idx = (torch.arange(B, device=dev)[:, None] * H + torch.arange(H, device=dev)[None, :]).to(torch.int64)
    dither = ((seed.to(torch.int64)[:, None] * 1103515245 + idx * 12345 + salt * 2654435761) % 1024).to(torch.float32) / 1024.0
    m = (math.floor(mean) + (dither < (mean - math.floor(mean))).to(torch.int64))[..., None]      # [B, H, 1]
    take = nonres & ((nonres.long().cumsum(-1) - 1) < m)
    forced_blocks = torch.where(forced & valid, wanted, -2)
    held_free = (held >= 0) & ~member(held, forced_blocks)                                      # resident, not forced
    pos = torch.arange(K, device=dev).expand(B, H, K)
    big = 4 * K
    key_w = torch.where(forced & valid, pos, torch.where(take, K + pos, torch.where(nonres, 3 * K + pos, big)))
    key_h = torch.where(held_free, 2 * K + pos, big)
    keys = torch.cat([key_w, key_h], -1)
    vals = torch.cat([wanted, held], -1)
    is_forced = torch.cat([forced & valid, torch.zeros_like(held_free)], -1)
    order = keys.sort(dim=-1, stable=True).indices[..., :K]
    new_w = torch.where(torch.gather(keys, -1, order) < big, torch.gather(vals, -1, order), -1)
    return new_w, torch.gather(is_forced, -1, order) & (new_w >= 0)
