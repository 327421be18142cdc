"""--kv-sparse handling in the patched ServerArgs (no server start: fast)."""

import os

import pytest
from sglang.srt.server_args import ServerArgs

from oasis_sglang.config import OasisConfigError
from oasis_sglang.models import prepare_smollm2


@pytest.fixture(scope="module")
def model():
    return str(prepare_smollm2())


def make(model, **kw):
    return ServerArgs(model_path=model, device="cpu", **kw)


def test_none_leaves_sglang_alone(model):
    a = make(model)
    assert a.kv_sparse == "none" and a.page_size == 1


def test_oasis_sets_dependent_defaults(model, monkeypatch):
    monkeypatch.setenv("SGLANG_FORCE_COARSE_WAR_BARRIER", "0")      # a user's value is replaced (and restored after)
    monkeypatch.delenv("SGLANG_ENABLE_WAR_BARRIER", raising=False)
    a = make(model, kv_sparse="oasis", kv_sparse_config='{"budget_tokens": 512, "block_size": 8}')
    assert a.page_size == 8 and a.attention_backend == "torch_native"
    assert a.disable_cuda_graph and not a.disable_overlap_schedule
    # the overlap scheduler stays on; its next writes to req_to_token wait for the whole forward
    assert os.environ["SGLANG_FORCE_COARSE_WAR_BARRIER"] == "1"
    assert "SGLANG_ENABLE_WAR_BARRIER" not in os.environ        # the CPU engine keeps SGLang's own choice
    assert a.max_running_requests == 64
    # admission reserves prompt + max_new_tokens: SGLang's new-token ratio pinned at 1.0
    assert a.schedule_conservativeness * float(os.environ["SGLANG_INIT_NEW_TOKEN_RATIO"]) >= 1.0
    assert float(os.environ["SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR"]) == 1.0
    assert '"budget_tokens": 512' in a.kv_sparse_config


def test_oasis_on_cpu_without_sglangs_cpu_engine_is_refused_by_name(model, monkeypatch):
    """Without SGLANG_USE_CPU_ENGINE=1 SGLang 0.5.17 would stop later, at model loading, on an
    import of vllm: the start-up check says what to set instead."""
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    with pytest.raises(OasisConfigError, match="set SGLANG_USE_CPU_ENGINE=1"):
        make(model, kv_sparse="oasis", kv_sparse_config='{"budget_tokens": 512, "block_size": 8}')


