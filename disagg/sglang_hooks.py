"""Hooks on SGLang's PD disaggregation for ``--kv-sparse oasis`` (listed in ``sglang_glue/hooks.py``).

Each delegates to this process's side (``serving.side()``: :class:`~.serving.PrefillSide` on a
prefill node, :class:`~.serving.DecodeSide` on a decode node) and does nothing without one
(not PD, or not ``--kv-sparse oasis``).
"""

from __future__ import annotations

import base64
import logging
import threading
import time

from .serving import TIER_ROUTE, DecodeSide, PrefillSide, connect_host, side, tp_agree
from .transport import TierLayout

logger = logging.getLogger(__name__)


def bootstrap_routes_hook(result, self, *args, **kwargs):
    """AFTER ``CommonKVBootstrapServer._setup_routes``: the route ``/oasis/tier`` where a
    prefill node's ranks PUT their host tier's NIXL layout and decode nodes GET it
    (``?rank=R``). 404 with "no OasisKV host tier" when none was registered (a dense prefill)."""
    from aiohttp import web

    tiers: dict[int, str] = {}
    self._oasis_tiers = tiers

    async def handle(request):
        if request.method == "PUT":
            try:
                d = await request.json()
                rank, layout = d["rank"], d["layout"]
                if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
                    raise ValueError(f"rank {rank!r}: want an integer >= 0")
                TierLayout.from_bytes(base64.b64decode(layout, validate=True))
                tiers[rank] = layout
            except (ValueError, KeyError, TypeError, OverflowError) as e:
                return web.Response(status=400, text=f"OasisKV tier registration: {type(e).__name__}: {e}")
            return web.Response(text="OK")
        if request.method != "GET":
            return web.Response(status=405, text="Method not allowed")
        try:
            rank = int(request.query.get("rank", "0"))
        except (ValueError, OverflowError):
            return web.Response(status=400, text="rank must be an integer")
        if rank not in tiers:
            return web.Response(status=404, text=f"no OasisKV host tier registered for rank {rank} (is the "
                                                 "prefill node running --kv-sparse oasis?)")
        return web.json_response({"layout": tiers[rank]})

    self.app.router.add_route("*", TIER_ROUTE, handle)
    return result


def register_to_bootstrap_hook(result, self, *args, **kwargs):
    """AFTER ``CommonKVManager.register_to_bootstrap`` (a prefill rank registered with its
    bootstrap server): register this rank's host-tier layout there too."""
    s = side()
    if not isinstance(s, PrefillSide):
        return result
    import requests

    from sglang.srt.utils.network import NetworkAddress

    if getattr(self, "dist_init_addr", None):
        host = NetworkAddress.parse(self.dist_init_addr).resolved().host
    else:
        host = connect_host(self.bootstrap_host)
    url = f"{NetworkAddress(host, self.bootstrap_port).to_url()}{TIER_ROUTE}"
    payload = {"rank": int(getattr(self, "attn_tp_rank", 0) or 0), "layout": s.layout_b64()}
    r = requests.put(url, json=payload, timeout=10)
    if r.status_code != 200:
        raise RuntimeError(f"OasisKV PD: registering the host tier with the bootstrap server {url} failed: "
                           f"HTTP {r.status_code} {r.text[:200]}")
    logger.info("OasisKV PD: host tier registered with NIXL as agent %s (staging pool for decode nodes; "
                "leases of %.0f s)", s.tier.name, s.lease_s)
    return result


def prefill_release_hook(original, req, tree_cache, *args, **kwargs):
    """AROUND ``disaggregation.prefill.release_kv_cache``: after a successful transfer the
    request's pages are leased to its decode node instead of freed (``PrefillSide.lease``);
    every other release (failures, aborts, retries) frees at once."""
    s = side()
    sender = getattr(req, "disagg_kv_sender", None)
    if isinstance(s, PrefillSide) and sender is not None and req.req_pool_idx is not None:
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

        if not isinstance(req.finished_reason, FINISH_ABORT) and req.bootstrap_host != FAKE_BOOTSTRAP_HOST \
                and not getattr(req, "_oasis_transfer_failed", False) and sender.poll() == KVPoll.Success:
            s.lease(req.bootstrap_room, lambda: original(req, tree_cache, *args, **kwargs), req.rid,
                    _uncached_tokens(req, tree_cache), _last_page(req, tree_cache))
            return None
    return original(req, tree_cache, *args, **kwargs)


