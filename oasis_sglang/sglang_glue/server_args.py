"""Start-up handling of ``--kv-sparse`` / ``--kv-sparse-config`` (called from the patched
``ServerArgs.__post_init__``, before SGLang resolves its own defaults).

Raises ``OasisConfigError`` (a ``ValueError``) naming the flag or key on bad input, so
``launch_server`` exits non-zero with that message before anything starts.
"""

from __future__ import annotations

import functools
import logging
import math
import os

from ..config import OasisConfig, OasisConfigError

logger = logging.getLogger(__name__)

SUPPORTED_ATTENTION_BACKENDS = ("torch_native", "triton", "intel_amx")   # intel_amx: CPU (EAGLE needs it there)
DEFAULT_MAX_RUNNING_REQUESTS = 64
PAIRED_FORWARD_ALGORITHMS = ("EAGLE3", "EAGLE", "STANDALONE", "NGRAM")   # NGRAM: model-free drafts
# the KV cache dtypes served (core/kv_dtype.py): the model's, or SGLang's plain fp8 (no FP4 / MXFP8 quant methods)
KV_CACHE_DTYPES = ("auto", "bfloat16", "bf16", "float16", "fp16", "fp8_e4m3", "fp8_e5m2")


def oasis_config(server_args) -> OasisConfig | None:
    """The server's validated :class:`OasisConfig`, or ``None`` without ``--kv-sparse oasis``.

    The one place the glue reads ``--kv-sparse-config``: ``handle_kv_sparse_args`` stores the
    normalised JSON back in ``server_args`` at start-up, and every later reader (pool, backend,
    draft backend; in the scheduler process too, where the args arrive pickled) gets the config
    parsed once per JSON text.

    Raises:
        OasisConfigError: the stored JSON is not a valid config (only if it was changed after
            start-up).
    """
    if getattr(server_args, "kv_sparse", "none") != "oasis":
        return None
    text = server_args.kv_sparse_config
    if isinstance(text, dict):             # the Python API may pass the config as a dict
        import json

        text = json.dumps(text)
    return _parse_config(text)


@functools.lru_cache(maxsize=8)
def _parse_config(text: str | None) -> OasisConfig:
    return OasisConfig.from_json(text)


def _is_cpu(args) -> bool:
    if args.device is not None:
        return args.device == "cpu"
    import torch

    return not torch.cuda.is_available()


