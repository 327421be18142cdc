"""sglang_glue/log_line.py: the ``OasisKV decode:`` line written from a real engine's residency
report, its parsers, and when DecodeLog writes it."""

import logging

import pytest
import torch

from oasis_sglang.config import OasisConfig
from oasis_sglang.core import OasisSparseKV
from oasis_sglang.sglang_glue.log_line import (DecodeLog, format_residency, parse_decode_counters,
                                               parse_residency)

BS, H, HQ, D = 4, 2, 6, 16
LOGGER = "oasis_sglang.sglang_glue.log_line"


def _engine(predictor="previous", budget=16):
    cfg = OasisConfig(budget_tokens=budget, block_size=BS, dense_layers=(0,), predictor=predictor)
    return OasisSparseKV(cfg, 3, 256, 5, H, D, D, torch.float32, "cpu")


class Driver:
    """Prefill then decode requests through every sparse layer, as the attention backend does
    (``write_kv`` + ``extend_attention``; ``begin_decode_step`` + ``write_kv`` + ``decode_attention``)."""

    def __init__(self, eng, device="cpu"):
        self.eng, self.dev = eng, device
        self.rt = torch.zeros(5, 64, dtype=torch.int32, device=device)
        self.t = {}

    def prefill(self, rows, n):
        e, d, B = self.eng, self.dev, len(rows)
        r = torch.tensor(rows, device=d)
        for row in rows:                                   # each row its own 64 token slots (16 pages)
            self.rt[row, :] = torch.arange(64, dtype=torch.int32, device=d) + 64 * (row - 1)
            self.t[row] = n
        for l in e.sparse_layers:
            k, v = torch.randn(B * n, H, D, device=d), torch.randn(B * n, H, D, device=d)
            e.write_kv(l, self.rt[r, :n].reshape(-1).long(), k, v)
            e.extend_attention(l, torch.randn(B * n, HQ, D, device=d), r, torch.zeros(B, dtype=torch.long),
                               torch.full((B,), n), self.rt, None, k, v)

    def decode(self, rows):
        e, d, B = self.eng, self.dev, len(rows)
        r = torch.tensor(rows, device=d)
        pos = torch.tensor([self.t[x] for x in rows], device=d)
        seq = pos + 1
        e.begin_decode_step(r, seq, self.rt, max_seq_len=int(seq.max()), rows_host=rows, seq_lens_host=seq.tolist())
        for l in e.sparse_layers:
            k, v = torch.randn(B, H, D, device=d), torch.randn(B, H, D, device=d)
            e.write_kv(l, self.rt[r, pos].long(), k, v, decode=True)
            e.decode_attention(l, torch.randn(B, HQ, D, device=d), k, v, None)
        for x in rows:
            self.t[x] += 1


def test_the_line_of_a_real_report_round_trips_through_both_parsers(seed):
    eng = _engine(predictor="current")                 # fresh queries every step: blocks come and go
    run = Driver(eng)
    run.prefill([1, 2], 30)
    for _ in range(12):
        run.decode([1, 2])
    r = eng.residency()
    assert r["decode_steps"] == 12 and r["context_tokens"] == [42, 42] and r["admitted_blocks"] > 0
    line = format_residency(r)
    assert line.startswith("OasisKV decode: #running-req: 2, ")
    got = parse_decode_counters("[2025-01-01 00:00:00] " + line)
    hits, adm = r["hit_blocks"], r["admitted_blocks"]
    assert got == {"running": 2, "sparse_layers": 2, "hit_rate": round(hits / (hits + adm), 3), "admitted_blocks": adm,
                   "evicted_blocks": r["evicted_blocks"], "h2d_mib": round(r["bytes_h2d"] / 2**20, 1),
                   "host_tier_mib": round(r["host_tier_bytes"] / 2**20, 1), "decode_steps": 12, "graph_steps": 0,
                   "dense_steps": 0, "transfer_budget_mib": None}
    assert r["transfer_budget_bytes"] is None and "transfer budget" not in line, \
        "'auto' on the CPU: no link was measured, the budget is unlimited"
    res = parse_residency(line)
    assert res == {"context": [42, 42], "device": r["device_working_set_tokens"], "budget": 16}
    # 3 resident blocks of 4 tokens (sink, recent, one more) and the partial last block's 2 tokens
    assert res["device"] == [14, 14]
    assert "predictor: current" in line and "prediction check: host" in line and "agreement" not in line


