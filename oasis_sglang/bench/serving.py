"""OasisKV vs dense SGLang, side by side on one GPU host, through SGLang's own ``bench_serving``.

The library behind ``scripts/bench_oasis.py`` (its command line is ``main``):

    python scripts/bench_oasis.py [--suite all] [--resume] [--out out/bench_oasis]
    python scripts/bench_oasis.py --suite all --list          # the planned runs
    bash scripts/gpu_smoke.sh 4 --suite all --resume          # on the lent H200, call after call

Each run is a real ``sglang serve`` on the Qwen3-8B-shaped dummy model (``$M``, random weights,
``--load-format dummy``; its EAGLE-3 dummy draft is ``$D``; both from ../shared/gpu-host), started
one after the other on the same GPU. ``python -m sglang.bench_serving`` sends the run's prompts
(random ids, ``--output-len`` tokens each, greedy, ``ignore_eos``) all at once. Reported per run:

* decode tok/s: the median of the server's ``Decode batch ... gen throughput`` log lines at the
  most requests that ran at once (SGLang's own figure; the first such line, which spans the last
  prefill, is left out), and that count ("most running": the concurrency measurement);
* step ms: ``running / decode tok/s``;
* output tok/s, median TPOT and TTFT: from ``bench_serving`` (they include the prefill);
* for oasis, from its ``OasisKV decode`` lines: H2D MB per decode step and GB/s at that step
  time and the admitted pieces per (request, sparse layer, KV head) per step, all from the steps
  at the most running (``oasis_figures``), hit rate, decode steps replayed from CUDA graphs;
* for oasis, the host link rate its server measured at start-up (its ``"auto"`` step budget
  follows it, so the traffic figures depend on it);
* the HBM bytes the step reads at least (weights and the KV it attends over, ``bench/roofline.py``)
  and the bandwidth and fraction of the GPU's peak that the step time gives (``hbm_figures``).

Suites (``all``: throughput, concurrency, context, short, stall; ``plan()`` says exactly what
each runs). The throughput / context runs of one system share one server (``server_groups``;
``--separate-servers`` starts one per run):
  throughput   dense with the KV pool of an 80 GB GPU (``--mem-fraction-static 0.475`` on the H200: 22
               requests of 16K) vs oasis with a host tier of ``--host-gib`` GiB, at 16K and 32K
  concurrency  the most requests each of those keeps running at once
  fetch-cap    oasis at 16K for each of ``--fetch-caps`` (paper Table 2)
  context      4K, 8K, 16K, 32K, dense vs oasis (plot: ``context_sweep.png``; with ``all`` the
               16K and 32K points are the throughput runs, measured once)
  short        1K input, same pool for both: oasis / dense >= 0.97 is the target
  stall        16K oasis with ``OASIS_ABLATE=no-transfer`` (admissions planned, not copied): the
               exposed transfer share of the step is 1 - its step time / the 16K oasis run's
  paired       issue 4's paired forward: oasis vs oasis-eagle3 (and dense, dense-eagle3)

A full ``all`` takes longer than one 600 s device call: results go to ``<out>/bench_oasis.json``
after every run and ``--resume`` skips the runs already there, so repeated calls complete it;
``--deadline S`` starts no run that would end past S seconds (exit status 3: runs are left).
Random weights give no real draft acceptance and no real attention pattern: these runs measure
speed only; the predicted top-K is used as if it were real (the pipeline does the same work).
Writes ``<out>/bench_oasis.md`` (tables), ``.json`` (raw), PNG plots and each server's log.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from ..argtypes import positive_float, positive_int, transfer_budget
from ..config import OasisConfig
from ..sglang_glue.log_line import parse_decode_counters
from ..testing.launch import launch, oasis_args
from . import profile_trace, roofline

DECODE = re.compile(r"Decode batch.*?#running-req: (\d+).*?gen throughput \(token/s\): ([\d.]+)")
SERVING = {"output_tok_s": r"Output token throughput \(tok/s\):\s+([\d.]+)",
           "median_tpot_ms": r"Median TPOT \(ms\):\s+([\d.]+)",
           "median_itl_ms": r"Median ITL \(ms\):\s+([\d.]+)",
           "median_ttft_ms": r"Median TTFT \(ms\):\s+([\d.]+)",
           "completed": r"Successful requests:\s+(\d+)"}
EAGLE = ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "1", "--speculative-eagle-topk", "1",
         "--speculative-num-draft-tokens", "2"]
# the KV pool an 80 GB GPU holds for Qwen3-8B (issue 5; 367,922 tokens on the H200): this share
# of the H200's 143,771 MiB; on another GPU the share of its memory that leaves the same bytes
DENSE_80GB_MEM_FRACTION = 0.475
H200_MIB = 143_771


def _gpu0() -> tuple[str, float] | None:
    """``(name, total MiB)`` of GPU 0 from ``nvidia-smi`` (no CUDA context in this process: it
    would take GPU memory from the servers), or ``None``."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits",
                              "-i", "0"], capture_output=True, text=True, timeout=30).stdout.strip()
        name, mib = out.rsplit(",", 1)
        return name.strip(), float(mib)
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def dense_80gb_mem_fraction(total_mib: float | None = None) -> float:
    """``--mem-fraction-static`` that gives dense the KV pool of an 80 GB GPU on this GPU
    (``total_mib``: its memory, default GPU 0's; 0.475 on the H200, 0.837 on an H100 80 GB;
    at most 0.9). Without a GPU: 0.475."""
    if total_mib is None:
        g = _gpu0()
        if g is None:
            return DENSE_80GB_MEM_FRACTION
        total_mib = g[1]
    return round(min(0.9, DENSE_80GB_MEM_FRACTION * H200_MIB / total_mib), 3)


def gpu_name() -> str:
    """GPU 0's name (``nvidia-smi``), or ``"no GPU"``."""
    g = _gpu0()
    return g[0] if g else "no GPU"


QWEN3_8B_LAYERS = 36
QWEN3_8B_KV_BYTES_PER_TOKEN = QWEN3_8B_LAYERS * 8 * 128 * 2 * 2   # layers x KV heads x head_dim x (K, V) x bf16
KV_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")               # --kv-dtype: SGLang's --kv-cache-dtype for every server


@dataclass(frozen=True)
class Run:
    """One server start and one ``bench_serving`` run.

    ``batch``: prompts sent at once (= concurrency = ``--max-running-requests``). ``pool``:
    ``"exact"`` sizes the KV pool (oasis: the host tier) to ``batch`` requests; ``"80gb"`` gives
    dense the pool of an 80 GB GPU (``--mem-fraction-static 0.475``). ``host_requests``: oasis
    host tier in requests of this length (default ``batch``).
    """

    key: str
    system: str
    input_len: int
    output_len: int
    batch: int
    pool: str = "exact"
    fetch_cap: int | None = None
    host_requests: int | None = None
    churn: str | None = None          # oasis: a churn profile replayed (OASIS_CHURN, core/churn.py)
    kv_dtype: str = "auto"            # SGLang's --kv-cache-dtype (dense and oasis alike)
    transfer_budget: object = "auto"  # oasis: the config's transfer_budget ("auto", a link fraction, bytes, None)


def kv_bytes_per_token(kv_dtype: str = "auto") -> int:
    """Bytes of Qwen3-8B KV per token, every layer: bf16, or half of it in fp8 (``--kv-dtype fp8_*``)."""
    return QWEN3_8B_KV_BYTES_PER_TOKEN // (2 if kv_dtype.startswith("fp8") else 1)


