"""Admission traffic of PD with partial KV, measured on the torch engine with a real model's K/V/Q.

A prompt is prefilled on one ``OasisSparseKV`` (the prefill node), admitted on another with an
``AdmissionPacket`` over NIXL (UCX loopback), and decoded there for ``N`` teacher-forced steps
while missing blocks are READ on demand; the prefill engine decodes the same steps itself
(colocated) for comparison. K/V/Q come from a Hugging Face forward
(``eval/sparse_sim.py``, ``SimConfig(record=True)``): post-RoPE, every layer.

Used by ``scripts/pd_admission.py`` and ``tests/disagg/test_pd_smollm2.py``.
"""

from __future__ import annotations

import itertools
import os

import torch

from ..config import OasisConfig
from ..core import OasisSparseKV
from ..core.remote import RemoteBlocks
from .admission import apply_admission, build_admission, full_transfer_bytes
from .transport import NixlTier, RemoteBlockFetcher

_names = itertools.count()


def measure_admission(kv: dict, queries: dict, sim_prefix: int, cfg: OasisConfig, num_layers: int,
                      summary_dtype: torch.dtype | None = torch.bfloat16, decode_steps: int | None = None) -> dict:
    """PD admission and decode on two engines vs colocated decode.

    Args:
        kv: ``{layer: (k [H, T, D], v [H, T, Dv])}`` post-RoPE K/V of every layer.
        queries: ``{sparse layer: [N, Hq, D]}`` queries of positions ``sim_prefix .. sim_prefix+N-1``.
        sim_prefix: the recording's prefix; the prompt here is ``P = sim_prefix + 1`` tokens (its
            last token's query is ``queries[l][0]``) and decode steps are positions ``P .. T-1``.
        cfg: the OasisKV config of both nodes (an asynchronous predictor; its ``pd_read_mode``
            decides how the decode node reads: ``deferred`` starts reads between steps as
            serving does, ``post`` / ``poll``).
        decode_steps: at most this many decode steps (default all).
    Returns: a dict of byte counts (``packet``, ``dense_layers``, ``admission`` = their sum,
        ``full``, ``ratio`` = full / admission, ``fetched``, ``decode_host_pieces`` and
        ``request_pieces``: (layer, KV head, block) pieces of the request's prompt holding data on
        the decode node after the steps, of all), ``steps``, ``remote_reads`` (NIXL transfers),
        ``max_abs_diff`` and ``equal`` of the PD outputs against colocated decode,
        ``rel_err_mean`` / ``rel_err_max`` (per step ``||pd - colocated|| / ||colocated||`` over
        the sparse layers' outputs), ``steps_equal`` (steps with bitwise equal outputs) and
        ``deferred_pieces`` (pieces a plan left out first: ``RemoteBlocks.deferred_pieces``).
    """
    sparse = [i for i in range(num_layers) if i not in cfg.dense_layers]
    k0, v0 = kv[sparse[0]]
    H, T, D = k0.shape
    Dv = v0.shape[-1]
    P = sim_prefix + 1
    n = T - P if decode_steps is None else min(T - P, decode_steps)
    bs = cfg.block_size
    tokens = -(-T // bs) * bs * 2 + bs
    dtype = k0.dtype
    pf = OasisSparseKV(cfg, num_layers, tokens, 2, H, D, Dv, dtype, "cpu")
    dc = OasisSparseKV(cfg, num_layers, tokens, 2, H, D, Dv, dtype, "cpu")
    tag = f"{os.getpid()}-{next(_names)}"
    npf, ndc = NixlTier(pf.host.k, pf.host.v, f"pd-prefill-{tag}"), NixlTier(dc.host.k, dc.host.v, f"pd-decode-{tag}")
    fetcher = RemoteBlockFetcher(ndc)
    try:
        peer = fetcher.add_peer(npf.layout())
        remote = RemoteBlocks(len(sparse), H, dc.host.num_pages, fetcher.fetch, post=fetcher.post, poll=fetcher.poll)
        dc.attach_remote(remote)
        W = -(-T // bs) * bs
        pages = tokens // bs
        rt_p = torch.zeros((2, W), dtype=torch.int32)
        rt_d = torch.zeros((2, W), dtype=torch.int32)
        rt_p[0] = torch.arange(W, dtype=torch.int32)                              # prefill node: pages 0..
        perm = torch.randperm(pages, generator=torch.Generator().manual_seed(0))[: W // bs]
        rt_d[1] = (perm[:, None] * bs + torch.arange(bs)).reshape(-1).to(torch.int32)   # decode node: scattered
        for li in sparse:
            k, v = kv[li]
            pf.write_kv(li, rt_p[0, :P].long(), k[:, :P].transpose(0, 1), v[:, :P].transpose(0, 1))
            # only the last prompt token's query matters here (it plans the first decode step)
            pf.extend_attention(li, queries[li][:1], torch.tensor([0]), torch.tensor([P - 1]), torch.tensor([1]),
                                rt_p, None)
        packet = build_admission(pf, 0, rt_p[0], P, summary_dtype=summary_dtype)
        apply_admission(dc, remote, packet, peer, 1, rt_d[1])
        diff, equal, rel = 0.0, True, []
        for i in range(1, n + 1):
            t = P - 1 + i                                                            # position of this step's token
            outs = []
            for eng, row, rt in ((pf, 0, rt_p), (dc, 1, rt_d)):
                eng.begin_decode_step(torch.tensor([row]), torch.tensor([t + 1]), rt)
                o = []
                for li in sparse:
                    k, v = kv[li]
                    kt, vt = k[:, t][None], v[:, t][None]
                    eng.write_kv(li, rt[row, t:t + 1].long(), kt, vt, decode=True)
                    o.append(eng.decode_attention(li, queries[li][i:i + 1], kt, vt, None))
                outs.append(torch.stack(o))
            diff = max(diff, float((outs[0] - outs[1]).abs().max()))
            rel.append(float((outs[1] - outs[0]).norm() / outs[0].norm().clamp(min=1e-30)))
            equal = equal and torch.equal(outs[0], outs[1])
        remote.wait_reads()
        L, Np = len(sparse), packet.src_pages.numel()
        es = k0.element_size()
        dense_bytes = full_transfer_bytes(P, len(cfg.dense_layers), H, D, Dv, es)
        held = int(remote.present[:, :, rt_d[1, :P:bs].long() // bs].sum())
        return {
            "prompt_tokens": P, "steps": n, "packet": packet.nbytes, "dense_layers": dense_bytes,
            "admission": packet.nbytes + dense_bytes, "full": full_transfer_bytes(P, num_layers, H, D, Dv, es),
            "ratio": full_transfer_bytes(P, num_layers, H, D, Dv, es) / (packet.nbytes + dense_bytes),
            "fetched": remote.bytes_read, "remote_reads": fetcher.stats.transfers,
            "decode_host_pieces": held, "request_pieces": L * H * Np,
            "max_abs_diff": diff, "equal": equal, "lost": dict(remote.lost),
            "rel_err_mean": sum(rel) / max(1, len(rel)), "rel_err_max": max(rel, default=0.0),
            "steps_equal": sum(1 for x in rel if x == 0), "deferred_pieces": remote.deferred_pieces,
        }
    finally:
        fetcher.close()
        ndc.close()
        npf.close()