def test_decode_counters_parse_the_line_the_backend_writes():
    """``parse_decode_counters`` (bench_oasis, run_demo) reads back every number
    ``format_residency`` writes, so a change of the log line cannot silently zero the figures."""
    from oasis_sglang.sglang_glue.log_line import parse_decode_counters

    r = {"context_tokens": [5000, 70], "device_working_set_tokens": [512, 70], "budget_tokens": 512,
         "sparse_layers": 28, "hit_blocks": 300, "admitted_blocks": 100, "evicted_blocks": 7, "bytes_h2d": 3 * 2**20,
         "working_set_bytes": 2**20, "summary_bytes": 2**20, "host_tier_bytes": 5 * 2**20, "predictor": "previous",
         "sync_steps": 0, "exposed_wait_ms": [0.0], "agreement": None, "decode_steps": 42, "graph_steps": 40}
    got = parse_decode_counters("[t] OasisKV decode: " + format_residency(r))
    assert got == {"running": 2, "sparse_layers": 28, "hit_rate": 0.75, "admitted_blocks": 100, "evicted_blocks": 7, "h2d_mib": 3.0,
                   "host_tier_mib": 5.0, "decode_steps": 42, "graph_steps": 40, "dense_steps": 0,
                   "transfer_budget_mib": None}


def test_optional_fields_of_the_line(seed):
    eng = _engine(predictor="previous")
    run = Driver(eng)
    run.prefill([3], 20)
    run.decode([3])
    r = eng.residency()
    assert r["exposed_wait_timed"] is False, "the exposed wait is timed on eager CUDA steps only"
    line = format_residency(r)
    assert "exposed wait: n/a (timed on eager CUDA steps only)" in line
    assert "agreement" not in line and "draft match" not in line
    r["agreement"] = [0.5, None, 1.0]
    r["draft_match"] = (3, 4)
    r["exposed_wait_timed"], r["exposed_wait_ms"] = True, [0.25, 0.5]
    line = format_residency(r)
    assert "exposed wait: 0.750 ms (last step, all sparse layers)" in line
    assert "agreement: 0.7500 (min layer 0.5000)" in line and line.endswith("draft match: 0.750 (3/4)")
    assert parse_residency(line)["context"] == [21]


@pytest.mark.parametrize("line", ["", "OasisKV decode: #running-req: 0", "Decode batch. #running-req: 3, #token: 40",
                                  "context tokens (host tier): [1, 2], device working set tokens per layer: [1, 2]"])
def test_parse_residency_refuses_a_line_that_is_not_one(line):
    with pytest.raises(ValueError, match="not an OasisKV decode line"):
        parse_residency(line)
    got = parse_decode_counters(line)
    assert got.pop("running") == (0 if line.startswith("OasisKV decode:") else None), "SGLang's own decode line is not ours"
    assert all(v is None for v in got.values())


def test_the_line_is_written_at_a_first_decode_step_and_every_interval(seed, caplog):
    eng = _engine()
    run = Driver(eng)
    updates = []

    class Sink:                                        # the metrics' side: what it is handed
        def update(self, r):
            updates.append(r["decode_steps"])

    log = DecodeLog(eng, interval=4, metrics=Sink(), draft_match=lambda: torch.tensor([1, 2]))
    caplog.set_level(logging.INFO, logger=LOGGER)

    def lines():
        return [r.getMessage() for r in caplog.records if r.name == LOGGER]

    run.prefill([1], 20)
    written = []
    for step in range(1, 11):
        if step == 6:
            run.prefill([2], 12)                        # a new request: its first decode step is step 6
        run.decode([1] + ([2] if step >= 6 else []))
        for _ in range(2):                              # asked twice for the same step: one line
            log.maybe_log()
        if len(lines()) > len(written):
            written.append(step)
    assert written == [1, 4, 6, 8]
    assert updates == written, "the metrics are updated from the same report, at the same steps"
    assert not log.due()
    assert parse_residency(lines()[0])["context"] == [21]
    assert parse_residency(lines()[2])["context"] == [26, 13]
    assert all(x.endswith("draft match: 0.500 (1/2)") for x in lines())
    assert [parse_decode_counters(x)["decode_steps"] for x in lines()] == [1, 4, 6, 8]


