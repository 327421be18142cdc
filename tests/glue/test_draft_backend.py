"""sglang_glue/draft_backend.py: which layers the paired forward's paged attention may compute
(``paged_ok``, on SGLang's real RadixAttention), the paired paged attention itself over a real
MHATokenToKVPool, and OasisDraftBackend's dispatch."""

import pytest
import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType, RadixAttention
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

from oasis_sglang.core.ops import TorchKVOps
from oasis_sglang.sglang_glue.draft_backend import OasisDraftBackend, adopt_draft_backend, paged_ok, paired_paged_attention

H, HQ, D = 2, 6, 16


def _layer(layer_id=0, **kw):
    return RadixAttention(num_heads=HQ, head_dim=D, scaling=D ** -0.5, num_kv_heads=H, layer_id=layer_id, **kw)


def test_a_plain_decoder_layer_is_paged_ok():
    layer = _layer()
    assert layer.attn_type is AttentionType.DECODER
    assert paged_ok(layer, {}) is True
    assert paged_ok(layer, {"sinks": None, "score_mod": None, "aux_tensors": None}) is True, "None = not given"


@pytest.mark.parametrize("kw,why", [
    (dict(logit_cap=30.0), "logit cap"),
    (dict(sliding_window_size=128), "sliding window"),
    (dict(is_cross_attention=True), "cross attention"),
    (dict(use_irope=True), "iRoPE"),
    (dict(attn_type=AttentionType.ENCODER_ONLY), "not a causal decoder"),
])
def test_layers_paged_attention_cannot_compute_are_refused(kw, why):
    assert paged_ok(_layer(**kw), {}) is False, why


def test_quantized_or_temperature_scaled_layers_are_refused():
    layer = _layer()
    layer.k_scale = torch.tensor(0.5)
    assert paged_ok(layer, {}) is False
    layer = _layer()
    layer.xai_temperature_len = 1024
    assert paged_ok(layer, {}) is False


@pytest.mark.parametrize("kwargs", [{"sinks": torch.zeros(HQ)}, {"score_mod": lambda s: s},
                                    {"aux_tensors": [torch.zeros(1)]}, {"q_rope": torch.zeros(1)}])
def test_extra_inputs_are_refused(kwargs):
    assert paged_ok(_layer(), kwargs) is False


