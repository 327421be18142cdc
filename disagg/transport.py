"""NIXL transport of OasisKV host-tier blocks between a prefill node and a decode node.

Paper: PD integration, remote partial fetching. The prefill node's host tier
(``core.host_tier.HostTier``, per sparse layer ``k[H, P, bs, D]`` / ``v[H, P, bs, Dv]``) is its
*staging pool*: it is registered with NIXL once (``NixlTier``) and its layout
(``TierLayout``: agent metadata and buffer addresses, a few hundred bytes) is sent to each
decode node. A decode node READs the (sparse layer, KV head, block) pieces its predictor wants
(``RemoteBlockFetcher``), one NIXL transfer holding every piece of every request (per sparse
layer and peer when a layer waits for them, per peer and step when reads are deferred), into
the same place of its own host tier. The NIXL calls of a read run on the fetcher's reader
thread: over UCX loopback (shared memory) ``transfer`` copies the bytes itself (24 ms of a
26 MiB step on the H200 host, 2026-12-04), which would otherwise stall the scheduler.

The memory is registered as ``DRAM`` (the host tier is host memory on a GPU host too: pinned
with ``cudaHostRegister``, so a READ lands in memory the device's H2D gather reads directly).

No SGLang import (this module is tested with two NIXL agents over UCX loopback).
"""

from __future__ import annotations

import base64
import logging
import json
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

logger = logging.getLogger(__name__)

# NIXL transfer states (nixl._api: check_xfer_state / transfer return these strings)
_DONE, _PROC, _ERR = "DONE", "PROC", "ERR"


class PeerLostError(RuntimeError):
    """A peer's blocks could not be read: NIXL reported an error (for instance
    ``NIXL_ERR_REMOTE_DISCONNECT`` after the prefill process died), or the transfer did not end
    within its deadline (a stopped peer over TCP leaves a READ in progress forever).

    Attributes: ``peer`` (the agent name), ``why``.
    """

    def __init__(self, peer: str, why: str):
        super().__init__(f"OasisKV PD: peer {peer!r}: {why}")
        self.peer, self.why = peer, why


def is_disconnect(e: BaseException) -> bool:
    """Whether NIXL raised ``e`` because the remote agent is gone (``nixlRemoteDisconnectError``,
    ``NIXL_ERR_REMOTE_DISCONNECT``: its process ended), not for a passing failure."""
    return type(e).__name__ == "nixlRemoteDisconnectError" or "NIXL_ERR_REMOTE_DISCONNECT" in str(e)


