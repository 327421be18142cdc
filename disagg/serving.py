"""``--kv-sparse oasis`` with SGLang's PD disaggregation (NIXL transfer backend): the serving side.

Paper: PD integration, remote partial fetching. What crosses at admission (SGLang's own NIXL
transfer, page by page, of the regions ``sglang_glue/pool.py OasisKVPool.get_contiguous_buf_infos``
advertises): the dense layers' KV, every sparse layer's min/max key summaries, and the prefill
node's page number of each block. The sparse layers' K/V stay in the prefill node's host tier
(its staging pool, registered with NIXL by :class:`PrefillSide`) and the decode node reads the
blocks its steps select (:class:`DecodeSide`: ``core/remote.py RemoteBlocks`` + ``transport.py
RemoteBlockFetcher``, one NIXL READ per (sparse layer, peer) holding every request's pieces).

Rules (stated, tested in tests/e2e/test_e2e_pd_oasis.py):

- First decode step on the decode node: the request has no working set yet, so the step selects
  synchronously with its own query (``OasisSparseKV.decode_attention``'s synchronous path) and
  reads the selected blocks before attending; later steps use the configured predictor.
- A block not here yet: the step waits for its READ (deadline ``pd_read_timeout_s``). A READ
  that fails or runs late marks the prefill node lost; its requests end with an error before
  the next step (``abort_lost``), everyone else keeps decoding; once they have ended, a node
  answering at that bootstrap address again is used for new requests.
- Prefill pages: after SGLang's transfer the prefill node holds the request's pages under a
  lease instead of freeing them (``PrefillSide.lease``); the decode node renews it while the
  request decodes (``oasis-renew:<room>`` every ``pd_lease_s / 4``) and releases it when the
  request ends or cannot be admitted (``oasis-release:<room>``, NIXL notifications); a lease
  neither renewed nor released for ``pd_lease_s`` seconds expires.
- Finding a prefill node's host tier: its layout (``transport.TierLayout``) is PUT to SGLang's
  bootstrap server (route ``/oasis/tier``, added to ``CommonKVBootstrapServer``) when the
  prefill registers; a decode node GETs it from the request's ``bootstrap_host:port`` the first
  time it sees that prefill node.

Not built here: TP > 1 with PD, speculative decoding with PD, CUDA graphs on the PD decode node
(the on-demand reads run on the host inside the step).

Imports SGLang only inside the hook functions (``disagg/`` and ``sglang_glue/`` are the only
SGLang importers).
"""

from __future__ import annotations

import base64
import logging
import time
import uuid
from dataclasses import dataclass

import torch

from ..core.remote import RemoteBlocks
from .admission import request_pages
from .transport import NixlTier, PeerLostError, RemoteBlockFetcher, TierLayout

logger = logging.getLogger(__name__)

RELEASE = b"oasis-release:"
RENEW = b"oasis-renew:"
TIER_ROUTE = "/oasis/tier"

# this process's side (one scheduler / TP rank per process); set by sglang_glue/install.py
_SIDE: "PrefillSide | DecodeSide | None" = None


def side():
    """This process's :class:`PrefillSide` / :class:`DecodeSide`, or ``None`` (not PD, or not oasis)."""
    return _SIDE


def set_side(s) -> None:
    global _SIDE
    _SIDE = s


