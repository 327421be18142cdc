"""Admission of a prefilled request on a decode node with partial KV (paper: PD integration).

What crosses the network for one request (``AdmissionPacket``), besides SGLang's own transfer
of the dense layers' KV (``dense_layers``) and of the request's metadata:

- the min/max key summaries of its blocks, every sparse layer and KV head (``2 / bs`` of its
  keys; sent in ``summary_dtype``, bf16 by default, rounded outward, min down and max up, so the
  Quest bound computed from them still bounds every key of the block);
- the first decode step's working set: per (sparse layer, KV head) the blocks the prefill node
  selected with the last prompt token's query (``OasisSparseKV.extend_attention`` plans them),
  sink and recent blocks included, with their K/V.

Every other block stays in the prefill node's host tier (the staging pool) and is read on
demand (``core/remote.py``, ``disagg/transport.py``). ``full_transfer_bytes`` is what SGLang's
PD mode would send instead: every layer's KV of every prompt token.

No SGLang import: the functions take the engines (``core.OasisSparseKV``) and SGLang's page ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core import OasisSparseKV
from ..core.remote import RemoteBlocks


@dataclass(frozen=True)
class AdmissionPacket:
    """One request's partial KV for a decode node (CPU tensors).

    Fields:
        prompt_len: tokens of the prompt (its KV is complete on the prefill node).
        src_pages: ``[N]`` int64, the request's host pages on the prefill node, block by block.
        kmin, kmax: ``[L, N, H, D]`` summaries of those blocks (``L`` sparse layers), in
            ``summary_dtype`` (outward rounded).
        ids: ``[L, H, K]`` int64 the first decode step's working set: block numbers
            (position // bs) per (sparse layer, KV head, slot), ``-1`` empty (a block at or past
            ``N`` is the next token's, admitted empty).
        k, v: ``[L, H, K, bs, D]`` / ``[..., Dv]`` the slots' K/V (the KV cache dtype).
    """

    prompt_len: int
    src_pages: torch.Tensor
    kmin: torch.Tensor
    kmax: torch.Tensor
    ids: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Bytes of the packet's tensors (what crosses the network for the sparse layers)."""
        return sum(t.numel() * t.element_size() for t in (self.src_pages, self.kmin, self.kmax, self.ids,
                                                          self.k, self.v))


def round_outward(kmin: torch.Tensor, kmax: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``kmin`` rounded down and ``kmax`` rounded up to ``dtype`` (a float dtype no wider than
    theirs): ``lo <= kmin`` and ``hi >= kmax`` elementwise, exactly representable in ``dtype``."""
    lo, hi = kmin.to(dtype), kmax.to(dtype)
    lo = torch.where(lo.to(kmin.dtype) > kmin, torch.nextafter(lo, torch.full_like(lo, float("-inf"))), lo)
    hi = torch.where(hi.to(kmax.dtype) < kmax, torch.nextafter(hi, torch.full_like(hi, float("inf"))), hi)
    return lo, hi


def request_pages(req_to_token_row: torch.Tensor, n_tokens: int, block_size: int) -> torch.Tensor:
    """``[ceil(n / bs)]`` int64 host pages of a request's first ``n_tokens`` positions (SGLang's
    ``req_to_token`` row; ``--page-size`` = ``block_size``, so a page holds one block)."""
    nb = -(-n_tokens // block_size)
    return torch.div(req_to_token_row[:nb * block_size:block_size].to("cpu", torch.int64), block_size,
                     rounding_mode="floor")


def build_admission(eng: OasisSparseKV, row: int, req_to_token_row: torch.Tensor, prompt_len: int,
                    summary_dtype: torch.dtype | None = torch.bfloat16) -> AdmissionPacket:
    """The packet of request row ``row`` on a prefill node, after its prefill
    (``extend_attention`` with an asynchronous predictor planned its first decode step's working
    set into ``eng.ws``).

    Args:
        summary_dtype: the summaries' dtype on the wire (``None``: the engine's own).
    Raises:
        ValueError: a bad row or prompt length, or no working set planned for the row (the
            ``current`` predictor plans none: PD needs ``previous`` or ``lookahead``).
    """
    if not 0 <= row < eng.ws.R or not 0 < prompt_len <= req_to_token_row.numel():
        raise ValueError(f"build_admission: row {row} (0..{eng.ws.R - 1}) / prompt_len {prompt_len} out of range")
    eng.pipe.drain()          # the prefetch streams may still write the working set
    pages = request_pages(req_to_token_row, prompt_len, eng.bs)
    ids = eng.ws.ids[:, row].to("cpu").clone()                         # [L, H, K]
    if not eng.predictor.asynchronous or not bool((ids >= 0).any()):
        raise ValueError(f"build_admission: row {row} has no planned working set (predictor "
                         f"{eng.predictor.name!r}; PD admission needs 'previous' or 'lookahead')")
    L = len(eng.sparse_layers)
    pd = pages.to(eng.device)
    kmin = torch.stack([eng.summaries.kmin[li][pd].cpu() for li in range(L)])
    kmax = torch.stack([eng.summaries.kmax[li][pd].cpu() for li in range(L)])
    if summary_dtype is not None and summary_dtype != kmin.dtype:
        kmin, kmax = round_outward(kmin, kmax, summary_dtype)
    k = torch.stack([eng.ws.k[li][row].cpu() for li in range(L)])
    v = torch.stack([eng.ws.v[li][row].cpu() for li in range(L)])
    return AdmissionPacket(prompt_len, pages, kmin, kmax, ids, k, v)


def apply_admission(eng: OasisSparseKV, remote: RemoteBlocks, packet: AdmissionPacket, peer: str, row: int,
                    req_to_token_row: torch.Tensor) -> None:
    """Install ``packet`` for request row ``row`` on a decode node whose SGLang allocator gave the
    request the slots of ``req_to_token_row``: summaries into this node's summaries, the first
    step's working set into row ``row`` (``OasisSparseKV.install_working_set``) and its blocks into
    this node's host tier; every other piece is recorded as ``peer``'s (read on demand).

    Raises:
        ValueError: the packet does not fit this engine (layers, KV heads, block size, pages),
            before anything changes.
    """
    pages = request_pages(req_to_token_row, packet.prompt_len, eng.bs)
    L, H, N = len(eng.sparse_layers), eng.head_num, pages.numel()
    if N != packet.src_pages.numel() or tuple(packet.kmin.shape) != (L, N, H, eng.head_dim) \
            or tuple(packet.ids.shape) != (L, H, eng.ws.K) or packet.k.shape[-2] != eng.bs:
        raise ValueError(f"apply_admission: packet with summaries {tuple(packet.kmin.shape)}, ids "
                         f"{tuple(packet.ids.shape)}, block size {packet.k.shape[-2]}; this node has {L} sparse "
                         f"layers, {H} KV heads, {eng.ws.K} slots, block size {eng.bs}, {N} pages for the request")
    eng.install_working_set(row, packet.ids, packet.k, packet.v, packet.prompt_len + 1)
    dev = eng.device
    present = torch.zeros((L, H, N), dtype=torch.bool)
    for li in range(L):
        eng.summaries.kmin[li][pages.to(dev)] = packet.kmin[li].to(dev, eng.summaries.kmin[li].dtype)
        eng.summaries.kmax[li][pages.to(dev)] = packet.kmax[li].to(dev, eng.summaries.kmax[li].dtype)
        hh, kk = torch.nonzero((packet.ids[li] >= 0) & (packet.ids[li] < N), as_tuple=True)
        b = packet.ids[li][hh, kk]
        eng.host.k[li][hh, pages[b]] = packet.k[li][hh, kk].to(eng.host.dtype)
        eng.host.v[li][hh, pages[b]] = packet.v[li][hh, kk].to(eng.host.dtype)
        present[li, hh, b] = True
    remote.admit(pages, peer, packet.src_pages, present)


TAG_COLS = 4      # int16 columns after the slots: the request's bootstrap room (64 bits)


def first_step_width(num_sparse_layers: int, head_num: int) -> int:
    """Columns of the ``pd_first_step`` region (``sglang_glue/pool.py``): one int16 slot + 1
    per (sparse layer, KV head), then the room tag (:data:`TAG_COLS`)."""
    return num_sparse_layers * head_num + TAG_COLS


def room_tag(room: int) -> torch.Tensor:
    """``[TAG_COLS]`` int16: a bootstrap room's 64 bits (the row's owner in ``pd_first_step``)."""
    r = int(room) & ((1 << 64) - 1)
    return torch.tensor([r - (1 << 64) if r >= 1 << 63 else r], dtype=torch.int64).view(torch.int16)


def first_step_mask(eng: OasisSparseKV, row: int, req_to_token_row: torch.Tensor, prompt_len: int,
                    room: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The first decode step's working set that prefill planned for request row ``row``, as one
    mask row per prompt block: what SGLang's page-by-page transfer carries to the decode node
    (``sglang_glue/pool.py``, region ``pd_first_step``; paper: PD admission sends the first
    step's working set, selected on the prefill node with the last prompt token's query).

    Returns:
        ``(pages [N] int64, mask [N, L * H + TAG_COLS] int16)``: the request's host pages (block
        by block) and, per block, at column ``li * H + h`` the working-set slot + 1 that holds
        the block in sparse layer ``li``, KV head ``h`` (0: not held), then ``room_tag(room)``:
        a page shared with another request (a cached prefix) carries the plan of the request
        sent last, and the tag tells the decode node whose it is. The slots are all zero when
        the engine planned nothing (predictor ``current``, or a benchmark without prefetch):
        the decode node then selects the first step itself. The next token's block
        (``prompt_len // bs == N``) is not a prompt block and is not in the mask
        (``plan_from_mask`` puts it back).
    Raises:
        ValueError: a bad row or prompt length, or more than 32767 working-set slots.
    """
    if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < eng.ws.R \
            or not 0 < prompt_len <= req_to_token_row.numel():
        raise ValueError(f"first_step_mask: row {row!r} (0..{eng.ws.R - 1}) / prompt_len {prompt_len!r} out of range")
    if eng.ws.K > torch.iinfo(torch.int16).max:
        raise ValueError(f"first_step_mask: {eng.ws.K} working-set slots do not fit the int16 mask")
    pages = request_pages(req_to_token_row, prompt_len, eng.bs)
    L, H, N = len(eng.sparse_layers), eng.head_num, pages.numel()
    mask = torch.zeros((N, first_step_width(L, H)), dtype=torch.int16)
    mask[:, L * H:] = room_tag(room)
    if not eng.predictor.asynchronous or eng.bench.skip_prefetch:
        return pages, mask
    ids = eng.planned_working_set(row)                                   # [L, H, K]
    li, h, k = torch.nonzero((ids >= 0) & (ids < N), as_tuple=True)
    mask[ids[li, h, k], li * H + h] = (k + 1).to(torch.int16)
    return pages, mask


