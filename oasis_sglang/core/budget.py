"""The per-step transfer budget: admissions shared across requests and KV heads by score rank.

Paper: Methodology, eq. 3 (``C = B_link x T_step``): what the host link can move while a decode
step computes is the most a step should admit; more stalls the step on its transfers. A fixed
per-head cap (``fetch_cap``) cannot say that: with few requests it wastes the link, with many
it overruns it (bench_oasis at 4K: 158 requests x 34 layers x 8 heads x 8 blocks = 1.4 GB a
step). Here the bytes of one step are divided evenly over the sparse layers, and a layer's
share goes to the candidates of all its (request, KV head) pairs in the order of their score
rank: the best missing block of every head before the second best of any (water-filling over
the position in each head's top-K list). Ties at the last admitted rank are broken by a
rotation with the LRU clock, so no head is always last. ``fetch_cap`` stays the per-head
ceiling; free-slot fills and forced (sink / recent) blocks are never refused
(``working_set.budget_candidates``).

``transfer_budget`` (config): bytes per step, a fraction of what the link moves in a step
(link rate measured at start-up x the step's compute time, estimated while serving as the step
time less the copies' link time), ``"auto"`` (0.8 of it), or ``None`` (the cap alone).
"""

from __future__ import annotations

import logging
import math

import torch

logger = logging.getLogger(__name__)

AUTO_LINK_FRACTION = 0.8       # ``"auto"``: headroom for the step time's jitter and the write-back traffic
UNLIMITED = -1                 # ``TransferBudget.blocks`` before a step time was measured


def share_budget(cand_pos: torch.Tensor, budget: torch.Tensor, clock: torch.Tensor, K: int) -> torch.Tensor:
    """Each (request, KV head)'s share of one layer's step budget, by score rank.

    Args:
        cand_pos: ``[N, C]`` int32 (``N = B * H``): per (request, KV head) its candidates'
            positions in its top-K list, increasing, ``-1`` padded (``ops.budget_candidates``).
        budget: 0-dim int64 device tensor, candidates this layer may admit this step (``< 0``:
            unlimited: every head gets ``C``, so the plan admits what ``fetch_cap`` allows, the
            same as planning without a budget; the candidate lists are then not read).
        clock: 0-dim int64 device tensor (the LRU clock): rotates the tie-break at the last rank.
        K: the top-K list length (positions are ``0 .. K-1``).
    Returns:
        ``[N]`` int32: how many of its first candidates each (request, KV head) admits. Every
        candidate at a position below the last admitted one is admitted; at that position the
        heads are taken in (index - clock) mod N order until the budget is spent. The sum is
        ``min(budget, candidates)`` for a budget ``>= 0``. No host sync (recordable in a CUDA graph).
    """
    N, C = cand_pos.shape
    dev = cand_pos.device
    if N == 0 or C == 0:
        return torch.zeros(N, dtype=torch.int32, device=dev)
    return torch.where(budget < 0, C, _share_finite(cand_pos, budget, clock, K)).to(torch.int32)


def _share_finite(cand_pos: torch.Tensor, budget: torch.Tensor, clock: torch.Tensor, K: int) -> torch.Tensor:
    """``share_budget`` for a budget ``>= 0`` (with a negative one the result is discarded by the caller)."""
    N, C = cand_pos.shape
    dev = cand_pos.device
    valid = cand_pos >= 0
    pos = torch.where(valid, cand_pos.long(), K)
    hist = torch.zeros(K + 1, dtype=torch.int64, device=dev).scatter_add_(0, pos.view(-1), torch.ones_like(pos.view(-1)))
    cum = hist[:K].cumsum(0)                                          # candidates at positions <= p
    b = budget
    full = (cum <= b).sum()                                           # positions 0 .. full-1 fit whole
    # (gather, not cum[t]: indexing with a 0-dim tensor reads it on the host, a sync a graph cannot hold)
    below = torch.where(full > 0, cum.gather(0, (full - 1).clamp(min=0).view(1)).squeeze(0), 0)
    rest = b - below                                                  # for the heads with a candidate at `full`
    allow = (valid & (pos < full)).sum(-1)
    at = (valid & (pos == full)).any(-1)                             # [N]
    idx = torch.arange(N, device=dev)
    start = clock % N
    at_rot = at[(idx + start) % N]                                    # heads in rotated order
    before_rot = at_rot.long().cumsum(0) - at_rot.long()             # earlier heads at `full`
    before = before_rot[(idx - start) % N]
    return (allow + (at & (before < rest)).long()).to(torch.int32)


