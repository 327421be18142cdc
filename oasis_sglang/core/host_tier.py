"""Host tier: the full KV cache of every sparse layer in host memory (paper: Methodology, tiered KV).

Layout per sparse layer: ``k[H, P, bs, D]`` and ``v[H, P, bs, Dv]`` — by layer, KV head and
block, so one (KV head, block) piece is ``bs * D`` contiguous elements (4 KiB for bs=16,
D=128, bf16), the unit the device gathers. Block ``p`` holds SGLang token locations
``[p * bs, (p + 1) * bs)`` (SGLang's ``--page-size`` equals ``block_size``), so SGLang's own
allocator, radix cache and free lists govern the host tier. Pinned (``cudaHostRegister``) when
CUDA is present; otherwise committed on demand (an anonymous ``mmap``): memory is taken when a
block is first written, and ``discard`` returns freed blocks' memory to the OS (a PD decode
node holds only the blocks it read from its prefill node, ``disagg/serving.py``).

Compact mode (``num_slots=S``): one pool of ``S`` pieces for all sparse layers, ``k_pool [S, bs,
D]`` and ``v_pool [S, bs, Dv]``, and a table ``slots [L, H * P]`` int32 giving each (layer, KV head,
page) piece its pool row (``-1``: none). Pieces get slots with ``assign`` and give them back with
``unassign``: a PD decode node, which reads only 16-45% of a request's pieces from its prefill
node, pins memory for those alone (disagg/README.md, "The decode node's host tier on a GPU").
The kernels reach a piece ``(h, page)`` of layer ``li`` at pool row ``slots[li, h * P + page]``
(their ``slots`` argument, ``core/ops.py``).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

OS_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4
_MADV_NOHUGEPAGE = 15


@functools.lru_cache(maxsize=1)
def _libc():
    """libc's ``madvise`` and ``mincore`` (loaded once)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def _on_demand_zeros(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor whose memory is committed OS page by OS page when first written.

    An anonymous private ``mmap`` (``torch.zeros`` writes every page, so the whole tier would
    be resident from start-up): a PD decode node's host tier holds only the blocks it read or
    wrote (``HostTier.resident_bytes``), and ``HostTier.discard`` gives freed blocks' memory
    back. The tensor keeps the mapping alive (``torch.frombuffer`` holds the buffer).
    """
    numel = 1
    for x in shape:
        numel *= int(x)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if not nbytes:
        return torch.zeros(shape, dtype=dtype)
    mm = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)
    # no transparent huge pages: with THP "always" one written piece would commit 2 MiB, and a
    # madvise of a piece would split a huge page (best effort: a kernel without THP refuses it)
    _libc().madvise(t.data_ptr(), len(mm), _MADV_NOHUGEPAGE)
    return t.view(dtype).view(shape)


def _pinned_zeros(shape: tuple, dtype: torch.dtype, device_index: int | None = None) -> torch.Tensor:
    """A zeroed host tensor page-locked in place with ``cudaHostRegister``.

    Not ``torch.zeros(pin_memory=True)``: PyTorch's pinned host allocator rounds each
    allocation up to a power of two, so a 1.1 GB layer takes 2 GB of page-locked RAM (a 74 GB
    host tier asked for ~137 GB and the OOM killer stopped the server on the 128 GiB H200 host).
    SGLang's HiCache host pool pins the same way (``mem_cache/pool_host/common.py``,
    ``alloc_with_host_register``). Unregistered when the tensor is freed.

    ``device_index``: the CUDA device made current first (a worker thread starts on device 0;
    flag 0 registers the memory with the current device's context).

    Raises:
        RuntimeError: ``cudaHostRegister`` failed (e.g. the page-lock limit, ``ulimit -l``).
    """
    import weakref

    if device_index is not None:
        torch.cuda.set_device(device_index)
    t = torch.zeros(shape, dtype=dtype)
    n = t.numel() * t.element_size()
    cudart = torch.cuda.cudart()
    rc = int(cudart.cudaHostRegister(t.data_ptr(), n, 0))
    if rc != 0:
        raise RuntimeError(f"OasisKV host tier: cudaHostRegister of {n / 2**30:.2f} GiB failed (error {rc}); "
                           f"check the page-lock limit (ulimit -l) and free host memory")
    weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())
    return t


class EveryFewSeconds:
    """A rate limit for a log line said while a condition lasts (a full compact pool, once per
    step otherwise): ``due()`` is True at the first call and then at most every ``interval_s``
    seconds (``time.monotonic``)."""

    def __init__(self, interval_s: float = 10.0):
        self.interval_s = float(interval_s)
        self._last = float("-inf")

    def due(self) -> bool:
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return False
        self._last = now
        return True


class HostTierFull(RuntimeError):
    """``HostTier.assign``: the compact pool has fewer free slots than the pieces need (nothing
    was changed)."""


class HostTier:
    """Host-memory KV store of the sparse layers.

    Args:
        num_layers: number of sparse layers stored here (indices 0..num_layers-1).
        num_pages: blocks per layer and KV head (``P``); token locations are ``< P * bs``.
        block_size: tokens per block (``bs``).
        head_num, head_dim, v_head_dim: KV heads ``H`` and head sizes ``D``, ``Dv``.
        dtype: KV dtype (the pool's).
        pin_memory: page-lock the buffers (only meaningful with CUDA).
        pin_device: CUDA device index whose context registers the buffers (default the current one).
        pin_threads: threads that zero and page-lock the ``2 * num_layers`` buffers at once
            (default ``min(8, CPUs this process may run on)``; 1 = one after the other). On the
            H200 host zeroing + pinning ran at 3.4 GB/s in one thread and 14.2 GB/s in 8
            (``scripts/bench_pin.py``, docs/benchmarks/2026-12-02_issue5-suite.md); the CUDA runtime is
            thread-safe and each buffer is registered on its own.
        num_slots: ``None`` (default): the whole tier, one ``[H, P, bs, D/Dv]`` K and V buffer per
            layer (``k`` / ``v``). An int ``S``: a *compact* tier (module docstring): the pools
            ``k_pool [S, bs, D]`` / ``v_pool [S, bs, Dv]`` and the table ``slots [L, H * P]``
            int32, all ``-1``; ``k`` / ``v`` then raise. At most ``2**31 - 1`` (int32 table).

    Raises:
        ValueError: ``pin_threads`` or ``num_slots`` is not a positive integer (or ``num_slots``
            does not fit the int32 table).
        RuntimeError: page-locking failed (``_pinned_zeros``).
    """

    def __init__(self, num_layers: int, num_pages: int, block_size: int, head_num: int,
                 head_dim: int, v_head_dim: int, dtype: torch.dtype, pin_memory: bool = False,
                 pin_threads: int | None = None, pin_device: int | None = None, num_slots: int | None = None):
        if num_slots is not None and (isinstance(num_slots, bool) or not isinstance(num_slots, int)
                                      or not 1 <= num_slots < 2**31):
            raise ValueError(f"HostTier: num_slots must be a positive integer below 2**31 or None, got {num_slots!r}")
        if pin_threads is not None and (isinstance(pin_threads, bool) or not isinstance(pin_threads, int)
                                        or pin_threads < 1):
            raise ValueError(f"HostTier: pin_threads must be a positive integer or None, got {pin_threads!r}")
        self.num_layers, self.num_pages, self.block_size = num_layers, num_pages, block_size
        self.head_num, self.head_dim, self.v_head_dim, self.dtype = head_num, head_dim, v_head_dim, dtype
        self.num_slots = num_slots
        if num_slots is None:
            shapes = ([(head_num, num_pages, block_size, head_dim)] * num_layers
                      + [(head_num, num_pages, block_size, v_head_dim)] * num_layers)
        else:
            shapes = [(num_slots, block_size, head_dim), (num_slots, block_size, v_head_dim)]
        self.on_demand = not pin_memory
        self.slots_peak = 0      # a compact tier: the most slots in use at once since it was made (pieces)
        if not pin_memory:
            try:
                bufs = [_on_demand_zeros(s, dtype) for s in shapes]
            except OSError as e:
                if num_slots is None:
                    raise
                raise OSError(e.errno, f"HostTier: the compact pool of num_slots={num_slots} pieces "
                                       f"({num_slots * block_size * (head_dim + v_head_dim) * torch.empty((), dtype=dtype).element_size() / 2**30:.2f} GiB) "
                                       f"could not be mapped: {e.strerror}") from e
        else:
            dev = torch.cuda.current_device() if pin_device is None else pin_device
            cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            n = pin_threads if pin_threads is not None else min(8, cpus)
            if n <= 1:
                bufs = [_pinned_zeros(s, dtype, dev) for s in shapes]
            else:
                # map() keeps the order and re-raises a worker's error here; the buffers already
                # registered are unregistered when their tensors are collected
                with ThreadPoolExecutor(max_workers=n, thread_name_prefix="oasis-pin") as pool:
                    bufs = list(pool.map(lambda s: _pinned_zeros(s, dtype, dev), shapes))
        if num_slots is None:
            self._k, self._v = bufs[:num_layers], bufs[num_layers:]
            self.k_pool = self.v_pool = self.slots = None
            return
        self._k = self._v = None
        self.k_pool, self.v_pool = bufs
        self.slots = torch.full((num_layers, head_num * num_pages), -1, dtype=torch.int32)
        # LIFO free list: the next slots handed out are _free[_nfree - 1], _free[_nfree - 2], ...
        # (0, 1, 2, ... at first; the slots one unassign freed are handed out again first, lowest first)
        self._free = torch.arange(num_slots - 1, -1, -1, dtype=torch.int64)
        self._nfree = num_slots

    # ---- the whole tier's per-layer buffers ------------------------------------------------
    @property
    def compact(self) -> bool:
        """A compact tier (``num_slots`` given): pools and a slot table, no per-layer buffers."""
        return self.num_slots is not None

    def _no_layers(self, what: str):
        return RuntimeError(f"HostTier.{what}: a compact tier (num_slots={self.num_slots}) has no per-layer "
                            f"[H, P, bs, D] buffers; its pieces are k_pool / v_pool rows through the slot table "
                            f"(slots[layer, h * P + page])")

    @property
    def k(self) -> list:
        """Per layer the ``[H, P, bs, D]`` K buffer (the whole tier). Raises RuntimeError on a
        compact tier (``k_pool`` through ``slots``)."""
        if self._k is None:
            raise self._no_layers("k")
        return self._k

    @k.setter
    def k(self, value: list) -> None:
        self._k = value

    @property
    def v(self) -> list:
        """Per layer the ``[H, P, bs, Dv]`` V buffer (the whole tier). Raises RuntimeError on a
        compact tier (``v_pool`` through ``slots``)."""
        if self._v is None:
            raise self._no_layers("v")
        return self._v

    @v.setter
    def v(self, value: list) -> None:
        self._v = value

    def buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What the kernels' ``host_k`` / ``host_v`` take for sparse layer ``layer``: the
        layer's ``[H, P, bs, D/Dv]`` buffers, or on a compact tier the pools ``[S, bs, D/Dv]``
        (their rows addressed through ``slots[layer]``)."""
        if self.compact:
            return self.k_pool, self.v_pool
        return self._k[layer], self._v[layer]

    def piece_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k [rows, bs * D], v [rows, bs * Dv])``: the pieces ``copy_blocks`` addresses for
        sparse layer ``layer``, row ``h * P + page`` (the whole tier) or a pool row ``slots[layer,
        h * P + page]`` (a compact tier, ``rows = S``)."""
        hk, hv = self.buffers(layer)
        return hk.view(-1, self.block_size * self.head_dim), hv.view(-1, self.block_size * self.v_head_dim)

    # ---- the compact tier's slots ------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        """Pool rows not held by a piece (a compact tier; RuntimeError on the whole tier)."""
        self._need_compact("free_slots")
        return self._nfree

    def _need_compact(self, what: str) -> None:
        if not self.compact:
            raise RuntimeError(f"HostTier.{what}: only a compact tier (num_slots=...) has slots")

    def _indices(self, what: str, name: str, x, hi: int) -> torch.Tensor:
        """``x`` as a flat CPU int64 tensor of values in ``0 .. hi - 1``; ValueError naming ``name``."""
        t = torch.as_tensor(x)
        if not t.numel():                                # (an empty list is a float tensor)
            return torch.empty(0, dtype=torch.int64)
        if t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex:
            raise ValueError(f"HostTier.{what}: {name} must be integers, got {t.dtype}")
        t = t.reshape(-1).to("cpu", torch.int64)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= hi):
            raise ValueError(f"HostTier.{what}: {name} must be in 0..{hi - 1}, got values in "
                             f"{int(t.min())}..{int(t.max())}")
        return t

    def assign(self, layers, heads, pages) -> torch.Tensor:
        """Give each piece ``(layers[i], heads[i], pages[i])`` a pool row (a compact tier).

        A piece that already has a slot keeps it; a piece listed twice gets one slot. New slots
        come from the free list (LIFO: at first 0, 1, 2, ...; the slots of the last ``unassign``
        first, lowest first), handed to the new pieces in increasing ``(layer, h * P + page)``
        order. A new slot's data is whatever the pool row holds (zeros, or the data of the
        piece that held it before; write it before reading).

        Args:
            layers / heads / pages: ``[N]`` integers (tensors or lists; sparse-layer index
                ``0 .. L - 1``, KV head ``0 .. H - 1``, host page ``0 .. P - 1``).
        Returns:
            ``[N]`` int64 (CPU) the slot of each piece.
        Raises:
            RuntimeError: the whole tier (no slots).
            ValueError: an argument that is not integers, out of its range (named), or of
                another length than the others.
            HostTierFull: fewer free slots than new pieces (the message gives both); nothing
                changed.
        """
        self._need_compact("assign")
        li = self._indices("assign", "layers", layers, self.num_layers)
        hh = self._indices("assign", "heads", heads, self.head_num)
        pp = self._indices("assign", "pages", pages, self.num_pages)
        if not li.numel() == hh.numel() == pp.numel():
            raise ValueError(f"HostTier.assign: layers, heads and pages must have one length, got "
                             f"{li.numel()}, {hh.numel()}, {pp.numel()}")
        HP = self.head_num * self.num_pages
        key = li * HP + hh * self.num_pages + pp                        # into slots.view(-1)
        flat = self.slots.view(-1)
        new = torch.unique(key[flat[key] < 0])                          # sorted, once each
        n = new.numel()
        if n > self._nfree:
            raise HostTierFull(f"HostTier.assign: the compact pool has {self._nfree} free slots of "
                               f"{self.num_slots}; {n} new pieces need one each")
        if n:
            taken = self._free[self._nfree - n:self._nfree].flip(0)
            self._nfree -= n
            self.slots_peak = max(self.slots_peak, self.num_slots - self._nfree)
            flat[new] = taken.to(torch.int32)
        return flat[key].to(torch.int64)

    def unassign(self, pages) -> int:
        """Free the slots of every piece (all layers and KV heads) of host pages ``pages [M]``
        (integers in ``0 .. P - 1``, repeats allowed); pieces without a slot are skipped.
        The freed slots are handed out first by the next ``assign``, lowest first.

        Returns: the number of slots freed.
        Raises:
            RuntimeError: the whole tier. ValueError: pages not integers or out of range."""
        self._need_compact("unassign")
        pp = torch.unique(self._indices("unassign", "pages", pages, self.num_pages))
        cols = (torch.arange(self.head_num, dtype=torch.int64)[:, None] * self.num_pages + pp[None, :]).reshape(-1)
        sub = self.slots[:, cols]
        freed = sub[sub >= 0].to(torch.int64)
        m = freed.numel()
        if m:
            self.slots[:, cols] = -1
            self._free[self._nfree:self._nfree + m] = torch.sort(freed, descending=True).values
            self._nfree += m
        return m

    @property
    def capacity_tokens(self) -> int:
        """Token locations the tier can hold (``P * bs``)."""
        return self.num_pages * self.block_size

    @property
    def nbytes(self) -> int:
        """Host bytes of all K and V buffers (a compact tier: its two pools)."""
        bufs = [self.k_pool, self.v_pool] if self.compact else self._k + self._v
        return sum(t.numel() * t.element_size() for t in bufs)

    @staticmethod
    def _runs(pieces: torch.Tensor):
        """Runs of consecutive piece numbers among ``pieces [M]`` (int64, any order, repeats
        allowed): ``(starts [R], ends [R], run [M])``, first and last piece of each run and the
        run of each entry of ``pieces``."""
        idx, inv = torch.unique(pieces.reshape(-1).cpu().to(torch.int64), return_inverse=True)
        if not idx.numel():
            return idx, idx, inv.reshape(-1)
        cut = torch.nonzero(idx[1:] != idx[:-1] + 1).reshape(-1) + 1
        starts, ends = torch.cat([idx[:1], idx[cut]]), torch.cat([idx[cut - 1], idx[-1:]])
        first = torch.zeros(idx.numel(), dtype=torch.int64)
        first[cut] = 1
        return starts, ends, first.cumsum(0)[inv.reshape(-1)]

    @staticmethod
    def _ranges(layer_buf: torch.Tensor, runs, piece_bytes: int, written: torch.Tensor | None = None):
        """Byte ranges ``(start, end)`` of one buffer's ``runs`` (``_runs``); with ``written``
        (``[M]`` bool, aligned with the pieces the runs were made of) only the runs holding a
        written piece."""
        starts, ends, run = runs
        if written is not None and starts.numel():
            keep = torch.zeros(starts.numel(), dtype=torch.bool)
            keep[run[written.reshape(-1)]] = True
            starts, ends = starts[keep], ends[keep]
        base = layer_buf.data_ptr()
        return [(base + a * piece_bytes, base + (b + 1) * piece_bytes) for a, b in zip(starts.tolist(), ends.tolist())]

    @property
    def piece_bytes(self) -> int:
        """Bytes of one (KV head, block) piece of the smaller of K and V (``bs * min(D, Dv)``
        elements): below ``OS_PAGE`` neighbouring blocks share OS pages (``discard``)."""
        elt = torch.empty((), dtype=self.dtype).element_size()
        return self.block_size * min(self.head_dim, self.v_head_dim) * elt

    def _buffers(self):
        """``(layer, buffer, piece bytes)`` of every K and V buffer, layer by layer (K then V); a
        compact tier: ``(None, pool, piece bytes)`` of its two pools."""
        bs = self.block_size
        if self.compact:
            yield None, self.k_pool, bs * self.head_dim * self.k_pool.element_size()
            yield None, self.v_pool, bs * self.v_head_dim * self.v_pool.element_size()
            return
        for li in range(self.num_layers):
            yield li, self.k[li], bs * self.head_dim * self.k[li].element_size()
            yield li, self.v[li], bs * self.v_head_dim * self.v[li].element_size()

    def discard(self, pages: torch.Tensor, written: torch.Tensor | None = None) -> int:
        """Give the memory of blocks ``pages [N]`` (int64 host pages, every layer and KV head)
        back to the OS. Only the OS pages wholly inside those blocks' pieces are given back (a
        piece smaller than an OS page, or not a multiple of one, shares OS pages with its
        neighbours): what was given back reads as zeros until written again, the rest keeps its
        data. Nothing on a pinned tier (page-locked memory stays).

        Args:
            written: ``[L, H, N]`` bool (optional), the pieces of ``pages`` that may hold data
                (a PD decode node: ``RemoteBlocks.written``, the pieces read or written there
                and every piece of a page whose memory was not given back since its last use);
                the others must not hold data. Used per K or V buffer whose pieces are whole
                OS pages (none shares one: 4 KiB or 8 KiB pieces with 4 KiB OS pages, not 2 KiB
                or 6 KiB ones): a run of consecutive pieces none of which is written is skipped,
                each other run is given back whole, as without ``written``. So the ``madvise``
                calls go from one per run of consecutive pieces to one per run holding a
                written piece.

        Cost: one ``madvise`` per run, about 3.6 us on a resident piece and 2.2 us on one never
        written on the dev box (a 16K request of a Qwen3-8B-shaped tier with scattered blocks:
        0.3-1.8 s; ``scripts/bench_discard.py``).

        Returns: bytes given back (an upper bound: pages never written count too).
        Raises:
            RuntimeError: a compact tier (``unassign`` frees a page's pieces there).
            ValueError: a page outside ``0 .. P - 1``, pages that are not integers (a bool mask,
                floats), or ``written`` not a dense bool tensor of shape ``[L, H, N]``.
        """
        if self.compact:
            raise RuntimeError(f"HostTier.discard: a compact tier (num_slots={self.num_slots}) gives pages back "
                               f"with unassign (their slots), not discard")
        pages = torch.as_tensor(pages)
        if pages.dtype == torch.bool or pages.dtype.is_floating_point or pages.dtype.is_complex:
            raise ValueError(f"HostTier.discard: pages must be integers, got {pages.dtype}")
        pages = pages.reshape(-1).to("cpu", torch.int64)
        if written is not None:
            written = torch.as_tensor(written)
            want = (self.num_layers, self.head_num, pages.numel())
            if (written.dtype != torch.bool or tuple(written.shape) != want or written.layout != torch.strided
                    or written.device.type == "meta"):
                raise ValueError(f"HostTier.discard: written must be a bool tensor of shape {list(want)}, "
                                 f"got {written.dtype} {list(written.shape)}")
            written = written.cpu()
        if not self.on_demand or not pages.numel():
            return 0
        if int(pages.min()) < 0 or int(pages.max()) >= self.num_pages:
            raise ValueError(f"HostTier.discard: pages must be in 0..{self.num_pages - 1}")
        P = self.num_pages
        runs = self._runs(torch.arange(self.head_num)[:, None] * P + pages[None, :])      # pieces h * P + page, h major
        ranges = []
        for li, buf, pb in self._buffers():
            w = written[li].reshape(-1) if written is not None and pb % OS_PAGE == 0 else None
            ranges += self._ranges(buf, runs, pb, w)
        libc, n = _libc(), 0
        for a, b in ranges:
            a, b = -(-a // OS_PAGE) * OS_PAGE, b // OS_PAGE * OS_PAGE
            if b > a:
                if libc.madvise(a, b - a, _MADV_DONTNEED) != 0:
                    raise OSError(ctypes.get_errno(), "HostTier.discard: madvise failed")
                n += b - a
        return n

    def resident_bytes(self) -> int:
        """Host memory the tier holds now, in bytes (``mincore``: OS pages resident, all buffers;
        about a second for a tier of 10^7 OS pages). A pinned tier is resident whole; an
        on-demand one only where blocks were written.

        Raises:
            OSError: ``mincore`` failed."""
        if not self.on_demand:
            return self.nbytes
        return sum(int(res.sum()) * OS_PAGE for _, _, res, _ in self._resident_os_pages())

    def _resident_os_pages(self):
        """Per non-empty K / V buffer: ``(buffer, piece bytes, res, offset)``, ``res`` ``[n]``
        bool the OS pages spanning it that are resident (``mincore``), ``offset`` the buffer's
        start within the first of them (bytes). Raises OSError when ``mincore`` fails."""
        libc = _libc()
        for _, buf, pb in self._buffers():
            size = buf.numel() * buf.element_size()
            if not size:
                continue
            a = buf.data_ptr() // OS_PAGE * OS_PAGE
            npg = -(-(buf.data_ptr() + size - a) // OS_PAGE)
            vec = (ctypes.c_ubyte * npg)()
            if libc.mincore(a, npg * OS_PAGE, vec) != 0:
                raise OSError(ctypes.get_errno(), "HostTier: mincore failed")
            yield buf, pb, (torch.frombuffer(vec, dtype=torch.uint8) & 1).bool(), buf.data_ptr() - a

    def resident_pages(self) -> torch.Tensor:
        """``[N]`` int64 host pages (sorted) any of whose pieces (any layer, K or V, KV head)
        touches a resident OS page (``mincore``). A pinned tier: every page. Tells which blocks
        hold memory when ``resident_bytes`` says the tier holds more than its requests do (an
        OS page shared by neighbouring blocks counts for each of them). A compact tier: the pages
        one of whose pieces has a slot touching a resident OS page (pinned: every slot).

        Raises:
            OSError: ``mincore`` failed."""
        P = self.num_pages
        if self.compact:
            return self._resident_pages_compact()
        if not self.on_demand:
            return torch.arange(P, dtype=torch.int64)
        hit = torch.zeros(P, dtype=torch.bool)
        for buf, pb, res, start in self._resident_os_pages():
            n = buf.numel() * buf.element_size() // pb           # pieces: H * P
            off = start + torch.arange(n, dtype=torch.int64) * pb
            first, last = off // OS_PAGE, (off + pb - 1) // OS_PAGE
            cs = torch.cat([torch.zeros(1, dtype=torch.int64), res.to(torch.int64).cumsum(0)])
            any_res = (cs[last + 1] - cs[first]) > 0
            hit |= any_res.view(-1, P).any(0)
        return torch.nonzero(hit).reshape(-1)

    def _resident_pages_compact(self) -> torch.Tensor:
        """``resident_pages`` of a compact tier: resident slots through the table."""
        res_slot = torch.zeros(self.num_slots, dtype=torch.bool)
        if not self.on_demand:
            res_slot[:] = True
        else:
            for buf, pb, res, start in self._resident_os_pages():
                off = start + torch.arange(self.num_slots, dtype=torch.int64) * pb
                first, last = off // OS_PAGE, (off + pb - 1) // OS_PAGE
                cs = torch.cat([torch.zeros(1, dtype=torch.int64), res.to(torch.int64).cumsum(0)])
                res_slot |= (cs[last + 1] - cs[first]) > 0
        s = self.slots.to(torch.int64)
        hit = (s >= 0) & res_slot[s.clamp(min=0)]
        return torch.nonzero(hit.view(self.num_layers * self.head_num, self.num_pages).any(0)).reshape(-1)

    def read_tokens(self, layer: int, loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather tokens by location: returns ``(k [n, H, D], v [n, H, Dv])`` on the CPU. A
        compact tier reads through ``slots[layer]``; a piece without a slot reads as zeros (as a
        piece never written does on the whole tier)."""
        loc = loc.to("cpu", torch.int64)
        page, off = loc // self.block_size, loc % self.block_size
        if self.compact:
            sl = self.slots[layer].to(torch.int64)[torch.arange(self.head_num)[None, :] * self.num_pages
                                                   + page[:, None]]                               # [n, H]
            have = sl >= 0
            o = off[:, None].expand_as(sl)
            k = torch.zeros((loc.numel(), self.head_num, self.head_dim), dtype=self.dtype)
            v = torch.zeros((loc.numel(), self.head_num, self.v_head_dim), dtype=self.dtype)
            k[have], v[have] = self.k_pool[sl[have], o[have]], self.v_pool[sl[have], o[have]]
            return k, v
        return (self.k[layer][:, page, off].transpose(0, 1).contiguous(),
                self.v[layer][:, page, off].transpose(0, 1).contiguous())

    def read_prefix(self, layer: int, req_to_token_row: torch.Tensor, n: int, device: torch.device | str,
                    copy_blocks, slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions ``0 .. n-1`` of one request from the host tier, on ``device``.

        Args:
            layer: sparse-layer index of this tier.
            req_to_token_row: the request's row of SGLang's ``req_to_token`` (position -> slot).
            n: tokens to read.
            copy_blocks: the engine's ``ops.copy_blocks`` (``core/ops.py``; the H2D gather kernel on CUDA).
            slots: a compact tier only: ``slots[layer]`` (``[H * P]`` int32) on ``device`` (the
                engine's device copy; default this tier's table, copied there). A piece without a
                slot reads as zeros (as a piece never written does on the whole tier).
        Returns:
            ``(k [n, H, D], v [n, H, Dv])`` in the host tier's dtype.

        Whole blocks go through ``copy_blocks`` (on CUDA the H2D gather kernel, 4 KiB pieces
        straight from pinned memory; a 16K-token prefix of a Qwen3-8B layer is 32 MB, under a
        millisecond); a tail that is not a whole block is gathered token by token on the host.
        (SGLang's prefixes are page-aligned and ``--page-size`` is the block size, so the tail
        is empty for a chunked prefill or a radix-cache hit.) This replaces a token-by-token
        gather on the host CPU.
        """
        li, bs, H, D, Dv = layer, self.block_size, self.head_num, self.head_dim, self.v_head_dim
        nb = n // bs
        dev = torch.device(device)
        parts_k, parts_v = [], []
        if nb:
            rt = req_to_token_row.to(dev)
            pages = torch.div(rt[:nb * bs:bs].to(torch.int64), bs, rounding_mode="floor")           # [nb]
            P = self.num_pages
            src = (torch.arange(H, device=dev)[:, None] * P + pages[None, :]).reshape(-1)        # [H * nb]
            dst = torch.arange(H * nb, device=dev)
            hk, hv = self.piece_views(li)
            if self.compact:
                table = self.slots[li].to(dev) if slots is None else slots
                src = table[src].to(torch.int64)
                dst = torch.where(src >= 0, dst, -1)           # no slot: no copy, zeros
                kb = torch.zeros((H * nb, bs * D), dtype=self.dtype, device=dev)
                vb = torch.zeros((H * nb, bs * Dv), dtype=self.dtype, device=dev)
            else:
                kb = torch.empty((H * nb, bs * D), dtype=self.dtype, device=dev)
                vb = torch.empty((H * nb, bs * Dv), dtype=self.dtype, device=dev)
            copy_blocks(kb, vb, dst, hk, hv, src)
            parts_k.append(kb.view(H, nb * bs, D).transpose(0, 1))
            parts_v.append(vb.view(H, nb * bs, Dv).transpose(0, 1))
        if n > nb * bs:
            kt, vt = self.read_tokens(li, req_to_token_row[nb * bs:n])
            parts_k.append(kt.to(dev))
            parts_v.append(vt.to(dev))
        if len(parts_k) == 1:
            return parts_k[0].contiguous(), parts_v[0].contiguous()
        if not parts_k:
            return (torch.empty((0, H, D), dtype=self.dtype, device=dev),
                    torch.empty((0, H, Dv), dtype=self.dtype, device=dev))
        return torch.cat(parts_k), torch.cat(parts_v)