def handle_kv_sparse_args(args) -> OasisConfig:
    """Validate the OasisKV flags against the rest of ``args`` and set dependent defaults.

    Sets ``page_size`` to ``block_size`` and the attention backend to ``torch_native`` on CPU
    when they are unset, captures only decode steps in CUDA graphs (with a draft the paired
    verify step and the draft-extend pass; none on CPU; ``_cuda_graph_args``), keeps overlap scheduling
    (with a draft: EAGLE3 on a GPU outside PD; ``_overlap_args``),
    makes admission reserve prompt + max_new_tokens in the token pool (= host tier), bounds
    ``--max-running-requests`` (default 64), and stores the normalised config JSON back in
    ``args.kv_sparse_config``.

    Raises:
        OasisConfigError: bad ``--kv-sparse-config`` key/value or an unsupported combination.
        RuntimeError: the oasis-sglang plugin's hook targets do not resolve in this SGLang.
    """
    if args.kv_sparse == "none":
        raise OasisConfigError("--kv-sparse-config is set but --kv-sparse is 'none': add --kv-sparse oasis "
                               "or drop --kv-sparse-config")
    if args.kv_sparse != "oasis":
        raise OasisConfigError(f"--kv-sparse: unknown mode {args.kv_sparse!r} (choices: none, oasis)")
    cfg = OasisConfig.from_json(args.kv_sparse_config)
    cpu = _is_cpu(args)
    cfg.kernel_backend("cpu" if cpu else "cuda")        # 'kernels' vs the device, before loading
    if cpu:
        if os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
            # without it SGLang 0.5.17 gets as far as loading the model, then stops on an import of
            # vllm's rotary embedding (srt/layers/rotary_embedding/base.py): say why before that
            raise OasisConfigError("--kv-sparse oasis on CPU runs on SGLang's CPU engine: set SGLANG_USE_CPU_ENGINE=1 "
                                   "in the server's environment (without it SGLang stops at model loading with "
                                   "\"No module named 'vllm'\")")
        _check_cpu_ops()
    from .hooks import check_plugin_ready

    check_plugin_ready()
    _check_model(args, cfg)

    def bad(flag: str, why: str):
        raise OasisConfigError(f"--kv-sparse oasis: {flag} {why}")

    for flag in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
        val = getattr(args, flag, None)
        if val is not None and val not in SUPPORTED_ATTENTION_BACKENDS:
            bad("--" + flag.replace("_", "-"), f"{val!r} is not supported (supported: {', '.join(SUPPORTED_ATTENTION_BACKENDS)})")
    spec = getattr(args, "speculative_algorithm", None)
    if args.attention_backend is None:
        # SGLang's EAGLE has no torch_native backend; on CPU it runs on intel_amx (torch ops)
        args.attention_backend = ("intel_amx" if spec else "torch_native") if cpu else "triton"
    for flag in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
        if getattr(args, flag, None) == "intel_amx" and not cpu:
            bad("--" + flag.replace("_", "-"), "'intel_amx' is the CPU engine's backend (use triton on CUDA)")
    if spec:
        for flag in ("attention_backend", "prefill_attention_backend", "decode_attention_backend",
                     "speculative_draft_attention_backend"):
            if getattr(args, flag, None) == "torch_native":
                bad("--" + flag.replace("_", "-"), "'torch_native' cannot run SGLang's speculative draft worker "
                    "(use intel_amx on CPU, triton on CUDA, or leave it unset)")
    if args.page_size is None:
        args.page_size = cfg.block_size
    elif args.page_size != cfg.block_size:
        bad("--page-size", f"{args.page_size} is incompatible with block_size {cfg.block_size}: they must be equal")
    if spec:
        # the draft is the look-ahead probe: one draft token beside the normal one (paired forward)
        if str(spec).upper() not in PAIRED_FORWARD_ALGORITHMS:
            bad("--speculative-algorithm", f"{spec!r} is not supported (supported: {', '.join(PAIRED_FORWARD_ALGORITHMS)}: "
                "the draft token rides the verify pass as the look-ahead probe)")
        ngram = str(spec).upper() == "NGRAM"
        if getattr(args, "speculative_adaptive", False):
            bad("--speculative-adaptive", "changes the number of draft steps per batch; the look-ahead probe "
                "needs exactly one draft token beside the normal one")
        if os.environ.get("SGLANG_SIMULATE_ACC_LEN"):
            bad("SGLANG_SIMULATE_ACC_LEN", "(environment) makes SGLang accept drafts, whose K/V the "
                "look-ahead probe does not keep; unset it")
        if getattr(args, "dtype", "auto") == "auto" and (cpu or not ngram):
            # with --dtype auto SGLang gives a draft model the dtype of its own config: a float32
            # or fp16 draft beside a bf16 target fails at the first forward ("expected mat1 and
            # mat2 to have the same dtype"). GPU: the target's own dtype (NGRAM has no draft
            # model: left alone). CPU: float32, the dtype SGLang's intel_amx speculative path
            # is tested in here.
            args.dtype = "float32" if cpu else _target_dtype(args)
            if args.dtype != "auto":
                logger.info("OasisKV: --dtype %s with speculative decoding (%s)", args.dtype,
                            "CPU intel_amx path" if cpu else "target and draft must share a dtype")
        if ngram:
            # SGLang's n-gram drafter: a chain of one draft token (its topk is the BFS breadth)
            mn = getattr(args, "speculative_ngram_min_bfs_breadth", 1)
            if mn != 1 or type(mn) is not int:
                bad("--speculative-ngram-min-bfs-breadth", f"must be 1 (one draft token beside the normal one), got {mn!r}")
            if args.speculative_ngram_max_bfs_breadth not in (1, _default(args, "speculative_ngram_max_bfs_breadth")):
                bad("--speculative-ngram-max-bfs-breadth", f"must be 1 (one draft token beside the normal one), "
                    f"got {args.speculative_ngram_max_bfs_breadth!r}")
            args.speculative_ngram_max_bfs_breadth = 1
            if getattr(args, "speculative_ngram_external_corpus_path", None) is not None:
                bad("--speculative-ngram-external-corpus-path", "is not supported with the look-ahead probe")
        wants = (("speculative_num_draft_tokens", 2),) if ngram else \
            (("speculative_num_steps", 1), ("speculative_eagle_topk", 1), ("speculative_num_draft_tokens", 2))
        for flag, want in wants:
            val = getattr(args, flag, None)
            if val is None:
                setattr(args, flag, want)
            elif val != want or type(val) is not int:
                bad("--" + flag.replace("_", "-"), f"must be {want} (one draft token beside the normal one), got {val!r}")
    predictor = cfg.predictor_for(has_draft=bool(spec), model_free_draft=str(spec).upper() == "NGRAM")   # before loading
    if str(getattr(args, "kv_cache_dtype", "auto")) not in KV_CACHE_DTYPES:
        bad("--kv-cache-dtype", f"{args.kv_cache_dtype!r} is not supported with --kv-sparse oasis "
            f"(one of {', '.join(KV_CACHE_DTYPES)})")
    for flag in ("enable_hierarchical_cache", "enable_hisparse", "enable_mixed_chunk", "enable_dp_attention",
                 "enable_torch_compile", "enable_pdmux"):
        if getattr(args, flag, False):
            bad("--" + flag.replace("_", "-"), "cannot be combined")
    pd = str(getattr(args, "disaggregation_mode", "null") or "null")
    if pd != "null":
        _pd_args(args, pd, bool(spec), bad)
    for flag in ("pp_size", "dp_size", "dcp_size", "attn_cp_size"):
        # (decode / attention context parallelism would split a request's tokens over ranks;
        # OasisKV's host tier and working sets hold a request's whole context per rank)
        if getattr(args, flag, 1) not in (None, 1):
            bad("--" + flag.replace("_", "-"), "must be 1 for now")
    tp = getattr(args, "tp_size", 1)
    if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
        bad("--tp-size", f"must be a positive integer, got {tp!r}")
    for flag in ("enable_prefill_cp", "enable_prefill_context_parallel", "enable_cp_decode_attn_tp"):
        if getattr(args, flag, False):
            bad("--" + flag.replace("_", "-"), "cannot be combined (context parallelism splits a request's tokens)")
    if cpu and (getattr(args, "tp_size", 1) or 1) > 1:
        _cpu_tp_env(int(args.tp_size))
    if args.max_running_requests is not None and args.max_running_requests < 1:
        bad("--max-running-requests", f"must be >= 1, got {args.max_running_requests}")
    mtt = getattr(args, "max_total_tokens", None)
    if mtt is not None and mtt < cfg.block_size:
        bad("--max-total-tokens", f"{mtt} holds no block: want at least block_size {cfg.block_size} tokens "
            f"(--kv-sparse oasis runs SGLang's paged pool with page size = block_size)")
    cps = getattr(args, "chunked_prefill_size", None)
    if cps is not None and cps > 0 and cps % cfg.block_size:
        bad("--chunked-prefill-size", f"{cps} must be a multiple of block_size {cfg.block_size} (the page size)")
    if args.max_running_requests is None:
        # the working set is preallocated per request row: keep the row count bounded
        args.max_running_requests = DEFAULT_MAX_RUNNING_REQUESTS
        logger.info("OasisKV: --max-running-requests defaults to %d", DEFAULT_MAX_RUNNING_REQUESTS)
    # The host tier is SGLang's token pool: admit a request only when its prompt plus its whole
    # max_new_tokens fit (SGLang's default estimates 70% decaying to 10% of max_new_tokens and
    # retracts requests when decode runs out of room).
    raw = os.environ.setdefault("SGLANG_INIT_NEW_TOKEN_RATIO", "0.7")
    try:
        init_ratio = float(raw)
    except ValueError:
        init_ratio = float("nan")
    if not (math.isfinite(init_ratio) and 0 < init_ratio <= 1):
        raise OasisConfigError(f"SGLANG_INIT_NEW_TOKEN_RATIO={raw!r}: want a number in (0, 1] (the share of "
                               f"max_new_tokens SGLang first reserves per request); unset it for 0.7")
    if args.schedule_conservativeness * init_ratio < 1.0:
        args.schedule_conservativeness = 1.01 / init_ratio
    os.environ["SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR"] = "1.0"
    _overlap_args(args, str(spec).upper() if spec else None, cpu, pd)
    _cuda_graph_args(args, cpu)
    if pd == "decode" and not args.disable_cuda_graph:
        why = _pd_decode_graph_blocker(cfg.pd_read_mode, predictor, bool(spec))
        if why:
            logger.info("OasisKV PD: disabling CUDA graphs on the decode node (%s)", why)
            args.disable_cuda_graph = True
        else:
            logger.info("OasisKV PD: decode steps in CUDA graphs (pd_read_mode deferred, %s predictor: no read "
                        "from the prefill node inside a predicted step; a request's first step is replayed too when "
                        "its working set was planned on the prefill node, else it runs eagerly)",
                        predictor)
    args.kv_sparse_config = cfg.to_json()
    logger.info("OasisKV enabled: %s", args.kv_sparse_config)
    if pd == "decode" and cfg.dense_short_contexts:
        logger.info("OasisKV PD: dense_short_contexts does not apply on a decode node (its blocks are read from "
                    "the prefill node on demand, so no step runs the dense path)")
    return cfg


