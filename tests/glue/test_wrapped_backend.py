"""sglang_glue/wrapped_backend.py: WrappedBackend answers for the backend it wraps.

Two inner backends: a recording subclass of SGLang's AttentionBackend defined here (it shows
which member was reached, with which arguments), and SGLang's real TorchNativeAttnBackend over
real pools on the CPU."""

import pytest
import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

from oasis_sglang.sglang_glue.wrapped_backend import WrappedBackend

# every AttentionBackend method and property the wrapper must pass through to the inner backend
DELEGATED_METHODS = ("init_forward_metadata_out_graph", "init_forward_metadata_in_graph",
                     "draft_extend_metadata_captured_in_graph", "prepare_full_cuda_graph_chunked_prefix",
                     "init_cuda_graph_state", "init_forward_metadata_for_breakable_cuda_graph_capture",
                     "prepare_forward_metadata_for_breakable_cuda_graph_replay", "get_cuda_graph_seq_len_fill_value",
                     "on_after_cuda_graph_warmup", "update_verify_buffers_to_fill_after_draft", "get_indexer_metadata")
# methods the wrapper defines itself (delegating them explicitly)
OWN_METHODS = ("init_forward_metadata", "support_triton", "forward_decode", "forward_extend")
# AttentionBackend's own dispatchers, kept so they reach the wrapper's forward_decode / forward_extend
DISPATCHERS = ("forward", "forward_mixed")


class Recorder(AttentionBackend):
    """An inner backend that records every call and answers with its name."""

    supports_ragged_verify_graph = True
    use_captured_forward_metadata_for_breakable_cuda_graph = True
    supports_full_cuda_graph_chunked_prefix = True
    prefill_attention_backend_str = "recorder-prefill"
    needs_cpu_seq_lens = False

    def __init__(self):
        super().__init__()
        self.calls = []
        self.forward_metadata = "inner metadata"

    @property
    def verify_mask(self):
        return "inner verify mask"

    def only_on_the_inner(self, x):
        return ("only_on_the_inner", x)


for _name in DELEGATED_METHODS + OWN_METHODS:
    def _method(self, *args, _name=_name, **kwargs):
        self.calls.append((_name, args, kwargs))
        return _name
    setattr(Recorder, _name, _method)


def test_the_members_listed_here_are_all_of_sglangs_attention_backend():
    """If SGLang adds a member to AttentionBackend, this list (and the wrapper) must be reviewed."""
    methods = {n for n, v in vars(AttentionBackend).items()
               if not n.startswith("_") and callable(v) and not isinstance(v, type)}
    assert methods == set(DELEGATED_METHODS) | set(OWN_METHODS) | set(DISPATCHERS)
    assert isinstance(vars(AttentionBackend)["verify_mask"], property)


def test_a_wrapper_is_an_attention_backend():
    w = WrappedBackend(Recorder())
    assert isinstance(w, AttentionBackend) and isinstance(w.inner, Recorder)


@pytest.mark.parametrize("name", DELEGATED_METHODS + OWN_METHODS)
def test_every_method_reaches_the_inner_backend_with_its_arguments(name):
    inner = Recorder()
    w = WrappedBackend(inner)
    args = ("q", "k", "v", "layer", "fb") if name in ("forward_decode", "forward_extend") else \
        () if name == "support_triton" else ("fb",)
    kwargs = {"in_capture": True} if name == "init_forward_metadata_out_graph" else {}
    assert getattr(w, name)(*args, **kwargs) == name
    if name in ("forward_decode", "forward_extend"):
        kwargs = {"save_kv_cache": True}
    assert inner.calls == [(name, args, kwargs)]


def test_named_graph_hooks_and_the_verify_mask_are_the_inner_backends():
    inner = Recorder()
    w = WrappedBackend(inner)
    assert w.init_forward_metadata_in_graph("fb") == "init_forward_metadata_in_graph"
    assert w.get_cuda_graph_seq_len_fill_value() == "get_cuda_graph_seq_len_fill_value"
    assert w.init_cuda_graph_state(8, 16) == "init_cuda_graph_state"
    assert [c[0] for c in inner.calls] == ["init_forward_metadata_in_graph", "get_cuda_graph_seq_len_fill_value",
                                           "init_cuda_graph_state"]
    assert inner.calls[2][1] == (8, 16)
    assert w.verify_mask == "inner verify mask"
    assert WrappedBackend(AttentionBackend()).verify_mask is None, "the inner backend's (AttentionBackend's default)"


