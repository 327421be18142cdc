"""sglang_glue/pool.py: OasisKVPool, SGLang's MHATokenToKVPool whose sparse layers keep no device
KV (built directly on the CPU; the engine attached as the backend hook does)."""

import pytest
import torch
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from oasis_sglang.config import OasisConfig
from oasis_sglang.core import OasisSparseKV
from oasis_sglang.sglang_glue.pool import OasisKVPool

BS, H, D, L, SIZE = 4, 2, 16, 3, 64
CFG = OasisConfig(budget_tokens=16, block_size=BS, dense_layers=(0,))


def _pool(cfg=CFG, attach=True, **kw):
    pool = OasisKVPool(size=SIZE, page_size=BS, dtype=torch.float32, head_num=H, head_dim=D, layer_num=L,
                       device="cpu", enable_memory_saver=False, oasis_cfg=cfg, **kw)
    if attach:
        pool.oasis = OasisSparseKV(cfg, L, pool.size + pool.page_size, 5, H, D, D, torch.float32, "cpu")
    return pool


def _layer(layer_id):
    return RadixAttention(num_heads=6, head_dim=D, scaling=D ** -0.5, num_kv_heads=H, layer_id=layer_id)


def test_dense_layers_keep_a_full_buffer_sparse_layers_a_one_page_placeholder():
    pool = _pool(attach=False)
    assert isinstance(pool, MHATokenToKVPool) and pool.oasis is None and pool.oasis_cfg is CFG
    assert [tuple(b.shape) for b in pool.k_buffer] == [(SIZE + BS, H, D), (BS, H, D), (BS, H, D)]
    assert [tuple(b.shape) for b in pool.v_buffer] == [(SIZE + BS, H, D), (BS, H, D), (BS, H, D)]
    assert all(b.dtype == torch.float32 and not b.any() for b in pool.k_buffer + pool.v_buffer)
    two = _pool(OasisConfig(budget_tokens=16, block_size=BS, dense_layers=(0, 2)), attach=False)
    assert [b.shape[0] for b in two.k_buffer] == [SIZE + BS, BS, SIZE + BS]


def test_a_sparse_layers_device_buffers_cannot_be_read():
    pool = _pool(attach=False)
    assert pool.get_key_buffer(0) is pool.k_buffer[0] and pool.get_value_buffer(0) is pool.v_buffer[0]
    k, v = pool.get_kv_buffer(0)
    assert k is pool.k_buffer[0] and v is pool.v_buffer[0]
    for layer_id in (1, 2):
        for read in (pool.get_key_buffer, pool.get_value_buffer, pool.get_kv_buffer):
            with pytest.raises(RuntimeError, match=f"layer {layer_id} is sparse; its KV lives in the host tier"):
                read(layer_id)


def test_a_sparse_layers_writes_go_to_the_host_tier(seed):
    pool = _pool()
    eng = pool.oasis
    loc = torch.tensor([8, 9, 10, 11, 37, 50, 3])        # page 2 whole, then single tokens
    k, v = torch.randn(7, H, D), torch.randn(7, H, D)
    placeholder = [b.clone() for b in pool.k_buffer[1:] + pool.v_buffer[1:]]
    pool.set_kv_buffer(_layer(2), loc, k, v)
    kh, vh = eng.host.read_tokens(eng.index[2], loc)
    assert torch.equal(kh, k) and torch.equal(vh, v)
    assert not eng.host.k[eng.index[1]].any() and not eng.host.v[eng.index[1]].any(), "only layer 2 was written"
    # the keys are folded into the block summaries too (page 2 is complete)
    li = eng.index[2]
    assert torch.equal(eng.summaries.kmin[li][2], k[:4].amin(0)) and torch.equal(eng.summaries.kmax[li][2], k[:4].amax(0))
    assert all(torch.equal(a, b) for a, b in zip(pool.k_buffer[1:] + pool.v_buffer[1:], placeholder)), \
        "the device placeholder is never written"
    assert not pool.k_buffer[0].any(), "nor the dense layer's buffer"
    # layer_id_override names the layer instead of the RadixAttention's own id
    pool.set_kv_buffer(_layer(2), torch.tensor([60]), k[:1], v[:1], layer_id_override=1)
    kh, _ = eng.host.read_tokens(eng.index[1], torch.tensor([60]))
    assert torch.equal(kh, k[:1])


