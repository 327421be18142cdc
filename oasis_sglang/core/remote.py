"""Decode node of a PD deployment: which host-tier pieces are here, and where the others are.

Paper: PD integration, remote partial fetching. A request admitted from a prefill node brings
only part of its KV cache (its first decode step's working set; ``disagg/``). The rest of its
blocks stay in the prefill node's host tier (the *staging pool*) and are read on demand: before
the transfer stage copies admitted blocks host -> device (``core/stages.py``), ``ensure_local``
reads the pieces that are not here yet from their peer (one read per (sparse layer, peer),
holding every request's pieces) into the same place of this node's host tier, where they stay
(the host tier is the decode node's cache of fetched blocks).

Rule for a piece that cannot arrive: the step waits for the read (its deadline is the
fetcher's); a peer that fails a read is marked lost, its pieces are skipped from then on (the
working set keeps what it had), and the requests on its pages are reported by
``failed_pages`` so the serving glue ends them with an error while the batch's other requests
go on.

Torch only (the reads are done by a callable; ``disagg.transport.RemoteBlockFetcher.fetch`` in
serving).
"""

from __future__ import annotations

from typing import Callable

import torch

# fetch(peer, layer, heads [N], src_pages [N], dst_pages [N]) -> bytes read; raises on a lost peer
FetchFn = Callable[[str, int, torch.Tensor, torch.Tensor, torch.Tensor], int]


class RemoteBlocks:
    """Per (sparse layer, KV head, block) presence of a decode node's host tier, and for each
    block (host page) admitted from a peer, that peer and the block's page there.

    Args:
        num_layers: sparse layers ``L``. head_num: KV heads ``H``. num_pages: host-tier pages ``P``.
        fetch: reads pieces from a peer (``FetchFn``); its exceptions mark the peer lost.
    State (CPU tensors): ``present [L, H, P]`` bool (every piece of a page not admitted from a
    peer is present: written here), ``peer [P]`` int32 index into ``peer_names`` or -1,
    ``src_page [P]`` int64.
    """

    def __init__(self, num_layers: int, head_num: int, num_pages: int, fetch: FetchFn):
        self.L, self.H, self.P = num_layers, head_num, num_pages
        self.fetch = fetch
        self.present = torch.ones((num_layers, head_num, num_pages), dtype=torch.bool)
        self.peer = torch.full((num_pages,), -1, dtype=torch.int32)
        self.src_page = torch.full((num_pages,), -1, dtype=torch.int64)
        self.peer_names: list[str] = []
        self.lost: dict[str, str] = {}            # peer -> why
        self.bytes_read = 0
        self.pieces_read = 0

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
        self.peer[pages] = self._peer_index(peer)
        self.src_page[pages] = src_pages
        self.present[:, :, pages] = False if present is None else present.to(torch.bool).cpu()

    def release(self, pages: torch.Tensor) -> None:
        """Pages freed (the request ended): they are this node's own again."""
        pages = torch.as_tensor(pages, dtype=torch.int64).cpu()
        self.present[:, :, pages] = True
        self.peer[pages] = -1
        self.src_page[pages] = -1

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
        owner = self.peer[p]
        n = 0
        for pi in torch.unique(owner).tolist():
            sel = owner == pi
            if pi < 0:                      # not admitted from a peer: cannot be missing
                raise RuntimeError(f"RemoteBlocks: layer {layer}: pieces of local pages marked missing")
            name = self.peer_names[pi]
            if name in self.lost:
                continue
            try:
                n += int(self.fetch(name, layer, h[sel], self.src_page[p[sel]], p[sel]))
            except Exception as e:  # noqa: BLE001 - any failure of a peer ends its requests, not the step
                self.lost[name] = f"{type(e).__name__}: {e}"
                continue
            self.present[layer, h[sel], p[sel]] = True
            self.pieces_read += int(sel.sum())
        self.bytes_read += n
        return n

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
