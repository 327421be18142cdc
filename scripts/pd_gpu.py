"""PD on one GPU, admission traffic and decode speed: a prefill and a decode server with
``--kv-sparse oasis`` side by side on the same GPU, NIXL over loopback (issue 19's H200 runs).

    python scripts/pd_gpu.py --model $M --input-len 16384 --requests 2 --out out/pd_gpu

Both servers serve ``--model`` with random weights (``--load-format dummy``, always: speed and
bytes only; the gpu-host kit's Qwen3-8B-shaped dummy) with SGLang's PD mode
(``--disaggregation-transfer-backend nixl``), ``--mem-fraction-static`` 0.4 each, the triton
attention backend, ``--sampling-backend pytorch`` (the gpu-host kit's settings), the predictor
from ``--predictor`` (``previous`` by default; ``current``, what ``auto`` picks without a draft,
keeps the decode node eager), the decode node's ``pd_read_mode`` from ``--pd-read-mode`` (``deferred``, the default:
no host read inside a predicted step; ``wait``: one per layer). The prefill node runs no CUDA graphs;
the decode node runs its decode steps in CUDA graphs with ``--cuda-graph`` (``deferred`` only: the
plugin refuses graphs to a step that reads inside its layers) and eagerly without. The requests go
to both servers at once with one bootstrap room each, as sglang-router sends them (the router is
not needed to measure what crosses), the decode node's answer streamed (each request's TTFT:
prefill, admission, first step). ``--system dense``: both nodes plain SGLang PD, the baseline
(the whole KV crosses at admission). Reported from the decode node's ``OasisKV PD`` lines: MiB at
admission against a full transfer, MiB read on demand, the request's sparse-layer KV held in the
decode node's host tier against a whole allocation (on a GPU the tier is page-locked whole: that
figure is what an on-demand tier would hold, not memory saved); the wall time of each request;
and the decode node's speed from SGLang's ``Decode batch`` lines (``gen throughput``, ``cuda
graph``) at the most requests running.
Exit status 1 when no request was admitted (oasis), a node answered with an error, or the decode
node's answer came back short.
Writes ``<out>/pd_gpu.json``, ``<out>/pd_gpu.md`` and both servers' logs.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import re
import sys
import time
from pathlib import Path

ADMITTED = re.compile(r"OasisKV PD: admitted request (\S+) from \S+: (\d+) prompt tokens, ([\d.]+) MiB at admission "
                      r".* vs ([\d.]+) MiB for a full transfer \(([\d.]+)x less\)")
RELEASED = re.compile(r"OasisKV PD: released request (\S+): its sparse layers' KV in this node's host tier ([\d.]+) MiB "
                      r".* vs ([\d.]+) MiB allocated whole \((?:([\d.]+)x less|none held|all of it)\); host tier resident "
                      r"([\d.]+ MiB|-)")
READ = re.compile(r"read on demand so far: ([\d.]+) MiB in (\d+) NIXL reads")
# the third figure (marking ended reads' pieces present): release lines of 2026-12-04 on
SERVICE = re.compile(r"starting reads between steps: ([\d.]+) ms per step \(([\d.]+) ms of it reading"
                     r"(?: the plans' counts, ([\d.]+) ms marking)?")
DECODE = re.compile(r"Decode batch.*?#running-req: (\d+).*?cuda graph: (\w+).*?gen throughput \(token/s\): ([\d.]+)")


def decode_speed(log: str) -> dict:
    """SGLang's decode lines at the most requests running: median ``gen throughput`` (tok/s),
    lines, and how many of them ran CUDA graphs."""
    rows = [(int(n), g == "True", float(t)) for n, g, t in DECODE.findall(log)]
    if not rows:
        return {"running": 0, "lines": 0, "tok_s_median": None, "cuda_graph_lines": 0}
    most = max(r[0] for r in rows)
    at = sorted(r[2] for r in rows if r[0] == most)
    return {"running": most, "lines": len(at), "tok_s_median": at[len(at) // 2], "tok_s_max": at[-1],
            "cuda_graph_lines": sum(1 for r in rows if r[0] == most and r[1])}


def server_args(a, mode: str, bootstrap: int) -> list[str]:
    cfg = {"budget_tokens": a.budget, "kernels": "triton", "predictor": a.predictor, "pd_read_mode": a.pd_read_mode}
    args = ["--load-format", "dummy", "--attention-backend", "triton", "--sampling-backend", "pytorch",
            "--mem-fraction-static", str(a.mem_fraction), "--max-running-requests", str(a.requests),
            "--max-total-tokens", str(a.requests * (a.input_len + a.output_len + 64) + 4096),
            "--context-length", str(a.input_len + a.output_len + 64), "--log-level", "info",
            "--decode-log-interval", "16",
            "--disaggregation-mode", mode, "--disaggregation-transfer-backend", "nixl"]
    if a.system == "oasis":
        args += ["--kv-sparse", "oasis", "--kv-sparse-config", json.dumps(cfg)]
    if mode == "prefill":
        args += ["--disaggregation-bootstrap-port", str(bootstrap)]
    if mode == "decode" and a.cuda_graph:
        args += ["--cuda-graph-max-bs", str(max(8, a.requests))]
    else:
        args += ["--disable-cuda-graph"]
    return args


def _stream_decode(url: str, body: dict, t0: float) -> dict:
    """POST ``body`` to a decode node's ``/generate`` with ``stream`` on (SGLang's SSE chunks
    ``data: {...}``, then ``data: [DONE]``): the status, the seconds from ``t0`` to the first chunk
    carrying a token (TTFT), the completion tokens of the last chunk, and the error text: an
    ``error`` chunk, an aborted request (SGLang streams an abort, e.g. a lost prefill node, as a
    chunk whose ``finish_reason`` has type ``abort``, under HTTP 200), or the connection's failure."""
    import requests

    out = {"status": None, "ttft_s": None, "tokens": 0, "error": None}
    try:
        with requests.post(url + "/generate", json={**body, "stream": True}, stream=True, timeout=1800) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                out["error"] = r.text[:500]
                return out
            for line in r.iter_lines():
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out["error"] = str(chunk["error"])[:500]
                    break
                meta = chunk.get("meta_info", {})
                n = int(meta.get("completion_tokens", 0))
                if n > 0 and out["ttft_s"] is None:
                    out["ttft_s"] = time.time() - t0
                out["tokens"] = max(out["tokens"], n)
                fr = meta.get("finish_reason")
                if isinstance(fr, dict) and fr.get("type") == "abort":
                    out["error"] = f"aborted ({fr.get('status_code')}): {fr.get('message')}"[:500]
    except (requests.RequestException, ValueError) as e:      # the node went away, a bad chunk
        out["error"] = f"{e.__class__.__name__}: {e}"[:500]
    return out


