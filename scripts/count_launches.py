"""Kernel launches and host syncs of one OasisKV decode step, per sparse layer.

    python scripts/count_launches.py [--batch 4] [--context 300] [--budget 64] [--steps 3]
        [--kernels triton] [--eager] [--out out/count_launches]

Inside a CUDA graph a launch costs no host time, but each kernel still occupies the GPU for a few
microseconds however little it does, so at ~34 sparse layers the number of kernels per layer sets
a floor under the step time. This script counts them for the decode work SGLang captures
(``write_kv`` + ``decode_attention`` of every sparse layer, in graph mode unless ``--eager``):

* on CUDA: the GPU kernels ``torch.profiler`` records (exact);
* on CPU (the Triton kernels under ``TRITON_INTERPRET=1``): Triton launches plus the ATen ops
  that launch a kernel on CUDA (every op except views and allocations), counted with a
  ``TorchDispatchMode``; host reads of device values (``item`` / ``tolist`` / ``nonzero``) are
  counted as syncs. The counts do not depend on the sizes, so small ones keep the interpreter quick.

The engine runs the ``previous`` predictor (each layer: summaries, token append + write-back,
attention, then predict / select / transfer for the next step) with ``--batch`` requests of
``--context`` tokens. Prints a table (ops by name, per step and per sparse layer) and writes
``launches.md`` / ``launches.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")      # before anything imports triton

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from oasis_sglang.argtypes import positive_int  # noqa: E402
from oasis_sglang.config import OasisConfig, OasisConfigError  # noqa: E402
from oasis_sglang.core import OasisSparseKV  # noqa: E402
from oasis_sglang.kernels import get_kv_ops  # noqa: E402

NO_KERNEL = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh",
             "detach", "alias", "_to_copy_noop", "result_type", "is_pinned", "size", "stride", "sym_size"}
SYNC = {"_local_scalar_dense", "nonzero", "item", "equal", "is_nonzero"}


def host_copy(name: str, args, kwargs: dict, out) -> str | None:
    """The host sync an ATen copy between host and device makes (CUDA's rules; a non-CPU device
    of any type counts, so ``meta`` tensors test this on a CPU): ``"h2d_pageable"`` for a copy
    from pageable host memory or a blocking one (``cpu_tensor.to(cuda)``), ``"d2h"`` for a copy to
    the host (``.cpu()``); ``None`` otherwise (a non-blocking copy from page-locked memory,
    ``core.devcopy.to_device``, does not wait). ``torch.tensor(list, device=cuda)`` never reaches
    a dispatch mode: on CUDA the profiler's ``Memcpy HtoD (Pageable -> Device)`` events count it
    (``main``)."""
    t = out if isinstance(out, torch.Tensor) else None
    if name not in ("_to_copy", "copy_") or not args or not isinstance(args[0], torch.Tensor):
        return None
    src, dst = (args[1], args[0]) if name == "copy_" else (args[0], t)
    if not isinstance(src, torch.Tensor) or dst is None:
        return None
    if src.device.type == "cpu" and dst.device.type != "cpu":
        pinned = src.is_pinned() if torch.cuda.is_available() else False
        blocking = not (kwargs.get("non_blocking") or (name == "copy_" and len(args) > 2 and args[2]))
        return "h2d_pageable" if blocking or not pinned else None
    if src.device.type != "cpu" and dst.device.type == "cpu":
        return "d2h"
    return None


class _Count(TorchDispatchMode):
    """ATen ops that would launch a CUDA kernel (views and allocations excluded), and host syncs."""

    def __init__(self):
        super().__init__()
        self.ops, self.syncs, self.paused = Counter(), Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        name = func.overloadpacket.__name__
        if name in SYNC:
            self.syncs[name] += 1
        else:
            kind = host_copy(name, args, kwargs or {}, out)
            if kind:
                self.syncs[kind] += 1
        if name in NO_KERNEL or func.is_view or name.startswith("_local_scalar"):
            return out
        if name == "_to_copy" and args and isinstance(args[0], torch.Tensor):
            dev, dt = (kwargs or {}).get("device"), (kwargs or {}).get("dtype")
            if (dev is None or torch.device(dev) == args[0].device) and (dt is None or dt == args[0].dtype):
                return out
        self.ops[f"aten.{name}"] += 1
        return out


def _patch_interpreter(counter: _Count):
    """Count Triton launches under the interpreter (and pause the ATen count inside them)."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def counted(self, *a, **k):
        if not k.get("warmup"):
            counter.ops[f"triton.{self.fn.__name__}"] += 1
        counter.paused += 1
        try:
            return run(self, *a, **k)
        finally:
            counter.paused -= 1

    InterpretedFunction.run = counted
    return lambda: setattr(InterpretedFunction, "run", run)


