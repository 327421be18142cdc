"""disagg/serving.py over real NIXL (UCX loopback), on the torch engine, without SGLang.

SGLang's transfer is played by copying the regions ``OasisKVPool.get_contiguous_buf_infos``
advertises page by page (the summaries and the page numbers); the rest is the serving code:
``DecodeSide.admit`` (the decode node knows only the prefill node's page of each block), a
synchronous first step that reads its blocks on demand, ``DecodeSide.release`` telling the
prefill node, whose ``PrefillSide.poll`` frees the lease; expiry; a lost peer's rows."""

import base64
import sys
import json
import time
import types

import pytest
import torch

pytest.importorskip("nixl")

from oasis_sglang.disagg.serving import Admitted, DecodeSide, PrefillSide, lease_clock, set_side  # noqa: E402
from oasis_sglang.disagg.admission import first_step_width, plan_from_mask, room_tag  # noqa: E402
from oasis_sglang.disagg.transport import TierLayout  # noqa: E402
from test_admission import BS, H, HQ, LAYERS, ROWS, TOKENS, D, decode, engine, locs, prefill, prefilled  # noqa: E402,F401


def pool_of(eng):
    """What DecodeSide needs of SGLang's pool (size, page size, device; it sets pd_page_ids)."""
    return types.SimpleNamespace(size=TOKENS - BS, page_size=BS, device="cpu", pd_page_ids=None)


def sglang_transfer(pf, dc, dc_pool, src_pages, dst_pages):
    """SGLang's page-by-page copy of the summaries and the page numbers (prefill page p holds p)."""
    for li in range(len(pf.sparse_layers)):
        dc.summaries.kmin[li][dst_pages] = pf.summaries.kmin[li][src_pages]
        dc.summaries.kmax[li][dst_pages] = pf.summaries.kmax[li][src_pages]
    for t in dc_pool.pd_page_ids:
        t[dst_pages] = src_pages


def make_sides(budget, pd_read_mode="wait", lease_s=600, decode_lease_s=None, prefill_predictor="previous"):
    """wait: the decode node's outputs equal the prefill node decoding the request itself."""
    pf, dc = engine(budget=budget, predictor=prefill_predictor), engine(budget=budget, pd_read_mode=pd_read_mode)
    ps = PrefillSide(pf, lease_s=lease_s)
    dpool = pool_of(dc)
    ds = DecodeSide(dc, dpool, read_timeout_s=5, lease_s=decode_lease_s or lease_s)
    ds.add_peer(("prefill-host", 1), TierLayout.from_bytes(base64.b64decode(ps.layout_b64())))   # as peer_for does
    return pf, dc, ps, ds, dpool


@pytest.fixture
def sides():
    s = make_sides(256)                                  # the budget covers the context
    yield s
    s[3].close()
    s[2].close()


def transferred(pf, dc, dpool, prompt, steps):
    """A request of ``prompt`` tokens prefilled on ``pf`` (row 1) and carried to ``dc`` (row 2)
    by SGLang's page-by-page transfer; K/V/Q for ``steps`` more tokens.

    Returns ``(K, V, Q, rt_p, rt_d, npg, src, dst)``: the request tables, prompt pages and the
    prefill / decode pages of each prompt block."""
    K, V, Q, rt_p, rt_d = prefilled(pf, prompt, steps)
    npg = -(-prompt // BS)
    src = torch.div(rt_p[1, :npg * BS:BS].long(), BS, rounding_mode="floor")
    dst = torch.div(rt_d[2, :npg * BS:BS].long(), BS, rounding_mode="floor")
    assert bool((dpool.pd_page_ids[0][dst] == -1).all())
    sglang_transfer(pf, dc, dpool, src, dst)
    return K, V, Q, rt_p, rt_d, npg, src, dst


def test_admit_decode_release(sides):
    pf, dc, ps, ds, dpool = sides
    prompt, steps = 61, 12
    n = prompt + steps
    assert bool((dpool.pd_page_ids[0] == -1).all())
    K, V, Q, rt_p, rt_d, npg, src, dst = transferred(pf, dc, dpool, prompt, steps)
    released = []
    ps.lease(77, lambda: released.append(77), "req-77", tokens=npg * BS)
    assert ps.held_tokens() == npg * BS
    ds.admit(2, rt_d[2], prompt, "prefill-host", 1, 77, "req-77")
    # the received page numbers are cleared once read, not when the request ends (on CUDA a clear
    # queued then could wipe the next request's numbers, written by the prefill node meanwhile)
    assert all(bool((t[dst] == -1).all()) for t in dpool.pd_page_ids)
    assert ds.remote.missing(0) == H * npg                # nothing of the sparse layers' K/V is here
    for t in range(prompt, n):                           # first step synchronous, then predicted
        want = decode(pf, 1, rt_p, K, V, Q, t)
        got = decode(dc, 2, rt_d, K, V, Q, t)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"step {t - prompt}")
    assert ds.remote.bytes_read > 0 and not ds.remote.lost
    assert dc.stats.sync_steps >= 1
    assert ds.rows[2].src_last == int(src[-1])            # names the transfer in the release
    ds.request_freed(2, None, ("prefill-host", 1, 77), "req-77")
    assert not ds.rows
    assert bool(ds.remote.present.all()) and bool((dpool.pd_page_ids[0][dst] == -1).all())
    for _ in range(200):                                  # the notification crosses UCX loopback
        if ps.poll():
            break
        time.sleep(0.05)
    assert released == [77] and not ps.leases and ps.released == 1