def _pd_decode_graph_blocker(read_mode: str, predictor: str, spec: bool) -> str | None:
    """Why a PD decode node cannot run its decode steps in CUDA graphs, or ``None`` when it can.

    A captured step must not read from the prefill node: only ``pd_read_mode: deferred`` with a
    predictor that plans a step ahead (``previous``) keeps every read between steps
    (``core/remote.py``); ``wait`` and ``current`` read inside the layer, on the host. With a draft
    (EAGLE-3 / lookahead) the paired verify and draft-extend graphs with PD have not run on a GPU.
    """
    if read_mode != "deferred":
        return f"pd_read_mode {read_mode}: blocks are read from the prefill node inside each layer"
    if predictor == "current":
        return ("predictor current ('auto' without a draft model): each layer selects and reads its blocks "
                "in the step itself; add \"predictor\": \"previous\" to --kv-sparse-config to plan a step "
                "ahead and decode in CUDA graphs (its accuracy: docs/accuracy.md)")
    if spec:
        return "a draft model with PD runs its paired steps eagerly (not validated in CUDA graphs on a GPU)"
    return None


def _pd_args(args, mode: str, spec: bool, bad) -> None:
    """``--disaggregation-mode prefill|decode`` with ``--kv-sparse oasis`` (``disagg/serving.py``).

    Raises:
        OasisConfigError: a transfer backend other than NIXL, a speculative algorithm other
            than EAGLE3, or ``nixl`` not installed. (TP: both nodes must run the same TP size.
            A decode node checks its prefill node's at the first request from it
            (``disagg.transport.TierLayout.compatible``), but SGLang 0.5.17's own NIXL transfer
            fails on different sizes before that, in the prefill node's bootstrap thread;
            refusing the pairing earlier is not built.)
    """
    if mode not in ("prefill", "decode"):
        bad("--disaggregation-mode", f"{mode!r}: want prefill or decode")
    backend = str(getattr(args, "disaggregation_transfer_backend", "") or "")
    if backend != "nixl":
        bad("--disaggregation-transfer-backend", f"{backend!r}: must be nixl (the decode node reads blocks from "
            "the prefill node's host tier with NIXL)")
    if getattr(args, "disaggregation_decode_enable_radix_cache", False):
        bad("--disaggregation-decode-enable-radix-cache", "cannot be combined: a prefix hit on the decode node "
            "would skip the transfer of the page numbers its blocks are read by")
    if getattr(args, "disaggregation_decode_enable_offload_kvcache", False):
        bad("--disaggregation-decode-enable-offload-kvcache", "cannot be combined: it offloads the decode node's KV "
            "cache to the host, where OasisKV's host tier already holds the sparse layers")
    algo = str(getattr(args, "speculative_algorithm", None) or "").upper()
    if spec and algo != "EAGLE3":
        bad("--speculative-algorithm", f"{algo} cannot be combined with --disaggregation-mode: only EAGLE3 is "
            "built and tested with PD (its draft model's KV is sent whole by SGLang's transfer)")
    try:
        import nixl  # noqa: F401
    except ImportError:
        bad("--disaggregation-mode", "needs the nixl package (from a checkout: pip install -c constraints.txt '.[disagg]')")


