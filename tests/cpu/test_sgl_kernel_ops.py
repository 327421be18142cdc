"""The torch sgl_kernel ops for CPU hosts, each against the formula it implements (a hand-computed
example, an independent torch loop, torch SDPA, or SGLang's own Triton kernel run by the Triton
interpreter), and the finder that serves them as ``sgl_kernel`` only where the CUDA driver is absent."""

import subprocess
import sys

import pytest
import torch

from oasis_sglang.cpu import sgl_kernel_ops as cpu_ops


def test_assign_req_to_token_pool_cpu(seed):
    R, L = 5, 40
    table = torch.randint(0, 1000, (R, L), dtype=torch.int32)
    expected = table.clone()
    rows = torch.tensor([3, 0, 4])
    start = torch.tensor([2, 0, 10])
    end = torch.tensor([7, 3, 10 + 17])
    out = torch.randint(0, 10**6, (int((end - start).sum()),), dtype=torch.int64)
    o = 0
    for r, s, e in zip(rows.tolist(), start.tolist(), end.tolist()):
        expected[r, s:e] = out[o:o + e - s].to(torch.int32)
        o += e - s
    cpu_ops.assign_req_to_token_pool_cpu(rows, table, start, end, out, L)
    assert torch.equal(table, expected)
    with pytest.raises(ValueError, match="pool_len"):
        cpu_ops.assign_req_to_token_pool_cpu(rows[:1], table, start[:1], torch.tensor([L + 1]), out, L)


def test_copy_all_layer_kv_cache_cpu(seed):
    bufs = [torch.randn(50, 3, 8), torch.randn(50, 3, 8).to(torch.bfloat16), torch.randn(50, 2, 4)]
    expected = [b.clone() for b in bufs]
    src = torch.tensor([4, 9, 30, 31])
    tgt = torch.tensor([9, 40, 2, 49])   # 9 is both a source and a target: sources are read first
    for e in expected:
        e[tgt] = e[src].clone()
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    strides = torch.tensor([b[0].numel() * b.element_size() for b in bufs], dtype=torch.int64)
    cpu_ops.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, e in zip(bufs, expected):
        assert torch.equal(b, e)


def _import_sgl_kernel(env_extra):
    code = ("import sgl_kernel, json; print(json.dumps([getattr(sgl_kernel, '__oasis_cpu_shim__', False), "
            "hasattr(sgl_kernel, 'copy_all_layer_kv_cache_cpu')]))")
    import os
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)


def test_finder_serves_the_shim_without_cuda():
    from oasis_sglang.cpu import finder as shim

    if shim.cuda_driver_present():
        pytest.skip("CUDA driver present: the real sgl_kernel must load (tested on the GPU host)")
    r = _import_sgl_kernel({})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[true, true]"


def test_finder_steps_aside_when_disabled_or_cuda_present():
    from oasis_sglang.cpu import finder as shim

    r = _import_sgl_kernel({"OASIS_DISABLE_CPU_SHIM": "1"})
    if shim.cuda_driver_present():
        assert "true" not in r.stdout
    else:   # the real package cannot load here: it needs libcuda
        assert r.returncode != 0 and "libcuda" in r.stderr
    # the decision itself: a finder never claims sgl_kernel when the driver loads
    f = shim.SglKernelCpuFinder()
    assert (f.find_spec("sgl_kernel") is None) == shim.cuda_driver_present()
    assert f.find_spec("numpy") is None


# ---------------------------------------------------------------------------------------------
# speculative decoding ops (EAGLE on the CPU engine)
# ---------------------------------------------------------------------------------------------

