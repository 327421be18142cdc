"""Decode node of a PD deployment: which host-tier pieces are here, and where the others are.

Paper: PD integration, remote partial fetching. A request admitted from a prefill node brings
only part of its KV cache (in serving its dense layers' KV, key summaries and the slots of the
first step's working set the prefill node planned, whose blocks ``read_now`` reads at admission;
``disagg/``). The rest of its
blocks stay in the prefill node's host tier (the *staging pool*) and are read on demand: before
the transfer stage copies admitted blocks host -> device (``core/stages.py``), ``ensure_local``
reads the pieces that are not here yet from their peer (one read per (sparse layer, peer),
holding every request's pieces) into the same place of this node's host tier, where they stay
(the host tier is the decode node's cache of fetched blocks).

When a read is made (``OasisConfig.pd_read_mode``):

- ``deferred`` (default) for a predicted step planned by the pipeline: the plan leaves out each
  wanted block not here yet (``filter_planned``: the working set keeps what it had for that
  step) and counts it on the device; ``service``, at the next step's start, starts the reads of
  every such piece of every layer and request (``post``: one read per peer holding every layer's
  pieces) and returns; a later ``service`` sees them ended and marks the pieces present, so the
  next plan can admit them. No host read inside a step (a CUDA graph captures it) and no wait
  for the network: a block arrives two or more steps after the plan that first wanted it (on
  CUDA three or more: the counts are read one step late, ``_left_out``). Blocks a step
  starts empty (its new token is their first) are never left out.
- ``wait``, and a synchronous step (a request's first step after admission without a plan from
  the prefill node selects with its own query): ``ensure_local`` in the transfer stage reads the plan's missing pieces before
  copying them (a host read of the plan per layer; outputs equal colocated decoding).

A read that fails (its deadline is the fetcher's) marks its peer lost; its pieces are skipped
from then on (the working set keeps what it had), and the requests on its pages are reported by
``failed_pages`` so the serving glue ends them with an error while the batch's other requests
go on.

A compact host tier (``HostTier(num_slots=S)``, ``OasisSparseKV(host_slots=S)``; the engine's
``attach_remote`` calls ``use_slots``): before a read of pieces into this node (``read_now``,
``ensure_local``, ``service``'s reads) each piece takes a pool row (``assign``), and the read lands
there (the fetcher's destinations are pool rows). When the pool is full, the pieces that do not
fit are not read this time: they stay missing, exactly as a piece not arrived yet (the working
set keeps what it had; a later plan may ask again), counted in ``slot_misses`` with a warning at
most every ``WARN_S`` seconds. ``release`` gives the pages' slots back (``unassign``) once the
reads into them ended.

Torch only (the reads are done by a callable; ``disagg.transport.RemoteBlockFetcher.fetch`` in
serving).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from .devcopy import to_device
from .host_tier import EveryFewSeconds, HostTierFull

logger = logging.getLogger(__name__)

# fetch(peer, layer, heads [N], src_pages [N], dst_pages [N]) -> bytes read; raises on a lost peer
FetchFn = Callable[[str, int, torch.Tensor, torch.Tensor, torch.Tensor], int]
# post(peer, layers [N] (or one layer), heads [N], src_pages [N], dst_pages [N]) -> a pending read (or None:
# nothing to read), without waiting; a read with an ``ended`` event (threading.Event) is waited for through it
# before its pages change hands even after it failed
PostFn = Callable[[str, "int | torch.Tensor", torch.Tensor, torch.Tensor, torch.Tensor], object]
# poll(pending) -> True once its pieces are here; raises on a lost peer (NIXL's failures, starting included)
PollFn = Callable[[object], bool]


class RemoteBlocks:
    """Per (sparse layer, KV head, block) presence of a decode node's host tier, and for each
    block (host page) admitted from a peer, that peer and the block's page there.

    Args:
        num_layers: sparse layers ``L``. head_num: KV heads ``H``. num_pages: host-tier pages ``P``.
        fetch: reads pieces from a peer (``FetchFn``); its exceptions mark the peer lost.
        device: the engine's device (default CPU): where ``present_dev`` and ``deferred`` live.
        post, poll: start a read without waiting and ask whether it ended (``PostFn``,
            ``PollFn``; ``disagg.transport.RemoteBlockFetcher.post`` / ``poll``): ``service``
            then starts the reads and returns, and a later ``service`` marks them present
            (``None``: ``service`` reads with ``fetch`` and waits).
    State: CPU tensors ``present [L, H, P]`` bool (every piece of a page not admitted from a
    peer is present: written here), ``peer [P]`` int32 index into ``peer_names`` or -1,
    ``src_page [P]`` int64; on ``device``: ``present_dev [L, H, P]`` bool (``present``'s copy
    the plans read; the same tensor on CPU) and ``deferred [L, H, P]`` int32 (how often a plan
    left the piece out since the last ``service``); ``inflight [L, H, P]`` bool (CPU) the pieces
    of reads started and not yet seen ended; ``dirty [P]`` bool (CPU) pages whose host memory
    may hold data ``present`` does not list (``written``, ``given_back``).
    """

    def __init__(self, num_layers: int, head_num: int, num_pages: int, fetch: FetchFn, device=None,
                 post: PostFn | None = None, poll: PollFn | None = None):
        self.L, self.H, self.P = num_layers, head_num, num_pages
        self.fetch = fetch
        self.present = torch.ones((num_layers, head_num, num_pages), dtype=torch.bool)
        self.device = torch.device("cpu") if device is None else torch.device(device)
        cpu = self.device.type == "cpu"
        self.present_dev = self.present if cpu else self.present.to(self.device)
        self.deferred = torch.zeros((num_layers, head_num, num_pages), dtype=torch.int32, device=self.device)
        self.deferred_pieces = 0        # pieces read by ``service`` (a plan had left them out)
        self.deferred_bytes = 0
        self.service_calls = 0          # ``service`` calls, and their host time (seconds) in all,
        self.service_s = 0.0
        self.counts_s = 0.0             # of which reading the plans' counts (``_left_out``)
        self.ended_s = 0.0              # and marking the pieces of ended reads present (``_take_ended``)
        # CUDA: the counts are read one call late, from a snapshot taken on the step's stream and
        # scanned on a side stream, so the host never waits for the step in flight (SGLang's
        # overlap scheduler keeps the GPU one step ahead of the host); CPU: at once
        self._lag = self.device.type == "cuda"
        if self._lag:
            self._snap = [torch.zeros_like(self.deferred) for _ in range(2)]
            self._snap_done: list = [None, None]
            self._turn = 0
            self._side = torch.cuda.Stream(device=self.device)
        if (post is None) != (poll is None):
            raise ValueError("RemoteBlocks: post and poll go together")
        self.post, self.poll = post, poll
        self.inflight = torch.zeros((num_layers, head_num, num_pages), dtype=torch.bool)
        # reads in flight: (layers [N], peer, heads [N], pages [N], read)
        self.pending: list[tuple[torch.Tensor, str, torch.Tensor, torch.Tensor, object]] = []
        # failed reads the transport may still be writing (their ``ended`` event not set): (pages [N], read)
        self.abandoned: list[tuple[torch.Tensor, object]] = []
        # pages whose host memory may hold data ``present`` does not list: a previous owner's
        # (released without its memory given back) or a failed read's that may have landed.
        # ``written`` counts every piece of them; ``given_back`` clears them
        self.dirty = torch.zeros((num_pages,), dtype=torch.bool)
        self.peer = torch.full((num_pages,), -1, dtype=torch.int32)
        self.src_page = torch.full((num_pages,), -1, dtype=torch.int64)
        self.peer_names: list[str] = []
        self.lost: dict[str, str] = {}            # peer -> why
        self.bytes_read = 0
        self.pieces_read = 0
        self.first_step_pieces = 0      # pieces read by ``read_now`` (first steps planned on the prefill node)
        self.first_step_bytes = 0
        self.first_step_reads = 0       # and the reads that carried them (one per peer and call)
        # a compact host tier (``use_slots``): its table, how pieces get a slot and give pages' slots back
        self.slot_table: torch.Tensor | None = None
        self._assign: Callable | None = None
        self._free_pages: Callable | None = None
        self._free_slots: Callable | None = None
        self.slot_misses = 0            # pieces not read for want of a free slot (compact tier)
        # pages with a piece a full compact pool could not take (a read not made, or a decoded
        # block not written back): their requests would attend without it, so the glue ends
        # them (``starve``; cleared when the page is admitted again or released)
        self.starved = torch.zeros((num_pages,), dtype=torch.bool)
        self._warn = EveryFewSeconds(self.WARN_S)

    WARN_S = 10.0       # the most often a full compact pool is warned about (seconds)

    def use_slots(self, table: torch.Tensor, assign: Callable, free_pages: Callable, free_slots: Callable) -> None:
        """Read into a compact host tier's pool rows (the engine's ``attach_remote`` calls this).

        Args:
            table: ``[L, H * P]`` int32 CPU, the tier's slot table (``HostTier.slots``; read, never
                written here: ``assign`` and ``free_pages`` change it).
            assign: ``(layers, heads, pages) -> [N] int64 rows`` (``OasisSparseKV.assign_host_pieces``;
                raises ``HostTierFull``, changing nothing, when the pool lacks slots).
            free_pages: ``(pages [M]) -> int`` gives every slot of those pages back
                (``OasisSparseKV.free_host_pages``).
            free_slots: ``() -> int`` the pool's free slots now (``HostTier.free_slots``).
        Raises:
            ValueError: ``table`` not ``[L, H * P]`` int32."""
        if table.dtype != torch.int32 or tuple(table.shape) != (self.L, self.H * self.P):
            raise ValueError(f"RemoteBlocks.use_slots: table {table.dtype} {tuple(table.shape)}: want int32 "
                             f"[{self.L}, {self.H * self.P}]")
        self.slot_table, self._assign, self._free_pages, self._free_slots = table, assign, free_pages, free_slots

    def _take_slots(self, l: torch.Tensor, h: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """A compact tier: give pieces ``(l[i], h[i], p[i])`` (``[M]`` int64 CPU) pool rows, as
        many as fit (in the order given; a piece keeps a slot it has). Returns ``[M]`` bool the
        pieces that have one (all True on the whole tier); the others are counted in
        ``slot_misses`` (once per piece) and warned about (rate-limited)."""
        if self.slot_table is None or not l.numel():
            return torch.ones(l.shape, dtype=torch.bool)
        col = h * self.P + p
        need = self.slot_table[l, col] < 0
        if bool(need.any()):
            ln, hn, pn = l[need], h[need], p[need]
            try:
                self._assign(ln, hn, pn)
            except HostTierFull:
                key = (ln * self.H + hn) * self.P + pn
                uk, first = _first_of_each(key)
                k = int(self._free_slots())
                if k:
                    take = first[:k]
                    self._assign(ln[take], hn[take], pn[take])
                miss = int(uk.numel()) - k
                self.slot_misses += miss
                self.starve(pn[first[k:]])
                if self._warn.due():
                    logger.warning("OasisKV PD: the compact host tier is full: %d pieces not read (their requests "
                                   "end: DecodeSide.starved_rows; %d in all so far); raise pd_host_slots",
                                   miss, self.slot_misses)
        return self.slot_table[l, col] >= 0

    def starve(self, pages) -> None:
        """Pages ``[N]`` (int64) with a piece a full compact pool could not take (``starved``)."""
        self.starved[torch.as_tensor(pages, dtype=torch.int64).reshape(-1)] = True

    def _dst(self, l: torch.Tensor, h: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """Where pieces ``(l, h, p)`` land here: their pages (the whole tier) or their pool rows."""
        if self.slot_table is None:
            return p
        return self.slot_table[l, h * self.P + p].to(torch.int64)

    def _peer_index(self, name: str) -> int:
        if name not in self.peer_names:
            self.peer_names.append(name)
        return self.peer_names.index(name)

    def admit(self, pages: torch.Tensor, peer: str, src_pages: torch.Tensor,
              present: torch.Tensor | None = None) -> None:
        """Record a request's pages as backed by ``peer``'s pages ``src_pages``.

        Args:
            pages, src_pages: ``[N]`` int64 host pages here and there, position by position.
            present: ``[L, H, N]`` bool, the pieces that arrived with the admission (default none).
        Raises:
            ValueError: lengths or ranges wrong, or ``present`` of the wrong shape (nothing changes).
        """
        pages = torch.as_tensor(pages, dtype=torch.int64).cpu()
        src_pages = torch.as_tensor(src_pages, dtype=torch.int64).cpu()
        if pages.shape != src_pages.shape or pages.dim() != 1:
            raise ValueError(f"admit: pages {tuple(pages.shape)}, src_pages {tuple(src_pages.shape)}: want [N] each")
        if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= self.P or int(src_pages.min()) < 0):
            raise ValueError(f"admit: pages must be in 0..{self.P - 1} and src_pages >= 0")
        if present is not None and tuple(present.shape) != (self.L, self.H, pages.numel()):
            raise ValueError(f"admit: present {tuple(present.shape)}: want {(self.L, self.H, pages.numel())}")
        if peer in self.lost:
            raise ValueError(f"admit: peer {peer!r} was lost ({self.lost[peer]})")
        self.wait_reads_into(pages)          # a read of the pages' previous request must not land later
        self.peer[pages] = self._peer_index(peer)
        self.src_page[pages] = src_pages
        self.starved[pages] = False
        self.present[:, :, pages] = False if present is None else present.to(torch.bool).cpu()
        self._mirror(pages)

    def _to_device(self, x: torch.Tensor) -> torch.Tensor:
        """A CPU tensor on the device without waiting for the step in flight (``devcopy.to_device``)."""
        return to_device(x, self.device, x.dtype)

    def _mark_present_dev(self, layer: torch.Tensor, h: torch.Tensor, p: torch.Tensor) -> None:
        """``present_dev[layer[i], h[i], p[i]] = True`` (``[N]`` int64 CPU each; ``layer`` may
        be one layer as a 0-d tensor): one flat index, one copy that does not wait for the
        device."""
        if self.present_dev is self.present:
            return
        flat = (layer * self.H + h) * self.P + p
        self.present_dev.view(-1).index_fill_(0, self._to_device(flat.reshape(-1)), True)

    def _mirror(self, pages: torch.Tensor) -> None:
        """Copy ``present`` of ``pages`` to the device and drop their deferred counts (the pages
        changed hands: a count of their previous request must not trigger a read)."""
        pd = self._to_device(pages)
        if self.present_dev is not self.present:
            self.present_dev.index_copy_(2, pd, self._to_device(self.present[:, :, pages].contiguous()))
        # index_fill_, not ``t[:, :, pd] = 0``: a scalar set by indexing is copied from pageable memory
        self.deferred.index_fill_(2, pd, 0)
        if self._lag:
            for snap in self._snap:
                snap.index_fill_(2, pd, 0)

    def release(self, pages: torch.Tensor) -> None:
        """Pages freed (the request ended): they are this node's own again. Waits first for
        the reads still writing into them (``wait_reads_into``, failed ones the transport still
        works on included): a page handed to another request must not receive a late read. A
        compact tier (``use_slots``): then every slot of the pages goes back (``free_pages``)."""
        pages = torch.as_tensor(pages, dtype=torch.int64).cpu().reshape(-1)
        self.wait_reads_into(pages)
        if self._free_pages is not None:
            self._free_pages(pages)              # a compact tier: the slots go back (no data kept)
        self.present[:, :, pages] = True
        self.dirty[pages] = True                 # until ``given_back``: a next owner's ``present`` won't show it
        self.starved[pages] = False
        self.peer[pages] = -1
        self.src_page[pages] = -1
        self._mirror(pages)

    def written(self, pages: torch.Tensor) -> torch.Tensor:
        """``[L, H, N]`` bool: the pieces of ``pages [N]`` (int64) whose host memory may hold
        data (``HostTier.discard``'s ``written``): the present ones, and every piece of a page
        that is ``dirty`` (a previous owner's data not given back, a failed read's bytes).

        Raises:
            ValueError: a page outside ``0 .. P - 1`` or not an integer."""
        pages = self._page_arg(pages, "written")
        return self.present[:, :, pages] | self.dirty[pages][None, None, :]

    def given_back(self, pages: torch.Tensor) -> None:
        """The host memory of every piece of ``pages [N]`` (int64) was given back
        (``HostTier.discard`` with ``written`` from :meth:`written`, or without it): no data
        ``present`` does not list.

        Raises:
            ValueError: a page outside ``0 .. P - 1`` or not an integer (nothing changes)."""
        self.dirty[self._page_arg(pages, "given_back")] = False

    def _page_arg(self, pages, who: str) -> torch.Tensor:
        """``pages`` as ``[N]`` int64 CPU host pages; ValueError naming ``who`` otherwise."""
        pages = torch.as_tensor(pages)
        if pages.dtype == torch.bool or pages.dtype.is_floating_point or pages.dtype.is_complex:
            raise ValueError(f"RemoteBlocks.{who}: pages must be integers, got {pages.dtype}")
        pages = pages.reshape(-1).to("cpu", torch.int64)
        if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= self.P):
            raise ValueError(f"RemoteBlocks.{who}: pages must be in 0..{self.P - 1}")
        return pages

    def cut_off(self, pages: torch.Tensor) -> None:
        """Start no more reads for ``pages [N]`` (int64): their pieces count as present from now
        on (whatever this node's host tier holds there), so no step reads them from their peer
        (reads already in flight still land in these pages; ``release`` waits for them).
        For a request about to end with an error whose peer's pages may no longer be its own
        (``disagg.serving.DecodeSide.check_stale``); ``release`` still ends it as usual."""
        pages = torch.as_tensor(pages, dtype=torch.int64).cpu().reshape(-1)
        self.present[:, :, pages] = True
        self._mirror(pages)

    def lost_mask(self, p: torch.Tensor) -> torch.Tensor:
        """``[M]`` bool: pages ``p`` (int64, admitted from a peer) whose peer is not lost."""
        lost = [i for i, n in enumerate(self.peer_names) if n in self.lost]
        if not lost:
            return torch.ones(p.shape, dtype=torch.bool)
        return ~torch.isin(self.peer[p], torch.tensor(lost, dtype=torch.int32))

    def missing(self, layer: int) -> int:
        """Pieces of sparse layer ``layer`` not here yet (all requests)."""
        return int((~self.present[layer]).sum())

    def ensure_local(self, layer: int, pieces: torch.Tensor) -> int:
        """Make host pieces ``pieces [M]`` (``h * P + page``, any order, -1 ignored) of sparse layer
        ``layer`` present, reading the missing ones from their peers (one ``fetch`` per peer).

        Returns: bytes read. A lost peer's pieces are skipped (see the module rule).
        """
        pieces = torch.as_tensor(pieces).reshape(-1).cpu().to(torch.int64)
        pieces = torch.unique(pieces[pieces >= 0])
        if not pieces.numel():
            return 0
        h, p = pieces // self.P, pieces % self.P
        miss = ~self.present[layer, h, p]
        if not bool(miss.any()):
            return 0
        h, p = h[miss], p[miss]
        if bool((self.peer[p] < 0).any()):      # not admitted from a peer: cannot be missing
            raise RuntimeError(f"RemoteBlocks: layer {layer}: pieces of local pages marked missing")
        lt = torch.full_like(h, layer)
        live = self.lost_mask(p)
        h, p = h[live], p[live]
        fit = self._take_slots(lt[:h.numel()], h, p)
        h, p = h[fit], p[fit]
        dst = self._dst(lt[:h.numel()], h, p)
        owner = self.peer[p]
        n = 0
        for pi in torch.unique(owner).tolist():
            sel = owner == pi
            name = self.peer_names[pi]
            try:
                n += int(self.fetch(name, layer, h[sel], self.src_page[p[sel]], dst[sel]))
            except Exception as e:  # noqa: BLE001 - any failure of a peer ends its requests, not the step
                self.lost[name] = f"{type(e).__name__}: {e}"
                self.dirty[p[sel]] = True   # part of its bytes may have landed without being present
                continue
            self.present[layer, h[sel], p[sel]] = True
            self._mark_present_dev(torch.tensor(layer, dtype=torch.int64), h[sel], p[sel])
            self.pieces_read += int(sel.sum())
        self.bytes_read += n
        return n

    def read_now(self, layers: torch.Tensor, heads: torch.Tensor, pages: torch.Tensor) -> int:
        """Make pieces ``(layers[i], heads[i], pages[i])`` (``[M]`` int64 each) present and wait:
        one read per peer holding every layer's pieces (``post`` / ``poll``, every peer's read
        started before any is waited for; without them one ``fetch`` per (layer, peer)). Used at
        a PD admission for the first step's working set the prefill node planned
        (``disagg/serving.py DecodeSide.install_first_steps``), between batches.

        Pieces already present, not admitted from a peer or of a lost peer are skipped; reads in
        flight are waited for first. A peer whose read fails is marked lost (its pieces stay
        missing; a read it may still write is waited for before its pages change hands).
        Returns: bytes read.
        """
        l, h, p = (torch.as_tensor(x).reshape(-1).cpu().to(torch.int64) for x in (layers, heads, pages))
        if not l.numel():
            return 0
        if bool(self.inflight[l, h, p].any()):
            self.wait_reads()
        keep = ~self.present[l, h, p] & (self.peer[p] >= 0)
        l, h, p = l[keep], h[keep], p[keep]
        keep = self.lost_mask(p)
        l, h, p = l[keep], h[keep], p[keep]
        keep = self._take_slots(l, h, p)          # a compact tier: the pieces that got a pool row
        l, h, p = l[keep], h[keep], p[keep]
        dst = self._dst(l, h, p)
        owner = self.peer[p]
        started = []          # every peer's read is started before any is waited for
        for pi in torch.unique(owner).tolist():
            name = self.peer_names[pi]
            sel = owner == pi
            ls, hs, ps, ds = l[sel], h[sel], p[sel], dst[sel]
            try:
                read = self.post(name, ls, hs, self.src_page[ps], ds) if self.post is not None else None
            except Exception as e:  # noqa: BLE001 - any failure of a peer ends its requests, not the step
                self.lost[name] = f"{type(e).__name__}: {e}"
                self.dirty[ps] = True       # (a transfer that failed while starting: counted as landed)
                continue
            started.append((name, ls, hs, ps, ds, read))
        n = 0
        for name, ls, hs, ps, ds, read in started:
            nb = 0
            try:
                if self.post is not None:
                    if read is not None:
                        while not self.poll(read):
                            time.sleep(0.0002)
                        nb = int(getattr(read, "nbytes", 0))
                else:
                    for layer in torch.unique(ls).tolist():
                        m = ls == layer
                        nb += int(self.fetch(name, layer, hs[m], self.src_page[ps[m]], ds[m]))
            except Exception as e:  # noqa: BLE001 - any failure of a peer ends its requests, not the step
                self.lost[name] = f"{type(e).__name__}: {e}"
                ended = getattr(read, "ended", None)
                if ended is not None and not ended.is_set():
                    self.abandoned.append((ps, read))       # its bytes may still land: pages wait for it
                self.dirty[ps] = True                       # bytes may have landed without being present
                continue
            self.present[ls, hs, ps] = True
            self._mark_present_dev(ls, hs, ps)
            k = int(ps.numel())
            self.pieces_read += k
            self.bytes_read += nb
            self.first_step_pieces += k
            self.first_step_bytes += nb
            self.first_step_reads += read is not None or self.post is None
            n += nb
        return n

    def filter_planned(self, layer: int, rows: torch.Tensor, wanted: torch.Tensor, forced: torch.Tensor,
                       seq: torch.Tensor, req_to_token: torch.Tensor, block_size: int, ids: torch.Tensor,
                       fetch_cap: int | None):
        """``pd_read_mode: deferred``: leave out of a pipelined plan of sparse layer ``layer``
        every wanted block whose piece is not here yet, and count for the next ``service`` those
        of them the plan would have admitted (missing from the working set, within the free
        slots plus ``fetch_cap`` of the head, or forced): reads stay within what ``wait`` reads.
        Device work only (no host read: a CUDA graph can capture it).

        Args:
            rows: ``[B]`` request rows. wanted / forced: ``[B, H, K]`` (int64 block ids, -1
                padded, priority order; bool) from ``select_topk``. seq: ``[B]`` context of the
                planned step (its new token included): a block starting at ``seq - 1`` or later
                is admitted empty and never left out. req_to_token: SGLang's ``[R, W]`` table
                (the block's host page is ``req_to_token[row, block * block_size] //
                block_size``). ids: ``[R, H, K]`` the layer's block table (working set).
                fetch_cap: the per-head cap of evicting admissions (``None``: K).
        Returns:
            ``(wanted, forced)`` ``[B, H, K]``: the left-out entries ``-1`` / ``False``.
        Paper: PD integration, remote partial fetching (the rule for a block not arrived in time).
        """
        B, H, K = wanted.shape
        W = req_to_token.shape[1]
        bs = block_size
        blk = wanted.clamp(min=0)
        page = torch.div(req_to_token[rows[:, None, None], (blk * bs).clamp(max=W - 1)].long(), bs,
                         rounding_mode="floor").clamp(0, self.P - 1)
        piece = torch.arange(H, device=wanted.device)[None, :, None] * self.P + page         # [B, H, K]
        absent = (wanted >= 0) & (blk * bs < (seq - 1)[:, None, None]) \
            & ~self.present_dev[layer].reshape(-1)[piece.reshape(-1)].view(B, H, K)
        # which of them the capped plan would admit (core.working_set.plan_admissions' ranks)
        held = ids[rows]
        missing = (wanted >= 0) & ~((wanted[..., :, None] == held[..., None, :]) & (held >= 0)[..., None, :]).any(-1)
        rank = missing.long().cumsum(-1) - 1
        limit = (held < 0).sum(-1, keepdim=True) + (K if fetch_cap is None else min(int(fetch_cap), K))
        read = absent & missing & ((rank < limit) | forced)
        self.deferred[layer].view(-1).scatter_add_(0, piece.reshape(-1), read.reshape(-1).to(torch.int32))
        return torch.where(absent, -1, wanted), forced & ~absent

    def service(self) -> int:
        """Read every piece a plan left out (``filter_planned``) since the last call (on CUDA:
        up to the call before it, ``_left_out``) and mark it present. Call between steps, after the plans that counted them ran (one device read of
        ``deferred``). With ``post`` / ``poll`` the reads are only started here, one per peer
        holding every layer's pieces; the reads started by earlier calls that ended are marked
        present first (a piece is admitted from the first plan after that). Without them, one
        waited ``fetch`` per (layer, peer).

        Returns: bytes read (waited) or started (``post``). A lost peer's pieces are skipped.
        """
        t0 = time.perf_counter()
        try:
            return self._service()
        finally:
            self.service_calls += 1
            self.service_s += time.perf_counter() - t0

    def _left_out(self) -> torch.Tensor:
        """``[M, 3]`` int64 (layer, head, page) CPU: the pieces plans left out, and reset the
        counts. CPU: every plan so far. CUDA: the plans queued before the last call (their
        snapshot was taken then, behind them on the step's stream, and has ended since: the
        step in flight is at most one later), read on a side stream, so the host waits for no
        step; a piece is read one step later than on CPU."""
        t0 = time.perf_counter()
        try:
            if not self._lag:
                idx = torch.nonzero(self.deferred).cpu()
                if idx.numel():
                    self.deferred.zero_()
                return idx
            t, prev = self._turn, 1 - self._turn
            self._snap[t].copy_(self.deferred)              # on the step's stream, behind the plans
            self.deferred.zero_()
            done = torch.cuda.Event()
            done.record()
            self._snap_done[t], self._turn = done, prev
            ev, self._snap_done[prev] = self._snap_done[prev], None
            if ev is None:
                return torch.empty((0, 3), dtype=torch.int64)
            with torch.cuda.stream(self._side):
                self._side.wait_event(ev)
                return torch.nonzero(self._snap[prev]).cpu()     # waits for the side stream only
        finally:
            self.counts_s += time.perf_counter() - t0

    def _service(self) -> int:
        t0 = time.perf_counter()
        self._take_ended()
        self.ended_s += time.perf_counter() - t0
        idx = self._left_out()                             # [M, 3] (layer, head, page)
        if not idx.numel():
            return 0
        if self.post is not None:
            return self._start_reads(idx[:, 0], idx[:, 1], idx[:, 2])
        n = 0
        for li in torch.unique(idx[:, 0]).tolist():
            sel = idx[idx[:, 0] == li]
            before = self.pieces_read
            got = self.ensure_local(li, sel[:, 1] * self.P + sel[:, 2])
            self.deferred_pieces += self.pieces_read - before
            self.deferred_bytes += got
            n += got
        return n

    def _start_reads(self, l: torch.Tensor, h: torch.Tensor, p: torch.Tensor) -> int:
        """``post`` the reads of pieces ``(l[i], h[i], p[i])`` (``[M]`` int64 each) not here, not
        in flight, and of a peer not lost: one read per peer with all its layers' pieces.
        Returns bytes started."""
        keep = ~self.present[l, h, p] & ~self.inflight[l, h, p] & (self.peer[p] >= 0)
        l, h, p = l[keep], h[keep], p[keep]
        keep = self.lost_mask(p)
        l, h, p = l[keep], h[keep], p[keep]
        keep = self._take_slots(l, h, p)          # a compact tier: the pieces that got a pool row
        l, h, p = l[keep], h[keep], p[keep]
        dst = self._dst(l, h, p)
        n = 0
        owner = self.peer[p]
        for pi in torch.unique(owner).tolist():
            name = self.peer_names[pi]
            sel = owner == pi
            try:
                read = self.post(name, l[sel], h[sel], self.src_page[p[sel]], dst[sel])
            except Exception as e:  # noqa: BLE001 - any failure of a peer ends its requests, not the step
                self.lost[name] = f"{type(e).__name__}: {e}"
                self.dirty[p[sel]] = True   # (a transfer that failed while starting: counted as landed)
                continue
            if read is None:
                continue
            self.inflight[l[sel], h[sel], p[sel]] = True
            self.pending.append((l[sel], name, h[sel], p[sel], read))
            n += int(getattr(read, "nbytes", 0))
        return n

    def _take_ended(self, wait: bool = False) -> None:
        """Mark the pieces of ended reads present (``wait``: poll each until it ends); a failed
        read marks its peer lost."""
        left = []
        for layer, name, h, p, read in self.pending:
            try:
                while True:
                    done = self.poll(read)
                    if done or not wait:
                        break
                    time.sleep(0.0002)
            except Exception as e:  # noqa: BLE001 - any failure of a peer ends its requests, not the step
                self.lost[name] = f"{type(e).__name__}: {e}"
                self.inflight[layer, h, p] = False
                ended = getattr(read, "ended", None)
                if ended is not None and not ended.is_set():
                    self.abandoned.append((p, read))    # its bytes may still land: pages wait for it
                self.dirty[p] = True                    # bytes may have landed without being present
                continue
            if not done:
                left.append((layer, name, h, p, read))
                continue
            self.inflight[layer, h, p] = False
            # a page released meanwhile was waited for (release): these pieces are still the request's
            self.present[layer, h, p] = True
            self._mark_present_dev(layer, h, p)
            k = int(h.numel())
            nb = int(getattr(read, "nbytes", 0))
            self.pieces_read += k
            self.bytes_read += nb
            self.deferred_pieces += k
            self.deferred_bytes += nb
        self.pending = left

    ABANDONED_WAIT_S = 60.0     # the most a page waits for a failed read the transport still works on

    def wait_reads_into(self, pages: torch.Tensor) -> None:
        """``wait_reads`` when a read in flight writes into one of ``pages [N]`` (int64 host
        pages), and wait for the failed reads into them the transport still works on (their
        ``ended``; at most ``ABANDONED_WAIT_S``): call before the pages change hands or their
        memory is given back."""
        pages = torch.as_tensor(pages, dtype=torch.int64).cpu()
        if self.pending and any(bool(torch.isin(p, pages).any()) for _, _, _, p, _ in self.pending):
            self.wait_reads()
        if self.abandoned:
            left = []
            for p, read in self.abandoned:
                if bool(torch.isin(p, pages).any()) and not read.ended.wait(self.ABANDONED_WAIT_S):
                    logger.error("OasisKV PD: a failed read into pages %s did not end within %.0f s; the pages "
                                 "change hands anyway and may still receive its bytes",
                                 p[torch.isin(p, pages)][:8].tolist(), self.ABANDONED_WAIT_S)
                if not read.ended.is_set():
                    left.append((p, read))
            self.abandoned = left

    def wait_reads(self) -> None:
        """Wait for every read started by ``service`` (each ends by its deadline) and mark its
        pieces present."""
        if self.pending:
            self._take_ended(wait=True)

    def forget_lost(self, peer: str) -> bool:
        """Take back a lost peer (seen alive again) once none of this node's pages is backed by
        it any more (its requests ended and were released). Returns whether it was taken back."""
        if peer not in self.lost:
            return True
        if peer in self.peer_names and bool((self.peer == self.peer_names.index(peer)).any()):
            return False
        del self.lost[peer]
        return True

    def failed_pages(self) -> torch.Tensor:
        """``[N]`` int64 pages whose peer was lost (their requests must end with an error)."""
        lost = [i for i, n in enumerate(self.peer_names) if n in self.lost]
        if not lost:
            return torch.empty(0, dtype=torch.int64)
        return torch.nonzero(torch.isin(self.peer, torch.tensor(lost, dtype=torch.int32))).reshape(-1)


def _first_of_each(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(unique keys [U], first [U])``: the distinct values of ``key [M]`` (int64) in the order
    they first occur, and the index of each one's first occurrence."""
    uk, inv = torch.unique(key, return_inverse=True)
    first = torch.full((uk.numel(),), key.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, inv, torch.arange(key.numel(), dtype=torch.int64), "amin")
    order = torch.argsort(first)
    return uk[order], first[order]
