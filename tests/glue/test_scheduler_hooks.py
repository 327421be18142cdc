"""sglang_glue/scheduler_hooks.py and runtime.py: the hooks on SGLang's ReqToTokenPool, Scheduler
and decode CUDA-graph runner, against a real ReqToTokenPool, real Req / ScheduleBatch /
ForwardBatch objects and a real OasisKV engine on the CPU. (The Scheduler and the graph runner
are too heavy to build here: each hook reads one attribute of them, given by a small stand-in.)"""

from types import SimpleNamespace

import torch
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.sampling.sampling_params import SamplingParams

from oasis_sglang.config import OasisConfig
from oasis_sglang.core import OasisSparseKV
from oasis_sglang.sglang_glue.runtime import OasisRuntime, runtime_of
from oasis_sglang.sglang_glue.scheduler_hooks import (can_run_graph_hook, req_clear_hook, req_free_hook,
                                                      run_batch_hook)

BS, H, HQ, D = 4, 2, 6, 16


def _pool(attach=True, predictor="previous"):
    """SGLang's request table (4 requests + padding row 0) with an engine of as many rows."""
    rtp = ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
    if attach:
        cfg = OasisConfig(budget_tokens=16, block_size=BS, dense_layers=(0,), predictor=predictor)
        eng = OasisSparseKV(cfg, 3, 4 * 64 + BS, rtp.req_to_token.shape[0], H, D, D, torch.float32, "cpu",
                            padding_row=0)
        rtp._oasis = OasisRuntime(eng)
    return rtp


def _reqs(rtp, n):
    reqs = [Req(f"r{i}", "", [1, 2, 3], SamplingParams()) for i in range(n)]
    assert rtp.alloc(reqs) is not None
    return reqs


def _prefill(rtp, rows, n):
    """Prefill ``n`` tokens of each row through every sparse layer (what the attention backend
    does for an EXTEND batch); the ``previous`` predictor then predicts each row's first decode
    step (context ``n + 1``)."""
    eng, rt, r, B = rtp._oasis.engine, rtp.req_to_token, torch.tensor(rows), len(rows)
    for row in rows:
        rt[row, :] = torch.arange(64, dtype=torch.int32) + 64 * (row - 1) + BS   # own pages, page 0 left free
    for l in eng.sparse_layers:
        k, v = torch.randn(B * n, H, D), torch.randn(B * n, H, D)
        eng.write_kv(l, rt[r, :n].reshape(-1).long(), k, v)
        eng.extend_attention(l, torch.randn(B * n, HQ, D), r, torch.zeros(B, dtype=torch.long),
                             torch.full((B,), n), rt, None, k, v)


def _decode(rtp, rows, t):
    eng, rt, r, B = rtp._oasis.engine, rtp.req_to_token, torch.tensor(rows), len(rows)
    seq = torch.full((B,), t + 1)
    eng.begin_decode_step(r, seq, rt, rows_host=rows, seq_lens_host=seq.tolist())
    for l in eng.sparse_layers:
        k, v = torch.randn(B, H, D), torch.randn(B, H, D)
        eng.write_kv(l, rt[r, t].long(), k, v, decode=True)
        eng.decode_attention(l, torch.randn(B, HQ, D), k, v, None)


def _decode_batch(rows, seq, mode=ForwardMode.DECODE):
    B = len(rows)
    return ForwardBatch(forward_mode=mode, batch_size=B, input_ids=torch.zeros(B, dtype=torch.long),
                        req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(seq),
                        out_cache_loc=torch.zeros(B, dtype=torch.long), seq_lens_sum=sum(seq),
                        seq_lens_cpu=torch.tensor(seq))


def _graph_runner(rtp, draft=False):
    return SimpleNamespace(model_runner=SimpleNamespace(req_to_token_pool=rtp, is_draft_worker=draft))


def test_runtime_is_found_on_the_request_table():
    rtp = _pool()
    assert isinstance(runtime_of(rtp), OasisRuntime) and runtime_of(rtp).batch_rows_host is None
    assert runtime_of(_pool(attach=False)) is None and runtime_of(None) is None