SPEC_OVERLAP_ALGORITHMS = ("EAGLE3",)   # with a draft, overlap on by default only where it ran on a GPU


def spec_overlap(spec: str | None, pd: str = "null") -> tuple[bool, bool]:
    """Whether SGLang's overlap scheduler stays on with the speculative algorithm ``spec`` (upper
    case; ``None``: no draft, always on) on a GPU in disaggregation mode ``pd``, by
    ``OASIS_SPEC_OVERLAP`` (``"0"`` / ``"1"``; empty or unset: on for ``SPEC_OVERLAP_ALGORITHMS``
    outside PD, off otherwise; ``_overlap_args`` has why). Also read by ``bench/serving.py`` to
    record each run's setting.

    Returns:
        ``(on, explicit)``: ``explicit`` when the variable decided it.
    Raises:
        OasisConfigError: ``OASIS_SPEC_OVERLAP`` is set to something other than ``0`` or ``1``.
    """
    raw = os.environ.get("OASIS_SPEC_OVERLAP", "")
    if raw not in ("", "0", "1"):
        raise OasisConfigError(f"OASIS_SPEC_OVERLAP={raw!r}: want 1 (keep SGLang's overlap scheduler with a draft "
                               f"model; the default for EAGLE3 outside PD) or 0 (off with a draft)")
    if not spec:
        return True, False
    if raw:
        return raw == "1", True
    return spec in SPEC_OVERLAP_ALGORITHMS and pd == "null", False


