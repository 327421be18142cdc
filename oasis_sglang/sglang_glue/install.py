"""Building OasisKV into a model runner: the memory check, the engine, the wrapped backends.

``init_attention_backends_hook`` runs AFTER SGLang's ``ModelRunner.init_attention_backends``
(``model_executor/model_runner.py``), once the KV pool (``pool.OasisKVPool``) and the request
table exist: it checks the model and the memory, builds ``core.OasisSparseKV``, attaches an
:class:`~.runtime.OasisRuntime` to the request table and wraps every attention backend the
runner holds in ``attn_backend.OasisAttnBackend``.
"""

from __future__ import annotations

import logging

import torch

from ..config import OasisConfig, OasisConfigError
from ..core import OasisSparseKV
from ..core.bench_hooks import BenchHooks
from ..core.kv_dtype import is_fp8, summary_dtype
from .runtime import OasisRuntime
from .server_args import record_lengths

logger = logging.getLogger(__name__)


def init_attention_backends_hook(result, model_runner, *args, **kwargs):
    """AFTER ``ModelRunner.init_attention_backends``: build the OasisKV state and wrap backends.

    Raises:
        OasisConfigError: an MLA/DSA model, a KV pool other than ``OasisKVPool`` (hybrid,
            sliding-window or quantized KV), pipeline parallelism, an fp8 KV cache with per-layer
            KV scales other than 1, or not enough memory.
    """
    from .server_args import oasis_config

    sa = model_runner.server_args
    cfg = oasis_config(sa)
    if cfg is None or getattr(model_runner, "is_draft_worker", False):
        return result                       # the draft model keeps SGLang's own KV cache and backend
    from .attn_backend import OasisAttnBackend
    from .log_line import DecodeLog, log_interval
    from .metrics import make_metrics
    from .pool import OasisKVPool

    mc = model_runner.model_config
    arch = getattr(mc, "attention_arch", None)
    if "MLA" in str(getattr(arch, "name", arch)).upper() or getattr(model_runner, "use_mla_backend", False):
        raise OasisConfigError(f"--kv-sparse oasis: MLA/DSA models are not supported ({mc.hf_config.architectures})")
    pool = model_runner.token_to_kv_pool
    if not isinstance(pool, OasisKVPool):
        raise OasisConfigError(
            f"--kv-sparse oasis: this model uses {type(pool).__name__} (hybrid, sliding-window or "
            f"quantized KV); only plain MHA/GQA KV caches are supported")
    if pool.start_layer != 0 or pool.layer_num != mc.num_hidden_layers:
        raise OasisConfigError("--kv-sparse oasis: pipeline parallelism is not supported")
    rtp = model_runner.req_to_token_pool
    dims = dict(num_layers=pool.layer_num, num_tokens=pool.size + pool.page_size, num_rows=rtp.req_to_token.shape[0],
                head_num=pool.head_num, head_dim=pool.head_dim, v_head_dim=pool.v_head_dim)
    # tensor parallelism: each rank serves its own KV heads (the pool's tp_k_head_num) with its own
    # engine, no collective; rank 0 writes the log lines and the metrics (its heads' counters)
    ps = getattr(model_runner, "ps", None) or model_runner            # SGLang 0.5.17: ModelRunner.ps.tp_rank
    tp_rank, tp_size = int(getattr(ps, "tp_rank", 0) or 0), int(getattr(ps, "tp_size", 1) or 1)
    first = tp_rank == 0
    host_ranks = max(1, tp_size // max(1, int(getattr(sa, "nnodes", 1) or 1)))     # ranks whose host tiers share this host
    compute_dtype = model_runner.dtype if is_fp8(pool.dtype) else None
    if compute_dtype is not None:
        check_kv_scales(model_runner.model, sa.kv_cache_dtype)
    sdtype = summary_dtype(pool.dtype, compute_dtype)
    pd = str(getattr(sa, "disaggregation_mode", "null") or "null")
    # a PD decode node with pd_host_slots: a compact host tier of that many pieces (disagg/README.md)
    host_slots = cfg.pd_host_slots if pd == "decode" else None
    if first and cfg.pd_host_slots is not None and pd != "decode":
        logger.warning("OasisKV: kv_sparse_config 'pd_host_slots' %d is ignored: it sizes a PD decode node's host "
                       "tier, and this server runs --disaggregation-mode %s (its host tier holds every block)",
                       cfg.pd_host_slots, pd)
    if host_slots is not None:
        need = (dims["num_layers"] - len(cfg.dense_layers)) * dims["head_num"] * cfg.budget_blocks
        if host_slots < need:
            # fewer pieces than one request's working set: its blocks could never all be read, and
            # its decode steps would attend without them (wrong output, HTTP 200)
            raise OasisConfigError(
                f"kv_sparse_config: 'pd_host_slots' {host_slots} is below one request's working set on this rank: "
                f"{need} pieces ({dims['num_layers'] - len(cfg.dense_layers)} sparse layers x {dims['head_num']} KV "
                f"heads x {cfg.budget_blocks} blocks of budget_tokens); give at least that many per request decoding "
                f"at once, or null (the whole host tier)")
    check_memory(cfg, OasisSparseKV.memory_plan(cfg, **dims, dtype_bytes=torch.empty((), dtype=pool.dtype).element_size(),
                                                summary_dtype_bytes=torch.empty((), dtype=sdtype).element_size(),
                                                host_slots=host_slots),
                 model_runner.device, host_ranks=host_ranks)
    from oasis_sglang.kernels import get_kv_ops

    ops = get_kv_ops(cfg.kernel_backend(torch.device(model_runner.device).type))
    algo = str(getattr(sa, "speculative_algorithm", "") or "")
    predictor = cfg.predictor_for(has_draft=bool(algo), model_free_draft=algo.upper() == "NGRAM")
    draft_match = None
    if algo:
        from . import spec_probe

        spec_probe.activate()
        draft_match = spec_probe.draft_match
    # ReqToTokenPool never hands out row 0; decode CUDA graphs pad with it
    engine = OasisSparseKV(cfg, **dims, dtype=pool.dtype, device=model_runner.device, ops=ops, predictor=predictor,
                           padding_row=0, compute_dtype=compute_dtype, host_slots=host_slots)
    engine.bench = BenchHooks.from_env()
    runtime = OasisRuntime(engine)
    accel = torch.device(model_runner.device).type != "cpu"
    runtime.record_lengths = record_lengths(algo, engine.predictor.asynchronous, pd, accel)
    engine.check_replays = runtime.record_lengths    # (the device check of each replay's host decision)
    if first and runtime.record_lengths:
        logger.info("OasisKV: decode steps take their host lengths from the prediction record (the %s draft is "
                    "never accepted: one token a step); compared with SGLang's host copy where it makes one, and "
                    "on the device at each replay (OASIS_RECORD_LENGTHS=0: SGLang's copy)", algo.upper())
    elif first and algo and accel and engine.predictor.asynchronous and pd == "null":
        logger.info("OasisKV: decode steps take SGLang's host copy of their lengths, which its overlapped speculative "
                    "worker waits for a step's verify to publish; OASIS_RECORD_LENGTHS=1 takes them from the "
                    "prediction record instead (not run on a GPU yet)")
    pool.oasis = engine
    rtp._oasis = runtime
    if pd in ("prefill", "decode"):
        if not engine.sparse_layers:
            raise OasisConfigError("--kv-sparse oasis with --disaggregation-mode: 'dense_layers' lists every layer; "
                                   "PD needs at least one sparse layer (or run --kv-sparse none)")
        # PD: the host tier is the prefill node's staging pool / the decode node's cache of read
        # blocks, registered with NIXL (disagg/serving.py)
        from oasis_sglang.disagg import serving

        serving.set_side(serving.PrefillSide(engine, cfg.pd_lease_s, tp_rank, tp_size) if pd == "prefill" else
                         serving.DecodeSide(engine, pool, cfg.pd_read_timeout_s, tp_rank, cfg.pd_lease_s,
                                            free_pages=lambda: _free_pages(model_runner), tp_size=tp_size))
        runtime.pd_decode = pd == "decode"
    log = DecodeLog(engine, log_interval(getattr(sa, "decode_log_interval", 40)), make_metrics(sa) if first else None,
                    draft_match, emit=first)
    runtime.log = log
    wrapped = {}

    def wrap(b):
        if b is None:
            return None
        if id(b) not in wrapped:
            wrapped[id(b)] = OasisAttnBackend(b, runtime, pool, rtp, log)
        return wrapped[id(b)]

    model_runner.attn_backend = wrap(model_runner.attn_backend)
    if getattr(model_runner, "decode_attn_backend", None) is not None:
        model_runner.decode_attn_backend = wrap(model_runner.decode_attn_backend)
    group = getattr(model_runner, "decode_attn_backend_group", None)
    if group:
        model_runner.decode_attn_backend_group = [wrap(b) for b in group]
    if first:
        logger.info(
            "OasisKV: %s kernels, %s predictor, %d sparse / %d dense layers, budget %d tokens per request, layer and KV "
            "head (%d blocks of %d), request rows %d; device working set %.1f MiB, summaries %.1f MiB, "
            "host tier %.1f MiB (%d tokens, KV cache %s)%s",
            ops.name, engine.predictor.name, len(engine.sparse_layers), len(cfg.dense_layers), cfg.budget_tokens,
            cfg.budget_blocks, cfg.block_size, engine.ws.R, engine.ws.nbytes / 2**20, engine.summaries.nbytes / 2**20,
            engine.host.nbytes / 2**20, engine.host.capacity_tokens, str(engine.kv_dtype).removeprefix("torch."),
            "" if tp_size == 1 else f"; per TP rank: {tp_size} ranks, {engine.head_num} KV head(s) each, "
            "the decode lines and metrics are rank 0's")
    if engine.budget.fraction is not None:
        rate = engine.measure_link()
        if rate is not None and first:
            logger.info("OasisKV: transfer budget %s: admission copies measured at %.1f GB/s host to device; a step "
                        "may admit %.2f of what the link moves during it (sized from the decode step time, "
                        "at each OasisKV decode line)", cfg.transfer_budget, rate / 1e9, engine.budget.fraction)
    elif engine.budget.enabled and first:
        logger.info("OasisKV: transfer budget %.1f MiB per decode step", cfg.transfer_budget / 2**20)
    return result


def _scale(as_float, param) -> float | None:
    """A layer's KV scale as a float (``None``: no scale): its ``*_scale_float``, else its one-element parameter."""
    if as_float is not None:
        return float(as_float)
    if isinstance(param, torch.Tensor) and param.numel() == 1:
        return float(param.detach().float().cpu())
    return None if param is None else float("nan")      # a scale we cannot read is refused


def check_kv_scales(model, kv_cache_dtype: str) -> None:
    """Refuse an fp8 KV cache whose attention layers carry KV scales other than 1.

    SGLang divides a new token's K / V by the layer's ``k_scale`` / ``v_scale`` (a checkpoint's
    calibrated ``kv_scale``) before the fp8 cast and multiplies them back when attending
    (``triton_backend.py``: ``k_descale = layer.k_scale_float``); OasisKV's kernels read fp8 as is
    (``core/kv_dtype.py``), which is right only for the scale SGLang uses without calibration: none.

    Args: model: the runner's ``torch.nn.Module``; kv_cache_dtype: the flag's value (for the message).
    Raises:
        OasisConfigError: naming the first such layer and its scales.
    """
    for name, m in model.named_modules():
        if not hasattr(m, "k_scale_float"):          # RadixAttention and its kind
            continue
        kf, vf = (_scale(getattr(m, f"{x}_scale_float", None), getattr(m, f"{x}_scale", None)) for x in "kv")
        if any(x is not None and x != 1.0 for x in (kf, vf)):
            raise OasisConfigError(
                f"--kv-cache-dtype {kv_cache_dtype}: layer {name} has KV scales k_scale={kf}, v_scale={vf} from the "
                "checkpoint; --kv-sparse oasis serves fp8 KV caches without scales only (use a checkpoint without "
                "kv_scale entries, or --kv-cache-dtype auto)")


def _free_pages(model_runner):
    """``[F]`` int64 pages SGLang's token allocator holds free (``free_pages`` and the PD decode
    node's ``release_pages``, ``mem_cache/allocator/paged.py``), and the pages freed in the free
    group now open (``free_group`` / ``free_page_reps_group``, ``allocator/base.py``).

    SGLang frees the requests a batch finished in one free group and hands their pages to the
    free list at the group's end, after ``DecodeSide.release`` ran for each: without the group,
    two requests ending in one step whose blocks share OS pages (a piece under 4 KiB; their
    decode blocks interleave) each saw the other's pages held, and those OS pages stayed resident
    for good (a PD decode node's host tier grew after every such round)."""
    return free_pages_of(model_runner.token_to_kv_pool_allocator)


def free_pages_of(a):
    """``[F]`` int64 page ids (units of ``a.page_size`` tokens; unique, sorted) free in SGLang's
    token allocator ``a`` (``mem_cache/allocator/base.py`` / ``paged.py``): its ``free_pages``
    and ``release_pages`` lists, and while a free group is open (``free_group_begin`` ..
    ``free_group_end``) the pages freed in it (``free_group``: token slots;
    ``free_page_reps_group``: one slot per page). Reads only; raises nothing for an allocator
    without those fields (they count as empty)."""
    import torch

    ps = int(getattr(a, "page_size", 1) or 1)
    parts = [t.reshape(-1).to("cpu", torch.int64) for t in (getattr(a, "free_pages", None),
                                                             getattr(a, "release_pages", None)) if t is not None]
    # only while a group is open: SGLang's free_group_end frees the group but keeps its list
    # until the next free_group_begin, and by then its pages may have been handed out again
    # (a breaker review: such a stale list had a release give back a live request's blocks)
    group = [] if getattr(a, "is_not_in_free_group", True) else \
        list(getattr(a, "free_group", None) or []) + list(getattr(a, "free_page_reps_group", None) or [])
    parts += [torch.div(t.reshape(-1).to("cpu", torch.int64), ps, rounding_mode="floor") for t in group]
    return torch.unique(torch.cat(parts)) if parts else torch.empty(0, dtype=torch.int64)


def check_memory(cfg: OasisConfig, plan: dict, device, host_ranks: int = 1) -> None:
    """Refuse to start when the OasisKV state cannot fit, naming the flags that size it.

    Args:
        plan: ``OasisSparseKV.memory_plan`` (bytes) of this rank. device: the model runner's device.
        host_ranks: TP ranks on this host, each allocating such a plan in host memory (they
            start together, so each checks all of them against what is available now).
    Raises:
        OasisConfigError: working set + summaries exceed free device memory, or the host tier
            exceeds available host memory (on CPU, all three count against host memory).
    """
    import psutil

    host_free = psutil.virtual_memory().available
    dev = torch.device(device)
    n = max(1, int(host_ranks))
    if dev.type == "cuda":
        dev_free = torch.cuda.mem_get_info(dev)[0]
        host_need = n * plan["host_tier"]
    else:   # CPU: everything lives in host memory
        dev_free, host_need = host_free, n * (plan["host_tier"] + plan["working_set"] + plan["summaries"])
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    if plan["working_set"] + plan["summaries"] > dev_free or host_need > host_free:
        raise OasisConfigError(
            f"--kv-sparse oasis: not enough memory: device working set {gib(plan['working_set'])} "
            f"(budget_tokens={cfg.budget_tokens} x --max-running-requests rows), summaries "
            f"{gib(plan['summaries'])} and host tier {gib(plan['host_tier'])} (--max-total-tokens)"
            + (f", per TP rank, {n} ranks on this host" if n > 1 else "")
            + f" vs {gib(dev_free)} free on {dev.type} and {gib(host_free)} host memory available; lower "
            f"budget_tokens, --max-running-requests or --max-total-tokens")
