"""The hot operations of OasisKV (seven, and the benchmarks' churn replay) behind one interface, with their torch references.

``TorchKVOps`` is the reference implementation (any device; the path used on CPU).
``oasis_sglang.kernels.TritonKVOps`` implements the same methods as Triton kernels (CUDA, or
the Triton interpreter on CPU) and is tested against this file. The engine
(``core.engine.OasisSparseKV``) only calls these methods, so the two are interchangeable.

Layouts (one sparse layer; paper: Methodology, tiered KV and head-wise mapping):
  host tier   ``host_k [H, P, bs, D]``, ``host_v [H, P, bs, Dv]`` (host memory, pinned on CUDA);
              piece ``(h, page)`` is row ``h * P + page`` of ``host_k.view(-1, bs * D)``
  compact     (``core.host_tier`` ``num_slots``) ``host_k [S, bs, D]``, ``host_v [S, bs, Dv]``:
              the pool, with ``slots [H * P]`` int32 (the layer's row of the slot table, on the
              kernel's device): piece ``(h, page)`` is pool row ``slots[h * P + page]``, none
              where ``-1``. The ops taking ``slots`` (``write_kv``, ``plan_transfer``,
              ``append_tokens``) drop a write to a piece without a slot and make no copy from
              one, and count each in ``dropped`` (int64, one element, on the kernel's device).
              The table's values must lie in ``-1 .. S - 1`` (``HostTier.assign`` keeps them
              there): the Triton kernels check it only with ``OASIS_KERNEL_CHECKS=1``, and
              ``plan_transfer`` (which does not know ``S``) leaves it to ``copy_blocks``' check of
              its ``src_idx``. ``slots=None``: the whole tier.
  summaries   ``kmin / kmax [P, H, D]`` (device), block ``p`` = SGLang page ``p``
  working set ``ws_k [R, H, K, bs, D]``, ``ws_v [R, H, K, bs, Dv]``, ``ids [R, H, K]`` int64
              (logical block held by slot ``(r, h, e)``, ``-1`` free)
``P`` pages, ``bs`` tokens per block, ``R`` request rows, ``K`` working-set blocks.
"""

from __future__ import annotations

import math

import torch

from .attention import decode_attention, gather_working_set
from .budget import share_budget
from .churn import replay_churn
from .selection import quest_scores, select_blocks
from .working_set import budget_candidates, plan_admissions


def block_pages(req_to_token: torch.Tensor, rows: torch.Tensor, nb: int, block_size: int) -> torch.Tensor:
    """``[B, nb]`` int64 page of each logical block ``j`` (the page of token ``j * bs``).

    Entries past a request's context are whatever ``req_to_token`` holds there (callers mask).
    """
    cols = (torch.arange(nb, device=req_to_token.device) * block_size).clamp(max=req_to_token.shape[1] - 1)
    return torch.div(req_to_token[rows.to(req_to_token.device).long()][:, cols], block_size,
                     rounding_mode="floor").long()


def check_slots(slots, dropped, H: int, P: int, what: str) -> None:
    """Assert the ``slots`` / ``dropped`` arguments of a compact host tier's op: ``slots [H * P]``
    int32 contiguous, ``dropped`` an int64 tensor of one element on the same device.

    Raises:
        AssertionError: naming ``what`` and the mismatch."""
    assert slots.dtype == torch.int32 and slots.shape == (H * P,) and slots.is_contiguous(), \
        f"{what}: slots must be a contiguous [H * P] = [{H * P}] int32 tensor, got {slots.dtype} {tuple(slots.shape)}"
    assert dropped is not None and dropped.dtype == torch.int64 and dropped.numel() == 1 \
        and dropped.device == slots.device, \
        f"{what}: slots need dropped, an int64 counter of one element on {slots.device}"


