"""sglang_glue/install.py: the memory check and the hook that builds OasisKV into a model runner
(real ServerArgs, KV pools, request table and SGLang attention backend on the CPU; ModelRunner
itself is too heavy to build here, so the runner is a namespace holding those real objects)."""

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.configs.model_config import AttentionArch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.server_args import ServerArgs

from oasis_sglang.config import OasisConfig, OasisConfigError
from oasis_sglang.core import OasisSparseKV
from oasis_sglang.sglang_glue.attn_backend import OasisAttnBackend
from oasis_sglang.sglang_glue.install import check_memory, init_attention_backends_hook
from oasis_sglang.sglang_glue.pool import OasisKVPool
from oasis_sglang.sglang_glue.runtime import OasisRuntime

CFG = OasisConfig(budget_tokens=16, block_size=4, dense_layers=(0,))
BIG = 10**15                                    # ~909 TiB: more than any host has


def test_check_memory_passes_a_small_plan_on_the_cpu():
    plan = OasisSparseKV.memory_plan(CFG, 3, 1024, 8, 2, 16, 16, 4)
    assert 0 < sum(plan.values()) < 2**20
    assert check_memory(CFG, plan, "cpu") is None
    assert check_memory(CFG, plan, torch.device("cpu")) is None


@pytest.mark.parametrize("part", ["working_set", "summaries", "host_tier"])
def test_check_memory_refuses_a_plan_that_does_not_fit_naming_the_flags(part):
    plan = {"working_set": 0, "summaries": 0, "host_tier": 0}
    plan[part] = BIG
    with pytest.raises(OasisConfigError) as e:
        check_memory(CFG, plan, "cpu")
    msg = str(e.value)
    for flag in ("budget_tokens", "--max-running-requests", "--max-total-tokens"):
        assert flag in msg, flag
    assert msg.startswith("--kv-sparse oasis: not enough memory")
    assert "budget_tokens=16 x --max-running-requests rows" in msg
    assert f"{BIG / 2**30:.2f} GiB" in msg and "free on cpu" in msg


def test_check_memory_counts_every_tp_rank_on_the_host():
    """TP ranks start together: each checks all ranks' host tiers against what is available."""
    import psutil

    half = psutil.virtual_memory().available // 2
    plan = {"working_set": 0, "summaries": 0, "host_tier": half - 2**20}
    assert check_memory(CFG, plan, "cpu", host_ranks=1) is None
    with pytest.raises(OasisConfigError, match="per TP rank, 3 ranks on this host"):
        check_memory(CFG, plan, "cpu", host_ranks=3)


# ---- init_attention_backends_hook ----------------------------------------------------------

@pytest.fixture(scope="module")
def oasis_args(model, restore_env):
    return ServerArgs(model_path=model, device="cpu", kv_sparse="oasis",
                      kv_sparse_config='{"budget_tokens": 16, "block_size": 4, "dense_layers": [0]}')


@pytest.fixture(scope="module")
def plain_args(model, restore_env):
    return ServerArgs(model_path=model, device="cpu")


