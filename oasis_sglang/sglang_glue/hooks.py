"""Every SGLang symbol oasis-sglang hooks, in one place, and the start-up check.

SGLang's ``HookRegistry`` only logs a target that fails to resolve; ``check_plugin_ready``
turns that into a start-up error when ``--kv-sparse oasis`` is requested.
"""

from __future__ import annotations

import pkgutil
from dataclasses import dataclass
from typing import Callable

PLUGIN_NAME = "oasis"


@dataclass(frozen=True)
class Hook:
    """One hooked SGLang symbol: dotted target, HookType name, our implementation and why."""
    target: str           # dotted path in sglang 0.5.17
    kind: str             # HookType name: AROUND / AFTER / BEFORE / REPLACE
    impl: str             # "module:function" in oasis_sglang
    why: str


HOOKS: tuple[Hook, ...] = (
    Hook("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_mha_kv_pool", "AROUND",
         "oasis_sglang.sglang_glue.pool:build_mha_kv_pool_hook",
         "build OasisKVPool (sparse layers' KV in the host tier) instead of MHATokenToKVPool"),
    Hook("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.config_from_budget", "AROUND",
         "oasis_sglang.sglang_glue.pool:config_from_budget_hook",
         "size the KV cache by OasisKV's device and host shares per token (SGLang counts every layer on the "
         "device and caps --max-total-tokens to that)"),
    Hook("sglang.srt.model_executor.model_runner.ModelRunner.init_attention_backends", "AFTER",
         "oasis_sglang.sglang_glue.install:init_attention_backends_hook",
         "create the OasisKV state and wrap the attention backend"),
    Hook("sglang.srt.managers.scheduler.Scheduler.run_batch", "BEFORE",
         "oasis_sglang.sglang_glue.scheduler_hooks:run_batch_hook",
         "the batch's request rows on the host (ForwardBatch keeps them on the device only)"),
    Hook("sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.can_run_graph", "AFTER",
         "oasis_sglang.sglang_glue.scheduler_hooks:can_run_graph_hook",
         "replay a captured decode step only when every row was predicted (host check); else run it eagerly"),
    Hook("sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.capture_one_shape", "AROUND",
         "oasis_sglang.sglang_glue.graph_hooks:capture_one_shape_hook",
         "capture each batch size once more as the dense path for short contexts (variant \"oasis_dense\")"),
    Hook("sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner._resolve_lora_variant",
         "AFTER", "oasis_sglang.sglang_glue.graph_hooks:resolve_variant_hook",
         "replay the dense-path graph when the step's bookkeeping chose the dense path"),
    Hook("sglang.srt.managers.scheduler.Scheduler.on_idle", "BEFORE",
         "oasis_sglang.sglang_glue.scheduler_hooks:on_idle_hook",
         "write the OasisKV decode lines still queued once the server is idle"),
    Hook("sglang.srt.mem_cache.memory_pool.ReqToTokenPool.free", "BEFORE",
         "oasis_sglang.sglang_glue.scheduler_hooks:req_free_hook",
         "free the working set of a finished request"),
    Hook("sglang.srt.mem_cache.memory_pool.ReqToTokenPool.clear", "AFTER",
         "oasis_sglang.sglang_glue.scheduler_hooks:req_clear_hook",
         "flush: free every working set"),
    Hook("sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.alloc_extend", "AROUND",
         "oasis_sglang.sglang_glue.fixes.cpu_paged_allocator:alloc_extend_hook",
         "page_size = block_size on CPU: SGLang's paged allocator is Triton-only"),
    Hook("sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.alloc_decode", "AROUND",
         "oasis_sglang.sglang_glue.fixes.cpu_paged_allocator:alloc_decode_hook",
         "page_size = block_size on CPU: SGLang's paged allocator is Triton-only"),
    Hook("sglang.srt.mem_cache.allocation.get_last_loc", "AROUND",
         "oasis_sglang.sglang_glue.fixes.cpu_paged_allocator:get_last_loc_hook",
         "page_size > 1 on CPU with EAGLE (intel_amx): SGLang dispatches get_last_loc to Triton"),
    # EAGLE on the CPU engine (any --kv-sparse; no-ops unless needed: see fixes/spec_cpu.py)
    Hook("sglang.srt.layers.attention.intel_amx_backend.IntelAMXAttnBackend.forward_extend", "AROUND",
         "oasis_sglang.sglang_glue.fixes.spec_cpu:forward_extend_hook",
         "0.5.17 bug (intel_amx_backend.py:216): the target-verify pass must see seq_lens + draft tokens"),
    Hook("sglang.srt.layers.attention.intel_amx_backend.IntelAMXAttnBackend.forward_decode", "AROUND",
         "oasis_sglang.sglang_glue.fixes.spec_cpu:forward_decode_hook",
         "0.5.17 bug (intel_amx_backend.py:262): multi-step draft decode must see its per-candidate seq_lens"),
    Hook("sglang.srt.arg_groups.overrides._attention_backend_platform_fallbacks", "AROUND",
         "oasis_sglang.sglang_glue.fixes.spec_cpu:platform_fallback_hook",
         "keep intel_amx (torch ops) for speculative decoding on a CPU without AMX: EAGLE has no torch_native backend"),
    Hook("sglang.kernels.ops.speculative.ngram_corpus.load_jit", "AROUND",
         "oasis_sglang.sglang_glue.fixes.spec_cpu:ngram_load_jit_hook",
         "0.5.17 bug: the n-gram corpus C++ (NGRAM drafter) misses #include <cstddef> and fails to build with g++ 13"),
    Hook("sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request", "BEFORE",
         "oasis_sglang.sglang_glue.fixes.input_ids:validate_input_ids_hook",
         "0.5.17 bug: out-of-vocabulary input_ids (and top_logprobs_num above the vocabulary) kill the scheduler; refuse them with a 400"),
    # SGLang's PD mode (NIXL) on the CPU engine (any --kv-sparse; no-ops off CPU unless
    # OASIS_NIXL_PROGRESS_DELAY_US is set: see fixes/pd_cpu.py)
    Hook("sglang.srt.disaggregation.nixl.conn.NixlKVManager.__init__", "BEFORE",
         "oasis_sglang.sglang_glue.fixes.pd_cpu:nixl_manager_init_hook",
         "CPU engine: register the KV pool with NIXL as DRAM, not VRAM, and pause NIXL's progress thread "
         "between polls (nixl's Python API fixes pthrDelay = 0: a core spun per agent)"),
    Hook("sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.maybe_send_cached_prefix_chunk",
         "AROUND", "oasis_sglang.sglang_glue.fixes.pd_cpu:early_send_hook",
         "CPU engine: skip the optional early send of a cached prefix (it records a CUDA event)"),
    # --kv-sparse oasis with PD disaggregation (NIXL): disagg/serving.py (inert without a PD side)
    Hook("sglang.srt.disaggregation.common.conn.CommonKVBootstrapServer._setup_routes", "AFTER",
         "oasis_sglang.disagg.sglang_hooks:bootstrap_routes_hook",
         "the bootstrap server's /oasis/tier route: prefill ranks publish their host tier's NIXL layout there"),
    Hook("sglang.srt.disaggregation.common.conn.CommonKVManager.register_to_bootstrap", "AFTER",
         "oasis_sglang.disagg.sglang_hooks:register_to_bootstrap_hook",
         "a prefill rank registers its host tier (the staging pool) beside SGLang's own registration"),
    Hook("sglang.srt.disaggregation.prefill.release_kv_cache", "AROUND",
         "oasis_sglang.disagg.sglang_hooks:prefill_release_hook",
         "after a transfer the prefill pages are leased to the decode node (it reads blocks on demand)"),
    Hook("sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.handle_inflight_transfer_failure",
         "AROUND", "oasis_sglang.disagg.sglang_hooks:transfer_failure_hook",
         "a transfer that failed on any TP rank frees its pages on every rank (one rank's own poll may say Success)"),
    Hook("sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.send_kv_chunk", "AROUND",
         "oasis_sglang.disagg.sglang_hooks:send_kv_chunk_hook",
         "the first decode step's working set, planned on the prefill node, rides with the request's last send"),
    Hook("sglang.srt.disaggregation.common.conn.CommonKVSender.should_send_kv_chunk", "AFTER",
         "oasis_sglang.disagg.sglang_hooks:should_send_kv_chunk_hook",
         "an OasisKV prefill node sends a request in one piece (every page carries its first-step mask)"),
    Hook("sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue",
         "AFTER", "oasis_sglang.disagg.sglang_hooks:prefill_poll_hook",
         "free the leases released by decode nodes (NIXL notifications) or expired"),
    Hook("sglang.srt.managers.scheduler_components.invariant_checker.SchedulerInvariantChecker._check_full_pool",
         "AROUND", "oasis_sglang.disagg.sglang_hooks:check_full_pool_hook",
         "SGLang's idle memory check: pages held under PD leases are accounted, not a leak"),
    Hook("sglang.srt.managers.scheduler_components.invariant_checker.SchedulerInvariantChecker._check_req_pool",
         "AROUND", "oasis_sglang.disagg.sglang_hooks:check_req_pool_hook",
         "SGLang's idle memory check: request rows held under PD leases are accounted, not a leak"),
    Hook("sglang.srt.managers.scheduler.Scheduler.flush_cache", "AROUND",
         "oasis_sglang.disagg.sglang_hooks:flush_cache_hook",
         "a prefill node with PD leases is not idle: refuse /flush_cache (it would free leased rows and pages)"),
    Hook("sglang.srt.disaggregation.decode.DecodeTransferQueue.pop_transferred", "AFTER",
         "oasis_sglang.disagg.sglang_hooks:pop_transferred_hook",
         "admit a transferred request: its blocks are backed by the prefill node's pages"),
    Hook("sglang.srt.disaggregation.decode.DecodePreallocQueue._ensure_prefill_info", "AROUND",
         "oasis_sglang.disagg.sglang_hooks:ensure_prefill_info_hook",
         "refuse a prefill node of another --tp-size before SGLang registers this node's KV buffers there (0.5.17's NIXL "
         "fails in the prefill's bootstrap thread on a mixed-TP transfer to host memory, stopping that node)"),
    Hook("sglang.srt.disaggregation.common.conn.CommonKVManager._handle_node_failure", "AFTER",
         "oasis_sglang.disagg.sglang_hooks:node_failure_hook",
         "a prefill node SGLang's heartbeat lost: the requests it transferred, decoding here, end at once if its "
         "process is gone (SGLang fails only those not transferred yet)"),
    Hook("sglang.srt.disaggregation.nixl.conn.NixlKVManager._handle_abort_notification", "AROUND",
         "oasis_sglang.disagg.sglang_hooks:abort_notification_hook",
         "a request a decode node refused (e.g. another --tp-size) ends on the prefill node with the decode node's reason"),
    Hook("sglang.srt.disaggregation.nixl.conn.NixlKVSender.__init__", "AFTER",
         "oasis_sglang.disagg.sglang_hooks:sender_init_hook",
         "a request a decode node refused before this prefill node made its sender fails when it is made "
         "(SGLang drops such an ABORT, and its NIXL sender never times out while bootstrapping)"),
    Hook("sglang.srt.disaggregation.decode.DecodeReqToTokenPool.free", "BEFORE",
         "oasis_sglang.disagg.sglang_hooks:decode_req_free_hook",
         "free a finished decode request's working set and remote pages (ReqToTokenPool.free's hook does not fire here)"),
    Hook("sglang.srt.managers.schedule_batch.release_req", "AROUND",
         "oasis_sglang.disagg.sglang_hooks:release_req_hook",
         "a retracted PD decode request: no CPU copy of its KV (sparse placeholders); its prefill node recomputes it"),
    Hook("sglang.srt.disaggregation.decode.DecodePreallocQueue.add", "AROUND",
         "oasis_sglang.disagg.sglang_hooks:prealloc_add_hook",
         "a retracted PD decode request is recomputed by its prefill node (SGLang's PD rebootstrap)"),
    Hook("sglang.srt.disaggregation.decode.DecodeReqToTokenPool.clear", "AFTER",
         "oasis_sglang.disagg.sglang_hooks:decode_req_clear_hook",
         "flush on a decode node: free every working set and remote page"),
    # the draft token as OasisKV's look-ahead probe (inert unless --kv-sparse oasis runs with a draft)
    Hook("sglang.srt.speculative.eagle_utils.verify_tree_greedy_func", "AROUND",
         "oasis_sglang.sglang_glue.spec_probe:verify_tree_greedy_hook",
         "probe mode: reject every draft (its K/V are not kept), so output equals plain greedy decoding"),
    Hook("sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker.init_attention_backend", "AFTER",
         "oasis_sglang.sglang_glue.draft_backend:draft_backend_hook",
         "the draft layer's DRAFT_EXTEND_V2 pass through split-KV paged attention (SGLang runs its prefill kernel)"),
    Hook("sglang.srt.speculative.eagle_utils.eagle_sample", "AROUND",
         "oasis_sglang.sglang_glue.spec_probe:eagle_sample_hook",
         "probe mode: verify greedily, so rejection sampling cannot accept a draft whose K/V are not kept"),
)