@dataclass(frozen=True)
class TierLayout:
    """What a peer needs to READ from a host tier: NIXL agent name and metadata, and per sparse
    layer the addresses of the K and V buffers (``k[H, P, bs, D]``, contiguous).

    Crosses the network as JSON (``to_bytes`` / ``from_bytes``). Sizes: ``num_pages`` blocks per
    layer and KV head, ``head_num`` KV heads, ``k_piece_bytes`` / ``v_piece_bytes`` bytes of one
    (KV head, block) piece (``bs * D * elem``), ``lease_s`` the seconds a prefill node holds a
    transferred request's pages without a renewal (its ``pd_lease_s``; 0: not said). The model's
    shape as the tier holds it: ``num_layers`` model layers (0: not said) and ``sparse_layers``
    the model layer of each buffer pair (empty: not said), ``dtype`` the tier's element type
    (empty: not said), ``tp_rank`` / ``tp_size`` the TP rank whose KV heads it holds and its
    node's TP size (``tp_size`` 0: not said). Two nodes whose ``dense_layers`` differ in position but not in number
    have tiers of the same sizes, and SGLang's transfer would copy one layer's KV and summaries
    into another's places, so ``compatible`` compares these too.
    ``from_bytes`` ignores fields a later version adds and raises ValueError naming the field for
    a ``lease_s`` outside 0..86400, a size that is not an integer > 0, a pointer or layer that is
    not an integer >= 0, or a TP rank outside ``0..tp_size-1``.
    """

    agent: str
    metadata: bytes
    k_ptrs: tuple[int, ...]
    v_ptrs: tuple[int, ...]
    num_pages: int
    head_num: int
    block_size: int
    k_piece_bytes: int
    v_piece_bytes: int
    lease_s: float = 0.0        # the prefill node's ``pd_lease_s`` (0: not a staging pool, or not said)
    num_layers: int = 0         # model layers (0: not said, an older layout)
    sparse_layers: tuple[int, ...] = ()   # the model layer of each (k_ptrs, v_ptrs) pair (empty: not said)
    dtype: str = ""             # the tier's element type, e.g. "torch.bfloat16" (empty: not said)
    tp_rank: int = 0            # the (attention) TP rank whose KV heads the tier holds
    tp_size: int = 0            # its node's TP size (0: not said, an older layout)

    def to_bytes(self) -> bytes:
        d = {f: getattr(self, f) for f in self.__dataclass_fields__}
        d["metadata"] = base64.b64encode(self.metadata).decode()
        return json.dumps(d).encode()

    @classmethod
    def from_bytes(cls, b: bytes) -> "TierLayout":
        """Raises ValueError on a malformed layout (names the field)."""
        try:
            d = json.loads(b)
            d["metadata"] = base64.b64decode(d["metadata"])
            d["k_ptrs"], d["v_ptrs"] = tuple(d["k_ptrs"]), tuple(d["v_ptrs"])
            if "sparse_layers" in d:
                d["sparse_layers"] = tuple(d["sparse_layers"])
            # fields a later version adds are left out (an older layout lacks lease_s: 0)
            lay = cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"OasisKV PD: malformed tier layout: {type(e).__name__}: {e}") from e
        ls = lay.lease_s
        if isinstance(ls, bool) or not isinstance(ls, (int, float)) or not 0 <= ls <= 86400:
            raise ValueError(f"OasisKV PD: tier layout: lease_s {ls!r}: want seconds in 0..86400")

        def _int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        for f in ("num_pages", "head_num", "block_size", "k_piece_bytes", "v_piece_bytes"):
            x = getattr(lay, f)
            if not _int(x) or x <= 0:
                raise ValueError(f"OasisKV PD: tier layout: {f} {x!r}: want an integer > 0")
        if not _int(lay.num_layers) or lay.num_layers < 0:
            raise ValueError(f"OasisKV PD: tier layout: num_layers {lay.num_layers!r}: want an integer >= 0")
        for f in ("k_ptrs", "v_ptrs", "sparse_layers"):
            bad = [x for x in getattr(lay, f) if not _int(x) or x < 0]
            if bad:
                raise ValueError(f"OasisKV PD: tier layout: {f} holds {bad[0]!r}: want integers >= 0")
        for f in ("agent", "dtype"):
            if not isinstance(getattr(lay, f), str):
                raise ValueError(f"OasisKV PD: tier layout: {f} {getattr(lay, f)!r}: want a string")
        for f in ("tp_size", "tp_rank"):
            x = getattr(lay, f)
            if isinstance(x, bool) or not isinstance(x, int) or x < 0 or (f == "tp_rank"
                                                                          and x >= max(1, lay.tp_size)):
                raise ValueError(f"OasisKV PD: tier layout: {f} {x!r}: want an integer in 0..tp_size-1 "
                                 f"(tp_size {lay.tp_size!r})" if f == "tp_rank" else
                                 f"OasisKV PD: tier layout: {f} {x!r}: want an integer >= 0")
        if len(lay.k_ptrs) != len(lay.v_ptrs):
            raise ValueError(f"OasisKV PD: tier layout: {len(lay.k_ptrs)} k_ptrs, {len(lay.v_ptrs)} v_ptrs")
        if lay.sparse_layers and len(lay.sparse_layers) != len(lay.k_ptrs):
            raise ValueError(f"OasisKV PD: tier layout: {len(lay.sparse_layers)} sparse_layers for "
                             f"{len(lay.k_ptrs)} buffer pairs")
        return lay

    def compatible(self, other: "TierLayout") -> str | None:
        """Why blocks of ``other`` cannot be copied into this tier's places, or ``None``."""
        if self.tp_size and other.tp_size and (self.tp_size, self.tp_rank) != (other.tp_size, other.tp_rank):
            fix = ("give both nodes the same --tp-size" if self.tp_size != other.tp_size else
                   "the bootstrap server answered with another rank's layout")
            return (f"TP rank {other.tp_rank} of {other.tp_size} (peer) != rank {self.tp_rank} of {self.tp_size} "
                    f"(here): a decode rank reads its KV heads from the prefill rank holding the same ones ({fix})")
        if self.dtype and other.dtype and self.dtype != other.dtype:
            return f"KV cache dtype {other.dtype} (peer) != {self.dtype} (here) (--kv-cache-dtype must match)"
        for f in ("head_num", "block_size", "k_piece_bytes", "v_piece_bytes"):
            if getattr(self, f) != getattr(other, f):
                return f"{f} {getattr(other, f)} (peer) != {getattr(self, f)} (here)"
        if self.num_layers and other.num_layers and self.num_layers != other.num_layers:
            return f"{other.num_layers} model layers (peer) != {self.num_layers} (here): not the same model"
        if len(self.k_ptrs) != len(other.k_ptrs) or (self.sparse_layers and other.sparse_layers
                                                    and self.sparse_layers != other.sparse_layers):
            n = self.num_layers or other.num_layers
            if n and self.sparse_layers and other.sparse_layers:
                dense = lambda sp: sorted(set(range(n)) - set(sp))     # noqa: E731
                return (f"dense_layers {dense(other.sparse_layers)} (peer) != {dense(self.sparse_layers)} (here): "
                        f"kv_sparse_config's dense_layers must match on both nodes")
            return f"{len(other.k_ptrs)} sparse layers (peer) != {len(self.k_ptrs)} (here)"
        return None


