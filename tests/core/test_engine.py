"""core/engine.py: OasisSparseKV (torch only, CPU): prefill, decode steps, bad calls, reset,
memory plan. Random inputs are fresh every run (see conftest). The pieces it is built from have
their own files: test_host_tier, test_selection, test_working_set, test_ops, test_prediction,
test_step, test_bench_hooks (and test_prefetch for the asynchronous pipeline)."""

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from oasis_sglang.config import OasisConfig
from oasis_sglang.core import OasisSparseKV
from oasis_sglang.core.attention import decode_attention


def _engine(budget, bs=4, layers=3, H=2, D=8, rows=4, tokens=512, dense=(0,), fetch_cap=None, dtype=torch.float32,
            predictor="current", **kw):
    cfg = OasisConfig(budget_tokens=budget, block_size=bs, sink_blocks=1, recent_blocks=2,
                      dense_layers=dense, fetch_cap=fetch_cap, predictor=predictor)
    return OasisSparseKV(cfg, layers, tokens, rows, H, D, D, dtype, "cpu", **kw)


def _paged_locs(n, bs=4, pages=125):
    """Token locations as SGLang's paged allocator gives them: random pages, in-page order."""
    p = torch.randperm(pages)[: -(-n // bs)]
    return (p[:, None] * bs + torch.arange(bs)).reshape(-1)[:n]


def _run_request(eng, layer, row, n_prompt, n_decode, Hq, rt, free_locs, dtype=torch.float32):
    """Prefill n_prompt tokens then decode n_decode; returns per-step outputs and the full K/V."""
    H, D = eng.head_num, eng.head_dim
    n = n_prompt + n_decode
    locs = free_locs[:n]
    rt[row, :n] = locs
    K, V = torch.randn(n, H, D).to(dtype), torch.randn(n, H, D).to(dtype)
    Q = torch.randn(n, Hq, D).to(dtype)
    eng.write_kv(layer, locs[:n_prompt], K[:n_prompt], V[:n_prompt])
    pre = eng.extend_attention(layer, Q[:n_prompt], torch.tensor([row]), torch.tensor([0]),
                               torch.tensor([n_prompt]), rt, None)
    outs = []
    for t in range(n_prompt, n):
        eng.write_kv(layer, locs[t:t + 1], K[t:t + 1], V[t:t + 1])
        eng.begin_decode_step(torch.tensor([row]), torch.tensor([t + 1]), rt)
        o = eng.decode_attention(layer, Q[t:t + 1], K[t:t + 1], V[t:t + 1], None)
        outs.append(o[0])
    return pre, outs, Q, K, V


@pytest.mark.parametrize("predictor", ["current", "previous"])
def test_decode_writes_fold_their_keys_into_the_block_summaries(seed, predictor):
    """``write_kv(decode=True)`` defers the summary fold to the layer's ``decode_attention`` (one
    launch with the append). After prefill and decode steps every block's summary is exactly the
    coordinate-wise min / max of its tokens' keys (Quest Sec. 3); a decode write that no
    attention consumes is folded by the next engine call (here a second write of the layer, and
    a step's begin), never lost."""
    eng = _engine(budget=16, predictor=predictor)
    layer, li, row, n_prompt, n = 1, 0, 2, 13, 27
    rt = torch.zeros(4, 256, dtype=torch.int32)
    locs = _paged_locs(n)
    rt[row, :n] = locs
    H, D = eng.head_num, eng.head_dim
    K, V, Q = torch.randn(n, H, D), torch.randn(n, H, D), torch.randn(n, 6, D)
    eng.write_kv(layer, locs[:n_prompt], K[:n_prompt], V[:n_prompt])
    eng.extend_attention(layer, Q[:n_prompt], torch.tensor([row]), torch.tensor([0]), torch.tensor([n_prompt]),
                         rt, None)
    for t in range(n_prompt, n - 2):
        eng.begin_decode_step(torch.tensor([row]), torch.tensor([t + 1]), rt)
        eng.write_kv(layer, locs[t:t + 1], K[t:t + 1], V[t:t + 1], decode=True)
        eng.decode_attention(layer, Q[t:t + 1], K[t:t + 1], V[t:t + 1], None)
    # two decode writes of the layer without attention, then a step's begin
    eng.write_kv(layer, locs[n - 2:n - 1], K[n - 2:n - 1], V[n - 2:n - 1], decode=True)
    eng.write_kv(layer, locs[n - 1:n], K[n - 1:n], V[n - 1:n], decode=True)
    eng.begin_decode_step(torch.tensor([row]), torch.tensor([n]), rt)
    bs = eng.bs
    for p in (locs // bs).unique().tolist():
        tok = (locs // bs == p).nonzero().flatten()
        assert torch.equal(eng.summaries.kmin[li][p], K[tok].amin(0)), p
        assert torch.equal(eng.summaries.kmax[li][p], K[tok].amax(0)), p


def test_prefill_equals_dense_causal_attention(seed):
    eng = _engine(budget=64)
    rt = torch.zeros(4, 256, dtype=torch.int32)
    pre, _, Q, K, V = _run_request(eng, 1, 2, 37, 0, 6, rt, _paged_locs(37))
    ref = scaled_dot_product_attention(Q.movedim(0, 1)[None], K.movedim(0, 1)[None], V.movedim(0, 1)[None],
                                       is_causal=True, enable_gqa=True)[0].movedim(1, 0)
    torch.testing.assert_close(pre, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("predictor", ["current", "previous"])
def test_prefill_with_host_lengths_reads_no_length_back_and_equals_the_device_path(seed, predictor):
    """``extend_attention(host=(rows, prefix_lens, extend_lens))`` (what the glue passes from
    SGLang's ``extend_*_lens_cpu``): the length tensors are never read (here they are meta
    tensors, which hold no values), and outputs, working sets and summaries equal the path that
    reads them back: request 1's second chunk (12 tokens after a 40-token prefix) beside
    request 2's 40-token prompt."""
    H, D, Hq = 2, 8, 6
    rt = torch.zeros(4, 256, dtype=torch.int32)
    locs = _paged_locs(92)
    rt[1, :52], rt[2, :40] = locs[:52], locs[52:]
    K, V, Q = torch.randn(92, H, D), torch.randn(92, H, D), torch.randn(92, Hq, D)
    res = []
    for host in (False, True):
        eng = _engine(budget=32, predictor=predictor)
        for layer in (1, 2):                                              # request 1's first chunk
            eng.write_kv(layer, locs[:40], K[:40], V[:40])
            eng.extend_attention(layer, Q[:40], torch.tensor([1]), torch.tensor([0]), torch.tensor([40]), rt, None)
        rows, pre, ext = torch.tensor([1, 2]), [40, 0], [12, 40]
        outs = []
        for layer in (1, 2):
            eng.write_kv(layer, locs[40:], K[40:], V[40:])
            if host:
                o = eng.extend_attention(layer, Q[40:], rows, torch.empty(2, device="meta"),
                                         torch.empty(2, device="meta"), rt, None, host=([1, 2], pre, ext))
            else:
                o = eng.extend_attention(layer, Q[40:], rows, torch.tensor(pre), torch.tensor(ext), rt, None)
            outs.append(o)
        res.append(outs + [t.clone() for t in (eng.ws.ids, eng.summaries.kmin[0], eng.summaries.kmax[1])])
    for a, b in zip(*res):
        assert torch.equal(a, b)
    eng = _engine(budget=32)
    with pytest.raises(ValueError, match=r"host lists of lengths \[2, 1, 1\] for 2 rows"):
        eng.extend_attention(1, Q[:4], torch.tensor([1, 2]), torch.tensor([0, 0]), torch.tensor([2, 2]), rt, None,
                             host=([1, 2], [0], [4]))


def test_prefill_builds_no_device_tensor_from_host_values_in_place(seed, monkeypatch):
    """On CUDA ``torch.tensor(list, device=cuda)`` is a copy from pageable memory: the host
    waits for the whole queued forward first (a sync per call; four per sparse layer of every
    prefill until 2026-12-06). The prefill must stage host lists through ``devcopy.to_device``
    instead: no ``torch.tensor`` / ``torch.as_tensor`` call with a device during
    ``extend_attention`` (SGLang's host lengths given, the asynchronous predictor on)."""
    H, D, Hq = 2, 8, 6
    rt = torch.zeros(4, 256, dtype=torch.int32)
    locs = _paged_locs(40)
    rt[1, :40] = locs
    eng = _engine(budget=32, predictor="previous")
    eng.write_kv(1, locs, torch.randn(40, H, D), torch.randn(40, H, D))
    calls = []
    for name in ("tensor", "as_tensor"):
        real = getattr(torch, name)

        def spy(*a, _real=real, _name=name, **k):
            if k.get("device") is not None:
                calls.append((_name, k["device"]))
            return _real(*a, **k)
        monkeypatch.setattr(torch, name, spy)
    eng.extend_attention(1, torch.randn(40, Hq, D), torch.tensor([1]), torch.empty(1, device="meta"),
                         torch.empty(1, device="meta"), rt, None, host=([1], [0], [40]))
    assert calls == [], f"device tensors built from host values in the prefill: {calls}"


@pytest.mark.parametrize("predictor", ["current", "previous"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_equals_dense_when_working_set_covers_context(seed, dtype, predictor):
    """budget >= context: every decode output is bitwise the dense attention over all tokens."""
    eng = _engine(budget=128, dtype=dtype, predictor=predictor)
    rt = torch.zeros(4, 256, dtype=torch.int32)
    _, outs, Q, K, V = _run_request(eng, 2, 1, 45, 30, 6, rt, _paged_locs(75), dtype)
    for i, o in enumerate(outs):
        t = 45 + i
        ref = decode_attention(Q[t], K[: t + 1], V[: t + 1], None)
        assert torch.equal(o, ref), f"step {i}"
    assert eng.residency()["evicted_blocks"] == 0


def test_engine_refuses_bad_calls_naming_the_argument(seed):
    """A dense or unknown layer, extend lengths that do not add up to the queries, and decode
    lengths below 1 are refused with a ValueError naming them, before any state changes: the
    state then serves a valid request exactly as a fresh engine does."""
    eng = _engine(budget=64)
    rt = torch.zeros(4, 256, dtype=torch.int32)
    q, k = torch.randn(5, 6, 8), torch.randn(5, 2, 8)
    with pytest.raises(ValueError, match=r"layer 0 is dense .*serves layers \[1, 2\]"):
        eng.write_kv(0, torch.arange(5), k, k)
    with pytest.raises(ValueError, match="layer 7 is not a layer of this model"):
        eng.decode_attention(7, q[:1], k[:1], k[:1], None)
    with pytest.raises(ValueError, match=r"want loc \[N\]"):
        eng.write_kv(1, torch.arange(4), k, k)
    with pytest.raises(ValueError, match=r"extend_lens \[3\] \(sum 3\).*q of 5 tokens"):
        eng.extend_attention(1, q, torch.tensor([1]), torch.tensor([0]), torch.tensor([3]), rt, None)
    with pytest.raises(ValueError, match="1 rows, 2 prefix_lens"):
        eng.extend_attention(1, q, torch.tensor([1]), torch.tensor([0, 0]), torch.tensor([5]), rt, None)
    for bad in ({"max_seq_len": 0}, {"rows_host": [1], "seq_lens_host": [0]}, {"rows_host": [-1], "seq_lens_host": [5]}):
        with pytest.raises(ValueError, match="want"):
            eng.begin_decode_step(torch.tensor([1]), torch.tensor([5]), rt, **bad)
    with pytest.raises(ValueError, match="mode .graph.: want one of"):
        eng.begin_decode_step(torch.tensor([1]), torch.tensor([5]), rt, mode="graph")
    with pytest.raises(RuntimeError, match="without begin_decode_step"):
        eng.decode_attention(1, q[:1], k[:1], k[:1], None)
    torch.manual_seed(0)
    got = _run_request(eng, 1, 2, 37, 3, 6, rt, _paged_locs(37 + 3))[1]
    torch.manual_seed(0)
    ref = _run_request(_engine(budget=64), 1, 2, 37, 3, 6, rt.clone(), _paged_locs(37 + 3))[1]
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    eng.begin_decode_step(torch.tensor([1, 2]), torch.tensor([5, 5]), rt)
    with pytest.raises(ValueError, match="q has 1 rows but the step's batch has 2"):
        eng.decode_attention(1, q[:1], k[:1], k[:1], None)


def test_sparse_attends_exactly_the_resident_blocks(seed):
    """budget < context: output = attention over the resident blocks; the budget is respected."""
    eng = _engine(budget=16, fetch_cap=2)   # 4 blocks of 4
    rt = torch.zeros(4, 256, dtype=torch.int32)
    free_locs = _paged_locs(90)
    _, outs, Q, K, V = _run_request(eng, 1, 3, 60, 30, 6, rt, free_locs)
    li = eng.index[1]
    ids = eng.ws.ids[li][3]                                     # state after the last step
    n = 90
    ks, vs = [], []
    for h in range(eng.head_num):
        pos = sorted(p for b in ids[h].tolist() if b >= 0 for p in range(b * 4, min(n, b * 4 + 4)))
        assert len(pos) <= 16
        assert (n - 1) in pos and 0 in pos, "recent and sink blocks are resident"
        ks.append(K[pos, h])
        vs.append(V[pos, h])
    kk, vv = torch.stack(ks, 1), torch.stack(vs, 1)
    ref = decode_attention(Q[n - 1], kk, vv, None)
    torch.testing.assert_close(outs[-1], ref, rtol=1e-5, atol=1e-5)
    # and the working-set copy equals the host tier (write-through kept them in sync)
    for h in range(eng.head_num):
        for e, b in enumerate(ids[h].tolist()):
            if b >= 0:
                page = int(rt[3, b * 4]) // 4
                valid = min(4, n - b * 4)
                assert torch.equal(eng.ws.k[li][3, h, e, :valid], eng.host.k[li][h, page, :valid])
    assert eng.residency()["evicted_blocks"] > 0


def test_reset_rows_frees_everything(seed):
    eng = _engine(budget=16)
    rt = torch.zeros(4, 256, dtype=torch.int32)
    _run_request(eng, 1, 2, 30, 3, 6, rt, _paged_locs(33))
    assert (eng.ws.ids[:, 2] >= 0).any()
    eng.reset_rows([2])
    assert (eng.ws.ids == -1).all()


def test_first_decode_step_after_a_prefill_is_flagged(seed):
    eng = _engine(budget=16)
    rt = torch.zeros(4, 256, dtype=torch.int32)
    _run_request(eng, 1, 2, 20, 1, 6, rt, _paged_locs(21))
    assert eng.stats.new_request_started        # first decode of row 2
    H, D = eng.head_num, eng.head_dim
    eng.begin_decode_step(torch.tensor([2]), torch.tensor([22]), rt)
    eng.decode_attention(1, torch.randn(1, 6, D), torch.randn(1, H, D), torch.randn(1, H, D), None)
    assert not eng.stats.new_request_started    # no prefill since: the request goes on


def test_memory_plan_matches_allocation(seed):
    cfg = OasisConfig(budget_tokens=16, block_size=4, dense_layers=(0,))
    plan = OasisSparseKV.memory_plan(cfg, 3, 512, 4, 2, 8, 8, 4)
    eng = OasisSparseKV(cfg, 3, 512, 4, 2, 8, 8, torch.float32, "cpu")
    assert plan == {"working_set": eng.ws.nbytes, "summaries": eng.summaries.nbytes, "host_tier": eng.host.nbytes}
    # a compact host tier (a PD decode node's pd_host_slots): its pool is the host tier, whatever the tokens
    plan_c = OasisSparseKV.memory_plan(cfg, 3, 512, 4, 2, 8, 8, 4, host_slots=100)
    eng_c = OasisSparseKV(cfg, 3, 512, 4, 2, 8, 8, torch.float32, "cpu", host_slots=100)
    assert plan_c == {"working_set": eng_c.ws.nbytes, "summaries": eng_c.summaries.nbytes,
                      "host_tier": eng_c.host.nbytes}
    assert plan_c["host_tier"] == 100 * 4 * (8 + 8) * 4 < plan["host_tier"]
    for bad in (0, -5, 1.5, True, "7"):
        with pytest.raises(ValueError, match="host_slots"):
            OasisSparseKV.memory_plan(cfg, 3, 512, 4, 2, 8, 8, 4, host_slots=bad)


def test_token_capacity_fills_the_device_and_the_host_by_what_each_keeps(seed):
    """``token_capacity``: the tokens whose device share (dense layers, summaries) plus the
    working set fit the device budget and whose host tier fits the host budget, whichever is
    less, checked against ``memory_plan`` (what the engine allocates, with SGLang's extra page);
    with one memory (CPU) both shares come off one budget; every layer dense: no host bound;
    what cannot fit is refused naming the flags."""
    cfg = OasisConfig(budget_tokens=64, block_size=16, dense_layers=(0, 1))
    L, H, D, rows, kvb, bs = 36, 8, 128, 42, 2, 16
    cell = L * H * 2 * D * kvb                           # SGLang's bytes per token, every layer on the device
    dense = 2 * cell // L                                # the two dense layers
    for dev_tokens, host in ((368_624, 4000 * 2**30), (368_624, 20 * 2**30), (50_000, None)):
        dev = dev_tokens * cell
        c = OasisSparseKV.token_capacity(cfg, dev, cell, host, L, rows, H, D, D, kvb)
        n = c["tokens"]
        assert n % bs == 0 and n > 0
        plan = OasisSparseKV.memory_plan(cfg, L, n + bs, rows, H, D, D, kvb)      # SGLang: size + page_size
        assert c["working_set"] == plan["working_set"] and c["host_cell"] * n == plan["host_tier"] - c["host_cell"] * bs
        on_dev = plan["working_set"] + plan["summaries"] + (n + bs) * dense
        one = OasisSparseKV.memory_plan(cfg, L, bs, rows, H, D, D, kvb)            # one block more would not fit
        if host is None:                                 # one memory: everything from one budget
            assert on_dev + plan["host_tier"] <= dev < on_dev + plan["host_tier"] + one["summaries"] \
                + one["host_tier"] + bs * dense
            assert c["limit"] == "device" and n < dev_tokens        # the summaries and the working set cost
            continue
        assert on_dev <= dev and plan["host_tier"] <= host
        if c["limit"] == "host":
            assert host - plan["host_tier"] < bs * c["host_cell"]  # the host is full to a block
        else:
            assert dev - on_dev < bs * c["device_cell"]
        assert n > dev_tokens or c["limit"] == "host"    # more than SGLang's dense count unless the host bounds it
    assert OasisSparseKV.token_capacity(cfg, 368_624 * cell, cell, 4000 * 2**30, L, rows, H, D, D, kvb)["limit"] == "device"
    assert OasisSparseKV.token_capacity(cfg, 368_624 * cell, cell, 20 * 2**30, L, rows, H, D, D, kvb)["limit"] == "host"
    every = OasisConfig(budget_tokens=64, block_size=bs, dense_layers=tuple(range(L)))
    c = OasisSparseKV.token_capacity(every, 1000 * cell, cell, 10 * 2**30, L, rows, H, D, D, kvb)
    assert c["limit"] == "device" and c["tokens"] == (1000 // bs - 1) * bs and c["host_cell"] == 0      # no host tier
    with pytest.raises(ValueError, match=r"budget_tokens=64 x 42 request rows.*--mem-fraction-static"):
        OasisSparseKV.token_capacity(cfg, 2**20, cell, None, L, rows, H, D, D, kvb)
    with pytest.raises(ValueError, match="no block of KV cache fits the host memory"):
        OasisSparseKV.token_capacity(cfg, 368_624 * cell, cell, 1000, L, rows, H, D, D, kvb)
    ws = OasisSparseKV.memory_plan(cfg, L, bs, rows, H, D, D, kvb)["working_set"]
    with pytest.raises(ValueError, match="after the working set.*--mem-fraction-static"):
        OasisSparseKV.token_capacity(cfg, ws + 10, cell, 10 * 2**30, L, rows, H, D, D, kvb)
    with pytest.raises(ValueError, match="no device memory"):
        OasisSparseKV.token_capacity(every, 0, cell, None, L, rows, H, D, D, kvb)


def _state(eng):
    """Everything a refused call must leave as it was."""
    return (eng.stats.decode_steps, eng.stats.sync_steps, int(eng.clock), dict(eng.record.host or {}),
            eng.record.seq.clone(), eng.ws.ids.clone(), eng.ws.k[0].clone(), eng.counters.clone(), eng.step,
            eng.last_batch, eng.cfg, eng.predictor.name)


def _same(a, b):
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


@pytest.mark.parametrize("predictor", ["current", "previous"])
def test_bad_steps_are_refused_before_any_state_change(seed, predictor):
    """Breaker review of issue 16: rows, lengths, host lists, modes and per-layer tensors that do
    not describe a valid batch of this engine are refused with a ValueError naming the argument,
    before any counter, record, working set or the LRU clock changes; the engine then serves a
    request exactly as a fresh one."""
    eng = _engine(budget=16, predictor=predictor, H=2, D=8)          # 4 request rows, 2 KV heads
    rt = torch.zeros(4, 64, dtype=torch.int32)                        # rows hold at most 64 tokens
    torch.manual_seed(1)
    _run_request(eng, 1, 2, 30, 2, 6, rt, _paged_locs(32))            # a live request in row 2
    before = _state(eng)
    r, s = torch.tensor([2, 3]), torch.tensor([33, 5])
    bad_begins = [
        (dict(rows=torch.tensor([2, -1]), seq_lens=s), "rows in"),                    # wraps to another row
        (dict(rows=torch.tensor([2, 7]), seq_lens=s), "rows in"),                     # beyond the request table
        (dict(rows=r, seq_lens=torch.tensor([33, 0])), "lengths in"),
        (dict(rows=r, seq_lens=torch.tensor([33, 65])), "lengths in"),                # beyond req_to_token
        (dict(rows=torch.tensor([2.0, 3.0]), seq_lens=s), "rows"),
        (dict(rows=r[None], seq_lens=s[None]), "rows"),
        (dict(rows=r, seq_lens=torch.tensor([33, 5, 5])), "seq_lens 3"),
        (dict(rows=r, seq_lens=s, max_seq_len=31.5), "max_seq_len"),
        (dict(rows=r, seq_lens=s, max_seq_len=65), "max_seq_len"),
        (dict(rows=r, seq_lens=s, rows_host=[2, 3]), "go together"),
        (dict(rows=r, seq_lens=s, rows_host=[2, 9], seq_lens_host=[33, 5]), "rows in"),
        (dict(rows=r, seq_lens=s, rows_host="23", seq_lens_host=[33, 5]), "rows_host must be a list"),
        (dict(rows=r, seq_lens=s, rows_host=[2, 3.5], seq_lens_host=[33, 5]), "rows_host entry"),
        (dict(rows=r, seq_lens=s, rows_host=[2, True], seq_lens_host=[33, 5]), "rows_host entry"),
        (dict(rows=r, seq_lens=s, rows_host=[2, 3], seq_lens_host=[33, 5], max_seq_len=6), "below the longest"),
        (dict(rows=r, seq_lens=s, mode="Eager"), "mode 'Eager'"),
        (dict(rows=r, seq_lens=s, mode="replay", rows_host=[2, 99], seq_lens_host=[33, 5]), "rows in"),
    ]
    for kw, msg in bad_begins:
        with pytest.raises(ValueError, match=msg):
            eng.begin_decode_step(kw.pop("rows"), kw.pop("seq_lens"), rt, **kw)
        assert _same(_state(eng), before), kw
    with pytest.raises(ValueError, match="req_to_token"):
        eng.begin_decode_step(r, s, rt[0])
    from oasis_sglang.config import OasisConfigError

    with pytest.raises(OasisConfigError, match="predictor 'bogus'"):
        eng.set_policy(fetch_cap=3, predictor="bogus")
    assert _same(_state(eng), before), "set_policy changed the fetch cap before refusing the predictor"
    # per-layer tensors, checked before the synchronous selection or the append
    eng.begin_decode_step(torch.tensor([2]), torch.tensor([33]), rt)
    started = _state(eng)
    q, k = torch.randn(1, 6, 8), torch.randn(1, 2, 8)
    for args, kw, msg in [((1, torch.randn(1, 5, 8), k, k, None), {}, "q has shape"),
                          ((1, torch.randn(1, 6, 4), k, k, None), {}, "q has shape"),
                          ((1, q, torch.randn(1, 3, 8), k, None), {}, "k_new"),
                          ((1, q, k, torch.randn(2, 2, 8), None), {}, "v_new"),
                          ((1, q, k, k, "x"), {}, "scale"),
                          ((1.0, q, k, k, None), {}, "layer_id"),
                          ((True, q, k, k, None), {}, "layer_id"),
                          ((1, q, k, k, None), dict(q_draft=torch.randn(1, 3, 16), k_draft=k, v_draft=k), "q_draft"),
                          ((1, q, k, k, None), dict(q_draft=q, k_draft=torch.randn(1, 8, 2), v_draft=k), "k_draft")]:
        with pytest.raises(ValueError, match=msg):
            eng.decode_attention(*args, **kw)
        assert _same(_state(eng), started), (msg, kw)


# ---- a compact host tier (host_slots): the slot table in every kernel call ---------------------------
def _lockstep(engines, steps=10, prompts=(37, 50), rows=(1, 2), Hq=4, seed_pages=None):
    """Prefill two requests in every sparse layer of each engine, then ``steps`` batched decode
    steps, the same inputs for each engine; returns each engine's decode outputs and the
    request table (pages of the requests distinct, random)."""
    eng0 = engines[0]
    H, D, bs = eng0.head_num, eng0.head_dim, eng0.bs
    rt = torch.zeros(4, 256, dtype=torch.int32)
    perm = torch.randperm(eng0.host.num_pages) if seed_pages is None else seed_pages
    at = 0
    for r, n in zip(rows, prompts):
        nb = -(-(n + steps) // bs)
        pos = torch.arange(nb * bs)
        rt[r, :nb * bs] = (perm[at:at + nb][pos // bs] * bs + pos % bs).int()
        at += nb
    outs = [[] for _ in engines]
    for layer in eng0.sparse_layers:
        for r, n in zip(rows, prompts):
            K, V, Q = torch.randn(n, H, D), torch.randn(n, H, D), torch.randn(n, Hq, D)
            for e in engines:
                e.write_kv(layer, rt[r, :n].long(), K, V)
                e.extend_attention(layer, Q, torch.tensor([r]), torch.tensor([0]), torch.tensor([n]), rt, None)
    seq = torch.tensor(prompts)
    rr = torch.tensor(rows)
    for _ in range(steps):
        seq = seq + 1
        loc = rt[rr, seq - 1].long()
        for e in engines:
            e.begin_decode_step(rr, seq, rt)
        for layer in eng0.sparse_layers:
            kn, vn, q = torch.randn(2, H, D), torch.randn(2, H, D), torch.randn(2, Hq, D)
            for i, e in enumerate(engines):
                e.write_kv(layer, loc, kn, vn, decode=True)
                outs[i].append(e.decode_attention(layer, q, kn, vn, None))
    return outs, rt


@pytest.mark.parametrize("ops", ["torch", "triton"])
def test_compact_host_tier_fully_assigned_equals_the_whole_tier(seed, ops):
    """Every piece given a slot (shuffled): decode outputs, working sets, counters and the host
    data read back through the table are exactly the whole tier's; nothing is dropped."""
    if ops == "triton":
        pytest.importorskip("triton")
        from oasis_sglang.kernels import get_kv_ops
        mk = lambda: get_kv_ops("triton")                                   # noqa: E731
    else:
        from oasis_sglang.core.ops import TorchKVOps
        mk = TorchKVOps
    whole = _engine(budget=16, fetch_cap=2, ops=mk())
    L, H, P = len(whole.sparse_layers), whole.head_num, whole.host.num_pages
    compact = _engine(budget=16, fetch_cap=2, ops=mk(), host_slots=L * H * P + 5)
    assert compact.host.compact and compact.host_slots_d.shape == (L, H * P)
    perm = torch.randperm(L * H * P)
    got = compact.assign_host_pieces(perm // (H * P), perm // P % H, perm % P)
    assert sorted(got.tolist()) == list(range(L * H * P)) and compact.host.free_slots == 5
    assert torch.equal(compact.host_slots_d.cpu(), compact.host.slots)
    outs, rt = _lockstep([whole, compact])
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    assert torch.equal(whole.ws.ids, compact.ws.ids)
    assert all(torch.equal(a, b) for a, b in zip(whole.ws.k + whole.ws.v, compact.ws.k + compact.ws.v))
    assert torch.equal(whole.counters, compact.counters) and int(whole.counters[:, 1].sum()) > 0
    assert int(whole.counters[:, 3].sum()) > 0 and int(whole.counters[:, 2].sum()) > 0
    assert not compact.host_dropped.any()
    sl = compact.host.slots.long()
    for li in range(L):
        assert torch.equal(compact.host.k_pool[sl[li]].view(H, P, *compact.host.k_pool.shape[1:]), whole.host.k[li])
        assert torch.equal(compact.host.v_pool[sl[li]].view(H, P, *compact.host.v_pool.shape[1:]), whole.host.v[li])
        n = 37
        a, b = whole.read_prefix(li, rt[1], n, "cpu"), compact.read_prefix(li, rt[1], n, "cpu")
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_compact_host_tier_counts_dropped_writes_and_copies(seed):
    """Pieces without a slot: the prefill's writes to them are dropped and counted per (token,
    KV head), the plans copy nothing from them (counted as dropped copies, not as copies), and
    ``free_host_pages`` / ``assign_host_pieces`` keep the device table equal to the host's."""
    eng = _engine(budget=16, fetch_cap=2, host_slots=400)
    L, H, P, bs = len(eng.sparse_layers), eng.head_num, eng.host.num_pages, eng.bs
    pages = torch.randperm(P)
    # every piece of the first 40 pages (the requests' pages), except KV head 0 of pages 3..6 in layer 0
    lay, hh, pp = torch.meshgrid(torch.arange(L), torch.arange(H), pages[:40], indexing="ij")
    keep = ~((lay == 0) & (hh == 0) & (torch.arange(40)[None, None, :] >= 3) & (torch.arange(40)[None, None, :] < 7))
    eng.assign_host_pieces(lay[keep], hh[keep], pp[keep])
    assert eng.host.free_slots == 400 - int(keep.sum())
    assert torch.equal(eng.host_slots_d.cpu(), eng.host.slots)
    ref = _engine(budget=16, fetch_cap=2)
    outs, rt = _lockstep([eng, ref], steps=12, seed_pages=pages)
    # request row 1 (37 tokens) holds pages[0..9], row 2 pages[10..]: the holes are 4 whole blocks of row 1
    assert int(eng.host_dropped[0, 0]) == 4 * bs and int(eng.host_dropped[1, 0]) == 0
    lost_copies = int(eng.host_dropped[0, 1])
    assert lost_copies > 0 and int(eng.host_dropped[1, 1]) == 0
    assert int(ref.counters[0, 1] - eng.counters[0, 1]) == lost_copies
    assert torch.equal(eng.counters[1], ref.counters[1])
    # freeing pages frees their slots everywhere, both copies of the table
    n = eng.free_host_pages(pages[:2])
    assert n == 2 * L * H and eng.host.free_slots == 400 - int(keep.sum()) + n
    assert torch.equal(eng.host_slots_d.cpu(), eng.host.slots)
    assert (eng.host.slots[:, torch.arange(H)[:, None] * P + pages[:2][None, :]] == -1).all()
    with pytest.raises(RuntimeError, match="whole"):
        ref.assign_host_pieces([0], [0], [0])
    with pytest.raises(ValueError, match="heads must be in"):
        eng.assign_host_pieces([0], [H], [0])
