"""The dense path for short contexts (``dense_short_contexts``, core/engine.py): a decode step
whose every request's next context fits the working set skips scoring, top-K, plans and copies,
and still computes exactly what the full path computes, also when a request grows past the
budget mid-decode and when a batch mixes short and long requests; a dense step leaves every
block of the next context resident."""

import pytest
import torch

from oasis_sglang.config import OasisConfig, OasisConfigError
from oasis_sglang.core import OasisSparseKV
from oasis_sglang.core.attention import decode_attention
from oasis_sglang.core.ops import TorchKVOps

H, D, HQ, BS, BUDGET = 2, 8, 6, 4, 64          # 16 blocks of 4 tokens per (request, layer, KV head)


def _engine(dense: bool, predictor: str, fetch_cap=2, ops=None):
    cfg = OasisConfig(budget_tokens=BUDGET, block_size=BS, dense_layers=(0,), fetch_cap=fetch_cap,
                      predictor=predictor, transfer_budget=None, dense_short_contexts=dense)
    return OasisSparseKV(cfg, 3, 1024, 4, H, D, D, torch.float32, "cpu", ops=ops)


def _prefill_reqs(eng, reqs, steps, g):
    """Prefill ``reqs`` ({row: prompt tokens}) in every sparse layer with random K/V/Q drawn from
    ``g`` for their prompts and ``steps`` decode steps. Returns the request table, the sorted
    rows, the prompt lengths and ``{(row, layer): (k, v, q)}``."""
    rt = torch.zeros(4, 512, dtype=torch.int32)
    for r in reqs:
        rt[r] = torch.arange(512, dtype=torch.int32) + 256 * (r - 1)
    rows, n, data = sorted(reqs), dict(reqs), {}
    for r in rows:
        for l in eng.sparse_layers:
            k, v, q = (torch.randn(n[r] + steps, H if i < 2 else HQ, D, generator=g) for i in range(3))
            data[r, l] = (k, v, q)
            eng.write_kv(l, rt[r, :n[r]].long(), k[:n[r]], v[:n[r]])
            eng.extend_attention(l, q[:n[r]], torch.tensor([r]), torch.tensor([0]), torch.tensor([n[r]]), rt, None,
                                 k[:n[r]], v[:n[r]])
    return rt, rows, n, data


def _drive(eng, reqs, steps, g):
    """Prefill ``reqs`` ({row: prompt tokens}) in both sparse layers, then decode ``steps``
    steps of the whole batch with host rows and lengths (as SGLang's glue passes them).
    Returns every step's attention outputs per sparse layer and the step's dense flag."""
    rt, rows, n, data = _prefill_reqs(eng, reqs, steps, g)
    outs, dense = [], []
    for t in range(steps):
        seq = [n[r] + t + 1 for r in rows]
        st = eng.begin_decode_step(torch.tensor(rows), torch.tensor(seq), rt, rows_host=rows, seq_lens_host=seq)
        dense.append(st.dense)
        step = []
        for l in eng.sparse_layers:
            k = torch.stack([data[r, l][0][n[r] + t] for r in rows])
            v = torch.stack([data[r, l][1][n[r] + t] for r in rows])
            q = torch.stack([data[r, l][2][n[r] + t] for r in rows])
            eng.write_kv(l, torch.stack([rt[r, n[r] + t] for r in rows]).long(), k, v, decode=True)
            step.append(eng.decode_attention(l, q, k, v, None))
        outs.append(step)
    eng.ws.check()                       # no decoded token ever missed its block
    return outs, dense, data