class BaseKVOps:
    """Interface of the OasisKV operations (see module docstring for layouts)."""

    name = "base"

    def write_kv(self, host_k, host_v, kmin, kmax, loc, k, v, block_size: int, one_token_each: bool = False,
                 write_host: bool = True, slots=None, dropped=None) -> None:
        """Write new tokens to the host tier and fold their keys into their blocks' summaries.

        Args:
            host_k / host_v: ``[H, P, bs, D/Dv]`` host tier of one layer, or with ``slots`` the
                compact pool ``[S, bs, D/Dv]`` (module docstring).
            kmin / kmax: ``[P, H, D]`` summaries of that layer (the model's dtype; with an fp8
                host tier the keys are folded in as the tier holds them, ``core.kv_dtype``).
            loc: ``[N]`` int64 token locations (page = ``loc // bs``, offset ``loc % bs``), in
                position order within each request (SGLang's ``out_cache_loc``).
            k: ``[N, H, D]``, v: ``[N, H, Dv]`` (cast to the tier dtype).
            one_token_each: every token is in a different block (a decode batch; a hint).
            write_host: ``False`` updates only the summaries (decode: the tokens go to the
                working set and reach the host tier as whole blocks, ``copy_blocks``).
            slots: ``[H * P]`` int32 on ``kmin``'s device, or ``None`` (the whole tier): token
                ``i`` of KV head ``h`` goes to pool row ``slots[h * P + loc[i] // bs]``; where that
                is ``-1`` it is written nowhere and ``dropped`` += 1 (per token and KV head).
            dropped: int64 device counter (one element), required with ``slots``.
        A token at block offset 0 starts its block's summary; any other token is folded into
        the block's current min/max, so after the block's last token the summary is exactly the
        block's coordinate-wise min/max (Quest Sec. 3), whatever the prefill/decode split.
        """
        raise NotImplementedError

    def select_topk(self, q, kmin, kmax, req_to_token, rows, seq_lens, block_size: int,
                    sink_blocks: int, recent_blocks: int, nb_max: int, k: int):
        """Quest scores of every block (GQA max) and the top-``k`` blocks per (query, KV head).

        Args:
            q: ``[B, Hq, D]`` one query row each (a request's normal and draft rows are two rows,
                each with its own ``rows`` / ``seq_lens`` entry).
            kmin / kmax: ``[P, H, D]``. req_to_token: SGLang's ``[R, max_len]`` int32 table.
            rows: ``[B]`` request rows. seq_lens: ``[B]`` context tokens of each query.
            nb_max: ``>= max(ceil(seq_lens / bs))`` blocks to consider.
        Returns:
            ``(wanted [B, H, k] int64, forced [B, H, k] bool)`` as ``core.selection.select_blocks``:
            sink and recent blocks first, then complete blocks by descending score, ties to the
            lower block id, ``-1`` padding.
        """
        raise NotImplementedError

    def copy_blocks(self, dst_k, dst_v, dst_idx, src_k, src_v, src_idx, counts=None) -> None:
        """``dst[dst_idx[i]] = src[src_idx[i]]`` for K and V pieces (one piece = one (KV head, block)).

        Args:
            dst_k / src_k: ``[Nd, bs*D]`` / ``[Ns, bs*D]`` views (``dst_v`` / ``src_v`` with ``Dv``);
                either side may be host memory (H2D gather into the working set, or D2H write-back).
            dst_idx / src_idx: ``[M]`` int64 piece indices. Entries with ``dst_idx < 0`` are
                skipped (fixed-size, sync-free admission lists); the others must be distinct.
            counts: optional ``[N]`` int32: the lists are ``N`` rows of ``M / N`` entries (as
                ``plan_transfer`` writes them) and only the first ``counts[n]`` entries of row
                ``n`` are read (the kernel then never scans the dead tail of a row).
        """
        raise NotImplementedError

    def budget_candidates(self, ids, rows, wanted, forced, fetch_cap, budget=None):
        """The admissions of one layer a step budget may refuse (``core.working_set.budget_candidates``).

        Args:
            ids: ``[R, H, K]`` int64 block table. rows: ``[B]``. wanted / forced: ``[B, H, K]``
                from ``select_topk``. fetch_cap: the per-head ceiling (``None``: K).
            budget: 0-dim int64 device tensor (``TransferBudget.blocks``) or ``None``; negative:
                none listed (all ``-1``), the match skipped.
        Returns:
            ``[B*H, C]`` int32, ``C = min(fetch_cap, K)``: the candidates' positions in each
            (request, KV head)'s top-K list, increasing, ``-1`` padded. No host sync.
        Paper: Methodology, eq. 3 (the step budget).
        """
        raise NotImplementedError

    def share_budget(self, cand_pos, budget, clock, k: int):
        """Each (request, KV head)'s share of one layer's step budget, by score rank
        (``core.budget.share_budget``: arguments, result, tie-break).

        Args:
            cand_pos: ``[N, C]`` int32 from ``budget_candidates``. budget / clock: 0-dim int64
                device tensors (candidates the layer may admit, ``< 0`` unlimited; the LRU clock).
            k: top-K list length.
        Returns:
            ``[N]`` int32 shares. No host sync.
        """
        raise NotImplementedError

    def replay_churn(self, wanted, forced, ids, rows, mean: float, seq, salt: int, nb_max: int):
        """Benchmarks only (``bench_oasis --churn``): the prediction rewritten to miss about
        ``mean`` resident blocks per (request, KV head) (``core.churn.replay_churn``: order,
        dither, clamps).

        Args:
            wanted, forced: ``[B, H, K]`` int64 / bool from ``select_topk``.
            ids: ``[R, H, K]`` int64 the layer's resident blocks per row; rows: ``[B]`` the batch's rows.
            mean: blocks per step and KV head; seq: ``[B]`` int64 context lengths (tokens) and
                ``salt`` (the layer) seed the dither; nb_max: every block id is below it.
        Returns:
            ``(wanted, forced)`` of the same shapes and dtypes. No host sync.
        """
        raise NotImplementedError

    def plan_transfer(self, ids, last_used, rows, wanted, forced, step, fetch_cap, seq, req_to_token,
                      block_size: int, num_pages: int, counters, skip_row: int | None = None, allow=None,
                      slots=None, dropped=None):
        """Stage (b) of the pipeline and the index work of stage (c), for one layer: capped
        eviction against the resident set, then the host-tier pieces to copy in.

        Args:
            ids, last_used: ``[R, H, K]`` int64 block table and LRU clock of the layer (updated
                in place; ``core.working_set.plan_admissions`` gives the rules).
            rows: ``[B]`` request rows. wanted / forced: ``[B, H, K]`` from ``select_topk``.
            step: LRU clock value, a 0-dim int64 device tensor (or an int).
            fetch_cap: evicting admissions per (request, KV head) and step; ``None``: unbounded.
            seq: ``[B]`` context of the step the admissions serve (incl. its new token): a block
                starting at ``seq - 1`` or later is admitted empty (no copy; its first token is
                the step's own).
            req_to_token: SGLang's ``[R, W]`` table (position -> token location).
            num_pages: ``P``, pages of the host tier (a host piece is ``h * P + page``).
            counters: ``[>=3]`` int64 device counters of the layer, incremented in place by
                (hits, copied blocks, evictions) of the rows other than ``skip_row``.
            skip_row: a CUDA-graph padding row: planned like any row, but it copies and counts nothing.
            allow: ``[B*H]`` int32, the step budget's share of each (request, KV head)'s
                ``budget_candidates`` (``core.budget.share_budget``); ``None``: the cap alone.
            slots: ``[H * P]`` int32 on the working set's device, or ``None`` (the whole tier):
                a copy's host piece is pool row ``slots[h * P + page]`` instead of ``h * P + page``.
                A copy whose piece has no slot (``-1``) is not listed (the block is admitted all
                the same, its slot's data stale) and ``dropped`` += 1; it is not counted as copied.
            dropped: int64 device counter (one element), required with ``slots``.
        Returns:
            ``(dst [B*H, K] int64, src [B*H, K] int64, counts [B*H] int32)``: row ``b * H + h``
            lists the working-set pieces ``(rows[b] * H + h) * K + slot`` to fill and their host
            pieces (or pool rows), live copies first in increasing slot order, then ``-1``; ``counts`` the live
            copies per row (``copy_blocks(..., counts=)`` reads these lists). No host sync.
        Paper: Methodology, Delta Selection and Capped Eviction.
        """
        raise NotImplementedError

    def append_tokens(self, ws_k, ws_v, ids, rows, pos, k, v, host_k, host_v, req_to_token, violations,
                      counters, skip_row: int | None = None, fold=None, slots=None, dropped=None) -> None:
        """Decode step 5 of one layer: each new token into its resident block's slot, and every
        block the token completes written back to the host tier (where the full KV cache lives).

        Args:
            ws_k / ws_v: ``[R, H, K, bs, D/Dv]`` working set of the layer; ids: ``[R, H, K]``.
            rows, pos: ``[B]`` request rows and token positions. k: ``[B, H, D]``; v: ``[B, H, Dv]``.
            host_k / host_v: ``[H, P, bs, D/Dv]`` host tier of the layer (pinned on CUDA), or
                with ``slots`` the compact pool ``[S, bs, D/Dv]``.
            req_to_token: ``[R, W]`` (the host page of the completed block: ``loc // bs``).
            violations: 0-dim int64 device counter, incremented by each (token, KV head) whose
                block is not resident: that token is written nowhere (an invariant violation;
                ``WorkingSet.check`` raises on it), and nothing is written back for it.
            counters: ``[4]`` int64: ``counters[3]`` += blocks written back.
            slots: ``[H * P]`` int32 on the working set's device, or ``None`` (the whole tier): a
                completed block of KV head ``h`` goes to pool row ``slots[h * P + page]``; where
                that is ``-1`` it is not written back (nor counted in ``counters[3]``) and
                ``dropped`` += ``bs`` (its tokens, as ``write_kv`` counts).
            dropped: int64 device counter (one element), required with ``slots``.
            skip_row: a CUDA-graph padding row: its tokens are written (to its own slots) but
                never counted or written back.
            fold: ``(kmin [P, H, D], kmax [P, H, D], loc [B], k [B, H, D])`` or ``None``: also fold
                each row's key into its block's summary, exactly as ``write_kv(host_k, host_v,
                kmin, kmax, loc, k, v, bs, one_token_each=True, write_host=False)`` (every row,
                the padding row's too), in the same launch (``OasisSparseKV.write_kv`` with
                ``decode=True`` defers its fold to here).
        No host sync; one D2H piece of ``bs * (D + Dv)`` elements per completed (request, KV head).
        """
        raise NotImplementedError

    def dense_plan(self, ids, last_used, rows, seq, block_size: int, pipelined: bool, clock_next, counters,
                   skip_row: int | None = None) -> None:
        """The dense path's working-set update of one decode step, for every sparse layer at once
        (``OasisSparseKV._dense_plan``: a step whose every request's next context fits the
        working set skips scoring, top-K, plans and copies).

        Args:
            ids, last_used: ``[L, R, H, K]`` int64 block tables and LRU clocks of all sparse
                layers (updated in place).
            rows: ``[B]`` request rows (distinct, except a CUDA-graph padding row repeated).
            seq: ``[B]`` int64 context tokens of this step, its new token included.
            pipelined: the predictor plans a step ahead (a hit is a resident block of the next
                context, ``< (seq + bs) // bs``); else (``current``) a hit is a resident block
                starting before this step's token (``ids * bs < seq - 1``).
            clock_next: 0-dim int64 device tensor, the next step's LRU clock.
            counters: ``[L, >=1]`` int64: ``counters[:, 0]`` += hits of rows other than ``skip_row``.
            skip_row: a CUDA-graph padding row: updated like any row but counts no hits.
        Effect: the blocks of positions ``seq - 1`` and ``seq`` (this step's token and the next
        one's), where not resident, each take the first free slot (lowest index, if any); every
        resident block below ``(seq + bs) // bs`` gets ``last_used = clock_next``. As
        ``plan_admissions`` with a top-K that is every block: nothing is copied (a new block
        has no token before the appended one). No host sync.
        """
        raise NotImplementedError

    def sparse_decode_attention(self, q, ws_k, ws_v, ids, rows, seq_lens, scale: float | None,
                                k_extra=None, v_extra=None, return_lse: bool = False):
        """Attention of one or two query rows per request over its head-wise working set.

        Args:
            q: ``[B, NQ, Hq, D]``, ``NQ`` in {1, 2} (normal row, then the draft row).
            ws_k / ws_v / ids: the working set of one layer (module docstring).
            rows: ``[B]`` request rows. seq_lens: ``[B]`` tokens in context, including the
                normal row's own token (already written into its resident block).
            scale: softmax scale (``None``: ``1/sqrt(D)``).
            k_extra / v_extra: ``[B, H, D/Dv]`` the draft token's own K/V, seen by row 1 only.
        Returns:
            ``(o [B, NQ, Hq, Dv] in q's dtype, lse [B, NQ, Hq] float32 natural-log sum of
            exp(scaled scores), or None)``.
        Every resident token ``pos = ids * bs + t < seq_len`` is attended; free slots and
        positions past the context are not. A row that sees no token gets zeros (LSE ``-inf``).
        """
        raise NotImplementedError

    def paged_attention(self, q, k_buf, v_buf, req_to_token, rows, kv_lens, scale: float | None,
                        max_kv_len: int | None = None):
        """Causal attention of ``NQ`` consecutive new tokens per request over its whole KV cache in
        SGLang's token-major pool: the paired forward's dense and draft layers.

        Args:
            q: ``[B, NQ, Hq, D]`` queries of the ``NQ`` new tokens (positions ``kv_lens - NQ ..
                kv_lens - 1``; their K/V are already in the pool).
            k_buf: ``[N, H, D]``, v_buf: ``[N, H, Dv]`` one layer of SGLang's ``MHATokenToKVPool``.
            req_to_token: ``[R, max_len]`` int32 (SGLang's request table: position -> token slot).
            rows: ``[B]`` request rows. kv_lens: ``[B]`` tokens seen by the last row (row ``i``
                sees the first ``kv_lens - (NQ - 1 - i)``; each must be ``>= 1``).
            scale: softmax scale (``None``: ``1/sqrt(D)``).
            max_kv_len: ``>= max(kv_lens)`` when known on the host (sizes the kernel grid without a
                device read); ignored by the reference.
        Returns:
            ``o [B, NQ, Hq, Dv]`` in q's dtype.
        Raises (reference): ``IndexError`` for a row or length out of the table, ``ValueError``
        for ``kv_lens < NQ``.
        Same result as SGLang's verify / draft-extend pass (``triton_backend.forward_extend``
        with a causal chain, topk 1) over the same pool.
        """
        raise NotImplementedError