def test_forward_dispatches_to_the_wrappers_decode_and_extend_and_forwards_kwargs():
    inner = Recorder()
    w = WrappedBackend(inner)

    def batch(mode):
        return ForwardBatch(forward_mode=mode, batch_size=1, input_ids=torch.zeros(1, dtype=torch.long),
                            req_pool_indices=torch.tensor([1]), seq_lens=torch.tensor([3]),
                            out_cache_loc=torch.tensor([2]), seq_lens_sum=3)

    fb = batch(ForwardMode.DECODE)
    assert w.forward("q", "k", "v", "layer", fb, save_kv_cache=False, sinks=None) == "forward_decode"
    assert inner.calls[-1] == ("forward_decode", ("q", "k", "v", "layer", fb), {"save_kv_cache": False, "sinks": None})
    for mode in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY):   # (MIXED: off NPU)
        fb = batch(mode)
        assert w.forward("q", "k", "v", "layer", fb) == "forward_extend"
        assert inner.calls[-1] == ("forward_extend", ("q", "k", "v", "layer", fb), {"save_kv_cache": True})


def test_plain_attributes_are_copied_and_unknown_ones_come_from_the_inner_backend():
    inner = Recorder()
    w = WrappedBackend(inner)
    assert w.supports_ragged_verify_graph and w.use_captured_forward_metadata_for_breakable_cuda_graph
    assert w.supports_full_cuda_graph_chunked_prefix and w.prefill_attention_backend_str == "recorder-prefill"
    assert w.decode_attention_backend_str is None
    assert w.needs_cpu_seq_lens is True, "the wrappers read SGLang's host copy of the lengths"
    assert w.forward_metadata == "inner metadata" and w.only_on_the_inner(3) == ("only_on_the_inner", 3)
    inner.forward_metadata = "changed"
    assert w.forward_metadata == "changed", "read at access time, not copied"
    with pytest.raises(AttributeError, match="no_such_member"):
        w.no_such_member
    assert WrappedBackend(AttentionBackend()).supports_ragged_verify_graph is False


def test_a_real_sglang_backend_behind_the_wrapper(seed):
    """SGLang's torch_native backend over real pools: the wrapper's decode writes the KV and
    returns what the backend itself computes; members and attributes are the backend's."""
    H, D = 2, 16
    pool = MHATokenToKVPool(size=32, page_size=1, dtype=torch.float32, head_num=H, head_dim=D, layer_num=1,
                            device="cpu", enable_memory_saver=False)
    rtp = ReqToTokenPool(size=2, max_context_len=16, device="cpu", enable_memory_saver=False)

    class Runner:                                           # what TorchNativeAttnBackend reads of a ModelRunner
        device, req_to_token_pool, token_to_kv_pool = "cpu", rtp, pool

    inner = TorchNativeAttnBackend(Runner())
    w = WrappedBackend(inner)
    assert w.req_to_token_pool is rtp and w.token_to_kv_pool is pool and w.device == "cpu"
    assert w.support_triton() is False
    with pytest.raises(NotImplementedError):
        w.get_cuda_graph_seq_len_fill_value()                # the backend's own answer: it has none
    layer = RadixAttention(num_heads=6, head_dim=D, scaling=D ** -0.5, num_kv_heads=H, layer_id=0)
    rtp.req_to_token[1, :5] = torch.arange(1, 6, dtype=torch.int32)
    pool.set_kv_buffer(layer, torch.arange(1, 5), torch.randn(4, H, D), torch.randn(4, H, D))
    fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=1, input_ids=torch.zeros(1, dtype=torch.long),
                      req_pool_indices=torch.tensor([1]), seq_lens=torch.tensor([5]), out_cache_loc=torch.tensor([5]),
                      seq_lens_sum=5, seq_lens_cpu=torch.tensor([5]))
    w.init_forward_metadata(fb)
    q, k, v = torch.randn(1, 6 * D), torch.randn(1, H, D), torch.randn(1, H, D)      # as RadixAttention passes them
    out = w.forward(q, k, v, layer, fb)
    assert torch.equal(pool.k_buffer[0][5], k[0]) and torch.equal(pool.v_buffer[0][5], v[0])
    ref = inner.forward_decode(q, k, v, layer, fb, save_kv_cache=False)
    assert out.shape == (1, 6 * D) and torch.equal(out, ref)
    # and against plain attention over the 5 tokens (GQA: 3 query heads per KV head)
    kk, vv = pool.k_buffer[0][1:6], pool.v_buffer[0][1:6]
    for hq in range(6):
        p = torch.softmax(kk[:, hq // 3] @ q.view(6, D)[hq] * D ** -0.5, 0)
        torch.testing.assert_close(out.view(6, D)[hq], p @ vv[:, hq // 3], rtol=1e-5, atol=1e-5)