def build(args, dev):
    H, G, D, bs = args.kv_heads, args.group, args.head_dim, 16
    B, C, L = args.batch, args.context, args.layers
    per = C + args.steps + bs
    # a fixed step budget: its kernels are launched as with the default "auto" on a GPU (off CUDA a
    # link fraction is never planned through), so the count is the same on both
    cfg = OasisConfig(budget_tokens=args.budget, block_size=bs, fetch_cap=args.fetch_cap, dense_layers=(),
                      sink_blocks=1, recent_blocks=2, kernels=args.kernels, transfer_budget=1 << 30)
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    eng = OasisSparseKV(cfg, L, B * per + bs, B + 1, H, D, D, dt, dev, ops=get_kv_ops(args.kernels),
                        predictor="previous", padding_row=None if args.eager else 0)
    rt = torch.zeros((B + 1, per), dtype=torch.int32, device=dev)
    rt[1:] = (bs + torch.arange(B, device=dev)[:, None] * per + torch.arange(per, device=dev)[None]).int()
    rows = torch.arange(1, B + 1, device=dev)
    T = B * C
    prefill(eng, rt, rows, args, dev, dt)()
    return eng, rt, rows, dt


def prefill(eng, rt, rows, args, dev, dt):
    """A prefill forward of ``--batch`` prompts of ``--context`` tokens, as SGLang's glue calls it
    (the host lengths given: ``extend_attention(host=...)``): per sparse layer the host tier and
    summaries (``write_kv``), the attention and the first decode step's prediction. Returns a
    function that runs it (its inputs made now, outside any counted region)."""
    H, G, D = args.kv_heads, args.group, args.head_dim
    B, C, L = args.batch, args.context, args.layers
    T = B * C
    loc = torch.cat([rt[r, :C] for r in range(1, B + 1)]).long()
    x = [(torch.randn(T, H, D, device=dev, dtype=dt), torch.randn(T, H, D, device=dev, dtype=dt),
          torch.randn(T, H * G, D, device=dev, dtype=dt)) for _ in range(L)]
    pre, ext = torch.zeros(B, dtype=torch.int64, device=dev), torch.full((B,), C, device=dev)
    host = (rows.tolist(), [0] * B, [C] * B)

    def run():
        for l, (k, v, q) in enumerate(x):
            eng.write_kv(l, loc, k, v)
            eng.extend_attention(l, q, rows, pre, ext, rt, None, k_new=k, v_new=v, host=host)
    return run