@pytest.mark.parametrize("predictor", ["previous", "current"])
def test_dense_steps_equal_the_full_path_through_the_budget(seed, predictor):
    """One request of 40 tokens decodes 40 steps: it fits the 64-token working set for its
    first 23 steps, then grows past it. The dense path's outputs are bitwise the full path's at
    every step, dense steps stop once the next context no longer fits, and while they ran each
    output was the dense attention over the whole context."""
    got = []
    for dense in (True, False):
        eng = _engine(dense, predictor)
        got.append(_drive(eng, {1: 40}, 40, torch.Generator().manual_seed(seed)) + (eng,))
    (o_d, flags, data, eng_d), (o_f, flags_f, _, eng_f) = got
    assert not any(flags_f), "dense_short_contexts false: never dense"
    first = 0 if predictor == "previous" else 1      # current: the first step selects and makes the set whole
    assert flags == [first <= t and 40 + t + 2 <= BUDGET for t in range(40)], flags
    assert eng_d.stats.dense_steps == sum(flags) > 0
    for t in range(40):
        for a, b in zip(o_d[t], o_f[t]):
            assert torch.equal(a, b), f"step {t}: the dense path differs from the full path"
    for t in range(sum(flags)):
        for i, l in enumerate(eng_d.sparse_layers):
            k, v, q = data[1, l]
            want = decode_attention(q[40 + t], k[:40 + t + 1], v[:40 + t + 1], None)
            assert torch.allclose(o_d[t][i][0], want, atol=1e-5, rtol=1e-5), f"step {t} layer {l}"
    assert torch.equal(eng_d.ws.ids, eng_f.ws.ids), "the same blocks in the same slots after the transition"
    if predictor == "previous":          # the same LRU clocks (current's full path stamps this step's clock)
        assert torch.equal(eng_d.ws.last_used, eng_f.ws.last_used)
    assert torch.equal(eng_d.counters, eng_f.counters), "the same hits, admissions, evictions, write-backs"
    r = eng_d.residency()
    assert r["dense_steps"] == sum(flags) and r["evicted_blocks"] > 0


class _Kernel9Ops(TorchKVOps):
    """The torch ops with the dense path's update by kernel 9 (``kernels.dense_plan``, under
    Triton's interpreter on CPU; on a CUDA host compiled, its tensors copied to the GPU and its
    results back): the other Triton kernels need a head_dim of 16 or more."""

    def dense_plan(self, *args):
        from oasis_sglang.kernels.dense_plan import dense_plan

        if not torch.cuda.is_available():
            return dense_plan(*args)
        dev = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
        dense_plan(*dev)
        for a, d in zip(args, dev):             # ids, last_used, counters change in place
            if isinstance(a, torch.Tensor):
                a.copy_(d.cpu())


@pytest.mark.parametrize("predictor", ["previous", "current"])
def test_kernel_9_in_the_engine_equals_the_reference(seed, predictor):
    """Two requests (one grows past the budget, one stays short) decode through the dense path
    with kernel 9 and with the torch reference: the same outputs, dense flags, block tables, LRU
    clocks and counters at the end."""
    res = []
    for ops in (TorchKVOps(), _Kernel9Ops()):
        eng = _engine(True, predictor, ops=ops)
        outs, flags, _ = _drive(eng, {1: 30, 3: 5}, 40, torch.Generator().manual_seed(seed))
        res.append((outs, flags, eng))
    (oa, fa, a), (ob, fb, b) = res
    assert fa == fb and any(fa) and not all(fa), fa
    for x, y in zip(oa, ob):
        assert all(torch.equal(p, q) for p, q in zip(x, y))
    assert torch.equal(a.ws.ids, b.ws.ids) and torch.equal(a.ws.last_used, b.ws.last_used)
    assert torch.equal(a.counters, b.counters) and b.stats.dense_steps == sum(fb)