def transfer_failure_hook(original, self, req, *args, **kwargs):
    """AROUND ``SchedulerDisaggregationPrefillMixin.handle_inflight_transfer_failure``: the
    transfer failed by the TP ranks' agreed status (SGLang's ``poll_and_all_reduce`` takes the
    lowest), so the request's pages are freed on every rank (:func:`prefill_release_hook`), also
    on a rank whose own sender says Success: the ranks' free pages must stay alike."""
    req._oasis_transfer_failed = True
    return original(self, req, *args, **kwargs)


def tp_mismatch(addr: str, prefill_tp, decode_tp) -> str | None:
    """The error for a decode node whose attention TP size differs from its prefill node's, or
    ``None`` when they are equal (or one is not known). OasisKV PD maps decode rank ``r`` to
    prefill rank ``r`` (``TierLayout.compatible``); SGLang 0.5.17's NIXL transfer between nodes
    of different TP sizes to a host-memory pool raises ``NotImplementedError`` in the prefill
    node's bootstrap thread (``disaggregation/nixl/conn.py``), which stops that node."""
    if prefill_tp is None or decode_tp is None or int(prefill_tp) == int(decode_tp):
        return None
    return (f"OasisKV PD: --tp-size: the prefill node at {addr} runs {int(prefill_tp)} attention TP rank(s), this "
            f"decode node {int(decode_tp)}; with --kv-sparse oasis decode rank r reads its KV heads from prefill "
            f"rank r: give both nodes the same --tp-size")


def config_mismatch(addr: str, err: Exception) -> str | None:
    """The error for a request whose prefill node SGLang found incompatible in its own checks
    (``CommonKVManager.try_ensure_parallel_info``: page size, KV cache dtype), naming OasisKV's
    key, or ``None`` for any other error. SGLang raises these inside the decode scheduler's
    loop, which stops the whole decode node and leaves the request unanswered."""
    msg = str(err)
    if msg.startswith("Page size mismatch"):
        return (f"OasisKV PD: block_size: the prefill node at {addr} and this decode node differ ({msg} With "
                f"--kv-sparse oasis the page size is the config's block_size): give both nodes the same block_size")
    if msg.startswith("KV cache dtype mismatch"):
        return f"OasisKV PD: --kv-cache-dtype: the prefill node at {addr} and this decode node differ ({msg})"
    return None


