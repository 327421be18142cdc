"""``--kv-sparse oasis`` with SGLang's PD disaggregation (NIXL transfer backend): the serving side.

Paper: PD integration, remote partial fetching. What crosses at admission (SGLang's own NIXL
transfer, page by page, of the regions ``sglang_glue/pool.py OasisKVPool.get_contiguous_buf_infos``
advertises): the dense layers' KV, every sparse layer's min/max key summaries (bf16 staging
buffers, rounded outward, when the engine's are wider: ``pd_summaries``), the prefill node's
page number of each block, and per block the first decode step's working-set slots the prefill
node planned (``pd_first_step``). The sparse layers' K/V stay in the prefill node's host tier
(its staging pool, registered with NIXL by :class:`PrefillSide`) and the decode node reads the
blocks its steps select (:class:`DecodeSide`: ``core/remote.py RemoteBlocks`` + ``transport.py
RemoteBlockFetcher``: one NIXL READ holding every request's pieces per (sparse layer, peer) in a
step that waits, per peer and step when reads are deferred; made on the fetcher's reader thread).

Rules (stated, tested in tests/e2e/test_e2e_pd_oasis.py):

- First decode step: with an asynchronous predictor (``previous``, ``lookahead``) on both nodes,
  the prefill node plans it during the last chunk's forward with the last prompt token's query
  (as a colocated server does), and writes the plan into the ``pd_first_step`` region at the
  request's pages right before its send; the request is sent in one piece with its last chunk
  (``sglang_hooks.should_send_kv_chunk_hook`` holds back the earlier chunks and SGLang's early
  send of a cached prefix: the plan is known only then). At admission the decode node reads the
  planned blocks (one NIXL READ per prefill node for every request admitted in that scheduler
  iteration, all layers; the scheduler waits for it between batches) and installs them slot by
  slot (``DecodeSide.install_first_steps``), so the first step is a predicted step (in CUDA
  graphs where the predictor's are). Each mask row carries the request's bootstrap room: a
  cached prefix page shared with a request sent later carries that request's plan, and the
  earlier request then does without (the later send wins). Without a usable plan (``current``
  on the prefill node; the two copies differ; another request's tag; a slot out of range or
  held twice; a (layer, KV head) without a prompt block or without the block the new token
  goes into; more blocks than this node's budget: a smaller budget packs the slots in their
  order) the row starts empty and the first step selects synchronously with its own query and
  reads its blocks before attending, as does every step with ``current`` on the decode node;
  the ``admitted request`` line says why (``first_steps_rejected`` counts them).
- A block not here yet: a predicted step leaves it out and keeps its resident set
  (``pd_read_mode: deferred``, below); a synchronous step, and every step with ``wait`` or
  ``predictor: current``, waits for its READ (deadline ``pd_read_timeout_s``). A READ
  that fails or runs late marks the prefill node lost; its requests end with an error before
  the next step (``abort_lost``), everyone else keeps decoding; once they have ended, a node
  answering at that bootstrap address again is used for new requests.
- Prefill pages: after SGLang's transfer the prefill node holds the request's pages under a
  lease instead of freeing them (``PrefillSide.lease``); the decode node renews it while the
  request is admitted (``oasis-renew:<room>`` at admission and then every quarter to three
  eighths of the lease, sent by a thread of its own, so a live process renews even while its
  scheduler is busy or the request waits in SGLang's queues) and releases it
  when the request ends, is retracted or cannot be admitted (``oasis-release:<room>:<page>``,
  the transfer named by the prefill node's page of its last token, or ``oasis-release:<room>``;
  NIXL notifications); a lease neither renewed nor released for ``pd_lease_s`` seconds (60 by
  default) expires: a decode node that died or was cut off loses its leases within that time.
  A decode node that could not renew a lease for 0.9 of its length (its process was stopped, its
  renewals failed) ends that request with an error before its next batch and starts no read of
  its blocks again (``DecodeSide.cut_off_stale``; reads already in flight land in its own pages),
  instead of reading pages its prefill node may have given to another request (checked before
  each batch: a forward already running when the process stalled still reads). The thread renews
  every admitted row while the process lives: a hung scheduler or a row SGLang never frees keeps
  its prefill pages held (SGLang's watchdog ends a hung forward). All peers are renewed from one
  thread: a peer whose notifications block delays the others' renewals. A lease's length is the
  shorter of the two nodes' ``pd_lease_s`` (the prefill node's travels in its ``TierLayout``).
  Not detected: a decode node stopped for a whole lease between a transfer's end and the
  request's admission.
- Off CUDA the decode node's host tier holds only the blocks it read or decoded (``core/host_tier.py``
  commits memory on demand; a request's blocks are given back when it ends or is retracted).
- Retraction on the decode node (its KV slots ran out): the request is recomputed by its prefill
  node (SGLang's PD rebootstrap, ``sglang_hooks.release_req_hook`` / ``prealloc_add_hook``), not
  copied to the CPU, and admitted again as that room's next transfer.
- Finding a prefill node's host tier: its layout (``transport.TierLayout``) is PUT to SGLang's
  bootstrap server (route ``/oasis/tier``, added to ``CommonKVBootstrapServer``) when the
  prefill registers; a decode node GETs it from the request's ``bootstrap_host:port`` the first
  time it sees that prefill node.

Speculative decoding: the draft model keeps SGLang's own KV pool, which SGLang's transfer sends
whole (``DecodePreallocQueue._init_kv_manager``); it is counted in the admission line.

Reads on the decode node (``OasisConfig.pd_read_mode``): ``deferred`` (default) starts the reads of
the blocks a pipelined plan left out at the next step's start and does not wait for them (a later
step's start marks them present), so a predicted step reads nothing on the host and waits for no
read (on CUDA the left-out counts are read one step late, so the host never waits for the step
in flight); ``wait`` reads inside each layer's transfer stage and waits. With ``deferred`` and
``predictor: previous`` the glue keeps the decode step in SGLang's CUDA graphs (H200, 8 x 16K:
782 tok/s vs 79.6 eager; ``sglang_glue/server_args._pd_decode_graph_blocker``).

TP: both nodes run the same ``--tp-size``; decode rank ``r`` reads its KV heads from prefill rank
``r`` (the layout each rank PUTs to the bootstrap server says its rank and size). What one rank's
NIXL agent sees is acted on by all ranks at the same loop iteration (``tp_agree``: SGLang's TP
schedulers must keep the same batches and free pages): a lease is freed once every prefill rank
would free it, a request ends on every decode rank when one rank cannot admit it or lost its
prefill rank. Tested on the CPU engine (``--tp 3``); not on a GPU.

Not built here: CUDA graphs with a draft model on the PD decode node; TP with different sizes
on the two nodes.

Imports SGLang only inside the hook functions (``disagg/`` and ``sglang_glue/`` are the only
SGLang importers).
"""

from __future__ import annotations

import base64
import contextlib
import logging
import threading
import time
import uuid
from dataclasses import dataclass

import torch

from ..core import host_tier
from ..core.remote import RemoteBlocks
from .admission import TAG_COLS, first_step_mask, first_step_width, plan_from_mask, request_pages, room_tag, round_outward
from .transport import NixlTier, PeerLostError, RemoteBlockFetcher, TierLayout, is_disconnect

logger = logging.getLogger(__name__)

RELEASE = b"oasis-release:"
RENEW = b"oasis-renew:"
TIER_ROUTE = "/oasis/tier"

def lease_clock() -> float:
    """Seconds on the clock a decode node times its leases' renewals with: ``CLOCK_BOOTTIME``
    (it keeps counting while the host is suspended, when the prefill node's leases expire
    anyway), ``time.monotonic`` where there is none."""
    return time.clock_gettime(_BOOTTIME) if _BOOTTIME is not None else time.monotonic()