def test_a_dense_step_leaves_the_next_context_resident_in_every_layer(seed):
    """After each dense step, every (layer, KV head) of the row holds exactly the blocks of the
    next context (the appended token's block and the next token's, from free slots), each once."""
    eng, full = _engine(True, "previous"), _engine(False, "previous")
    rt_steps = 20
    outs, flags, _ = _drive(eng, {2: 7}, rt_steps, torch.Generator().manual_seed(seed))
    _drive(full, {2: 7}, rt_steps, torch.Generator().manual_seed(seed))
    assert all(flags)
    assert torch.equal(eng.ws.ids, full.ws.ids) and torch.equal(eng.ws.last_used, full.ws.last_used), \
        "the same slots and LRU clocks as the full path's plans"
    n_next = 7 + rt_steps + 1
    for li in range(len(eng.sparse_layers)):
        for h in range(H):
            held = sorted(x for x in eng.ws.ids[li, 2, h].tolist() if x >= 0)
            assert held == list(range(-(-n_next // BS))), (li, h, held)


def test_a_batch_with_one_long_request_takes_the_full_path(seed):
    """Dense steps need every row to fit: a batch of a short and a long request selects for
    both (and stays exact against the engine without the dense path)."""
    got = []
    for dense in (True, False):
        eng = _engine(dense, "previous")
        got.append(_drive(eng, {1: 10, 3: 90}, 6, torch.Generator().manual_seed(seed)))
    assert not any(got[0][1])
    for a, b in zip(got[0][0], got[1][0]):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_without_host_rows_or_with_measure_agreement_no_step_is_dense(seed):
    """The dense decision is made on the host: no host rows (an eager step without
    ``rows_host``), ``measure_agreement`` or a bad value of the key give the full path or an
    error naming the key."""
    eng = _engine(True, "previous")
    rt = torch.zeros(4, 512, dtype=torch.int32)
    rt[1] = torch.arange(512, dtype=torch.int32)
    for l in eng.sparse_layers:
        k = torch.randn(9, H, D)
        eng.write_kv(l, rt[1, :9].long(), k, k)
        eng.extend_attention(l, torch.randn(9, HQ, D), torch.tensor([1]), torch.tensor([0]), torch.tensor([9]), rt,
                             None, k, k)
    assert not eng.begin_decode_step(torch.tensor([1]), torch.tensor([10]), rt).dense
    cfg = OasisConfig(budget_tokens=BUDGET, block_size=BS, dense_layers=(0,), predictor="previous",
                      measure_agreement=True)
    e2 = OasisSparseKV(cfg, 3, 1024, 4, H, D, D, torch.float32, "cpu")
    assert not any(_drive(e2, {1: 9}, 3, torch.Generator().manual_seed(seed))[1])
    for bad in (1, "yes", None):
        with pytest.raises(OasisConfigError, match="dense_short_contexts"):
            OasisConfig(dense_short_contexts=bad)


def _prefill(eng, rt, row, pre, n, k, v, q):
    for l in eng.sparse_layers:
        eng.write_kv(l, rt[row, pre:n].long(), k[l][pre:n], v[l][pre:n])
        eng.extend_attention(l, q[l][pre:n], torch.tensor([row]), torch.tensor([pre]), torch.tensor([n - pre]), rt,
                             None, k[l][pre:n], v[l][pre:n])


def _decode(eng, rt, row, t, k, v, q):
    st = eng.begin_decode_step(torch.tensor([row]), torch.tensor([t + 1]), rt, rows_host=[row], seq_lens_host=[t + 1])
    out = []
    for l in eng.sparse_layers:
        eng.write_kv(l, rt[row, t:t + 1].long(), k[l][t:t + 1], v[l][t:t + 1], decode=True)
        out.append(eng.decode_attention(l, q[l][t:t + 1], k[l][t:t + 1], v[l][t:t + 1], None))
    return st, out


@pytest.mark.parametrize("predictor", ["current", "previous"])
def test_an_extend_of_a_decoding_row_forgets_its_marks(seed, predictor):
    """A row decoded a few steps, then its tail is prefilled again (an extend over position 12,
    as a streaming session's retry does): the extend cuts its working set back, so no earlier
    mark may make the next step dense over the cut set. Outputs stay exactly the full path's and
    the dense attention over the rewritten context."""
    g = torch.Generator().manual_seed(seed)
    rt = torch.zeros(4, 512, dtype=torch.int32)
    rt[1] = torch.arange(512, dtype=torch.int32)
    L = (1, 2)
    k = {l: torch.randn(40, H, D, generator=g) for l in L}
    v = {l: torch.randn(40, H, D, generator=g) for l in L}
    q = {l: torch.randn(40, HQ, D, generator=g) for l in L}
    outs = []
    for dense in (True, False):
        eng = _engine(dense, predictor)
        kk, vv = {l: k[l].clone() for l in L}, {l: v[l].clone() for l in L}
        _prefill(eng, rt, 1, 0, 10, kk, vv, q)
        for t in range(10, 13):
            _decode(eng, rt, 1, t, kk, vv, q)
        for l in L:                                       # position 12 rewritten, then prefilled again
            kk[l][12], vv[l][12] = -kk[l][12], 2 * vv[l][12]
        _prefill(eng, rt, 1, 12, 13, kk, vv, q)
        got = []
        for t in range(13, 16):
            st, o = _decode(eng, rt, 1, t, kk, vv, q)
            got.append((st.dense, o))
        eng.ws.check()
        outs.append(got)
        for i, (_, o) in enumerate(got):
            t = 13 + i
            for j, l in enumerate(L):
                want = decode_attention(q[l][t], kk[l][:t + 1], vv[l][:t + 1], None)
                assert torch.allclose(o[j][0], want, atol=1e-5, rtol=1e-5), (dense, t, l)
    assert not outs[0][0][0] or predictor == "previous", "current: the step after the extend selects"
    for (_, a), (_, b) in zip(*outs):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_switching_the_predictor_clears_the_record(seed):
    """set_policy (benchmarks) to another predictor: what the record held meant something else
    (current: a context selected whole; previous: one prefetched), so the next step selects
    and no decoded token misses its block."""
    g = torch.Generator().manual_seed(seed)
    rt = torch.zeros(4, 512, dtype=torch.int32)
    rt[1] = torch.arange(512, dtype=torch.int32)
    L = (1, 2)
    k, v, q = ({l: torch.randn(40, n, D, generator=g) for l in L} for n in (H, H, HQ))
    for dense in (True, False):
        eng = _engine(dense, "current", fetch_cap=2)
        _prefill(eng, rt, 1, 0, 10, k, v, q)
        for t in range(10, 12):
            _decode(eng, rt, 1, t, k, v, q)
        eng.set_policy(predictor="previous")
        assert eng.record.host == {}
        st, _ = _decode(eng, rt, 1, 12, k, v, q)
        assert st.sync and not st.dense
        for t in range(13, 16):
            _decode(eng, rt, 1, t, k, v, q)
        eng.ws.check()


def _drive_graph(eng, reqs, steps, g, pad=2, eager_every=4):
    """``_drive``'s schedule as SGLang's decode CUDA-graph runner runs it with both variants
    captured: every step but each ``eager_every``-th is a replay. A replay's host bookkeeping
    (``begin_decode_step`` in ``replay`` mode, real rows only) chooses the variant
    (``DecodeStep.dense``); then the device work of that variant's graph runs as a capture step
    records it (``prepare_step_device`` and every sparse layer over the batch padded with
    request row 0 of context 1). Start-up first captures both variants (padding rows only)."""
    B = len(reqs)
    pad_rows, pad_seq = torch.zeros(B + pad, dtype=torch.long), torch.ones(B + pad, dtype=torch.long)
    for dense in (False, True):                        # SGLang captures the full graph, then the dense one
        eng.begin_decode_step(pad_rows, pad_seq, torch.zeros(4, 512, dtype=torch.int32), mode="capture", dense=dense)
    rt, rows, n, data = _prefill_reqs(eng, reqs, steps, g)
    outs, dense = [], []
    for t in range(steps):
        seq = [n[r] + t + 1 for r in rows]
        replay = t % eager_every != 0 and eng.can_replay(rows, seq)
        if replay:
            st = eng.begin_decode_step(torch.tensor(rows), torch.tensor(seq), rt, mode="replay", rows_host=rows,
                                       seq_lens_host=seq)
            assert eng.step is None
            eng.begin_decode_step(torch.tensor(rows + [0] * pad), torch.tensor(seq + [1] * pad), rt, mode="capture",
                                  dense=st.dense)
            eng.prepare_step_device()
        else:
            st = eng.begin_decode_step(torch.tensor(rows), torch.tensor(seq), rt, rows_host=rows, seq_lens_host=seq)
        dense.append((replay, st.dense))
        step = []
        P = pad if replay else 0
        for l in eng.sparse_layers:
            k = torch.stack([data[r, l][0][n[r] + t] for r in rows] + [torch.randn(H, D, generator=g)] * P)
            v = torch.stack([data[r, l][1][n[r] + t] for r in rows] + [torch.randn(H, D, generator=g)] * P)
            q = torch.stack([data[r, l][2][n[r] + t] for r in rows] + [torch.randn(HQ, D, generator=g)] * P)
            loc = torch.stack([rt[r, n[r] + t] for r in rows] + [rt[0, 0]] * P).long()
            eng.write_kv(l, loc, k, v, decode=True)
            step.append(eng.decode_attention(l, q, k, v, None)[:B])
        outs.append(step)
        if eng.record.trusted:     # the device record (what the graphs mark) equals the host mirror
            assert eng.record.seq[rows].tolist() == [eng.record.host.get(r, -1) for r in rows], t
    eng.ws.check()
    return outs, dense, data


def _padded_engine(dense: bool, predictor: str, fetch_cap=2):
    cfg = OasisConfig(budget_tokens=BUDGET, block_size=BS, dense_layers=(0,), fetch_cap=fetch_cap,
                      predictor=predictor, transfer_budget=None, dense_short_contexts=dense)
    return OasisSparseKV(cfg, 3, 1024, 4, H, D, D, torch.float32, "cpu", padding_row=0)


@pytest.mark.parametrize("predictor", ["previous", "current"])
def test_dense_graph_replays_equal_eager_steps(seed, predictor):
    """Graph mode with the dense-path variant captured: a short request (fits for its first
    steps) and a longer one that grows past the budget mid-run. Replays choose the dense graph
    exactly when an eager step would be dense; outputs, slots, LRU-independent counters and the
    dense-step count equal the eager engine's, and the padding rows count no hits."""
    reqs, steps = {1: 40, 3: 9}, 30
    eng_e, eng_g = _padded_engine(True, predictor), _padded_engine(True, predictor)
    o_e, flags_e, _ = _drive(eng_e, reqs, steps, torch.Generator().manual_seed(seed))
    o_g, flags_g, _ = _drive_graph(eng_g, reqs, steps, torch.Generator().manual_seed(seed))
    assert [d for _, d in flags_g] == flags_e, "replays choose the dense graph when an eager step is dense"
    assert any(r and d for r, d in flags_g), "some dense replays ran"
    assert any(r and not d for r, d in flags_g), "and some full-path replays (the long request past the budget)"
    for t in range(steps):
        for a, b in zip(o_e[t], o_g[t]):
            assert torch.equal(a, b), f"step {t}"
    assert torch.equal(eng_e.ws.ids[:, [1, 3]], eng_g.ws.ids[:, [1, 3]])
    assert torch.equal(eng_e.counters, eng_g.counters), "hits, admissions, evictions, write-backs (padding: none)"
    ra, rb = eng_e.residency(), eng_g.residency()
    assert ra["dense_steps"] == rb["dense_steps"] == sum(flags_e) > 0
    assert rb["graph_steps"] == sum(r for r, _ in flags_g) and rb["sync_steps"] == ra["sync_steps"]


def test_no_dense_replay_before_a_dense_capture_and_bad_dense_arguments(seed):
    """A replay chooses the dense graph only once one was captured; ``dense=True`` outside a
    capture, or a dense capture with the dense path off, is refused before any state changes."""
    eng = _padded_engine(True, "previous")
    rt = torch.zeros(4, 512, dtype=torch.int32)
    rt[1] = torch.arange(512, dtype=torch.int32)
    _prefill(eng, rt, 1, 0, 10, *({l: torch.randn(20, n, D) for l in (1, 2)} for n in (H, H, HQ)))
    assert eng.can_replay([1], [11]) and eng.can_capture_dense()
    st = eng.begin_decode_step(torch.tensor([1]), torch.tensor([11]), rt, mode="replay", rows_host=[1], seq_lens_host=[11])
    assert not st.dense and eng.stats.dense_steps == 0, "no dense graph captured: the full graph replays"
    for mode in ("eager", "replay"):
        with pytest.raises(ValueError, match="dense"):
            eng.begin_decode_step(torch.tensor([1]), torch.tensor([12]), rt, mode=mode, rows_host=[1],
                                  seq_lens_host=[12], dense=True)
    with pytest.raises(ValueError, match="dense"):
        eng.begin_decode_step(torch.tensor([1]), torch.tensor([12]), rt, mode="capture", dense=1)
    off = _padded_engine(False, "previous")
    assert not off.can_capture_dense()
    with pytest.raises(ValueError, match="dense_short_contexts"):
        off.begin_decode_step(torch.tensor([0]), torch.tensor([1]), rt, mode="capture", dense=True)
    assert eng.stats.decode_steps == 1 and off.stats.decode_steps == 0


def test_switching_the_predictor_drops_the_dense_graphs(seed):
    """A captured graph keeps the predictor it was recorded with (its record marks and hit
    counts): after ``set_policy(predictor=...)`` no replay picks the dense graph (nor, for
    current, marks the record) until one is captured again."""
    eng = _padded_engine(True, "previous")
    rt = torch.zeros(4, 512, dtype=torch.int32)
    rt[1] = torch.arange(512, dtype=torch.int32)
    _prefill(eng, rt, 1, 0, 10, *({l: torch.randn(20, n, D) for l in (1, 2)} for n in (H, H, HQ)))
    eng.begin_decode_step(torch.tensor([0]), torch.tensor([1]), rt, mode="capture", dense=True)
    st = eng.begin_decode_step(torch.tensor([1]), torch.tensor([11]), rt, mode="replay", rows_host=[1], seq_lens_host=[11])
    assert st.dense
    eng.set_policy(predictor="current")
    st = eng.begin_decode_step(torch.tensor([1]), torch.tensor([12]), rt, mode="replay", rows_host=[1], seq_lens_host=[12])
    assert not st.dense and eng.record.host == {} and int(eng.record.seq[1]) == -1, "nothing marked by a stale graph"
    eng.begin_decode_step(torch.tensor([0]), torch.tensor([1]), rt, mode="capture", dense=True)
    eng.begin_decode_step(torch.tensor([1]), torch.tensor([13]), rt, mode="replay", rows_host=[1], seq_lens_host=[13])
    assert eng.record.host == {1: 14} and int(eng.record.seq[1]) == 14, "recaptured: current marks again"


def test_each_replay_checks_the_hosts_decision_on_the_device(seed, caplog):
    """A replay's device work compares each real row's context with the context its working set
    was predicted for (``replay_misses``; the padding row and the captures' warm-up runs do not
    count). Correct replays leave it at 0; a replay the host decided on wrong lengths (what a
    wrong host length from the prediction record would give) is counted, and the next report
    logs it as an error and rebuilds the host record from the device."""
    eng = _padded_engine(True, "previous")
    eng.check_replays = True
    _drive_graph(eng, {1: 40, 3: 9}, 12, torch.Generator().manual_seed(seed))
    assert eng.stats.graph_steps > 0 and int(eng.replay_misses) == 0
    assert eng.residency()["replay_misses"] == 0
    eng = _padded_engine(False, "previous")
    eng.check_replays = True
    rt = torch.zeros(4, 512, dtype=torch.int32)
    rt[1] = torch.arange(512, dtype=torch.int32)
    pad = (torch.zeros(3, dtype=torch.long), torch.ones(3, dtype=torch.long))
    eng.begin_decode_step(*pad, rt, mode="capture")
    eng.prepare_step_device()
    _prefill(eng, rt, 1, 0, 10, *({l: torch.randn(20, n, D) for l in (1, 2)} for n in (H, H, HQ)))
    assert eng.record.host == {1: 11}
    eng.begin_decode_step(torch.tensor([1]), torch.tensor([11]), rt, mode="replay", rows_host=[1], seq_lens_host=[11])
    assert int(eng.replay_misses) == 0, "zeroed at the first replay, before its device work"
    eng.begin_decode_step(torch.tensor([1, 0, 0]), torch.tensor([13, 1, 1]), rt, mode="capture")   # really 13
    eng.prepare_step_device()
    assert int(eng.replay_misses) == 1, "row 1 was predicted for 11; the padding rows do not count"
    with caplog.at_level("ERROR"):
        r = eng.residency()
    assert r["replay_misses"] == 1 and "1 rows of replayed decode steps had a working set predicted" in caplog.text
    assert eng.record.trusted and eng.record.host == {1: 11}, "rebuilt from the device record"
    caplog.clear()
    with caplog.at_level("ERROR"):
        assert eng.residency()["replay_misses"] == 1
    assert "replayed decode steps" not in caplog.text, "logged once"