def test_free_resets_only_the_finished_requests_row(seed):
    rtp = _pool()
    eng = rtp._oasis.engine
    a, b = _reqs(rtp, 2)
    rows = [a.req_pool_idx, b.req_pool_idx]
    assert rows == [1, 2]
    _prefill(rtp, rows, 20)
    _decode(rtp, rows, 20)
    assert (eng.ws.ids[:, 1] >= 0).any() and (eng.ws.ids[:, 2] >= 0).any()
    assert eng.record.seq[1:3].tolist() == [22, 22] and eng.record.host == {1: 22, 2: 22}
    ids2 = eng.ws.ids[:, 2].clone()
    assert req_free_hook(rtp, a) is None
    assert (eng.ws.ids[:, 1] == -1).all() and (eng.ws.last_used[:, 1] == 0).all()
    assert int(eng.record.seq[1]) == -1 and 1 not in eng.record.host
    assert torch.equal(eng.ws.ids[:, 2], ids2) and int(eng.record.seq[2]) == 22 and eng.record.host == {2: 22}
    assert a.req_pool_idx == 1, "the hook runs BEFORE SGLang's free: it leaves the request alone"
    a.req_pool_idx = None                          # a request that holds no row: nothing to do
    req_free_hook(rtp, a)
    assert torch.equal(eng.ws.ids[:, 2], ids2)


def test_clear_resets_every_row_and_passes_the_result_through(seed):
    rtp = _pool()
    eng = rtp._oasis.engine
    rows = [r.req_pool_idx for r in _reqs(rtp, 3)]
    _prefill(rtp, rows, 16)
    _decode(rtp, rows, 16)
    assert (eng.ws.ids >= 0).any() and (eng.record.seq >= 0).any()
    sentinel = object()
    assert req_clear_hook(sentinel, rtp) is sentinel
    assert (eng.ws.ids == -1).all() and (eng.record.seq == -1).all() and eng.record.host == {}


def test_without_oasis_on_the_pool_the_hooks_do_nothing(seed):
    rtp = _pool(attach=False)
    reqs = _reqs(rtp, 2)
    assert req_free_hook(rtp, reqs[0]) is None and reqs[0].req_pool_idx == 1
    assert req_clear_hook("result", rtp) == "result"
    sched = SimpleNamespace(req_to_token_pool=rtp)
    assert run_batch_hook(sched, ScheduleBatch(reqs=reqs)) is None
    assert not hasattr(rtp, "_oasis")
    fb = _decode_batch([1, 2], [5, 5])
    assert can_run_graph_hook(True, _graph_runner(rtp), fb) is True
    assert can_run_graph_hook(False, _graph_runner(rtp), fb) is False
    assert run_batch_hook(SimpleNamespace(), ScheduleBatch(reqs=reqs)) is None, "a scheduler without a table"


def test_run_batch_records_the_rows_in_batch_order():
    rtp = _pool()
    rt = rtp._oasis
    reqs = _reqs(rtp, 3)
    sched = SimpleNamespace(req_to_token_pool=rtp)
    assert run_batch_hook(sched, ScheduleBatch(reqs=[reqs[2], reqs[0], reqs[1]])) is None
    assert rt.batch_rows_host == [3, 1, 2]
    run_batch_hook(sched, ScheduleBatch(reqs=[reqs[1]]))
    assert rt.batch_rows_host == [2]
    fresh = Req("new", "", [1], SamplingParams())       # not allocated yet: req_pool_idx None
    run_batch_hook(sched, ScheduleBatch(reqs=[reqs[0], fresh]))
    assert rt.batch_rows_host is None
    run_batch_hook(sched, ScheduleBatch(reqs=[]))
    assert rt.batch_rows_host == []
    run_batch_hook(sched, SimpleNamespace())             # a batch without requests
    assert rt.batch_rows_host is None


def test_can_run_graph_needs_every_row_predicted_for_its_context(seed):
    rtp = _pool()
    rt = rtp._oasis
    runner = _graph_runner(rtp)
    reqs = _reqs(rtp, 2)
    sched = SimpleNamespace(req_to_token_pool=rtp)
    fb = _decode_batch([1, 2], [21, 21])
    assert can_run_graph_hook(True, runner, fb) is False, "no rows recorded by the scheduler"
    run_batch_hook(sched, ScheduleBatch(reqs=reqs))
    assert can_run_graph_hook(True, runner, fb) is False, "nothing predicted yet"
    _prefill(rtp, [1, 2], 20)                            # predicts each row's first decode step
    assert can_run_graph_hook(True, runner, fb) is True
    assert can_run_graph_hook(False, runner, fb) is False, "SGLang's own refusal stands"
    assert can_run_graph_hook(True, runner, _decode_batch([1, 2], [21, 22])) is False, "a row's context differs"
    assert can_run_graph_hook(True, runner, _decode_batch([1, 2, 3], [21, 21, 21])) is False, "rows of another batch"
    fb_nocpu = _decode_batch([1, 2], [21, 21])
    fb_nocpu.seq_lens_cpu = None
    assert can_run_graph_hook(True, runner, fb_nocpu) is False, "no host copy of the lengths"
    run_batch_hook(sched, ScheduleBatch(reqs=reqs[:1]))
    assert can_run_graph_hook(True, runner, fb) is False, "the scheduler's rows are another batch's"
    run_batch_hook(sched, ScheduleBatch(reqs=reqs))
    _decode(rtp, [1, 2], 20)                             # predicts the next step (context 22)
    assert can_run_graph_hook(True, runner, _decode_batch([1, 2], [22, 22])) is True
    assert can_run_graph_hook(True, runner, fb) is False, "the old context"
    req_free_hook(rtp, reqs[1])
    assert can_run_graph_hook(True, runner, _decode_batch([1, 2], [22, 22])) is False, "a freed row"
    rt.batch_rows_host = [1]
    assert can_run_graph_hook(True, runner, _decode_batch([1], [22])) is True