@pytest.mark.parametrize("kw,key", [
    (dict(kv_sparse_config='{"budget": 512}'), "budget"),
    (dict(page_size=4), "--page-size"),
    (dict(attention_backend="flashinfer"), "--attention-backend"),
    (dict(speculative_algorithm="DFLASH"), "--speculative-algorithm"),
    (dict(speculative_algorithm="NGRAM", speculative_ngram_max_bfs_breadth=3), "--speculative-ngram-max-bfs-breadth"),
    (dict(speculative_algorithm="NGRAM", speculative_ngram_min_bfs_breadth=2), "--speculative-ngram-min-bfs-breadth"),
    (dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4), "--speculative-num-draft-tokens"),
    (dict(speculative_algorithm="NGRAM", speculative_ngram_external_corpus_path=""), "--speculative-ngram-external-corpus-path"),
    (dict(speculative_algorithm="NGRAM", speculative_ngram_min_bfs_breadth=1.0), "--speculative-ngram-min-bfs-breadth"),
    (dict(speculative_algorithm="EAGLE3", speculative_num_draft_tokens=4), "--speculative-num-draft-tokens"),
    (dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=2), "--speculative-eagle-topk"),
    (dict(kv_sparse_config='{"predictor": "lookahead"}'), "predictor"),
    (dict(kv_sparse_config='{"measure_agreement": true}'), "measure_agreement"),
    (dict(enable_torch_compile=True), "--enable-torch-compile"),
    (dict(speculative_algorithm="EAGLE3", speculative_adaptive=True), "--speculative-adaptive"),
    (dict(speculative_algorithm="EAGLE3", attention_backend="torch_native"), "--attention-backend"),
    (dict(speculative_algorithm="STANDALONE", speculative_draft_attention_backend="torch_native"),
     "--speculative-draft-attention-backend"),
    (dict(enable_mixed_chunk=True), "--enable-mixed-chunk"),
    (dict(enable_pdmux=True), "--enable-pdmux"),
    (dict(kv_cache_dtype="fp4_e2m1"), "--kv-cache-dtype"),
    (dict(kv_cache_dtype="mxfp8"), "--kv-cache-dtype"),
    (dict(tp_size=0), "--tp-size"),
    (dict(tp_size=-1), "--tp-size"),
    (dict(tp_size=3, dcp_size=3), "--dcp-size"),
    (dict(tp_size=3, attn_cp_size=3), "--attn-cp-size"),
    (dict(disaggregation_mode="decode", disaggregation_transfer_backend="mooncake"),
     "--disaggregation-transfer-backend 'mooncake': must be nixl"),
    (dict(disaggregation_mode="decode", disaggregation_transfer_backend="nixl", speculative_algorithm="NGRAM"),
     "--speculative-algorithm NGRAM cannot be combined with --disaggregation-mode: only EAGLE3"),
    (dict(disaggregation_mode="decode", disaggregation_transfer_backend="nixl",
          disaggregation_decode_enable_radix_cache=True), "--disaggregation-decode-enable-radix-cache"),
    (dict(disaggregation_mode="decode", disaggregation_transfer_backend="nixl",
          disaggregation_decode_enable_offload_kvcache=True), "--disaggregation-decode-enable-offload-kvcache"),
    (dict(kv_sparse_config='{"pd_lease_s": 0}'), "pd_lease_s"),
    (dict(kv_sparse_config='{"pd_lease_s": 0.5}'), "at least 1 second"),
    (dict(kv_sparse_config='{"pd_lease_s": 1e11}'), "at most 86400"),
    (dict(kv_sparse_config='{"pd_lease_s": %d}' % 10 ** 400), "pd_lease_s"),
    (dict(kv_sparse_config='{"pd_read_timeout_s": "10"}'), "pd_read_timeout_s"),
    (dict(kv_sparse_config='{"pd_read_timeout_s": 1e-300}'), "at least 0.01"),
    (dict(kv_sparse_config='{"pd_read_timeout_s": 1e300}'), "at most 3600"),
])
def test_bad_combinations_name_the_flag(model, kw, key):
    with pytest.raises(OasisConfigError, match=key):
        make(model, kv_sparse="oasis", **kw)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_pd_with_tp_is_accepted(model, mode):
    """TP with PD: each decode rank reads its KV heads from the prefill rank of the same number
    (the TP sizes are compared at the first request: tests/disagg/test_transport.py)."""
    pytest.importorskip("nixl")
    a = make(model, kv_sparse="oasis", disaggregation_mode=mode, disaggregation_transfer_backend="nixl", tp_size=3)
    assert a.tp_size == 3 and a.disaggregation_mode == mode


@pytest.mark.parametrize("kw,key", [
    (dict(kv_sparse_config='{"dense_layers": [30]}'), "dense_layers"),
    (dict(kv_sparse_config='{"dense_layers": %s}' % list(range(30))), "dense_layers"),
    (dict(kv_sparse_config='{"budget_tokens": 16384}'), "budget_tokens"),
    (dict(chunked_prefill_size=100), "--chunked-prefill-size"),
    (dict(max_running_requests=0), "--max-running-requests"),
    (dict(max_total_tokens=4), "--max-total-tokens 4 holds no block"),
    (dict(kv_sparse_config='{"kernels": "triton"}'), "kernels"),
])
def test_model_dependent_checks_fail_before_loading(model, kw, key):
    with pytest.raises(OasisConfigError, match=key):
        make(model, kv_sparse="oasis", **kw)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2", "bf16", "auto"])
