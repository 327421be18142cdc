"""oasis_sglang/bench/serving.py (scripts/bench_oasis.py): planning and parsing (the GPU runs themselves are in docs/benchmarks.md)."""

import sys
from pathlib import Path

import pytest

from oasis_sglang.sglang_glue.log_line import format_residency



@pytest.fixture(scope="module")
def bench():
    from oasis_sglang.bench import serving

    return serving


def _args(bench, *argv):
    import argparse

    return argparse.Namespace(systems=None, input_len=16384, input_lens=None, output_len=256, batch=8, dense_batch=32,
                           host_gib=72.0, budget=2048, fetch_cap=None, fetch_caps=[1, 2, 4, 8, 16],
                           predictor="previous", eager=False, churn=None, kv_dtype="auto", transfer_budget="auto")


def test_all_plans_the_measurements_once(bench):
    a = _args(bench)
    keys = [r.key for r in bench.plan("all", a)]
    assert len(keys) == len(set(keys))
    for prefix in ("throughput/16384/", "throughput/32768/", "context/4096/", "context/8192/",
                   "short/1024/", "stall/16384/"):
        assert any(k.startswith(prefix) for k in keys), prefix
    assert not any(k.startswith("fetch-cap/") for k in keys), "the fetch-cap ablation is its own suite"
    assert not any(k.startswith("context/16384") for k in keys), "the 16K point is the throughput run"
    runs = {r.key: r for r in bench.plan("all", a)}
    d, o = runs["throughput/16384/dense"], runs["throughput/16384/oasis"]
    assert d.pool == "80gb" and o.pool == "exact"
    assert o.batch == o.host_requests == bench.host_requests_for(16384 + 256 + 64, 72.0) == 33
    assert "--mem-fraction-static" in bench.system_args(d, a) and "--kv-sparse" in bench.system_args(o, a)
    s = bench.system_args(runs["short/1024/oasis"], a)
    assert int(s[s.index("--context-length") + 1]) >= 2048, "oasis refuses a budget above the context length"


def test_the_host_tier_is_sized_by_the_sparse_layers_the_server_keeps_there(bench):
    """The benchmark's request count per --host-gib charges what the server's host tier holds
    per token (``OasisSparseKV.token_capacity``'s ``host_cell``: the 34 sparse layers of 36), so
    96 GiB holds 44 requests of 16K (40 when all 36 layers were charged)."""
    from oasis_sglang.config import OasisConfig
    from oasis_sglang.core.engine import OasisSparseKV

    cap = OasisSparseKV.token_capacity(OasisConfig(), device_bytes=40 * 2**30, dense_cell_bytes=36 * 4096,
                                       host_bytes=96 * 2**30, num_layers=36, num_rows=45, head_num=8, head_dim=128,
                                       v_head_dim=128, dtype_bytes=2)
    assert bench.tier_bytes_per_token() == cap["host_cell"] == 34 * 4096
    assert bench.tier_bytes_per_token("fp8_e5m2") == 34 * 2048
    assert bench.host_requests_for(16384 + 256 + 64, 96.0) == 44
    assert bench.host_requests_for(32768 + 256 + 64, 96.0) == 22
    assert bench.host_requests_for(16704, 96.0) * 16704 <= cap["tokens"], "the server's tier holds what the bench sends"
    with pytest.raises(ValueError, match="--host-gib"):
        bench.host_requests_for(16704, 1.0)