def test_a_paired_verify_batch_replays_when_its_decode_row_was_predicted(seed):
    """TARGET_VERIFY (the paired forward with a draft): ``seq_lens`` excludes the 2 verify
    tokens, so the decode row's context, the one predicted, is ``seq_lens + 1``."""
    rtp = _pool()
    reqs = _reqs(rtp, 2)
    runner = _graph_runner(rtp)
    run_batch_hook(SimpleNamespace(req_to_token_pool=rtp), ScheduleBatch(reqs=reqs))
    _prefill(rtp, [1, 2], 20)                            # predicts context 21 for each row
    assert can_run_graph_hook(True, runner, _decode_batch([1, 2], [20, 20], mode=ForwardMode.TARGET_VERIFY)) is True
    assert can_run_graph_hook(True, runner, _decode_batch([1, 2], [21, 21], mode=ForwardMode.TARGET_VERIFY)) is False
    assert can_run_graph_hook(True, runner, _decode_batch([1, 2], [21, 21])) is True, "the same rows as a decode batch"
    ext = _decode_batch([1, 2], [20, 20], mode=ForwardMode.EXTEND)
    assert can_run_graph_hook(True, runner, ext) is True, "not a decode pass: SGLang decides"


def test_record_lengths_replay_a_verify_batch_without_sglangs_host_lengths(seed, caplog):
    """``record_lengths`` (a draft that is never accepted): a TARGET_VERIFY batch that carries no
    ``seq_lens_cpu`` (SGLang's overlapped spec worker when no backend asks for it) replays on the
    prediction record's lengths; without the flag it cannot. Where SGLang's copy is there too the
    two are compared: a difference is logged, counted, SGLang's lengths decide, and the record's
    host mirror is dropped (no replay until it is rebuilt)."""
    from oasis_sglang.sglang_glue.attn_backend import OasisAttnBackend
    from oasis_sglang.sglang_glue.batch_info import host_lengths

    rtp = _pool()
    rt = rtp._oasis
    reqs = _reqs(rtp, 2)
    runner = _graph_runner(rtp)
    run_batch_hook(SimpleNamespace(req_to_token_pool=rtp), ScheduleBatch(reqs=reqs))
    _prefill(rtp, [1, 2], 20)                            # predicts context 21 for each row
    verify = lambda seq, cpu=True: _decode_batch([1, 2], seq, mode=ForwardMode.TARGET_VERIFY) if cpu else \
        _nocpu(_decode_batch([1, 2], seq, mode=ForwardMode.TARGET_VERIFY))  # noqa: E731
    assert can_run_graph_hook(True, runner, verify([20, 20], cpu=False)) is False, "flag off: no host lengths"
    backend = object.__new__(OasisAttnBackend)
    backend.runtime, backend.inner = rt, SimpleNamespace(needs_cpu_seq_lens=False)   # (SGLang's triton backend)
    assert backend.needs_cpu_seq_lens is True
    rt.record_lengths = True
    assert backend.needs_cpu_seq_lens is False           # what SGLang's scheduler reads at start-up
    backend.inner = SimpleNamespace()                    # a backend that does not say: SGLang's default, True
    assert backend.needs_cpu_seq_lens is True, "the wrapped backend still gets SGLang's copy when it asks"
    assert can_run_graph_hook(True, runner, verify([20, 20], cpu=False)) is True
    assert host_lengths(verify([20, 20], cpu=False), [1, 2], 1, rt) == [21, 21]
    assert host_lengths(verify([20, 20]), [1, 2], 1, rt) == [21, 21] and rt.length_mismatches == 0
    # a row the record knows nothing of: the host has no lengths for the batch
    assert host_lengths(_nocpu(_decode_batch([1, 3], [20, 20])), [1, 3], 1, rt) is None
    # SGLang's copy disagrees with the record: SGLang's lengths, counted and logged, mirror dropped
    with caplog.at_level("ERROR"):
        assert host_lengths(verify([21, 20]), [1, 2], 1, rt) == [22, 21]
    assert rt.length_mismatches == 1 and "differ from SGLang's for 1 of 2 rows" in caplog.text
    assert not rt.engine.record.trusted
    assert can_run_graph_hook(True, runner, verify([20, 20], cpu=False)) is False, "until the mirror is rebuilt"
    rt.engine.record.confirm()                           # (the next report rebuilds it from the device)
    assert can_run_graph_hook(True, runner, verify([20, 20], cpu=False)) is True
    assert host_lengths(verify([20, 20]), [1, None], 1, rt) == [21, 21], "a row without a number: SGLang's"
    short = verify([20, 20])
    short.seq_lens_cpu = torch.tensor([20])
    assert host_lengths(short, [1, 2], 1, rt) is None, "a copy shorter than the batch: neither source"
    from oasis_sglang.sglang_glue.batch_info import host_rows
    long_ = verify([20, 20])
    long_.seq_lens_cpu = torch.tensor([20, 20, 7])
    assert host_rows(long_, [1, 2], 1, rt) == (None, None), "an eager batch's copy of another length"
    assert rt.length_mismatches == 1