def test_plain_kv_cache_dtypes_are_served(model, kv):
    assert make(model, kv_sparse="oasis", kv_cache_dtype=kv).kv_cache_dtype == kv


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_pd_with_nixl_is_served(model, mode, caplog):
    """A PD node is served; a decode node says ``dense_short_contexts`` does not apply there."""
    pytest.importorskip("nixl")
    with caplog.at_level("INFO", logger="oasis_sglang"):
        a = make(model, kv_sparse="oasis", disaggregation_mode=mode, disaggregation_transfer_backend="nixl",
                 kv_sparse_config='{"pd_lease_s": 30, "pd_read_timeout_s": 2.5}')
    assert a.disaggregation_mode == mode and a.disable_cuda_graph
    assert '"pd_lease_s": 30.0' in a.kv_sparse_config and '"pd_read_timeout_s": 2.5' in a.kv_sparse_config
    said = "dense_short_contexts does not apply on a decode node" in caplog.text
    assert said == (mode == "decode"), caplog.text[-2000:]


@pytest.mark.parametrize("read_mode,predictor,spec,blocked", [
    ("deferred", "previous", False, None), ("wait", "previous", False, "pd_read_mode wait"),
    ("deferred", "current", False, "predictor current"), ("deferred", "lookahead", True, "draft model")])
def test_pd_decode_keeps_cuda_graphs_only_without_reads_inside_a_step(read_mode, predictor, spec, blocked):
    """(The CPU engine captures nothing, so ServerArgs on this machine always disables graphs
    before this check: the rule itself is tested here; the GPU run is docs/benchmarks.md's.)"""
    from oasis_sglang.sglang_glue.server_args import _pd_decode_graph_blocker

    why = _pd_decode_graph_blocker(read_mode, predictor, spec)
    assert (why is None) if blocked is None else (blocked in why)


def test_tp_must_give_each_rank_whole_heads(model):
    """SmolLM2: 9 attention heads, 3 KV heads: --tp 3 (one KV head per rank) and 9 (a replicated
    KV head per rank) are served, 2 is refused naming the flag."""
    with pytest.raises(OasisConfigError, match=r"--tp-size 2 does not split the model's 9 attention heads and 3 KV"):
        make(model, kv_sparse="oasis", tp_size=2)


def test_cpu_tp_sets_sglangs_cpu_environment_unless_the_user_did(model, monkeypatch):
    from oasis_sglang.sglang_glue.server_args import cpu_thread_binding

    monkeypatch.delenv("SGLANG_NCCL_SO_PATH", raising=False)
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0-1|0-1|0-1")
    a = make(model, kv_sparse="oasis", tp_size=3)
    assert a.tp_size == 3
    assert os.environ["SGLANG_NCCL_SO_PATH"].endswith("libnccl.so") and not os.path.exists(os.environ["SGLANG_NCCL_SO_PATH"])
    assert os.environ["SGLANG_CPU_OMP_THREADS_BIND"] == "0-1|0-1|0-1", "a user's binding is kept"
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND")
    make(model, kv_sparse="oasis", tp_size=3)
    assert os.environ["SGLANG_CPU_OMP_THREADS_BIND"] == cpu_thread_binding(3, os.cpu_count())
    assert cpu_thread_binding(3, 2) == "0|1|0" and cpu_thread_binding(2, 8) == "0-3|4-7" and cpu_thread_binding(3, 3) == "0|1|2"
    with pytest.raises(ValueError, match="tp 0"):
        cpu_thread_binding(0, 4)


def test_config_without_oasis_is_an_error(model):
    with pytest.raises(OasisConfigError, match="--kv-sparse oasis"):
        make(model, kv_sparse_config='{"budget_tokens": 512}')