def ensure_prefill_info_hook(original, self, addr_to_reqs, *args, **kwargs):
    """AROUND ``DecodePreallocQueue._ensure_prefill_info``: a request whose prefill node runs
    another TP size fails here, with an error naming ``--tp-size`` (:func:`tp_mismatch`), and
    so does one whose prefill node SGLang's own checks refuse (another ``block_size`` or KV
    cache dtype, :func:`config_mismatch`; SGLang would raise and stop this node), and one whose
    prefill node's OasisKV host tier this node cannot read (another ``dense_layers``:
    :func:`_tier_mismatch`), before SGLang registers this node's KV buffers with that node (``receiver.init`` ->
    ``_register_kv_args``, which would stop the prefill node's bootstrap thread on a transfer to
    host memory: it then serves nobody). It fails as SGLang fails a request whose prefill
    node could not be reached (``kv_receiver.abort``; the handshake poll then ends it with this
    message); every TP rank reads the same prefill info, so all ranks end it. The info is not
    kept, so each later request to that node is checked here too (SGLang's cached info is
    trusted otherwise: a prefill node restarted with another TP size on the same bootstrap
    address before SGLang's heartbeat dropped the old info, about 10 s, is not re-checked). TP
    rank 0 tells the prefill node's ranks (:func:`_notify_prefill_abort`, in a thread), which end
    their side at once; the prefill node serves everyone else throughout."""
    if not isinstance(side(), DecodeSide):
        return original(self, addr_to_reqs, *args, **kwargs)
    ready, remaining, refused = {}, [], []
    for addr, reqs in addr_to_reqs.items():     # one at a time: SGLang's loop raises for the first mismatch
        try:
            got, rest = original(self, {addr: reqs}, *args, **kwargs)
        except RuntimeError as e:
            why = config_mismatch(addr, e)
            if why is None:
                raise
            refused.append((addr, reqs, why, None))
            continue
        ready.update(got)
        remaining.extend(rest)
    mgr = self.kv_manager
    for addr in list(ready):
        info = getattr(mgr, "prefill_info_table", {}).get(addr)
        why = tp_mismatch(addr, getattr(info, "attn_tp_size", None), getattr(mgr, "attn_tp_size", None))
        if why is None:
            why = _tier_mismatch(addr)
        if why is not None:
            refused.append((addr, ready.pop(addr), why, info))
    for addr, reqs, why, info in refused:
        # not cached: SGLang's fast path (``DecodePreallocQueue.add``) would start the next
        # request's transfer from the cached info; uncached, each one comes here
        lock = getattr(mgr, "connection_lock", None)
        if lock is not None:
            with lock:
                mgr.prefill_info_table.pop(addr, None)
        else:
            mgr.prefill_info_table.pop(addr, None)
        rooms = []
        for decode_req in reqs:
            r = decode_req.kv_receiver
            if r is None:
                continue
            r.abort()
            mgr.record_failure(r.bootstrap_room, why)     # abort() recorded "Aborted by AbortReq."
            rooms.append(int(r.bootstrap_room))
        logger.error("%s (%d request(s) refused)", why, len(rooms))
        if rooms and int(getattr(mgr, "attn_tp_rank", 0) or 0) == 0:
            # off the scheduler loop: its HTTP and ZMQ calls must not hold the running batch
            threading.Thread(target=_notify_prefill_abort, args=(mgr, addr, info, rooms, why), daemon=True,
                             name="oasis-pd-abort-notice").start()
    return ready, remaining


def node_failure_hook(result, self, failed_bootstrap_addr, *args, **kwargs):
    """AFTER ``CommonKVManager._handle_node_failure`` on an OasisKV decode node: SGLang's
    heartbeat found a prefill node's bootstrap server down (``SGLANG_DISAGGREGATION_HEARTBEAT_*``:
    by default two failed checks 5 s apart) and failed the requests it had not transferred yet.
    Those it had are decoding here from that node's pages: :meth:`DecodeSide.probe` renews their
    leases at once, so a process that is gone ends them within about the heartbeat's time
    instead of when their leases turn stale (0.9 x ``pd_lease_s``), and a node restarted there is
    asked for its new NIXL agent before the next admission from it."""
    s = side()
    if not isinstance(s, DecodeSide):
        return result
    from sglang.srt.utils.network import NetworkAddress

    for host, port in list(s.peers):
        try:
            same = NetworkAddress(host, int(port)).to_host_port_str() == str(failed_bootstrap_addr)
        except Exception:  # noqa: BLE001 - an address SGLang cannot format is not this one
            same = False
        if same:
            held, sent = s.probe((host, port))
            logger.info("OasisKV PD: SGLang lost prefill node %s: renewing the leases of its %d request(s) here now "
                        "(%d sent) to find out whether its process is gone", failed_bootstrap_addr, held, sent)
    return result


def _tier_mismatch(addr: str) -> str | None:
    """Why the OasisKV host tier of the prefill node at bootstrap address ``addr`` cannot serve
    this decode node (``DecodeSide.peer_for``: its layout fetched once and checked, e.g. another
    ``dense_layers``, whose KV regions SGLang's NIXL transfer would size differently and fail in
    the prefill node's bootstrap thread, leaving that node unable to serve), or ``None``."""
    from sglang.srt.utils.network import NetworkAddress

    from .transport import PeerLostError

    try:
        na = NetworkAddress.parse(str(addr))
        side().peer_for(na.host, int(na.port))
    except PeerLostError as e:
        return f"OasisKV PD: prefill node {addr} cannot serve this decode node: {e.why}"
    except Exception:  # noqa: BLE001 - an address SGLang itself used; admission checks again
        return None
    return None