def test_a_dense_layers_writes_are_sglangs(seed):
    pool = _pool()
    loc = torch.tensor([5, 6, 66])
    k, v = torch.randn(3, H, D), torch.randn(3, H, D)
    pool.set_kv_buffer(_layer(0), loc, k, v)
    assert torch.equal(pool.k_buffer[0][loc], k) and torch.equal(pool.v_buffer[0][loc], v)
    assert int((pool.k_buffer[0].abs().sum((1, 2)) > 0).sum()) == 3
    assert not any(t.any() for t in pool.oasis.host.k + pool.oasis.host.v), "the host tier holds sparse layers only"


def test_move_kv_cache_is_the_identity_or_refused(seed):
    pool = _pool()
    pool.set_kv_buffer(_layer(0), torch.arange(8), torch.randn(8, H, D), torch.randn(8, H, D))
    before = pool.k_buffer[0].clone(), pool.v_buffer[0].clone()
    assert pool.move_kv_cache(torch.tensor([3, 4]), torch.tensor([3, 4])) is None
    assert pool.move_kv_cache(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)) is None
    for tgt, src in ((torch.tensor([3, 5]), torch.tensor([3, 4])), (torch.tensor([3]), torch.tensor([3, 4]))):
        with pytest.raises(RuntimeError, match="a speculative draft was accepted"):
            pool.move_kv_cache(tgt, src)
    assert torch.equal(pool.k_buffer[0], before[0]) and torch.equal(pool.v_buffer[0], before[1]), "nothing moved"


def test_layouts_oasis_cannot_serve_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="quantized, post-capture and HND KV layouts are not supported"):
        _pool(attach=False, post_capture_active=True)
    monkeypatch.setenv("SGLANG_USE_HND_KVCACHE", "1")
    with pytest.raises(ValueError, match="quantized, post-capture and HND KV layouts"):
        _pool(attach=False)


def test_pd_transfer_regions_are_dense_kv_summaries_page_numbers_and_first_step_masks():
    """``get_contiguous_buf_infos`` (SGLang's PD transfer registers these and sends them page by
    page): K half = dense K, min summaries, page numbers, first-step mask; V half = dense V, max
    summaries, page numbers, first-step mask; every region has the same pages, the sparse
    placeholders are not advertised. The fp32 summaries cross in bf16 staging buffers; bf16
    summaries are sent as they are."""
    pool = _pool()
    eng = pool.oasis
    P = (SIZE + BS) // BS
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    smin, smax = pool.pd_summaries
    assert [t.shape for t in smin + smax] == [t.shape for t in eng.summaries.kmin + eng.summaries.kmax]
    assert all(t.dtype == torch.bfloat16 for t in smin + smax)
    k_half = [pool.k_buffer[0]] + smin + [pool.pd_page_ids[0], pool.pd_first_step[0]]
    v_half = [pool.v_buffer[0]] + smax + [pool.pd_page_ids[1], pool.pd_first_step[1]]
    assert ptrs == [t.data_ptr() for t in k_half + v_half]
    assert lens == [t.numel() * t.element_size() for t in k_half + v_half]
    assert items == [BS * H * D * 4, H * D * 2, H * D * 2, 8, 2 * (len(eng.sparse_layers) * H + 4)] * 2
    assert [n // i for n, i in zip(lens, items)] == [P] * 10
    assert torch.equal(pool.pd_page_ids[0], torch.arange(P)) and torch.equal(pool.pd_page_ids[1], torch.arange(P))
    assert all(not bool(t.any()) and t.dtype == torch.int16 for t in pool.pd_first_step)
    assert pool.pd_page_bytes == sum(items)
    assert all(p not in ptrs for p in (pool.k_buffer[1].data_ptr(), pool.v_buffer[2].data_ptr()))
    # a bf16 KV cache: the summaries are bf16 already and cross as they are
    bf = OasisKVPool(size=SIZE, page_size=BS, dtype=torch.bfloat16, head_num=H, head_dim=D, layer_num=L,
                     device="cpu", enable_memory_saver=False, oasis_cfg=CFG)
    bf.oasis = OasisSparseKV(CFG, L, bf.size + bf.page_size, 5, H, D, D, torch.bfloat16, "cpu")
    ptrs = bf.get_contiguous_buf_infos()[0]
    assert bf.pd_summaries is None
    assert ptrs[1:3] == [t.data_ptr() for t in bf.oasis.summaries.kmin]
    with pytest.raises(RuntimeError, match="need the OasisKV engine"):
        _pool(attach=False).get_contiguous_buf_infos()