def tier_bytes_per_token(kv_dtype: str = "auto") -> int:
    """Bytes per token the oasis host tier holds for Qwen3-8B: the sparse layers' K and V only
    (the config's ``dense_layers``, 2 of 36 by default, keep their KV on the device), bf16 or
    fp8. 136 KiB in bf16 (``OasisSparseKV.token_capacity``'s ``host_cell``)."""
    sparse = QWEN3_8B_LAYERS - len(OasisConfig().dense_layers)
    return kv_bytes_per_token(kv_dtype) * sparse // QWEN3_8B_LAYERS


def host_requests_for(ctx: int, host_gib: float, kv_dtype: str = "auto") -> int:
    """Requests of ``ctx`` tokens whose Qwen3-8B sparse layers' KV (in ``kv_dtype``,
    :func:`tier_bytes_per_token`) fits in ``host_gib`` GiB of host tier: 44 of 16,704 tokens in
    96 GiB (before 2026-12-06 the benchmark charged all 36 layers, 40). Raises ValueError (naming
    --host-gib) when not even one fits."""
    per = tier_bytes_per_token(kv_dtype)
    if not math.isfinite(host_gib * 2**30):
        raise ValueError(f"--host-gib {host_gib:g} is too large to size a host tier")
    n = int(host_gib * 2**30 // (ctx * per))
    if n < 1:
        raise ValueError(f"--host-gib {host_gib:g} holds no request of {ctx} tokens "
                         f"({ctx * per / 2**30:.2f} GiB of Qwen3-8B sparse-layer KV)")
    return n


def plan(suite: str, a) -> list[Run]:
    """The runs of ``suite`` (``all`` = throughput, concurrency, context, short and stall, in this
    order; the fetch-cap ablation, four more servers, is its own suite since the step budget
    made the cap a ceiling: ``all`` has to fit one device session).

    throughput   dense (80 GB pool) vs oasis (host tier of ``--host-gib``) at 16K and 32K input
    concurrency  the same runs' "most running": what each system keeps running at once at 16K
    fetch-cap    oasis at 16K for each of ``--fetch-caps`` (paper Table 2): tok/s and H2D GB/s
    context      dense vs oasis at 4K, 8K, 16K, 32K (80 GB pool / host tier), plotted
    short        1K input: oasis / dense >= 0.97 expected (same pool for both)
    stall        16K oasis without the admission copies (``OASIS_ABLATE=no-transfer``), beside the
                 16K throughput run: the exposed transfer cost inside SGLang's graph replays
    paired       the paired forward (issue 4): oasis vs oasis-eagle3 (and dense, dense-eagle3)
    """
    out, o = [], a.output_len
    # oasis runs name their fetch cap (the config's default when --fetch-cap is not given), so
    # the fetch-cap run at the default cap is the 16K throughput run, measured once
    cap = a.fetch_cap if a.fetch_cap is not None else OasisConfig().fetch_cap
    kvd = getattr(a, "kv_dtype", "auto")
    sysargs = lambda: a.systems or ["dense", "oasis"]  # noqa: E731

    def long_runs(ctxs, tag):
        for n in ctxs:
            hr = host_requests_for(n + o + 64, a.host_gib, kvd)
            for sy in sysargs():
                b = hr if sy.startswith("oasis") else max(hr, a.dense_batch)
                out.append(Run(f"{tag}/{n}/{sy}", sy, n, o, b, "80gb" if sy.startswith("dense") else "exact",
                               None if sy.startswith("dense") else cap, hr))

    if suite in ("throughput", "concurrency", "all"):
        long_runs(a.input_lens or [16384, 32768], "throughput")
    if suite == "fetch-cap":
        n = 16384
        hr = host_requests_for(n + o + 64, a.host_gib, kvd)
        for c in a.fetch_caps:
            out.append(Run(f"fetch-cap/{c}", "oasis", n, o, hr, "exact", c, hr))
    if suite in ("context", "all"):
        long_runs(a.input_lens or [4096, 8192, 16384, 32768], "context")
    if suite in ("short", "all"):
        for sy in sysargs():
            out.append(Run(f"short/1024/{sy}", sy, 1024, o, a.batch, "exact", None if sy.startswith("dense") else cap))
    if suite in ("stall", "all"):
        n = 16384
        hr = host_requests_for(n + o + 64, a.host_gib, kvd)
        if suite == "stall":
            out.append(Run(f"throughput/{n}/oasis", "oasis", n, o, hr, "exact", cap, hr))
        out.append(Run(f"stall/{n}/oasis-no-transfer", "oasis-no-transfer", n, o, hr, "exact", cap, hr))
    if suite == "paired":
        for sy in a.systems or ["oasis", "oasis-eagle3", "dense", "dense-eagle3"]:
            out.append(Run(f"paired/{a.input_len}/{sy}", sy, a.input_len, o, a.batch, "exact",
                           None if sy.startswith("dense") else cap))
    import dataclasses

    if getattr(a, "churn", None):
        out = [dataclasses.replace(r, churn=str(a.churn)) if r.system.startswith("oasis") else r for r in out]
    if kvd != "auto":       # its own keys: an fp8 run never replaces a stored bf16 one (--resume) or meets its dense
        out = [dataclasses.replace(r, kv_dtype=kvd, key=f"{r.key}@{kvd}") for r in out]
    tb = getattr(a, "transfer_budget", "auto")
    if tb != "auto":        # oasis runs at another step budget: their own keys too (dense runs are unchanged)
        out = [dataclasses.replace(r, transfer_budget=tb, key=f"{r.key}@tb={budget_label(tb)}")
               if r.system.startswith("oasis") else r for r in out]
    if suite == "all":       # the context sweep repeats the throughput runs at 16K and 32K: measure once
        seen, uniq = {}, []
        for r in out:
            k = (r.system, r.input_len, r.output_len, r.batch, r.pool, r.fetch_cap, r.churn)
            if k not in seen:
                seen[k] = r
                uniq.append(r)
        out = uniq
    return out


def budget_label(tb) -> str:
    """``transfer_budget`` as written in run keys and table headers: ``auto``, ``null``, a link
    fraction (``0.5``) or bytes per step (``400000000B``: never read as a fraction)."""
    if tb is None:
        return "null"
    if isinstance(tb, int) and not isinstance(tb, bool):
        return f"{tb}B"
    return str(tb)


def key_suffix(key: str) -> str:
    """The ``@...`` part of a run key (KV dtype, transfer budget), ``""`` for a plain run."""
    return "@" + key.split("@", 1)[1] if "@" in key else ""


def spec_overlap_now() -> str:
    """Whether an oasis server with an EAGLE-3 draft started now keeps SGLang's overlap scheduler,
    ``"1"`` or ``"0"`` (``sglang_glue.server_args.spec_overlap``, the rule the server applies).

    Raises:
        OasisConfigError: ``OASIS_SPEC_OVERLAP`` is neither unset, ``0`` nor ``1``."""
    from ..sglang_glue.server_args import spec_overlap

    return "1" if spec_overlap("EAGLE3")[0] else "0"


def spec_overlap_of(res: dict) -> str:
    """A stored oasis-eagle3 result's overlap setting: its ``spec_overlap`` field, else the
    ``OASIS_SPEC_OVERLAP`` it recorded, else ``"0"`` (before 75e68c7 a draft turned it off)."""
    return str(res.get("spec_overlap") or res.get("env", {}).get("OASIS_SPEC_OVERLAP") or "0")


def system_args(run: Run, a) -> list[str]:
    """Server flags of ``run`` (system ``dense``, ``dense-eagle3``, ``oasis`` or ``oasis-eagle3``)."""
    name = run.system
    ctx = run.input_len + run.output_len + 64
    # oasis refuses a budget above the context length: short runs get room for it (both systems)
    args = ["--load-format", "dummy", "--attention-backend", "triton", "--sampling-backend", "pytorch",
            "--max-running-requests", str(run.batch), "--context-length", str(max(ctx, a.budget + 64)),
            "--log-level", "info", "--decode-log-interval", "10"]
    if run.kv_dtype != "auto":
        args += ["--kv-cache-dtype", run.kv_dtype]
    if run.pool == "80gb":
        args += ["--mem-fraction-static", str(dense_80gb_mem_fraction())]
    else:
        args += ["--max-total-tokens", str((run.host_requests or run.batch) * ctx)]
    if name.startswith("dense"):
        args += ["--disable-prefill-cuda-graph", "--cuda-graph-max-bs", str(max(8, run.batch))]
    else:
        cfg = {"budget_tokens": a.budget, "kernels": "triton"}
        if run.fetch_cap is not None:
            cfg["fetch_cap"] = run.fetch_cap
        if a.predictor:
            cfg["predictor"] = a.predictor
        if run.transfer_budget != "auto":
            cfg["transfer_budget"] = run.transfer_budget
        args += oasis_args(**cfg)
        if not name.endswith("eagle3"):
            args += ["--cuda-graph-max-bs", str(max(8, run.batch))]
        if a.eager:
            args += ["--disable-cuda-graph"]
    if name.endswith("eagle3"):
        args += EAGLE + ["--speculative-draft-model-path", os.environ.get("D", "$D")]
    return args


def bench_serving(url: str, run: Run, out: Path, timeout: int) -> dict:
    """``sglang.bench_serving``: ``run.batch`` random-id prompts sent at once; the figures it prints."""
    tag = run.key.replace("/", "_")
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", url,
           "--dataset-name", "random-ids", "--random-input-len", str(run.input_len), "--random-output-len",
           str(run.output_len), "--random-range-ratio", "1", "--num-prompts", str(run.batch), "--max-concurrency",
           str(run.batch), "--tokenize-prompt", "--tokenizer", os.environ["M"], "--model", os.environ["M"],
           "--disable-tqdm", "--seed", "1", "--output-file", str(out / f"serving_{tag}.jsonl")]
    if os.environ.get("DS"):
        cmd += ["--dataset-path", os.environ["DS"]]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    (out / f"bench_serving_{tag}.txt").write_text(" ".join(cmd) + "\n" + r.stdout + "\n" + r.stderr[-4000:])
    if r.returncode:
        raise RuntimeError(f"bench_serving for {run.key} exited {r.returncode}: {r.stderr[-2000:]}")
    res = {}
    for k, pat in SERVING.items():
        m = re.search(pat, r.stdout)
        res[k] = float(m.group(1)) if m else None
    return res