def test_decode_node_holds_only_the_blocks_it_read_or_decoded(seed):
    """Budget 24 tokens of a 200-token prompt: the decode node reads only the blocks its steps
    select (outputs equal to the prefill node decoding the request itself), holds far less of
    the request than a whole allocation, and gives that memory back at the release."""
    pf, dc, ps, ds, dpool = make_sides(24)
    try:
        prompt, steps = 200, 10
        n = prompt + steps
        K, V, Q, rt_p, rt_d, npg, src, dst = transferred(pf, dc, dpool, prompt, steps)
        ds.admit(2, rt_d[2], prompt, "prefill-host", 1, 3, "req-3")
        assert dc.host.resident_bytes() == 0                   # nothing of the sparse layers' K/V is here
        pf.reset_rows([1])          # the prefill node decoding it itself from an empty row (synchronous first step)
        for t in range(prompt, n):
            torch.testing.assert_close(decode(dc, 2, rt_d, K, V, Q, t), decode(pf, 1, rt_p, K, V, Q, t),
                                       rtol=1e-5, atol=1e-5, msg=f"step {t - prompt}")
        pages = torch.div(rt_d[2, :n:BS].long(), BS, rounding_mode="floor")
        L = len(dc.sparse_layers)
        whole = pages.numel() * L * H * dc.block_bytes
        held = ds.held_bytes(2, pages)
        read = int(ds.remote.present[:, :, dst].sum())           # prompt pieces read on demand
        assert held == (read + (pages.numel() - npg) * L * H) * dc.block_bytes
        assert 0 < read * dc.block_bytes == ds.remote.bytes_read
        assert held * 2 < whole, (held, whole)                   # budget 6 blocks of 53, cap 2 a step
        assert dc.host.resident_bytes() > 0         # OS pages: 16 of these 256 B pieces share one
        # SGLang's allocator: every page free once this request ended (it was the only one), so the
        # OS pages its blocks share with other (free) blocks go back too
        ds.free_pages = lambda: torch.arange(dc.host.num_pages)
        ds.release(2, pages)
        assert dc.host.resident_bytes() == 0
        assert (ds.released_requests, ds.held_bytes_total, ds.whole_bytes_total) == (1, held, whole)
        assert not ds.rows and bool(ds.remote.present.all())
    finally:
        ds.close()
        ps.close()


def first_step_regions(pf):
    """A pool's two ``pd_first_step`` regions for ``pf``'s host pages."""
    return [torch.zeros((pf.host.num_pages, first_step_width(len(pf.sparse_layers), H)), dtype=torch.int16)
            for _ in range(2)]


def carry_first_step(ps, pf, dpool, rt_p, prompt, src, dst, room, torn=False):
    """The prefill node writes its plan right before the request's send
    (``sglang_hooks.send_kv_chunk_hook``), and SGLang's transfer carries both copies of the
    ``pd_first_step`` region page by page (``torn``: the second copy arrives stale)."""
    ppool = types.SimpleNamespace(pd_first_step=first_step_regions(pf))
    n = ps.prepare_send(ppool, 1, rt_p[1], prompt, room)
    for i, (a, b) in enumerate(zip(ppool.pd_first_step, dpool.pd_first_step)):
        b[dst] = 0 if torn and i else a[src]
    return n


@pytest.mark.parametrize("prompt", [61, 64])          # 64: the first step's new token opens a block
def test_the_first_step_planned_on_the_prefill_node_crosses_with_the_transfer(seed, prompt):
    """The prefill node's plan for the first decode step (last prompt token's query) arrives as
    per-block slot masks; admission reads its blocks in one NIXL READ across layers and installs
    them slot by slot, so the first step is a predicted one (no synchronous selection) and every
    step's output is bitwise what the prefill node computes decoding the request itself."""
    pf, dc, ps, ds, dpool = make_sides(24)
    try:
        steps = 12
        K, V, Q, rt_p, rt_d, npg, src, dst = transferred(pf, dc, dpool, prompt, steps)
        plan = pf.ws.ids[:, 1].clone()
        in_prompt = int(((plan >= 0) & (plan < npg)).sum())
        assert carry_first_step(ps, pf, dpool, rt_p, prompt, src, dst, room=9) == in_prompt > 0
        assert ps.first_steps_sent == 1
        ds.admit(2, rt_d[2], prompt, "prefill-host", 1, 9, "req-9")
        assert all(not bool(t.any()) for t in dpool.pd_first_step)      # cleared once read
        assert torch.equal(dc.ws.ids[:, 2], plan)                     # slot by slot, the new token's block too
        assert bool((plan == npg).any()) == (prompt % BS == 0)
        assert ds.first_steps_planned == 1 and ds.remote.first_step_pieces == in_prompt
        assert ds.fetcher.stats.transfers == 1                        # one READ for every layer's pieces
        assert ds.remote.first_step_bytes == in_prompt * 2 * BS * D * 4 == ds.remote.bytes_read
        for t in range(prompt, prompt + steps):
            assert torch.equal(decode(dc, 2, rt_d, K, V, Q, t), decode(pf, 1, rt_p, K, V, Q, t)), t - prompt
        assert dc.stats.sync_steps == 0 and not ds.remote.lost
    finally:
        ds.close()
        ps.close()


