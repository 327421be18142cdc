"""Device working set: a bounded pool of block slots and the head-wise block table.

Paper: Methodology — head-wise logical-to-logical mapping above the engine's own tables, and
capped eviction. Each (request row, sparse layer, KV head) owns ``K = budget_tokens // bs``
slots; ``ids[l][r, h, e]`` is the logical block (of request row ``r``) held in slot entry
``e``, or ``-1``. Slot ``(r, h, e)`` stores ``bs`` tokens of keys and values. Device memory is
``R * H * K * bs * (D + Dv)`` elements per layer: bounded by the budget, not the context.
Request rows are SGLang's ``req_pool_idx``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .devcopy import to_device


@dataclass
class Admission:
    """Blocks to bring in for one layer, dense and fixed-size so no host sync is needed.

    For batch entry ``b`` and KV head ``h``, admission ``i`` is live where ``mask[b, h, i]``:
    logical block ``block[b, h, i]`` goes into slot entry ``entry[b, h, i]``. All ``[B, H, K]``
    (``mask`` bool, the others int64; dead entries hold arbitrary values). ``evicted`` and
    ``hits`` are 0-dim int64 device tensors: admissions that replaced a resident block, and
    wanted blocks already resident (no traffic).
    """

    mask: torch.Tensor
    entry: torch.Tensor
    block: torch.Tensor
    evicted: torch.Tensor
    hits: torch.Tensor

    def sparse(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The live admissions as parallel ``[M]`` tensors ``(batch, head, entry, block)`` (syncs)."""
        b, h, i = torch.nonzero(self.mask, as_tuple=True)
        return b, h, self.entry[b, h, i], self.block[b, h, i]