def plan_from_mask(mask: torch.Tensor, prompt_len: int, block_size: int, num_slots: int) -> torch.Tensor | None:
    """The decode node's side of :func:`first_step_mask`: the first step's working set ids.

    Args:
        mask: ``[L, H, N]`` integer, the received slots of the request's ``N`` prompt blocks
            (slot + 1 per block, 0: not held; the tag columns already checked and dropped).
        prompt_len: prompt tokens (the first step's context is ``prompt_len + 1``).
        block_size: tokens per block. num_slots: ``K``, working-set slots per (layer, KV head).
    Returns:
        ``[L, H, K]`` int64 block numbers by slot, ``-1`` empty: the prefill node's slots (in
        their order, packed into the first slots when some lie past this node's ``K``), and
        when the new token opens a block of its own (``prompt_len % block_size == 0``) that
        block in the first slot left free (where the prefill node's plan put it when the row
        was empty, as it is for a prompt prefilled in one chunk). ``None`` when the mask is no
        plan: a slot value out of range or held twice, more blocks than ``K``, or a (layer,
        KV head) without a prompt block (prefill planned nothing) or without the block the
        first step's new token goes into (the step writes the
        token's K/V into that block's slot, so it must be resident). The caller then lets the
        first step select for itself.
    """
    L, H, N = mask.shape
    nxt = prompt_len // block_size
    m = mask.to(torch.int64)
    held = m > 0
    need_next = nxt >= N                                     # the new token opens a block of its own
    if N == 0 or bool((m < 0).any()) or not bool(held.any(-1).all()) \
            or int(held.sum(-1).max()) + int(need_next) > num_slots:
        return None
    srt = torch.where(held, m, 0).sort(-1).values
    if bool(((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] > 0)).any()):     # a slot held twice
        return None
    if int(m.max()) > num_slots:                             # a larger budget there: pack in slot order
        order = torch.sort(torch.where(held, m, torch.iinfo(torch.int64).max), dim=-1, stable=True)
        rank = torch.empty_like(order.indices).scatter_(-1, order.indices, torch.arange(N).expand(L, H, N))
        m = torch.where(held, rank + 1, 0)
    ids = torch.full((L, H, num_slots + 1), -1, dtype=torch.int64)
    blocks = torch.arange(N, dtype=torch.int64).expand(L, H, N)
    ids.scatter_(-1, torch.where(held, m - 1, num_slots), torch.where(held, blocks, -1))
    ids = ids[..., :num_slots]
    if need_next:
        free = ids < 0
        ids.scatter_(-1, free.to(torch.int8).argmax(-1, keepdim=True), nxt)
    if not bool((ids == nxt).any(-1).all()):
        return None
    return ids


def full_transfer_bytes(prompt_len: int, num_layers: int, head_num: int, head_dim: int, v_head_dim: int,
                        elem_bytes: int) -> int:
    """Bytes SGLang's PD mode sends for a prompt: K and V of every layer and prompt token."""
    return prompt_len * num_layers * head_num * (head_dim + v_head_dim) * elem_bytes