def connect_host(host: str) -> str:
    """A bind address as one to connect to: the wildcards ``0.0.0.0`` / ``::`` become the
    loopback of their family (as SGLang's ``CommonKVManager.register_to_bootstrap`` does)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


def agent_name(role: str, tp_rank: int) -> str:
    """A NIXL agent name unique per process: ``oasis-<role>-<8 hex>-tp<rank>``."""
    return f"oasis-{role}-{uuid.uuid4().hex[:8]}-tp{tp_rank}"


@dataclass
class Lease:
    """A prefill request whose KV pages are held for a decode node: ``release()`` frees them
    (SGLang's ``release_kv_cache`` of the request), ``deadline`` is ``time.monotonic()`` seconds."""
    release: object
    deadline: float
    rid: str
    tokens: int = 0


class PrefillSide:
    """Prefill node: the host tier registered with NIXL (the staging pool) and the leases.

    Args:
        engine: this rank's ``core.OasisSparseKV``. lease_s: ``OasisConfig.pd_lease_s``.
        tp_rank: this rank (names the NIXL agent).
    """

    role = "prefill"

    def __init__(self, engine, lease_s: float, tp_rank: int = 0):
        self.tier = NixlTier(engine.host.k, engine.host.v, agent_name("prefill", tp_rank))
        self.lease_s = float(lease_s)
        self.leases: dict[int, Lease] = {}
        self.released = self.expired = 0

    def layout_b64(self) -> str:
        return base64.b64encode(self.tier.layout().to_bytes()).decode()

    def lease(self, room: int, release, rid: str = "", tokens: int = 0) -> None:
        """Hold a transferred request's pages until its decode node releases them (or
        ``lease_s`` passes without a renewal). ``release``: a callable freeing them (called
        once); ``tokens``: the KV slots it holds outside the radix cache (SGLang's idle memory
        check counts them)."""
        old = self.leases.pop(int(room), None)
        if old is not None:          # a room reused while its lease is held: free the old pages first
            self._free(int(room), old)
        self.leases[int(room)] = Lease(release, time.monotonic() + self.lease_s, rid, int(tokens))

    def _free(self, room: int, lease: Lease) -> None:
        try:
            lease.release()
        except Exception:  # noqa: BLE001 - one request's release must not stop the prefill loop
            logger.exception("OasisKV PD: freeing the pages of request %s (room %d) failed", lease.rid, room)

    def held_tokens(self) -> int:
        """KV slots (tokens) held by leases, outside the radix cache."""
        return sum(x.tokens for x in self.leases.values())

    def poll(self, now: float | None = None) -> int:
        """Free the leases the decode nodes released (NIXL notifications) or that expired.
        Called from the prefill scheduler's loop. Returns leases freed."""
        n = 0
        try:
            notifs = self.tier.agent.get_new_notifs()
        except Exception as e:  # noqa: BLE001 - a notification error must not stop the prefill loop
            logger.warning("OasisKV PD: reading NIXL notifications failed: %s", e)
            notifs = {}
        now = time.monotonic() if now is None else now
        for msgs in notifs.values():
            for m in msgs:
                kind = RELEASE if m.startswith(RELEASE) else RENEW if m.startswith(RENEW) else None
                digits = m[len(kind):] if kind else b""
                if not (digits.isdigit() and len(digits) <= 20):
                    continue                 # not ours, or malformed: ignored
                room = int(digits)
                if kind == RENEW:
                    if room in self.leases:
                        self.leases[room].deadline = now + self.lease_s
                    continue
                lease = self.leases.pop(room, None)
                if lease is not None:
                    self._free(room, lease)
                    self.released += 1
                    n += 1
        for room in [r for r, x in self.leases.items() if x.deadline <= now]:
            lease = self.leases.pop(room)
            logger.warning("OasisKV PD: lease of request %s (room %d) expired: no release or renewal from its "
                           "decode node for %.0f s; its pages are freed", lease.rid, room, self.lease_s)
            self._free(room, lease)
            self.expired += 1
            n += 1
        if n:
            logger.info("OasisKV PD: freed %d lease(s); released by decode nodes: %d, expired: %d, held now: %d",
                        n, self.released, self.expired, len(self.leases))
        return n


@dataclass
class Admitted:
    """A decode-node request admitted from a prefill node: ``pages [N]`` int64 its host pages
    here (block by block), ``peer`` the prefill node's NIXL agent, ``room`` its bootstrap room."""
    pages: torch.Tensor
    peer: str
    room: int
    rid: str


class DecodeSide:
    """Decode node: this host tier registered with NIXL (the READs' destination), the peers'
    layouts, and which request rows were admitted from which peer.

    Args:
        engine: this rank's ``core.OasisSparseKV`` (``attach_remote`` is called on it).
        pool: the ``OasisKVPool`` (its ``pd_page_ids`` receive the prefill pages).
        read_timeout_s: ``OasisConfig.pd_read_timeout_s`` (seconds per NIXL read).
        tp_rank: this rank (names the NIXL agent). lease_s: ``OasisConfig.pd_lease_s``
            (leases are renewed every quarter of it).
    Raises:
        ValueError: ``read_timeout_s`` not > 0 (``RemoteBlockFetcher``).
    """

    role = "decode"

    RETRY_S = 10.0        # a prefill node whose layout could not be had is asked again after this

    def __init__(self, engine, pool, read_timeout_s: float, tp_rank: int = 0, lease_s: float = 600.0):
        self.engine, self.pool = engine, pool
        self.tier = NixlTier(engine.host.k, engine.host.v, agent_name("decode", tp_rank))
        self.fetcher = RemoteBlockFetcher(self.tier, timeout_s=read_timeout_s)
        self.remote = RemoteBlocks(len(engine.sparse_layers), engine.head_num, engine.host.num_pages,
                                   fetch=self.fetcher.fetch)
        engine.attach_remote(self.remote)
        P = (pool.size + pool.page_size) // pool.page_size        # pages of every transfer region (pool.py)
        # the prefill node's page of each block arrives here with SGLang's transfer; -1: none yet
        pool.pd_page_ids = [torch.full((P,), -1, dtype=torch.int64, device=pool.device) for _ in range(2)]
        self.peers: dict[tuple[str, int], str] = {}          # (bootstrap host, port) -> agent
        self.rows: dict[int, Admitted] = {}
        self.aborted = 0
        self.admission_bytes = self.full_transfer_bytes = 0       # over every admitted request
        self._failed: dict[tuple[str, int], tuple[float, str]] = {}   # (host, port) -> (retry after, why)
        self.renew_s = float(lease_s) / 4
        self._next_renew = 0.0

    # ---- peers ------------------------------------------------------------------------------
    def peer_for(self, host: str, port: int, tries: int = 3) -> str:
        """The NIXL agent of the prefill node behind bootstrap ``host:port`` (its layout fetched
        from the bootstrap server once; runs in the decode scheduler's loop, so it gives up
        within a few seconds and remembers a failure for ``RETRY_S``).

        Raises:
            PeerLostError: no layout there (not an OasisKV prefill node, or unreachable), a
                layout this node cannot read from (another block size, head count, layers),
                or a lost node still backing requests being ended.
        """
        key = (str(host), int(port))
        agent = self.peers.get(key)
        if agent is not None and agent not in self.remote.lost:
            return agent
        failed = self._failed.get(key)
        if failed is not None and time.monotonic() < failed[0]:
            raise PeerLostError(f"{key[0]}:{key[1]}", failed[1])
        if agent is not None:               # lost: take it back (or a new node there) once its requests ended
            if not self.remote.forget_lost(agent):
                raise PeerLostError(agent, "lost; its requests are still being ended")
            self.fetcher.remove_peer(agent)
            del self.peers[key]
        import requests

        h = connect_host(key[0])
        url = f"http://{'[' + h + ']' if ':' in h else h}:{key[1]}{TIER_ROUTE}?rank=0"
        why = "no answer"
        for i in range(tries):
            try:
                r = requests.get(url, timeout=2)
            except requests.RequestException as e:
                why = f"{type(e).__name__}: {e}"
                time.sleep(0.5 * (i + 1))
                continue
            if r.status_code == 200:
                try:
                    lay = TierLayout.from_bytes(base64.b64decode(r.json()["layout"], validate=True))
                    agent = self.fetcher.add_peer(lay)
                except Exception as e:  # noqa: BLE001 - a layout we cannot use: no retry helps
                    why = f"unusable host tier layout: {type(e).__name__}: {e}"
                    break
                self.peers[key] = agent
                self.remote.forget_lost(agent)
                self._failed.pop(key, None)
                return agent
            why = f"HTTP {r.status_code}: {r.text[:200]}"
            if r.status_code == 404:
                break
            time.sleep(0.5 * (i + 1))
        why = (f"no usable OasisKV host tier at its bootstrap server ({why}); run the prefill node with "
               "--kv-sparse oasis and the same --kv-sparse-config")
        self._failed[key] = (time.monotonic() + self.RETRY_S, why)
        raise PeerLostError(f"{key[0]}:{key[1]}", why)

    def renew(self, now: float | None = None) -> None:
        """Keep the leases of the requests decoding here alive on their prefill nodes (a
        notification per request every ``lease_s / 4``; called before each decode batch)."""
        now = time.monotonic() if now is None else now
        if now < self._next_renew or not self.rows:
            return
        self._next_renew = now + self.renew_s
        for adm in self.rows.values():
            if adm.peer not in self.remote.lost:
                try:
                    self.tier.agent.send_notif(adm.peer, RENEW + str(adm.room).encode())
                except Exception as e:  # noqa: BLE001 - the next read from that peer decides whether it is lost
                    logger.warning("OasisKV PD: renewing the lease of request %s failed: %s", adm.rid, e)

    def refuse(self, host: str, port: int, room: int, rid: str = "") -> None:
        """A transferred request that could not be admitted: tell its prefill node to free its
        pages now (when that node is known and not lost), instead of holding them to expiry."""
        agent = self.peers.get((str(host), int(port)))
        if agent is None or agent in self.remote.lost:
            return
        try:
            self.tier.agent.send_notif(agent, RELEASE + str(int(room)).encode())
        except Exception as e:  # noqa: BLE001
            logger.warning("OasisKV PD: could not release the lease of refused request %s: %s", rid, e)

    # ---- requests ---------------------------------------------------------------------------
    def admit(self, row: int, req_to_token_row: torch.Tensor, prompt_len: int, host: str, port: int,
              room: int, rid: str = "") -> None:
        """A request whose SGLang transfer completed: its pages here are backed by the prefill
        node's pages (``pd_page_ids``, received with the transfer); nothing of its sparse
        layers' K/V is here yet. Its row starts empty, so its first step selects synchronously.

        Args:
            row: the request's row in SGLang's request table. req_to_token_row: ``[max_len]``
                integer token slots of that row. prompt_len: prompt tokens (their KV was sent).
            host, port: the request's bootstrap address (finds its prefill node). room: its
                bootstrap room (names its lease there). rid: for log lines.

        Raises:
            PeerLostError: the prefill node's host tier cannot be found.
            ValueError: the received page numbers are missing or torn (the transfer did not
                carry OasisKV's regions: a prefill node without ``--kv-sparse oasis``).
        """
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < self.engine.ws.R:
            raise ValueError(f"OasisKV PD: admit: row {row!r} not in 0..{self.engine.ws.R - 1}")
        if not 0 < prompt_len <= req_to_token_row.numel():
            raise ValueError(f"OasisKV PD: admit: prompt_len {prompt_len} not in 1..{req_to_token_row.numel()}")
        if row in self.rows:            # SGLang reused the row: its last request ended without our free hook
            logger.warning("OasisKV PD: row %d still held request %s; releasing it for request %s",
                           row, self.rows[row].rid, rid)
            self.release(row)
        peer = self.peer_for(host, port)
        pages = request_pages(req_to_token_row, prompt_len, self.engine.bs)
        pd = pages.to(self.pool.pd_page_ids[0].device)
        src = self.pool.pd_page_ids[0][pd].to("cpu")
        if bool((src < 0).any()) or not torch.equal(src, self.pool.pd_page_ids[1][pd].to("cpu")):
            raise ValueError("OasisKV PD: the transfer did not carry the prefill node's page numbers (is the prefill "
                             "node running --kv-sparse oasis with the same block_size and dense_layers?)")
        if int(src.max()) >= self.fetcher.peers[peer].num_pages:
            raise ValueError(f"OasisKV PD: received page numbers up to {int(src.max())}, but the prefill node's host "
                             f"tier has {self.fetcher.peers[peer].num_pages} pages")
        self.engine.reset_rows([row])
        self.remote.admit(pages, peer, src)
        self.rows[int(row)] = Admitted(pages, peer, int(room), rid)
        n = pages.numel()
        sent, full = n * getattr(self.pool, "pd_page_bytes", 0), n * getattr(self.pool, "pd_full_page_bytes", 0)
        self.admission_bytes += sent
        self.full_transfer_bytes += full
        if sent:
            mib = 2 ** 20
            logger.info("OasisKV PD: admitted request %s from %s: %d prompt tokens, %.2f MiB at admission (dense "
                        "layers, summaries, page numbers) vs %.2f MiB for a full transfer (%.2fx less); read on "
                        "demand so far: %.2f MiB in %d NIXL reads", rid, peer, prompt_len, sent / mib, full / mib,
                        full / sent, self.fetcher.stats.bytes / mib, self.fetcher.stats.transfers)

    def release(self, row: int) -> None:
        """The request on ``row`` ended: its pages are this node's again, and its prefill node
        may free its pages (a NIXL notification; a lost peer is not told)."""
        adm = self.rows.pop(int(row), None)
        if adm is None:
            return
        self.remote.release(adm.pages)
        pd = adm.pages.to(self.pool.pd_page_ids[0].device)
        for t in self.pool.pd_page_ids:
            t[pd] = -1
        if adm.peer in self.remote.lost:
            return
        try:
            self.tier.agent.send_notif(adm.peer, RELEASE + str(adm.room).encode())
        except Exception as e:  # noqa: BLE001 - the lease then expires on the prefill node
            logger.warning("OasisKV PD: could not tell prefill node %s to free request %s's pages (%s); "
                           "its lease will expire", adm.peer, adm.rid, e)

    def lost_rows(self) -> dict[int, str]:
        """Rows admitted from a lost peer -> why it was lost."""
        return {r: self.remote.lost[a.peer] for r, a in self.rows.items() if a.peer in self.remote.lost}