def oasis_figures(lines: list[str], step_ms: float | None, max_running: int | None = None,
                  kv_heads: int | None = None) -> dict:
    """Host-to-device traffic of the decode steps at the most requests running, from the
    ``OasisKV decode`` lines' cumulative counters, with the last line's hit rate, graph steps and
    host-tier size.

    The counters are differences between consecutive lines that are both about a step of
    ``max_running`` requests (the steps between them ran that batch: requests only leave at the
    end), so the figures describe the step whose time is ``step_ms``, not an average over the
    ramp-up and the tail (issue 17: the all-steps average read about half the traffic at 40
    running). Without such a pair they fall back to the first and last lines
    (``h2d_basis: "all steps"``).

    Returns:
        ``h2d_mb_per_step`` (MB, 1e6 bytes), ``h2d_gb_s`` (at ``step_ms``), ``h2d_basis``,
        ``h2d_steps`` (decode steps the figures cover), ``admitted_per_head_step`` (admitted
        pieces per request, sparse layer and KV head per step, when ``kv_heads`` and the running
        count are known: at most ``fetch_cap`` plus forced sink / recent blocks), ``hit_rate``,
        ``graph_steps``, ``decode_steps``, ``dense_steps`` (cumulative, the last line's),
        ``host_tier_gb``; ``{}`` without lines.
    """
    vals = [parse_decode_counters(ln) for ln in lines]
    if not vals:
        return {}
    last = vals[-1]
    res = {"hit_rate": last["hit_rate"], "graph_steps": last["graph_steps"], "decode_steps": last["decode_steps"],
           "dense_steps": last.get("dense_steps"), "host_tier_gb": (last["host_tier_mib"] or 0) * 2**20 / 1e9}
    keys = ("decode_steps", "h2d_mib", "admitted_blocks")
    ok = [v for v in vals if all(v[k] is not None for k in keys)]
    pairs = [(a, b) for a, b in zip(ok, ok[1:]) if max_running and a["running"] == b["running"] == max_running
             and b["decode_steps"] > a["decode_steps"]]
    basis, running = "most running", max_running
    if not pairs and len(ok) >= 2 and ok[-1]["decode_steps"] > ok[0]["decode_steps"]:
        pairs, basis, running = [(ok[0], ok[-1])], "all steps", None
    if not pairs:
        return res
    steps = sum(b["decode_steps"] - a["decode_steps"] for a, b in pairs)
    mb = sum(b["h2d_mib"] - a["h2d_mib"] for a, b in pairs) * 2**20 / 1e6 / steps
    res.update(h2d_mb_per_step=mb, h2d_gb_s=mb / step_ms if step_ms else None, h2d_basis=basis, h2d_steps=steps)
    layers = last.get("sparse_layers")
    if running and kv_heads and layers:
        adm = sum(b["admitted_blocks"] - a["admitted_blocks"] for a, b in pairs)
        res["admitted_per_head_step"] = adm / steps / (running * layers * kv_heads)
    return res


def kv_heads_of(model: str | os.PathLike) -> int | None:
    """``num_key_value_heads`` (or ``num_attention_heads``) of the model folder's config.json, or None."""
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    n = cfg.get("num_key_value_heads", cfg.get("num_attention_heads"))
    return n if isinstance(n, int) and n > 0 else None


def steady_running(log: str, lines_needed: int = 3, min_running: int = 1) -> int | None:
    """The running-request count once the decode phase is steady: the last ``lines_needed``
    ``Decode batch`` lines show the same count, at least ``min_running``, and no earlier line
    showed more. None before. (``bench_serving`` first sends one warm-up request alone: its
    lines are steady at 1, so a batch of several passes ``min_running=2``.)"""
    counts = [int(n) for n, _ in DECODE.findall(log)]
    if len(counts) < lines_needed or len(set(counts[-lines_needed:])) != 1 or counts[-1] < max(counts) \
            or counts[-1] < min_running:
        return None
    return counts[-1]


def keep_trace() -> bool:
    """``OASIS_BENCH_KEEP_TRACE=1`` (or ``true`` / ``yes``): a profile's raw SGLang trace stays
    beside the results as ``trace_<its name>`` (for Perfetto) instead of being deleted."""
    return os.environ.get("OASIS_BENCH_KEEP_TRACE", "").strip().lower() in ("1", "true", "yes")


def drop_traces(traces: list[Path]) -> None:
    """Delete a profile's trace files, except the first one with ``keep_trace()``: it moves one
    folder up (beside the results) as ``trace_<its name>``."""
    for i, t in enumerate(traces):
        if i == 0 and keep_trace():
            t.replace(t.parent.parent / f"trace_{t.name}")
        else:
            t.unlink()