def test_draft_defaults_and_backend(model):
    """A draft gets the paired-forward settings and, on CPU, the intel_amx backend."""
    a = make(model, kv_sparse="oasis", speculative_algorithm="EAGLE3")
    assert (a.speculative_num_steps, a.speculative_eagle_topk, a.speculative_num_draft_tokens) == (1, 1, 2)
    assert a.attention_backend == "intel_amx" and a.dtype == "float32"
    assert a.disable_overlap_schedule            # no overlap scheduler with the paired forward


def test_overlap_barrier_on_a_gpu(monkeypatch):
    """On a GPU the WAR barrier is forced on and coarse, whatever the user's environment said."""
    from types import SimpleNamespace

    from oasis_sglang.sglang_glue.server_args import _overlap_args

    monkeypatch.setenv("SGLANG_ENABLE_WAR_BARRIER", "0")
    monkeypatch.delenv("SGLANG_FORCE_COARSE_WAR_BARRIER", raising=False)
    monkeypatch.delenv("OASIS_SPEC_OVERLAP", raising=False)
    for spec in (None, "EAGLE3"):
        a = SimpleNamespace(disable_overlap_schedule=False)
        _overlap_args(a, spec=spec, cpu=False)
        assert not a.disable_overlap_schedule
        assert os.environ["SGLANG_ENABLE_WAR_BARRIER"] == os.environ["SGLANG_FORCE_COARSE_WAR_BARRIER"] == "1"
        monkeypatch.setenv("SGLANG_ENABLE_WAR_BARRIER", "0")


def test_overlap_with_a_draft_by_algorithm_and_variable(monkeypatch):
    """With a draft on a GPU the overlap scheduler stays on for EAGLE3 outside PD (and its
    barrier is set), off for the algorithms not run with it on a GPU and on PD nodes; OASIS_SPEC_OVERLAP=0 / 1 turns it off / on
    for any of them; --disable-overlap-schedule still wins; the CPU engine keeps it off; any
    value but 0 / 1 is refused, naming the variable."""
    from types import SimpleNamespace

    from oasis_sglang.config import OasisConfigError
    from oasis_sglang.sglang_glue.server_args import _overlap_args

    def on(spec, pd="null", cpu=False, disabled=False):
        a = SimpleNamespace(disable_overlap_schedule=disabled)
        _overlap_args(a, spec, cpu, pd)
        return not a.disable_overlap_schedule

    monkeypatch.delenv("SGLANG_FORCE_COARSE_WAR_BARRIER", raising=False)
    for unset in (None, ""):                                 # empty: unset
        if unset is None:
            monkeypatch.delenv("OASIS_SPEC_OVERLAP", raising=False)
        else:
            monkeypatch.setenv("OASIS_SPEC_OVERLAP", unset)
        assert on("EAGLE3") and on(None)
        assert os.environ["SGLANG_FORCE_COARSE_WAR_BARRIER"] == "1"
        assert not on("EAGLE") and not on("STANDALONE") and not on("NGRAM") and not on("EAGLE3", pd="decode") and not on("EAGLE3", pd="prefill")
        assert not on("EAGLE3", cpu=True) and not on("EAGLE3", disabled=True)
    from oasis_sglang.sglang_glue.server_args import spec_overlap

    assert spec_overlap("EAGLE3") == (True, False) and spec_overlap("NGRAM") == (False, False)
    monkeypatch.setenv("OASIS_SPEC_OVERLAP", "0")
    assert spec_overlap("EAGLE3") == (False, True) and spec_overlap(None) == (True, False)
    assert not on("EAGLE3") and not on("STANDALONE") and on(None)          # (without a draft: unchanged)
    monkeypatch.setenv("OASIS_SPEC_OVERLAP", "1")
    assert on("EAGLE3") and on("STANDALONE") and on("NGRAM") and on("EAGLE3", pd="decode")
    assert not on("EAGLE3", cpu=True) and not on("NGRAM", disabled=True)
    monkeypatch.setenv("OASIS_SPEC_OVERLAP", "yes")
    with pytest.raises(OasisConfigError, match="OASIS_SPEC_OVERLAP='yes'"):
        _overlap_args(SimpleNamespace(disable_overlap_schedule=False), "EAGLE3", False)