def pd_generate(prefill_url: str, decode_url: str, bootstrap: int, ids: list[int], n_new: int, room: int) -> dict:
    """One request sent to both nodes with the same bootstrap room (sglang-router's PD routing),
    the decode node's answer streamed.

    Returns ``{"prefill_status", "decode_status", "wall_s", "ttft_s", "output_tokens", "error"}``:
    ``ttft_s`` is the time to the decode node's first token (prefill, the admission's transfer
    and, with OasisKV, its first step's reads; ``None`` when no token came), ``wall_s`` until the
    last one; ``error`` the decode node's, else the prefill node's, else ``None``.
    """
    import requests

    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n_new, "ignore_eos": True},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap, "bootstrap_room": room}
    t0 = time.time()
    with cf.ThreadPoolExecutor(2) as ex:
        fp = ex.submit(requests.post, prefill_url + "/generate", json=body, timeout=1800)
        fd = ex.submit(_stream_decode, decode_url, body, t0)
        rd = fd.result()
        wall = time.time() - t0
        rp = fp.result()
    err = rd["error"] or (None if rp.status_code == 200 else rp.text[:500])
    return {"prefill_status": rp.status_code, "decode_status": rd["status"], "wall_s": wall,
            "ttft_s": rd["ttft_s"], "output_tokens": rd["tokens"], "error": err}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--input-len", type=int, default=16384)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--mem-fraction", type=float, default=0.4, help="--mem-fraction-static of each server")
    ap.add_argument("--pd-read-mode", choices=("deferred", "wait"), default="deferred",
                    help="the decode node's pd_read_mode (deferred: reads between steps; wait: in each layer)")
    ap.add_argument("--predictor", choices=("previous", "current"), default="previous",
                    help="both nodes' predictor (current: each layer reads inside the step, so no CUDA graphs)")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="decode node: decode steps in CUDA graphs (needs --pd-read-mode deferred)")
    ap.add_argument("--system", choices=("oasis", "dense"), default="oasis",
                    help="dense: both nodes plain SGLang PD (the whole KV crosses at admission): the baseline")
    ap.add_argument("--out", default="out/pd_gpu")
    a = ap.parse_args(argv)
    for name in ("input_len", "output_len", "requests", "budget"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.cuda_graph and a.system == "oasis" and (a.pd_read_mode != "deferred" or a.predictor != "previous"):
        ap.error("--cuda-graph needs --pd-read-mode deferred and --predictor previous (otherwise the decode node "
                 "reads inside each layer)")
    if not 0 < a.mem_fraction <= 0.45:
        ap.error("--mem-fraction must be in (0, 0.45]: two servers share the GPU")
    if a.budget > a.input_len + a.output_len + 64:
        ap.error(f"--budget {a.budget} exceeds the servers' context length ({a.input_len + a.output_len + 64} = "
                 "--input-len + --output-len + 64)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from oasis_sglang.testing.launch import free_port, launch

    bootstrap = free_port()
    servers = {}
    try:
        servers["prefill"] = launch(a.model, 0, server_args(a, "prefill", bootstrap), out / "prefill.log", timeout=900, echo=False)
        servers["decode"] = launch(a.model, 0, server_args(a, "decode", bootstrap), out / "decode.log", timeout=900, echo=False)
        rng = random.Random(0)
        prompts = [[rng.randrange(100, 30000) for _ in range(a.input_len)] for _ in range(a.requests)]
        t0 = time.time()
        with cf.ThreadPoolExecutor(a.requests) as ex:
            results = list(ex.map(lambda i: pd_generate(servers["prefill"].url, servers["decode"].url, bootstrap,
                                                        prompts[i], a.output_len, 1000 + i), range(a.requests)))
        wall = time.time() - t0
        time.sleep(2)
        dlog = servers["decode"].log()
    finally:
        for s in servers.values():
            s.stop()
    adm = [dict(zip(("rid", "prompt_tokens", "admission_mib", "full_mib", "less"), m)) for m in ADMITTED.findall(dlog)]
    rel = [dict(zip(("rid", "held_mib", "whole_mib", "less", "resident_mib"), m)) for m in RELEASED.findall(dlog)]
    reads = READ.findall(dlog)
    service = SERVICE.findall(dlog)
    adm = [x for x in adm if int(x["prompt_tokens"]) >= a.input_len]
    rel = [x for x in rel if float(x["whole_mib"]) > 0 and x["rid"] in {y["rid"] for y in adm}]
    speed = decode_speed(dlog)
    from oasis_sglang.sglang_glue.log_line import parse_decode_counters

    olines = [ln for ln in dlog.splitlines() if "OasisKV decode:" in ln]
    if olines:      # the last line's cumulative counters: steps replayed from graphs, synchronous first steps
        last = parse_decode_counters(olines[-1])
        m = re.search(r"fallback synchronous steps: (\d+)", olines[-1])
        speed.update(decode_steps=last["decode_steps"], graph_steps=last["graph_steps"],
                     sync_steps=int(m.group(1)) if m else None, h2d_mib=last["h2d_mib"])
    res = {"args": vars(a), "requests": results, "wall_s": wall, "admitted": adm, "released": rel,
           "read_on_demand_last": reads[-1] if reads else None,
           "service_ms_per_step": float(service[-1][0]) if service else None,
           "counts_ms_per_step": float(service[-1][1]) if service else None,
           "marking_ms_per_step": float(service[-1][2]) if service and service[-1][2] else None,
           "decode_speed": speed}
    (out / "pd_gpu.json").write_text(json.dumps(res, indent=1))
    lines = ["| request | prompt tokens | MiB at admission | MiB full transfer | less | host-tier MiB held | "
             "MiB allocated whole | less |", "|---|---|---|---|---|---|---|---|"]
    relby = {x["rid"]: x for x in rel}
    for x in adm:
        r = relby.get(x["rid"], {})
        lines.append(f"| {x['rid'][:8]} | {x['prompt_tokens']} | {x['admission_mib']} | {x['full_mib']} | {x['less']}x | "
                     f"{r.get('held_mib', '-')} | {r.get('whole_mib', '-')} | {r.get('less', '-')}x |")
    lines += ["", "| request | decode status | output tokens | TTFT s | wall s |", "|---|---|---|---|---|"]
    lines += [f"| {i} | {r['decode_status']} | {r['output_tokens']} | "
              f"{'-' if r['ttft_s'] is None else format(r['ttft_s'], '.2f')} | {r['wall_s']:.2f} |"
              for i, r in enumerate(results)]
    lines.append(f"\nsystem {a.system}; requests: {results}; wall {wall:.1f} s; read on demand (cumulative, last line): {res['read_on_demand_last']}; "
                 f"starting reads between steps: {res['service_ms_per_step']} ms per step "
                 f"({res['counts_ms_per_step']} ms of it reading the plans' counts, "
                 f"{res['marking_ms_per_step']} ms marking ended reads' pieces present)")
    lines.append(f"decode node (pd_read_mode {a.pd_read_mode}, {'CUDA graphs' if a.cuda_graph else 'eager'}): {speed}")
    (out / "pd_gpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    ok = (adm or a.system == "dense") and all(r["decode_status"] == 200 and r["prefill_status"] == 200
                                              and r["output_tokens"] == a.output_len for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