def test_interval_below_one_is_one(seed, caplog):
    eng = _engine()
    run = Driver(eng)
    log = DecodeLog(eng, interval=0)
    assert log.interval == 1
    caplog.set_level(logging.INFO, logger=LOGGER)
    run.prefill([1], 8)
    for _ in range(3):
        run.decode([1])
        log.maybe_log()
    assert len([r for r in caplog.records if r.name == LOGGER]) == 3


def test_no_line_is_due_before_the_first_decode_step(seed, caplog):
    """attn_backend's replay path calls ``maybe_log`` BEFORE ``begin_decode_step(mode="replay")``
    ("about the steps before this one"): on a fresh server whose first decode step is replayed
    from a CUDA graph there is no step before it, so no line (``#running-req: 0``, ``decode
    steps: 0``) may be written nor the metrics updated (a bug this test found, fixed)."""
    eng = _engine()
    Driver(eng).prefill([1], 20)
    log = DecodeLog(eng, interval=4)
    caplog.set_level(logging.INFO, logger=LOGGER)
    log.maybe_log()
    assert not [r for r in caplog.records if r.name == LOGGER], caplog.text


def test_garbled_numbers_are_not_read_as_figures():
    """A malformed number is missing (None), never a wrong figure or a crash; non-text is a TypeError."""
    assert parse_decode_counters("OasisKV decode: #running-req: 2, hit rate: 1.2.3, admitted blocks: 5")["hit_rate"] is None
    assert parse_decode_counters("OasisKV decode: hit rate: ., H2D: 1.2.3 MiB")["h2d_mib"] is None
    with pytest.raises(ValueError, match="not an OasisKV decode line"):
        parse_residency("context tokens (host tier): [1, x], device working set tokens per layer and KV head: "
                        "[1] (budget 4)")
    with pytest.raises(TypeError, match="str"):
        parse_decode_counters(b"OasisKV decode: hit rate: 0.5")
    with pytest.raises(ValueError, match="not an OasisKV decode line"):
        parse_residency(None)