PROGRESS_DELAY_ENV = "OASIS_NIXL_PROGRESS_DELAY_US"
CPU_PROGRESS_DELAY_US = 100
_progress_delay = {"us": 0, "installed": False}
_progress_lock = threading.Lock()


def progress_delay_us(cpu: bool) -> int:
    """The pause (microseconds) NIXL's progress threads take between polls in this process:
    ``$OASIS_NIXL_PROGRESS_DELAY_US`` when set, else ``CPU_PROGRESS_DELAY_US`` (100) on the CPU
    engine and 0 (NIXL's own: it spins) with a GPU.

    Why: nixl's Python API (1.5.1, ``nixl_agent.__init__``) fixes ``pthrDelay = 0``, so every
    agent's progress thread busy-polls a whole core for as long as the agent lives. A PD pair
    on one host has four agents (SGLang's and OasisKV's on each node): on a 2-core machine the
    servers got about a third of the CPU. With 100 us two idle agents used 0.11 CPU s per 3 s
    instead of 5.94, and a READ of 86 x 4 KiB pieces over UCX loopback took 0.24 ms instead of
    0.15 (median of 20; docs/benchmarks/2026-12-04_nixl-progress-delay-cpu.md, ``scripts/probe_nixl_progress.py``).

    Raises:
        ValueError: the variable is not an integer in 0..1000000, naming it.
    """
    import os

    import re

    raw = os.environ.get(PROGRESS_DELAY_ENV)
    if raw is None or raw.strip() == "":
        return CPU_PROGRESS_DELAY_US if cpu else 0
    us = int(raw.strip()) if re.fullmatch(r"[0-9]{1,7}", raw.strip()) else -1
    if not 0 <= us <= 1_000_000:
        raise ValueError(f"{PROGRESS_DELAY_ENV}={raw!r}: want an integer number of microseconds in 0..1000000 "
                         f"(0: NIXL's own busy polling)")
    return us


def set_progress_delay(us: int) -> bool:
    """Make NIXL agents created from now on in this process pause ``us`` microseconds between
    progress polls (``progress_delay_us``): nixl's Python API sets the agent config's
    ``pthrDelay`` to 0, so its config class (in nixl's bindings) is replaced by a subclass that
    keeps ``pthrDelay`` at least ``us``. SGLang's own agents (``NixlKVManager``) are made
    the same way (``sglang_glue/fixes/pd_cpu.py`` calls this before they are).

    The delay is only ever raised in a process (the largest asked for applies to agents made
    later). Returns: whether a delay is in effect (False for 0 or when this nixl has no ``pthrDelay``).
    """

    with _progress_lock:
        return _set_progress_delay(int(us))


def _set_progress_delay(us: int) -> bool:
    import sys

    from nixl._api import nixl_agent

    # only raised: one process may ask twice (OasisKV's tier first, then SGLang's NixlKVManager),
    # and an agent made later must not spin because an earlier caller asked for 0
    _progress_delay["us"] = max(_progress_delay["us"], us)
    us = _progress_delay["us"]
    if _progress_delay["installed"] or us <= 0:
        return bool(_progress_delay["installed"] and us > 0)
    bind = getattr(sys.modules[nixl_agent.__module__], "nixlBind", None)
    base = getattr(bind, "nixlAgentConfig", None)
    if base is None or not hasattr(base, "pthrDelay"):
        logger.warning("OasisKV PD: this nixl has no nixlAgentConfig.pthrDelay; its progress threads keep "
                       "busy-polling a core each")
        return False

    class _Config(base):
        """nixl's agent config with ``pthrDelay`` kept at least the delay set here."""

        @property
        def pthrDelay(self):  # noqa: N802 - nixl's name
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, v):  # noqa: N802
            base.pthrDelay.__set__(self, max(int(v), _progress_delay["us"]))

    bind.nixlAgentConfig = _Config
    _progress_delay["installed"] = True
    return True


def _agent(name: str, backends=("UCX",), cpu_engine: bool | None = None):
    """A NIXL agent (STRICT thread sync) with ``backends``, made after ``set_progress_delay``
    (``cpu_engine``: the engine runs on the CPU; ``None``: when CUDA is not available)."""
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t   # lazy: nixl is the [disagg] extra

    set_progress_delay(progress_delay_us(cpu=not torch.cuda.is_available() if cpu_engine is None else cpu_engine))

    # STRICT: the reader thread (RemoteBlockFetcher) and the scheduler's thread (notifications,
    # peers) call one agent
    return nixl_agent(name, nixl_agent_config(backends=list(backends),
                                              sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))