@pytest.mark.parametrize("prompt,cut", [(61, 40), (64, 24), (200, 101)])
def test_a_plan_after_a_chunked_prefill_decodes_as_the_prefill_node(seed, prompt, cut):
    """The prefill node prefills the prompt in two chunks (its first chunk's plan is admitted into
    its working set, the last chunk's plans the first decode step from there, capped): the plan
    that crosses is its working set after the last chunk, slot by slot, and the decode node
    (``pd_read_mode: wait``) decodes bitwise as the prefill node decoding the request itself."""
    pf, dc, ps, ds, dpool = make_sides(24)
    try:
        steps = 12
        n = prompt + steps
        K, V, Q = torch.randn(LAYERS, n, H, D), torch.randn(LAYERS, n, H, D), torch.randn(LAYERS, n, HQ, D)
        rt_p, rt_d = torch.zeros(ROWS, 256, dtype=torch.int32), torch.zeros(ROWS, 256, dtype=torch.int32)
        rt_p[1, :n], rt_d[2, :n] = locs(n), locs(n)
        for a, b in ((0, cut), (cut, prompt)):                      # SGLang's chunked prefill
            for li in pf.sparse_layers:
                pf.write_kv(li, rt_p[1, a:b].long(), K[li, a:b], V[li, a:b])
                pf.extend_attention(li, Q[li, a:b], torch.tensor([1]), torch.tensor([a]), torch.tensor([b - a]),
                                    rt_p, None)
        npg = -(-prompt // BS)
        src = torch.div(rt_p[1, :npg * BS:BS].long(), BS, rounding_mode="floor")
        dst = torch.div(rt_d[2, :npg * BS:BS].long(), BS, rounding_mode="floor")
        sglang_transfer(pf, dc, dpool, src, dst)
        plan = pf.ws.ids[:, 1].clone()
        assert carry_first_step(ps, pf, dpool, rt_p, prompt, src, dst, room=9) > 0
        ds.admit(2, rt_d[2], prompt, "prefill-host", 1, 9, "req-9")
        assert torch.equal(dc.ws.ids[:, 2], plan) and ds.first_steps_planned == 1
        for t in range(prompt, n):
            assert torch.equal(decode(dc, 2, rt_d, K, V, Q, t), decode(pf, 1, rt_p, K, V, Q, t)), t - prompt
        assert dc.stats.sync_steps == 0
    finally:
        ds.close()
        ps.close()


@pytest.mark.parametrize("case", ["torn", "shared", "current"])
def test_without_a_usable_plan_the_first_step_selects_on_the_decode_node(seed, case):
    """A torn mask (its two copies differ), a page whose rows another request's send overwrote
    (a shared cached prefix: the room tag differs) or a prefill node that planned nothing
    (predictor ``current``): nothing is installed or read at admission, the first step selects
    synchronously, and outputs still equal the prefill node decoding the request from an
    empty row."""
    pf, dc, ps, ds, dpool = make_sides(24, prefill_predictor="current" if case == "current" else "previous")
    try:
        prompt, steps = 61, 6
        K, V, Q, rt_p, rt_d, npg, src, dst = transferred(pf, dc, dpool, prompt, steps)
        marked = carry_first_step(ps, pf, dpool, rt_p, prompt, src, dst, room=4, torn=case == "torn")
        if case == "shared":
            for t in dpool.pd_first_step:
                t[dst[0], -4:] = room_tag(12345)
        assert (marked > 0) == (case != "current") and ps.first_steps_sent == (case != "current")
        ds.admit(2, rt_d[2], prompt, "prefill-host", 1, 4, "req-4")
        assert all(not bool(t.any()) for t in dpool.pd_first_step)
        assert not bool((dc.ws.ids[:, 2] >= 0).any()) and ds.first_steps_planned == 0
        assert ds.first_steps_rejected == (case != "current")
        assert ds.remote.first_step_pieces == 0 and ds.remote.bytes_read == 0
        ref = engine(budget=24)                  # the decode node's predictor, from an empty row
        prefill(ref, 1, rt_p, K, V, Q, prompt)
        ref.reset_rows([1])
        for t in range(prompt, prompt + steps):
            if t == prompt + 1:      # the first step after the admission was a request's first (log line)
                assert dc.stats.new_request_started
            torch.testing.assert_close(decode(dc, 2, rt_d, K, V, Q, t), decode(ref, 1, rt_p, K, V, Q, t),
                                       rtol=1e-5, atol=1e-5, msg=f"step {t - prompt}")
        assert dc.stats.sync_steps >= 1
    finally:
        ds.close()
        ps.close()


def test_fp32_summaries_cross_in_bf16_rounded_outward(seed):
    """Summaries wider than 16 bits cross in the pools' bf16 staging buffers (``pd_summaries``):
    filled by the prefill node right before the send, rounded outward, and read back into the
    decode node's summaries at admission, where they still bound every key of each block (the
    Quest score stays an upper bound) and are exactly the prefill node's rounded outward."""
    from oasis_sglang.disagg.admission import round_outward

    pf, dc, ps, ds, dpool = make_sides(24)
    try:
        prompt, steps = 61, 4
        K, V, Q, rt_p, rt_d = prefilled(pf, prompt, steps)
        npg = -(-prompt // BS)
        src = torch.div(rt_p[1, :npg * BS:BS].long(), BS, rounding_mode="floor")
        dst = torch.div(rt_d[2, :npg * BS:BS].long(), BS, rounding_mode="floor")
        L, P = len(pf.sparse_layers), pf.host.num_pages
        staging = lambda: tuple([torch.zeros((P, H, D), dtype=torch.bfloat16) for _ in range(L)]  # noqa: E731
                                for _ in range(2))
        ppool = types.SimpleNamespace(pd_summaries=staging(), pd_first_step=first_step_regions(pf))
        dpool.pd_summaries = staging()
        assert ps.prepare_send(ppool, 1, rt_p[1], prompt, 6) > 0
        for a, b in zip(ppool.pd_summaries + tuple([t] for t in ppool.pd_first_step),
                        dpool.pd_summaries + tuple([t] for t in dpool.pd_first_step)):
            for x, y in zip(a, b):                      # SGLang's transfer, page by page
                y[dst] = x[src]
        for t in dpool.pd_page_ids:
            t[dst] = src
        ds.admit(2, rt_d[2], prompt, "prefill-host", 1, 6, "req-6")
        for li in range(L):
            kmin, kmax = pf.summaries.kmin[li][src], pf.summaries.kmax[li][src]
            lo, hi = dc.summaries.kmin[li][dst], dc.summaries.kmax[li][dst]
            assert lo.dtype == torch.float32 and bool((lo <= kmin).all()) and bool((hi >= kmax).all())
            want_lo, want_hi = round_outward(kmin, kmax, torch.bfloat16)
            assert torch.equal(lo, want_lo.float()) and torch.equal(hi, want_hi.float())
            assert not torch.equal(lo, kmin)            # they did cross in bf16
        assert torch.equal(dc.ws.ids[:, 2], pf.ws.ids[:, 1]) and ds.first_steps_planned == 1
        for t in range(prompt, prompt + steps):
            assert bool(torch.isfinite(decode(dc, 2, rt_d, K, V, Q, t)).all())
        assert dc.stats.sync_steps == 0
    finally:
        ds.close()
        ps.close()


def test_an_oasis_prefill_node_sends_a_request_in_one_piece_with_its_plan(seed):
    """``should_send_kv_chunk_hook`` holds back every send but the last chunk's on an OasisKV
    prefill node only; ``send_kv_chunk_hook`` fills the plan before the last send, not before
    the others."""
    from oasis_sglang.disagg.sglang_hooks import send_kv_chunk_hook, should_send_kv_chunk_hook

    pf, dc, ps, ds, dpool = make_sides(24)
    try:
        prompt = 61
        K, V, Q, rt_p, rt_d = prefilled(pf, prompt, 1)
        ppool = types.SimpleNamespace(pd_first_step=first_step_regions(pf))
        sched = types.SimpleNamespace(req_to_token_pool=types.SimpleNamespace(req_to_token=rt_p),
                                      token_to_kv_pool_allocator=types.SimpleNamespace(get_kvcache=lambda: ppool))
        req = types.SimpleNamespace(req_pool_idx=1, origin_input_ids=list(range(prompt)), rid="r", bootstrap_room=3)
        sent = []
        send = lambda self, r, last_chunk=False, end_idx=None: sent.append((last_chunk, end_idx))  # noqa: E731
        set_side(None)
        assert should_send_kv_chunk_hook(True, None, 3, False) is True          # not OasisKV PD: SGLang's rule
        set_side(ps)
        assert should_send_kv_chunk_hook(True, None, 3, False) is False
        assert should_send_kv_chunk_hook(True, None, 3, last_chunk=True) is True
        assert should_send_kv_chunk_hook(False, None, 0, True) is False         # SGLang's own "no" stands
        send_kv_chunk_hook(send, sched, req, last_chunk=False, end_idx=16)
        assert sent == [(False, 16)] and not bool(ppool.pd_first_step[0].any())
        send_kv_chunk_hook(send, sched, req, True)
        assert sent[-1] == (True, None) and ps.first_steps_sent == 1
        pages = torch.div(rt_p[1, :prompt:BS].long(), BS, rounding_mode="floor")
        assert torch.equal(ppool.pd_first_step[0], ppool.pd_first_step[1])
        rows = ppool.pd_first_step[0][pages]
        assert bool((rows[:, :-4] > 0).any(0).all())      # every (layer, KV head) planned
        assert bool((rows[:, -4:] == room_tag(3)).all())  # tagged with the request's room
    finally:
        set_side(None)
        ds.close()
        ps.close()


def test_plan_from_mask_puts_blocks_in_their_slots_and_refuses_what_is_no_plan():
    m = torch.tensor([[[2, 0, 1]], [[0, 3, 1]]], dtype=torch.int16)        # [L=2, H=1, N=3]: slot + 1
    assert plan_from_mask(m, 10, 4, 4).tolist() == [[[2, 0, -1, -1]], [[2, -1, 1, -1]]]
    # 12 tokens in 3 full blocks: the new token's block 3 goes to the first free slot
    assert plan_from_mask(m, 12, 4, 4).tolist() == [[[2, 0, 3, -1]], [[2, 3, 1, -1]]]
    # a smaller budget here (K = 2; slot 3 is past it): packed in the prefill node's slot order
    assert plan_from_mask(m, 10, 4, 2).tolist() == [[[2, 0]], [[2, 1]]]
    assert plan_from_mask(torch.tensor([[[1, 2]], [[2, 1]]]), 8, 4, 2) is None            # no slot for block 2
    assert plan_from_mask(torch.tensor([[[1, 1, 2]], [[1, 0, 2]]]), 10, 4, 4) is None     # slot 0 held twice
    assert plan_from_mask(torch.tensor([[[1, 0, 2]], [[0, 0, 0]]]), 10, 4, 4) is None     # layer 1: nothing
    assert plan_from_mask(torch.tensor([[[1, 0, 0]], [[1, 0, 2]]]), 10, 4, 4) is None     # layer 0 lacks block 2
    assert plan_from_mask(torch.tensor([[[1, 0, -2]], [[1, 0, 2]]]), 10, 4, 4) is None    # a negative slot
    assert plan_from_mask(torch.tensor([[[5, 0, 5]]]), 10, 4, 3) is None                   # held twice, past K
    assert plan_from_mask(torch.tensor([[[1, 9, 1]]]), 10, 4, 3) is None
    assert plan_from_mask(torch.zeros((2, 1, 0), dtype=torch.int16), 0, 4, 4) is None
    assert room_tag(2 ** 64 - 1).tolist() == [-1] * 4 and room_tag(5).view(torch.int64).item() == 5


def test_release_never_gives_back_another_requests_blocks_and_rejects_masks(sides):
    """A page list that (wrongly) holds a block of another admitted request: that block keeps
    its data. Bool masks and floats are refused, not read as page numbers."""
    pf, dc, ps, ds, dpool = sides
    rt = torch.zeros(ROWS, 256, dtype=torch.int32)
    rt[1, :16], rt[2, :16] = torch.arange(16), torch.arange(64, 80)         # pages 0-3 and 16-19
    for r in (1, 2):
        pd = torch.div(rt[r, :16:BS].long(), BS, rounding_mode="floor")
        for t in dpool.pd_page_ids:
            t[pd] = pd
        ds.admit(r, rt[r], 16, "prefill-host", 1, 100 + r, f"req-{r}")
    given = []                                             # what release hands the host tier
    discard = dc.host.discard
    dc.host.discard = lambda p, **kw: (given.append(p.clone()), discard(p, **kw))[1]
    ds.release(1, torch.tensor([0, 1, 2, 3, 16]), tokens=16)
    assert given and 16 not in given[-1].tolist() and set(given[-1].tolist()) >= {0, 1, 2, 3}
    assert 2 in ds.rows
    for bad in (torch.arange(8) == 3, torch.tensor([0.5, 2.0])):
        with pytest.raises(ValueError, match="integers"):
            ds.release(2, bad)
        with pytest.raises(ValueError, match="integers"):
            dc.host.discard(bad)


def test_admit_refuses_a_transfer_without_page_numbers(sides):
    pf, dc, ps, ds, dpool = sides
    rt_d = torch.zeros(ROWS, 256, dtype=torch.int32)
    rt_d[2, :40] = locs(40)
    with pytest.raises(ValueError, match="did not carry the prefill node's page numbers"):
        ds.admit(2, rt_d[2], 40, "prefill-host", 1, 5)
    assert not ds.rows


def test_lease_expires(sides):
    _, _, ps, _, _ = sides
    freed = []
    ps.lease(1, lambda: freed.append(1), "a")
    ps.lease(2, lambda: freed.append(2), "b")
    assert ps.poll() == 0 and not freed
    assert ps.poll(now=time.monotonic() + 601) == 2 and sorted(freed) == [1, 2]
    assert ps.expired == 2 and not ps.leases


def test_lost_prefill_node_names_its_rows(sides):
    pf, dc, ps, ds, dpool = sides
    prompt = 61
    K, V, Q = torch.randn(LAYERS, prompt + 2, H, D), torch.randn(LAYERS, prompt + 2, H, D), \
        torch.randn(LAYERS, prompt + 2, HQ, D)
    rt_p = torch.zeros(ROWS, 256, dtype=torch.int32)
    rt_d = torch.zeros(ROWS, 256, dtype=torch.int32)
    rt_p[1, :prompt + 2], rt_d[2, :prompt + 2] = locs(prompt + 2), locs(prompt + 2)
    prefill(pf, 1, rt_p, K, V, Q, prompt)
    npg = -(-prompt // BS)
    src = torch.div(rt_p[1, :npg * BS:BS].long(), BS, rounding_mode="floor")
    dst = torch.div(rt_d[2, :npg * BS:BS].long(), BS, rounding_mode="floor")
    sglang_transfer(pf, dc, dpool, src, dst)
    ds.admit(2, rt_d[2], prompt, "prefill-host", 1, 9, "req-9")
    ds.fetcher.local.agent.remove_remote_agent(ds.peers[("prefill-host", 1)])   # NIXL forgets it
    decode(dc, 2, rt_d, K, V, Q, prompt)                   # the step goes on
    assert list(ds.lost_rows()) == [2] and "PeerLostError" in ds.lost_rows()[2]
    ds.release(2)                                          # a lost peer is not told; nothing raises
    assert not ds.rows and not ds.lost_rows()
    peer = ds.peers[("prefill-host", 1)]
    assert ds.remote.forget_lost(peer) and peer not in ds.remote.lost    # its requests ended: taken back


def _deliver(ps, want=1):
    for _ in range(200):                                  # notifications cross UCX loopback
        if ps.poll():
            return
        time.sleep(0.05)


def test_renewals_keep_a_lease_and_bad_messages_and_releases_do_not_stop_the_loop(sides):
    pf, dc, ps, ds, dpool = sides
    freed = []

    def boom():
        raise RuntimeError("release failed")

    ps.lease(1, boom, "bad")
    ps.lease(2, lambda: freed.append(2), "good")
    ps.lease(3, lambda: freed.append(3), "renewed")
    peer = ds.peers[("prefill-host", 1)]
    t0 = time.monotonic()
    ps.leases[3].deadline = t0 + 1.0
    for m in (b"oasis-release: 2 ", b"oasis-release:+2", b"oasis-release:", b"oasis-release:1", b"oasis-renew:3",
              b"oasis-release:2"):
        ds.tier.agent.send_notif(peer, m)
    for _ in range(100):
        ps.poll()
        if freed:
            break
        time.sleep(0.05)
    assert freed == [2] and 1 not in ps.leases and ps.released == 2      # the raising release was dropped, logged
    assert ps.leases[3].deadline > t0 + 100                                # renewed to lease_s from now
    now = lease_clock()
    ds.rows[5] = Admitted(torch.tensor([0]), peer, 3, "r", renewed=now)
    ds.remote.lost["gone"] = "test"
    ds.rows[6] = Admitted(torch.tensor([1]), "gone", 4, "r4", renewed=now)
    assert ds.renew() == 0                                                  # none due yet (renewed now)
    assert ds.renew(due_only=False) == 1 and ds.renewals == 1               # none to a lost peer
    assert ds.rows[5].renewed > now
    ds.rows.clear()
    ds.remote.lost.pop("gone")


def test_a_live_decode_node_keeps_its_leases_and_a_gone_one_loses_them_within_the_lease():
    """The decode node's renewal thread keeps a request's lease alive for several lease lengths
    with nobody calling ``renew`` (a busy scheduler); once the node is gone (closed: it sends
    nothing more) the prefill node frees the lease within ``lease_s``."""
    lease = 4.0
    pf, dc, ps, ds, dpool = make_sides(256, lease_s=lease)
    try:
        *_, rt_d, _, _, _ = transferred(pf, dc, dpool, 40, 2)
        freed = []
        ps.lease(7, lambda: freed.append(7), "req-7")
        assert ds._renewer is None                               # no thread before the first admission
        ds.admit(2, rt_d[2], 40, "prefill-host", 1, 7, "req-7")
        assert ds._renewer.is_alive()
        t_end = time.monotonic() + 3 * lease
        while time.monotonic() < t_end:
            ps.poll()
            assert not freed, "a live decode node's lease expired"
            time.sleep(0.05)
        assert ds.renewals >= 6, ds.renewals                     # every quarter to three eighths of a lease
        ds.close()                                               # the decode node is gone
        assert not ds._renewer.is_alive()
        t0 = time.monotonic()
        while not freed and time.monotonic() - t0 < 3 * lease:
            ps.poll()
            time.sleep(0.05)
        assert freed == [7] and ps.expired == 1 and not ps.leases
        assert time.monotonic() - t0 <= lease + 1.5
    finally:
        ds.close()
        ps.close()


def test_a_lease_not_renewed_for_most_of_its_length_ends_its_request():
    """A decode node that could not renew a lease for 0.9 of ``lease_s`` (its process stopped,
    its renewals failing) must not read that request's blocks any more (the prefill node may
    have given the pages to another request): before the next batch the request is ended with
    an error and its pages are cut off (its last forward reads nothing), and the renewal thread
    stops renewing it."""
    from oasis_sglang.disagg.sglang_hooks import abort_lost

    lease = 2.0
    pf, dc, ps, ds, dpool = make_sides(256, lease_s=lease)
    try:
        prompt = 40
        K, V, Q, rt_p, rt_d, *_ = transferred(pf, dc, dpool, prompt, 2)
        ds.admit(2, rt_d[2], prompt, "prefill-host", 1, 7, "req-7")
        assert ds.renewals == 1                                  # renewed at admission
        assert not ds.check_stale()
        assert ds._next_stale == pytest.approx(ds.rows[2].renewed + ds.STALE * lease)   # no loop before then
        ds._stop_renewing.set()                                  # the renewals stop (a stopped process)
        ds._renewer.join()
        time.sleep(ds.STALE * lease + 0.2)
        req = types.SimpleNamespace(req_pool_idx=2, rid="req-7", to_finish=None, finished_reason=None)
        set_side(ds)
        try:
            abort_lost(types.SimpleNamespace(reqs=[req]))
        finally:
            set_side(None)
        assert req.to_finish is not None and "last renewed" in req.to_finish.message, req.to_finish
        assert list(ds.stale) == [2] and "pd_lease_s 2" in ds.stale[2] and not ds.lost_rows()
        read = ds.fetcher.stats.bytes
        decode(dc, 2, rt_d, K, V, Q, prompt)                     # SGLang's last forward of the request
        assert ds.fetcher.stats.bytes == read, "a stale row's pages were read"
        n = ds.renewals
        assert ds.renew() == 0 and ds.renewals == n              # a stale lease is not renewed
        assert ds._renew_one(ds.rows[2]) == 0 and ds.renewals == n   # not even asked directly: too late
        ds.release(2)
        assert not ds.stale and not ds._cut
    finally:
        ds.close()
        ps.close()


def test_a_renewal_that_failed_is_sent_again_at_the_next_tick_and_a_late_one_is_not_sent(sides):
    pf, dc, ps, ds, dpool = sides
    peer = ds.peers[("prefill-host", 1)]
    now = lease_clock()
    ds.rows[5] = Admitted(torch.tensor([0]), "no-such-agent", 3, "r", renewed=now, lease_s=600.0)
    assert ds._renew_one(ds.rows[5]) == 0 and ds.rows[5].retry          # NIXL refused: retried
    ds.rows[5].peer = peer
    assert ds.renew() == 1 and not ds.rows[5].retry                     # due at once, not a quarter lease later
    ds.rows[5].renewed = lease_clock() - 0.95 * 600
    assert ds._renew_one(ds.rows[5]) == 0 and 5 in ds.stale             # too late: stale, not renewed
    ds.rows.clear()
    ds.stale.clear()


def test_the_shorter_lease_of_the_two_nodes_rules():
    """A prefill node whose ``pd_lease_s`` is shorter than the decode node's sets the pace (its
    layout says it): its requests are renewed often enough for its lease, also when the
    renewal thread was sleeping on the decode node's longer tick when they were admitted."""
    pf, dc, ps, ds, dpool = make_sides(256, lease_s=4.0, decode_lease_s=40.0)
    try:
        peer = ds.peers[("prefill-host", 1)]
        assert ds.peer_lease[peer] == 4.0
        ds._start_renewer()                                      # asleep on the decode node's tick (5 s)
        time.sleep(0.2)
        *_, rt_d, _, _, _ = transferred(pf, dc, dpool, 40, 2)
        freed = []
        ps.lease(7, lambda: freed.append(7), "req-7")
        ds.admit(2, rt_d[2], 40, "prefill-host", 1, 7, "req-7")
        assert ds.rows[2].lease_s == 4.0 and ds._tick() == 0.5
        t_end = time.monotonic() + 2 * 4.0
        while time.monotonic() < t_end:
            ps.poll()
            assert not freed, "a live decode node's lease expired"
            assert not ds.check_stale()
            time.sleep(0.05)
        assert ds.renewals >= 4, ds.renewals
    finally:
        ds.close()
        ps.close()


def test_a_tier_layout_from_a_later_version_parses_and_a_bad_lease_is_refused():
    lay = TierLayout("a", b"m", (1,), (2,), 4, 1, 8, 16, 16, 30.0)
    d = json.loads(lay.to_bytes())
    d["added_later"] = 1
    assert TierLayout.from_bytes(json.dumps(d).encode()) == lay
    for bad in ("30", True, -1, 1e9):
        d = json.loads(lay.to_bytes())
        d["lease_s"] = bad
        with pytest.raises(ValueError, match="lease_s"):
            TierLayout.from_bytes(json.dumps(d).encode())
    d = json.loads(lay.to_bytes())
    del d["lease_s"]                                              # an older layout: not said
    assert TierLayout.from_bytes(json.dumps(d).encode()).lease_s == 0.0


def test_a_release_names_its_transfer_of_the_room(sides):
    """A request retracted on its decode node is recomputed and transferred again under the same
    bootstrap room: the release sent at the retraction (generation 1) must not free the second
    transfer's lease, whatever order the messages arrive in."""
    pf, dc, ps, ds, dpool = sides
    freed = []
    ps.lease(7, lambda: freed.append("first"), "r", page=40)
    ps.lease(7, lambda: freed.append("second"), "r", page=41)   # transferred again before the release arrived
    assert freed == ["first"] and ps.leases[7].page == 41
    peer = ds.peers[("prefill-host", 1)]
    ds.tier.agent.send_notif(peer, b"oasis-release:7:40")    # late: its lease is gone
    for _ in range(20):
        ps.poll()
        time.sleep(0.05)
    assert 7 in ps.leases and freed == ["first"]
    ds.tier.agent.send_notif(peer, b"oasis-release:7:41")
    _deliver(ps)
    assert freed == ["first", "second"] and not ps.leases
    ps.lease(8, lambda: freed.append("third"), "s", page=3)
    for m in (b"oasis-release:8:", b"oasis-release:8:x", b"oasis-release:8:-3", b"oasis-release:8:3:1"):
        ds.tier.agent.send_notif(peer, m)                    # malformed: ignored
    for _ in range(20):
        ps.poll()
        time.sleep(0.05)
    assert 8 in ps.leases
    ps.lease(9, lambda: freed.append("fourth"), "t", page=5)    # the room reused by a new request: its own page
    ds.tier.agent.send_notif(peer, b"oasis-release:9:5")
    _deliver(ps)
    assert 9 not in ps.leases and freed[-1] == "fourth"


def test_refused_admission_releases_the_lease(sides):
    pf, dc, ps, ds, dpool = sides
    freed = []
    ps.lease(11, lambda: freed.append(11), "refused")
    ds.refuse("prefill-host", 1, 11, "refused")
    _deliver(ps)
    assert freed == [11] and not ps.leases
    ds.refuse("unknown-host", 9, 12)                      # unknown prefill node: nothing to tell, nothing raised


def test_a_request_freed_before_its_admission_releases_its_lease(sides):
    """Aborted in SGLang's decode transfer queue (after its KV arrived, before admission): its
    prefill node frees the pages now; an admitted one is released once; the warm-up tells nobody."""
    pf, dc, ps, ds, dpool = sides
    freed = []
    ps.lease(21, lambda: freed.append(21), "aborted")
    ds.request_freed(3, torch.tensor([5, 6]), ("prefill-host", 1, 21), "aborted")
    _deliver(ps)
    assert freed == [21] and not ps.leases
    ds.request_freed(3, torch.tensor([5, 6]), None, "warm-up")     # no prefill node: nothing sent, nothing raised
    assert not ds.rows


def test_an_unreachable_prefill_node_fails_fast_and_is_remembered(sides):
    from oasis_sglang.disagg.transport import PeerLostError
    from oasis_sglang.testing.launch import free_port

    _, _, _, ds, _ = sides
    port = free_port()                                     # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(PeerLostError, match="no usable OasisKV host tier"):
        ds.peer_for("127.0.0.1", port)
    assert time.monotonic() - t0 < 10
    t0 = time.monotonic()
    with pytest.raises(PeerLostError, match="no usable OasisKV host tier"):
        ds.peer_for("127.0.0.1", port)                     # remembered: no new wait in the decode loop
    assert time.monotonic() - t0 < 0.5


def test_the_idle_sweep_gives_back_free_blocks_left_resident_and_keeps_held_ones(seed):
    """Once no request is held, every free block still resident goes back to the OS (a block
    whose OS page a neighbour held at its release, a read landing after its request ended);
    a block SGLang's allocator does not list as free keeps its data."""
    pf, dc, ps, ds, dpool = make_sides(24)
    try:
        host = dc.host
        held = 7
        free = torch.tensor([p for p in range(host.num_pages) if p != held])
        ds.free_pages = lambda: free
        for li in range(len(dc.sparse_layers)):        # a late write into free blocks 100 and 40, and the held block
            host.k[li][:, 100] = 1.0
            host.v[li][:, 40] = 2.0
            host.k[li][:, held] = 5.0
        assert {100, 40, held} <= set(host.resident_pages().tolist())
        res = ds._sweep_idle()
        assert res == host.resident_bytes() > 0
        left = set(host.resident_pages().tolist())
        assert 100 not in left and 40 not in left and held in left
        assert float(host.k[0][0, held].sum()) == 5.0 * host.k[0][0, held].numel()
        assert float(host.k[0][0, 100].abs().sum()) == 0.0 and ds.swept_bytes > 0
        # what stays shares the held block's OS pages (256 B pieces: 16 blocks to an OS page)
        assert left <= set(range(held - 16, held + 17)) and ds._sweep_idle() == res
    finally:
        ds.close()
        ps.close()


def test_a_release_after_sglangs_free_group_ended_keeps_a_new_requests_blocks(seed):
    """Breaker review: SGLang's ``free_group_end`` frees a group's pages but keeps its list until
    the next group begins. Pages of a request that ended in a group (A), handed to a new request
    (Y) afterwards, must not count as free when another request (X) is released outside a
    group: Y's blocks (2 KiB pieces, sharing OS pages with X's) keep their data and Y decodes
    as the prefill node does."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    from oasis_sglang.sglang_glue.install import free_pages_of

    def toks(pages):
        return (torch.as_tensor(pages)[:, None] * BS + torch.arange(BS)).reshape(-1)

    pf, dc, ps, ds, dpool = make_sides(24)
    try:
        a = PagedTokenToKVPoolAllocator(TOKENS - BS, BS, torch.int64, "cpu", kvcache=None, need_sort=True)
        a.alloc(TOKENS - BS)                                  # every page in use
        a.free(toks(range(42, 48)))
        a.free_group_begin()                                  # a decode step: request A ends
        a.free(toks(range(32, 41)))
        a.free_group_end()
        y = a.alloc(9 * BS)                                   # request Y gets A's pages
        assert sorted(set((y // BS).tolist())) == list(range(32, 41))
        assert not bool(torch.isin(torch.arange(32, 41), free_pages_of(a)).any()), "a stale group counted free"
        ds.free_pages = lambda: free_pages_of(a)
        prompt, steps = 160, 50
        n = prompt + steps
        K, V, Q, rt_p, rt_d = prefilled(pf, prompt, steps)
        ypages = torch.tensor(list(range(100, 105)) + list(range(32, 41)) + list(range(105, 105 + -(-n // BS) - 14)))
        rt_d[2].zero_()
        rt_d[2, :n] = toks(ypages)[:n].to(torch.int32)
        npg = -(-prompt // BS)
        src = torch.div(rt_p[1, :npg * BS:BS].long(), BS, rounding_mode="floor")
        sglang_transfer(pf, dc, dpool, src, ypages[:npg])
        ds.admit(2, rt_d[2], prompt, "prefill-host", 1, 3, "req-Y")
        pf.reset_rows([1])
        for t in range(prompt, prompt + 25):
            torch.testing.assert_close(decode(dc, 2, rt_d, K, V, Q, t), decode(pf, 1, rt_p, K, V, Q, t),
                                       rtol=1e-5, atol=1e-5)
        before = [dc.host.k[0][:, p].clone() for p in range(32, 41)]
        a.free(toks([41]))                                    # X ends outside a group (an abort, a retraction)
        ds.request_freed(3, torch.tensor([41]), None, "req-X", tokens=BS)
        assert all(torch.equal(b, dc.host.k[0][:, p]) for b, p in zip(before, range(32, 41)))
        for t in range(prompt + 25, n):
            torch.testing.assert_close(decode(dc, 2, rt_d, K, V, Q, t), decode(pf, 1, rt_p, K, V, Q, t),
                                       rtol=1e-5, atol=1e-5, msg=f"step {t - prompt}")
    finally:
        ds.close()
        ps.close()


AGREE = r"""
import json, sys
import torch.distributed as dist
from oasis_sglang.disagg.serving import tp_agree
rank, n, init = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=n)
g = dist.new_group(list(range(n)), backend="gloo")
local = [{7: "r0 released", 9: "r0 expired", 11: "r0"}, {7: "r1 released", 9: "r1"}, {7: "r2", 5: "r2"}][rank]
out = {"every": tp_agree(local, g, every=True), "any": tp_agree(local, g),
       "none": tp_agree({} if rank else {3: "r0"}, g, every=True), "empty": tp_agree({}, g),
       "held": tp_agree([{13: "r0"}, {}, {13: "r2", 15: "r2"}][rank], g, every=True,
                        held=[{13, 15}, {15}, {13, 15}][rank])}
print(json.dumps({k: sorted(v.items()) for k, v in out.items()}))
dist.destroy_process_group()
"""


def test_tp_ranks_agree_on_what_one_or_every_rank_saw(tmp_path):
    """``tp_agree`` over a real 3-rank gloo group (SGLang's TP CPU group is one): every rank gets
    the same answer; ``every`` keeps the keys all ranks hold (freeing a lease), the default those
    any rank holds (ending a request), each with the lowest rank's reason; one rank with nothing
    makes ``every`` empty, unless it does not hold the key at all (``held``); without a group the
    local dict comes back (a copy)."""
    import json
    import subprocess
    import sys

    init = f"file://{tmp_path / 'store'}"
    procs = [subprocess.Popen([sys.executable, "-c", AGREE, str(r), "3", init], stdout=subprocess.PIPE, text=True)
             for r in range(3)]
    outs = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1] == outs[2]
    got = outs[0]
    assert got["every"] == [[7, "r0 released"]]
    assert got["any"] == [[5, "r2"], [7, "r0 released"], [9, "r0 expired"], [11, "r0"]]
    assert got["none"] == [] and got["empty"] == []
    # a rank that never held 13 (its transfer failed: no lease there) does not hold it back; 15
    # is held back by rank 0, which holds it and has not released it
    assert got["held"] == [[13, "r0"]]
    from oasis_sglang.disagg.serving import tp_agree

    local = {1: "x"}
    out = tp_agree(local, None)
    assert out == local and out is not local


@pytest.fixture
def four_kib_pieces(monkeypatch):
    """Engines of this module and test_admission's with 16-token blocks of 64 fp32 dims: 4 KiB
    pieces, one OS page each, so ``HostTier.discard`` uses the ``written`` mask."""
    import test_admission as ta

    for mod in (ta, sys.modules[__name__]):
        monkeypatch.setattr(mod, "BS", 16)
        monkeypatch.setattr(mod, "D", 64)
        monkeypatch.setattr(mod, "TOKENS", 4096)


def test_a_page_released_without_its_memory_given_back_is_given_back_by_its_next_owner(four_kib_pieces):
    """A request released without pages (SGLang's clear hook, a row reused) leaves what it read
    resident; the next owner of those pages reads none of it and ends: its release gives that
    memory back too (the pages are dirty), and nothing stays resident."""
    pf, dc, ps, ds, dpool = make_sides(64)
    try:
        from oasis_sglang.core.host_tier import OS_PAGE

        assert dc.host.piece_bytes % OS_PAGE == 0
        prompt, steps = 61, 8
        K, V, Q, rt_p, rt_d, npg, src, dst = transferred(pf, dc, dpool, prompt, steps)
        ds.admit(2, rt_d[2], prompt, "prefill-host", 1, 5, "A")
        for t in range(prompt, prompt + steps):
            decode(dc, 2, rt_d, K, V, Q, t)
        ds.release(2)                                      # no pages: nothing given back
        assert dc.host.resident_bytes() > 0
        sglang_transfer(pf, dc, dpool, src, dst)           # B gets the same pages
        ds.admit(2, rt_d[2], prompt, "prefill-host", 1, 6, "B")
        pages = torch.div(rt_d[2, :prompt:16].long(), 16, rounding_mode="floor")
        ds.release(2, pages, tokens=prompt)                # B ends before reading anything
        assert dc.host.resident_bytes() == 0
        assert not ds.remote.dirty[pages].any()
    finally:
        ds.close()
        ps.close()


def test_config_mismatch_names_the_oasis_key_for_sglangs_own_refusals():
    """SGLang's checks of a prefill node's info raise RuntimeError in the decode scheduler's loop;
    the hook turns the two it knows into a request error naming the key to change."""
    from oasis_sglang.disagg.sglang_hooks import config_mismatch

    why = config_mismatch("127.0.0.1:8998", RuntimeError(
        "Page size mismatch: prefill server has page_size=8, but decode server has page_size=16. "
        "Both servers must use the same --page-size value."))
    assert why.startswith("OasisKV PD: block_size: the prefill node at 127.0.0.1:8998") and "page_size=8" in why
    assert "--kv-cache-dtype" in config_mismatch("a:1", RuntimeError("KV cache dtype mismatch: prefill ..."))
    assert config_mismatch("a:1", RuntimeError("PD decode DCP requires an MLA or hybrid-MLA KV pool.")) is None


def test_a_renewal_to_a_gone_prefill_process_ends_its_requests_before_the_next_batch(sides):
    """A prefill node whose NIXL agent ended (its process died): the next renewal of a lease
    there fails with NIXL's remote-disconnect error, and the scheduler's check before the next
    batch marks the peer lost (its rows end), long before the lease would turn stale; a
    renewal that fails for another reason is only retried."""
    pf, dc, ps, ds, dpool = sides
    peer = ds.peers[("prefill-host", 1)]
    now = lease_clock()
    ds.rows[5] = Admitted(torch.tensor([0]), peer, 3, "r", renewed=now)
    ps.close()                                           # the agent ends, as with its process
    for _ in range(100):                                 # UCX notices the disconnect within moments
        ds.rows[5].renewed = lease_clock()
        if ds._renew_one(ds.rows[5]) == 0 and ds._down:
            break
        time.sleep(0.05)
    assert ds._down and peer in ds._down and "renewing a lease" in ds._down[peer], ds._down
    assert peer not in ds.remote.lost, "marked in the scheduler's thread, not the renewal thread"
    assert ds.cut_off_stale() == {} and peer in ds.remote.lost and not ds._down
    assert list(ds.lost_rows()) == [5] and not ds.stale
    ds.rows.clear()
    ds.remote.lost.pop(peer)


def test_a_renewal_failing_otherwise_is_retried_not_taken_as_a_lost_node(sides):
    _, _, _, ds, _ = sides
    ds.rows[5] = Admitted(torch.tensor([0]), "no-such-agent", 3, "r", renewed=lease_clock())
    assert ds._renew_one(ds.rows[5]) == 0 and ds.rows[5].retry
    assert not ds._down and ds.cut_off_stale() == {} and not ds.remote.lost
    ds.rows.clear()


def test_a_prefill_node_restarted_on_the_same_address_is_read_from_its_new_process(seed):
    """The decode node knows the prefill node at a bootstrap address by its NIXL agent; a new
    process there (a restart) is another agent. A known peer that holds no request here is
    asked for its layout again (after ``RECHECK_S``) before a request is admitted from it, so
    the first request after a restart reads from the new process; a peer holding requests is
    not asked (their renewals watch it)."""
    import http.server
    import json
    import threading

    from oasis_sglang.disagg.serving import TIER_ROUTE

    pf, dc = engine(budget=256), engine(budget=256)
    ps1, ps2 = PrefillSide(pf, lease_s=600), PrefillSide(engine(budget=256), lease_s=600)
    ds = DecodeSide(dc, pool_of(dc), read_timeout_s=5, lease_s=600)
    serving = {"ps": ps1}
    asked = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):                                # noqa: N802 - http.server's name
            asked.append(self.path)
            body = json.dumps({"layout": serving["ps"].layout_b64()}).encode()
            self.send_response(200 if self.path.startswith(TIER_ROUTE) else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    try:
        a1 = ds.peer_for("127.0.0.1", port)
        assert a1 == ps1.tier.name and len(asked) == 1
        assert ds.peer_for("127.0.0.1", port) == a1 and len(asked) == 1, "known and recent: not asked again"
        ds.RECHECK_S = 0.0
        assert ds.peer_for("127.0.0.1", port) == a1 and len(asked) == 2, "idle: asked, the same process"
        ds.rows[4] = Admitted(torch.tensor([0]), a1, 3, "r", renewed=lease_clock())
        serving["ps"] = ps2                              # a restart there: another agent
        assert ds.peer_for("127.0.0.1", port) == a1 and len(asked) == 2, "holding a request: not asked"
        ds.rows.clear()
        a2 = ds.peer_for("127.0.0.1", port)
        assert a2 == ps2.tier.name != a1 and len(asked) == 3
        assert a1 not in ds.fetcher.peers and a2 in ds.fetcher.peers
        assert ds.peers == {("127.0.0.1", port): a2}
        ds.RECHECK_S = 60.0
        assert ds.probe(("127.0.0.1", port)) == (0, 0)   # SGLang's heartbeat lost it: asked before the next use
        assert ds.peer_for("127.0.0.1", port) == a2 and len(asked) == 4
    finally:
        srv.shutdown()
        ds.close()
        ps1.close()
        ps2.close()