class WorkingSet:
    """Slots and block table of the sparse layers.

    Args:
        num_layers: sparse layers ``L``. num_rows: request rows ``R``. head_num: KV heads ``H``.
        budget_blocks: ``K``. block_size: ``bs``. head_dim / v_head_dim: ``D`` / ``Dv``.
    """

    def __init__(self, num_layers: int, num_rows: int, head_num: int, budget_blocks: int,
                 block_size: int, head_dim: int, v_head_dim: int, dtype: torch.dtype,
                 device: torch.device | str):
        self.L, self.R, self.H, self.K, self.bs = num_layers, num_rows, head_num, budget_blocks, block_size
        shape = (num_rows, head_num, budget_blocks, block_size)
        self.k = [torch.zeros(shape + (head_dim,), dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape + (v_head_dim,), dtype=dtype, device=device) for _ in range(num_layers)]
        self.ids = torch.full((num_layers, num_rows, head_num, budget_blocks), -1, dtype=torch.int64, device=device)
        self.last_used = torch.zeros_like(self.ids)
        self.violations = torch.zeros((), dtype=torch.int64, device=device)

    def check(self) -> None:
        """Raise ``RuntimeError`` if a decoded token ever found its block not resident (syncs)."""
        n = int(self.violations)
        if n:
            raise RuntimeError(f"OasisKV invariant: {n} decoded token(s) found their block not resident")

    @property
    def nbytes(self) -> int:
        """Device bytes of all working-set K and V slots."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def reset_rows(self, rows) -> None:
        """Free every slot of the given request rows (request finished or row reallocated).
        Does not wait for the device (``devcopy``)."""
        rows = to_device(rows, self.ids.device).reshape(-1)
        self.ids.index_fill_(1, rows, -1)
        self.last_used.index_fill_(1, rows, 0)

    def drop_blocks_from(self, layer: int, rows: torch.Tensor, first_block: torch.Tensor) -> None:
        """Free the slots of blocks ``>= first_block[b]`` of request row ``rows[b]`` (``[B]``):
        a prefill chunk rewrote them in the host tier, so resident copies are stale."""
        ids = self.ids[layer][rows]                                         # [B, H, K]
        self.ids[layer][rows] = torch.where(ids >= first_block[:, None, None], -1, ids)

    def plan(self, layer: int, rows: torch.Tensor, wanted: torch.Tensor, forced: torch.Tensor,
             step, fetch_cap: int | None, counted: torch.Tensor | None = None) -> Admission:
        """Decide admissions and evictions for one layer and update its block table
        (:func:`plan_admissions` on ``ids[layer]`` / ``last_used[layer]``)."""
        return plan_admissions(self.ids[layer], self.last_used[layer], rows, wanted, forced, step, fetch_cap, counted)


def _missing(ids: torch.Tensor, rows: torch.Tensor, wanted: torch.Tensor):
    """``(held, match, in_held, missing)`` of one layer: the ``[B, H, K, K]`` match of wanted
    blocks (rows) against resident ones (columns)."""
    held = ids[rows]                                            # [B, H, K]
    assert wanted.shape == held.shape, (wanted.shape, held.shape)
    valid_w = wanted >= 0
    match = (wanted[..., :, None] == held[..., None, :]) & valid_w[..., :, None] & (held >= 0)[..., None, :]
    in_held = match.any(-1)
    return held, match, in_held, valid_w & ~in_held


def budget_candidates(ids: torch.Tensor, rows: torch.Tensor, wanted: torch.Tensor, forced: torch.Tensor,
                      fetch_cap: int | None, budget: torch.Tensor | None = None) -> torch.Tensor:
    """The admissions a step budget may refuse, for one layer (torch reference; paper eq. 3).

    Missing blocks are admitted in priority order (forced first, then by descending score):
    the first ``n_free`` into free slots, the rest each evicting a resident block. The
    candidates are the evicting admissions of non-forced blocks that ``fetch_cap`` allows:
    missing ranks ``max(n_free, n_forced_missing) .. n_free + cap - 1``. Free-slot fills and
    forced (sink / recent) blocks are never refused.

    Args:
        ids: ``[R, H, K]`` block table. rows: ``[B]``. wanted / forced: ``[B, H, K]`` from
            ``select_blocks`` (priority order). fetch_cap: the per-head ceiling (``None``: K).
        budget: 0-dim int64 tensor, the step budget's blocks per layer (``TransferBudget.blocks``);
            negative (unlimited): no candidate is listed (``share_budget`` then gives every head
            ``C`` without reading them; the kernel skips its block-table match). ``None``: listed.
    Returns:
        ``[B*H, C]`` int32, ``C = min(fetch_cap, K)``: per (request, KV head) the candidates'
        positions in ``wanted`` (their score rank within the head), increasing, ``-1`` padded.
    """
    held, _, _, missing = _missing(ids, rows, wanted)
    B, H, K = held.shape
    C = K if fetch_cap is None else min(int(fetch_cap), K)
    n_free = (held < 0).sum(-1, keepdim=True)
    n_forced = (missing & forced).sum(-1, keepdim=True)
    rank = missing.long().cumsum(-1) - 1
    cand = missing & (rank >= torch.maximum(n_free, n_forced)) & (rank < n_free + C)
    pos = torch.arange(K, device=ids.device).expand(B, H, K)
    order = torch.where(cand, pos, pos + K).sort(-1).values[..., :C]          # candidates first, by position
    out = torch.where(order < K, order, -1).view(B * H, C).to(torch.int32)
    return out if budget is None else torch.where(budget < 0, -1, out)


def plan_admissions(ids: torch.Tensor, last_used: torch.Tensor, rows: torch.Tensor, wanted: torch.Tensor,
                    forced: torch.Tensor, step, fetch_cap: int | None, counted: torch.Tensor | None = None,
                    allow: torch.Tensor | None = None) -> Admission:
    """Decide admissions and evictions for one layer and update the block table (the torch
    reference of stage (b); paper: Methodology, Delta Selection and Capped Eviction).

    Wanted blocks already resident are hits (no traffic). Missing ones are admitted in
    priority order into free slots first, then into slots of resident blocks outside
    ``wanted``, least recently selected first (LRU). Admissions that evict are capped at
    ``fetch_cap`` per (request, KV head) unless the block is forced (sink / recent:
    always resident). Every slot ends up holding distinct blocks.

    Args:
        rows: ``[B]`` request rows. wanted / forced: ``[B, H, K]`` from ``select_blocks``.
        step: monotonically increasing step counter (LRU clock): an int, or a 0-dim int64
            device tensor (no host value needed, so the call can be captured in a CUDA graph).
        counted: ``[B]`` bool, the rows whose hits and evictions are counted (default all;
            CUDA-graph padding rows are not).
        allow: ``[B*H]`` int, the step budget's share (``core.budget.share_budget``): at most
            this many of the head's ``budget_candidates`` are admitted (the first ones);
            ``None``: all of them (the cap alone).
    Returns:
        The admissions to copy in (``Admission``); the table already points at them.
        Runs without host synchronisation.
    """
    # one [B, H, K, K] match of wanted (rows) against held (columns) gives both directions
    held, match, in_held, missing = _missing(ids, rows, wanted)   # in_held: a hit
    B, H, K = held.shape
    keep = match.any(-2)                                        # resident block still wanted
    free = held < 0
    evictable = (held >= 0) & ~keep
    n_free = free.sum(-1, keepdim=True)
    n_forced_missing = (missing & forced).sum(-1, keepdim=True)
    rank = missing.long().cumsum(-1) - 1                       # priority rank among missing
    if fetch_cap is None:
        limit = torch.full_like(n_free, K)
    else:
        # a cap of K or more is unbounded; clamped so n_free + cap cannot overflow int64
        limit = torch.maximum(n_free + min(int(fetch_cap), K), n_forced_missing)
    if allow is not None:
        # the budget's share of the candidates (budget_candidates: ranks from max(n_free, forced))
        lo = torch.maximum(n_free, n_forced_missing)
        limit = torch.minimum(limit, lo + allow.view(B, H, 1).to(limit.dtype))
    admitted = missing & (rank < limit)
    n_admit = admitted.sum(-1, keepdim=True)
    # destinations: free slots (in slot order) then evictable by LRU, then untouchable
    big = torch.iinfo(torch.int64).max
    dkey = torch.where(free, torch.full_like(held, -1), torch.where(evictable, last_used[rows], torch.full_like(held, big)))
    dest_order = torch.sort(dkey, dim=-1, stable=True).indices
    src_order = torch.sort((~admitted).to(torch.int8), dim=-1, stable=True).indices
    i = torch.arange(K, device=held.device)[None, None, :]
    pair = i < n_admit                                          # [B, H, K] live admissions
    blocks = torch.gather(wanted, -1, src_order)                # admitted blocks first, in priority order
    was_free = torch.gather(free, -1, dest_order)
    # scatter the live admissions into their slots (dead ones into a spare column K)
    slot = torch.where(pair, dest_order, K)
    new_held = torch.cat([held, held[..., :1]], -1)
    new_held.scatter_(-1, slot, torch.where(pair, blocks, -1))
    new_held = new_held[..., :K]
    # LRU clock: every slot whose block is wanted this step is "used" now: the kept ones and
    # the admitted ones (admissions only land in free or evictable slots, never in kept ones)
    filled = torch.zeros((B, H, K + 1), dtype=torch.bool, device=held.device).scatter_(-1, slot, pair)[..., :K]
    used = keep | filled
    ids[rows] = new_held
    last_used[rows] = torch.where(used, step, last_used[rows])
    c = None if counted is None else counted[:, None, None]
    return Admission(mask=pair, entry=dest_order, block=blocks,
                     evicted=(pair & ~was_free if c is None else pair & ~was_free & c).sum(),
                     hits=(in_held if c is None else in_held & c).sum())