def _runner(server_args, pool_cls=OasisKVPool, layers=3, start_layer=None, kv_dtype=torch.float32, **extra):
    """What the hook reads of a ModelRunner after SGLang's init_attention_backends."""
    kw = dict(oasis_cfg=OasisConfig.from_json(server_args.kv_sparse_config)) if pool_cls is OasisKVPool else {}
    pool = pool_cls(size=64, page_size=4, dtype=kv_dtype, head_num=2, head_dim=16, layer_num=layers,
                    device="cpu", enable_memory_saver=False, start_layer=start_layer, **kw)
    rtp = ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
    mr = SimpleNamespace(server_args=server_args, device="cpu", token_to_kv_pool=pool, req_to_token_pool=rtp,
                         model_config=SimpleNamespace(attention_arch=AttentionArch.MHA, num_hidden_layers=3,
                                                      hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"])),
                         use_mla_backend=False, is_draft_worker=False)
    mr.attn_backend = TorchNativeAttnBackend(mr)
    mr.__dict__.update(extra)
    return mr


def test_the_hook_builds_the_engine_and_wraps_the_backends(oasis_args, monkeypatch):
    monkeypatch.delenv("OASIS_ABLATE", raising=False)
    mr = _runner(oasis_args)
    inner = mr.attn_backend
    mr.decode_attn_backend = inner                    # the same backend twice: wrapped once
    mr.decode_attn_backend_group = [inner, None]
    sentinel = object()
    assert init_attention_backends_hook(sentinel, mr) is sentinel
    pool, rtp = mr.token_to_kv_pool, mr.req_to_token_pool
    eng = pool.oasis
    assert isinstance(eng, OasisSparseKV) and isinstance(rtp._oasis, OasisRuntime) and rtp._oasis.engine is eng
    assert eng.sparse_layers == [1, 2] and eng.ws.R == rtp.req_to_token.shape[0] == 5
    assert eng.host.capacity_tokens == pool.size + pool.page_size == 68
    assert (eng.head_num, eng.head_dim, eng.v_head_dim, eng.host.dtype) == (2, 16, 16, torch.float32)
    assert eng.padding_row == 0 and eng.predictor.name == "current" and eng.ops.name == "torch"
    assert not eng.bench.skip_admission_copy
    assert isinstance(mr.attn_backend, OasisAttnBackend) and mr.attn_backend.inner is inner
    assert mr.decode_attn_backend is mr.attn_backend and mr.decode_attn_backend_group == [mr.attn_backend, None]
    be = mr.attn_backend
    assert be.runtime is rtp._oasis and be.pool is pool and be.req_to_token_pool is rtp and be.engine is eng
    assert be.log.engine is eng and be.log.interval == oasis_args.decode_log_interval and be.log.metrics is None


@pytest.mark.parametrize("kv", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_the_hook_builds_an_fp8_engine_and_refuses_kv_scales(oasis_args, kv):
    """SGLang's fp8 pool (uint8 storage, fp8 dtype): host tier and working set in fp8, summaries
    in the model's dtype; a layer with a checkpoint KV scale other than 1 is refused by name."""
    from sglang.srt.layers.radix_attention import RadixAttention

    model = torch.nn.ModuleDict({"attn": RadixAttention(4, 16, 0.25, 2, 1)})
    mr = _runner(oasis_args, kv_dtype=kv, dtype=torch.bfloat16, model=model)
    assert mr.token_to_kv_pool.store_dtype == torch.uint8
    init_attention_backends_hook(None, mr)
    eng = mr.token_to_kv_pool.oasis
    assert eng.host.dtype == eng.ws.k[0].dtype == eng.kv_dtype == kv and eng.summaries.kmin[0].dtype == torch.bfloat16
    assert eng.block_bytes == 4 * (16 + 16)              # 1 byte per element: half the bf16 bytes per block
    model.attn.k_scale_float = model.attn.v_scale_float = 1.0           # no-op scales are served
    init_attention_backends_hook(None, _runner(oasis_args, kv_dtype=kv, dtype=torch.bfloat16, model=model))
    model.attn.k_scale, model.attn.k_scale_float = torch.nn.Parameter(torch.tensor(0.5)), 0.5
    with pytest.raises(OasisConfigError, match=r"--kv-cache-dtype .*layer attn has KV scales k_scale=0.5"):
        init_attention_backends_hook(None, _runner(oasis_args, kv_dtype=kv, dtype=torch.bfloat16, model=model))


def test_under_tp_each_rank_builds_its_engine_and_only_rank_0_writes_lines(oasis_args, caplog):
    """The pool holds this rank's KV heads (tp_k_head_num): the engine is built on them; rank 0
    writes the start-up and decode lines and owns the metrics, the others stay quiet."""
    import logging

    engines = []
    for rank in (0, 1):
        mr = _runner(oasis_args, ps=SimpleNamespace(tp_rank=rank, tp_size=2))     # ModelRunner.ps (0.5.17)
        with caplog.at_level(logging.INFO, logger="oasis_sglang.sglang_glue.install"):
            caplog.clear()
            init_attention_backends_hook(None, mr)
        eng, log = mr.token_to_kv_pool.oasis, mr.attn_backend.log
        engines.append(eng)
        assert eng.head_num == mr.token_to_kv_pool.head_num == 2
        assert log.emit == (rank == 0)
        started = [r.message for r in caplog.records if "OasisKV:" in r.message and "kernels" in r.message]
        assert (len(started), rank) in ((1, 0), (0, 1))
        if rank == 0:
            assert "per TP rank: 2 ranks, 2 KV head(s) each" in started[0]
    assert engines[0] is not engines[1] and engines[0].host.k[0].data_ptr() != engines[1].host.k[0].data_ptr()


def test_the_hook_applies_oasis_ablate(oasis_args, monkeypatch):
    monkeypatch.setenv("OASIS_ABLATE", "no-transfer")
    mr = _runner(oasis_args)
    init_attention_backends_hook(None, mr)
    assert mr.token_to_kv_pool.oasis.bench.skip_admission_copy


def test_without_kv_sparse_or_on_the_draft_model_the_runner_is_left_alone(plain_args, oasis_args):
    for args, draft in ((plain_args, False), (oasis_args, True)):
        mr = _runner(oasis_args)
        mr.server_args, mr.is_draft_worker = args, draft
        inner = mr.attn_backend
        assert init_attention_backends_hook("r", mr) == "r"
        assert mr.attn_backend is inner and mr.token_to_kv_pool.oasis is None
        assert not hasattr(mr.req_to_token_pool, "_oasis")


def test_the_hook_refuses_what_oasis_cannot_serve(oasis_args):
    with pytest.raises(OasisConfigError, match="MHATokenToKVPool.*only plain MHA/GQA"):
        init_attention_backends_hook(None, _runner(oasis_args, pool_cls=MHATokenToKVPool))
    with pytest.raises(OasisConfigError, match="MLA/DSA models are not supported"):
        init_attention_backends_hook(None, _runner(oasis_args, use_mla_backend=True))
    mla = _runner(oasis_args)
    mla.model_config.attention_arch = AttentionArch.MLA       # the model's own architecture, whatever the backend
    with pytest.raises(OasisConfigError, match="MLA/DSA models are not supported"):
        init_attention_backends_hook(None, mla)
    with pytest.raises(OasisConfigError, match="pipeline parallelism"):
        init_attention_backends_hook(None, _runner(oasis_args, layers=2))
    with pytest.raises(OasisConfigError, match="pipeline parallelism"):
        init_attention_backends_hook(None, _runner(oasis_args, start_layer=1))


def test_free_pages_include_sglangs_open_free_group():
    """SGLang frees a batch's finished requests in one free group and lists their pages as free
    only at its end, after OasisKV's release hook ran for each: ``free_pages_of`` counts the
    group's pages (``free`` and ``free_segment``) as free, so two requests ending in one step
    give back the OS pages their blocks share."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    from oasis_sglang.sglang_glue.install import free_pages_of

    ps = 4
    a = PagedTokenToKVPoolAllocator(16 * ps, ps, torch.int64, "cpu", kvcache=None, need_sort=True)
    before = set(free_pages_of(a).tolist())
    taken = a.free_pages[:3].clone()
    a.free_pages = a.free_pages[3:]
    assert set(free_pages_of(a).tolist()) == before - set(taken.tolist())
    a.free_group_begin()
    a.free(taken[0] * ps + torch.arange(ps))                           # a request's page, token slots
    a.free_segment(taken[1] * ps + torch.arange(2 * ps), start_pos=0)  # and two pages (page reps)
    got = set(free_pages_of(a).tolist())
    listed = set(torch.cat([a.free_pages, a.release_pages]).tolist())
    assert {int(taken[0]), int(taken[1]), int(taken[1]) + 1} <= got
    assert int(taken[0]) not in listed                                 # SGLang's lists: not yet
    a.free_group_end()
    assert set(free_pages_of(a).tolist()) == got == set(torch.cat([a.free_pages, a.release_pages]).tolist())


def test_a_pd_decode_node_refuses_a_compact_pool_below_one_requests_working_set(model, restore_env):
    """``pd_host_slots`` below one request's pieces (sparse layers x KV heads x budget blocks) on
    a decode node: its blocks could never all be read and its steps would attend without them
    (wrong text with HTTP 200, a breaker's finding): refused at start-up naming the key and the
    minimum. (A prefill node, or no PD, ignores the key.)"""
    sa = ServerArgs(model_path=model, device="cpu", kv_sparse="oasis", kv_sparse_config=(
        '{"budget_tokens": 16, "block_size": 4, "dense_layers": [0], "pd_host_slots": 15}'))

    class AsDecodeNode:                  # the same arguments on a PD decode node
        def __getattr__(self, name):
            return "decode" if name == "disaggregation_mode" else getattr(sa, name)

    with pytest.raises(OasisConfigError, match=r"'pd_host_slots' 15 is below one request's working set on this rank: "
                                               r"16 pieces \(2 sparse layers x 2 KV heads x 4 blocks"):
        init_attention_backends_hook(None, _runner(AsDecodeNode()))
    init_attention_backends_hook(None, _runner(sa))          # not a decode node: the key is not used