def test_oasis_figures_from_real_log_lines(bench):
    def line(steps, h2d_blocks):
        r = {"context_tokens": [100] * 4, "device_working_set_tokens": [64] * 4, "budget_tokens": 2048,
             "sparse_layers": 34, "hit_blocks": 900, "admitted_blocks": h2d_blocks, "evicted_blocks": 0, "bytes_h2d": h2d_blocks * 4096,
             "working_set_bytes": 0, "summary_bytes": 0, "host_tier_bytes": 2**30, "predictor": "previous",
             "sync_steps": 0, "exposed_wait_ms": [0.0], "agreement": None, "decode_steps": steps, "graph_steps": steps,
             "dense_steps": steps // 2}
        return "[t] OasisKV decode: " + format_residency(r)

    f = bench.oasis_figures([line(10, 1000), line(60, 51000)], step_ms=20.0)
    assert f["h2d_mb_per_step"] == pytest.approx(50000 * 4096 / 1e6 / 50, rel=1e-3)   # the line rounds MiB
    assert f["h2d_gb_s"] == pytest.approx(f["h2d_mb_per_step"] / 20.0)
    assert f["graph_steps"] == 60 and f["decode_steps"] == 60 and f["dense_steps"] == 30 and f["host_tier_gb"] == pytest.approx(2**30 / 1e9)
    assert f["h2d_basis"] == "all steps" and "admitted_per_head_step" not in f, "no most-running count given"
    assert bench.oasis_figures([], 1.0) == {}


def test_oasis_traffic_is_taken_at_the_most_running(bench):
    """Issue 17: H2D per step and admitted pieces per (request, layer, KV head) come from the
    counter deltas between lines about steps at the most running, not from an average over the
    ramp-up and the tail (where fewer requests admit less)."""
    def line(running, steps, admitted):
        r = {"context_tokens": [100] * running, "device_working_set_tokens": [64] * running, "budget_tokens": 2048,
             "sparse_layers": 34, "hit_blocks": 0, "admitted_blocks": admitted, "evicted_blocks": 0,
             "bytes_h2d": admitted * 65536, "working_set_bytes": 0, "summary_bytes": 0, "host_tier_bytes": 2**30,
             "predictor": "previous", "sync_steps": 0, "exposed_wait_ms": [0.0], "agreement": None,
             "decode_steps": steps, "graph_steps": steps}
        return "[t] OasisKV decode: " + format_residency(r)

    per_step = 40 * 34 * 8 * 8                     # 40 requests x 34 layers x 8 KV heads x 8 pieces
    lines = [line(1, 1, 100), line(20, 5, 5000),    # ramp-up: few requests, few admissions
             line(40, 10, 10_000), line(40, 20, 10_000 + 10 * per_step), line(40, 30, 10_000 + 20 * per_step),
             line(3, 200, 10_000 + 21 * per_step)]  # the tail
    f = bench.oasis_figures(lines, step_ms=20.0, max_running=40, kv_heads=8)
    assert f["h2d_basis"] == "most running" and f["h2d_steps"] == 20
    assert f["admitted_per_head_step"] == pytest.approx(8.0)
    assert f["h2d_mb_per_step"] == pytest.approx(per_step * 65536 / 1e6, rel=1e-3)
    assert f["h2d_gb_s"] == pytest.approx(f["h2d_mb_per_step"] / 20.0)
    whole = bench.oasis_figures(lines, step_ms=20.0)            # the old all-steps average reads far less
    assert whole["h2d_basis"] == "all steps" and whole["h2d_mb_per_step"] < f["h2d_mb_per_step"] / 5


def test_kv_heads_of_reads_the_model_config(bench, tmp_path):
    (tmp_path / "config.json").write_text('{"num_key_value_heads": 8, "num_attention_heads": 32}')
    assert bench.kv_heads_of(tmp_path) == 8
    (tmp_path / "config.json").write_text('{"num_attention_heads": 12}')
    assert bench.kv_heads_of(tmp_path) == 12
    (tmp_path / "config.json").write_text('not json')
    assert bench.kv_heads_of(tmp_path) is None and bench.kv_heads_of(tmp_path / "missing") is None


def test_tables_compare_oasis_with_dense_of_the_same_run(bench):
    a = _args(bench)
    res = [{"key": "throughput/16384/dense", "system": "dense", "decode_tok_s": 1000.0, "max_running": 22},
           {"key": "throughput/16384/oasis", "system": "oasis", "decode_tok_s": 3100.0, "max_running": 31},
           {"key": "fetch-cap/4", "system": "oasis", "error": "start failed: boom"}]
    md = bench.tables(res, a)
    assert "| throughput/16384/oasis | 31 | 3100.0 |" in md and "3.10x" in md
    assert "fetch-cap/4 | failed: start failed: boom" in md


def test_oasis_runs_name_their_fetch_cap(bench):
    from oasis_sglang.config import OasisConfig

    a = _args(bench)
    default = OasisConfig().fetch_cap
    o = {r.key: r for r in bench.plan("all", a)}["throughput/16384/oasis"]
    assert o.fetch_cap == default
    assert f'"fetch_cap": {default}' in " ".join(bench.system_args(o, a)), "the run names its cap"
    assert [r.key for r in bench.plan("fetch-cap", a)] == [f"fetch-cap/{c}" for c in (1, 2, 4, 8, 16)]


def test_the_long_runs_of_a_system_share_one_server_sized_for_all_of_them(bench):
    a = _args(bench)
    runs = bench.plan("all", a)
    groups = bench.server_groups(runs)
    keys = [[r.key for r in g] for g in groups]
    assert keys[0] == ["throughput/16384/dense", "throughput/32768/dense", "context/4096/dense", "context/8192/dense"]
    assert keys[1] == ["throughput/16384/oasis", "throughput/32768/oasis", "context/4096/oasis", "context/8192/oasis"]
    assert keys[2:] == [["short/1024/dense"], ["short/1024/oasis"], ["stall/16384/oasis-no-transfer"]], \
        "other pools, and the ablation's environment, get a server each"
    assert sum(len(g) for g in groups) == len(runs)
    assert [len(g) for g in bench.server_groups(runs, share=False)] == [1] * len(runs)
    oasis = groups[1]
    args = bench.group_args(oasis, a)
    val = lambda flag: int(args[args.index(flag) + 1])  # noqa: E731
    assert val("--context-length") == 32768 + 256 + 64, "the longest context"
    assert val("--max-running-requests") == max(r.batch for r in oasis) == oasis[2].batch, "the 4K run's count"
    assert val("--cuda-graph-max-bs") == oasis[2].batch
    assert val("--max-total-tokens") == max(r.host_requests * (r.input_len + 320) for r in oasis)
    for r in oasis:
        assert val("--max-total-tokens") >= r.host_requests * (r.input_len + 320), r.key
        alone = bench.system_args(r, a)
        assert [x for x in alone if x.startswith("{")] == [x for x in args if x.startswith("{")], "the same config"
    dense = bench.group_args(groups[0], a)
    assert "--mem-fraction-static" in dense and "--max-total-tokens" not in dense, "dense keeps the 80 GB pool"


class _FakeServer:
    """What run_one reads of a server: its log (growing) and stop()."""

    def __init__(self):
        self.text, self.stopped, self.url = "warm-up\n", False, "http://127.0.0.1:1"

    def log(self):
        return self.text

    def stop(self):
        self.stopped = True


def test_a_shared_server_serves_its_runs_and_each_reads_only_its_own_log(bench, monkeypatch, tmp_path):
    """run_one on a shared server: the figures come from the log written during that run only."""
    started = []

    def fake_start(args, log_path, a, ablate=False, churn=None):
        started.append((log_path.name, args))
        return _FakeServer()

    def fake_bench(url, run, out, timeout):
        srv = started_srv[0]
        n, tok = run.batch, {4096: 4000.0, 8192: 2000.0, 16384: 1000.0, 32768: 500.0}[run.input_len]
        line = "[x] Decode batch, #running-req: {}, gen throughput (token/s): {}\n"
        srv.text += line.format(n, 1.0) + line.format(n, tok) * 3
        return {"output_tok_s": 1.0}

    started_srv = []
    monkeypatch.setattr(bench, "start_server", lambda *x, **k: started_srv.append(fake_start(*x, **k)) or started_srv[-1])
    monkeypatch.setattr(bench, "bench_serving", fake_bench)
    monkeypatch.setenv("M", str(Path(__file__).parent))
    monkeypatch.setattr(bench, "kv_heads_of", lambda m: 8)
    assert _main(bench, monkeypatch, "--suite", "context", "--systems", "dense", "--out", str(tmp_path)) == 0
    assert len(started) == 1 and started[0][0] == "server_dense_80gb_shared.log"
    import json

    rows = {r["key"]: r for r in json.loads((tmp_path / "bench_oasis.json").read_text())["results"]}
    assert {k: r["decode_tok_s"] for k, r in rows.items()} == {
        "context/4096/dense": 4000.0, "context/8192/dense": 2000.0, "context/16384/dense": 1000.0,
        "context/32768/dense": 500.0}, "each run's median of its own lines"
    assert rows["context/4096/dense"]["start_s"] is not None and all(r["shared_server"] for r in rows.values())
    assert started_srv[0].stopped


def test_a_shared_server_that_fails_to_start_fails_each_of_its_runs(bench, monkeypatch, tmp_path):
    def boom(*x, **k):
        raise RuntimeError("no GPU")

    monkeypatch.setattr(bench, "start_server", boom)
    monkeypatch.setenv("M", str(Path(__file__).parent))
    assert _main(bench, monkeypatch, "--suite", "context", "--systems", "dense", "--out", str(tmp_path)) == 1
    md = (tmp_path / "bench_oasis.md").read_text()
    assert md.count("start failed: RuntimeError: no GPU") == 4


def test_shared_runs_appear_in_the_fetch_cap_and_context_tables(bench):
    a = _args(bench)
    res = [{"key": "throughput/16384/dense", "system": "dense", "input_len": 16384, "fetch_cap": None,
            "decode_tok_s": 1000.0, "max_running": 22},
           {"key": "throughput/16384/oasis", "system": "oasis", "input_len": 16384, "fetch_cap": 8,
            "decode_tok_s": 1700.0, "max_running": 41},
           {"key": "fetch-cap/2", "system": "oasis", "input_len": 16384, "fetch_cap": 2,
            "decode_tok_s": 2000.0, "max_running": 41},
           {"key": "context/4096/dense", "system": "dense", "input_len": 4096, "fetch_cap": None,
            "decode_tok_s": 3000.0, "max_running": 83}]
    fc = bench.suite_rows(res, "fetch-cap")
    assert [r["fetch_cap"] for r in fc] == [2, 8]
    ctx = bench.suite_rows(res, "context")
    assert [(r["input_len"], r["system"]) for r in ctx] == [(4096, "dense"), (16384, "dense"), (16384, "oasis")]
    md = bench.tables(res, a)
    fc_md = md.split("### fetch-cap")[1].split("###")[0]
    assert "| fetch-cap/2 | 41 | 2000.0 |" in fc_md and "2.00x" in fc_md, "fetch-cap rows compare with 16K dense"
    assert "| throughput/16384/oasis (cap 8) | 41 | 1700.0 |" in fc_md


def _fake_runs(bench, monkeypatch, fail=(), seconds=0.0):
    """bench.run_one replaced by a recorder (the server runs need a GPU); returns the call list."""
    import time as _t

    calls = []

    def fake(run, a, out, srv=None):
        calls.append(run.key)
        _t.sleep(seconds)
        base = {f: getattr(run, f) for f in bench.RUN_FIELDS} | {"key": run.key}
        if run.key in fail:
            return base | {"error": "start failed: boom\nTraceback | pipe"}
        return base | {"decode_tok_s": 100.0, "max_running": run.batch}

    monkeypatch.setattr(bench, "run_one", fake)
    monkeypatch.setattr(bench, "start_server", lambda *x, **k: _FakeServer())   # shared servers: faked too
    monkeypatch.setenv("M", str(Path(__file__).parent))     # a folder: the runs are faked
    return calls


def _main(bench, monkeypatch, *argv):
    monkeypatch.setattr(sys, "argv", ["bench_oasis.py", *argv])
    return bench.main()


def test_resume_skips_matching_runs_and_remeasures_changed_ones(bench, monkeypatch, tmp_path, capsys):
    import json

    calls = _fake_runs(bench, monkeypatch)
    out = str(tmp_path)
    assert _main(bench, monkeypatch, "--suite", "short", "--out", out) == 0
    assert calls == ["short/1024/dense", "short/1024/oasis"]
    assert _main(bench, monkeypatch, "--suite", "short", "--out", out, "--resume") == 0
    assert calls == ["short/1024/dense", "short/1024/oasis"], "both stored runs match the plan"
    assert _main(bench, monkeypatch, "--suite", "short", "--out", out, "--resume", "--batch", "4") == 0
    assert calls[2:] == ["short/1024/dense", "short/1024/oasis"]
    assert "measured with other settings" in capsys.readouterr().err
    rows = json.loads((tmp_path / "bench_oasis.json").read_text())["results"]
    assert sorted(r["batch"] for r in rows) == [4, 4]


def test_deadline_leaves_runs_with_exit_3_and_errors_stay_in_one_table_row(bench, monkeypatch, tmp_path):
    calls = _fake_runs(bench, monkeypatch, fail={"fetch-cap/1"}, seconds=1.0)
    out = str(tmp_path)
    rc = _main(bench, monkeypatch, "--suite", "fetch-cap", "--fetch-caps", "1", "2", "2", "4", "--out", out,
               "--deadline", "2.5", "--run-estimate", "0.2")
    # 1 s runs: the second starts at 1 (its estimate, 1 s, fits 2.5), the third would end at 3
    assert rc == 3 and calls == ["fetch-cap/1", "fetch-cap/2"], calls
    md = (tmp_path / "bench_oasis.md").read_text()
    row = [ln for ln in md.splitlines() if ln.startswith("| fetch-cap/1 ")]
    assert len(row) == 1 and "boom Traceback / pipe" in row[0]
    # the rest, then a later call of another suite: the stored failure is not its concern
    assert _main(bench, monkeypatch, "--suite", "fetch-cap", "--fetch-caps", "2", "4", "--out", out, "--resume") == 0
    assert calls.count("fetch-cap/2") == 1 and calls[-1] == "fetch-cap/4", "a repeated --fetch-caps value is one run"
    assert _main(bench, monkeypatch, "--suite", "fetch-cap", "--fetch-caps", "1", "--out", out, "--resume") == 1


@pytest.mark.parametrize("argv,msg", [(["--plot-only"], "no results"), (["--deadline", "nan"], "finite"),
                                      (["--deadline", "100"], "no run would start"),
                                      (["--fetch-caps", "0"], "positive integer"),
                                      (["--host-gib", "nan"], "--host-gib"), (["--host-gib", "0.5"], "holds no request"),
                                      (["--budget", "100"], "budget_tokens"), (["--fetch-cap", "0"], "--fetch-cap"),
                                      (["--batch", "0"], "--batch"), (["--input-len", "-5"], "--input-len"),
                                      (["--output-len", "0"], "--output-len"), (["--timeout", "-1"], "--timeout")])
def test_bad_arguments_are_refused_with_the_option_named(bench, monkeypatch, tmp_path, capsys, argv, msg):
    _fake_runs(bench, monkeypatch)
    with pytest.raises(SystemExit) as e:
        _main(bench, monkeypatch, "--out", str(tmp_path / "x"), *argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_a_malformed_results_file_is_one_clear_line(bench, monkeypatch, tmp_path):
    (tmp_path / "bench_oasis.json").write_text('{"results": [{"key": "short/1024/dense"}]}')
    with pytest.raises(SystemExit, match="not a bench_oasis results file"):
        _main(bench, monkeypatch, "--plot-only", "--out", str(tmp_path))
    (tmp_path / "bench_oasis.json").write_text(
        '{"results": [{"key": "short/1024/dense", "system": "dense", "decode_tok_s": "fast"}]}')
    with pytest.raises(SystemExit, match="short/1024/dense: decode_tok_s is 'fast'"):
        _main(bench, monkeypatch, "--plot-only", "--out", str(tmp_path))


def test_a_model_variable_that_is_not_a_folder_is_refused(bench, monkeypatch, tmp_path, capsys):
    _fake_runs(bench, monkeypatch)
    monkeypatch.setenv("M", str(tmp_path / "no-such-model"))
    with pytest.raises(SystemExit) as e:
        _main(bench, monkeypatch, "--suite", "short", "--resume", "--out", str(tmp_path / "x"))
    assert e.value.code == 2 and "M=" in capsys.readouterr().err


def test_steady_running_waits_for_the_decode_phase(bench):
    line = "[x] Decode batch, #running-req: {}, #token: 1, token usage: 0.1, gen throughput (token/s): 100.0, #queue-req: 0"
    log = "\n".join(line.format(n) for n in (3, 8, 8))
    assert bench.steady_running(log) is None                     # two lines at 8: not yet
    assert bench.steady_running(log + "\n" + line.format(8)) == 8
    assert bench.steady_running(log + "\n" + "\n".join(line.format(5) for _ in range(3))) is None   # past the peak
    # bench_serving's warm-up request runs alone first (the 4K profile of 2026-12-04 caught it)
    warm = "\n".join(line.format(1) for _ in range(6))
    assert bench.steady_running(warm) == 1 and bench.steady_running(warm, min_running=2) is None
    assert bench.steady_running(warm + "\n" + "\n".join(line.format(158) for _ in range(3)), min_running=2) == 158


def _trace(tmp_path, events, gz=True):
    import gzip
    import json

    p = tmp_path / ("t.trace.json.gz" if gz else "t.json")
    data = json.dumps({"traceEvents": events})
    if gz:
        with gzip.open(p, "wt") as f:
            f.write(data)
    else:
        p.write_text(data)
    return p


def test_profile_trace_splits_device_time(tmp_path):
    """Busy time is the union over streams; idle is the rest of the window; kernels go to their
    groups (SGLang's _fwd_* decode attention is not OasisKV's _stage1); CPU events are ignored."""
    from oasis_sglang.bench import profile_trace as pt

    k = lambda name, stream, ts, dur: {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,  # noqa: E731
                                       "args": {"stream": stream}}
    ev = [k("nvjet_tst_128x64", 7, 0, 400), k("_fwd_grouped_kernel_stage1", 7, 400, 100),
          k("_stage1", 7, 600, 100), k("_score_kernel", 20, 450, 200),          # overlaps the compute stream
          k("_copy_rows_kernel", 21, 900, 100),                                  # idle from 700 to 900
          k("void at::native::reduce_kernel<512, 1, or>", 21, 950, 30), k("void at::native::reduce_kernel<512, 1, or>", 21, 990, 10),
          k("my_kernel", 21, 985, 4),
          {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000},
          {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 1000, "dur": 0, "args": {"stream": 7}}]
    s = pt.summarize(pt.load_gpu_events(_trace(tmp_path, ev)), steps=2)
    assert s["kernels"] == 9
    assert s["window_ms"] == pytest.approx(1.0 / 2)                # 0 .. 1000 us over 2 steps
    assert s["busy_ms"] == pytest.approx(0.8 / 2)                  # [0, 700) and [900, 1000)
    assert s["idle_ms"] == pytest.approx(0.2 / 2) and s["busy_frac"] == pytest.approx(0.8)
    g = s["groups_ms"]
    assert g["GEMMs"] == pytest.approx(0.2) and g["dense attention (SGLang)"] == pytest.approx(0.05)
    assert g["sparse attention"] == pytest.approx(0.05) and g["scoring"] == pytest.approx(0.1)
    assert g["H2D copy"] == pytest.approx(0.05)
    assert s["streams_ms"]["7"] == pytest.approx(0.3)
    # what each stream carried, the most time first
    assert list(s["stream_groups_ms"]["7"])[:3] == ["GEMMs", "dense attention (SGLang)", "sparse attention"]
    assert s["stream_groups_ms"]["21"]["H2D copy"] == pytest.approx(0.05)
    assert s["stream_groups_ms"]["20"] == {"scoring": pytest.approx(0.1)}
    assert "| 7 | 0.300 | GEMMs 0.200, dense attention (SGLang) 0.050, sparse attention 0.050, memcpy / memset 0.000 |" in pt.markdown(s)
    assert "| scoring | 0.100 |" in pt.markdown(s)
    # group "other", kernel by kernel, the most time first
    assert list(s["other_top_ms"].items()) == [("void at::native::reduce_kernel<512, 1, or>", pytest.approx(0.02)),
                                               ("my_kernel", pytest.approx(0.002))]
    assert g["other"] == pytest.approx(0.022)
    assert "| `void at::native::reduce_kernel<512, 1, or>` | 0.020 |" in pt.markdown(s)


def test_profile_trace_attributes_the_compute_streams_gaps(tmp_path):
    """The compute stream (the most GEMM time, though a copy stream has more kernel time) and its
    idle time: gaps under 20 us are launch spacing, longer ones are put on the kernels around them
    and the other stream's kernel that ended last inside the gap; overlapping records of the
    stream (a short one inside a long one) open no gap."""
    from oasis_sglang.bench import profile_trace as pt

    k = lambda name, stream, ts, dur: {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,  # noqa: E731
                                       "args": {"stream": stream}}
    ev = [k("gemm", 7, 0, 100), k("attn", 7, 105, 100),               # 5 us: spacing
          k("tiny", 7, 110, 10),                                        # inside attn: no gap after it
          k("_copy_rows_kernel", 9, 150, 200),                          # ends at 350, inside the next gap
          k("_copy_rows_kernel", 9, 400, 500),                          # stream 9: the most kernel time
          k("_plan_kernel", 8, 100, 150),                               # ends at 250, before the copy
          k("gemm", 7, 351, 100),                                       # gap 205 .. 351: the copy released it
          k("norm", 7, 600, 50)]                                        # gap 451 .. 600: nothing ended in it
    g = pt.summarize(pt.load_gpu_events(_trace(tmp_path, ev)), steps=1)["gaps"]
    assert g["stream"] == "7"
    assert g["short_gap_ms"] == pytest.approx(0.005)
    assert g["gap_ms"] == pytest.approx(0.005 + 0.146 + 0.149)
    assert g["long_gaps"] == 2
    assert g["top"][0][:3] == ("gemm", "norm", "(none: launch or host)") and g["top"][0][3] == pytest.approx(0.149)
    assert g["top"][1][:3] == ("attn", "gemm", "_copy_rows_kernel") and g["top"][1][3] == pytest.approx(0.146)
    md = pt.markdown(pt.summarize(pt.load_gpu_events(_trace(tmp_path, ev)), steps=1))
    assert "| `attn` | `gemm` | `_copy_rows_kernel` | 0.146 | 1.0 |" in md


def test_profile_trace_writes_a_timeline_of_every_gpu_event(tmp_path):
    """--timeline: one CSV row per GPU event, by start, times from the first start, gzip for .gz;
    CPU events are left out."""
    import csv
    import gzip
    from oasis_sglang.bench import profile_trace as pt

    k = lambda name, stream, ts, dur: {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,  # noqa: E731
                                       "args": {"stream": stream}}
    ev = [k("_copy_rows_kernel", 9, 1150, 200), k("nvjet_gemm", 7, 1000, 100),
          {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000}]
    tr = _trace(tmp_path, ev)
    assert pt.main([str(tr), "--steps", "1", "--timeline", str(tmp_path / "t.csv.gz")]) == 0
    rows = list(csv.reader(gzip.decompress((tmp_path / "t.csv.gz").read_bytes()).decode().splitlines()))
    assert rows == [["start_us", "dur_us", "stream", "group", "name"],
                    ["0.000", "100.000", "7", "GEMMs", "nvjet_gemm"],
                    ["150.000", "200.000", "9", "H2D copy", "_copy_rows_kernel"]]
    assert pt.write_timeline(pt.load_gpu_events(tr), tmp_path / "t.csv") == 2
    assert (tmp_path / "t.csv").read_text().splitlines()[1].startswith("0.000,100.000,7,GEMMs")
    with pytest.raises(ValueError, match="no GPU events"):
        pt.write_timeline([], tmp_path / "e.csv")


def test_profile_trace_rejects_what_it_cannot_read(tmp_path, capsys):
    from oasis_sglang.bench import profile_trace as pt

    with pytest.raises(ValueError, match="no GPU kernels"):
        pt.summarize(pt.load_gpu_events(_trace(tmp_path, [{"ph": "X", "cat": "cpu_op", "name": "a", "ts": 0, "dur": 1}])), 1)
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2")
    assert pt.main([str(bad), "--steps", "1"]) == 2
    assert "not JSON" in capsys.readouterr().err
    with pytest.raises(ValueError, match="steps"):
        pt.summarize([("k", 1, 0.0, 1.0)], 0)


def test_profile_trace_refuses_bad_events_naming_them(tmp_path, capsys):
    """Negative, missing or non-finite times are refused naming the event; a gzip file cut short
    or an empty file (torch creates it with ``gzip.open(path, "wb")`` before writing) is an EOFError
    the caller retries; a corrupt gzip stream or absurd nesting is a ValueError naming the file;
    plain JSON is read whatever its suffix; a zero-length window still formats."""
    from oasis_sglang.bench import profile_trace as pt

    k = {"ph": "X", "cat": "kernel", "name": "nvjet", "ts": 0, "dur": 5, "args": [1]}     # args not a dict: no stream
    assert pt.load_gpu_events(_trace(tmp_path, [k]))[0][1] is None
    for bad in ({"dur": -1}, {"dur": None}, {"ts": float("nan")}, {"ts": "x"}):
        with pytest.raises(ValueError, match="GPU event 0"):
            pt.load_gpu_events(_trace(tmp_path, [{**k, **bad}]))
    no_ts = dict(k)
    del no_ts["ts"]
    with pytest.raises(ValueError, match="ts=None"):
        pt.load_gpu_events(_trace(tmp_path, [no_ts]))
    plain = _trace(tmp_path, [k], gz=False).rename(tmp_path / "plain.trace.json.gz")
    assert len(pt.load_gpu_events(plain)) == 1
    whole = _trace(tmp_path, [k] * 50)
    cut = tmp_path / "cut.trace.json.gz"
    cut.write_bytes(whole.read_bytes()[:40])
    with pytest.raises(EOFError, match="cut.trace.json.gz"):
        pt.load_gpu_events(cut)
    empty = tmp_path / "empty.trace.json.gz"
    empty.write_bytes(b"")
    with pytest.raises(EOFError, match="empty.trace.json.gz: 0 bytes"):
        pt.load_gpu_events(empty)
    raw = bytearray(whole.read_bytes())
    raw[12:40] = bytes(b ^ 0xFF for b in raw[12:40])
    (tmp_path / "bad.trace.json.gz").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="bad.trace.json.gz: not a gzip stream"):
        pt.load_gpu_events(tmp_path / "bad.trace.json.gz")
    (tmp_path / "deep.json").write_text("[" * 200_000)
    with pytest.raises(ValueError, match="nested too deep"):
        pt.load_gpu_events(tmp_path / "deep.json")
    s = pt.summarize([("nvjet", 1, 10.0, 0.0)], 1)
    assert s["window_ms"] == 0 and "| GEMMs | 0.000 | - |" in pt.markdown(s)
    assert pt.main([str(whole), "--steps", "1", "--out", str(tmp_path / "no" / "such" / "dir.md")]) == 2
    assert "No such file" in capsys.readouterr().err


def test_tables_skip_a_malformed_stored_profile(bench):
    a = _args(bench)
    a.suite = "short"
    good = {"running": 8, "window_ms": 6.0, "busy_frac": 0.9, "idle_ms": 0.6, "groups_ms": {"GEMMs": 4.0}}
    res = [{"key": "short/1024/dense", "system": "dense", "decode_tok_s": 100.0, "profile": good},
           {"key": "short/1024/oasis", "system": "oasis", "decode_tok_s": 90.0, "profile": {"running": 8}}]
    md = bench.tables(res, a)
    assert "| short/1024/dense | 8 | 6.00 | 90.0% | 0.60 | 4.00 |" in md
    assert "| short/1024/oasis | 8 | 6.00" not in md


def test_stall_suite_pairs_the_16k_run_with_its_no_transfer_ablation(bench):
    a = _args(bench)
    keys = [r.key for r in bench.plan("stall", a)]
    assert keys == ["throughput/16384/oasis", "stall/16384/oasis-no-transfer"]
    assert "stall/16384/oasis-no-transfer" in [r.key for r in bench.plan("all", a)]
    runs = {r.key: r for r in bench.plan("stall", a)}
    assert bench.system_args(runs["stall/16384/oasis-no-transfer"], a) == bench.system_args(runs["throughput/16384/oasis"], a)
    a.suite = "stall"
    res = [{"key": "throughput/16384/oasis", "system": "oasis", "decode_tok_s": 2000.0, "step_ms": 20.0, "max_running": 40},
           {"key": "stall/16384/oasis-no-transfer", "system": "oasis-no-transfer", "decode_tok_s": 2222.2,
            "step_ms": 18.0, "max_running": 40}]
    assert "| 16K | 40 / 40 | 20.00 | 18.00 | 10.0% |" in bench.tables(res, a)


def test_churn_replay_marks_the_oasis_runs_and_reaches_their_servers(bench, monkeypatch, tmp_path, capsys):
    import json
    from argparse import Namespace as argparse_ns

    prof = tmp_path / "churn.json"
    prof.write_text("[2.0, 3.0]")
    real_start = bench.start_server
    calls = _fake_runs(bench, monkeypatch)
    out = str(tmp_path / "o")
    assert _main(bench, monkeypatch, "--suite", "short", "--out", out, "--churn", str(prof)) == 0
    rows = {r["key"]: r for r in json.loads((tmp_path / "o" / "bench_oasis.json").read_text())["results"]}
    assert rows["short/1024/oasis"]["churn"] == str(prof.resolve()) and rows["short/1024/dense"]["churn"] is None
    assert "replay the churn profile" in (tmp_path / "o" / "bench_oasis.md").read_text()
    assert _main(bench, monkeypatch, "--suite", "short", "--out", out, "--resume") == 0
    assert calls[2:] == ["short/1024/oasis"], "without --churn the oasis run is another measurement"
    capsys.readouterr()
    assert _main(bench, monkeypatch, "--suite", "short", "--list", "--churn", str(prof)) == 0
    listed = capsys.readouterr().out
    assert f"OASIS_CHURN={prof.resolve()} sglang serve" in listed and listed.count("OASIS_CHURN") == 1
    started = []
    monkeypatch.setattr(bench, "launch", lambda m, port, args, log, **k: started.append(dict(__import__("os").environ))
                        or _FakeServer())
    real_start(["--x"], tmp_path / "l.log", argparse_ns(timeout=5), churn="/p.json")
    assert started[-1]["OASIS_CHURN"] == "/p.json" and "OASIS_CHURN" not in __import__("os").environ
    prof.write_text("[-1]")
    with pytest.raises(SystemExit) as e:
        _main(bench, monkeypatch, "--suite", "short", "--out", out, "--churn", str(prof))
    assert e.value.code == 2 and "--churn" in capsys.readouterr().err


def test_list_prints_the_servers_that_would_start(bench, monkeypatch, tmp_path, capsys):
    _fake_runs(bench, monkeypatch)
    capsys.readouterr()
    assert _main(bench, monkeypatch, "--suite", "all", "--list") == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 5, lines
    assert lines[1].startswith("throughput/16384/oasis throughput/32768/oasis context/4096/oasis context/8192/oasis ")
    assert "--max-running-requests 167 " in lines[1]      # 4K: 96 GiB of 136 KiB tokens
    assert _main(bench, monkeypatch, "--suite", "all", "--list", "--separate-servers") == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 11
    with pytest.raises(SystemExit) as e:
        _main(bench, monkeypatch, "--suite", "short", "--churn=", "--list")
    assert e.value.code == 2 and "--churn: empty" in capsys.readouterr().err


def test_kv_dtype_fp8_doubles_the_host_tier_requests_and_reaches_every_server(bench, monkeypatch, tmp_path):
    """--kv-dtype fp8_e4m3: every server gets SGLang's --kv-cache-dtype (dense like oasis), the
    host tier holds twice the requests of bf16, and its runs are keyed KEY@dtype: --resume keeps
    the stored bf16 runs and measures the fp8 ones beside them."""
    import json

    a = _args(bench)
    a.kv_dtype = "fp8_e4m3"
    runs = {r.key: r for r in bench.plan("all", a)}
    o8, o16 = runs["throughput/16384/oasis@fp8_e4m3"], {r.key: r for r in bench.plan("all", _args(bench))}["throughput/16384/oasis"]
    assert o8.kv_dtype == "fp8_e4m3" and o16.kv_dtype == "auto"
    assert o8.host_requests == bench.host_requests_for(16384 + 256 + 64, 72.0, "fp8_e4m3") == 66 == 2 * o16.host_requests
    for r in runs.values():
        args = bench.system_args(r, a)
        assert args[args.index("--kv-cache-dtype") + 1] == "fp8_e4m3", r.key
    assert "--kv-cache-dtype" not in bench.system_args(o16, _args(bench))
    calls = _fake_runs(bench, monkeypatch)
    out = str(tmp_path)
    assert _main(bench, monkeypatch, "--suite", "short", "--out", out) == 0
    rows = json.loads((tmp_path / "bench_oasis.json").read_text())["results"]
    for r in rows:                       # results stored before the field existed were bf16 ("auto")
        del r["kv_dtype"]
    (tmp_path / "bench_oasis.json").write_text(json.dumps({"args": {}, "results": rows}))
    assert _main(bench, monkeypatch, "--suite", "short", "--out", out, "--resume") == 0
    assert calls == ["short/1024/dense", "short/1024/oasis"], "a stored run without kv_dtype is a bf16 run"
    assert _main(bench, monkeypatch, "--suite", "short", "--out", out, "--resume", "--kv-dtype", "fp8_e5m2") == 0
    assert calls[2:] == ["short/1024/dense@fp8_e5m2", "short/1024/oasis@fp8_e5m2"]
    keys = [r["key"] for r in json.loads((tmp_path / "bench_oasis.json").read_text())["results"]]
    assert sorted(keys) == ["short/1024/dense", "short/1024/dense@fp8_e5m2", "short/1024/oasis",
                            "short/1024/oasis@fp8_e5m2"], "both dtypes kept"
    assert "KV cache dtype fp8_e5m2" in (tmp_path / "bench_oasis.md").read_text()
    with pytest.raises(SystemExit):
        _main(bench, monkeypatch, "--suite", "short", "--kv-dtype", "fp4")


def test_a_transfer_budget_reaches_the_oasis_servers_under_its_own_keys(bench, monkeypatch, tmp_path):
    """--transfer-budget 0.5: the oasis servers' config carries it, dense runs are unchanged,
    oasis runs are keyed KEY@tb=0.5 and compared with the plain dense run; --resume measures
    them beside stored runs without the field (those were "auto"); a bad value is refused."""
    import argparse
    import json

    from oasis_sglang.argtypes import transfer_budget

    assert transfer_budget("auto") == "auto" and transfer_budget("null") is None
    assert transfer_budget("0.5") == 0.5 and isinstance(transfer_budget("0.5"), float)
    assert transfer_budget("400000000") == 400000000 and isinstance(transfer_budget("400000000"), int)
    assert transfer_budget("Auto") == "auto" and transfer_budget("NULL") is None
    for bad in ("half", "-1", "1e9", "nan."):
        with pytest.raises(argparse.ArgumentTypeError, match="want auto, null"):
            transfer_budget(bad)
    a = _args(bench)
    a.transfer_budget = 0.5
    runs = {r.key: r for r in bench.plan("short", a)}
    assert sorted(runs) == ["short/1024/dense", "short/1024/oasis@tb=0.5"]
    cfg = bench.system_args(runs["short/1024/oasis@tb=0.5"], a)
    assert json.loads(cfg[cfg.index("--kv-sparse-config") + 1])["transfer_budget"] == 0.5
    plain = bench.system_args({r.key: r for r in bench.plan("short", _args(bench))}["short/1024/oasis"], _args(bench))
    assert "transfer_budget" not in json.loads(plain[plain.index("--kv-sparse-config") + 1])
    a.transfer_budget = None
    assert "short/1024/oasis@tb=null" in {r.key for r in bench.plan("short", a)}
    calls = _fake_runs(bench, monkeypatch)
    out = str(tmp_path)
    assert _main(bench, monkeypatch, "--suite", "short", "--out", out) == 0
    rows = json.loads((tmp_path / "bench_oasis.json").read_text())["results"]
    for r in rows:                       # results stored before the field existed were "auto"
        del r["transfer_budget"]
    (tmp_path / "bench_oasis.json").write_text(json.dumps({"args": {}, "results": rows}))
    assert _main(bench, monkeypatch, "--suite", "short", "--out", out, "--resume", "--transfer-budget", "0.5") == 0
    assert calls == ["short/1024/dense", "short/1024/oasis", "short/1024/oasis@tb=0.5"]
    by = {r["key"]: r for r in json.loads((tmp_path / "bench_oasis.json").read_text())["results"]}
    assert by["short/1024/oasis@tb=0.5"]["transfer_budget"] == 0.5
    assert bench._dense_of(by["short/1024/oasis@tb=0.5"], by)["key"] == "short/1024/dense"
    assert "transfer budget 0.5" in (tmp_path / "bench_oasis.md").read_text()
    with pytest.raises(SystemExit):     # the config refuses a fraction above 1
        _main(bench, monkeypatch, "--suite", "short", "--transfer-budget", "1.5")


def test_a_stored_eagle3_run_from_before_the_overlap_default_is_measured_again(bench, monkeypatch):
    """The breaker's case: an oasis-eagle3 result stored without OASIS_SPEC_OVERLAP was measured
    with the overlap scheduler off (the default before 75e68c7); --resume with the variable unset
    (now: on) must not take it for a run of today's default, and its table row says so."""
    import argparse

    monkeypatch.delenv("OASIS_SPEC_OVERLAP", raising=False)
    a = _args(bench)
    a.systems, a.predictor = ["oasis-eagle3"], "lookahead"
    run = bench.plan("paired", a)[0]
    stored = {f: getattr(run, f) for f in bench.RUN_FIELDS} | {"key": run.key}
    assert bench.spec_overlap_of(stored) == "0" and not bench.same_run(stored, run)
    assert bench.same_run(stored | {"spec_overlap": "1"}, run)
    monkeypatch.setenv("OASIS_SPEC_OVERLAP", "1")          # recorded as env by the third session's A/B
    assert bench.same_run(stored | {"env": {"OASIS_SPEC_OVERLAP": "1"}}, run)
    monkeypatch.setenv("OASIS_SPEC_OVERLAP", "0")
    assert not bench.same_run(stored | {"env": {"OASIS_SPEC_OVERLAP": "1"}}, run)
    dense = bench.plan("paired", argparse.Namespace(**{**vars(a), "systems": ["dense-eagle3"]}))[0]
    assert bench.same_run({f: getattr(dense, f) for f in bench.RUN_FIELDS}, dense), "dense: SGLang's own default"
    monkeypatch.setenv("OASIS_SPEC_OVERLAP", " 1")        # the servers would refuse it: so does the bench, at once
    with pytest.raises(SystemExit):
        _main(bench, monkeypatch, "--suite", "paired", "--systems", "oasis-eagle3", "--predictor", "lookahead")
    monkeypatch.delenv("OASIS_SPEC_OVERLAP")
    md = bench.tables([stored | {"decode_tok_s": 1527.9, "max_running": 39},
                       stored | {"key": run.key + "x", "decode_tok_s": 1862.1, "spec_overlap": "1"}], a)
    assert f"| {run.key} (overlap scheduler off) |" in md and f"| {run.key}x |" in md


def test_runs_at_another_budget_keep_their_stall_row_and_their_own_fetch_cap_rows(bench):
    """The breaker's cases: the stall table pairs the no-transfer run with the 16K oasis run of the
    same key suffix (it vanished with --transfer-budget); the fetch-cap rows take in only the
    throughput run of their own suffix (the context plot draws one line per system and suffix
    by the same ``key_suffix``); an integer budget's key says bytes."""
    a = _args(bench)
    a.transfer_budget = 400000000
    assert "short/1024/oasis@tb=400000000B" in {r.key for r in bench.plan("short", a)}
    r = lambda key, system, **kw: {"key": key, "system": system, "input_len": 16384, "decode_tok_s": 100.0,  # noqa: E731
                                    "max_running": 40, **kw}
    res = [r("throughput/16384/oasis", "oasis", step_ms=20.0, fetch_cap=8),
           r("throughput/16384/oasis@tb=0.5", "oasis", step_ms=16.0, fetch_cap=8),
           r("stall/16384/oasis-no-transfer@tb=0.5", "oasis-no-transfer", step_ms=12.0),
           r("fetch-cap/2", "oasis", fetch_cap=2)]
    md = bench.tables(res, a)
    assert "| 16K@tb=0.5 | 40 / 40 | 16.00 | 12.00 | 25.0% |" in md
    assert [x["key"] for x in bench.suite_rows(res, "fetch-cap")] == ["fetch-cap/2", "throughput/16384/oasis"]
    assert bench.key_suffix("context/16384/oasis@fp8_e4m3@tb=0.5") == "@fp8_e4m3@tb=0.5"
    assert bench.key_suffix("context/16384/oasis") == ""


def test_an_fp8_run_is_compared_with_fp8_dense_and_a_failed_rerun_keeps_the_stored_result(bench, monkeypatch, tmp_path):
    """The breaker's case: oasis fp8 beside dense bf16 gets no ratio (no fp8 dense run), and a
    re-measurement that fails does not replace a stored result (exit 1)."""
    import json

    out = str(tmp_path)
    calls = _fake_runs(bench, monkeypatch)
    assert _main(bench, monkeypatch, "--suite", "short", "--out", out) == 0
    assert _main(bench, monkeypatch, "--suite", "short", "--systems", "oasis", "--kv-dtype", "fp8_e4m3", "--out", out,
                 "--resume") == 0
    by = {r["key"]: r for r in json.loads((tmp_path / "bench_oasis.json").read_text())["results"]}
    assert bench._dense_of(by["short/1024/oasis@fp8_e4m3"], by) is None
    assert bench._dense_of(by["short/1024/oasis"], by) is by["short/1024/dense"]
    calls.clear()
    _fake_runs(bench, monkeypatch, fail=("short/1024/oasis",))
    assert _main(bench, monkeypatch, "--suite", "short", "--systems", "oasis", "--out", out, "--resume",
                 "--output-len", "128") == 1                    # other settings: measured again, and it fails
    after = {r["key"]: r for r in json.loads((tmp_path / "bench_oasis.json").read_text())["results"]}
    assert after["short/1024/oasis"] == by["short/1024/oasis"], "the stored result is kept"


def test_deadline_estimates_leave_the_server_start_out_and_scale_by_tokens_prefilled(bench):
    """--deadline: a run timed in this call predicts the same run; another length of its system
    scales by batch x context (at least 1x), plus a server start when the run needs one; with
    nothing timed, --run-estimate (a whole run with its start). The 2026-12-05 H200 call stopped
    after 4K because the 4K run's 200 s shared-server start was doubled for 8K."""
    R = bench.Run
    r4 = R("context/4096/oasis", "oasis", 4096, 256, 158)
    r8 = R("context/8192/oasis", "oasis", 8192, 256, 82)
    r32 = R("context/32768/oasis", "oasis", 32768, 256, 21)
    d = R("context/8192/dense", "dense", 8192, 256, 32)
    assert bench.estimate_run_s(r4, {}, {}, None, 150.0) == 150.0
    assert bench.estimate_run_s(r4, {}, {}, 0.0, 150.0) == 150.0
    took, tok = {("oasis", 4096): 61.0}, {("oasis", 4096): 158 * 4096}
    assert bench.estimate_run_s(r4, took, tok, 0.0, 150.0) == 61.0
    assert bench.estimate_run_s(r4, took, tok, 200.0, 150.0) == 261.0
    assert bench.estimate_run_s(r8, took, tok, 0.0, 150.0) == pytest.approx(61.0 * 82 * 8192 / (158 * 4096))
    assert bench.estimate_run_s(r32, took, tok, 0.0, 150.0) == pytest.approx(61.0 * 21 * 32768 / (158 * 4096))
    assert bench.estimate_run_s(R("x", "oasis", 1024, 256, 8), took, tok, 0.0, 150.0) == 61.0, "at least 1x"
    assert bench.estimate_run_s(d, took, tok, 90.0, 150.0) == 150.0, "another system: nothing timed"


def test_the_80gb_dense_pool_is_the_same_bytes_on_any_gpu(bench):
    """Dense's "80gb" pool: 0.475 of the H200 (the stored baselines), the share of another GPU's
    memory that leaves the same bytes (an H100 80 GB: 0.837), at most 0.9."""
    f = bench.dense_80gb_mem_fraction
    assert f(143_771) == 0.475 and f(81_559) == 0.837 and f(40_000) == 0.9
    for mib in (143_771, 81_559, 97_871):
        assert abs(f(mib) * mib - 0.475 * 143_771) < 0.001 * mib


@pytest.mark.parametrize("value,kept", [(None, False), ("0", False), ("1", True), ("yes", True)])
def test_profile_traces_are_deleted_unless_kept(tmp_path, monkeypatch, value, kept):
    """``OASIS_BENCH_KEEP_TRACE`` in ``1 / true / yes`` moves the first trace beside the results
    (``trace_<name>``); every other trace, and all of them otherwise, are deleted."""
    from oasis_sglang.bench.serving import drop_traces

    if value is None:
        monkeypatch.delenv("OASIS_BENCH_KEEP_TRACE", raising=False)
    else:
        monkeypatch.setenv("OASIS_BENCH_KEEP_TRACE", value)
    tdir = tmp_path / ".traces"
    tdir.mkdir()
    traces = [tdir / f"run_a-TP-{r}.trace.json.gz" for r in (0, 1)]
    for t in traces:
        t.write_bytes(b"x")
    drop_traces(traces)
    assert not any(t.exists() for t in traces)
    assert (tmp_path / "trace_run_a-TP-0.trace.json.gz").exists() == kept
    assert not (tmp_path / "trace_run_a-TP-1.trace.json.gz").exists()


QWEN3_8B = {"num_hidden_layers": 36, "hidden_size": 4096, "intermediate_size": 12288, "vocab_size": 151936,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}


def test_roofline_counts_the_bytes_each_system_reads(tmp_path):
    """bench/roofline.py against the arithmetic written out: Qwen3-8B's weights, dense SGLang's
    whole KV cache, OasisKV's working sets + dense layers + key summaries (none on the dense path)."""
    import json

    from oasis_sglang.bench import roofline

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    s = roofline.ModelShape.from_config(tmp_path)
    per_layer = 4096 * 128 * (2 * 32 + 2 * 8) + 3 * 4096 * 12288            # q, k, v, o + gate, up, down
    assert s.weight_bytes() == 2 * (36 * per_layer + 151936 * 4096)
    kv_token_layer = 8 * 128 * 2 * 2                                       # K and V, bf16: 4 KiB
    d = roofline.step_hbm_bytes(s, "dense", 22, 16512)
    assert d["kv"] == 22 * 36 * 16512 * kv_token_layer and d["working_sets"] == d["summaries"] == 0
    o = roofline.step_hbm_bytes(s, "oasis", 40, 16512)
    assert o["working_sets"] == 40 * 34 * 2048 * kv_token_layer
    assert o["dense_layers"] == 40 * 2 * 16512 * kv_token_layer
    assert o["summaries"] == 40 * 34 * 8 * 1032 * (2 * 128 * 2)             # ceil(16512 / 16) blocks, min + max
    assert o["total"] == o["weights"] + o["working_sets"] + o["dense_layers"] + o["summaries"] and o["kv"] == 0
    assert round(o["total"] / 1e9, 2) == 37.70 and round(d["total"] / 1e9, 2) == 68.70   # the run file's figures
    short = roofline.step_hbm_bytes(s, "oasis", 8, 1152)                     # fits the working set: dense path
    assert short["summaries"] == 0 and short["working_sets"] == 8 * 34 * 1152 * kv_token_layer
    assert roofline.step_hbm_bytes(s, "oasis", 8, 2048)["summaries"] > 0, "2048 + the next token overflow 2048"
    fp8 = roofline.step_hbm_bytes(s, "dense", 22, 16512, kv_bytes=1)
    assert fp8["kv"] * 2 == d["kv"] and fp8["weights"] == d["weights"]
    tb_s, frac = roofline.reached(o["total"], 17.06, "NVIDIA H100 80GB HBM3")
    assert tb_s == pytest.approx(2.2098, rel=1e-3) and frac == pytest.approx(tb_s / 3.35)
    assert roofline.reached(o["total"], 17.06, "NVIDIA H200")[1] == pytest.approx(tb_s / 4.8)
    assert roofline.reached(o["total"], 17.06, "no GPU")[1] is None
    with pytest.raises(ValueError, match="dense_layers 40"):
        roofline.step_hbm_bytes(s, "oasis", 1, 100, dense_layers=40)
    with pytest.raises(ValueError, match="block 0"):
        roofline.step_hbm_bytes(s, "oasis", 1, 100, block=0)
    with pytest.raises(ValueError, match="step_ms 0"):
        roofline.reached(o["total"], 0, "NVIDIA H200")


def test_roofline_reads_no_shape_it_cannot_count(tmp_path):
    import json

    from oasis_sglang.bench import roofline

    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_8B, "num_experts": 128}))
    assert roofline.ModelShape.from_config(tmp_path) is None, "a MoE step does not read every expert"
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in QWEN3_8B.items() if k != "intermediate_size"}))
    assert roofline.ModelShape.from_config(tmp_path) is None
    (tmp_path / "config.json").write_text("not json")
    assert roofline.ModelShape.from_config(tmp_path) is None and roofline.ModelShape.from_config(tmp_path / "x") is None
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in QWEN3_8B.items() if k != "head_dim"}))
    assert roofline.ModelShape.from_config(tmp_path).head_dim == 128, "hidden_size / heads"