def _notify_prefill_abort(mgr, addr: str, info, rooms: list[int], why: str) -> None:
    """Tell every rank of the prefill node at ``addr`` that ``rooms`` were refused (SGLang's
    decode-to-prefill ``ABORT`` message, ``CommonKVReceiver._send_abort_notification``), so it
    ends its side at once (the router answers the client when both sides have) instead of
    never (SGLang 0.5.17's ``NixlKVSender`` does not check its bootstrap timeout: the request
    would wait until the client gave up), with ``why`` as its error
    (:func:`abort_notification_hook`). Runs in its own thread. Best effort: a prefill rank that
    cannot be reached is logged, and its side of the request waits as without this notice."""
    import requests
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    if info is None:                # (refused in SGLang's checks: its info was not kept)
        try:
            r = requests.get(f"http://{addr}/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&"
                             f"target_pp_rank=-1", timeout=5)
            from types import SimpleNamespace
            info = SimpleNamespace(**r.json()) if r.status_code == 200 else None
        except Exception as e:  # noqa: BLE001 - best effort
            logger.warning("OasisKV PD: the prefill node at %s did not give its ranks: %s", addr, e)
        if info is None:
            return
    sent = 0
    for dp in range(int(getattr(info, "dp_size", 1) or 1)):
        for tp in range(int(info.attn_tp_size)):
            for pp in range(int(getattr(info, "pp_size", 1) or 1)):
                try:
                    r = requests.get(f"http://{addr}/route?prefill_dp_rank={dp}&prefill_cp_rank=0&"
                                     f"target_tp_rank={tp}&target_pp_rank={pp}", timeout=5)
                    if r.status_code != 200:
                        continue
                    sock, lock = CommonKVReceiver._connect_to_bootstrap_server(r.json())
                    with lock:
                        for room in rooms:
                            # SGLang reads the first four frames; the fifth, the reason, is
                            # read by an OasisKV prefill node (abort_notification_hook)
                            sock.send_multipart([b"ABORT", str(room).encode("ascii"),
                                                 mgr.local_ip.encode("ascii"), str(mgr.rank_port).encode("ascii"),
                                                 why.encode()])
                    sent += 1
                except Exception as e:  # noqa: BLE001 - best effort, as SGLang's own notification
                    logger.warning("OasisKV PD: telling the prefill node at %s (dp %d, tp %d, pp %d) that a request "
                                   "was refused failed: %s", addr, dp, tp, pp, e)
    logger.info("OasisKV PD: told %d prefill rank(s) at %s that %d request(s) were refused", sent, addr, len(rooms))


ABORT_REASON_PREFIX = b"OasisKV PD: "
# rooms a decode node refused before this prefill node made their sender: room -> (reason, time)
_EARLY_ABORTS: dict[int, tuple[str, float]] = {}
_EARLY_ABORTS_LOCK = threading.Lock()
EARLY_ABORT_KEEP_S = 600.0