class NixlTier:
    """A host tier registered with NIXL as ``DRAM`` under its own agent.

    Args:
        k, v: the tier's per-sparse-layer buffers (``HostTier.k`` / ``.v``): CPU tensors
            ``[H, P, bs, D]`` / ``[H, P, bs, Dv]``, contiguous, all of one dtype.
        name: the NIXL agent name (unique per process and node, e.g. ``oasis-prefill-<port>-tp0``).
        cpu_engine: the OasisKV engine runs on the CPU (NIXL's progress thread then pauses
            between polls, ``progress_delay_us``); ``None``: when CUDA is not available.
        sparse_layers, num_layers: the model layer of each buffer pair and the model's layer
            count, told to peers in the layout (``TierLayout.compatible`` compares them).
        compact: ``None`` (default): ``k`` / ``v`` are the whole tier's per-layer buffers. A
            tuple ``(L, H, P)``: a decode node's *compact* tier (``HostTier(num_slots=S)``):
            ``k = [k_pool]`` / ``v = [v_pool]``, the pools ``[S, bs, D]`` / ``[S, bs, Dv]``
            (one NIXL region each), for ``L`` sparse layers, ``H`` KV heads and ``P`` pages of
            the tier they stand for. READs then land in pool rows (``RemoteBlockFetcher.post``'s
            ``dst_pages`` are pool rows ``0 .. S - 1``); ``layout`` tells ``L`` layers of ``P``
            pages (every layer's pointer is the pool's: nobody reads from a compact tier).
    Raises:
        ValueError: buffers not on the CPU, not contiguous, or of different shapes; a bad
            ``compact`` (not three positive integers, or pools that are not one ``[S, bs, D]``
            K and one ``[S, bs, Dv]`` V).
    """

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], name: str, backends=("UCX",),
                 cpu_engine: bool | None = None, sparse_layers: tuple[int, ...] = (), num_layers: int = 0,
                 tp: tuple[int, int] = (0, 0), compact: tuple[int, int, int] | None = None):
        if len(k) != len(v) or not k:
            raise ValueError(f"NixlTier: {len(k)} K and {len(v)} V buffers: want one of each per sparse layer")
        self.compact = compact is not None
        if compact is not None:
            self._init_compact(k, v, name, backends, cpu_engine, sparse_layers, num_layers, tp, compact)
            return
        for t in k + v:
            if t.device.type != "cpu" or not t.is_contiguous() or t.dim() != 4:
                raise ValueError(f"NixlTier: buffer {tuple(t.shape)} on {t.device}: want contiguous CPU [H, P, bs, D]")
        if any(t.shape != k[0].shape for t in k) or any(t.shape[:3] != k[0].shape[:3] for t in v):
            raise ValueError("NixlTier: the layers' buffers differ in shape")
        if sparse_layers and len(sparse_layers) != len(k):
            raise ValueError(f"NixlTier: {len(sparse_layers)} sparse_layers for {len(k)} buffer pairs")
        self.k, self.v, self.name = k, v, name
        self.sparse_layers, self.num_layers = tuple(int(x) for x in sparse_layers), int(num_layers)
        self.tp = (int(tp[0]), int(tp[1]))
        H, P, bs, D = k[0].shape
        es = k[0].element_size()
        self.head_num, self.num_pages, self.block_size = H, P, bs
        self.k_piece, self.v_piece = bs * D * es, bs * v[0].shape[3] * es
        self.num_slots = None
        self.agent = _agent(name, backends, cpu_engine)
        self._reg = self.agent.register_memory(k + v, "DRAM")

    def _init_compact(self, k, v, name, backends, cpu_engine, sparse_layers, num_layers, tp, compact) -> None:
        """``__init__`` of a compact tier (``compact=(L, H, P)``, the pools ``k[0]`` / ``v[0]``)."""
        try:
            L, H, P = (int(x) for x in compact)
            ok = len(tuple(compact)) == 3 and not any(isinstance(x, bool) for x in compact) and min(L, H, P) >= 1
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"NixlTier: compact {compact!r}: want (sparse layers, KV heads, pages), positive integers")
        if len(k) != 1:
            raise ValueError(f"NixlTier: a compact tier takes one K pool and one V pool, got {len(k)} of each")
        kp, vp = k[0], v[0]
        for t in (kp, vp):
            if t.device.type != "cpu" or not t.is_contiguous() or t.dim() != 3:
                raise ValueError(f"NixlTier: pool {tuple(t.shape)} on {t.device}: want contiguous CPU [S, bs, D]")
        if kp.shape[:2] != vp.shape[:2] or kp.dtype != vp.dtype:
            raise ValueError(f"NixlTier: K pool {tuple(kp.shape)} {kp.dtype} and V pool {tuple(vp.shape)} {vp.dtype} "
                             f"differ in slots, block size or dtype")
        if sparse_layers and len(sparse_layers) != L:
            raise ValueError(f"NixlTier: {len(sparse_layers)} sparse_layers for {L} sparse layers")
        self.k, self.v, self.name = [kp], [vp], name
        self.sparse_layers, self.num_layers = tuple(int(x) for x in sparse_layers), int(num_layers)
        self.tp = (int(tp[0]), int(tp[1]))
        S, bs, D = kp.shape
        es = kp.element_size()
        self.num_sparse = L
        self.head_num, self.num_pages, self.block_size, self.num_slots = H, P, bs, S
        self.k_piece, self.v_piece = bs * D * es, bs * vp.shape[2] * es
        self.agent = _agent(name, backends, cpu_engine)
        self._reg = self.agent.register_memory([kp, vp], "DRAM")

    @classmethod
    def of_host(cls, host, name: str, **kw) -> "NixlTier":
        """Register a ``core.host_tier.HostTier``: its per-layer buffers (the whole tier), or
        its two pools (a compact tier, ``compact=(L, H, P)``). ``kw``: the other arguments."""
        if getattr(host, "compact", False):
            return cls([host.k_pool], [host.v_pool], name,
                       compact=(host.num_layers, host.head_num, host.num_pages), **kw)
        return cls(host.k, host.v, name, **kw)

    def layout(self, lease_s: float = 0.0) -> TierLayout:
        """What a peer needs to read this tier (:class:`TierLayout`); ``lease_s``: how long a
        prefill node holds a request's pages without a renewal (its ``pd_lease_s``)."""
        if self.agent is None:
            raise RuntimeError(f"NixlTier {self.name!r}: closed (it has no NIXL agent)")
        n = self.num_sparse if self.compact else 1        # a compact tier: its pool for every layer
        return TierLayout(self.name, self.agent.get_agent_metadata(), tuple(t.data_ptr() for t in self.k) * n,
                          tuple(t.data_ptr() for t in self.v) * n, self.num_pages, self.head_num, self.block_size,
                          self.k_piece, self.v_piece, float(lease_s), self.num_layers, self.sparse_layers,
                          str(self.k[0].dtype), *self.tp)

    def close(self) -> None:
        """Deregister the buffers and let go of the agent. NIXL's progress thread busy-polls one
        CPU core for as long as the agent lives (``pthrDelay`` is 0 in nixl's Python API, as in
        SGLang's own NIXL connection), so a tier no longer in use must be closed, not left to
        the garbage collector (six leaked agents held both cores of a 2-core CI box). Close the
        ``RemoteBlockFetcher`` reading into it first. Idempotent; ``layout`` raises afterwards."""
        try:
            if self._reg is not None:
                reg, self._reg = self._reg, None
                self.agent.deregister_memory(reg)
        finally:
            self.agent = None

    @property
    def closed(self) -> bool:
        """Whether ``close`` ran (no NIXL agent, no registered memory)."""
        return self.agent is None