def test_tables_give_the_hbm_bandwidth_each_run_reached(bench, tmp_path):
    import json

    from oasis_sglang.bench import roofline

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    shape = roofline.ModelShape.from_config(tmp_path)
    run = bench.Run("context/16384/oasis", "oasis", 16384, 256, 40)
    f = bench.hbm_figures(run, 40, 17.06, 2048, shape, "NVIDIA H100 80GB HBM3")
    assert f["hbm_gb_per_step"] == pytest.approx(37.70, abs=0.005)
    assert f["hbm_of_peak"] == pytest.approx(0.66, abs=0.005)
    dense = bench.Run("context/16384/dense", "dense", 16384, 256, 22, pool="80gb")
    fd = bench.hbm_figures(dense, 22, 25.11, 2048, shape, "NVIDIA H100 80GB HBM3")
    assert fd["hbm_tb_s"] == pytest.approx(2.736, abs=0.001)
    assert bench.hbm_figures(run, 40, None, 2048, shape, "x") == {}, "no step time"
    assert bench.hbm_figures(run, 40, 17.0, 2048, None, "x") == {}, "no model shape"
    assert bench.hbm_figures(run, 40, 17.06, 2048, shape, "no GPU")["hbm_of_peak"] is None
    res = [{"key": "context/16384/dense", "system": "dense", "decode_tok_s": 876.2, "max_running": 22, **fd},
           {"key": "context/16384/oasis", "system": "oasis", "decode_tok_s": 2344.2, "max_running": 40, **f},
           {"key": "context/32768/oasis", "system": "oasis", "decode_tok_s": 1.0, "max_running": 20}]
    md = bench.tables(res, _args(bench))
    assert "| context/16384/oasis | 40 | 37.7 | 2.21 | 66% |" in md
    assert "| context/16384/dense | 22 | 68.7 | 2.74 | 82% |" in md
    assert "context/32768/oasis | 20 |" not in md.split("### HBM")[1], "a run without the figures has no row"