def _fail_room(mgr, room: int, reason: str) -> None:
    """Mark a prefill room not yet transferred failed with ``reason`` (as SGLang's handler does)."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    if room in mgr.request_status and mgr.check_status(room) != KVPoll.Success:
        mgr.record_failure(room, reason)
        mgr.update_status(room, KVPoll.Failed)


def abort_notification_hook(original, self, msg, *args, **kwargs):
    """AROUND ``NixlKVManager._handle_abort_notification`` on an OasisKV prefill node: a decode
    node's ``ABORT`` with a fifth frame (:func:`_notify_prefill_abort`) ends the request with
    that reason instead of SGLang's "Aborted by decode-side abort notification." (as SGLang's
    handler does: a room not yet transferred is marked failed, the reason recorded first). A
    notice can come before the request reaches this node's scheduler (the decode node refuses
    within milliseconds; a busy prefill loop creates the sender later), where SGLang's handler
    would drop it and the request would wait forever: the room is remembered first (for
    ``EARLY_ABORT_KEEP_S``) and :func:`sender_init_hook` fails it when its sender is made."""
    if not isinstance(side(), PrefillSide) or len(msg) < 5 or msg[0] != b"ABORT" \
            or not msg[4].startswith(ABORT_REASON_PREFIX):
        return original(self, msg, *args, **kwargs)
    try:
        room = int(msg[1].decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        return original(self, msg, *args, **kwargs)
    reason = msg[4][:2000].decode("utf-8", "replace")
    now = time.monotonic()
    with _EARLY_ABORTS_LOCK:               # first, so a sender made meanwhile finds it (sender_init_hook)
        for r in [r for r, (_, t) in _EARLY_ABORTS.items() if now - t > EARLY_ABORT_KEEP_S]:
            del _EARLY_ABORTS[r]
        _EARLY_ABORTS[room] = (reason, now)
    _fail_room(self, room, reason)
    return True


def sender_init_hook(result, self, *args, **kwargs):
    """AFTER ``NixlKVSender.__init__`` on an OasisKV prefill node: a room a decode node already
    refused (:func:`abort_notification_hook`) fails at once with its reason."""
    if not _EARLY_ABORTS or not isinstance(side(), PrefillSide):
        return result
    room = getattr(self, "bootstrap_room", None)
    with _EARLY_ABORTS_LOCK:
        got = _EARLY_ABORTS.pop(room, None)
    if got is not None:
        _fail_room(self.kv_mgr, room, got[0])
    return result


def send_kv_chunk_hook(original, self, req, last_chunk: bool = False, *args, **kwargs):
    """AROUND ``SchedulerDisaggregationPrefillMixin.send_kv_chunk``: before a request's last
    send, fill what it carries besides SGLang's own data (``PrefillSide.prepare_send``: the
    summaries in bf16 where the engine's are wider, and the first decode step's working set this
    node planned, region ``pd_first_step``)."""
    s = side()
    if isinstance(s, PrefillSide) and last_chunk and req.req_pool_idx is not None:
        try:
            s.prepare_send(self.token_to_kv_pool_allocator.get_kvcache(), int(req.req_pool_idx),
                           self.req_to_token_pool.req_to_token[req.req_pool_idx], len(req.origin_input_ids),
                           int(req.bootstrap_room or 0))
        except Exception:  # noqa: BLE001 - a bug here must not stop the prefill loop for everyone
            logger.exception("OasisKV PD: preparing the send of request %s failed; it is sent as it is (its "
                             "summaries on the decode node may be stale, its first step selected there)", req.rid)
    return original(self, req, last_chunk, *args, **kwargs)


def should_send_kv_chunk_hook(result, self, *args, **kwargs):
    """AFTER ``CommonKVSender.should_send_kv_chunk``: on an OasisKV prefill node a request is sent
    in one piece, with its last chunk (the chunks before it, and SGLang's early send of a cached
    prefix, are held back: ``send_kv_chunk`` then sends from the first unsent page), because
    every page carries the first step's working set (``pd_first_step``), which is known only
    after the last prompt token's forward."""
    last_chunk = kwargs.get("last_chunk", args[1] if len(args) > 1 else False)
    if isinstance(side(), PrefillSide) and not last_chunk:
        return False
    return result


def _last_page(req, tree_cache):
    """The page of the request's last transferred (prompt) token, which names its transfer in
    the decode node's release (``PrefillSide.lease``); ``None`` if it cannot be read."""
    try:
        n = len(req.origin_input_ids)
        slot = int(tree_cache.req_to_token_pool.req_to_token[req.req_pool_idx, n - 1])
        return slot // int(getattr(tree_cache, "page_size", 1) or 1)
    except Exception:  # noqa: BLE001 - the release then frees whatever lease the room has
        return None