def test_record_lengths_by_draft_predictor_pd_and_variable(monkeypatch):
    """Host lengths from the prediction record: with a draft, an asynchronous predictor and
    outside PD; unset, on the CPU engine only; OASIS_RECORD_LENGTHS=0 / 1 turns it off / on;
    any value but 0 / 1 is refused by name."""
    from oasis_sglang.config import OasisConfigError
    from oasis_sglang.sglang_glue.server_args import record_lengths

    monkeypatch.delenv("OASIS_RECORD_LENGTHS", raising=False)
    assert record_lengths("EAGLE3", True) and record_lengths("ngram", True)
    assert not record_lengths("EAGLE3", True, accel=True), "unset: off on a GPU (not run there yet)"
    assert not record_lengths(None, True) and not record_lengths("", True)
    assert not record_lengths("EAGLE3", False), "current: synchronous, no record"
    assert not record_lengths("EAGLE3", True, "decode") and not record_lengths("EAGLE3", True, "prefill")
    monkeypatch.setenv("OASIS_RECORD_LENGTHS", "0")
    assert not record_lengths("EAGLE3", True) and not record_lengths("EAGLE3", True, accel=True)
    monkeypatch.setenv("OASIS_RECORD_LENGTHS", "1")
    assert record_lengths("EAGLE3", True) and record_lengths("EAGLE3", True, accel=True)
    assert not record_lengths("EAGLE3", True, "decode", accel=True) and not record_lengths(None, True, accel=True)
    monkeypatch.setenv("OASIS_RECORD_LENGTHS", "on")
    with pytest.raises(OasisConfigError, match="OASIS_RECORD_LENGTHS='on'"):
        record_lengths("EAGLE3", True)


def test_overlap_scheduler_can_still_be_turned_off(model):
    a = make(model, kv_sparse="oasis", disable_overlap_schedule=True)
    assert a.disable_overlap_schedule


def test_simulated_acceptance_is_refused(model, monkeypatch):
    monkeypatch.setenv("SGLANG_SIMULATE_ACC_LEN", "2")
    with pytest.raises(OasisConfigError, match="SGLANG_SIMULATE_ACC_LEN"):
        make(model, kv_sparse="oasis", speculative_algorithm="EAGLE3")


def test_gpu_path_with_a_draft_reaches_its_checks(model, monkeypatch):
    """The GPU branch of ``handle_kv_sparse_args`` (here forced on a CPU box) runs its draft
    checks: a local ``import os`` in the CPU branch once made ``os`` unbound on every GPU server
    with a draft (UnboundLocalError at start-up, found on the H100 2026-12-07)."""
    from oasis_sglang.sglang_glue import server_args as sa

    monkeypatch.setattr(sa, "_is_cpu", lambda args: False)
    monkeypatch.setenv("SGLANG_SIMULATE_ACC_LEN", "2")
    with pytest.raises(OasisConfigError, match="SGLANG_SIMULATE_ACC_LEN"):
        make(model, kv_sparse="oasis", speculative_algorithm="EAGLE3")


@pytest.mark.parametrize("bad", ["0", "abc", "-0.5", "nan", "2"])
def test_bad_init_new_token_ratio_is_named(model, monkeypatch, bad):
    """OasisKV reads SGLang's SGLANG_INIT_NEW_TOKEN_RATIO to size admission; a value that is not
    in (0, 1] is refused naming the variable (not a ZeroDivisionError or float() traceback)."""
    monkeypatch.setenv("SGLANG_INIT_NEW_TOKEN_RATIO", bad)
    with pytest.raises(OasisConfigError, match="SGLANG_INIT_NEW_TOKEN_RATIO"):
        make(model, kv_sparse="oasis")