_BOOTTIME = getattr(time, "CLOCK_BOOTTIME", None)

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


def tp_agree(local: dict[int, str], group=None, every: bool = False, held=None) -> dict[int, str]:
    """A decision every TP rank of a node must take alike, from what each rank saw itself.

    SGLang's TP schedulers run in lockstep and expect the same batches and the same free pages
    on every rank; what one rank's NIXL agent saw (a release, an expiry, a lost peer, a failed
    admission) must therefore be acted on by all of them at the same loop iteration. Each rank
    calls this at the same point of its loop (a collective over ``group``).

    Args:
        local: ``{key: why}`` this rank would act on (keys: bootstrap rooms or request rows,
            equal across ranks). group: SGLang's attention-TP CPU (gloo) group; ``None`` or a
            group of one: ``local`` is returned as it is.
        every: act only on keys every rank holds (freeing a lease: wait until each rank's
            counterpart released it) instead of keys any rank holds (ending a request).
        held: with ``every``, the keys this rank holds at all (``local``'s among them): a rank
            that does not hold a key does not hold it back (a lease some ranks never took).
    Returns:
        the agreed ``{key: why}`` (``why`` of the lowest rank that holds the key), a new dict.
    """
    if group is None:
        return dict(local)
    import torch.distributed as dist

    n = dist.get_world_size(group)
    if n <= 1:
        return dict(local)
    strict = every and held is None
    cnt = torch.tensor([len(local)], dtype=torch.int64)
    dist.all_reduce(cnt, op=dist.ReduceOp.MIN if strict else dist.ReduceOp.MAX, group=group)
    if int(cnt) == 0:
        return {}
    seen: list = [None] * n
    mine = (sorted(local.items()), sorted(set(held) | set(local)) if held is not None else None)
    dist.all_gather_object(seen, mine, group=group)
    dicts = [dict(x[0]) for x in seen]
    keys = set().union(*dicts)
    if every:
        holds = [set(x[1]) if x[1] is not None else None for x in seen]
        keys = {k for k in keys if all(k in d or (h is not None and k not in h) for d, h in zip(dicts, holds))}
    return {k: next(d[k] for d in dicts if k in d) for k in sorted(keys)}


def agent_name(role: str, tp_rank: int) -> str:
    """A NIXL agent name unique per process: ``oasis-<role>-<8 hex>-tp<rank>``."""
    return f"oasis-{role}-{uuid.uuid4().hex[:8]}-tp{tp_rank}"


def _page_list(pages) -> torch.Tensor:
    """``[N]`` int64 host pages on the CPU. Raises ValueError for a bool mask or floats."""
    t = torch.as_tensor(pages)
    if t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex:
        raise ValueError(f"OasisKV PD: page numbers must be integers, got {t.dtype}")
    return t.reshape(-1).to("cpu", torch.int64)


@dataclass
class Lease:
    """A prefill request whose KV pages are held for a decode node: ``release()`` frees them
    (SGLang's ``release_kv_cache`` of the request), ``deadline`` is ``time.monotonic()`` seconds,
    ``page`` the page here of the transfer's last token: it names the transfer (a request
    retracted on its decode node and recomputed here is transferred again under the same room,
    into pages allocated while the first transfer's were still held, so its last page differs)."""
    release: object
    deadline: float
    rid: str
    tokens: int = 0
    page: int | None = None