def test_the_host_link_rate_of_the_oasis_server_reaches_the_table(bench):
    """The start-up line of a served 16K run on the H100 (2026-12-06, call 3), as SGLang logged it."""
    line = ("[2026-12-06 10:55:48] OasisKV: transfer budget auto: admission copies measured at 48.3 GB/s host to "
            "device; a step may admit 0.80 of what the link moves during it (sized from the decode step time, at "
            "each OasisKV decode line)\n")
    assert bench.link_rate("x\n" + line + "y\n") == 48.3
    assert bench.link_rate(line + line.replace("48.3", "25.4")) == 25.4, "the last start-up"
    assert bench.link_rate("[t] Decode batch, #running-req: 8\n") is None
    res = [{"key": "context/16384/oasis", "system": "oasis", "decode_tok_s": 2344.2, "max_running": 40,
            "link_gb_s": 48.3},
           {"key": "context/16384/dense", "system": "dense", "decode_tok_s": 876.2, "max_running": 22},
           {"key": "context/4096/oasis", "system": "oasis", "error": "start failed: boom"}]
    md = bench.tables(res, _args(bench))
    rows = {l.split(" | ")[0][2:]: l for l in md.splitlines() if l.startswith("| context/")}
    assert rows["context/16384/oasis"].endswith("| 2.68x | 48.3 |")
    assert rows["context/16384/dense"].endswith("| - | - |"), "dense measures no link"
    assert rows["context/4096/oasis"].startswith("| context/4096/oasis | failed: start failed: boom")
    head = next(l for l in md.splitlines() if l.startswith("| run |"))
    assert all(l.count("|") == head.count("|") for l in rows.values()), "every row has the header's columns"