def test_a_sized_step_budget_is_on_the_line_and_a_fraction_follows_the_step_time(seed):
    """A fixed budget (bytes) is on the line from the start; a link fraction is sized at each
    line from the measured step time (here a link rate set by hand: the CPU has no link)."""
    cfg = OasisConfig(budget_tokens=16, block_size=BS, dense_layers=(0,), predictor="previous",
                      transfer_budget=3 * 2**20)
    eng = OasisSparseKV(cfg, 3, 256, 5, H, D, D, torch.float32, "cpu")
    per_layer = 3 * 2**20 // (2 * eng.block_bytes)
    assert int(eng.budget.blocks) == per_layer and eng.budget.bytes_per_step == per_layer * 2 * eng.block_bytes
    run = Driver(eng)
    run.prefill([1, 2], 30)
    run.decode([1, 2])
    line = format_residency(eng.residency())
    assert parse_decode_counters(line)["transfer_budget_mib"] == round(eng.budget.bytes_per_step / 2**20, 1)
    cfg = OasisConfig(budget_tokens=16, block_size=BS, dense_layers=(0,), predictor="previous", transfer_budget=0.5)
    eng = OasisSparseKV(cfg, 3, 256, 5, H, D, D, torch.float32, "cpu")
    log = DecodeLog(eng, interval=1)
    eng.budget.set_link_rate(1e9)                       # 1 GB/s
    run = Driver(eng)
    run.prefill([1, 2], 30)
    for _ in range(3):
        run.decode([1, 2])
        log.maybe_log()
    st = eng.budget.step_s
    assert st is not None and st > 0
    hi, lo = (int(0.5 * 1e9 * st * share // (2 * eng.block_bytes)) for share in (1.0, 0.25))
    assert lo <= int(eng.budget.blocks) <= hi, \
        "0.5 x link rate x (the step time measured between the lines less its copies' link time)"


def test_an_interval_spanning_a_prefill_cannot_raise_the_step_time(seed, monkeypatch):
    """The line at a request's first decode step follows its prefill: that interval's time per
    decode step is no decode step time, so it may only lower the sized step time."""
    import oasis_sglang.sglang_glue.log_line as ll

    cfg = OasisConfig(budget_tokens=16, block_size=BS, dense_layers=(0,), predictor="previous", transfer_budget=0.5)
    eng = OasisSparseKV(cfg, 3, 256, 5, H, D, D, torch.float32, "cpu")
    eng.budget.set_link_rate(1e9)
    log = DecodeLog(eng, interval=1)
    clock = [100.0]
    monkeypatch.setattr(ll.time, "perf_counter", lambda: clock[0])
    run = Driver(eng)
    run.prefill([1, 2], 30)

    def step(seconds, new_request=False):
        clock[0] += seconds
        run.decode([1, 2])
        eng.stats.new_request_started = new_request
        log.maybe_log()

    step(0.0)                                   # the first line only marks the time
    step(0.010)
    assert eng.budget.step_s == pytest.approx(0.010)
    step(5.0, new_request=True)                 # an interval with a prefill in it
    assert eng.budget.step_s == pytest.approx(0.010), "a prefill's time is not a decode step's"
    step(0.004, new_request=True)
    assert eng.budget.step_s == pytest.approx(0.004), "lower is taken (the prefill only inflates)"
    step(0.020)
    assert eng.budget.step_s == pytest.approx(0.020), "a plain interval moves it either way"


def test_a_quiet_rank_writes_nothing_but_still_sizes_its_budget(seed, caplog):
    """TP ranks other than 0 (``emit=False``): no line, no metrics update, the budget resized as on rank 0."""
    class Sink:
        def update(self, r):
            raise AssertionError("a quiet rank updated the metrics")

    cfg = OasisConfig(budget_tokens=16, block_size=BS, dense_layers=(0,), predictor="previous", transfer_budget=0.5)
    eng = OasisSparseKV(cfg, 3, 256, 5, H, D, D, torch.float32, "cpu")
    eng.budget.set_link_rate(1e9)
    log = DecodeLog(eng, interval=1, metrics=Sink(), emit=False)
    caplog.set_level(logging.INFO, logger=LOGGER)
    run = Driver(eng)
    run.prefill([1, 2], 30)
    for _ in range(3):
        run.decode([1, 2])
        log.maybe_log()
    assert not [r for r in caplog.records if r.name == LOGGER]
    assert eng.budget.step_s is not None and eng.budget.step_s > 0 and log._logged_step == eng.stats.decode_steps


def test_the_line_interval_is_sglangs_unless_the_benchmark_variable_sets_it(monkeypatch):
    """``OASIS_DECODE_LOG_INTERVAL`` (benchmarks) overrides SGLang's ``--decode-log-interval``;
    a bad value stops the start-up naming the variable."""
    from oasis_sglang.config import OasisConfigError
    from oasis_sglang.sglang_glue.log_line import log_interval

    monkeypatch.delenv("OASIS_DECODE_LOG_INTERVAL", raising=False)
    assert log_interval(10) == 10 and log_interval(None) == 40
    monkeypatch.setenv("OASIS_DECODE_LOG_INTERVAL", "1000")
    assert log_interval(10) == 1000
    for bad in ("0", "-3", "ten", "2.5"):
        monkeypatch.setenv("OASIS_DECODE_LOG_INTERVAL", bad)
        with pytest.raises(OasisConfigError, match=f"OASIS_DECODE_LOG_INTERVAL='{bad}'"):
            log_interval(10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the report's copy is asynchronous only on CUDA")
@pytest.mark.gpu
def test_a_due_line_is_written_when_its_copy_lands_and_never_waits(seed, caplog):
    """On CUDA a due line queues its copy and returns (the GPU still has ~0.2 s of work queued);
    it is written by a later call once the copy has landed, about the step it was due at."""
    import time

    cfg = OasisConfig(budget_tokens=16, block_size=BS, dense_layers=(0,), predictor="previous")
    eng = OasisSparseKV(cfg, 3, 256, 5, H, D, D, torch.float32, "cuda")
    run = Driver(eng, "cuda")
    caplog.set_level(logging.INFO, logger=LOGGER)
    log = DecodeLog(eng, interval=1)

    def lines():
        return [r.getMessage() for r in caplog.records if r.name == LOGGER]

    run.prefill([1], 20)
    run.decode([1])
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)
    t = time.perf_counter()
    log.maybe_log()
    assert time.perf_counter() - t < 0.05 and not lines(), "the line waited for the device"
    assert log.pending() == 1                      # what the idle hook (on_idle_hook) writes
    torch.cuda.synchronize()
    assert log.poll() == 1 and log.pending() == 0
    assert parse_decode_counters(lines()[0])["decode_steps"] == 1
    assert parse_residency(lines()[0])["context"] == [21]