def profile_steady_decode(srv, tag: str, steps: int, tdir: Path, done, timeout: float = 600,
                          grace: float = 60, min_running: int = 1) -> dict:
    """Once ``srv``'s decode phase is steady (``steady_running``), ask SGLang's profiler for
    ``steps`` forward passes of GPU activity (``POST /start_profile``) and summarise the trace
    (``profile_trace.summarize``). Runs in a thread beside ``bench_serving``. ``min_running``:
    the fewest running requests that count as the run's decode phase (``steady_running``).

    Returns ``{}`` when the benchmark ended (``done`` set) before a steady phase, else the
    summary plus ``running`` (requests running when it started), or ``{"error": ...}``: the
    server refused, the trace is not a usable GPU trace, or no trace came within ``grace``
    seconds after the benchmark ended (fewer than ``steps`` forward passes were left)."""
    import requests


    t0 = time.time()
    start = len(srv.log())              # only the benchmark's decode lines (not the warm-up request's)
    while not done.is_set() and time.time() - t0 < timeout:
        n = steady_running(srv.log()[start:], min_running=min_running)
        if n:
            break
        time.sleep(0.5)
    else:
        return {}
    tdir.mkdir(parents=True, exist_ok=True)
    try:
        r = requests.post(srv.url + "/start_profile", json={
            "output_dir": str(tdir), "num_steps": steps, "activities": ["GPU"], "profile_id": tag,
            "with_stack": False, "record_shapes": False}, timeout=120)
        r.raise_for_status()
    except Exception as e:  # noqa: BLE001 - the benchmark's figures stand without the profile
        return {"error": f"/start_profile: {e.__class__.__name__}: {str(e)[:300]}"}
    last_err, ended = None, None
    while True:
        traces = sorted(tdir.glob(f"{tag}-TP-*.trace.json*"))     # SGLang names it <profile_id>-TP-<rank>
        if traces:
            try:
                s = profile_trace.summarize(profile_trace.load_gpu_events(traces[0]), steps)
            except (EOFError, OSError) as e:     # the scheduler process is still writing it
                last_err = e
            except ValueError as e:              # whole but unusable: no retry
                drop_traces(traces)
                return {"error": str(e)[:300]}
            else:
                drop_traces(traces)
                return {**s, "running": n}
        if done.is_set():
            ended = ended or time.time()
            if time.time() - ended > grace:
                return {"error": f"no readable trace {grace:.0f} s after the benchmark ended (fewer than {steps} "
                                 f"forward passes left?{'' if last_err is None else f' last: {last_err!r}'})"}
        time.sleep(0.5)


SHARED_SUITES = ("throughput", "context")   # long runs: one server per system serves every context


def server_groups(runs: list[Run], share: bool = True) -> list[list[Run]]:
    """The runs one server can serve one after the other (``share``): the throughput / context
    runs of one system, pool and fetch cap (the 4K .. 32K points differ only in prompt length
    and count); every other run alone. Groups keep the plan's order of their first run.

    A server start is most of a run (the 96 GiB host tier is pinned in 101-127 s, then graphs
    are captured); sharing one per system is what fits the whole suite in a device session."""
    groups, index = [], {}
    for r in runs:
        k = (r.system, r.pool, r.fetch_cap, r.churn) if share and r.key.split("/")[0] in SHARED_SUITES \
            else ("alone", r.key)
        if k in index:
            groups[index[k]].append(r)
        else:
            index[k] = len(groups)
            groups.append([r])
    return groups


def group_args(group: list[Run], a) -> list[str]:
    """Server flags that serve every run of ``group``: the flags of its longest context with the
    most requests any run sends, the graphs for that batch and the largest token pool (host
    tier) any run needs."""
    longest = max(group, key=lambda r: r.input_len)
    args = system_args(longest, a)
    sets = {"--max-running-requests": max(r.batch for r in group),
            "--cuda-graph-max-bs": max(max(8, r.batch) for r in group),
            "--max-total-tokens": max((r.host_requests or r.batch) * (r.input_len + r.output_len + 64) for r in group)}
    for flag, val in sets.items():
        if flag in args:
            args[args.index(flag) + 1] = str(val)
    return args


def start_server(args: list[str], log_path: Path, a, ablate: bool = False, churn: str | None = None):
    """``sglang serve`` with ``args`` (``OASIS_ABLATE=no-transfer`` when ``ablate``,
    ``OASIS_CHURN=churn`` when given); the ``testing.launch.Server``. Raises what the launch raises."""
    env = {"OASIS_ABLATE": "no-transfer" if ablate else None, "OASIS_CHURN": churn}
    try:
        for k, v in env.items():          # read by the server's OasisKV engine (BenchHooks.from_env)
            if v:
                os.environ[k] = v
        return launch(os.environ["M"], 0, args, log_path, timeout=a.timeout, echo=False)
    finally:
        for k, v in env.items():
            if v:
                os.environ.pop(k, None)


SERVER_ENV = ("OASIS_SPEC_OVERLAP", "OASIS_COPY_PROGRAMS", "OASIS_DECODE_LOG_INTERVAL", "OASIS_ABLATE",
              "OASIS_RECORD_LENGTHS")   # recorded when set


def server_env() -> dict:
    """The experiment variables (``SERVER_ENV``) set in this process, which every server inherits."""
    return {k: os.environ[k] for k in SERVER_ENV if os.environ.get(k)}


def run_one(run: Run, a, out: Path, srv=None) -> dict:
    """Benchmark ``run``; its figures (``error`` when it failed).

    Without ``srv`` the run starts its own server and stops it after; with ``srv`` (a shared
    server, ``server_groups``) it reads only the log written from now on and leaves it running.
    With ``--profile-steps N`` a thread profiles ``N`` steady decode steps meanwhile (result
    field ``profile``, table ``profile_<run>.md``)."""
    base = {"key": run.key, "system": run.system, "input_len": run.input_len, "output_len": run.output_len,
            "batch": run.batch, "pool": run.pool, "fetch_cap": run.fetch_cap, "host_requests": run.host_requests,
            "churn": run.churn, "kv_dtype": run.kv_dtype, "transfer_budget": run.transfer_budget,
            "date": time.strftime("%Y-%m-%d %H:%M")}
    env = server_env()
    if env:
        base["env"] = env           # experiments the servers inherit (not part of the run's key)
    if run.system == "oasis-eagle3":
        base["spec_overlap"] = spec_overlap_now()
    t0 = time.time()
    own = srv is None
    if own:
        try:
            srv = start_server(system_args(run, a), out / f"server_{run.key.replace('/', '_')}.log", a,
                               ablate=run.system == "oasis-no-transfer", churn=run.churn)
        except Exception as e:  # noqa: BLE001 - report and go on with the next run
            return {**base, "error": f"start failed: {e.__class__.__name__}: {str(e)[:300]}"}
        base["start_s"] = round(time.time() - t0, 1)
    else:
        base["shared_server"] = True
    offset = len(srv.log())
    try:
        res = dict(base)
        prof, done = {}, None
        if a.profile_steps:
            import threading

            tag = run.key.replace("/", "_")
            done = threading.Event()
            th = threading.Thread(target=lambda: prof.update(
                profile_steady_decode(srv, tag, a.profile_steps, out / ".traces", done,
                                      min_running=2 if run.batch > 1 else 1)), daemon=True)
            th.start()
        try:
            res.update(bench_serving(srv.url, run, out, a.timeout))
        finally:
            if done is not None:
                done.set()
                th.join(timeout=120)           # the thread gives up 60 s after the benchmark ends
        if done is not None:
            if th.is_alive():
                prof = {"error": "the profile thread did not finish within 120 s of the benchmark"}
            if prof:
                res["profile"] = dict(prof)
            if prof and "error" not in prof:
                try:
                    (out / f"profile_{tag}.md").write_text(
                        profile_trace.markdown(prof, f"{run.key}, {prof['running']} running") + "\n")
                except Exception as e:  # noqa: BLE001 - the benchmark's figures stand without the profile
                    res["profile"] = {"error": f"{e.__class__.__name__}: {str(e)[:200]}"}
        log = srv.log()[offset:]
        lines = [(int(n), float(g)) for n, g in DECODE.findall(log)]
        top = max((n for n, _ in lines), default=0)       # prefills stagger arrivals: not always --batch
        full = [g for n, g in lines if n == top][1:] or [g for n, g in lines if n == top]   # first: since the prefill
        res["max_running"] = top
        res["decode_lines_at_max_running"] = len(full)
        res["decode_tok_s"] = statistics.median(full) if full else None
        res["step_ms"] = 1e3 * top / res["decode_tok_s"] if res["decode_tok_s"] else None
        ol = [l for l in log.splitlines() if "OasisKV decode:" in l]
        res["oasis_line"] = ol[-1].split("OasisKV decode: ", 1)[-1] if ol else None
        res["link_gb_s"] = link_rate(srv.log())     # the start-up line (before ``offset`` on a shared server)
        res.update(oasis_figures(ol, res["step_ms"], top, kv_heads_of(os.environ["M"])))
        res.update(hbm_figures(run, top, res["step_ms"], a.budget, roofline.ModelShape.from_config(os.environ["M"]),
                               gpu_name()))
        return res
    except Exception as e:  # noqa: BLE001
        return {**base, "error": f"{e.__class__.__name__}: {str(e)[:500]}"}
    finally:
        if own:
            srv.stop()