def _nocpu(fb):
    fb.seq_lens_cpu = None
    return fb


def test_can_run_graph_leaves_other_passes_and_the_draft_model_to_sglang(seed):
    rtp = _pool()
    reqs = _reqs(rtp, 2)
    fb = _decode_batch([1, 2], [9, 9], mode=ForwardMode.DRAFT_EXTEND_V2)
    assert rtp._oasis.batch_rows_host is None
    assert can_run_graph_hook(True, _graph_runner(rtp), fb) is True, "not a decode pass"
    fb = _decode_batch([1, 2], [9, 9])
    assert can_run_graph_hook(True, _graph_runner(rtp, draft=True), fb) is True, "the draft model's runner"
    assert can_run_graph_hook(True, _graph_runner(rtp), fb) is False
    assert len(reqs) == 2


def test_current_predictor_replays_any_batch_with_host_rows(seed):
    """``current`` selects inside the (captured) step: every batch whose rows are known may replay."""
    rtp = _pool(predictor="current")
    reqs = _reqs(rtp, 2)
    run_batch_hook(SimpleNamespace(req_to_token_pool=rtp), ScheduleBatch(reqs=reqs))
    assert can_run_graph_hook(True, _graph_runner(rtp), _decode_batch([1, 2], [7, 30])) is True
    rtp._oasis.batch_rows_host = None
    assert can_run_graph_hook(True, _graph_runner(rtp), _decode_batch([1, 2], [7, 30])) is False


def test_sglangs_patched_free_and_clear_call_the_hooks(seed):
    """Through SGLang's own ReqToTokenPool.free / clear once the plugin's hooks are applied
    (BEFORE free: the hook sees the request's row before SGLang clears it; AFTER clear)."""
    from oasis_sglang.sglang_glue import hooks

    hooks.check_plugin_ready()
    rtp = _pool()
    eng = rtp._oasis.engine
    a, b, c = _reqs(rtp, 3)
    _prefill(rtp, [1, 2, 3], 12)
    rtp.free(b)
    assert b.req_pool_idx is None and rtp.free_slots[-1] == 2
    assert int(eng.record.seq[2]) == -1 and (eng.ws.ids[:, 2] == -1).all()
    assert eng.record.seq[[1, 3]].tolist() == [13, 13] and (eng.ws.ids[:, [1, 3]] >= 0).any()
    rtp.clear()
    assert (eng.record.seq == -1).all() and (eng.ws.ids == -1).all() and rtp.free_slots == [1, 2, 3, 4]


def test_an_extend_batch_gives_the_engine_its_host_lengths_or_nothing():
    """``batch_info.extend_host`` on SGLang's own ForwardBatch: the scheduler's rows with
    ``extend_prefix_lens_cpu`` / ``extend_seq_lens_cpu`` when all three cover the batch
    (the engine then reads no length back: one host sync fewer per sparse layer and prefill)."""
    from oasis_sglang.sglang_glue.batch_info import extend_host

    def fb(pre, ext, B=2):
        return ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=B, input_ids=torch.zeros(1, dtype=torch.long),
                            req_pool_indices=torch.tensor([3, 1][:B]), seq_lens=torch.tensor([9, 5][:B]),
                            out_cache_loc=torch.zeros(1, dtype=torch.long), seq_lens_sum=14,
                            extend_prefix_lens_cpu=pre, extend_seq_lens_cpu=ext)

    assert extend_host(fb([4, 0], [5, 5]), [3, 1]) == ([3, 1], [4, 0], [5, 5])
    assert extend_host(fb([4, 0], [5, 5]), None) is None, "no scheduler rows"
    assert extend_host(fb(None, [5, 5]), [3, 1]) is None
    assert extend_host(fb([4, 0], [5, 5]), [3]) is None, "rows of another batch"
    assert extend_host(fb([4], [5], B=1), [3, 1]) is None