def record_lengths(spec: str | None, asynchronous: bool, pd: str = "null", accel: bool = False) -> bool:
    """Whether decode steps take their host lengths from OasisKV's prediction record instead
    of SGLang's host copy of ``seq_lens`` (``OasisRuntime.record_lengths``), by
    ``OASIS_RECORD_LENGTHS`` (``"0"`` / ``"1"``; empty or unset: on for the CPU engine, off on
    an accelerator (``accel``): it has not run on a GPU yet).

    Only with a draft (``spec``, any case; its drafts are never accepted, ``spec_probe``, so
    each step adds exactly one token per request and the record, advanced by one a step, holds
    every row's context), an asynchronous predictor (the record is kept per step) and outside
    PD (a decode node installs prefill-planned first steps). Why: with SGLang's host copy, the
    overlapped speculative worker waits for step ``t``'s verify before it prepares step
    ``t+1``, and that host work (about 5.6 ms at 39 x 16K on the H200, 2026-12-07) left the GPU
    idle 4.4 ms a step after the draft-extend pass. On the CPU engine SGLang copies its lengths
    anyway (its speculative backend asks for them), so there every step compares the two
    (``batch_info.host_lengths``): what CI tests.

    Raises:
        OasisConfigError: ``OASIS_RECORD_LENGTHS`` is set to something other than ``0`` or ``1``.
    """
    raw = os.environ.get("OASIS_RECORD_LENGTHS", "")
    if raw not in ("", "0", "1"):
        raise OasisConfigError(f"OASIS_RECORD_LENGTHS={raw!r}: want 1 (decode steps with a draft take their host "
                               f"lengths from the prediction record; the default on the CPU engine) or 0 (SGLang's "
                               f"host copy; the default on a GPU)")
    on = raw == "1" or (raw == "" and not accel)
    return on and bool(spec) and bool(asynchronous) and str(pd or "null") == "null"