def test_assign_extend_cache_locs_cpu(seed):
    R, L = 6, 30
    table = torch.randint(0, 10**5, (R, L), dtype=torch.int32)
    rows = torch.tensor([4, 1, 5])
    start = torch.tensor([3, 0, 11])
    end = torch.tensor([5, 4, 11])            # an empty range too
    out = torch.full((10,), -7, dtype=torch.int64)
    expected = torch.cat([table[4, 3:5], table[1, 0:4]]).to(torch.int64)
    cpu_ops.assign_extend_cache_locs_cpu(rows, table, start, end, out, L)
    assert torch.equal(out[:6], expected)
    assert torch.equal(out[6:], torch.full((4,), -7))          # the tail is left as it was
    with pytest.raises(ValueError, match="pool_len"):
        cpu_ops.assign_extend_cache_locs_cpu(rows[:1], table, start[:1], torch.tensor([L + 1]), out, L)


def test_assign_draft_cache_locs_contiguous_cpu():
    table = torch.arange(4 * 20, dtype=torch.int32).view(4, 20) + 1000
    rows, lens = torch.tensor([2, 0]), torch.tensor([5, 9])
    out = torch.empty(2 * 2 * 3, dtype=torch.int64)            # topk 2, 3 steps
    cpu_ops.assign_draft_cache_locs_contiguous_cpu(rows, table, lens, out, 20, 2, 3)
    assert out.tolist() == [1045, 1046, 1047, 1048, 1049, 1050, 1009, 1010, 1011, 1012, 1013, 1014]
    with pytest.raises(ValueError, match="expected"):
        cpu_ops.assign_draft_cache_locs_contiguous_cpu(rows, table, lens, out[:5], 20, 2, 3)


def test_fill_accept_out_cache_loc_cpu():
    accept_index = torch.tensor([[0, 1, -1], [3, -1, -1], [4, 5, 6]], dtype=torch.int32)
    out_cache_loc = torch.tensor([10, 11, 12, 13, 14, 15, 16], dtype=torch.int64)
    acc = torch.zeros(9, dtype=torch.int64)
    cpu_ops.fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, acc)
    assert acc.tolist() == [10, 11, 13, 14, 15, 16, 0, 0, 0]
    acc.zero_()
    cpu_ops.fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, acc, 3)   # first row only
    assert acc.tolist() == [10, 11, 0, 0, 0, 0, 0, 0, 0]


def test_fill_bonus_tokens_cpu():
    accept_tokens = torch.tensor([[5, 6, 7], [8, 9, 10]], dtype=torch.int32)
    accept_lens = torch.tensor([2, 3], dtype=torch.int32)
    bonus = torch.empty(2, dtype=torch.int32)
    cpu_ops.fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus, 3)
    assert bonus.tolist() == [6, 10]
    with pytest.raises(ValueError, match="accept_lens"):
        cpu_ops.fill_bonus_tokens_cpu(accept_tokens, torch.tensor([0, 1], dtype=torch.int32), bonus, 3)


def test_rotate_input_ids_cpu():
    ids = torch.tensor([1, 2, 3, 4, 5, 6, 7])
    cpu_ops.rotate_input_ids_cpu(ids, torch.tensor([0, 3, 7]), torch.tensor([3, 4, 0]), torch.tensor([50, 60, 70]))
    assert ids.tolist() == [2, 3, 50, 5, 6, 7, 60]
    ids = torch.tensor([1, 2, 3, 4])
    cpu_ops.rotate_input_ids_cpu(ids, torch.tensor([0]), torch.tensor([4]), torch.tensor([[9]]), torch.tensor([1]))
    assert ids.tolist() == [2, 9, 4, 4]


def test_build_draft_decode_metadata_cpu():
    table = torch.arange(3 * 12, dtype=torch.int32).view(3, 12)
    out = cpu_ops.build_draft_decode_metadata_cpu(table, torch.tensor([2, 0]), torch.tensor([3, 2]), 2, 2, 12)
    assert out.shape == (4, 12) and out.dtype == torch.int32
    assert out[0, :5].tolist() == [24, 25, 26, 27, 28]      # prefix + candidate 0's two slots
    assert out[1, :5].tolist() == [24, 25, 26, 29, 30]      # prefix + candidate 1's two slots
    assert out[2, :4].tolist() == [0, 1, 2, 3] and out[3, :4].tolist() == [0, 1, 4, 5]