def piece_descs(k_ptr, v_ptr, heads: np.ndarray, pages: np.ndarray, num_pages: int,
                k_piece: int, v_piece: int) -> np.ndarray:
    """NIXL descriptors ``[2N, 3]`` (address, bytes, device id 0) of the K then V pieces
    ``(heads[i], pages[i])`` of a ``[H, P, bs, D]`` tier layer whose K / V start at ``k_ptr`` /
    ``v_ptr`` (ints: one layer; ``[N]`` uint64 arrays: piece ``i``'s layer's). A compact pool:
    ``heads`` zeros, ``pages`` the pool rows and ``num_pages`` 0 (address = base + row * piece)."""
    off = heads.astype(np.uint64) * np.uint64(num_pages) + pages.astype(np.uint64)
    n = len(off)
    d = np.zeros((2 * n, 3), dtype=np.uint64)
    d[:n, 0] = np.uint64(k_ptr) + off * np.uint64(k_piece)
    d[:n, 1] = k_piece
    d[n:, 0] = np.uint64(v_ptr) + off * np.uint64(v_piece)
    d[n:, 1] = v_piece
    return d


@dataclass
class FetchStats:
    """Decode-node counters: NIXL READ transfers, pieces and bytes read from peers."""
    transfers: int = 0
    pieces: int = 0
    bytes: int = 0