def _overlap_args(args, spec: str | None, cpu: bool = False, pd: str = "null") -> None:
    """SGLang's overlap scheduler with OasisKV (``Scheduler.event_loop_overlap``).

    Kept on without a draft: the scheduler prepares batch ``t+1`` on the host while batch ``t``
    runs, so its CPU time (batch assembly, result processing, graph input copies) leaves the
    decode step. Two orderings make that safe for the OasisKV state:

    * ``SGLANG_FORCE_COARSE_WAR_BARRIER=1`` (and, on a GPU, ``SGLANG_ENABLE_WAR_BARRIER=1``, which
      SGLang otherwise infers from ``torch.version.cuda``; a user's other value is replaced with a
      warning): after each launch the scheduler's stream waits for
      the whole forward, not only for the decode graph's pre-replay snapshot of its inputs
      (``DecodeCudaGraphRunner.execute``'s read-done event), because the captured OasisKV
      kernels read ``req_to_token`` during the replay (block pages for admissions and
      write-back): the next batch's writes to that table must not overtake them.
    * a finished request's working set is reset on the scheduler's stream after that wait and
      after every prefetch stream (``OasisSparseKV.reset_rows``), so the extra step the overlap
      scheduler runs for a request that has just finished still sees its rows intact.

    ``spec``: the speculative algorithm (upper case) or ``None``; ``pd``: the disaggregation mode.
    Kept on with an EAGLE3 draft too (``SPEC_OVERLAP_ALGORITHMS``: SGLang's overlapped speculative
    worker, spec v2) outside PD, unless ``OASIS_SPEC_OVERLAP=0``. EAGLE, STANDALONE, NGRAM and a
    PD node with a draft keep it off unless ``OASIS_SPEC_OVERLAP=1``: none has run with it on a
    GPU. Why it is on: without it the host's work between steps is GPU idle time (6.69 ms
    of a 26.0 ms paired step at 39 x 16K on the H100; with it 4.02 ms of 23.1 ms, and 1862.1
    against 1527.9 decode tok/s; greedy tokens and their log-probabilities bitwise equal with and
    without it at 4K, budget 1024, ``scripts/greedy_consistency.py``;
    docs/benchmarks/2026-12-06_h100-spec-overlap.md). Spec v2 publishes the verify's lengths
    mid-forward (``FutureMap.resolve_seq_lens_cpu``); the verify batch still gets its host lengths
    after a wait on the previous verify's publish event, and the barrier and row-reset orderings
    above are the same as without a draft. SGLang 0.5.17 has no overlap for speculative decoding
    on the CPU engine, so there it stays off.

    Raises:
        OasisConfigError: ``OASIS_SPEC_OVERLAP`` is set to something other than ``0`` or ``1``.
    """
    on, explicit = spec_overlap(spec, pd)                    # (validates the variable first)
    record_lengths(spec, True, pd)                           # (validates OASIS_RECORD_LENGTHS)
    if spec and cpu:
        if not getattr(args, "disable_overlap_schedule", True):
            logger.info("OasisKV: disabling the overlap scheduler (speculative paired forward on the CPU engine: "
                        "SGLang 0.5.17 has no overlap scheduler for speculative decoding there)")
        args.disable_overlap_schedule = True
        return
    if spec and not on:
        if not getattr(args, "disable_overlap_schedule", True):
            why = "OASIS_SPEC_OVERLAP=0" if explicit else (
                f"{spec}: not run with it on a GPU; OASIS_SPEC_OVERLAP=1 keeps it" if pd == "null"
                else f"a PD {pd} node with a draft: not run with it on a GPU; OASIS_SPEC_OVERLAP=1 keeps it")
            logger.info("OasisKV: disabling the overlap scheduler (speculative paired forward, %s)", why)
        args.disable_overlap_schedule = True
        return
    if spec and (spec not in SPEC_OVERLAP_ALGORITHMS or pd != "null") \
            and not getattr(args, "disable_overlap_schedule", False):
        logger.warning("OasisKV: OASIS_SPEC_OVERLAP=1: the overlap scheduler stays on with %s%s (not run with it "
                       "on a GPU)", spec, "" if pd == "null" else f" on a PD {pd} node")
    if not getattr(args, "disable_overlap_schedule", False):
        # (on the CPU engine the forward is synchronous: SGLang's barrier stays as it decides there)
        for var in ("SGLANG_FORCE_COARSE_WAR_BARRIER",) + (() if cpu else ("SGLANG_ENABLE_WAR_BARRIER",)):
            if os.environ.get(var, "1") not in ("1", "true", "True"):
                logger.warning("OasisKV: %s=%s replaced by 1: the overlap scheduler needs the barrier with "
                               "--kv-sparse oasis (or pass --disable-overlap-schedule)", var, os.environ[var])
            os.environ[var] = "1"
        logger.info("OasisKV: overlap scheduler on (SGLANG_FORCE_COARSE_WAR_BARRIER=1: the scheduler's next "
                    "writes to req_to_token wait for the whole forward, whose OasisKV kernels read it)")