def _draft_tree(b, topk, steps, n, vocab=5):
    """(parent_list, selected_index, draft tokens) as SGLang's draft loop builds them
    (``select_top_k_tokens`` + ``organize_draft_results``), from random draft probabilities."""
    from sglang.srt.speculative.eagle_utils import organize_draft_results

    p = torch.rand(b, topk).sort(-1, descending=True).values
    scores, score_list = p, [p.unsqueeze(1)]
    token_list = [torch.randint(0, vocab, (b, topk))]
    parents_list = [torch.arange(-1, topk).expand(b, -1)]
    for i in range(1, steps):
        es = scores.unsqueeze(2) * torch.rand(b, topk, topk).sort(-1, descending=True).values
        scores, cs_index = torch.topk(es.flatten(1), topk, dim=-1)
        score_list.append(es)
        token_list.append(torch.randint(0, vocab, (b, topk * topk)))
        parents_list.append(cs_index + topk * topk * (i - 1) + topk)
    return organize_draft_results(score_list, token_list, parents_list, n)


def _build_tree(fn, parent_list, sel, seq_lens, topk, steps, n, mode):
    b = seq_lens.numel()
    mask = torch.full((n * n * b + (n * int(seq_lens.sum()) if mode == 0 else 0),), True)
    pos = torch.empty(b * n, dtype=torch.long)
    retrieve = torch.full((3, b, n), -1, dtype=torch.long)
    fn(parent_list.contiguous(), sel.contiguous(), seq_lens, mask, pos, retrieve[0], retrieve[1], retrieve[2],
       topk, steps, n, mode)
    return mask, pos, retrieve


TREES = [(3, 1, 1, 2), (2, 1, 3, 4), (2, 2, 3, 5), (3, 4, 4, 8)]   # (batch, topk, steps, draft tokens)


def test_build_tree_chain_by_hand():
    """topk 1, one step, 2 draft tokens (the served EAGLE-3 setting): a two-node chain."""
    mask, pos, (ri, nxt, sib) = _build_tree(cpu_ops.build_tree_kernel_efficient_cpu, torch.empty(2, 0, dtype=torch.long),
                                            torch.zeros(2, 1, dtype=torch.long), torch.tensor([7, 3]), 1, 1, 2, 1)
    assert pos.tolist() == [7, 8, 3, 4]
    assert ri.tolist() == [[0, 1], [2, 3]] and nxt.tolist() == [[1, -1], [1, -1]] and sib.tolist() == [[-1, -1]] * 2
    assert mask.view(2, 2, 2).tolist() == [[[True, False], [True, True]]] * 2
    mask, _, _ = _build_tree(cpu_ops.build_tree_kernel_efficient_cpu, torch.empty(1, 0, dtype=torch.long),
                             torch.zeros(1, 1, dtype=torch.long), torch.tensor([3]), 1, 1, 2, 0)
    assert mask.view(2, 5).tolist() == [[True] * 3 + [True, False], [True] * 5]   # prefix columns kept


@pytest.mark.parametrize("b,topk,steps,n", TREES)
@pytest.mark.parametrize("mode", [0, 1])
def test_build_tree_matches_sglang_triton(seed, b, topk, steps, n, mode):
    """Against SGLang's ``sgl_build_tree_kernel_efficient_triton`` (TRITON_INTERPRET=1 on CPU)."""
    from sglang.srt.speculative.eagle_utils import TreeMaskMode, sgl_build_tree_kernel_triton

    parent_list, sel, _ = _draft_tree(b, topk, steps, n)
    seq_lens = torch.randint(3, 9, (b,))
    ours = _build_tree(cpu_ops.build_tree_kernel_efficient_cpu, parent_list, sel, seq_lens, topk, steps, n, mode)
    ref = _build_tree(lambda *a: sgl_build_tree_kernel_triton(*a[:-1], TreeMaskMode(a[-1])),
                      parent_list, sel, seq_lens, topk, steps, n, mode)
    for x, y in zip(ours, ref):
        assert torch.equal(x, y)
    with pytest.raises(NotImplementedError, match="BITPACKING"):
        _build_tree(cpu_ops.build_tree_kernel_efficient_cpu, parent_list, sel, seq_lens, topk, steps, n, 2)