class _Setup:
    """Two requests in a real token pool: rows 1 and 2 of the request table, ``n`` tokens each
    already cached, and two new tokens each (the normal one and the draft)."""

    def __init__(self, n=(5, 9)):
        self.pool = MHATokenToKVPool(size=64, page_size=1, dtype=torch.float32, head_num=H, head_dim=D,
                                     layer_num=1, device="cpu", enable_memory_saver=False)
        self.rtp = ReqToTokenPool(size=2, max_context_len=16, device="cpu", enable_memory_saver=False)
        self.layer = _layer()
        self.n = n
        locs = torch.randperm(63)[: sum(n) + 4] + 1
        self.ctx = {}
        start = 0
        for row, m in zip((1, 2), n):
            self.ctx[row] = locs[start:start + m + 2]
            self.rtp.req_to_token[row, : m + 2] = self.ctx[row].to(torch.int32)
            self.pool.set_kv_buffer(self.layer, self.ctx[row][:m], torch.randn(m, H, D), torch.randn(m, H, D))
            start += m + 2
        self.out_loc = torch.stack([self.ctx[1][n[0]:], self.ctx[2][n[1]:]]).reshape(-1)   # [2B]

    def batch(self, mode, seq_lens):
        return ForwardBatch(forward_mode=mode, batch_size=2, input_ids=torch.zeros(4, dtype=torch.long),
                            req_pool_indices=torch.tensor([1, 2]), seq_lens=torch.tensor(seq_lens),
                            out_cache_loc=self.out_loc, seq_lens_sum=sum(seq_lens),
                            seq_lens_cpu=torch.tensor(seq_lens))

    def reference(self, q):
        """Causal attention of each request's two new rows over the pool (GQA, 3 query heads per KV head)."""
        out = torch.empty(4, HQ, D)
        kb, vb = self.pool.k_buffer[0], self.pool.v_buffer[0]
        for b, row in enumerate((1, 2)):
            for i in range(2):
                loc = self.ctx[row][: self.n[b] + 1 + i]
                for h in range(HQ):
                    p = torch.softmax(kb[loc, h // 3] @ q.view(4, HQ, D)[2 * b + i, h] * D ** -0.5, 0)
                    out[2 * b + i, h] = p @ vb[loc, h // 3]
        return out.view(4, HQ * D)


@pytest.mark.parametrize("mode,extra", [(ForwardMode.DRAFT_EXTEND_V2, 0), (ForwardMode.TARGET_VERIFY, 2)])
def test_paired_paged_attention_is_causal_attention_of_both_tokens(seed, mode, extra):
    """DRAFT_EXTEND_V2: ``seq_lens`` counts the 2 new tokens; TARGET_VERIFY: it does not (+2)."""
    s = _Setup()
    q, k, v = torch.randn(4, HQ * D), torch.randn(4, H * D), torch.randn(4, H * D)
    fb = s.batch(mode, [m + 2 - extra for m in s.n])
    o = paired_paged_attention(TorchKVOps(), s.pool, s.rtp.req_to_token, q, k, v, s.layer, fb, True, extra)
    assert torch.equal(s.pool.k_buffer[0][s.out_loc], k.view(4, H, D)), "the new tokens' K/V are written first"
    assert torch.equal(s.pool.v_buffer[0][s.out_loc], v.view(4, H, D))
    assert o.shape == (4, HQ * D)
    torch.testing.assert_close(o, s.reference(q), rtol=1e-5, atol=1e-5)


def test_paired_paged_attention_refuses_other_batches(seed):
    s = _Setup()
    fb = s.batch(ForwardMode.DRAFT_EXTEND_V2, [7, 11])
    q, k = torch.randn(4, HQ * D), torch.randn(4, H * D)
    with pytest.raises(RuntimeError, match="2 tokens per request, got 3 for 2 requests"):
        paired_paged_attention(TorchKVOps(), s.pool, s.rtp.req_to_token, q[:3], k[:3], k[:3], s.layer, fb, True, 0)
    with pytest.raises(RuntimeError, match="KV sharing"):
        paired_paged_attention(TorchKVOps(), s.pool, s.rtp.req_to_token, q, None, None, s.layer, fb, True, 0)
    before = s.pool.k_buffer[0].clone()
    o = paired_paged_attention(TorchKVOps(), s.pool, s.rtp.req_to_token, q, None, None, s.layer, fb, False, 0)
    assert o.shape == (4, HQ * D) and torch.equal(s.pool.k_buffer[0], before), "save_kv_cache=False writes nothing"


class _Inner(AttentionBackend):
    """The draft worker's own backend (an input here): records what reaches it."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        self.calls.append((forward_batch.forward_mode, layer.layer_id, save_kv_cache, sorted(kwargs)))
        return "inner"


def test_draft_backend_runs_paged_attention_only_for_plain_draft_extend(seed):
    s = _Setup()
    inner = _Inner()
    be = adopt_draft_backend(inner, TorchKVOps(), s.pool, s.rtp)
    assert be is inner and isinstance(be, OasisDraftBackend), "the backend SGLang built, adopted in place"
    assert isinstance(be, _Inner) and type(be).__name__ == "OasisDraft_Inner", \
        "still an instance of its own class: SGLang captures draft-extend graphs only for its listed classes"
    assert adopt_draft_backend(be, TorchKVOps(), s.pool, s.rtp) is be and type(be).__mro__.count(OasisDraftBackend) == 1
    assert type(adopt_draft_backend(_Inner(), TorchKVOps(), s.pool, s.rtp)) is type(be), "one subclass per class"
    assert adopt_draft_backend(None, TorchKVOps(), s.pool, s.rtp) is None
    q, k, v = torch.randn(4, HQ * D), torch.randn(4, H * D), torch.randn(4, H * D)
    fb = s.batch(ForwardMode.DRAFT_EXTEND_V2, [m + 2 for m in s.n])
    o = be.forward_extend(q, k, v, s.layer, fb)
    torch.testing.assert_close(o, s.reference(q), rtol=1e-5, atol=1e-5)
    assert inner.calls == []
    capped = _layer(logit_cap=30.0)
    assert be.forward_extend(q, k, v, capped, fb) == "inner"
    assert be.forward_extend(q, k, v, s.layer, fb, sinks=torch.zeros(HQ)) == "inner"
    assert be.forward_extend(q, k, v, s.layer, s.batch(ForwardMode.EXTEND, list(s.n)), save_kv_cache=False) == "inner"
    assert inner.calls == [(ForwardMode.DRAFT_EXTEND_V2, 0, True, []), (ForwardMode.DRAFT_EXTEND_V2, 0, True, ["sinks"]),
                           (ForwardMode.EXTEND, 0, False, [])]