class PrefillSide:
    """Prefill node: the host tier registered with NIXL (the staging pool) and the leases.

    Args:
        engine: this rank's ``core.OasisSparseKV``. lease_s: ``OasisConfig.pd_lease_s``.
        tp_rank, tp_size: this (attention) TP rank, which names the NIXL agent, and the node's
            TP size; both go in the layout (a decode rank reads from the prefill rank of its own
            KV heads: ``TierLayout.compatible``).
    """

    role = "prefill"

    def __init__(self, engine, lease_s: float, tp_rank: int = 0, tp_size: int = 1):
        self.engine = engine
        self.tier = NixlTier(engine.host.k, engine.host.v, agent_name("prefill", tp_rank),
                             cpu_engine=engine.device.type == "cpu", sparse_layers=tuple(engine.sparse_layers),
                             num_layers=engine.num_layers, tp=(tp_rank, tp_size))
        self.lease_s = float(lease_s)
        self.leases: dict[int, Lease] = {}
        # leases this rank would free (released here, or expired) -> "released" / "expired"; with
        # TP they are freed once every rank would (``tp_agree``), so the ranks' pages stay alike
        self.freeing: dict[int, str] = {}
        self.released = self.expired = 0
        self.first_steps_sent = 0        # requests sent with a first-step working set planned here

    def prepare_send(self, pool, row: int, req_to_token_row: torch.Tensor, prompt_len: int, room: int = 0) -> int:
        """Right before a request's send (its last chunk; the chunks before it are held back by
        ``sglang_hooks.should_send_kv_chunk_hook``), fill what that send carries besides SGLang's
        own data, at the request's pages:

        - the bf16 summaries (``pool.pd_summaries``, when the engine's are wider): the request's
          min / max key summaries rounded outward (``admission.round_outward``: min down, max up,
          so the Quest bound still holds for every key of a block);
        - both copies of ``pd_first_step``: the first decode step's working set this node
          planned for it (``admission.first_step_mask``), tagged with its bootstrap ``room``; a
          failure there only costs the plan (logged; the decode node then selects the first
          step itself).

        On CUDA the plan is read after that row's plan event and the writes run on the engine's
        side stream, which the host then waits for (NIXL's thread reads the regions next); the
        request's pages are read from SGLang's table on the current stream, as SGLang's own send
        that follows does.

        Args:
            pool: the ``OasisKVPool`` (no regions yet: nothing is written). row: the request's row.
            req_to_token_row: its ``[max_len]`` token slots. prompt_len: tokens sent.
            room: its bootstrap room (the tag its decode node checks).
        Returns: the (block, sparse layer, KV head) entries of the plan (0: none planned).
        Raises:
            ValueError: a bad length.
        """
        eng = self.engine
        if not 0 < prompt_len <= req_to_token_row.numel():
            raise ValueError(f"OasisKV PD: prepare_send: prompt_len {prompt_len!r} not in "
                             f"1..{req_to_token_row.numel()}")
        pages = request_pages(req_to_token_row, prompt_len, eng.bs)
        staged = getattr(pool, "pd_summaries", None)
        regions = getattr(pool, "pd_first_step", None)
        mask = None
        if regions is not None:
            try:
                pages, mask = first_step_mask(eng, row, req_to_token_row, prompt_len, room)
            except Exception as e:  # noqa: BLE001 - the request is still sent, without a plan
                logger.warning("OasisKV PD: the first decode step of row %s was not planned for its decode node: %s",
                               row, e)
                L = len(eng.sparse_layers)
                mask = torch.zeros((pages.numel(), first_step_width(L, eng.head_num)), dtype=torch.int16)
                mask[:, L * eng.head_num:] = room_tag(room)
        cuda = eng.device.type == "cuda"
        side = eng.side_stream() if cuda else None
        with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
            if staged is not None:
                pd = pages.to(eng.device)
                for li in range(len(eng.sparse_layers)):
                    lo, hi = round_outward(eng.summaries.kmin[li][pd], eng.summaries.kmax[li][pd],
                                           staged[0][li].dtype)
                    staged[0][li][pd.to(staged[0][li].device)] = lo.to(staged[0][li].device)
                    staged[1][li][pd.to(staged[1][li].device)] = hi.to(staged[1][li].device)
            if mask is not None:
                dev = regions[0].device
                pd, m = pages.to(dev), mask.to(dev, regions[0].dtype)
                for t in regions:
                    t[pd] = m
        if cuda:
            side.synchronize()
        n = 0 if mask is None else int((mask[:, :-TAG_COLS] > 0).sum())
        self.first_steps_sent += bool(n)
        return n

    def layout_b64(self) -> str:
        return base64.b64encode(self.tier.layout(self.lease_s).to_bytes()).decode()

    def close(self) -> None:
        """Deregister the staging pool and end the NIXL agent (``NixlTier.close``); the leases
        are left as they are (the process is ending). Idempotent."""
        self.tier.close()

    def lease(self, room: int, release, rid: str = "", tokens: int = 0, page: int | None = None) -> None:
        """Hold a transferred request's pages until its decode node releases them (or
        ``lease_s`` passes without a renewal). ``release``: a callable freeing them (called
        once); ``tokens``: the KV slots it holds outside the radix cache (SGLang's idle memory
        check counts them); ``page``: the page of its last transferred token (:class:`Lease`)."""
        room = int(room)
        self.freeing.pop(room, None)
        old = self.leases.pop(room, None)
        if old is not None:          # a room transferred again while its lease is held: free the old pages first
            self._free(room, old)
        self.leases[room] = Lease(release, time.monotonic() + self.lease_s, rid, int(tokens),
                                  None if page is None else int(page))

    def _free(self, room: int, lease: Lease) -> None:
        try:
            lease.release()
        except Exception:  # noqa: BLE001 - one request's release must not stop the prefill loop
            logger.exception("OasisKV PD: freeing the pages of request %s (room %d) failed", lease.rid, room)

    def held_tokens(self) -> int:
        """KV slots (tokens) held by leases, outside the radix cache."""
        return sum(x.tokens for x in self.leases.values())

    def poll(self, now: float | None = None, group=None) -> int:
        """Free the leases the decode nodes released (NIXL notifications) or that expired.
        Called from the prefill scheduler's loop, at the same iteration on every TP rank
        (``group``: SGLang's attention-TP CPU group; a lease is freed once every rank would free
        it, ``tp_agree``). Returns leases freed.

        Messages: ``oasis-release:<room>[:<page>]`` and ``oasis-renew:<room>``. With ``page`` (the
        transfer's last page here, :class:`Lease`), only the lease of that transfer is freed: a
        release sent when a request was retracted on its decode node cannot free the lease of its
        recompute's transfer. A renewal takes back an expiry not yet agreed."""
        notifs = {}
        if not self.tier.closed:
            try:
                notifs = self.tier.agent.get_new_notifs()
            except Exception as e:  # noqa: BLE001 - a notification error must not stop the prefill loop
                logger.warning("OasisKV PD: reading NIXL notifications failed: %s", e)
        now = time.monotonic() if now is None else now
        for msgs in notifs.values():
            for m in msgs:
                kind = RELEASE if m.startswith(RELEASE) else RENEW if m.startswith(RENEW) else None
                digits, sep, g = (m[len(kind):] if kind else b"").partition(b":")
                if not (digits.isdigit() and len(digits) <= 20) or (sep and not (g.isdigit() and len(g) <= 19)):
                    continue                 # not ours, or malformed: ignored
                room, page = int(digits), int(g) if sep else None
                held = self.leases.get(room)
                if held is None:
                    continue
                if kind == RENEW:
                    held.deadline = now + self.lease_s
                    if self.freeing.get(room) == "expired":
                        del self.freeing[room]
                    continue
                if page is not None and held.page is not None and held.page != page:
                    continue                 # the release of an earlier transfer of this room
                self.freeing[room] = "released"
        for room, x in self.leases.items():
            if x.deadline <= now and room not in self.freeing:
                self.freeing[room] = "expired"
        n = 0
        for room, why in tp_agree(self.freeing, group, every=True, held=self.leases.keys()).items():
            self.freeing.pop(room, None)
            lease = self.leases.pop(room, None)
            if lease is None:
                continue
            if why == "expired":
                logger.warning("OasisKV PD: lease of request %s (room %d) expired: no release or renewal from its "
                               "decode node for %.0f s; its pages are freed", lease.rid, room, self.lease_s)
                self.expired += 1
            else:
                self.released += 1
            self._free(room, lease)
            n += 1
        if n:
            logger.info("OasisKV PD: freed %d lease(s); released by decode nodes: %d, expired: %d, held now: %d",
                        n, self.released, self.expired, len(self.leases))
        return n


@dataclass
class Admitted:
    """A decode-node request admitted from a prefill node: ``pages [N]`` int64 its host pages
    here (block by block), ``peer`` the prefill node's NIXL agent, ``room`` its bootstrap room,
    ``src_last`` the prefill node's page of its last block (names the transfer in releases:
    ``PrefillSide.lease``), ``renewed`` the :func:`lease_clock` time the last renewal of its
    lease was sent (its admission first), ``retry`` whether the last renewal failed (it is
    sent again at the renewal thread's next tick), ``lease_s`` its lease's length (the shorter
    of the two nodes' ``pd_lease_s``)."""
    pages: torch.Tensor
    peer: str
    room: int
    rid: str
    src_last: int = -1
    renewed: float = 0.0
    lease_s: float = 60.0
    retry: bool = False


@dataclass
class _FirstStep:
    """An admitted request's first step, between :meth:`DecodeSide.admit` and its log line:
    ``ids [L, H, K]`` the plan (``None``: none to read), ``pages [N]`` its host pages, ``sent`` /
    ``full`` bytes of its SGLang transfer and of a full one, ``why`` a plan was not used."""
    row: int
    ids: torch.Tensor | None
    pages: torch.Tensor
    prompt_len: int
    peer: str
    rid: str
    sent: int
    full: int
    why: str | None = None