LINK = re.compile(r"OasisKV: transfer budget \S+: admission copies measured at ([\d.]+) GB/s host to device")


def link_rate(log: str) -> float | None:
    """The host link rate (GB/s) the oasis server measured at start-up for its ``"auto"`` step
    budget (``sglang_glue/install.py``'s line; the last one when the log holds several), or
    ``None`` (dense, a fixed budget, or no CUDA). The same command admits different bytes on
    hosts whose links differ (25.4 vs 48.3 GB/s on two H100 instances, 2026-12-06): traffic
    figures carry it."""
    m = LINK.findall(log)
    return float(m[-1]) if m else None


def hbm_figures(run: Run, running: int, step_ms: float | None, budget: int, shape, gpu: str) -> dict:
    """The HBM bytes of the step at ``running`` requests and the bandwidth it reached
    (``bench/roofline.py``): ``hbm_gb_per_step`` (the lower bound, GB), ``hbm_tb_s``,
    ``hbm_of_peak`` (``None`` for a GPU whose peak is not in the table). The context is the
    prompt plus half the output (the decode's mean); OasisKV's block size and dense layers are
    the config's defaults (what bench_oasis runs). Empty without a step time or a readable
    ``config.json``; a ``-eagle3`` system's draft model is not counted."""
    if not step_ms or not running or shape is None:
        return {}
    d = OasisConfig()
    kvb = 1 if run.kv_dtype.startswith("fp8") else 2
    b = roofline.step_hbm_bytes(shape, "dense" if run.system.startswith("dense") else "oasis", running,
                                run.input_len + run.output_len // 2, kv_bytes=kvb, budget=budget,
                                block=d.block_size, dense_layers=len(d.dense_layers))
    tb_s, frac = roofline.reached(b["total"], step_ms, gpu)
    return {"hbm_gb_per_step": b["total"] / 1e9, "hbm_tb_s": tb_s, "hbm_of_peak": frac}


def _f(x, p=1):
    return "-" if x is None else f"{x:.{p}f}"


def suite_rows(results: list[dict], suite: str) -> list[dict]:
    """The results of ``suite``, with the runs it shares with the throughput suite under ``all``:
    the context sweep's 16K / 32K points and the fetch-cap run at the default cap (the 16K oasis
    run), unless the suite measured them itself."""
    rows = [r for r in results if r["key"].startswith(suite + "/") and "error" not in r]
    rows += [r for r in results if r["key"].startswith(suite + "/") and "error" in r]
    thr = [r for r in results if r["key"].startswith("throughput/") and "error" not in r]
    if suite == "context" and rows:
        have = {(r.get("system"), r.get("input_len"), key_suffix(r["key"])) for r in rows}
        rows += [r for r in thr if (r.get("system"), r.get("input_len"), key_suffix(r["key"])) not in have]
        rows.sort(key=lambda r: (r.get("input_len") or 0, r.get("system") or "", key_suffix(r["key"])))
    elif suite == "fetch-cap" and rows:
        # the 16K throughput run at a cap the suite did not measure, with the same KV dtype and budget
        have = {(r.get("fetch_cap"), key_suffix(r["key"])) for r in rows}
        sfx = {key_suffix(r["key"]) for r in rows}
        rows += [r for r in thr if r.get("system") == "oasis" and r.get("input_len") == 16384
                 and r.get("fetch_cap") is not None and key_suffix(r["key"]) in sfx
                 and (r["fetch_cap"], key_suffix(r["key"])) not in have]
        rows.sort(key=lambda r: (key_suffix(r["key"]), r.get("fetch_cap") or 0))
    return rows


def _dense_of(r: dict, by: dict) -> dict | None:
    """The dense run an oasis run is compared with (same suite, length and KV dtype; fetch-cap:
    16K throughput)."""
    if r["system"] != "oasis":
        return None
    kvd = r.get("kv_dtype", RUN_DEFAULTS["kv_dtype"])
    sfx = "" if kvd == "auto" else f"@{kvd}"
    if r["key"].startswith("fetch-cap/"):
        return by.get("throughput/16384/dense" + sfx)
    return by.get(r["key"].split("@")[0].rsplit("/", 1)[0] + "/dense" + sfx)