def _verify(fn, cand, retrieve, target, steps, kw="retrive"):
    b, n = cand.shape
    pred = torch.zeros(b * n, dtype=torch.int32)
    acc = torch.full((b, steps + 1), -1, dtype=torch.int32)
    num = torch.empty(b, dtype=torch.int32)
    fn(predicts=pred, accept_index=acc, accept_token_num=num, candidates=cand, target_predict=target,
       **{f"{kw}_index": retrieve[0], f"{kw}_next_token": retrieve[1], f"{kw}_next_sibling": retrieve[2]})
    return pred, acc, num


def test_verify_tree_greedy_by_hand():
    """Chain of 3 draft tokens after the bonus token; the target agrees with the first two drafts."""
    n = 4
    mask, pos, retrieve = _build_tree(cpu_ops.build_tree_kernel_efficient_cpu, torch.tensor([[-1, 0, 1]]),
                                      torch.tensor([[0, 1, 2]]), torch.tensor([5]), 1, 3, n, 1)
    assert retrieve[1].tolist() == [[1, 2, 3, -1]] and pos.tolist() == [5, 6, 7, 8]
    cand = torch.tensor([[100, 11, 12, 13]])
    target = torch.tensor([[11, 12, 99, 77]])      # target after node i: agrees at nodes 0, 1; not at 2
    pred, acc, num = _verify(cpu_ops.verify_tree_greedy_cpu, cand, retrieve, target, 3)
    assert num.tolist() == [2] and acc.tolist() == [[0, 1, 2, -1]]
    assert pred.tolist() == [11, 12, 99, 0]        # two accepted drafts + the bonus token from node 2


@pytest.mark.parametrize("b,topk,steps,n", TREES)
def test_verify_tree_greedy_matches_sglang_triton(seed, b, topk, steps, n):
    """Against SGLang's ``verify_tree_greedy_kernel_triton`` on trees from the draft loop, with a
    3-token vocabulary so that drafts are often accepted."""
    from sglang.srt.speculative.eagle_utils import verify_tree_greedy_triton

    for _ in range(4):
        parent_list, sel, draft = _draft_tree(b, topk, steps, n, vocab=3)
        _, _, retrieve = _build_tree(cpu_ops.build_tree_kernel_efficient_cpu, parent_list, sel,
                                     torch.randint(3, 9, (b,)), topk, steps, n, 1)
        cand = torch.cat([torch.randint(0, 3, (b, 1)), draft], 1).contiguous()
        target = torch.randint(0, 3, (b, n))
        ours = _verify(cpu_ops.verify_tree_greedy_cpu, cand, retrieve, target, steps)
        ref = _verify(verify_tree_greedy_triton, cand, retrieve, target, steps, kw="retrieve")
        for x, y in zip(ours, ref):
            assert torch.equal(x, y)


# ---------------------------------------------------------------------------------------------
# attention ops (torch.ops.sgl_kernel.*, intel_amx backend)
# ---------------------------------------------------------------------------------------------