def _cuda_graph_config(args) -> dict:
    """``--cuda-graph-config`` as a dict (JSON text, a dict or SGLang's ``CudaGraphConfig``).

    Raises:
        OasisConfigError: not JSON, or not an object of phase objects.
    """
    cgc = getattr(args, "cuda_graph_config", None)
    if not cgc:
        return {}
    if hasattr(cgc, "to_dict"):
        cgc = cgc.to_dict()
    if isinstance(cgc, str):
        import json

        try:
            cgc = json.loads(cgc)
        except ValueError as e:
            raise OasisConfigError(f"--kv-sparse oasis: --cuda-graph-config is not valid JSON ({e})") from None
    if not isinstance(cgc, dict) or not all(isinstance(v, dict) for v in cgc.values()):
        raise OasisConfigError(f"--kv-sparse oasis: --cuda-graph-config must be an object of phase objects, "
                               f"e.g. {{\"decode\": {{\"backend\": \"full\"}}}}; got {cgc!r}")
    return cgc


def _cuda_graph_args(args, cpu: bool) -> None:
    """CUDA graphs with OasisKV: the decode step is captured (SGLang's decode graph runner; the
    engine's ``capture`` / ``replay`` steps) with the ``full`` backend; with a draft that step
    is the paired TARGET_VERIFY forward (the runner captures verify batches then), and SGLang's
    draft-extend graph runner captures the draft layer's pass. Prefill never is (it walks
    requests on the host). On CPU nothing is captured.

    Raises:
        OasisConfigError: a CUDA-graph flag asks for a capture OasisKV cannot run (prefill, a
            decode backend other than ``full``, any decode graph on CPU).
    """
    cfg = _cuda_graph_config(args)
    pre = str(cfg.get("prefill", {}).get("backend", "disabled")).lower()
    dec = cfg.get("decode", {}).get("backend")
    bad = lambda flag, val, why: OasisConfigError(f"--kv-sparse oasis: {flag} {val!r}: {why}")  # noqa: E731
    if pre != "disabled":
        raise bad("--cuda-graph-config prefill backend", pre, "OasisKV prefill cannot be captured; use 'disabled'")
    if getattr(args, "cuda_graph_backend_prefill", None) not in (None, "disabled"):
        raise bad("--cuda-graph-backend-prefill", args.cuda_graph_backend_prefill,
                  "OasisKV prefill cannot be captured; use 'disabled'")
    why = "on the CPU engine" if cpu else None
    for flag, val in (("--cuda-graph-backend-decode", getattr(args, "cuda_graph_backend_decode", None)),
                      ("--cuda-graph-config decode backend", dec)):
        if val is None or str(val).lower() == "disabled":
            continue
        if why:
            raise bad(flag, val, f"OasisKV captures no CUDA graph {why}; use 'disabled' or leave it unset")
        if str(val).lower() != "full":
            raise bad(flag, val, "OasisKV captures the decode step whole; use 'full' or 'disabled'")
    if why:
        if not args.disable_cuda_graph:
            logger.info("OasisKV: disabling CUDA graphs (%s)", why)
        args.disable_cuda_graph = True
        return
    if not getattr(args, "disable_prefill_cuda_graph", True):
        logger.info("OasisKV: disabling the prefill CUDA graph (decode steps are captured)")
        args.disable_prefill_cuda_graph = True


def _default(args, name: str):
    """SGLang's default of ``ServerArgs.<name>`` (a value equal to it is taken as not set by the user)."""
    import dataclasses

    return next((f.default for f in dataclasses.fields(type(args)) if f.name == name), None)


def _target_dtype(args) -> str:
    """The target model's config dtype as a ``--dtype`` value (``auto`` when unknown)."""
    try:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(args.model_path, trust_remote_code=bool(args.trust_remote_code))
        tc = getattr(hf, "text_config", None) or hf
        dt = (getattr(tc, "dtype", None) or getattr(tc, "torch_dtype", None) or getattr(hf, "dtype", None)
              or getattr(hf, "torch_dtype", None))
    except Exception:  # noqa: BLE001 - remote or exotic configs: leave it to SGLang
        return "auto"
    name = str(dt).replace("torch.", "") if dt is not None else ""
    return name if name in ("bfloat16", "float16", "float32") else "auto"