def test_ngram_draft_is_a_chain_of_one(model):
    """SGLang's model-free n-gram drafter as the look-ahead source: one draft token (topk 1)."""
    a = make(model, kv_sparse="oasis", speculative_algorithm="NGRAM")
    assert (a.speculative_ngram_max_bfs_breadth, a.speculative_eagle_topk, a.speculative_num_draft_tokens) == (1, 1, 2)
    assert a.attention_backend == "intel_amx"


def _graph_args(**kw):
    from types import SimpleNamespace

    base = dict(disable_cuda_graph=False, speculative_algorithm=None, cuda_graph_config=None,
                cuda_graph_backend_prefill=None, cuda_graph_backend_decode=None, disable_prefill_cuda_graph=False)
    base.update(kw)
    return SimpleNamespace(**base)


def test_cuda_graphs_capture_decode_only():
    """On CUDA, decode steps are captured (SGLang's decode graph runner; with a draft its paired
    TARGET_VERIFY step) and the prefill graph is turned off; on CPU nothing is captured; a
    prefill or piecewise decode graph backend the engine cannot run is refused naming the flag."""
    from oasis_sglang.sglang_glue.server_args import _cuda_graph_args

    a = _graph_args()
    _cuda_graph_args(a, cpu=False)
    assert not a.disable_cuda_graph and a.disable_prefill_cuda_graph
    for spec in ("EAGLE3", "NGRAM"):
        a = _graph_args(speculative_algorithm=spec)
        _cuda_graph_args(a, cpu=False)
        assert not a.disable_cuda_graph and a.disable_prefill_cuda_graph, spec
        a = _graph_args(speculative_algorithm=spec, cuda_graph_backend_decode="full")
        _cuda_graph_args(a, cpu=False)
        assert not a.disable_cuda_graph, "a full decode graph with a draft is what OasisKV captures"
    a = _graph_args()
    _cuda_graph_args(a, cpu=True)
    assert a.disable_cuda_graph
    from sglang.srt.model_executor.cuda_graph_config import default_cuda_graph_config

    obj = default_cuda_graph_config()
    obj.prefill.backend = "breakable"
    for kw, flag in ((dict(cuda_graph_backend_prefill="breakable"), "--cuda-graph-backend-prefill"),
                     (dict(cuda_graph_backend_decode="tc_piecewise"), "--cuda-graph-backend-decode"),
                     (dict(cuda_graph_config='{"prefill": {"backend": "full"}}'), "--cuda-graph-config"),
                     (dict(cuda_graph_config='{"decode": {"backend": "breakable"}}'), "--cuda-graph-config"),
                     (dict(cuda_graph_config=obj), "--cuda-graph-config"),
                     (dict(cuda_graph_config="{not json"), "--cuda-graph-config"),
                     (dict(cuda_graph_config="[1, 2]"), "--cuda-graph-config"),
                     (dict(speculative_algorithm="NGRAM", cuda_graph_backend_decode="breakable"),
                      "--cuda-graph-backend-decode"),
                     (dict(speculative_algorithm="EAGLE3", cuda_graph_config={"decode": {"backend": "breakable"}}),
                      "--cuda-graph-config"),
                     (dict(disable_cuda_graph=True, cuda_graph_backend_prefill="breakable"),
                      "--cuda-graph-backend-prefill")):
        with pytest.raises(OasisConfigError, match=flag):
            _cuda_graph_args(_graph_args(**kw), cpu=False)
    a = _graph_args(cuda_graph_config='{"decode": {"backend": "full", "max_bs": 32}}')
    _cuda_graph_args(a, cpu=False)
    assert not a.disable_cuda_graph