def _sdpa(q, k, v, mask, scale):
    """Reference: torch SDPA, q ``[M, Hq, D]``, k/v ``[N, Hkv, D]`` (GQA by repetition), mask ``[M, N]``."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                         attn_mask=mask, scale=scale)
    return o.transpose(0, 1)


def _cache(N=200, Hkv=2, D=32, R=4, P=40):
    """K/V buffers of ``N`` slots and a request table of ``R`` rows of ``P`` distinct slots (0 = padding)."""
    kb, vb = torch.randn(N, Hkv, D), torch.randn(N, Hkv, D)
    table = (torch.randperm(N - 1)[:R * P] + 1).view(R, P).to(torch.int32)
    return kb, vb, table


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_cpu_matches_sdpa(seed, dtype):
    Hq, Hkv, D = 6, 2, 32
    kb, vb, table = _cache(Hkv=Hkv, D=D)
    kb, vb = kb.to(dtype), vb.to(dtype)
    rows, lens = torch.tensor([2, 0, 3]), torch.tensor([7, 1, 19])
    loc = torch.stack([table[r, l - 1] for r, l in zip(rows.tolist(), lens.tolist())]).to(torch.int64)
    q, k, v = torch.randn(3, Hq, D, dtype=dtype), torch.randn(3, Hkv * D, dtype=dtype), torch.randn(3, Hkv * D, dtype=dtype)
    out = torch.empty(3, Hq, D, dtype=dtype)
    torch.ops.sgl_kernel.decode_attention_cpu(q, kb, vb, out, k, v, loc, torch.zeros(3, Hq, 8, D + 1), table, rows,
                                              lens, 0.125, 0.0, False, 0, None, None)
    assert torch.equal(kb[loc], k.view(3, Hkv, D)) and torch.equal(vb[loc], v.view(3, Hkv, D))   # new K/V written
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for b, (r, L) in enumerate(zip(rows.tolist(), lens.tolist())):
        idx = table[r, :L].long()
        ref = _sdpa(q[b:b + 1].float(), kb[idx].float(), vb[idx].float(), None, 0.125)
        torch.testing.assert_close(out[b:b + 1].float(), ref, atol=tol, rtol=tol)


def test_decode_attention_cpu_window_cap_sinks(seed):
    """Sliding window, logit cap and attention sinks against a naive softmax with an extra column."""
    Hq, Hkv, D, L, W, cap = 4, 2, 32, 12, 5, 3.0
    kb, vb, table = _cache(Hkv=Hkv, D=D)
    q = torch.randn(1, Hq, D)
    sinks = torch.randn(Hq)
    out = torch.empty(1, Hq, D)
    torch.ops.sgl_kernel.decode_attention_cpu(q, kb, vb, out, None, None, torch.tensor([0]), torch.zeros(1), table,
                                              torch.tensor([1]), torch.tensor([L]), 0.2, cap, False, W, None, sinks)
    idx = table[1, L - W:L].long()            # the window: the last W keys
    k, v = kb[idx].repeat_interleave(2, 1), vb[idx].repeat_interleave(2, 1)
    s = torch.einsum("hd,nhd->hn", q[0], k) * 0.2
    s = cap * torch.tanh(s / cap)
    p = torch.softmax(torch.cat([s, sinks[:, None]], 1), 1)[:, :W]
    torch.testing.assert_close(out[0], torch.einsum("hn,nhd->hd", p, v), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tree", [False, True])
def test_extend_attention_cpu_matches_sdpa(seed, tree):
    """Prefix from the cache + new tokens from k/v_extend; causal, or a tree mask (QLEN_ONLY layout)."""
    Hq, Hkv, D = 6, 2, 32
    kb, vb, table = _cache(Hkv=Hkv, D=D)
    rows = torch.tensor([3, 1, 0])
    e = [3, 3, 3] if tree else [4, 1, 6]
    P = [5, 0, 11]
    lens = torch.tensor([p + x for p, x in zip(P, e)])
    starts = torch.tensor([0, e[0], e[0] + e[1]])
    T = sum(e)
    q, k, v = torch.randn(T, Hq, D), torch.randn(T, Hkv * D), torch.randn(T, Hkv * D)
    masks = [torch.tril(torch.ones(x, x, dtype=torch.bool)) for x in e]
    tree_mask = None
    if tree:   # a root with two children: node 2 must not see node 1
        masks = [torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)] * 3
        tree_mask = torch.cat([m.reshape(-1) for m in masks])
    out = torch.empty(T, Hq, D)
    torch.ops.sgl_kernel.extend_attention_cpu(q, k, v, out, kb, vb, table, rows, lens, torch.tensor(e, dtype=torch.int32),
                                              starts.to(torch.int32), max(e), 0.125, 0.0, False, 0, None, None, tree_mask)
    for b in range(3):
        s, x, p = starts[b].item(), e[b], P[b]
        idx = table[rows[b], :p].long()
        kk = torch.cat([kb[idx], k[s:s + x].view(x, Hkv, D)])
        vv = torch.cat([vb[idx], v[s:s + x].view(x, Hkv, D)])
        mask = torch.cat([torch.ones(x, p, dtype=torch.bool), masks[b]], 1)
        torch.testing.assert_close(out[s:s + x], _sdpa(q[s:s + x], kk, vv, mask, 0.125), atol=1e-5, rtol=1e-5)


def test_extend_attention_cpu_sliding_window(seed):
    Hq, Hkv, D, P, e, W = 2, 1, 32, 6, 4, 3
    kb, vb, table = _cache(Hkv=Hkv, D=D)
    q, k, v = torch.randn(e, Hq, D), torch.randn(e, Hkv * D), torch.randn(e, Hkv * D)
    out = torch.empty(e, Hq, D)
    torch.ops.sgl_kernel.extend_attention_cpu(q, k, v, out, kb, vb, table, torch.tensor([2]), torch.tensor([P + e]),
                                              torch.tensor([e]), torch.tensor([0]), e, 0.3, 0.0, False, W, None, None, None)
    idx = table[2, :P].long()
    kk, vv = torch.cat([kb[idx], k.view(e, Hkv, D)]), torch.cat([vb[idx], v.view(e, Hkv, D)])
    qpos, kpos = torch.arange(P, P + e)[:, None], torch.arange(P + e)[None, :]
    mask = (kpos <= qpos) & (qpos - kpos < W)
    torch.testing.assert_close(out, _sdpa(q, kk, vv, mask, 0.3), atol=1e-5, rtol=1e-5)


def test_attention_ops_are_registered_in_sgl_kernel_namespace():
    """The intel_amx backend reads them as ``torch.ops.sgl_kernel.*`` (registered without CUDA)."""
    from oasis_sglang.cpu import finder as shim

    if shim.cuda_driver_present():
        pytest.skip("CUDA driver present: the real sgl_kernel owns the namespace")
    for name in ("decode_attention_cpu", "extend_attention_cpu"):
        assert hasattr(torch.ops.sgl_kernel, name)
    assert cpu_ops.register_torch_ops() == []          # idempotent
    assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")   # SGLang keeps AMX GEMMs off


@pytest.mark.parametrize("D", [1, 2, 5, 8])
def test_reconstruct_indices_from_tree_mask_matches_sglang_host_links(seed, D):
    """Links equal SGLang's own host derivation (``ngram_worker._derive_tree_links``); positions
    are the verified length plus each node's depth."""
    from sglang.srt.speculative.ngram_worker import _derive_tree_links

    bs = 3
    parent = [[-1] + [int(torch.randint(0, i, ())) for i in range(1, D)] for _ in range(bs)]
    mask = torch.zeros(bs, D, D, dtype=torch.bool)
    depth = torch.zeros(bs, D, dtype=torch.int64)
    for b in range(bs):
        for i in range(D):
            j = i
            while j >= 0:          # self and every ancestor, as SGLang's NGRAM corpus writes it
                mask[b, i, j] = True
                j = parent[b][j]
            depth[b, i] = int(mask[b, i].sum()) - 1
    seq = torch.randint(5, 50, (bs,))
    pos = torch.empty(bs * D, dtype=torch.int64)
    idx, nxt, sib = (torch.full((bs, D), -7, dtype=torch.int64) for _ in range(3))
    cpu_ops.reconstruct_indices_from_tree_mask(mask.flatten(), seq, pos, idx, nxt, sib, bs, D)
    want_nxt, want_sib = _derive_tree_links(mask.numpy(), bs, D)
    assert torch.equal(nxt, want_nxt) and torch.equal(sib, want_sib)
    assert torch.equal(pos, (seq[:, None] + depth).flatten())
    assert torch.equal(idx, torch.arange(bs * D).view(bs, D))