class RemoteBlockFetcher:
    """Decode node: READ (sparse layer, KV head, block) pieces from peers' host tiers into the
    same-shaped local ``NixlTier``.

    One call of ``fetch`` is one NIXL transfer (K and V pieces of one sparse layer from one peer,
    for every request of the step), waited for with a deadline.

    Args:
        local: this node's registered host tier (the READs' destination).
        timeout_s: default deadline of one ``fetch`` (seconds).
    """

    IDLE_EXIT_S = 2.0     # the reader thread ends after this long with nothing queued or in flight

    def __init__(self, local: NixlTier, timeout_s: float = 10.0):
        if not timeout_s > 0:
            raise ValueError(f"RemoteBlockFetcher: timeout_s {timeout_s!r}: want > 0 seconds")
        self.local, self.timeout_s = local, float(timeout_s)
        self.peers: dict[str, TierLayout] = {}
        self.stats = FetchStats()
        self._reads: queue.SimpleQueue = queue.SimpleQueue()
        self._reader: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def _submit(self, p: "PendingRead") -> None:
        with self._lock:
            if self._closed or self.local.closed:
                raise RuntimeError(f"RemoteBlockFetcher of {self.local.name!r}: closed (no read can be posted)")
            if self._reader is None or not self._reader.is_alive():   # the agent is taken while the tier is open
                self._reader = threading.Thread(target=self._read_loop, args=(self.local.agent,),
                                                name=f"oasis-nixl-{self.local.name}", daemon=True)
                self._reader.start()
            self._reads.put(p)

    def _read_loop(self, ag) -> None:
        """The reader thread: starts every posted read (``initialize_xfer`` + ``transfer``; a
        read whose deadline passed, or that ``poll`` gave up, while it was queued is not
        started), then checks all reads in flight together, so a stalled peer's read does not
        hold another peer's back. A read is ``ended`` only when NIXL no longer works on it: it
        finished, failed, or was given up and its handle released (a handle NIXL refuses to
        release is checked on until it leaves PROC, at most ``timeout_s`` more); until then a
        failed read's destination pieces may still be written (``core/remote.py`` waits for
        ``ended`` before their pages change hands)."""
        flying: list = []                           # [(read, handle, give-up time or None)]
        stop = False
        while not (stop and not flying):
            try:
                item = self._reads.get(timeout=self.IDLE_EXIT_S if not flying and not stop else 0.0002)
            except queue.Empty:
                item = False
                if not flying and not stop:
                    with self._lock:                # idle: end (``_submit`` starts another), so a
                        if self._reads.empty():     # fetcher left unclosed does not keep its agent
                            self._reader = None     # (and NIXL's busy progress thread) alive
                            return
                    continue
            while item is not False:
                if item is None:
                    stop = True
                else:
                    self._start(ag, item, flying)
                try:
                    item = self._reads.get_nowait()
                except queue.Empty:
                    item = False
            left = []
            for p, h, gave_up in flying:
                try:
                    state = ag.check_xfer_state(h)
                except Exception as e:  # noqa: BLE001 - NIXL_ERR_REMOTE_DISCONNECT and the like
                    state, p.error = _ERR, p.error or f"{type(e).__name__}: {e}"
                if state == _PROC and gave_up is None and (p.failed is not None or time.monotonic() > p.t_end):
                    gave_up = time.monotonic()                 # poll's deadline: release the handle
                if state == _PROC and gave_up is None:
                    left.append((p, h, None))
                    continue
                p.state = state
                if state == _PROC:
                    try:
                        ag.release_xfer_handle(h)
                    except Exception:  # noqa: BLE001 - NIXL may refuse a handle still in progress
                        if time.monotonic() - gave_up < self.timeout_s:
                            left.append((p, h, gave_up))
                            continue
                    p.ended.set()
                    continue
                self._end(ag, p, h)
            flying = left

    def _start(self, ag, p: "PendingRead", flying: list) -> None:
        if p.failed is not None or time.monotonic() > p.t_end:
            p.error = p.error or "given up before it started (its deadline passed while queued)"
            p.local = p.remote = None
            p.ended.set()
            return
        h = None
        try:
            h = ag.initialize_xfer("READ", ag.get_xfer_descs(p.local, "DRAM"),
                                   ag.get_xfer_descs(p.remote, "DRAM"), p.peer)
            state = ag.transfer(h)
        except Exception as e:  # noqa: BLE001 - NIXL_ERR_REMOTE_DISCONNECT and the like
            p.state, p.error = _ERR, f"{type(e).__name__}: {e}"
            self._end(ag, p, h)
            return
        p.local = p.remote = None
        if state == _PROC:
            flying.append((p, h, None))
        else:
            p.state = state
            self._end(ag, p, h)

    @staticmethod
    def _end(ag, p: "PendingRead", h) -> None:
        if h is not None:
            try:
                ag.release_xfer_handle(h)
            except Exception:  # noqa: BLE001 - a finished or failed handle: nothing else holds it
                pass
        p.local = p.remote = None
        p.ended.set()

    def close(self) -> bool:
        """Stop the reader thread once the reads already posted ended (call before closing the
        tier; ``post`` raises afterwards). Returns whether it stopped; when it did not within
        ``2 * timeout_s + 5`` s (a transfer still running) it logs, and the tier's memory must
        not be deregistered (``DecodeSide.close`` then leaves it)."""
        with self._lock:
            self._closed = True
            t = self._reader
        if t is not None and t.is_alive():
            self._reads.put(None)
            t.join(timeout=2 * self.timeout_s + 5)
            if t.is_alive():
                logger.warning("OasisKV PD: the NIXL reader thread of %r did not stop within %.0f s (a READ "
                               "still running)", self.local.name, 2 * self.timeout_s + 5)
                return False
        return True

    def add_peer(self, layout: TierLayout) -> str:
        """Load a peer's NIXL metadata; returns its agent name. Raises ValueError when its tier's
        shape differs from this one's (naming the field)."""
        why = self.local.layout().compatible(layout)
        if why is not None:
            raise ValueError(f"OasisKV PD: peer {layout.agent!r} cannot serve this node: {why}")
        if layout.agent not in self.peers:
            self.local.agent.add_remote_agent(layout.metadata)
        self.peers[layout.agent] = layout
        return layout.agent

    def remove_peer(self, agent: str) -> None:
        """Forget a peer (after it was lost or drained); unknown names are ignored."""
        if self.peers.pop(agent, None) is not None:
            try:
                self.local.agent.remove_remote_agent(agent)
            except Exception:      # noqa: BLE001 - the peer may already be gone from NIXL's view
                pass

    def fetch(self, peer: str, layer: int, heads, src_pages, dst_pages, timeout_s: float | None = None) -> int:
        """READ pieces ``(layer, heads[i], src_pages[i])`` of ``peer`` into ``(layer, heads[i],
        dst_pages[i])`` here, and wait (``post``, then ``poll`` until done). A compact local tier
        (``NixlTier(compact=...)``): ``dst_pages[i]`` is the pool row piece ``i`` lands in (the
        caller took it, ``HostTier.assign``); the peer's side is its whole tier as always.

        Args:
            peer: an agent name from ``add_peer``. layer: sparse-layer index.
            heads, src_pages, dst_pages: ``[N]`` integer arrays / tensors / lists.
        Returns:
            bytes read.
        Raises:
            KeyError: unknown peer. ValueError: out-of-range indices or lengths that differ.
            PeerLostError: NIXL failed the transfer, or it did not end within the deadline
                (the reader thread gives it up; the destination pieces are then undefined).
        """
        p = self.post(peer, layer, heads, src_pages, dst_pages, timeout_s)
        if p is None:
            return 0
        while not self.poll(p):
            time.sleep(0.0002)
        return p.nbytes

    def post(self, peer: str, layer, heads, src_pages, dst_pages,
             timeout_s: float | None = None) -> "PendingRead | None":
        """Start the READ of ``fetch`` and return without waiting (``None``: nothing to read).
        The destination pieces are undefined until ``poll`` returns True.

        Args:
            layer: one sparse-layer index for every piece, or ``[N]`` integers (piece ``i`` of
                layer ``layer[i]``): one NIXL transfer across layers (the decode node starts one
                per peer and step, ``core/remote.py``). Others as ``fetch``.
        Raises:
            KeyError, ValueError: as ``fetch`` (NIXL's own failures, starting included, are
            raised by ``poll`` as PeerLostError).
        """
        lay = self.peers[peer]
        if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool)
                                          and timeout_s > 0):
            raise ValueError(f"fetch: timeout_s {timeout_s!r}: want > 0 seconds")
        heads, src, dst = (_int_array(x, name) for x, name in ((heads, "heads"), (src_pages, "src_pages"),
                                                               (dst_pages, "dst_pages")))
        if not len(heads) == len(src) == len(dst):
            raise ValueError(f"fetch: {len(heads)} heads, {len(src)} src_pages, {len(dst)} dst_pages")
        layers = _int_array(layer, "layer", scalar_ok=True)
        per_piece = layers.ndim == 1
        if per_piece and len(layers) != len(heads):
            raise ValueError(f"fetch: {len(layers)} layers for {len(heads)} pieces (want one layer, or one per piece)")
        layer = layers if per_piece else int(layers)
        if not len(heads):
            return None
        lo, hi = (int(layers.min()), int(layers.max())) if per_piece else (layer, layer)
        if not 0 <= lo <= hi < len(lay.k_ptrs):
            raise ValueError(f"fetch: layer {layer if not per_piece else f'{lo}..{hi}'} not in "
                             f"0..{len(lay.k_ptrs) - 1}")
        loc = self.local
        dst_hi = loc.num_slots if loc.compact else loc.num_pages
        if heads.min() < 0 or heads.max() >= lay.head_num or src.min() < 0 or src.max() >= lay.num_pages \
                or dst.min() < 0 or dst.max() >= dst_hi:
            raise ValueError(f"fetch: heads / pages out of range (heads < {lay.head_num}, src pages < "
                             f"{lay.num_pages}, dst {'pool rows' if loc.compact else 'pages'} < {dst_hi})")
        if per_piece:
            rk, rv = (np.asarray(x, dtype=np.uint64)[layers] for x in (lay.k_ptrs, lay.v_ptrs))
        else:
            rk, rv = lay.k_ptrs[layer], lay.v_ptrs[layer]
        if loc.compact:                 # pool rows: base + row * piece bytes, whatever the layer
            lk, lv = loc.k[0].data_ptr(), loc.v[0].data_ptr()
        elif per_piece:
            lk, lv = (np.asarray([t.data_ptr() for t in x], dtype=np.uint64)[layers] for x in (loc.k, loc.v))
        else:
            lk, lv = loc.k[layer].data_ptr(), loc.v[layer].data_ptr()
        remote = piece_descs(rk, rv, heads, src, lay.num_pages, lay.k_piece_bytes, lay.v_piece_bytes)
        if loc.compact:
            local = piece_descs(lk, lv, np.zeros_like(dst), dst, 0, loc.k_piece, loc.v_piece)
        else:
            local = piece_descs(lk, lv, heads, dst, loc.num_pages, loc.k_piece, loc.v_piece)
        t_end = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        p = PendingRead(peer, t_end, len(heads), len(heads) * (lay.k_piece_bytes + lay.v_piece_bytes),
                        local=local, remote=remote)
        self._submit(p)
        return p

    def poll(self, p: "PendingRead") -> bool:
        """Whether the READ ``p`` (from ``post``) ended; on True its pieces are here and the
        counters include it. Raises PeerLostError when NIXL failed it (it could not start, or
        ended with an error) or its deadline passed (the reader thread then gives it up; the
        destination pieces are undefined)."""
        if p.failed is not None:
            raise PeerLostError(p.peer, p.failed)
        if not p.ended.is_set():
            if time.monotonic() > p.t_end:
                p.failed = f"a READ of {p.pieces} pieces did not end in time"
                raise PeerLostError(p.peer, p.failed)
            return False
        if p.error is not None:
            p.failed = f"READ failed: {p.error}"
        elif p.state == _PROC:
            p.failed = f"a READ of {p.pieces} pieces did not end in time"
        elif p.state != _DONE:
            p.failed = f"NIXL ended a READ with state {p.state}"
        if p.failed is not None:
            raise PeerLostError(p.peer, p.failed)
        if not p.counted:
            p.counted = True
            self.stats.transfers += 1
            self.stats.pieces += p.pieces
            self.stats.bytes += p.nbytes
        return True