class DecodeSide:
    """Decode node: this host tier registered with NIXL (the READs' destination), the peers'
    layouts, and which request rows were admitted from which peer.

    Args:
        engine: this rank's ``core.OasisSparseKV`` (``attach_remote`` is called on it).
        pool: the ``OasisKVPool`` (its ``pd_page_ids`` receive the prefill pages).
        read_timeout_s: ``OasisConfig.pd_read_timeout_s`` (seconds per NIXL read).
        tp_rank: this (attention) TP rank (names the NIXL agent; its blocks are read from the
            prefill node's rank of the same number, which holds the same KV heads).
        tp_size: the node's TP size (must equal the prefill node's: ``TierLayout.compatible``).
        lease_s: ``OasisConfig.pd_lease_s``
            (leases are renewed every quarter to three eighths of it, or of the prefill node's
            if shorter, by a thread started at the first admission: :meth:`renew`).
        free_pages: returns ``[F]`` int64 the pages SGLang's allocator holds free, those of
            its open free group included (``sglang_glue.install.free_pages_of``): a freed
            request's blocks that share an OS page with free neighbours are given back with
            them, and once no request is held every free block still resident
            (:meth:`_sweep_idle`); ``None``: only whole OS pages inside the request's own blocks.
    Raises:
        ValueError: ``read_timeout_s`` not > 0 (``RemoteBlockFetcher``).
    """

    role = "decode"

    RETRY_S = 10.0        # a prefill node whose layout could not be had is asked again after this
    RECHECK_S = 2.0       # a peer holding no request here is asked for its layout again after this

    def __init__(self, engine, pool, read_timeout_s: float, tp_rank: int = 0, lease_s: float = 60.0,
                 free_pages=None, tp_size: int = 1):
        self.engine, self.pool = engine, pool
        self.free_pages = free_pages
        self.tp_rank = int(tp_rank)
        # a compact host tier (OasisSparseKV(host_slots=...), ``pd_host_slots``): its two pools
        self.tier = NixlTier.of_host(engine.host, agent_name("decode", tp_rank),
                                     cpu_engine=engine.device.type == "cpu", sparse_layers=tuple(engine.sparse_layers),
                                     num_layers=engine.num_layers, tp=(tp_rank, tp_size))
        self.fetcher = RemoteBlockFetcher(self.tier, timeout_s=read_timeout_s)
        self.remote = RemoteBlocks(len(engine.sparse_layers), engine.head_num, engine.host.num_pages,
                                   fetch=self.fetcher.fetch, device=engine.device,
                                   post=self.fetcher.post, poll=self.fetcher.poll)
        engine.attach_remote(self.remote)
        host, mib = engine.host, 2 ** 20
        whole = host.num_layers * host.head_num * host.num_pages * engine.block_bytes
        if host.compact:
            logger.info("OasisKV PD: decode node's host tier registered with NIXL as agent %s: a compact pool of %d "
                        "pieces (pd_host_slots), %.2f MiB, instead of %.2f MiB for every block of its %d pages",
                        self.tier.name, host.num_slots, host.nbytes / mib, whole / mib, host.num_pages)
        else:
            logger.info("OasisKV PD: decode node's host tier registered with NIXL as agent %s: every block of its %d "
                        "pages, %.2f MiB (%s)", self.tier.name, host.num_pages, host.nbytes / mib,
                        "committed as blocks are read or decoded" if host.on_demand else "page-locked whole")
        P = (pool.size + pool.page_size) // pool.page_size        # pages of every transfer region (pool.py)
        # the prefill node's page of each block arrives here with SGLang's transfer; -1: none yet
        pool.pd_page_ids = [torch.full((P,), -1, dtype=torch.int64, device=pool.device) for _ in range(2)]
        # the first step's working set the prefill node planned, per block (admission.first_step_mask)
        pool.pd_first_step = [torch.zeros((P, first_step_width(len(engine.sparse_layers), engine.head_num)),
                                          dtype=torch.int16, device=pool.device) for _ in range(2)]
        # admitted rows whose planned first step is still to be read and installed
        self._first: list[_FirstStep] = []
        self.installed_now: list[tuple[int, str]] = []   # (row, rid) installed by the last install_first_steps
        self.first_steps_planned = 0     # requests whose first step used the prefill node's plan
        self.first_steps_rejected = 0    # requests whose plan arrived but was not used (refused, read or install failed)
        self.peers: dict[tuple[str, int], str] = {}          # (bootstrap host, port) -> agent
        self.rows: dict[int, Admitted] = {}
        self.aborted = 0
        self.admission_bytes = self.full_transfer_bytes = 0       # over every admitted request
        self._failed: dict[tuple[str, int], tuple[float, str]] = {}   # (host, port) -> (retry after, why)
        # prefill agents found gone by another thread (a renewal that NIXL answered with its
        # remote-disconnect error), marked lost in the scheduler's thread (``take_down``)
        self._down: dict[str, str] = {}
        # prefill agent -> time.monotonic() its layout was last had from its bootstrap server
        # (``peer_for`` asks again before admitting from a peer that holds no request here)
        self._checked: dict[str, float] = {}
        self.lease_s = float(lease_s)
        # a row whose lease may have expired on its prefill node: no renewal for STALE of the
        # lease (a stopped process, renewals failing); its pages there may be another request's
        self.stale: dict[int, str] = {}
        self._cut: set[int] = set()                # stale rows whose pages are no longer read
        self.peer_lease: dict[str, float] = {}     # prefill agent -> its pd_lease_s (TierLayout)
        self.renewals = 0                                           # renewal notifications sent
        # the rows: changed by the scheduler's thread, read by the renewal thread
        self._rows_lock = threading.Lock()
        self._renewer: threading.Thread | None = None
        self._stop_renewing = threading.Event()
        self._wake = threading.Event()
        # lease_clock() time before which no row can turn stale: the check before every batch
        # skips its loop over the rows until then (renewals only move a row's time later)
        self._next_stale = float("inf")
        # released requests: their bytes in this host tier, and what a whole allocation holds
        self.released_requests = self.held_bytes_total = self.whole_bytes_total = 0
        self.swept_bytes = 0            # host-tier bytes the idle sweep gave back (``_sweep_idle``)
        # bytes per page of the draft model's KV cache, which SGLang sends whole (set by the glue; None: not yet read)
        self.draft_page_bytes: int | None = None
        self.retracted = 0

    # ---- peers ------------------------------------------------------------------------------
    def peer_for(self, host: str, port: int, tries: int = 3) -> str:
        """The NIXL agent of the prefill node behind bootstrap ``host:port`` (its layout fetched
        from the bootstrap server; runs in the decode scheduler's loop, so it gives up within a
        few seconds and remembers a failure for ``RETRY_S``). A known peer that holds no request
        here is asked again when its layout is older than ``RECHECK_S``: a prefill node
        restarted on the same address is a new NIXL agent, and the old one, not read from since,
        is not known to be gone (a peer holding requests is watched by their renewals).

        Raises:
            PeerLostError: no layout there (not an OasisKV prefill node, or unreachable), a
                layout this node cannot read from (another block size, head count, layers),
                or a lost node still backing requests being ended.
        """
        self.take_down()
        key = (str(host), int(port))
        agent = self.peers.get(key)
        if agent is not None and agent not in self.remote.lost and (
                time.monotonic() - self._checked.get(agent, 0.0) < self.RECHECK_S or self._holds(agent)):
            return agent
        failed = self._failed.get(key)
        if failed is not None and time.monotonic() < failed[0]:
            raise PeerLostError(f"{key[0]}:{key[1]}", failed[1])
        if agent is not None and agent in self.remote.lost:   # take it back (or a new node there) once its requests ended
            if not self.remote.forget_lost(agent):
                raise PeerLostError(agent, "lost; its requests are still being ended")
            self._forget_peer(key, agent)
            agent = None
        lay = self._layout_at(key, tries)
        if agent is not None:
            if lay.agent == agent:
                self._checked[agent] = time.monotonic()
                return agent
            logger.warning("OasisKV PD: the prefill node at %s:%d is a new process (NIXL agent %s, was %s)",
                           key[0], key[1], lay.agent, agent)
            self._forget_peer(key, agent)
        try:
            return self.add_peer(key, lay)
        except Exception as e:  # noqa: BLE001 - a layout we cannot use: no retry helps
            why = (f"no usable OasisKV host tier at its bootstrap server (unusable host tier layout: "
                   f"{type(e).__name__}: {e}); run the prefill node with --kv-sparse oasis and the same "
                   "--kv-sparse-config")
            self._failed[key] = (time.monotonic() + self.RETRY_S, why)
            raise PeerLostError(f"{key[0]}:{key[1]}", why) from None

    def _forget_peer(self, key: tuple[str, int], agent: str) -> None:
        self.fetcher.remove_peer(agent)
        self._checked.pop(agent, None)
        self.peers.pop(key, None)

    def _holds(self, agent: str) -> bool:
        """Whether a request admitted from ``agent`` is held here."""
        with self._rows_lock:
            return any(a.peer == agent for a in self.rows.values())

    def _layout_at(self, key: tuple[str, int], tries: int) -> TierLayout:
        """The host tier layout the bootstrap server at ``key`` = ``(host, port)`` serves
        (``tries`` HTTP GETs of 2 s at most). Raises PeerLostError, remembered for ``RETRY_S``:
        none there, or a malformed one."""
        import requests

        h = connect_host(key[0])
        url = f"http://{'[' + h + ']' if ':' in h else h}:{key[1]}{TIER_ROUTE}?rank={self.tp_rank}"
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
                    return TierLayout.from_bytes(base64.b64decode(r.json()["layout"], validate=True))
                except Exception as e:  # noqa: BLE001 - a layout we cannot use: no retry helps
                    why = f"unusable host tier layout: {type(e).__name__}: {e}"
                    break
            why = f"HTTP {r.status_code}: {r.text[:200]}"
            if r.status_code == 404:
                break
            time.sleep(0.5 * (i + 1))
        why = (f"no usable OasisKV host tier at its bootstrap server ({why}); run the prefill node with "
               "--kv-sparse oasis and the same --kv-sparse-config")
        self._failed[key] = (time.monotonic() + self.RETRY_S, why)
        raise PeerLostError(f"{key[0]}:{key[1]}", why)

    def add_peer(self, key: tuple[str, int], lay: TierLayout) -> str:
        """Use the prefill node behind bootstrap address ``key`` (``(host, port)``) whose host
        tier is ``lay`` (``peer_for`` got it from the bootstrap server). Its requests' leases are
        renewed and checked by the shorter of its ``pd_lease_s`` (``lay.lease_s``) and this
        node's. Returns its NIXL agent. Raises ValueError: a tier this node cannot read
        (``RemoteBlockFetcher.add_peer``)."""
        agent = self.fetcher.add_peer(lay)
        self.peers[key] = agent
        self._checked[agent] = time.monotonic()
        if lay.lease_s > 0:
            self.peer_lease[agent] = lay.lease_s
            if lay.lease_s != self.lease_s:
                logger.warning("OasisKV PD: prefill node %s holds pages for %g s without a renewal, this node's "
                               "pd_lease_s is %g: its requests' leases are renewed and checked by the shorter "
                               "(give both nodes the same --kv-sparse-config)", agent, lay.lease_s, self.lease_s)
        self.remote.forget_lost(agent)
        self._failed.pop(key, None)
        return agent

    def renew(self, due_only: bool = True) -> int:
        """Keep the leases of the requests decoding here alive on their prefill nodes: one
        ``oasis-renew:<room>`` notification per request (none to a lost node, none for a stale
        row), for each request whose last renewal is a quarter of its lease old (``due_only``)
        or for every one. The renewal thread calls it every eighth of the shortest lease
        (:meth:`_renew_loop`), not the scheduler's loop: a decode step that runs long (a
        synchronous read, a slow CPU step) or a request waiting in SGLang's queues must not lose
        its lease, while a process that died stops renewing at once.

        Returns: notifications sent. Thread-safe (NIXL agents here use STRICT thread sync).
        """
        if self.tier.closed:
            return 0
        now = lease_clock()
        self.check_stale(now)
        with self._rows_lock:
            due = [a for r, a in self.rows.items()
                   if r not in self.stale and (not due_only or a.retry or now - a.renewed >= a.lease_s / 4)]
        return sum(self._renew_one(a) for a in due)

    def _tick(self) -> float:
        """Seconds the renewal thread sleeps: an eighth of the shortest lease held (at most a day)."""
        with self._rows_lock:
            lease = min([self.lease_s] + [a.lease_s for a in self.rows.values()])
        return min(lease / 8, 86400.0)

    def _renew_one(self, adm: Admitted) -> int:
        agent = self.tier.agent
        if adm.peer in self.remote.lost or agent is None:
            return 0
        t = lease_clock()                # before the send: the prefill node may count from its start
        if t - adm.renewed > self.STALE * adm.lease_s:
            self._next_stale = t         # too late (the process stalled since the check): the lease may be gone
            self.check_stale(t)
            return 0
        try:
            agent.send_notif(adm.peer, RENEW + str(adm.room).encode())
        except Exception as e:  # noqa: BLE001 - the next read from that peer decides whether it is lost
            if is_disconnect(e):
                self.peer_down(adm.peer, f"renewing a lease: {type(e).__name__}: {e}")
            logger.warning("OasisKV PD: renewing the lease of request %s failed: %s", adm.rid, e)
            adm.retry = True
            return 0
        adm.renewed, adm.retry = t, False
        with self._rows_lock:
            self.renewals += 1
        return 1

    def peer_down(self, agent: str, why: str) -> None:
        """Any thread: the prefill node of NIXL agent ``agent`` is gone (NIXL answered a
        notification to it with its remote-disconnect error). Its requests end with an error
        before the next batch, whether or not they would read from it again (the scheduler's
        thread marks it lost: :meth:`take_down`, called by :meth:`cut_off_stale`)."""
        with self._rows_lock:
            self._down.setdefault(agent, why)

    def take_down(self) -> dict[str, str]:
        """Scheduler's thread: mark lost the peers :meth:`peer_down` reported
        (``RemoteBlocks.lost``: their pieces are no longer read, :meth:`lost_rows` ends their
        requests). Returns them -> why."""
        if not self._down:
            return {}
        with self._rows_lock:
            down, self._down = self._down, {}
        for agent, why in down.items():
            if agent in self.fetcher.peers and agent not in self.remote.lost:
                self.remote.lost[agent] = why
                logger.error("OasisKV PD: prefill node %s lost (%s): its requests end", agent, why)
        return down

    def probe(self, key: tuple[str, int]) -> tuple[int, int]:
        """Any thread (``sglang_hooks.node_failure_hook``: SGLang's heartbeat found the bootstrap
        server at ``key`` = ``(host, port)`` down): renew now every lease held there, so that a
        process that is gone is found at once (:meth:`peer_down`) while one that only stalled is
        not (its leases decide: :meth:`check_stale`); a peer that holds nothing is asked for its
        layout again before it is used (:meth:`peer_for`). Returns ``(requests held there,
        renewals sent)``."""
        agent = self.peers.get((str(key[0]), int(key[1])))
        if agent is None or self.tier.closed:
            return 0, 0
        self._checked[agent] = float("-inf")
        with self._rows_lock:
            held = [a for r, a in self.rows.items() if a.peer == agent and r not in self.stale]
        return len(held), sum(self._renew_one(a) for a in held)

    STALE = 0.9

    def check_stale(self, now: float | None = None) -> dict[int, str]:
        """Rows whose lease was not renewed for ``STALE`` (0.9) of its length (``Admitted.lease_s``):
        their prefill node may have freed their pages already (and given them to another
        request), so their blocks must not be read any more (:meth:`cut_off_stale`);
        :func:`~.sglang_hooks.abort_lost` ends them with an error. Happens when this process was stopped, or its renewals
        failed, for most of a lease. Returns the stale rows -> why."""
        now = lease_clock() if now is None else now
        if now < self._next_stale and not self.stale:
            return {}                    # no row can be stale yet: no loop over the rows (before every batch)
        with self._rows_lock:
            nxt = float("inf")
            for r, a in self.rows.items():
                if r in self.stale or a.peer in self.remote.lost:
                    continue
                if now - a.renewed > self.STALE * a.lease_s:
                    self.stale[r] = (f"its lease on prefill node {a.peer} was last renewed {now - a.renewed:.1f} s "
                                     f"ago (pd_lease_s {a.lease_s:g}): its pages there may have been freed")
                    logger.error("OasisKV PD: request %s: %s", a.rid, self.stale[r])
                else:
                    nxt = min(nxt, a.renewed + self.STALE * a.lease_s)
            self._next_stale = nxt
            return dict(self.stale)

    def cut_off_stale(self) -> dict[int, str]:
        """Scheduler's thread, before a batch: start no more reads of the pages of stale rows
        (``RemoteBlocks.cut_off``; SGLang still runs an ending request's last forward, which must
        not read pages that may be another request's; reads already in flight land in the
        request's own pages); peers found gone meanwhile are marked lost first (:meth:`take_down`).
        Returns the stale rows -> why."""
        self.take_down()
        stale = self.check_stale()
        for r in stale:
            adm = self.rows.get(r)
            if adm is not None and r not in self._cut:
                self.remote.cut_off(adm.pages)
                self._cut.add(r)
        return stale

    def _renew_loop(self) -> None:
        while not self._stop_renewing.is_set():
            self._wake.wait(self._tick())         # woken early by an admission (its lease may be shorter)
            self._wake.clear()
            if self._stop_renewing.is_set():
                return
            try:
                self.renew()
            except Exception:  # noqa: BLE001 - a renewal that failed must not end the thread
                logger.exception("OasisKV PD: renewing leases failed")

    def _start_renewer(self) -> None:
        """Start the renewal thread (daemon; once per side, at the first admission)."""
        if self._renewer is None and not self._stop_renewing.is_set():
            self._renewer = threading.Thread(target=self._renew_loop, name="oasis-pd-renew", daemon=True)
            self._renewer.start()

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
              room: int, rid: str = "", install: bool = True) -> None:
        """A request whose SGLang transfer completed: its pages here are backed by the prefill
        node's pages (``pd_page_ids``, received with the transfer); nothing of its sparse
        layers' K/V is here yet. When the transfer carried the first decode step's working set
        the prefill node planned (``pd_first_step``; ``admission.plan_from_mask``) and this
        node's predictor is asynchronous, those blocks are read now and installed in its row
        (:meth:`install_first_steps`), so its first step is a predicted one; otherwise its row
        starts empty and its first step selects synchronously.

        Args:
            row: the request's row in SGLang's request table. req_to_token_row: ``[max_len]``
                integer token slots of that row. prompt_len: prompt tokens (their KV was sent).
            host, port: the request's bootstrap address (finds its prefill node). room: its
                bootstrap room (names its lease there). rid: for log lines.
            install: read and install the planned first step now; ``False``: queue it for
                :meth:`install_first_steps` (one read per peer for several admissions).

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
        src2 = self.pool.pd_page_ids[1][pd].to("cpu")
        # cleared here, once read (the reads above waited for the stream), not when the request
        # ends: a clear queued then runs after the step in flight, and by then SGLang may have
        # given the pages to the next request, whose transfer (written by the prefill node, not
        # by stream work) it would wipe
        for t in self.pool.pd_page_ids:
            t.index_fill_(0, pd, -1)
        first, why = None, None
        regions = getattr(self.pool, "pd_first_step", None)
        if regions is not None:
            m0, m1 = (t[pd].to("cpu") for t in regions)
            for t in regions:
                t.index_fill_(0, pd, 0)
            first, why = self._first_step_plan(m0, m1, prompt_len, room)
        if bool((src < 0).any()) or not torch.equal(src, src2):
            raise ValueError("OasisKV PD: the transfer did not carry the prefill node's page numbers (is the prefill "
                             "node running --kv-sparse oasis with the same block_size and dense_layers?)")
        if int(src.max()) >= self.fetcher.peers[peer].num_pages:
            raise ValueError(f"OasisKV PD: received page numbers up to {int(src.max())}, but the prefill node's host "
                             f"tier has {self.fetcher.peers[peer].num_pages} pages")
        self.engine.reset_rows([row])
        self.engine.note_new_request()         # its first step writes the OasisKV decode log line
        staged = getattr(self.pool, "pd_summaries", None)
        if staged is not None:          # the summaries crossed in bf16 (PrefillSide.prepare_send)
            sm = self.engine.summaries
            for li in range(len(self.engine.sparse_layers)):
                sm.kmin[li][pages.to(sm.kmin[li].device)] = staged[0][li][pd].to(sm.kmin[li].device, sm.kmin[li].dtype)
                sm.kmax[li][pages.to(sm.kmax[li].device)] = staged[1][li][pd].to(sm.kmax[li].device, sm.kmax[li].dtype)
        self.remote.admit(pages, peer, src)
        now = lease_clock()
        adm = Admitted(pages, peer, int(room), rid, int(src[-1]), now,
                       min(self.lease_s, self.peer_lease.get(peer, self.lease_s)))
        with self._rows_lock:
            self.rows[int(row)] = adm
            self.stale.pop(int(row), None)
            self._cut.discard(int(row))
            self._next_stale = min(self._next_stale, now + self.STALE * adm.lease_s)
        self._renew_one(adm)           # at once: its lease was made when the prefill node saw the transfer end
        self._start_renewer()
        self._wake.set()               # the thread's tick follows the shortest lease held
        n = pages.numel()
        draft = self.draft_page_bytes or 0
        sent = n * (getattr(self.pool, "pd_page_bytes", 0) + draft)
        full = n * (getattr(self.pool, "pd_full_page_bytes", 0) + draft)
        self.admission_bytes += sent
        self.full_transfer_bytes += full
        pending = _FirstStep(int(row), first, pages, prompt_len, peer, rid, sent, full, why)
        if first is not None:
            self._first.append(pending)         # logged once its blocks are read (install_first_steps)
        else:
            self._log_admitted(pending, 0)
        if install:
            self.install_first_steps()

    def _first_step_plan(self, m0: torch.Tensor, m1: torch.Tensor, prompt_len: int, room: int):
        """The first step's working set from the two received copies of a request's
        ``pd_first_step`` rows (``[N, width]`` int16 each): ``(ids [L, H, K] or None, why not)``;
        ``why`` is ``None`` when there was nothing to use (the prefill node planned nothing, or
        this node's predictor selects every step itself)."""
        eng = self.engine
        L, H = len(eng.sparse_layers), eng.head_num
        if not eng.predictor.asynchronous:
            return None, None
        if m0.shape[-1] != first_step_width(L, H):
            return None, f"its mask has {m0.shape[-1]} columns, this node {first_step_width(L, H)}"
        slots = m0[:, :L * H]
        if not bool(slots.any()) and not bool(m1[:, :L * H].any()):
            return None, None                    # nothing planned (or nothing of OasisKV's sent)
        if not torch.equal(m0, m1):
            return None, "the mask's two copies differ"
        if not bool((m0[:, L * H:] == room_tag(room)).all()):
            return None, "another request's plan on a shared page (a cached prefix sent meanwhile)"
        ids = plan_from_mask(slots.view(-1, L, H).permute(1, 2, 0), prompt_len, eng.bs, eng.ws.K)
        return ids, (None if ids is not None else "not a plan this node can use (slots, budget or the new "
                     "token's block)")

    def _log_admitted(self, p: "_FirstStep", first_bytes: int) -> None:
        """The ``admitted request`` log line; ``first_bytes``: the planned first step's blocks
        read at admission (they cross then too)."""
        sent = p.sent + first_bytes
        self.admission_bytes += first_bytes
        self.first_steps_rejected += bool(p.why)
        if not sent:
            return
        mib = 2 ** 20
        draft = bool(self.draft_page_bytes)
        if first_bytes and not p.why:
            how = (f"its {first_bytes // self.engine.block_bytes} prompt block pieces (sparse layer x KV head x "
                   f"block) planned on the prefill node "
                   f"({first_bytes / mib:.2f} MiB read at admission)")
        elif p.why:
            how = f"selected here (the prefill node's plan not used: {p.why})"
        else:
            how = "selected here (read on demand)"
        logger.info("OasisKV PD: admitted request %s from %s: %d prompt tokens, %.2f MiB at admission (dense "
                    "layers, summaries, page numbers, first-step masks%s%s) vs %.2f MiB for a full transfer "
                    "(%.2fx less); first step's working set: %s; read on demand since start-up: %.2f MiB in %d NIXL "
                    "reads", p.rid, p.peer, p.prompt_len, sent / mib, ", draft model's KV" if draft else "",
                    ", first step's blocks" if first_bytes else "", p.full / mib, p.full / sent, how,
                    *self._on_demand())

    def _on_demand(self) -> tuple[float, int]:
        """MiB and NIXL reads from prefill nodes so far, the planned first steps' reads at
        admission left out (for the log lines)."""
        st, r = self.fetcher.stats, self.remote
        return (st.bytes - r.first_step_bytes) / 2 ** 20, st.transfers - r.first_step_reads

    def install_first_steps(self) -> int:
        """Read the planned first-step working sets of the rows admitted since the last call
        (one NIXL READ per peer with every request's pieces, all layers: ``RemoteBlocks.read_now``;
        the scheduler waits for it between batches, as a synchronous first step would inside
        its forward) and install them (``OasisSparseKV.install_working_set_from_host``), then log
        each request's admission. A row whose peer was lost meanwhile keeps an empty row: its
        first step selects and the lost peer ends it (:meth:`lost_rows`). Returns bytes read."""
        pend, self._first = self._first, []
        self.installed_now = []
        pend = [p for p in pend if p.row in self.rows and self.rows[p.row].pages is p.pages]
        if not pend:
            return 0
        ls, hs, ps = [], [], []
        for p in pend:
            li, h, k = torch.nonzero((p.ids >= 0) & (p.ids < p.pages.numel()), as_tuple=True)
            ls.append(li)
            hs.append(h)
            ps.append(p.pages[p.ids[li, h, k]])
        try:
            n = self.remote.read_now(torch.cat(ls), torch.cat(hs), torch.cat(ps))
        except Exception as e:  # noqa: BLE001 - the rows then select their first steps themselves
            logger.error("OasisKV PD: reading the planned first steps failed: %s", e)
            for p in pend:
                p.why = f"reading it failed: {e}"
                self._log_admitted(p, 0)
            return 0
        for p, li in zip(pend, ls):
            if p.peer in self.remote.lost:
                p.why = f"its prefill node was lost ({self.remote.lost[p.peer]})"
                self._log_admitted(p, 0)
                continue
            read = li.numel() * self.engine.block_bytes           # these crossed, installed or not
            try:
                self.engine.install_working_set_from_host(p.row, p.ids, p.pages, p.prompt_len + 1)
            except Exception as e:  # noqa: BLE001 - the row then selects its first step itself
                logger.error("OasisKV PD: installing the first step of request %s failed (%s); it selects its own",
                             p.rid, e)
                self.engine.reset_rows([p.row])
                p.why = f"installing it failed: {e}"
                self._log_admitted(p, read)
                continue
            self.first_steps_planned += 1
            self.installed_now.append((p.row, p.rid))
            self._log_admitted(p, read)
        return n

    def drop_first_steps(self, rows: dict[int, str]) -> None:
        """Empty the rows whose planned first step was installed by the last
        :meth:`install_first_steps` but not on every TP rank (``rows``: row -> rid): each
        rank's request table must say the same rows are predicted, since the decode CUDA graph's
        replay is decided from it (``OasisSparseKV.can_replay``) and every rank must take the
        same path. Their first steps select synchronously (the blocks read stay in the tier)."""
        if not rows:
            return
        self.engine.reset_rows(list(rows))
        for row, rid in rows.items():
            self.first_steps_planned -= 1
            self.first_steps_rejected += 1
            logger.info("OasisKV PD: request %s: its first step's plan was not used on every TP rank; it selects "
                        "its own", rid)

    def held_bytes(self, row: int, pages: torch.Tensor, tokens: int | None = None) -> int:
        """Bytes of request ``row``'s sparse-layer K/V in this node's host tier: the pieces of its
        prompt blocks read from its prefill node, plus every piece of its other complete blocks
        (written here by decode). ``pages [N]``: all its host pages, in order; ``tokens``: its
        token count (a partial last block is only in the working set)."""
        adm = self.rows.get(int(row))
        pages = _page_list(pages)
        remote = torch.zeros(0, dtype=torch.int64) if adm is None else adm.pages
        if tokens is not None and tokens % self.engine.bs and pages.numel() \
                and not bool(torch.isin(pages[-1:], remote).all()):
            pages = pages[:-1]
        own = pages[~torch.isin(pages, remote)]
        pieces = int(self.remote.present[:, :, remote].sum()) + own.numel() * self.remote.L * self.remote.H
        return pieces * self.engine.block_bytes

    def release(self, row: int, pages: torch.Tensor | None = None, tokens: int | None = None) -> None:
        """The request on ``row`` ended: its pages are this node's again, and its prefill node
        may free its pages (a NIXL notification; a lost peer is not told).

        Args:
            pages: ``[N]`` int64 every host page the request held (prompt and decoded blocks);
                their memory goes back to the OS (``HostTier.discard``, on-demand tiers; a compact
                tier: their slots, ``OasisSparseKV.free_host_pages``, after the reads into them) and the
                request's host-tier bytes are logged against a whole allocation. Default: its
                prompt pages.
            tokens: tokens the request held (its last block is partial when not a multiple of
                the block size: it lived in the working set only and is not counted as held).
        Raises:
            ValueError: ``pages`` not integers or outside ``0 .. P - 1`` (nothing changes).
        """
        adm = self.rows.get(int(row))
        gone = None
        if pages is not None:
            pages = _page_list(pages)
            P = self.engine.host.num_pages
            if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= P):
                raise ValueError(f"OasisKV PD: release: pages must be in 0..{P - 1}")
            others = [a.pages for r, a in self.rows.items() if r != int(row)]
            if others:           # never give back a block another admitted request holds
                pages = pages[~torch.isin(pages, torch.cat(others))]
            held = self.held_bytes(row, pages, tokens)
            if self.engine.host.compact:
                # a compact tier: the pages' slots go back once no read lands in them (no madvise)
                gone = pages
                self.remote.wait_reads_into(gone)
                self.engine.free_host_pages(gone)
            else:
                gone = self._with_free_neighbours(pages)
                self.remote.wait_reads_into(gone)          # no read may land in memory given back
                # only the runs of pieces that may hold data (read, installed or decoded here, or on a
                # dirty page: ``RemoteBlocks.written``) cost a madvise; the rest was given back before
                self.engine.host.discard(gone, written=self.remote.written(gone))
            if adm is not None and int(row) not in self._cut:   # (a cut-off row counts every piece as here)
                whole = pages.numel() * self.remote.L * self.remote.H * self.engine.block_bytes
                self.released_requests += 1
                self.held_bytes_total += held
                self.whole_bytes_total += whole
                mib = 2 ** 20
                less = "none held" if not held else "all of it" if held >= whole else f"{whole / held:.2f}x less"
                left = len(self.rows) - 1
                # the tier's resident memory (mincore over the whole tier: ~1 s for a large one) only once idle;
                # a compact tier: its pool's slots in use
                host = self.engine.host
                if host.compact:
                    res = (f"{host.num_slots - host.free_slots} of {host.num_slots} pool slots in use (peak "
                           f"{host.slots_peak}), "
                           f"{self.remote.slot_misses} reads waited for a slot so far")
                else:
                    res = "-" if left else f"{self._sweep_idle() / mib:.2f} MiB"
                logger.info("OasisKV PD: released request %s: its sparse layers' KV in this node's host tier %.2f MiB "
                            "(blocks read on demand or decoded here) vs %.2f MiB allocated whole (%s); host "
                            "tier resident %s, requests from prefill nodes held: %d; read on demand since start-up: %.2f "
                            "MiB in %d NIXL reads, %d pieces of them left out of a plan first (pd_read_mode "
                            "deferred); starting reads between steps: %.3f ms per step (%.3f ms of it reading "
                            "the plans' counts, %.3f ms marking ended reads' pieces present)", adm.rid, held / mib,
                            whole / mib, less, res, left, *self._on_demand(), self.remote.deferred_pieces,
                            1e3 * self.remote.service_s / max(1, self.remote.service_calls),
                            1e3 * self.remote.counts_s / max(1, self.remote.service_calls),
                            1e3 * self.remote.ended_s / max(1, self.remote.service_calls))
        with self._rows_lock:
            adm = self.rows.pop(int(row), None)
            self.stale.pop(int(row), None)
            self._cut.discard(int(row))
        if adm is not None:
            mine = adm.pages
            if self.engine.host.compact:        # (a compact tier frees their slots: not those another request holds)
                with self._rows_lock:
                    others = [a.pages for a in self.rows.values()]
                if others:
                    mine = mine[~torch.isin(mine, torch.cat(others))]
            self.remote.release(mine)           # (its pages' numbers in pd_page_ids were cleared at admission)
        self.engine.write_starved.discard(int(row))
        if gone is not None:
            self.remote.starved[gone] = False   # (decoded pages: given back, a next owner starts clean)
            self.remote.given_back(gone)        # (after ``release``, which marks its pages dirty)
        if adm is None:
            return
        if adm.peer in self.remote.lost:
            return
        try:
            self.tier.agent.send_notif(adm.peer, RELEASE + (f"{adm.room}:{adm.src_last}" if adm.src_last >= 0
                                                            else str(adm.room)).encode())
        except Exception as e:  # noqa: BLE001 - the lease then expires on the prefill node
            logger.warning("OasisKV PD: could not tell prefill node %s to free request %s's pages (%s); "
                           "its lease will expire", adm.peer, adm.rid, e)

    def _sweep_idle(self) -> int:
        """With no request from a prefill node held: give back the memory of every free block
        still resident (``HostTier.resident_pages``; a block whose OS page a neighbour held
        when it was released, or a read that landed after its request ended), then return the
        tier's resident bytes. Logs what it gave back (none is expected: it is a backstop)."""
        host = self.engine.host
        if not host.on_demand or host.compact:      # (a compact tier frees slots with their requests)
            return host.resident_bytes()
        stray = host.resident_pages()
        if stray.numel() and self.free_pages is not None:
            try:
                stray = stray[torch.isin(stray, _page_list(self.free_pages()))]
            except Exception as e:  # noqa: BLE001 - only memory is at stake
                logger.warning("OasisKV PD: reading the free pages failed (%s); no idle sweep", e)
                stray = stray[:0]
            held = [a.pages for a in self.rows.values()]
            if held and stray.numel():
                stray = stray[~torch.isin(stray, torch.cat(held))]
            if stray.numel():
                self.remote.wait_reads_into(stray)
                n = host.discard(stray)
                self.remote.given_back(stray)
                self.swept_bytes += n
                if n:                   # (0: blocks sharing an OS page with a held one, SGLang's padding page)
                    logger.info("OasisKV PD: idle: gave back the memory of %d free blocks still resident in the host "
                                "tier (%.2f MiB)", stray.numel(), n / 2 ** 20)
        return host.resident_bytes()

    def _with_free_neighbours(self, pages: torch.Tensor) -> torch.Tensor:
        """``pages`` and the free pages within an OS page of them (pieces smaller than an OS
        page share it with the neighbouring blocks; a free block's data is never read before it
        is written again, so giving its memory back is safe)."""
        host = self.engine.host
        k = -(-host_tier.OS_PAGE // max(1, host.piece_bytes))       # blocks that can share an OS page
        if k <= 1 or self.free_pages is None or not pages.numel():
            return pages
        try:
            free = _page_list(self.free_pages())
        except Exception as e:  # noqa: BLE001 - only memory is at stake: give back the request's own blocks
            logger.warning("OasisKV PD: reading the free pages failed (%s); giving back the request's own only", e)
            return pages
        near = (pages[:, None] + torch.arange(-(k - 1), k)[None, :]).reshape(-1)
        near = near[(near >= 0) & (near < host.num_pages)]
        near = near[torch.isin(near, free)]
        held = [a.pages for a in self.rows.values()]
        if held:                # never a block an admitted request holds, whatever the free list says
            near = near[~torch.isin(near, torch.cat(held))]
        return torch.unique(torch.cat([pages, near]))

    def request_freed(self, row: int, pages: torch.Tensor | None, bootstrap: tuple | None, rid: str = "",
                      retracted: bool = False, tokens: int | None = None) -> None:
        """SGLang freed the request on ``row`` (``DecodeReqToTokenPool.free``): release it
        (:meth:`release`). One that was never admitted here (aborted or failed while in SGLang's
        transfer queue) may still hold a lease on its prefill node: that node is told to free it
        now (:meth:`refuse`) instead of at expiry.

        Args:
            pages: ``[N]`` int64 every host page it held, or ``None``. bootstrap: ``(host, port,
                room)`` of a request from a prefill node; ``None`` for SGLang's warm-up.
            tokens: the tokens it held (:meth:`release`).
            retracted: retracted, to be recomputed by its prefill node and transferred again
                under the same room (SGLang's PD rebootstrap): this transfer's lease is released
                (named by its last page there), as when a request ends.
        """
        adm = self.rows.get(int(row))
        self.release(row, pages, tokens)
        if adm is None and bootstrap is not None:
            self.refuse(bootstrap[0], bootstrap[1], bootstrap[2], rid)

    def close(self) -> None:
        """Stop renewing leases (the renewal thread ends), stop reading
        (``RemoteBlockFetcher.close``: the reads already started end first), then deregister
        this host tier and end the NIXL agent (``NixlTier.close``). Idempotent; the process is
        ending or the side is no longer used (its prefill nodes' leases then expire after
        ``lease_s``). A read still running after the fetcher's wait keeps the tier registered
        (its memory may still be written)."""
        self._stop_renewing.set()
        self._wake.set()
        if self._renewer is not None:
            self._renewer.join(timeout=10)
        if self.fetcher.close():
            self.tier.close()
        else:
            logger.warning("OasisKV PD: decode host tier %s left registered: a NIXL read into it is still running",
                           self.tier.name)

    def starved_rows(self) -> dict[int, str]:
        """A compact host tier (``pd_host_slots``) that ran full: rows with a block it could not
        take (a read not made: ``RemoteBlocks.starved``; a decoded block not written back:
        ``OasisSparseKV.write_starved``) -> why. Their steps would attend without those blocks
        from then on (the pool evicts nothing while they run), so :func:`~.sglang_hooks.abort_lost`
        ends them with an error naming the key instead of answering with degraded text."""
        host = self.engine.host
        if not host.compact:
            return {}
        starved = self.remote.starved
        writes = self.engine.write_starved
        if not writes and not bool(starved.any()):
            return {}
        why = (f"this decode node's compact host tier is full (kv_sparse_config 'pd_host_slots' {host.num_slots}): "
               "blocks of this request could not be read or written back; raise pd_host_slots (or null: the whole "
               "host tier)")
        with self._rows_lock:
            return {r: why for r, a in self.rows.items() if r in writes or bool(starved[a.pages].any())}

    def lost_rows(self) -> dict[int, str]:
        """Rows admitted from a lost peer -> why it was lost."""
        return {r: self.remote.lost[a.peer] for r, a in self.rows.items() if a.peer in self.remote.lost}