class TorchKVOps(BaseKVOps):
    """Reference implementations (torch; bitwise equal to SGLang's torch_native on full working sets)."""

    name = "torch"

    def write_kv(self, host_k, host_v, kmin, kmax, loc, k, v, block_size, one_token_each=False, write_host=True,
                 slots=None, dropped=None):
        """Reference: host-tier scatter by location, then ``scatter_reduce`` amin/amax into the summaries."""
        if slots is None:
            H, P, bs, D = host_k.shape
        else:
            (P, H, _), (_, bs, D) = kmin.shape, host_k.shape
            check_slots(slots, dropped, H, P, "write_kv")
        assert bs == block_size and k.shape[1:] == (H, D) and v.shape[0] == k.shape[0] == loc.numel(), \
            f"write_kv: host [H, P, bs, D] = {tuple(host_k.shape)} (block_size {block_size}), loc {tuple(loc.shape)}, " \
            f"k {tuple(k.shape)}, v {tuple(v.shape)}: want loc [N], k [N, {H}, {D}], v [N, {H}, Dv]"
        if write_host and slots is not None:
            loc_s = loc.to(slots.device, torch.int64)
            sl = slots.long()[torch.arange(H, device=slots.device)[None, :] * P + (loc_s // bs)[:, None]]   # [N, H]
            dropped += (sl < 0).sum()
            sl = sl.to(host_k.device)
            have = sl >= 0
            off = (loc.to(host_k.device, torch.int64) % bs)[:, None].expand_as(sl)
            host_k[sl[have], off[have]] = k.to(host_k.device, host_k.dtype)[have]
            host_v[sl[have], off[have]] = v.to(host_v.device, host_v.dtype)[have]
        elif write_host:
            loc_h = loc.to(host_k.device, torch.int64)
            page, off = loc_h // bs, loc_h % bs
            host_k[:, page, off] = k.to(host_k.device, host_k.dtype).transpose(0, 1)
            host_v[:, page, off] = v.to(host_v.device, host_v.dtype).transpose(0, 1)
        # the keys as the host tier holds them (fp8: rounded), exact in the summaries' dtype
        kd = k.to(kmin.device).to(host_k.dtype).to(kmin.dtype)
        page_d = torch.div(loc.to(kmin.device, torch.int64), bs, rounding_mode="floor")
        first = (loc.to(kmin.device, torch.int64) % bs) == 0
        kmin[page_d[first]] = kd[first]
        kmax[page_d[first]] = kd[first]
        idx = page_d[:, None, None].expand_as(kd)
        kmin.scatter_reduce_(0, idx, kd, "amin", include_self=True)
        kmax.scatter_reduce_(0, idx, kd, "amax", include_self=True)

    def select_topk(self, q, kmin, kmax, req_to_token, rows, seq_lens, block_size, sink_blocks,
                    recent_blocks, nb_max, k):
        """Reference: ``quest_scores`` over the gathered summaries, then ``select_blocks`` (stable sort)."""
        seq = seq_lens.to(kmin.device, torch.int64)
        pages = block_pages(req_to_token, rows, nb_max, block_size).to(kmin.device)
        scores = quest_scores(q, kmin[pages], kmax[pages])
        return select_blocks(scores, (seq + block_size - 1) // block_size, seq // block_size, k,
                             sink_blocks, recent_blocks)

    def copy_blocks(self, dst_k, dst_v, dst_idx, src_k, src_v, src_idx, counts=None):
        """Reference: indexed copy of the live pieces (boolean mask: syncs; the kernel does not)."""
        live = dst_idx >= 0
        if counts is not None:
            n = counts.numel()
            col = torch.arange(dst_idx.numel() // max(n, 1), device=dst_idx.device)
            live = live & (col[None, :] < counts.to(dst_idx.device).long()[:, None]).reshape(-1)
        dst_idx, src_idx = dst_idx[live], src_idx[live]
        if dst_idx.numel() == 0:
            return
        si = src_idx.to(src_k.device, torch.int64)
        di = dst_idx.to(dst_k.device, torch.int64)
        dst_k[di] = src_k[si].to(dst_k.device, dst_k.dtype)
        dst_v[di] = src_v[si].to(dst_v.device, dst_v.dtype)

    def budget_candidates(self, ids, rows, wanted, forced, fetch_cap, budget=None):
        """Reference: ``core.working_set.budget_candidates``."""
        return budget_candidates(ids, rows, wanted, forced, fetch_cap, budget)

    def share_budget(self, cand_pos, budget, clock, k):
        """Reference: ``core.budget.share_budget``."""
        return share_budget(cand_pos, budget, clock, k)

    def replay_churn(self, wanted, forced, ids, rows, mean, seq, salt, nb_max):
        """Reference: ``core.churn.replay_churn`` (about 25 kernels; bitmap membership)."""
        return replay_churn(wanted, forced, ids[rows], mean, seq, salt=salt, nb_max=nb_max)

    def plan_transfer(self, ids, last_used, rows, wanted, forced, step, fetch_cap, seq, req_to_token,
                      block_size, num_pages, counters, skip_row=None, allow=None, slots=None, dropped=None):
        """Reference: ``core.working_set.plan_admissions`` (sorts and a ``[B, H, K, K]`` match),
        then the pieces of the copied admissions gathered through ``req_to_token``."""
        counted = None if skip_row is None else rows != skip_row
        adm = plan_admissions(ids, last_used, rows, wanted, forced, step, fetch_cap, counted, allow)
        B, H, K = wanted.shape
        bs, W = block_size, req_to_token.shape[1]
        h = torch.arange(H, device=ids.device)[None, :, None]
        r = rows[:, None, None]
        blk = adm.block.clamp(min=0)
        live = adm.mask & (blk * bs < (seq - 1)[:, None, None])
        if counted is not None:
            live = live & counted[:, None, None]
        page = torch.div(req_to_token[r, (blk * bs).clamp(max=W - 1)].long(), bs, rounding_mode="floor")
        piece = h * num_pages + page
        if slots is not None:
            check_slots(slots, dropped, H, num_pages, "plan_transfer")
            piece = slots.long()[piece.clamp(0, slots.numel() - 1)]     # its pool row (a dead entry's: unused)
            dropped += (live & (piece < 0)).sum()
            live = live & (piece >= 0)
        slot = torch.where(live, adm.entry, K)                          # dead admissions to a spare column
        by_slot = lambda x: torch.full((B, H, K + 1), -1, dtype=torch.int64, device=ids.device).scatter_(  # noqa: E731
            -1, slot, x.expand(B, H, K))[..., :K]
        dst_s, src_s = by_slot((r * H + h) * K + adm.entry), by_slot(piece)
        first = torch.sort((dst_s < 0).to(torch.int8), dim=-1, stable=True).indices   # live first, slot order
        counters[:3] += torch.stack([adm.hits, live.sum(), adm.evicted])
        return (torch.gather(dst_s, -1, first).view(B * H, K), torch.gather(src_s, -1, first).view(B * H, K),
                (dst_s >= 0).sum(-1).view(B * H).to(torch.int32))

    def append_tokens(self, ws_k, ws_v, ids, rows, pos, k, v, host_k, host_v, req_to_token, violations,
                      counters, skip_row=None, fold=None, slots=None, dropped=None):
        """Reference: ``write_kv``'s summary fold (with ``fold``), then find the slot by a
        ``[B, H, K]`` match, masked scatter, then ``copy_blocks`` D2H."""
        R, H, K, bs, D = ws_k.shape
        if fold is not None:
            kmin, kmax, floc, fk = fold
            self.write_kv(host_k, host_v, kmin, kmax, floc, fk, v, bs, one_token_each=True, write_host=False,
                          slots=slots, dropped=dropped)
        if slots is not None:
            P = slots.numel() // H
            check_slots(slots, dropped, H, P, "append_tokens")
        else:
            P = host_k.shape[1]
        blk = (pos // bs)[:, None, None]
        hit = ids[rows] == blk                                          # [B, H, K]
        ok = hit.any(-1)                                                # [B, H]; False breaks the invariant
        real = torch.ones_like(rows, dtype=torch.bool) if skip_row is None else rows != skip_row
        violations += (~ok & real[:, None]).sum()                       # checked on the host later: no sync
        e = hit.long().argmax(-1)                                       # [B, H]
        off = (pos % bs)[:, None].expand_as(e)
        r = rows[:, None].expand_as(e)
        h = torch.arange(H, device=e.device)[None, :].expand_as(e)
        ws_k[r, h, e, off] = torch.where(ok[..., None], k.to(ws_k.dtype), ws_k[r, h, e, off])   # never a wrong slot
        ws_v[r, h, e, off] = torch.where(ok[..., None], v.to(ws_v.dtype), ws_v[r, h, e, off])
        done = ok & ((pos % bs) == bs - 1)[:, None] & real[:, None]     # [B, H] blocks completed
        page = torch.div(req_to_token[rows, pos].long(), bs, rounding_mode="floor")
        src = ((r * H + h) * K + e).reshape(-1)
        piece = h * P + page[:, None]
        if slots is not None:
            piece = slots.long()[piece.clamp(0, slots.numel() - 1)]     # its pool row
            dropped += (done & (piece < 0)).sum() * bs
            done = done & (piece >= 0)
        dst = torch.where(done, piece, -1).reshape(-1)
        self.copy_blocks(host_k.view(-1, bs * D), host_v.view(-1, bs * ws_v.shape[-1]), dst,
                         ws_k.view(-1, bs * D), ws_v.view(-1, bs * ws_v.shape[-1]), src)
        counters[3] += done.sum()

    def dense_plan(self, ids, last_used, rows, seq, block_size, pipelined, clock_next, counters, skip_row=None):
        """Reference: ``[L, B, H, K]`` masks, a first-free-slot ``argmax`` and ``scatter_`` per new
        block (about 25 launches)."""
        bs = block_size
        held = ids[:, rows]                                                   # [L, B, H, K]
        nb_next = ((seq + bs) // bs)[None, :, None, None]                     # blocks of seq + 1 tokens
        if pipelined:
            hit = (held >= 0) & (held < nb_next)
        else:
            hit = (held >= 0) & (held * bs < (seq - 1)[None, :, None, None])
        if skip_row is not None:
            hit &= (rows != skip_row)[None, :, None, None]
        counters[:, 0] += hit.sum((1, 2, 3))
        for j in ((seq - 1) // bs, seq // bs):
            jj = j[None, :, None, None]
            need = ~(held == jj).any(-1, keepdim=True) & (held < 0).any(-1, keepdim=True)
            e = (held < 0).to(torch.int8).argmax(-1, keepdim=True)          # first free slot
            held.scatter_(-1, e, torch.where(need, jj.expand_as(e), held.gather(-1, e)))
        ids[:, rows] = held
        last_used[:, rows] = torch.where((held >= 0) & (held < nb_next), clock_next, last_used[:, rows])

    def sparse_decode_attention(self, q, ws_k, ws_v, ids, rows, seq_lens, scale, k_extra=None,
                                v_extra=None, return_lse=False):
        """Reference: per request, ``gather_working_set`` + SDPA (bitwise SGLang torch_native); LSE by ``logsumexp``."""
        B, NQ, Hq, D = q.shape
        bs, H = ws_k.shape[3], ws_k.shape[1]
        assert NQ in (1, 2) and Hq % H == 0, f"q must be [B, 1 or 2, Hq, D] with Hq a multiple of H={H}, got {tuple(q.shape)}"
        assert rows.shape == seq_lens.shape == (B,), f"rows {tuple(rows.shape)} and seq_lens {tuple(seq_lens.shape)} must be [{B}]"
        assert (k_extra is None) == (v_extra is None), "k_extra and v_extra go together"
        if k_extra is not None:
            assert NQ == 2, "k_extra / v_extra (the draft token's K/V) need NQ == 2 query rows"
            assert k_extra.shape[:2] == v_extra.shape[:2] == (B, H), (k_extra.shape, v_extra.shape)
        o = q.new_empty((B, NQ, Hq, ws_v.shape[-1]))
        lse = torch.empty((B, NQ, Hq), dtype=torch.float32, device=q.device) if return_lse else None
        sc = scale if scale is not None else 1.0 / math.sqrt(D)
        rows_c, seq_c = rows.tolist(), seq_lens.tolist()
        for b in range(B):
            r = rows_c[b]
            kw, vw = gather_working_set(ws_k[r], ws_v[r], ids[r], int(seq_c[b]), bs)
            for i in range(NQ):
                kk, vv = kw, vw
                if i == 1 and k_extra is not None:
                    kk = torch.cat([kw, k_extra[b:b + 1].to(kw.dtype)])
                    vv = torch.cat([vw, v_extra[b:b + 1].to(vw.dtype)])
                if kk.shape[0] == 0:         # nothing resident (only a CUDA-graph padding row): zeros, as the kernel
                    o[b, i] = 0
                    if return_lse:
                        lse[b, i] = float("-inf")
                    continue
                o[b, i] = decode_attention(q[b, i], kk, vv, scale)
                if return_lse:
                    G = Hq // kk.shape[1]
                    s = torch.einsum("hgd,nhd->hgn", q[b, i].float().view(-1, G, D), kk.float()) * sc
                    lse[b, i] = torch.logsumexp(s, -1).reshape(Hq)
        return o, lse

    def paged_attention(self, q, k_buf, v_buf, req_to_token, rows, kv_lens, scale, max_kv_len=None):
        """Reference: per request and row, gather the row's visible tokens through ``req_to_token`` + SDPA."""
        B, NQ, Hq, D = q.shape
        assert NQ in (1, 2) and Hq % k_buf.shape[1] == 0, \
            f"q must be [B, 1 or 2, Hq, D] with Hq a multiple of H={k_buf.shape[1]}, got {tuple(q.shape)}"
        assert rows.shape == kv_lens.shape == (B,), f"rows {tuple(rows.shape)} and kv_lens {tuple(kv_lens.shape)} must be [{B}]"
        o = q.new_empty((B, NQ, Hq, v_buf.shape[-1]))
        rows_c, kv_c = rows.tolist(), kv_lens.tolist()
        R, width = req_to_token.shape
        for b in range(B):
            if not 0 <= int(rows_c[b]) < R:
                raise IndexError(f"paged_attention: rows[{b}] = {rows_c[b]} is not in [0, {R})")
            if int(kv_c[b]) > width:
                raise IndexError(f"paged_attention: kv_lens[{b}] = {kv_c[b]} exceeds req_to_token's width {width}")
            for i in range(NQ):
                n = int(kv_c[b]) - (NQ - 1 - i)
                if n < 1:
                    raise ValueError(f"paged_attention: request {b} row {i} sees {n} tokens (kv_lens must be >= NQ)")
                loc = req_to_token[int(rows_c[b]), :n].to(k_buf.device, torch.int64)
                o[b, i] = decode_attention(q[b, i], k_buf[loc], v_buf[loc], scale)
        return o