def _int_array(x, name: str, scalar_ok: bool = False) -> np.ndarray:
    """``x`` (tensor, array, list or int) as an int64 numpy array: 1-D (or 0-d with
    ``scalar_ok``), of an integer dtype. Raises ValueError naming ``name`` otherwise."""
    try:
        a = np.asarray(x.cpu() if isinstance(x, torch.Tensor) else x)
    except Exception as e:  # noqa: BLE001 - anything that is not array-like
        raise ValueError(f"fetch: {name} {x!r}: want integers ({type(e).__name__})") from None
    if a.ndim == 1 and a.size == 0:
        return a.astype(np.int64)
    if a.dtype.kind not in "iu" or a.ndim > 1 or (a.ndim == 0 and not scalar_ok):
        want = "an integer or a 1-D integer array" if scalar_ok else "a 1-D integer array"
        raise ValueError(f"fetch: {name}: want {want}, got dtype {a.dtype} shape {tuple(a.shape)}")
    return a.astype(np.int64)


@dataclass
class PendingRead:
    """A READ started by ``RemoteBlockFetcher.post`` (made by its reader thread): its peer,
    deadline (``time.monotonic()`` seconds), pieces and bytes, NIXL descriptors (``[2N, 3]``,
    dropped once made), last NIXL state, ``ended`` (set by the reader thread), the error NIXL
    raised, and why it failed (``None``: it did not; a failed read raises again at every
    ``poll``)."""
    peer: str
    t_end: float
    pieces: int
    nbytes: int
    local: np.ndarray | None = None
    remote: np.ndarray | None = None
    state: str = _PROC
    ended: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    failed: str | None = None
    counted: bool = False