class TransferBudget:
    """The step budget of one engine, in blocks per sparse layer (a device scalar the graphs read).

    Args:
        setting: the config's ``transfer_budget`` (``"auto"``, bytes, a link fraction, ``None``).
        block_bytes: bytes of one (KV head, block) piece (K and V).
        num_layers: sparse layers (the bytes of a step are split evenly over them).
        device: where ``blocks`` lives.
    Attributes:
        blocks: 0-dim int64 device tensor, candidates one layer may admit per step
            (``UNLIMITED`` = -1 until a link rate and a step time are known, or with ``None``).
        link_bytes_per_s: measured host-to-device rate of the admission copies (``None`` until
            measured; CPU: never).
        step_s: the last step time the budget was sized for (seconds), or ``None``.
    """

    def __init__(self, setting, block_bytes: int, num_layers: int, device):
        self.setting, self.block_bytes, self.L = setting, int(block_bytes), max(1, int(num_layers))
        self.blocks = torch.full((), UNLIMITED, dtype=torch.int64, device=device)
        self._cuda = torch.device(device).type == "cuda"
        self.link_bytes_per_s: float | None = None
        self.step_s: float | None = None
        if isinstance(setting, int) and not isinstance(setting, bool):
            self._set_bytes(setting)

    @property
    def enabled(self) -> bool:
        """The step plans through the budget: ``transfer_budget`` is not ``None``, and a link
        fraction is only planned through on CUDA (elsewhere no link is measured, so it would
        stay unlimited: the candidates and shares would be computed for nothing every layer).
        Fixed by the configuration, so a captured CUDA graph holds the budget's kernels from
        the start and reads the device scalar ``blocks`` as it is resized."""
        return self.setting is not None and (self.fraction is None or self._cuda)

    @property
    def fraction(self) -> float | None:
        """The link fraction of an ``"auto"`` or fractional setting, else ``None``."""
        if self.setting == "auto":
            return AUTO_LINK_FRACTION
        return self.setting if isinstance(self.setting, float) else None

    @property
    def bytes_per_step(self) -> int | None:
        """Bytes the budget lets a step admit (all sparse layers), ``None`` when unlimited (reads
        the device scalar ``blocks``: a host sync on CUDA; ``bytes_for`` takes a copy of it)."""
        return self.bytes_for(int(self.blocks))

    def bytes_for(self, blocks: int) -> int | None:
        """Bytes a step may admit when ``blocks`` (a value of ``blocks``: per layer and step)
        is the budget; ``None`` when unlimited (``< 0``)."""
        return None if blocks < 0 else int(blocks) * self.L * self.block_bytes

    def _set_bytes(self, nbytes: float) -> None:
        blocks = nbytes / (self.L * self.block_bytes)
        self.blocks.fill_(int(min(max(blocks, 0.0), 2.0**62)) if math.isfinite(blocks) else 2**62)

    def set_link_rate(self, bytes_per_s: float | None) -> None:
        """The measured link rate (bytes/s; ``None``, not a positive finite number: unknown, the
        budget stays as it is)."""
        ok = isinstance(bytes_per_s, (int, float)) and not isinstance(bytes_per_s, bool) \
            and math.isfinite(bytes_per_s) and bytes_per_s > 0
        self.link_bytes_per_s = float(bytes_per_s) if ok else None

    def observe_step(self, step_s: float, copied_bytes: float | None = None) -> None:
        """Resize a link-fraction budget for a measured decode step (eq. 3 on the compute time).

        Args:
            step_s: the decode step time (seconds).
            copied_bytes: bytes the admissions copied per step over the same steps (``None``:
                not known, taken as 0).

        The step time contains whatever part of the copies the compute did not hide, so eq. 3
        is applied to ``step - copied / rate`` (the step as if every copy had been exposed;
        at least a quarter of the step): budget = fraction x rate x that. With a step of
        ``compute + a x copied / rate`` (``a`` the exposed share, 0..1) the budget settles at
        ``fraction x rate x compute / (1 + fraction x (1 - a))``, below what the link moves
        during the compute for every ``a``; sized on the whole step time instead it settled
        above it (``/ (1 - fraction x a)``; the 16K run of 2026-12-03 sat at the cap's traffic
        with 30% of the step exposed). Fixed budgets ignore this.
        """
        f, rate = self.fraction, self.link_bytes_per_s
        if f is None or rate is None or not (isinstance(step_s, (int, float)) and math.isfinite(step_s) and step_s > 0):
            return
        copied = copied_bytes if copied_bytes is not None and math.isfinite(copied_bytes) and copied_bytes > 0 else 0.0
        self.step_s = float(step_s)
        self._set_bytes(f * rate * max(self.step_s - copied / rate, 0.25 * self.step_s))