def cuda_syncs(events) -> Counter:
    """Host syncs in a CUDA profile: the synchronize calls, and the copies from or to pageable
    host memory that made none. PyTorch's blocking copies (``.item()``, ``.cpu()``,
    ``torch.tensor(list, device=cuda)``: ``c10::cuda::memcpy_and_sync``) are a memcpy followed by
    ``cudaStreamSynchronize``, so such a pair counts once, as its synchronize call; a pageable
    copy beyond the synchronize calls (staged by CUDA itself) counts on its own."""
    syncs, copies = Counter(), Counter()
    for e in events:
        n = e.name
        if n.startswith("Memcpy") and "Pageable" in n:
            copies["h2d_pageable" if "HtoD" in n else "d2h_pageable"] += 1
        elif n in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"):
            syncs[n] += 1
    extra = sum(copies.values()) - syncs["cudaStreamSynchronize"]
    for kind in ("h2d_pageable", "d2h_pageable"):
        take = min(copies[kind], max(0, extra))
        if take:
            syncs[kind] += take
            extra -= take
    return syncs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=positive_int, default=4)
    ap.add_argument("--context", type=positive_int, default=300, help="prompt tokens per request")
    ap.add_argument("--budget", type=positive_int, default=64, help="working-set tokens per (layer, KV head)")
    ap.add_argument("--fetch-cap", type=positive_int, default=8)
    ap.add_argument("--layers", type=positive_int, default=2, help="sparse layers (counts are reported per layer)")
    ap.add_argument("--kv-heads", type=positive_int, default=2)
    ap.add_argument("--group", type=positive_int, default=4, help="query heads per KV head")
    ap.add_argument("--head-dim", type=positive_int, default=16)
    ap.add_argument("--steps", type=positive_int, default=3, help="decode steps counted (the counts of each are the same)")
    ap.add_argument("--kernels", choices=["triton", "torch"], default="triton")
    ap.add_argument("--eager", action="store_true", help="eager steps (host check each step) instead of graph mode")
    ap.add_argument("--dense", action="store_true",
                    help="the dense path's captured step (short contexts: no selection, kernel 9's update) "
                         "instead of the full path's (graph mode only; --context + --steps must fit --budget)")
    ap.add_argument("--prefill", action="store_true",
                    help="count a prefill forward (write_kv + extend_attention of each sparse layer, SGLang's host "
                         "lengths given) instead of decode steps; on CUDA its host syncs are what a prefill waits for")
    ap.add_argument("--out", default="out/count_launches")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if args.prefill and (args.dense or args.eager):
        ap.error("--prefill counts a prefill forward: leave out --dense and --eager")
    if args.dense and args.eager:
        ap.error("--dense counts the captured dense step: leave out --eager")
    if args.dense and args.context + args.steps + 2 > args.budget:
        ap.error(f"--dense: --context {args.context} + --steps {args.steps} (+2) must fit --budget {args.budget}")
    if args.head_dim < 16 and args.kernels == "triton":
        ap.error(f"--head-dim {args.head_dim}: the Triton kernels need a head_dim of at least 16")
    try:
        eng, rt, rows, dt = build(args, dev)
    except OasisConfigError as e:          # --budget / --fetch-cap against the block size
        ap.error(str(e))
    B, L, H, D = args.batch, args.layers, args.kv_heads, args.head_dim
    seq = torch.full((B,), args.context, device=dev)

    def inputs():
        """The next step's inputs, made outside the counted region (the graph runner's static buffers)."""
        nonlocal seq
        seq = seq + 1
        x = [(torch.randn(B, H * args.group, D, device=dev, dtype=dt), torch.randn(B, H, D, device=dev, dtype=dt),
              torch.randn(B, H, D, device=dev, dtype=dt)) for _ in range(L)]
        return x, seq, rt[rows, seq - 1].long(), int(seq.max()), rows.tolist(), seq.tolist()

    def step(x):
        qkv, sq, loc, mx, rows_h, seq_h = x
        if args.eager:     # the step's host check reads the host record (no device read)
            eng.begin_decode_step(rows, sq, rt, max_seq_len=mx, rows_host=rows_h, seq_lens_host=seq_h)
        else:              # what a captured step records (the replay's host bookkeeping launches nothing)
            eng.begin_decode_step(rows, sq, rt, mode="capture", dense=args.dense)
            eng.prepare_step_device()
        for l, (q, k, v) in enumerate(qkv):
            eng.write_kv(l, loc, k, v, decode=True)
            eng.decode_attention(l, q, k, v, None)

    if args.prefill:       # count prefill forwards instead (the build's was the warm-up)
        def inputs():
            return prefill(eng, rt, rows, args, dev, dt)

        def step(x):
            x()
    step(inputs())                                    # warm-up (first step, compiles on CUDA)
    per_step = []
    for s in range(args.steps):
        x = inputs()
        if dev == "cuda":
            from torch.profiler import ProfilerActivity, profile

            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                step(x)
                torch.cuda.synchronize()
            evs = prof.events()
            ops = Counter(e.name for e in evs if e.device_type == torch.autograd.DeviceType.CUDA
                          and not e.name.startswith(("Memcpy", "Memset")))
            syncs = cuda_syncs(evs)
            syncs["cudaDeviceSynchronize"] -= 1          # the profile's own, above
            per_step.append((ops, +syncs))
        else:
            c = _Count()
            undo = _patch_interpreter(c) if args.kernels == "triton" else (lambda: None)
            try:
                with c:
                    step(x)
            finally:
                undo()
            per_step.append((c.ops, c.syncs))
    ops, syncs = per_step[-1]
    total = sum(ops.values())
    mode = "prefill" if args.prefill else "eager" if args.eager else "graph mode"
    what = "prefill forward" if args.prefill else "decode step"
    lines = [f"# Kernel launches per OasisKV {what} ({dev}, {args.kernels} kernels, {mode})", "",
             f"`python scripts/count_launches.py {' '.join(os.sys.argv[1:])}`: batch {B}, {L} sparse layers, "
             f"`previous` predictor, fetch_cap {args.fetch_cap}"
             + (", the dense path (short contexts)" if args.dense else "") + ".", "",
             f"**{total / L:.1f} kernel launches per sparse layer** ({total} per {what}), "
             f"{sum(syncs.values())} host syncs per {what}.", "",
             f"| op | per {what} | per sparse layer |", "|---|---|---|"]
    for name, n in ops.most_common():
        lines.append(f"| {name} | {n} | {n / L:.1f} |")
    if syncs:
        lines += ["", "Host syncs: " + ", ".join(f"{k} x{v}" for k, v in syncs.items())]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "launches.md").write_text(text)
    (out / "launches.json").write_text(json.dumps({
        "device": dev, "kernels": args.kernels, "mode": mode, "batch": B, "sparse_layers": L,
        "per_step": total, "per_sparse_layer": total / L, "ops": dict(ops), "syncs": dict(syncs),
        "steady": all(p[0] == ops for p in per_step)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