def _uncached_tokens(req, tree_cache) -> int:
    """The request's KV slots outside the radix cache, as SGLang's invariant checker counts them
    (``scheduler_components/invariant_checker.py _get_total_uncached_sizes``)."""
    n = int(req.kv.kv_allocated_len) if req.kv is not None else 0
    ps = int(getattr(tree_cache, "page_size", 1) or 1)
    if ps > 1:
        n = -(-n // ps) * ps
    return n - int(getattr(req, "cache_protected_len", 0) or 0)


def check_full_pool_hook(original, self, ps, uncached=0, *args, **kwargs):
    """AROUND ``SchedulerInvariantChecker._check_full_pool`` (SGLang's idle and busy memory checks): the
    pages a prefill node holds under leases are accounted, not leaked."""
    s = side()
    if isinstance(s, PrefillSide):
        uncached += s.held_tokens()
    return original(self, ps, uncached, *args, **kwargs)


def check_req_pool_hook(original, self, *args, **kwargs):
    """AROUND ``SchedulerInvariantChecker._check_req_pool``: request rows held by leases are
    accounted, not leaked (the check passes when free + session + leased rows make the total)."""
    s = side()
    if isinstance(s, PrefillSide) and s.leases:
        rtp = self.req_to_token_pool
        held = self.pool_stats_observer.session_held_req_count()
        if len(rtp.free_slots) + held + len(s.leases) == rtp.size:
            return None
    return original(self, *args, **kwargs)


def flush_cache_hook(original, self, *args, **kwargs):
    """AROUND ``Scheduler.flush_cache``: a prefill node holding leases is not idle (decode nodes
    still read those pages): refuse the flush, as SGLang refuses it with requests pending."""
    s = side()
    if isinstance(s, PrefillSide) and s.leases:
        logger.warning("Cache not flushed because %d transferred request(s) are still leased to decode nodes "
                       "(OasisKV PD; they end at their release or after pd_lease_s)", len(s.leases))
        return False
    return original(self, *args, **kwargs)


def prefill_poll_hook(result, self, *args, **kwargs):
    """AFTER ``SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue`` (every
    loop iteration): free the leases released by decode nodes or expired."""
    s = side()
    if isinstance(s, PrefillSide):
        s.poll(group=_tp_group(self))
    return result


_TP_ANNOUNCED = False


def _tp_group(scheduler):
    """SGLang's attention-TP CPU (gloo) group of a scheduler (``Scheduler.attn_tp_cpu_group``;
    its size is ``Scheduler.ps.attn_tp_size`` in 0.5.17), or ``None`` with one rank. The first
    time a group of several ranks is used, one line says so (per rank)."""
    global _TP_ANNOUNCED
    ps = getattr(scheduler, "ps", None)
    n = getattr(ps, "attn_tp_size", None) if ps is not None else None
    if n is None:
        n = getattr(scheduler, "attn_tp_size", None) or getattr(scheduler, "tp_size", 1)
    group = getattr(scheduler, "attn_tp_cpu_group", None) or getattr(scheduler, "tp_cpu_group", None)
    if int(n or 1) <= 1 or group is None:
        return None
    if not _TP_ANNOUNCED:
        _TP_ANNOUNCED = True
        logger.info("OasisKV PD: %d TP ranks: lease frees, request ends and first-step plans are agreed over "
                    "SGLang's attention-TP CPU group", int(n))
    return group


def pop_transferred_hook(result, self, *args, **kwargs):
    """AFTER ``DecodeTransferQueue.pop_transferred``: admit each transferred request into OasisKV
    (``DecodeSide.admit``); one that cannot be admitted ends with an error, the others go on."""
    s = side()
    if not isinstance(s, DecodeSide) or not result:
        return result
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    rtt = self.scheduler.req_to_token_pool.req_to_token
    if s.draft_page_bytes is None:
        s.draft_page_bytes = _draft_page_bytes(self.scheduler)
    failed: dict[int, str] = {}
    for req in result:
        if req.bootstrap_host == FAKE_BOOTSTRAP_HOST:     # SGLang's warm-up: no prefill node, no KV sent
            continue
        try:
            s.admit(req.req_pool_idx, rtt[req.req_pool_idx], _transferred_len(req), req.bootstrap_host,
                    req.bootstrap_port, req.bootstrap_room, req.rid, install=False)
        except Exception as e:  # noqa: BLE001 - one request's admission must not stop the decode loop
            logger.error("OasisKV PD: request %s cannot be admitted: %s", req.rid, e)
            if req.req_pool_idx is not None:
                failed[int(req.req_pool_idx)] = str(e)
            else:
                _abort(req, f"OasisKV PD: cannot admit the request: {e}")
            s.refuse(req.bootstrap_host, req.bootstrap_port, req.bootstrap_room, req.rid)
    # with TP every rank ends a request one rank could not admit (its rows are freed as usual)
    failed = tp_agree(failed, _tp_group(self.scheduler))
    for req in result:
        why = failed.get(int(req.req_pool_idx)) if req.req_pool_idx is not None else None
        if why is not None:
            _abort(req, f"OasisKV PD: cannot admit the request: {why}")
    group = _tp_group(self.scheduler)
    try:
        s.install_first_steps()      # one READ per prefill node for every admitted request's first step
    except Exception:  # noqa: BLE001 - the rows then select their first steps themselves
        logger.exception("OasisKV PD: installing the planned first steps failed")
    if group is not None:            # with TP a row keeps its plan only where every rank installed it
        mine = {int(r): rid for r, rid in s.installed_now}
        kept = tp_agree(mine, group, every=True)
        s.drop_first_steps({r: rid for r, rid in mine.items() if r not in kept})
    return result


def _draft_page_bytes(scheduler) -> int:
    """Bytes per page of the draft model's KV cache, which SGLang's transfer sends whole
    (``DecodePreallocQueue._init_kv_manager`` adds the draft pool's regions); 0 without a draft."""
    q = getattr(scheduler, "disagg_decode_prealloc_queue", None)
    pool = getattr(q, "draft_token_to_kv_pool", None)
    if pool is None:
        return 0
    try:
        return int(sum(pool.get_contiguous_buf_infos()[2]))
    except Exception as e:  # noqa: BLE001 - only a log figure depends on it
        logger.warning("OasisKV PD: the draft model's KV bytes per page could not be read (%s); not counted", e)
        return 0


def _transferred_len(req) -> int:
    """Tokens whose KV the prefill node sent: the prompt, or after a retraction the prompt and
    the output before the replayed boundary token (``DecodePreallocQueue._rebootstrap_prefill_len``;
    SGLang's commit has appended that token again by now)."""
    if getattr(req, "pd_rebootstrap_in_progress", False):
        return len(req.origin_input_ids) + len(req.output_ids) - 1
    return len(req.origin_input_ids)


def release_req_hook(original, *args, **kwargs):
    """AROUND ``managers.schedule_batch.release_req`` (a decode request retracted: SGLang's
    ``retract_decode`` or the retract pause). On an OasisKV PD decode node its KV is not copied
    to the CPU (``offload_kv=False``: the sparse layers' placeholders cannot be copied, and their
    blocks are on the prefill node anyway); the request is recomputed by its prefill node through
    SGLang's PD rebootstrap (:func:`prealloc_add_hook`). Its pages are freed here
    (:func:`decode_req_free_hook`, with ``req.is_retracted`` not yet set: SGLang sets it after)."""
    s = side()
    if isinstance(s, DecodeSide):
        kwargs["offload_kv"] = False
        req = kwargs.get("req")
        if req is not None and not req.finished() and req.to_finish is None:
            req._oasis_retracting = True
            try:
                return original(*args, **kwargs)
            finally:
                req._oasis_retracting = False
    return original(*args, **kwargs)


def prealloc_add_hook(original, self, req, is_retracted=False, is_rebootstrap=False, *args, **kwargs):
    """AROUND ``DecodePreallocQueue.add``: on an OasisKV PD decode node a retracted request is
    recomputed by its prefill node (SGLang's PD rebootstrap, as its retract pause does:
    the last output token is replayed) instead of waiting in the retracted queue for a CPU copy
    of its KV that was not made (:func:`release_req_hook`)."""
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    s = side()
    if isinstance(s, DecodeSide) and is_retracted and req.bootstrap_host not in (None, FAKE_BOOTSTRAP_HOST):
        if req.output_ids:
            req.pd_rebootstrap_forced_output_id = req.output_ids.pop()
        req.pd_rebootstrap_in_progress = True
        s.retracted += 1
        logger.info("OasisKV PD: request %s retracted (decode KV slots ran out); its prefill node recomputes its %d "
                    "tokens (SGLang's PD rebootstrap); retracted so far: %d", req.rid,
                    len(req.origin_input_ids) + len(req.output_ids), s.retracted)
        return original(self, req, *args, is_retracted=False, is_rebootstrap=True, **kwargs)
    return original(self, req, *args, is_retracted=is_retracted, is_rebootstrap=is_rebootstrap, **kwargs)


def decode_req_free_hook(self, req, *args, **kwargs):
    """BEFORE ``DecodeReqToTokenPool.free``: free the request's working set and its remote
    pages, and tell its prefill node (``DecodeSide.request_freed``), also for a request that
    ended before its admission (aborted or failed in SGLang's transfer queue)."""
    from oasis_sglang.sglang_glue.runtime import runtime_of

    rt = runtime_of(self)
    if rt is not None and req.req_pool_idx is not None:
        rt.engine.reset_rows([req.req_pool_idx])
        s = side()
        if isinstance(s, DecodeSide):
            from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

            pd = req.bootstrap_host not in (None, FAKE_BOOTSTRAP_HOST) and req.bootstrap_room is not None
            pages, n = _request_pages(self, req, rt.engine.bs)
            s.request_freed(req.req_pool_idx, pages,
                            (req.bootstrap_host, req.bootstrap_port, req.bootstrap_room) if pd else None, req.rid,
                            retracted=bool(getattr(req, "_oasis_retracting", False)), tokens=n)
    return None


def _request_pages(req_to_token_pool, req, block_size: int):
    """``([N] int64 host pages, tokens)`` of every token slot the request held (prompt and output: SGLang's
    ``kv_allocated_len``, whose slots ``mem_cache/common.py release_kv_cache`` has just freed;
    nothing is allocated before this hook runs)."""
    from .admission import request_pages

    row = req_to_token_pool.req_to_token[req.req_pool_idx]
    kv = getattr(req, "kv", None)
    n = int(kv.kv_allocated_len) if kv is not None else int(getattr(req, "kv_committed_len", 0) or 0)
    n = min(n, row.numel())
    if n <= 0:
        return None, None
    return request_pages(row, n, block_size), n


def decode_req_clear_hook(result, self, *args, **kwargs):
    """AFTER ``DecodeReqToTokenPool.clear``: free every working set and remote page."""
    from oasis_sglang.sglang_glue.runtime import runtime_of

    rt = runtime_of(self)
    if rt is not None:
        rt.engine.reset_rows(list(range(rt.engine.ws.R)))
        s = side()
        if isinstance(s, DecodeSide):
            for row in list(s.rows):
                s.release(row)
    return result


def _abort(req, message: str) -> None:
    """End a running request with an error at its next result (SGLang's ``Req.to_finish``; not
    ``set_finish_with_abort``, which rewrites the prompt of a request not yet prefilled)."""
    from http import HTTPStatus

    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    req.to_finish = FINISH_ABORT(message, HTTPStatus.INTERNAL_SERVER_ERROR, "InternalServerError")


def abort_lost(batch, group=None) -> None:
    """Before a decode batch runs (``scheduler_hooks.run_batch_hook``): end with an error the
    requests whose prefill node was lost (their blocks cannot be read any more), whose blocks a
    full compact host tier could not take (``DecodeSide.starved_rows``), or whose lease
    there was not renewed for most of its length (``DecodeSide.cut_off_stale``: the pages may be
    another request's by now, so no read of them starts again, also not in the request's last
    forward). (Leases are renewed by ``DecodeSide``'s renewal thread, not here.) With TP
    (``group``: SGLang's attention-TP CPU group, the same batch on every rank) a request ends on
    every rank when one rank lost its prefill rank or found it stale (``serving.tp_agree``)."""
    s = side()
    if not isinstance(s, DecodeSide):
        return
    reqs = getattr(batch, "reqs", None) or []
    stale = s.cut_off_stale()
    starved = s.starved_rows()
    ends: dict[int, str] = {}
    if s.remote.lost or stale or starved:
        lost = s.lost_rows()
        for req in reqs:
            if req.to_finish is not None or req.finished_reason is not None or req.req_pool_idx is None:
                continue
            why = lost.get(req.req_pool_idx)
            if why is not None:
                ends[int(req.req_pool_idx)] = f"its prefill node was lost ({why})"
            elif req.req_pool_idx in stale:
                ends[int(req.req_pool_idx)] = ("its KV cache on its prefill node can no longer be relied on "
                                               f"({stale[req.req_pool_idx]})")
            elif req.req_pool_idx in starved:
                ends[int(req.req_pool_idx)] = starved[req.req_pool_idx]
    ends = tp_agree(ends, group)
    if not ends:
        return
    for req in reqs:
        why = ends.get(req.req_pool_idx) if req.req_pool_idx is not None else None
        if why is None or req.to_finish is not None or req.finished_reason is not None:
            continue
        logger.error("OasisKV PD: request %s ends: %s", req.rid, why)
        _abort(req, f"OasisKV PD: this request ends: {why}")
        s.aborted += 1