_registered = False


def _impl(h: Hook) -> Callable:
    mod, fn = h.impl.split(":")
    return getattr(__import__(mod, fromlist=[fn]), fn)


def unresolved_targets() -> list[str]:
    """Targets (and implementations) that do not resolve, as ``"target: error"`` lines."""
    bad = []
    for h in HOOKS:
        try:
            pkgutil.resolve_name(h.target)
        except Exception as e:  # noqa: BLE001 - report every failure
            bad.append(f"{h.target}: {type(e).__name__}: {e}")
        try:
            _impl(h)
        except Exception as e:  # noqa: BLE001
            bad.append(f"{h.impl}: {type(e).__name__}: {e}")
    return bad


def register() -> None:
    """Entry point of the ``sglang.srt.plugins`` group: register every hook in ``HOOKS``.

    The OasisKV hooks are inert unless ``--kv-sparse oasis`` is set (each one checks the server
    args); the EAGLE-on-CPU hooks (``fixes.spec_cpu``) act only on the CPU engine's ``intel_amx``
    backend with speculative decoding.
    """
    global _registered
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for h in HOOKS:
        HookRegistry.register(h.target, _impl(h), HookType[h.kind])
    _registered = True


def check_plugin_ready() -> None:
    """Make sure the plugin is loaded and every hook target resolved and was applied.

    Raises:
        RuntimeError: listing the targets that failed, or saying the plugin did not load
            (for instance ``SGLANG_PLUGINS`` excludes ``oasis``).
    """
    bad = unresolved_targets()
    if bad:
        raise RuntimeError("oasis-sglang: hook targets do not resolve in this SGLang:\n  " + "\n  ".join(bad))
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    load_plugins()
    if not _registered:
        raise RuntimeError(
            "oasis-sglang: the 'oasis' plugin was not loaded (is oasis-sglang installed, and does "
            "SGLANG_PLUGINS include 'oasis'?)")
    HookRegistry.apply_hooks()
    missing = [h.target for h in HOOKS if h.target not in HookRegistry._patched]
    if missing:
        raise RuntimeError("oasis-sglang: hooks were not applied to: " + ", ".join(missing))