def _check_cpu_ops() -> None:
    """On a CPU host SGLang imports ``sgl_kernel``: make sure the torch ops are there.

    Raises:
        RuntimeError: ``sgl_kernel`` cannot be imported (the CPU shim is off or not installed).
    """
    try:
        import sgl_kernel  # noqa: F401
    except ImportError as e:
        import os as _os

        hint = ("OASIS_DISABLE_CPU_SHIM=1 is set" if _os.environ.get("OASIS_DISABLE_CPU_SHIM") == "1"
                else "is oasis-sglang installed with `pip install .` (not -e), so oasis_sglang_cpu.pth is in site-packages?")
        raise RuntimeError(f"oasis-sglang: sgl_kernel cannot be imported on this CPU host ({e.__class__.__name__}: "
                           f"{str(e).strip().splitlines()[0] if str(e).strip() else e!r}); {hint}") from None


def _cpu_tp_env(tp: int) -> None:
    """The environment SGLang's CPU engine needs for ``--tp N`` (set only where the user left it unset).

    ``SGLANG_NCCL_SO_PATH``: pynccl loads the venv's NCCL and calls ``torch.cuda.device`` on a
    CPU host; a path to no library makes SGLang skip it (the CPU engine's collectives are gloo's).
    ``SGLANG_CPU_OMP_THREADS_BIND``: the CPU engine binds each rank's OpenMP threads from NUMA
    nodes, which a host with fewer nodes than ranks cannot give: cores split evenly over the
    ranks, or round-robin one core each when there are fewer cores than ranks.
    """
    if "SGLANG_NCCL_SO_PATH" not in os.environ:
        os.environ["SGLANG_NCCL_SO_PATH"] = "/nonexistent/oasis-sglang-cpu/libnccl.so"
        logger.info("OasisKV: SGLANG_NCCL_SO_PATH set to no library (the CPU engine's --tp runs on gloo)")
    if "SGLANG_CPU_OMP_THREADS_BIND" not in os.environ:
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(tp, os.cpu_count() or 1)
        logger.info("OasisKV: SGLANG_CPU_OMP_THREADS_BIND=%s (--tp %d on %d cores)",
                    os.environ["SGLANG_CPU_OMP_THREADS_BIND"], tp, os.cpu_count() or 1)


def cpu_thread_binding(tp: int, cores: int) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` for ``tp`` ranks on ``cores`` cores: ``"a-b|c-d|..."``.

    Raises:
        ValueError: ``tp`` or ``cores`` below 1.
    """
    if tp < 1 or cores < 1:
        raise ValueError(f"cpu_thread_binding: tp {tp} and cores {cores} must be >= 1")
    if cores < tp:
        return "|".join(str(r % cores) for r in range(tp))
    per = cores // tp
    return "|".join(f"{r * per}-{(r + 1) * per - 1}" if per > 1 else str(r) for r in range(tp))


def _check_model(args, cfg: OasisConfig) -> None:
    """Check ``dense_layers`` and ``budget_tokens`` against the model's config, when it is local.

    Raises:
        OasisConfigError: a dense layer is out of range, every layer is dense, or the budget
            exceeds the context length.
    """
    try:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(args.model_path, trust_remote_code=bool(args.trust_remote_code))
        hf = getattr(hf, "text_config", None) or hf
        layers = int(hf.num_hidden_layers)
        ctx = int(args.context_length or getattr(hf, "max_position_embeddings", 0) or 0)
    except Exception:  # noqa: BLE001 - remote or exotic configs are checked again at model load
        return
    cfg.check_model(layers)
    tp = int(getattr(args, "tp_size", 1) or 1)
    heads = int(getattr(hf, "num_attention_heads", 0) or 0)
    kv = int(getattr(hf, "num_key_value_heads", 0) or heads)
    if tp > 1 and heads and (heads % tp or (kv % tp and tp % kv)):
        # each TP rank serves whole KV heads (SGLang's tp_k_head_num; replicated when tp > KV heads)
        raise OasisConfigError(f"--kv-sparse oasis: --tp-size {tp} does not split the model's {heads} attention heads "
                               f"and {kv} KV heads over whole heads per rank (use a divisor of {math.gcd(heads, kv)}, "
                               f"or a multiple of {kv} that divides {heads})")
    if len(cfg.dense_layers) >= layers:
        raise OasisConfigError(f"kv_sparse_config: 'dense_layers' covers all {layers} layers: nothing is sparse "
                               f"(use --kv-sparse none)")
    if ctx and cfg.budget_tokens > ctx:
        raise OasisConfigError(f"kv_sparse_config: 'budget_tokens' ({cfg.budget_tokens}) exceeds the context "
                               f"length ({ctx})")