def tables(results: list[dict], a) -> str:
    """Markdown: one table per suite present in ``results``, with the issue-5 ratios."""
    by = {r["key"]: r for r in results}
    md = [f"Qwen3-8B-shaped dummy (random weights: speed only), {gpu_name()}; oasis budget {a.budget}, predictor "
          f"{a.predictor or 'default'}, {'eager' if a.eager else 'decode CUDA graphs'}; dense KV pool "
          f"--mem-fraction-static {dense_80gb_mem_fraction()} (80 GB GPU) where marked 80gb; oasis host tier "
          f"{a.host_gib} GiB unless sized to the batch; KV cache dtype {getattr(a, 'kv_dtype', 'auto')}; transfer "
          f"budget {budget_label(getattr(a, 'transfer_budget', 'auto'))}."
          + (f" Oasis predictions replay the churn profile {a.churn} (OASIS_CHURN, core/churn.py)."
             if getattr(a, "churn", None) else " Random-weight churn (about the whole cap every step)."), ""]
    # "H2D GB/s over the step": the step's admitted bytes over the whole step time (how much of the
    # step the link would be busy at that rate), not the copy kernels' own rate (a profile gives it)
    head = ("| run | most running | decode tok/s | step ms | output tok/s | TPOT ms | TTFT s | H2D MB/step | H2D GB/s over the step | "
            "admitted / (req, layer, head) / step | hit rate | vs dense | host link GB/s (start-up) |")
    sep = "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    for suite in ("throughput", "context", "fetch-cap", "short", "stall", "paired"):
        rows = suite_rows(results, suite)
        if not rows:
            continue
        md += [f"### {suite}", "", head, sep]
        for r in rows:
            if "error" in r:
                err = " ".join(str(r["error"]).split())[:150].replace("|", "/")
                md.append(f"| {r['key']} | failed: {err} |" + " |" * 11)
                continue
            dense = _dense_of(r, by)
            ratio = (r["decode_tok_s"] / dense["decode_tok_s"]
                     if dense and dense.get("decode_tok_s") and r.get("decode_tok_s") else None)
            key = r["key"] if r["key"].startswith(suite + "/") or suite != "fetch-cap" else f"{r['key']} (cap {r.get('fetch_cap')})"
            if r.get("env"):
                key += " (" + ", ".join(f"{k}={v}" for k, v in r["env"].items()) + ")"
            if r.get("system") == "oasis-eagle3" and spec_overlap_of(r) == "0":
                key += " (overlap scheduler off)"
            md.append(f"| {key} | {'-' if r.get('max_running') is None else r['max_running']} | {_f(r.get('decode_tok_s'))} | "
                      f"{_f(r.get('step_ms'), 2)} | {_f(r.get('output_tok_s'))} | {_f(r.get('median_tpot_ms'), 2)} | "
                      f"{_f((r.get('median_ttft_ms') or 0) / 1e3 if r.get('median_ttft_ms') else None)} | "
                      f"{_f(r.get('h2d_mb_per_step'))}{'' if r.get('h2d_basis', 'most running') == 'most running' else ' (all steps)'} | "
                      f"{_f(r.get('h2d_gb_s'), 2)} | {_f(r.get('admitted_per_head_step'), 2)} | {_f(r.get('hit_rate'), 3)} | "
                      f"{'-' if ratio is None else f'{ratio:.2f}x'} | {_f(r.get('link_gb_s'))} |")
        md.append("")
    hbm = [r for r in results if "error" not in r and isinstance(r.get("hbm_gb_per_step"), (int, float))
           and isinstance(r.get("hbm_tb_s"), (int, float))]
    if hbm:
        md += ["### HBM bandwidth reached (bench/roofline.py: weights + the KV the step reads, a lower bound)", "",
               "| run | most running | GB per step | TB/s | of the GPU's peak |", "|---|---|---|---|---|"]
        for r in hbm:
            frac = r.get("hbm_of_peak")
            md.append(f"| {r['key']} | {r.get('max_running')} | {r['hbm_gb_per_step']:.1f} | {r['hbm_tb_s']:.2f} | "
                      f"{'-' if not isinstance(frac, (int, float)) else f'{100 * frac:.0f}%'} |")
        md.append("")
    stall = []        # each no-transfer run beside the 16K oasis run of the same KV dtype and transfer budget
    for st in results:
        if st.get("system") != "oasis-no-transfer" or not st["key"].startswith("stall/16384/") or not st.get("step_ms"):
            continue
        base_run = by.get("throughput/16384/oasis" + key_suffix(st["key"]))
        if base_run and base_run.get("step_ms"):
            exp = 1 - st["step_ms"] / base_run["step_ms"]
            stall.append(f"| 16K{key_suffix(st['key'])} | {base_run.get('max_running')} / {st.get('max_running')} | "
                         f"{base_run['step_ms']:.2f} | {st['step_ms']:.2f} | {100 * exp:.1f}% |")
    if stall:
        md += ["### stall (exposed transfer inside SGLang's graph replays)", "",
               "| context | running | oasis step ms | without admission copies ms | exposed transfer share of the step |",
               "|---|---|---|---|---|"] + stall + [""]
    prof = [r for r in results if isinstance(r.get("profile"), dict) and "error" not in r["profile"]
            and isinstance(r["profile"].get("groups_ms"), dict)
            and all(isinstance(r["profile"].get(k), (int, float)) for k in ("running", "window_ms", "busy_frac", "idle_ms"))]
    if prof:
        groups = ["GEMMs", "dense attention (SGLang)", "sparse attention", "scoring", "top-K", "admission plan",
                  "H2D copy", "append + summaries"]
        md += ["### decode step profile (GPU time per step, SGLang's profiler)", "",
               "| run | running | window ms | GPU busy | idle ms | " + " | ".join(groups) + " | other |",
               "|---|---|---|---|---|" + "---|" * (len(groups) + 1)]
        for r in prof:
            p = r["profile"]
            gm = p["groups_ms"]
            other = sum(v for g, v in gm.items() if g not in groups)
            md.append(f"| {r['key']} | {p['running']} | {p['window_ms']:.2f} | {100 * p['busy_frac']:.1f}% | "
                      f"{p['idle_ms']:.2f} | " + " | ".join(f"{gm.get(g, 0.0):.2f}" for g in groups)
                      + f" | {other:.2f} |")
        md.append("")
    return "\n".join(md)


def plots(results: list[dict], out: Path) -> list[Path]:
    """PNG plots: decode tok/s vs context (dense vs oasis) and vs fetch_cap (with H2D GB/s)."""
    ip = sys.modules.get("IPython")
    if ip is not None and not hasattr(ip, "version_info"):
        # the GPU-host kit's IPython stand-in (imported by SGLang) lacks it; matplotlib's figure
        # reads it and returns early at >= 8.24
        ip.version_info = (8, 24)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (re-run with --plot-only on a machine that has it)", file=sys.stderr)
        return []
    made = []
    ctx = [r for r in results if r["key"].split("/")[0] in ("context", "throughput") and r.get("decode_tok_s")]
    if ctx:
        fig, ax = plt.subplots(figsize=(6, 4))
        # one line per system and key suffix (KV dtype, transfer budget): runs of another setting never mix
        for sy in sorted({(r["system"], key_suffix(r["key"])) for r in ctx}):
            pts = sorted({r["input_len"]: r["decode_tok_s"] for r in ctx
                          if (r["system"], key_suffix(r["key"])) == sy}.items())
            ax.plot([p[0] / 1024 for p in pts], [p[1] for p in pts], marker="o", label=sy[0] + sy[1])
        ax.set_xlabel("input length (K tokens)")
        ax.set_ylabel("decode tok/s (all running)")
        ax.set_title("Decode throughput vs context (80 GB-equivalent KV pool)")
        ax.legend()
        fig.tight_layout()
        made.append(out / "context_sweep.png")
        fig.savefig(made[-1], dpi=120)
        plt.close(fig)
    fc = [r for r in suite_rows(results, "fetch-cap") if r.get("decode_tok_s") and r.get("fetch_cap")
          and not key_suffix(r["key"])]         # the plot: the plain runs (the tables show the others)
    if fc:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        caps = [r["fetch_cap"] for r in fc]
        l1 = ax.plot(caps, [r["decode_tok_s"] for r in fc], marker="o", label="oasis decode tok/s")
        dense = next((r for r in results if r["key"] == "throughput/16384/dense" and r.get("decode_tok_s")), None)
        if dense:
            l1 += [ax.axhline(dense["decode_tok_s"], color="C0", ls="--", lw=1, label="dense decode tok/s")]
        ax.set_xscale("log", base=2)
        ax.set_xticks(caps, [str(c) for c in caps])
        ax.set_xlabel("fetch_cap (evicting admissions per step, request, layer, KV head)")
        ax.set_ylabel("decode tok/s")
        ax2 = ax.twinx()
        l2 = ax2.plot(caps, [r.get("h2d_gb_s") or 0 for r in fc], marker="s", color="C1", label="H2D GB/s")
        ax2.set_ylabel("H2D GB/s")
        ax.set_title("Fetch-cap ablation, 16K context")
        ax.legend(l1 + l2, [h.get_label() for h in l1 + l2], loc="center right", fontsize=8)
        fig.tight_layout()
        made.append(out / "fetch_cap.png")
        fig.savefig(made[-1], dpi=120)
        plt.close(fig)
    return made


T0 = time.time()


