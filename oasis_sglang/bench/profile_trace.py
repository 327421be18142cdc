"""Where a served decode step's GPU time goes, from a PyTorch profiler trace of SGLang.

    python scripts/profile_trace.py TRACE.trace.json.gz --steps 8 [--out profile.md]

``TRACE`` is the Chrome trace SGLang's profiler writes (``POST /start_profile`` with
``num_steps``; ``scripts/bench_oasis.py --profile-steps N`` asks for it once a run is in its
steady decode phase). Only GPU activity is read (``cat`` ``kernel``, ``gpu_memcpy``,
``gpu_memset``; kernels replayed from CUDA graphs included), so the figures are device time:

* window: first kernel start to last kernel end, per step (``--steps`` forward passes);
* busy: the union of kernel intervals over all streams; idle = window - busy is time the GPU
  waited on the host (scheduling, launches, host synchronisation);
* per kernel group (``GROUPS``): kernel time summed over all streams, per step (OasisKV's stage
  streams run beside the compute stream, so groups can add up to more than busy);
* per stream: kernel time per step (the stream with the most is the compute stream).

Used by ``oasis_sglang.bench.serving`` (bench_oasis's ``profile`` result field and ``profile_<run>.md``);
``scripts/profile_trace.py`` is its command line.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import math
import sys
import zlib
from pathlib import Path

# (group, name substrings), first match wins: SGLang's Triton decode attention (``_fwd_*``)
# before OasisKV's split-K kernels, whose stage names are plain ``_stage1`` / ``_stage2``
GROUPS = [
    ("dense attention (SGLang)", ("_fwd_kernel", "_fwd_grouped_kernel", "decode_attention")),
    ("paged attention (paired)", ("_paged_stage",)),
    ("sparse attention", ("_stage1", "_stage2")),
    ("GEMMs", ("nvjet", "cublas", "gemm", "sm90_xmma", "cutlass", "splitKreduce")),
    ("scoring", ("_score_kernel",)),
    ("top-K", ("_select_kernel", "sbtopk", "radixSort", "_decode_keys_kernel", "gatherTopK", "mbtopk")),
    ("admission plan", ("_plan_transfer_kernel",)),
    ("H2D copy", ("_copy_rows_kernel", "_copy_blocks_kernel")),
    ("append + summaries", ("_append_tokens_kernel", "_write_kv_kernel")),
    ("norm, RoPE, activation", ("rmsnorm", "RMSNorm", "rotary", "rope", "silu", "act_and_mul", "gelu")),
    ("memcpy / memset", ("Memcpy", "Memset", "memcpy", "memset")),
]
_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def group_of(name: str) -> str:
    """The ``GROUPS`` entry whose substring ``name`` contains first, else ``"other"``."""
    for g, keys in GROUPS:
        if any(k in name for k in keys):
            return g
    return "other"


def load_gpu_events(path: str | Path) -> list[tuple[str, object, float, float]]:
    """``[(name, stream, start_us, dur_us)]`` of the GPU events of a Chrome trace (plain or gzip
    JSON, told apart by the gzip magic bytes, whatever the suffix).

    Raises:
        OSError / EOFError: the file cannot be read, is shorter than 2 bytes (torch's profiler opens
            it with ``gzip.open(path, "wb")``, so it exists empty while being written), or a gzip
            file ends early (still being written).
        ValueError: not a Chrome trace (not JSON, a corrupt gzip stream, nesting too deep, no
            ``traceEvents`` list), or a GPU event whose ``ts`` / ``dur`` is missing, not a finite
            number, or a negative duration (names the event).
    """
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(2)
    if len(head) < 2:
        raise EOFError(f"{path}: {len(head)} bytes (still being written?)")
    gz = head == b"\x1f\x8b"
    try:
        with (gzip.open(path, "rt") if gz else open(path, "rt")) as f:
            d = json.load(f)
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    except EOFError as e:
        raise EOFError(f"{path}: the gzip file ends early ({e})") from None
    except (zlib.error, gzip.BadGzipFile) as e:
        raise ValueError(f"{path}: not a gzip stream ({e})") from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deep to be a Chrome trace") from None
    ev = d.get("traceEvents") if isinstance(d, dict) else d
    if not isinstance(ev, list):
        raise ValueError(f"{path}: not a Chrome trace (no traceEvents list)")
    out = []
    for i, e in enumerate(ev):
        if not (isinstance(e, dict) and e.get("ph") == "X" and e.get("cat") in _GPU_CATS):
            continue
        ts, dur = e.get("ts"), e.get("dur")
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in (ts, dur)) \
                or dur < 0:
            raise ValueError(f"{path}: GPU event {i} ({e.get('name')!r}) has ts={ts!r}, dur={dur!r}: "
                             f"want finite numbers and dur >= 0")
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        out.append((str(e.get("name", "")), args.get("stream", e.get("tid")), float(ts), float(dur)))
    return out


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


OTHER_TOP = 12        # kernels of group "other" listed by name in the summary
STREAM_GROUPS = 4     # kernel groups listed per stream in the markdown


def summarize(events: list[tuple[str, object, float, float]], steps: int) -> dict:
    """Per-step device time of ``steps`` forward passes (see the module docstring).

    Returns ``{"steps", "kernels", "window_ms", "busy_ms", "idle_ms", "busy_frac", "groups_ms":
    {group: ms per step}, "streams_ms": {stream: ms per step}, "stream_groups_ms": {stream: {group:
    ms per step}}, "other_top_ms": {kernel name (first 120 characters): ms per step}}``
    (``other_top_ms``: the ``OTHER_TOP`` kernels of group "other" with the most time;
    ``stream_groups_ms``: which kernel groups each stream carried, the most time first: a CUDA
    graph's replay puts its branches on streams of its own, so a stream's number alone does not
    say which of OasisKV's stage streams it was); times are per step.
    Raises:
        ValueError: no GPU events, or ``steps`` < 1.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if not events:
        raise ValueError("no GPU kernels in the trace (was the profiler's GPU activity on?)")
    t0 = min(s for _, _, s, _ in events)
    t1 = max(s + d for _, _, s, d in events)
    busy = _union([(s, s + d) for _, _, s, d in events])
    groups: dict[str, float] = {}
    streams: dict[str, float] = {}
    stream_groups: dict[str, dict[str, float]] = {}
    other: dict[str, float] = {}
    for name, stream, _, d in events:
        g = group_of(name)
        groups[g] = groups.get(g, 0.0) + d
        if g == "other":
            other[name[:120]] = other.get(name[:120], 0.0) + d
        streams[str(stream)] = streams.get(str(stream), 0.0) + d
        sg = stream_groups.setdefault(str(stream), {})
        sg[g] = sg.get(g, 0.0) + d
    per = lambda us: us / 1e3 / steps  # noqa: E731
    window = t1 - t0
    return {"steps": steps, "kernels": len(events), "window_ms": per(window), "busy_ms": per(busy),
            "idle_ms": per(window - busy), "busy_frac": busy / window if window > 0 else 1.0,
            "groups_ms": {g: per(v) for g, v in sorted(groups.items(), key=lambda kv: -kv[1])},
            "streams_ms": {s: per(v) for s, v in sorted(streams.items(), key=lambda kv: -kv[1])},
            "stream_groups_ms": {st: {g: per(v) for g, v in sorted(sg.items(), key=lambda kv: -kv[1])}
                                 for st, sg in stream_groups.items()},
            "other_top_ms": {k: per(v) for k, v in sorted(other.items(), key=lambda kv: -kv[1])[:OTHER_TOP]},
            "gaps": compute_gaps(events, steps)}


GAP_MIN_US = 20.0      # compute-stream gaps at least this long are attributed (shorter: launch spacing)
GAP_TOP = 10           # (kernel before, kernel after, released by) rows listed


def compute_gaps(events: list[tuple[str, object, float, float]], steps: int) -> dict:
    """Where the compute stream (the stream with the most GEMM time; the most kernel time when no
    GEMM ran) stands idle.

    A gap is the time between one compute-stream kernel's end and the next one's start. Gaps of
    at least ``GAP_MIN_US`` are attributed to the kernel of another stream that ended last
    inside the gap (what the compute stream most likely waited for: a stage stream's event, or
    the join at a CUDA-graph step's end); shorter gaps are launch spacing.

    Returns ``{"stream", "gap_ms", "short_gap_ms", "long_gaps", "top": [(before, after,
    released_by, ms per step, count per step)]}`` (kernel names cut to 60 characters; times
    per step).
    """
    per_stream: dict[str, list[float]] = {}
    for n, st, _, d in events:
        t = per_stream.setdefault(str(st), [0.0, 0.0])
        t[0] += d if group_of(n) == "GEMMs" else 0.0
        t[1] += d
    main = max(per_stream, key=lambda k: tuple(per_stream[k]))
    mk = sorted(((s0, s0 + d, n) for n, st, s0, d in events if str(st) == main))
    others = sorted(((s0 + d, n) for n, st, s0, d in events if str(st) != main))
    ends = [e for e, _ in others]
    short = long_ = 0.0
    n_long = 0
    top: dict[tuple[str, str, str], list[float]] = {}
    end, an = float("-inf"), ""  # the latest end so far and its kernel (records of one stream may overlap)
    for (_, a1, a_name), (b0, _, bn) in zip(mk, mk[1:]):
        if a1 > end:
            end, an = a1, a_name
        g = b0 - end
        if g <= 0:
            continue
        if g < GAP_MIN_US:
            short += g
            continue
        long_ += g
        n_long += 1
        i = bisect.bisect_right(ends, b0 + 1.0) - 1
        rel = others[i][1] if i >= 0 and ends[i] > end else "(none: launch or host)"
        key = (an[:60], bn[:60], rel[:60])
        t = top.setdefault(key, [0.0, 0])
        t[0] += g
        t[1] += 1
    per = lambda us: us / 1e3 / steps  # noqa: E731
    rows = sorted(top.items(), key=lambda kv: -kv[1][0])[:GAP_TOP]
    return {"stream": main, "gap_ms": per(short + long_), "short_gap_ms": per(short), "long_gaps": n_long / steps,
            "top": [(k[0], k[1], k[2], per(v[0]), v[1] / steps) for k, v in rows]}


def markdown(s: dict, title: str = "decode step") -> str:
    """A markdown table of ``summarize``'s result."""
    share = lambda v: f"{100 * v / s['window_ms']:.1f}%" if s["window_ms"] > 0 else "-"  # noqa: E731
    md = [f"{title}: {s['steps']} steps, {s['kernels']} GPU events; per step: window {s['window_ms']:.2f} ms, "
          f"GPU busy {s['busy_ms']:.2f} ms ({100 * s['busy_frac']:.1f}%), idle {s['idle_ms']:.2f} ms", "",
          "| kernel group | ms per step | share of window |", "|---|---|---|"]
    for g, v in s["groups_ms"].items():
        md.append(f"| {g} | {v:.3f} | {share(v)} |")
    md += ["", "| stream | kernel ms per step | its kernel groups (ms per step) |", "|---|---|---|"]
    sg = s.get("stream_groups_ms", {})
    md += [f"| {k} | {v:.3f} | " + ", ".join(f"{g} {ms:.3f}" for g, ms in list(sg.get(k, {}).items())[:STREAM_GROUPS])
           + " |" for k, v in s["streams_ms"].items()]
    if s.get("other_top_ms"):
        md += ["", '| kernel in "other" | ms per step |', "|---|---|"]
        md += [f"| `{k.replace('|', '/')}` | {v:.3f} |" for k, v in s["other_top_ms"].items()]
    g = s.get("gaps")
    if g:
        md += ["", f"Compute stream {g['stream']} idle: {g['gap_ms']:.3f} ms per step, of it "
               f"{g['short_gap_ms']:.3f} ms in gaps under {GAP_MIN_US:.0f} us and {g['long_gaps']:.1f} longer gaps; "
               "the longer ones by the kernels around them and the other stream's kernel that ended last in the gap:",
               "", "| before | after | released by | ms per step | gaps per step |", "|---|---|---|---|---|"]
        md += [f"| `{a.replace('|', '/')}` | `{b.replace('|', '/')}` | `{r.replace('|', '/')}` | {ms:.3f} | {n:.1f} |"
               for a, b, r, ms, n in g["top"]]
    return "\n".join(md)


def write_timeline(events: list[tuple[str, object, float, float]], path: str | Path) -> int:
    """Every GPU event as one CSV row, by start: ``start_us`` (from the first event's start),
    ``dur_us``, ``stream``, ``group`` (``group_of``), ``name`` (first 100 characters), gzip when
    ``path`` ends in ``.gz``: a trace's critical path read by eye, a few hundred KB where the
    Chrome trace is tens of MB.

    Returns:
        the rows written.
    Raises:
        ValueError: no events.
    """
    if not events:
        raise ValueError("no GPU events to write")
    import csv
    import io
    rows = sorted(events, key=lambda e: e[2])
    t0 = rows[0][2]
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["start_us", "dur_us", "stream", "group", "name"])
    for name, stream, s0, d in rows:
        w.writerow([f"{s0 - t0:.3f}", f"{d:.3f}", stream, group_of(name), name[:100]])
    data = buf.getvalue().encode(errors="replace")      # (a trace may hold lone surrogates)
    path = Path(path)
    path.write_bytes(gzip.compress(data) if path.suffix.lower() == ".gz" else data)
    return len(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="Chrome trace from SGLang's profiler (.trace.json.gz)")
    ap.add_argument("--steps", type=int, required=True, help="forward passes the trace covers (the num_steps asked for)")
    ap.add_argument("--out", default=None, help="also write the table here")
    ap.add_argument("--timeline", default=None,
                    help="also write every GPU event as CSV here (start_us, dur_us, stream, group, name; "
                         "gzip when it ends in .gz)")
    a = ap.parse_args(argv)
    try:
        ev = load_gpu_events(a.trace)
        s = summarize(ev, a.steps)
        if a.timeline:
            write_timeline(ev, a.timeline)
        md = markdown(s, Path(a.trace).name)
        if a.out:
            Path(a.out).write_text(md + "\n")
    except (OSError, EOFError, ValueError) as e:        # EOFError: a gzip file cut short
        print(f"profile_trace: {e}", file=sys.stderr)
        return 2
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