def test_a_run_records_the_experiments_its_server_inherits(bench, monkeypatch, tmp_path):
    """OASIS_SPEC_OVERLAP and the other server-side experiment variables, when set, are part of
    every run's result (``env``), even of a run whose server did not start."""
    def boom(*a, **k):
        raise RuntimeError("no GPU here")

    monkeypatch.setattr(bench, "start_server", boom)
    run = bench.Run("paired/16384/oasis-eagle3", "oasis-eagle3", 16384, 256, 40, "exact", 8)
    monkeypatch.delenv("OASIS_COPY_PROGRAMS", raising=False)
    monkeypatch.delenv("OASIS_DECODE_LOG_INTERVAL", raising=False)
    monkeypatch.setenv("OASIS_SPEC_OVERLAP", "1")
    r = bench.run_one(run, _args(bench), tmp_path)
    assert r["env"] == {"OASIS_SPEC_OVERLAP": "1"} and r["error"].startswith("start failed: RuntimeError")
    monkeypatch.delenv("OASIS_SPEC_OVERLAP")
    assert "env" not in bench.run_one(run, _args(bench), tmp_path)


def test_resume_remeasures_an_oasis_run_whose_experiment_variables_changed(bench, monkeypatch):
    """--resume keeps a stored oasis run only when it ran with the experiment variables set now
    (an A/B of OASIS_SPEC_OVERLAP into one --out must measure both halves); dense runs are not
    affected by them. The tables name a run's variables."""
    runs = {r.key: r for r in bench.plan("short", _args(bench))}
    o, d = runs["short/1024/oasis"], runs["short/1024/dense"]
    stored = lambda r, **extra: {f: getattr(r, f) for f in bench.RUN_FIELDS} | {"key": r.key} | extra  # noqa: E731
    monkeypatch.delenv("OASIS_SPEC_OVERLAP", raising=False)
    monkeypatch.delenv("OASIS_COPY_PROGRAMS", raising=False)
    monkeypatch.delenv("OASIS_DECODE_LOG_INTERVAL", raising=False)
    assert bench.same_run(stored(o), o)
    assert not bench.same_run(stored(o, env={"OASIS_SPEC_OVERLAP": "1"}), o)
    assert bench.same_run(stored(d, env={"OASIS_SPEC_OVERLAP": "1"}), d)
    monkeypatch.setenv("OASIS_SPEC_OVERLAP", "1")
    assert bench.same_run(stored(o, env={"OASIS_SPEC_OVERLAP": "1"}), o) and not bench.same_run(stored(o), o)
    md = bench.tables([stored(o, env={"OASIS_SPEC_OVERLAP": "1"}, decode_tok_s=100.0, max_running=8)], _args(bench))
    assert "| short/1024/oasis (OASIS_SPEC_OVERLAP=1) | 8 | 100.0 |" in md


def test_host_gib_too_large_to_size_is_refused_naming_the_flag(bench):
    with pytest.raises(ValueError, match="--host-gib 1e\\+300 is too large"):
        bench.host_requests_for(16704, 1e300)