def load_results(jpath: Path) -> tuple[list[dict], dict]:
    """``(results, args)`` of a ``bench_oasis.json``; SystemExit with one line if it is malformed."""
    try:
        d = json.loads(jpath.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"bench_oasis: cannot read {jpath}: {e}")
    res = d.get("results") if isinstance(d, dict) else None
    if not isinstance(res, list) or not all(isinstance(r, dict) and isinstance(r.get("key"), str)
                                            and isinstance(r.get("system"), str) for r in res):
        raise SystemExit(f"bench_oasis: {jpath} is not a bench_oasis results file (want {{'results': [{{'key', "
                         f"'system', ...}}, ...]}})")
    for r in res:
        for f in NUMERIC_FIELDS:
            v = r.get(f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
                raise SystemExit(f"bench_oasis: {jpath}: run {r['key']}: {f} is {v!r}, want a finite number or null")
    return res, d.get("args") if isinstance(d.get("args"), dict) else {}


# result fields the tables and plots format as numbers (load_results checks them)
NUMERIC_FIELDS = ("input_len", "output_len", "batch", "fetch_cap", "max_running", "decode_tok_s", "step_ms",
                  "output_tok_s", "median_tpot_ms", "median_ttft_ms", "h2d_mb_per_step", "h2d_gb_s", "hit_rate",
                  "admitted_per_head_step", "hbm_gb_per_step", "hbm_tb_s", "hbm_of_peak", "link_gb_s")
RUN_FIELDS = ("system", "input_len", "output_len", "batch", "pool", "fetch_cap", "host_requests", "churn", "kv_dtype",
              "transfer_budget")
RUN_DEFAULTS = {"kv_dtype": "auto", "transfer_budget": "auto"}      # fields results stored before the field existed were measured with


def estimate_run_s(run: Run, took: dict, prompt_tokens: dict, start_s: float | None, default: float) -> float:
    """Seconds ``run`` is expected to take, for ``--deadline``.

    Args:
        took: ``(system, input_len) -> seconds`` of runs timed in this call, their server's start
            left out; prompt_tokens: the same keys -> tokens those runs prefilled (batch x context).
        start_s: seconds of the server start this run needs first (the last start timed in this
            call; 0 when it runs on a server already up; None when no start was timed yet).
        default: ``--run-estimate``, a whole run with its start, when nothing was timed yet.
    Returns:
        The same system and length's last time; else the system's runs scaled by the tokens
        this run prefills (at least 1x); else ``default``; plus ``start_s`` for a timed figure.
    """
    est = took.get((run.system, run.input_len))
    if est is None:
        same = [(t, prompt_tokens[k]) for k, t in took.items() if k[0] == run.system]
        if not same:
            return default
        est = max(t * max(1.0, run.batch * run.input_len / n) for t, n in same)
    return est + (start_s or 0.0)


def same_run(res: dict, run: Run) -> bool:
    """Whether a stored result measured ``run`` as planned now (same system, lengths, batch, pool,
    fetch cap and host tier; for oasis runs also the same experiment variables, ``server_env``),
    so ``--resume`` may skip it."""
    if run.system.startswith("oasis") and res.get("env", {}) != server_env():
        return False
    if run.system == "oasis-eagle3" and spec_overlap_of(res) != spec_overlap_now():
        return False
    return all(res.get(f, RUN_DEFAULTS.get(f)) == getattr(run, f) for f in RUN_FIELDS)


def main() -> int:
    global T0
    T0 = time.time()                      # --deadline counts from here
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=["all", "throughput", "concurrency", "fetch-cap", "context", "short", "stall",
                                        "paired"],
                    default="all")
    ap.add_argument("--systems", nargs="+", default=None, choices=["dense", "oasis", "dense-eagle3", "oasis-eagle3", "oasis-no-transfer"],
                    help="override the suite's systems")
    ap.add_argument("--only", nargs="+", default=None, help="run only these run keys (see --list)")
    ap.add_argument("--list", action="store_true", help="print the planned runs and exit")
    ap.add_argument("--resume", action="store_true", help="skip runs already in <out>/bench_oasis.json (split a "
                    "long suite over several calls)")
    ap.add_argument("--plot-only", action="store_true", help="rewrite the tables and plots from <out>/bench_oasis.json")
    ap.add_argument("--input-len", type=positive_int, default=16384, help="paired suite: input length")
    ap.add_argument("--input-lens", type=positive_int, nargs="+", default=None, help="throughput / context: input lengths")
    ap.add_argument("--output-len", type=positive_int, default=256)
    ap.add_argument("--batch", type=positive_int, default=8, help="paired / short: requests sent together")
    ap.add_argument("--dense-batch", type=positive_int, default=32,
                    help="throughput / context: prompts sent to dense at least (its pool limits what runs)")
    ap.add_argument("--host-gib", type=positive_float, default=96.0,
                    help="oasis host tier, GiB of Qwen3-8B sparse-layer KV (pinned host memory, 136 KiB a token "
                         "in bf16; the GPU hosts have 128 GiB; 96 GiB holds 44 requests of 16K)")
    ap.add_argument("--budget", type=positive_int, default=2048, help="oasis budget_tokens")
    ap.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES,
                    help="SGLang's --kv-cache-dtype for dense and oasis alike (fp8: half the bytes per token, so "
                         "--host-gib holds twice the requests and the 80 GB dense pool twice the tokens)")
    ap.add_argument("--fetch-cap", type=positive_int, default=None, help="oasis fetch_cap (default: the config's)")
    ap.add_argument("--transfer-budget", type=transfer_budget, default="auto",
                    help="oasis transfer_budget: auto (the config's default: 0.8 of the link over the step's compute "
                         "time), a link fraction such as 0.5, an integer of bytes per step, or null (fetch_cap "
                         "alone); runs at another value than auto get their own keys (@tb=...)")
    ap.add_argument("--fetch-caps", type=positive_int, nargs="+", default=[1, 2, 4, 8, 16], help="fetch-cap suite values")
    ap.add_argument("--predictor", default="previous", choices=["previous", "lookahead", "current"],
                    help="oasis predictor (previous: the asynchronous pipeline without a draft model)")
    ap.add_argument("--eager", action="store_true", help="oasis without CUDA graphs")
    ap.add_argument("--churn", default=None, metavar="FILE",
                    help="oasis runs replay this churn profile (results.json of scripts/measure_agreement.py "
                         "--fetch-caps unbounded, or a JSON list of per-layer means): a measured admission rate "
                         "instead of random weights' (core/churn.py)")
    ap.add_argument("--separate-servers", action="store_true",
                    help="one server per run (default: the throughput / context runs of a system share one server, "
                         "started for the longest context and the most requests; server_groups)")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds after start-up past which no new run starts: a run starts only if its estimate "
                         "still fits (the last run of its system and length in this call, else that system's last "
                         "run scaled by context, else --run-estimate); a device call has a hard limit")
    ap.add_argument("--run-estimate", type=float, default=240.0,
                    help="seconds one run takes, for --deadline before a run has been timed")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="also profile this many steady decode steps of each run with SGLang's profiler "
                         "(GPU time by kernel group and GPU idle time; oasis_sglang/bench/profile_trace.py)")
    ap.add_argument("--timeout", type=positive_int, default=900, help="seconds for a server start / one bench_serving run")
    ap.add_argument("--out", default=os.environ.get("OUT", "out") + "/bench_oasis")
    a = ap.parse_args()
    if not math.isfinite(a.run_estimate) or a.run_estimate <= 0 or a.deadline is not None and (
            not math.isfinite(a.deadline) or a.deadline <= 0):
        ap.error("--deadline and --run-estimate must be positive, finite seconds")
    if not 0 <= a.profile_steps <= 64:
        ap.error(f"--profile-steps must be 0 (off) to 64, got {a.profile_steps}")
    try:                  # the oasis servers would each refuse a bad budget or cap at start-up
        OasisConfig(budget_tokens=a.budget, fetch_cap=a.fetch_cap, transfer_budget=a.transfer_budget)
        for c in a.fetch_caps:
            OasisConfig(budget_tokens=a.budget, fetch_cap=c)
    except ValueError as e:
        ap.error(f"--budget / --fetch-cap(s) / --transfer-budget: {e}")
    if a.churn is not None and not a.churn:
        ap.error("--churn: empty file name")
    if a.churn:
        from ..core.churn import load_profile

        try:
            load_profile(a.churn)
        except (OSError, ValueError) as e:
            ap.error(f"--churn: {e}")
        a.churn = str(Path(a.churn).resolve())
    if a.deadline is not None and a.deadline < a.run_estimate:
        ap.error(f"--deadline {a.deadline:g} is below --run-estimate {a.run_estimate:g}: no run would start")
    for name in ("fetch_caps", "input_lens", "systems"):
        if getattr(a, name):
            setattr(a, name, list(dict.fromkeys(getattr(a, name))))     # a repeated value is one run
    try:
        runs = plan(a.suite, a)
    except ValueError as e:
        ap.error(str(e))
    if any(r.system == "oasis-eagle3" for r in runs):
        try:                  # every oasis-eagle3 server would refuse it at start-up
            spec_overlap_now()
        except ValueError as e:
            ap.error(str(e))
    if a.only:
        unknown = set(a.only) - {r.key for r in runs}
        if unknown:
            ap.error(f"--only: unknown run keys {sorted(unknown)}; planned: {[r.key for r in runs]}")
        runs = [r for r in runs if r.key in a.only]
    if a.list:                            # the servers that would start, with the runs each serves
        for group in server_groups(runs, share=not a.separate_servers):
            r = group[0]
            env = ("OASIS_ABLATE=no-transfer " if r.system == "oasis-no-transfer" else "") + \
                (f"OASIS_CHURN={r.churn} " if r.churn else "")
            args = group_args(group, a) if len(group) > 1 else system_args(r, a)
            print(" ".join(x.key for x in group), f"{env}sglang serve --model-path $M", " ".join(args))
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    jpath = out / "bench_oasis.json"
    results = []
    if a.plot_only and not jpath.exists():
        ap.error(f"--plot-only: no results at {jpath} (--out names the folder holding bench_oasis.json)")
    if a.resume and not jpath.exists():
        print(f"bench_oasis: --resume: no results at {jpath} yet; starting from scratch", file=sys.stderr)
    if (a.resume or a.plot_only) and jpath.exists():
        results, stored = load_results(jpath)
        if a.plot_only:                   # the table header describes the stored runs
            for k in ("budget", "predictor", "eager", "host_gib", "churn", "kv_dtype", "transfer_budget"):
                if k in stored:
                    setattr(a, k, stored[k])
    failed: set[str] = set()
    if not a.plot_only:
        for var in ("M",) + (("D",) if any(r.system.endswith("eagle3") for r in runs) else ()):
            if not os.environ.get(var) or not Path(os.environ[var]).is_dir():
                ap.error(f"environment variable {var}={os.environ.get(var, '')!r} must name the model folder "
                         f"(source the gpu-host kit's env.sh)")
        stored_by = {r["key"]: r for r in results}
        todo = []
        for r in runs:
            old = stored_by.get(r.key)
            if old is not None and "error" not in old and same_run(old, r):
                continue
            if old is not None and "error" not in old:
                diff = {f: (old.get(f, RUN_DEFAULTS.get(f)), getattr(r, f)) for f in RUN_FIELDS
                        if old.get(f, RUN_DEFAULTS.get(f)) != getattr(r, f)}
                print(f"bench_oasis: --resume: {r.key} was measured with other settings {diff} (stored, planned): "
                      "measuring it again", file=sys.stderr)
            todo.append(r)
        pending = False
        took: dict[tuple, float] = {}        # (system, input_len) -> seconds of its last run in this call,
        #                                      its server's start left out (counted in start_est)
        prompt_tokens: dict[tuple, int] = {}  # (system, input_len) -> tokens its requests sent
        start_est = None                     # seconds a server start takes (the last start of this call)
        bar = tqdm(total=len(todo), desc=f"bench_oasis {a.suite}", file=sys.stderr)

        def record(res: dict) -> None:
            nonlocal results
            print(json.dumps(res), file=sys.stderr, flush=True)
            old = next((r for r in results if r["key"] == res["key"]), None)
            if "error" in res and old is not None and "error" not in old:
                failed.add(res["key"])           # a failed re-measurement never loses a stored result
                print(f"bench_oasis: {res['key']} failed; its stored result (measured {old.get('date')}) is kept",
                      file=sys.stderr)
                bar.update()
                return
            results = [r for r in results if r["key"] != res["key"]] + [res]
            # written after every run: a call cut short keeps what it measured (--resume goes on)
            jpath.write_text(json.dumps({"args": vars(a), "results": results}, indent=1))
            (out / "bench_oasis.md").write_text(tables(results, a) + "\n")
            mirror = os.environ.get("OASIS_BENCH_MIRROR")   # gpu_smoke.sh: $OUT, kept even if the call is cut
            if mirror:
                Path(mirror).mkdir(parents=True, exist_ok=True)
                for f in ("bench_oasis.json", "bench_oasis.md"):
                    (Path(mirror) / f).write_bytes((out / f).read_bytes())
            bar.update()

        for group in server_groups(todo, share=not a.separate_servers):
            srv = None
            for i, run in enumerate(group):
                est = estimate_run_s(run, took, prompt_tokens, start_est if srv is None else 0.0, a.run_estimate)
                if a.deadline is not None and time.time() - T0 + est > a.deadline:
                    left = [r.key for r in todo[todo.index(run):]]
                    print(f"bench_oasis: --deadline {a.deadline:.0f} s: {len(left)} runs left for --resume: {left}",
                          file=sys.stderr)
                    pending = True
                    break
                t_run, start_s = time.time(), 0.0
                if len(group) > 1 and srv is None:
                    name = f"server_{run.system}_{run.pool}_shared.log"
                    try:
                        srv = start_server(group_args(group, a), out / name, a,
                                           ablate=run.system == "oasis-no-transfer", churn=run.churn)
                    except Exception as e:  # noqa: BLE001 - every run of the group failed to start
                        err = f"start failed: {e.__class__.__name__}: {str(e)[:300]}"
                        for r in group[i:]:
                            record({f: getattr(r, f) for f in RUN_FIELDS} | {"key": r.key, "error": err,
                                                                             "date": time.strftime("%Y-%m-%d %H:%M")})
                        break
                    start_s = round(time.time() - t_run, 1)
                    res = run_one(run, a, out, srv=srv)
                    res["start_s"] = start_s           # the shared server's start, counted on its first run
                else:
                    res = run_one(run, a, out, srv=srv)
                if "error" not in res:
                    res["run_s"] = round(time.time() - t_run, 1)       # the shared server's start included
                    start_s = res.get("start_s", start_s)
                    if start_s:
                        start_est = start_s
                    took[(run.system, run.input_len)] = time.time() - t_run - start_s
                    prompt_tokens[(run.system, run.input_len)] = run.batch * run.input_len
                record(res)
            if srv is not None:
                srv.stop()
            if pending:
                break
        bar.close()
    md = tables(results, a)
    (out / "bench_oasis.md").write_text(md + "\n")
    for p in plots(results, out):
        print(f"wrote {p}", file=sys.stderr)
    print(md)
    if not a.plot_only and pending:
        return 3
    planned = {r.key for r in runs}       # errors of stored runs outside this call's plan do not count
    return 1 if failed or any("error" in r for r in results if r["key"] in planned) else 0


if __name__ == "__main__":
    sys.exit(main())
